//! Kernels of the model's operations, llm.c style: each operation is a forward kernel and a
//! backward kernel over views plus sizes. Tensors are row-major; "rows" are tokens.
//!
//! Conventions, so the model can chain kernels without extra copies:
//! - backward kernels ACCUMULATE (`+=`) into weight gradients (`dw`) and into gradients that
//!   flow into the residual stream where noted; other outputs are overwritten;
//! - integer data (token ids, routing indices) is host memory (`&[u32]`); a GPU backend uploads
//!   it. Routing decisions and per-expert sums come back to the host because the model needs
//!   them to size the per-expert GEMMs.

use crate::backend::Gemm;
use crate::tensor::{View, ViewMut};

#[allow(clippy::too_many_arguments)]
pub trait NnOps: Send + Sync {
    /// Independent GEMMs in one call (the routed experts' GEMMs over their tokens): each
    /// `(shape, a_offset, b_offset, c_offset)` computes, on the views starting at those element
    /// offsets, what [`crate::Blas::gemm`] would. Output blocks must not overlap.
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]);

    /// `out[t] = wte[ids[t]]`, rows of `dim`.
    fn embedding_forward(&self, out: ViewMut, wte: View, ids: &[u32], dim: usize);
    /// `dwte[ids[t]] += dout[t]`.
    fn embedding_backward(&self, dwte: ViewMut, dout: View, ids: &[u32], dim: usize);

    /// RMSNorm of rows of `dim`: `out = w * x * rstd`, `rstd = 1/sqrt(mean(x²) + eps)` (saved).
    fn rmsnorm_forward(&self, out: ViewMut, rstd: ViewMut, x: View, w: View, dim: usize, eps: f32);
    /// `dx += ∂/∂x`, `dw += ∂/∂w`.
    fn rmsnorm_backward(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        x: View,
        w: View,
        rstd: View,
        dim: usize,
    );

    /// Per-head RMSNorm (weight `w` of `head_dim`) followed by rotate-half RoPE, on rows of
    /// `heads * head_dim`. Row `r` is at position `pos0 + r % seq`; `rstd` is `[rows, heads]`.
    fn head_norm_rope_forward(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        x: View,
        w: View,
        heads: usize,
        head_dim: usize,
        seq: usize,
        pos0: usize,
        theta: f64,
        eps: f32,
    );
    /// `dx` overwritten, `dw += ∂/∂w`.
    fn head_norm_rope_backward(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        x: View,
        w: View,
        rstd: View,
        heads: usize,
        head_dim: usize,
        seq: usize,
        pos0: usize,
        theta: f64,
    );

    /// Causal grouped-query attention with scale `1/sqrt(head_dim)`. `q`, `out`:
    /// `[batch, tq, heads, head_dim]`; `k`, `v`: `[batch, tk, kv_heads, head_dim]`, `tk >= tq`,
    /// query `i` sitting at key position `tk - tq + i`. Saves the log-sum-exp of each score row,
    /// `lse: [batch, heads, tq]`, so backward recomputes probabilities without storing them.
    fn attention_forward(
        &self,
        out: ViewMut,
        lse: ViewMut,
        q: View,
        k: View,
        v: View,
        batch: usize,
        tq: usize,
        tk: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    );
    /// `dq`, `dk`, `dv` overwritten.
    fn attention_backward(
        &self,
        dq: ViewMut,
        dk: ViewMut,
        dv: ViewMut,
        dout: View,
        out: View,
        q: View,
        k: View,
        v: View,
        lse: View,
        batch: usize,
        tq: usize,
        tk: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    );

    /// `out = silu(gate) * up`, elementwise.
    fn swiglu_forward(&self, out: ViewMut, gate: View, up: View);
    /// `dgate`, `dup` overwritten.
    fn swiglu_backward(&self, dgate: ViewMut, dup: ViewMut, dout: View, gate: View, up: View);

    /// Router: `probs = softmax(logits)` over `experts` per row; select the top `k` of
    /// `probs + bias` (ties: lower index first) into `idx` (`[rows, k]`, best first), with
    /// weights `probs[idx]`, renormalised to sum to one if `renorm`. `psum[e]` is set to the sum
    /// over rows of `probs[:, e]` (for the auxiliary loss).
    fn router_forward(
        &self,
        probs: ViewMut,
        weights: ViewMut,
        idx: &mut [u32],
        psum: &mut [f64],
        logits: View,
        bias: Option<View>,
        experts: usize,
        k: usize,
        renorm: bool,
    );
    /// `dlogits` (overwritten) from the gradient of the weights and a per-expert constant added
    /// to every row's probability gradient (`dprob_const`, from the auxiliary loss).
    fn router_backward(
        &self,
        dlogits: ViewMut,
        dweights: View,
        probs: View,
        idx: &[u32],
        dprob_const: &[f64],
        experts: usize,
        k: usize,
        renorm: bool,
    );

    /// Dispatch: `xe[i] = x[src[i]]`.
    fn moe_gather(&self, xe: ViewMut, x: View, src: &[u32], dim: usize);
    /// `dx[t] += Σ_j dxe[pos[t*k + j]]` (`pos`: where token `t`'s `j`-th choice was dispatched).
    fn moe_gather_backward(&self, dx: ViewMut, dxe: View, pos: &[u32], k: usize, dim: usize);
    /// Combine: `out[t] += Σ_j w[t*k + j] * ye[pos[t*k + j]]`.
    fn moe_combine(&self, out: ViewMut, ye: View, w: View, pos: &[u32], k: usize, dim: usize);
    /// `dye` and `dw` overwritten.
    fn moe_combine_backward(
        &self,
        dye: ViewMut,
        dw: ViewMut,
        dout: View,
        ye: View,
        w: View,
        pos: &[u32],
        k: usize,
        dim: usize,
    );

    /// Softmax cross-entropy of rows of `vocab` logits against `targets`; saves each row's
    /// log-sum-exp and returns the SUM of the losses.
    fn cross_entropy_forward(
        &self,
        lse: ViewMut,
        logits: View,
        targets: &[u32],
        vocab: usize,
    ) -> f64;
    /// In place: `logits` becomes `scale * (softmax(logits) - onehot(target))`.
    fn cross_entropy_backward(
        &self,
        logits: ViewMut,
        lse: View,
        targets: &[u32],
        vocab: usize,
        scale: f32,
    );
}

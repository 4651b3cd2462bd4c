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
use crate::tensor::{TMut, T};

#[allow(clippy::too_many_arguments)]
pub trait NnOps: Send + Sync {
    /// Independent GEMMs in one call (the routed experts' GEMMs over their tokens): each
    /// `(shape, a_offset, b_offset, c_offset)` computes, on the views starting at those element
    /// offsets, what [`crate::Blas::gemm`] would. Output blocks must not overlap.
    fn gemm_grouped(&self, c: TMut, a: T, b: T, groups: &[(Gemm, usize, usize, usize)]);

    /// `out[t] = wte[ids[t]]`, rows of `dim`.
    fn embedding_forward(&self, out: TMut, wte: T, ids: &[u32], dim: usize);
    /// `dwte[ids[t]] += dout[t]`.
    fn embedding_backward(&self, dwte: TMut, dout: T, ids: &[u32], dim: usize);

    /// RMSNorm of rows of `dim`: `out = w * x * rstd`, `rstd = 1/sqrt(mean(x²) + eps)` (saved).
    fn rmsnorm_forward(&self, out: TMut, rstd: TMut, x: T, w: T, dim: usize, eps: f32);
    /// `dx += ∂/∂x`, `dw += ∂/∂w`.
    fn rmsnorm_backward(&self, dx: TMut, dw: TMut, dout: T, x: T, w: T, rstd: T, dim: usize);

    /// Per-head RMSNorm (weight `w` of `head_dim`) followed by rotate-half RoPE, on rows of
    /// `heads * head_dim`. Row `r` is at position `pos0 + r % seq`; `rstd` is `[rows, heads]`.
    fn head_norm_rope_forward(
        &self,
        out: TMut,
        rstd: TMut,
        x: T,
        w: T,
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
        dx: TMut,
        dw: TMut,
        dout: T,
        x: T,
        w: T,
        rstd: T,
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
        out: TMut,
        lse: TMut,
        q: T,
        k: T,
        v: T,
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
        dq: TMut,
        dk: TMut,
        dv: TMut,
        dout: T,
        out: T,
        q: T,
        k: T,
        v: T,
        lse: T,
        batch: usize,
        tq: usize,
        tk: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    );

    /// `out = silu(gate) * up`, elementwise.
    fn swiglu_forward(&self, out: TMut, gate: T, up: T);
    /// `dgate`, `dup` overwritten.
    fn swiglu_backward(&self, dgate: TMut, dup: TMut, dout: T, gate: T, up: T);

    /// Router: `probs = softmax(logits)` over `experts` per row; select the top `k` of
    /// `probs + bias` (ties: lower index first) into `idx` (`[rows, k]`, best first), with
    /// weights `probs[idx]`, renormalised to sum to one if `renorm`. `psum[e]` is set to the sum
    /// over rows of `probs[:, e]` (for the auxiliary loss).
    fn router_forward(
        &self,
        probs: TMut,
        weights: TMut,
        idx: &mut [u32],
        psum: &mut [f64],
        logits: T,
        bias: Option<T>,
        experts: usize,
        k: usize,
        renorm: bool,
    );
    /// `dlogits` (overwritten) from the gradient of the weights and a per-expert constant added
    /// to every row's probability gradient (`dprob_const`, from the auxiliary loss).
    fn router_backward(
        &self,
        dlogits: TMut,
        dweights: T,
        probs: T,
        idx: &[u32],
        dprob_const: &[f64],
        experts: usize,
        k: usize,
        renorm: bool,
    );

    /// Dispatch: `xe[i] = x[src[i]]`.
    fn moe_gather(&self, xe: TMut, x: T, src: &[u32], dim: usize);
    /// `dx[t] += Σ_j dxe[pos[t*k + j]]` (`pos`: where token `t`'s `j`-th choice was dispatched).
    fn moe_gather_backward(&self, dx: TMut, dxe: T, pos: &[u32], k: usize, dim: usize);
    /// Combine: `out[t] += Σ_j w[t*k + j] * ye[pos[t*k + j]]`.
    fn moe_combine(&self, out: TMut, ye: T, w: T, pos: &[u32], k: usize, dim: usize);
    /// `dye` and `dw` overwritten.
    fn moe_combine_backward(
        &self,
        dye: TMut,
        dw: TMut,
        dout: T,
        ye: T,
        w: T,
        pos: &[u32],
        k: usize,
        dim: usize,
    );

    /// Softmax cross-entropy of rows of `vocab` logits against `targets`; saves each row's
    /// log-sum-exp and returns the SUM of the losses.
    fn cross_entropy_forward(&self, lse: TMut, logits: T, targets: &[u32], vocab: usize) -> f64;
    /// In place: `logits` becomes `scale * (softmax(logits) - onehot(target))`.
    fn cross_entropy_backward(
        &self,
        logits: TMut,
        lse: T,
        targets: &[u32],
        vocab: usize,
        scale: f32,
    );
}

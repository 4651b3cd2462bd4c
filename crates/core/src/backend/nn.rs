//! Kernels of the model's operations, llm.c style: each operation is a forward kernel and a
//! backward kernel over views plus sizes. Tensors are row-major; "rows" are tokens.
//!
//! Conventions, so the model can chain kernels without extra copies:
//! - backward kernels ACCUMULATE (`+=`) into weight gradients (`dw`) and into gradients that
//!   flow into the residual stream where noted; other outputs are overwritten;
//! - integer data (token ids, targets, routing indices) are u32 tensors ([`crate::DType::U32`])
//!   in the backend's memory, like everything else a kernel reads: a step uploads its tokens
//!   once and routing stays on the device. A MoE layer's per-expert counts stay there too on a
//!   backend whose [`NnOps::gemm_experts`] reads them there ([`NnOps::experts_on_device`]);
//!   otherwise, and for the expert-parallel all-to-all, the model downloads them after
//!   [`NnOps::moe_dispatch`] (cuBLAS's grouped GEMM and NCCL take their sizes from the host).

use crate::backend::Gemm;
use crate::tensor::{View, ViewMut};

/// What a norm's backward reads: the norm's input, its weight and the saved `1/rms` per row.
#[derive(Clone, Copy)]
pub struct NormSaved<'a> {
    pub x: View<'a>,
    pub w: View<'a>,
    pub rstd: View<'a>,
}

/// Sizes of a per-head RMSNorm followed by RoPE: rows of `heads × head_dim`, row `r` at
/// position `pos0 + r % seq`, rotary base `theta`.
#[derive(Clone, Copy, Debug)]
pub struct HeadRope {
    pub heads: usize,
    pub head_dim: usize,
    pub seq: usize,
    pub pos0: usize,
    pub theta: f64,
    pub eps: f32,
}

/// Sizes of causal grouped-query attention (llm.c's B, T, NH, HS as one value): `tq` queries
/// against `tk >= tq` keys per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub batch: usize,
    pub tq: usize,
    pub tk: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// What attention's backward reads: its output, inputs and the log-sum-exp of each score row.
#[derive(Clone, Copy)]
pub struct AttnSaved<'a> {
    pub out: View<'a>,
    pub q: View<'a>,
    pub k: View<'a>,
    pub v: View<'a>,
    pub lse: View<'a>,
}

/// Attention's input gradients (overwritten).
pub struct AttnGrads<'a> {
    pub dq: ViewMut<'a>,
    pub dk: ViewMut<'a>,
    pub dv: ViewMut<'a>,
}

/// A router's choice: `k` of `experts` per row, weights renormalised to one if `renorm`.
#[derive(Clone, Copy, Debug)]
pub struct RouterDims {
    pub experts: usize,
    pub k: usize,
    pub renorm: bool,
}

/// What the router's forward writes: `[rows, experts]` probabilities, `[rows, k]` weights and
/// chosen experts (best first, u32), and the per-expert sum of probabilities over rows (f64).
pub struct RouterOut<'a> {
    pub probs: ViewMut<'a>,
    pub weights: ViewMut<'a>,
    pub idx: ViewMut<'a>,
    pub psum: ViewMut<'a>,
}

/// What [`NnOps::moe_dispatch`] writes, all u32: `[E]` rows per expert, `[E+1]` first row of
/// each expert, and for the `[n*k]` dispatched rows the token each came from (`src`) and, per
/// (token, choice), the row it went to (`pos`).
/// `totals` (f64 `[E]`), where given, has each count ADDED to it: a layer's counts summed over
/// its token chunks, kept on the device for the auxiliary loss.
pub struct DispatchOut<'a> {
    pub counts: ViewMut<'a>,
    pub offsets: ViewMut<'a>,
    pub src: ViewMut<'a>,
    pub pos: ViewMut<'a>,
    pub totals: Option<ViewMut<'a>>,
}

/// The auxiliary loss's gradient with respect to each router probability, the same for every
/// row: `coef · counts[e] / tokens` for expert `e`, computed in f64 from the layer's global
/// per-expert counts (`[E]` f64 on the device, [`DispatchOut::totals`] summed over ranks).
#[derive(Clone, Copy)]
pub struct AuxGrad<'a> {
    pub counts: View<'a>,
    pub coef: f64,
    pub tokens: f64,
}

impl AuxGrad<'_> {
    /// Expert `e`'s constant given its count: the one formula, for every backend.
    pub fn at(&self, count: f64) -> f64 {
        self.coef * count / self.tokens
    }
}

/// Where a grouped expert GEMM finds its experts' rows: `offsets[e]..offsets[e + 1]` are
/// expert `e`'s dispatched rows, on the host or (u32 `[E + 1]`) in the backend's memory, as
/// [`NnOps::moe_dispatch`] wrote them.
#[derive(Clone, Copy)]
pub enum ExpertRows<'a> {
    Host(&'a [usize]),
    /// `rows` bounds the dispatched rows (`offsets[E]`): what the operands' views hold.
    Device {
        offsets: View<'a>,
        rows: usize,
    },
}

/// Which dimension of an expert's GEMM is its routed rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    /// `m`: a product over the expert's rows (forward, input gradients).
    M,
    /// `k`: a sum over them (the weight gradients).
    K,
}

/// One GEMM per expert over its routed rows (see [`ExpertRows`]). Expert `e` with rows
/// `r0..r0 + c` runs `gemm` with the routed dimension set to `c`, on A, B and C from the
/// element offsets `r0 · per_row + e · per_expert` (`a`, `b`, `c`, each `[per_row,
/// per_expert]`). Leading dimensions, transposes, alpha, beta and the bf16 flags are
/// `gemm`'s, and must not depend on the routed dimension.
#[derive(Clone, Copy, Debug)]
pub struct ExpertGemm {
    pub gemm: Gemm,
    pub routed: Routed,
    pub a: [usize; 2],
    pub b: [usize; 2],
    pub c: [usize; 2],
}

impl ExpertGemm {
    /// Expert `e`'s GEMM over `rows` from `r0`, as [`NnOps::gemm_grouped`] takes it.
    pub fn at(&self, e: usize, r0: usize, rows: usize) -> (Gemm, usize, usize, usize) {
        let mut g = self.gemm;
        match self.routed {
            Routed::M => g.m = rows,
            Routed::K => g.k = rows,
        }
        let off = |[row, ex]: [usize; 2]| r0 * row + e * ex;
        (g, off(self.a), off(self.b), off(self.c))
    }

    /// The groups, from host offsets: every expert with rows, and one routed on `k` without
    /// rows where beta is not one (its `C = beta · C`, the empty sum's).
    pub fn groups(&self, offsets: &[usize]) -> Vec<(Gemm, usize, usize, usize)> {
        let keep_empty = self.routed == Routed::K && self.gemm.beta != 1.0;
        offsets
            .windows(2)
            .enumerate()
            .filter(|(_, w)| w[1] > w[0] || keep_empty)
            .map(|(e, w)| self.at(e, w[0], w[1] - w[0]))
            .collect()
    }

    /// The same GEMMs with `f` applied to the shape (a promise of `Gemm::unchanged`, a beta).
    pub fn with(mut self, f: impl Fn(Gemm) -> Gemm) -> Self {
        self.gemm = f(self.gemm);
        self
    }
}

/// Where each (token, choice) went in the dispatched layout: `pos[t*k + j]` (u32) is the row of
/// token `t`'s `j`-th choice; rows of `dim`.
#[derive(Clone, Copy)]
pub struct Dispatched<'a> {
    pub pos: View<'a>,
    pub k: usize,
    pub dim: usize,
}

/// A step's token ids with their grouping by id, both uploaded by the host with the batch
/// ([`embedding_segments`] of the same ids), so that a backend can add the embedding gradient
/// one id at a time, deterministically, without reading the ids back. All u32.
#[derive(Clone, Copy)]
pub struct EmbedIds<'a> {
    /// `[n]`: the token ids.
    pub ids: View<'a>,
    /// At least `[n]`: the tokens sorted by id, stably.
    pub order: View<'a>,
    /// At least `[n + 1]`: segment `s` is `order[seg_start[s]..seg_start[s + 1]]`, and past
    /// the last segment it holds `n` (empty segments), so that a kernel may take segments up to
    /// `n` without knowing how many there are (its launch the same for every batch).
    pub seg_start: View<'a>,
    /// At least `[segments]`: the id of segment `s`.
    pub seg_id: View<'a>,
    /// The number of distinct ids (0 when there are no tokens).
    pub segments: usize,
}

/// The grouping [`EmbedIds`] carries, computed on the host from the ids the host uploads:
/// `(order, seg_start, seg_id)` — `order` lists the tokens sorted by id, stably (ties in token
/// order), and segment `s` is `order[seg_start[s]..seg_start[s + 1]]`, all of id `seg_id[s]`.
/// `seg_start` has `n + 1` entries whatever the number of segments: past the last it holds `n`
/// (empty segments). The one definition of it (the batch builder and the tests use it).
pub fn embedding_segments(ids: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_by_key(|&t| ids[t as usize]);
    let (mut seg_start, mut seg_id) = (Vec::new(), Vec::new());
    for (p, &t) in order.iter().enumerate() {
        let id = ids[t as usize];
        if seg_id.last() != Some(&id) {
            seg_start.push(p as u32);
            seg_id.push(id);
        }
    }
    seg_start.resize(ids.len() + 1, ids.len() as u32);
    (order, seg_start, seg_id)
}

pub trait NnOps: Send + Sync {
    /// Independent GEMMs in one call (the routed experts' GEMMs over their tokens): each
    /// `(shape, a_offset, b_offset, c_offset)` computes, on the views starting at those element
    /// offsets, what [`crate::Blas::gemm`] would. Output blocks must not overlap.
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]);

    /// The routed experts' GEMMs, one per expert over its rows ([`ExpertGemm`]): what
    /// [`NnOps::gemm_grouped`] does with [`ExpertGemm::groups`] of the offsets. A backend that
    /// cannot read [`ExpertRows::Device`] offsets where they are reads them back first
    /// ([`NnOps::experts_on_device`] says which).
    fn gemm_experts(&self, c: ViewMut, a: View, b: View, rows: ExpertRows, g: &ExpertGemm);

    /// Whether [`NnOps::gemm_experts`] reads [`ExpertRows::Device`] offsets in device memory
    /// itself, with no host read (for bf16-input GEMMs, or f32 ones), so that a step need not
    /// read a MoE layer's counts back.
    fn experts_on_device(&self, _bf16_inputs: bool) -> bool {
        false
    }

    /// `out[t] = wte[ids[t]]`, rows of `dim`; `ids` is u32.
    fn embedding_forward(&self, out: ViewMut, wte: View, ids: View, dim: usize);
    /// `dwte[ids[t]] += dout[t]` (`ids` with its grouping, see [`EmbedIds`]).
    fn embedding_backward(&self, dwte: ViewMut, dout: View, ids: EmbedIds, dim: usize);

    /// RMSNorm of rows of `dim`: `out = w * x * rstd`, `rstd = 1/sqrt(mean(x²) + eps)` (saved).
    fn rmsnorm_forward(&self, out: ViewMut, rstd: ViewMut, x: View, w: View, dim: usize, eps: f32);
    /// `dx += ∂/∂x`, `dw += ∂/∂w`.
    fn rmsnorm_backward(&self, dx: ViewMut, dw: ViewMut, dout: View, s: NormSaved, dim: usize);

    /// Per-head RMSNorm (weight `w` of `head_dim`) followed by rotate-half RoPE (see
    /// [`HeadRope`]); `rstd` is `[rows, heads]`. `out` may be bf16 where `x` is f32 (the rows
    /// bf16 attention reads): each value rounded once, as a cast of the f32 result would be.
    fn head_norm_rope_forward(&self, out: ViewMut, rstd: ViewMut, x: View, w: View, d: HeadRope);
    /// `dx` overwritten, `dw += ∂/∂w`. `dout` may be bf16 where `x` is f32 (bf16 attention's
    /// gradients), read widened.
    fn head_norm_rope_backward(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        d: HeadRope,
    );

    /// Causal grouped-query attention with scale `1/sqrt(head_dim)`. `q`, `out`:
    /// `[batch, tq, heads, head_dim]`; `k`, `v`: `[batch, tk, kv_heads, head_dim]`, `tk >= tq`,
    /// query `i` sitting at key position `tk - tq + i`. Saves the log-sum-exp of each score row,
    /// `lse: [batch, heads, tq]`, so backward recomputes probabilities without storing them.
    /// `q`, `k`, `v`, `out` (and backward's `dout`, `dq`, `dk`, `dv`) share one dtype; in bf16
    /// (`training.compute_dtype = "bf16"`) the arithmetic is f32, each output rounded to bf16
    /// once, and `lse` is f32, otherwise it is the inputs' dtype.
    fn attention_forward(&self, out: ViewMut, lse: ViewMut, q: View, k: View, v: View, d: AttnDims);
    /// The gradients of `q`, `k`, `v` (overwritten) from that of the output.
    fn attention_backward(&self, g: AttnGrads, dout: View, s: AttnSaved, d: AttnDims);

    /// [`NnOps::head_norm_rope_forward`] with positions restarting at each document
    /// (`data.document_mask`): row `r` is rotated to position `pos0 + r % seq - docs[r]`, where
    /// `docs` (u32, one per row) is the position in its sequence where the row's document
    /// starts, at most `r % seq`.
    fn head_norm_rope_forward_docs(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        x: View,
        w: View,
        docs: View,
        d: HeadRope,
    );
    /// The backward of [`NnOps::head_norm_rope_forward_docs`].
    fn head_norm_rope_backward_docs(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        docs: View,
        d: HeadRope,
    );
    /// Block-causal [`NnOps::attention_forward`] (`data.document_mask`): query `i` of
    /// sequence `b` attends key `j` only if `docs[b·tq + i] <= j <= tk - tq + i`, `docs`
    /// (u32 `[batch, tq]`) holding the key position where the query's document starts, never
    /// less than the query before it's. A window of several documents then computes what each
    /// document would alone.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward_docs(
        &self,
        out: ViewMut,
        lse: ViewMut,
        q: View,
        k: View,
        v: View,
        docs: View,
        d: AttnDims,
    );
    /// The backward of [`NnOps::attention_forward_docs`].
    fn attention_backward_docs(
        &self,
        g: AttnGrads,
        dout: View,
        s: AttnSaved,
        docs: View,
        d: AttnDims,
    );

    /// `out = silu(gate) * up`, elementwise, computed in f32 (or the backend's f64). `out` may
    /// be bf16 where the inputs are f32 (the rows a bf16-input GEMM reads next, under
    /// `training.compute_dtype = "bf16"`): the f32 result rounded once, the bits of the f32 op
    /// followed by [`crate::Blas::cast`]. Inputs and output may all be bf16 (the gate and up
    /// a bf16 GEMM wrote): the f32 op on the widened inputs, rounded once.
    fn swiglu_forward(&self, out: ViewMut, gate: View, up: View);
    /// `dgate`, `dup` overwritten; both may be bf16 where the inputs are f32, as the forward's
    /// output, and all five may be bf16, as there.
    fn swiglu_backward(&self, dgate: ViewMut, dup: ViewMut, dout: View, gate: View, up: View);

    /// Router: `probs = softmax(logits)` over `experts` per row; select the top `k` of
    /// `probs + bias` (ties: lower index first) into `idx` (`[rows, k]`, best first), with
    /// weights `probs[idx]`, renormalised to sum to one if `renorm`. `psum[e]` is set to the sum
    /// over rows of `probs[:, e]` (for the auxiliary loss).
    fn router_forward(&self, out: RouterOut, logits: View, bias: Option<View>, d: RouterDims);
    /// `dlogits` (overwritten) from the gradient of the weights and a per-expert constant added
    /// to every row's probability gradient (the auxiliary loss's, [`AuxGrad`]).
    fn router_backward(
        &self,
        dlogits: ViewMut,
        dweights: View,
        probs: View,
        idx: View,
        aux: AuxGrad,
        d: RouterDims,
    );

    /// Group the `[n, k]` choices `idx` of a router by expert, a stable counting sort: expert
    /// `e`'s rows are `offsets[e] .. offsets[e] + counts[e]`, holding its (token, choice) pairs
    /// in token order (see [`DispatchOut`]).
    fn moe_dispatch(&self, out: DispatchOut, idx: View, experts: usize, k: usize);
    /// Dispatch: `xe[i] = x[src[i]]` (`src` u32). `xe` may be bf16 where `x` is f32 (each
    /// element rounded once, as a cast after the copy) or bf16.
    fn moe_gather(&self, xe: ViewMut, x: View, src: View, dim: usize);
    /// `dx[t] += Σ_j dxe[pos[t*k + j]]`.
    fn moe_gather_backward(&self, dx: ViewMut, dxe: View, d: Dispatched);
    /// Combine: `out[t] += Σ_j w[t*k + j] * ye[pos[t*k + j]]`. `ye` may be bf16 where `out` is
    /// f32 (the experts' outputs a bf16 GEMM wrote): the f32 op on the widened values.
    fn moe_combine(&self, out: ViewMut, ye: View, w: View, d: Dispatched);
    /// `dye` and `dw` overwritten; `dye` may be bf16 where the rest is f32 (rounded once, as a
    /// cast after the f32 op; `dw` stays f32), and then `ye` may be bf16 too (widened, as in
    /// the forward).
    fn moe_combine_backward(
        &self,
        dye: ViewMut,
        dw: ViewMut,
        dout: View,
        ye: View,
        w: View,
        d: Dispatched,
    );

    /// Softmax cross-entropy of rows of `vocab` logits against `targets`; saves each row's
    /// log-sum-exp and ADDS the sum of the losses to `loss[0]`, an f64 element (read once at the
    /// end of the step, not here).
    fn cross_entropy_forward(
        &self,
        lse: ViewMut,
        logits: View,
        targets: View,
        vocab: usize,
        loss: ViewMut,
    );
    /// In place: `logits` becomes `scale * (softmax(logits) - onehot(target))`.
    fn cross_entropy_backward(
        &self,
        logits: ViewMut,
        lse: View,
        targets: View,
        vocab: usize,
        scale: f32,
    );
}

/// [`NnOps`] methods that forward to a field: `forward_nn_ops!(ops: rmsnorm_forward, …)` inside
/// an `impl NnOps` writes each named method as `self.ops.method(args)`, so a wrapper (a kernel
/// backend over its ops, a test backend over the CPU one) writes out only the methods it changes.
/// One list of signatures besides the trait: a changed signature fails to compile here, not in
/// each wrapper.
#[macro_export]
macro_rules! forward_nn_ops {
    ($t:ident: $($m:ident),+ $(,)?) => { $( $crate::forward_nn_ops!(@ $t $m); )+ };
    (@ $t:ident embedding_forward) => { $crate::forward_nn_ops!(@fn $t embedding_forward(
        out: $crate::ViewMut, wte: $crate::View, ids: $crate::View, dim: usize)); };
    (@ $t:ident embedding_backward) => { $crate::forward_nn_ops!(@fn $t embedding_backward(
        dwte: $crate::ViewMut, dout: $crate::View, ids: $crate::EmbedIds, dim: usize)); };
    (@ $t:ident rmsnorm_forward) => { $crate::forward_nn_ops!(@fn $t rmsnorm_forward(
        out: $crate::ViewMut, rstd: $crate::ViewMut, x: $crate::View, w: $crate::View,
        dim: usize, eps: f32)); };
    (@ $t:ident rmsnorm_backward) => { $crate::forward_nn_ops!(@fn $t rmsnorm_backward(
        dx: $crate::ViewMut, dw: $crate::ViewMut, dout: $crate::View, s: $crate::NormSaved,
        dim: usize)); };
    (@ $t:ident head_norm_rope_forward) => { $crate::forward_nn_ops!(@fn $t head_norm_rope_forward(
        out: $crate::ViewMut, rstd: $crate::ViewMut, x: $crate::View, w: $crate::View,
        d: $crate::HeadRope)); };
    (@ $t:ident head_norm_rope_backward) => { $crate::forward_nn_ops!(@fn $t head_norm_rope_backward(
        dx: $crate::ViewMut, dw: $crate::ViewMut, dout: $crate::View, s: $crate::NormSaved,
        d: $crate::HeadRope)); };
    (@ $t:ident attention_forward) => { $crate::forward_nn_ops!(@fn $t attention_forward(
        out: $crate::ViewMut, lse: $crate::ViewMut, q: $crate::View, k: $crate::View,
        v: $crate::View, d: $crate::AttnDims)); };
    (@ $t:ident attention_backward) => { $crate::forward_nn_ops!(@fn $t attention_backward(
        g: $crate::AttnGrads, dout: $crate::View, s: $crate::AttnSaved, d: $crate::AttnDims)); };
    (@ $t:ident head_norm_rope_forward_docs) => { $crate::forward_nn_ops!(@fn $t head_norm_rope_forward_docs(
        out: $crate::ViewMut, rstd: $crate::ViewMut, x: $crate::View, w: $crate::View,
        docs: $crate::View, d: $crate::HeadRope)); };
    (@ $t:ident head_norm_rope_backward_docs) => { $crate::forward_nn_ops!(@fn $t head_norm_rope_backward_docs(
        dx: $crate::ViewMut, dw: $crate::ViewMut, dout: $crate::View, s: $crate::NormSaved,
        docs: $crate::View, d: $crate::HeadRope)); };
    (@ $t:ident attention_forward_docs) => { $crate::forward_nn_ops!(@fn $t attention_forward_docs(
        out: $crate::ViewMut, lse: $crate::ViewMut, q: $crate::View, k: $crate::View,
        v: $crate::View, docs: $crate::View, d: $crate::AttnDims)); };
    (@ $t:ident attention_backward_docs) => { $crate::forward_nn_ops!(@fn $t attention_backward_docs(
        g: $crate::AttnGrads, dout: $crate::View, s: $crate::AttnSaved, docs: $crate::View,
        d: $crate::AttnDims)); };
    (@ $t:ident swiglu_forward) => { $crate::forward_nn_ops!(@fn $t swiglu_forward(
        out: $crate::ViewMut, gate: $crate::View, up: $crate::View)); };
    (@ $t:ident swiglu_backward) => { $crate::forward_nn_ops!(@fn $t swiglu_backward(
        dgate: $crate::ViewMut, dup: $crate::ViewMut, dout: $crate::View, gate: $crate::View,
        up: $crate::View)); };
    (@ $t:ident router_forward) => { $crate::forward_nn_ops!(@fn $t router_forward(
        out: $crate::RouterOut, logits: $crate::View, bias: Option<$crate::View>,
        d: $crate::RouterDims)); };
    (@ $t:ident router_backward) => { $crate::forward_nn_ops!(@fn $t router_backward(
        dlogits: $crate::ViewMut, dweights: $crate::View, probs: $crate::View, idx: $crate::View,
        aux: $crate::AuxGrad, d: $crate::RouterDims)); };
    (@ $t:ident moe_dispatch) => { $crate::forward_nn_ops!(@fn $t moe_dispatch(
        out: $crate::DispatchOut, idx: $crate::View, experts: usize, k: usize)); };
    (@ $t:ident moe_gather) => { $crate::forward_nn_ops!(@fn $t moe_gather(
        xe: $crate::ViewMut, x: $crate::View, src: $crate::View, dim: usize)); };
    (@ $t:ident moe_gather_backward) => { $crate::forward_nn_ops!(@fn $t moe_gather_backward(
        dx: $crate::ViewMut, dxe: $crate::View, d: $crate::Dispatched)); };
    (@ $t:ident moe_combine) => { $crate::forward_nn_ops!(@fn $t moe_combine(
        out: $crate::ViewMut, ye: $crate::View, w: $crate::View, d: $crate::Dispatched)); };
    (@ $t:ident moe_combine_backward) => { $crate::forward_nn_ops!(@fn $t moe_combine_backward(
        dye: $crate::ViewMut, dw: $crate::ViewMut, dout: $crate::View, ye: $crate::View,
        w: $crate::View, d: $crate::Dispatched)); };
    (@ $t:ident cross_entropy_forward) => { $crate::forward_nn_ops!(@fn $t cross_entropy_forward(
        lse: $crate::ViewMut, logits: $crate::View, targets: $crate::View, vocab: usize,
        loss: $crate::ViewMut)); };
    (@ $t:ident cross_entropy_backward) => { $crate::forward_nn_ops!(@fn $t cross_entropy_backward(
        logits: $crate::ViewMut, lse: $crate::View, targets: $crate::View, vocab: usize,
        scale: f32)); };
    (@fn $t:ident $m:ident($($a:ident: $ty:ty),* $(,)?)) => {
        fn $m(&self, $($a: $ty),*) {
            self.$t.$m($($a),*)
        }
    };
}

/// Every kernel op of [`NnOps`] (all but the GEMMs and `experts_on_device`) forwarded to a field
/// with [`crate::forward_nn_ops`]: for a wrapper that changes none of them.
#[macro_export]
macro_rules! forward_nn_kernels {
    ($t:ident) => {
        $crate::forward_nn_ops!($t:
            embedding_forward, embedding_backward, rmsnorm_forward, rmsnorm_backward,
            head_norm_rope_forward, head_norm_rope_backward, attention_forward,
            attention_backward, swiglu_forward, swiglu_backward, router_forward, router_backward,
            moe_dispatch, moe_gather, moe_gather_backward, moe_combine, moe_combine_backward,
            cross_entropy_forward, cross_entropy_backward, head_norm_rope_forward_docs,
            head_norm_rope_backward_docs, attention_forward_docs, attention_backward_docs,
        );
    };
}

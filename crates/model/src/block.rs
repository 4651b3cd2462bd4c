//! One transformer block, forward and backward, as explicit kernel calls:
//!
//! ```text
//! xn1 = rmsnorm(x)            q,k,v = xn1·Wqᵀ, xn1·Wkᵀ, xn1·Wvᵀ
//! qr,kr = rope(headnorm(q,k))  att = attention(qr, kr, v)
//! xmid = x + att·Woᵀ          xn2 = rmsnorm(xmid)
//! y = xmid + mlp(xn2)         mlp = Σ_topk w·expert(xn2) [+ shared(xn2)]  or a dense SwiGLU
//! ```
//!
//! [`block_forward`] runs four stages, [`qkv_forward`], [`attend_forward`], [`out_proj_forward`]
//! and [`mlp_forward`]; [`block_backward`] runs their backwards in the reverse order. All of
//! them read the block's sizes from one [`Dims`], made once a call.
//!
//! Under bf16 compute (`Model::bf16`) attention runs on bf16 q, k, v (rounded after RoPE / the
//! q-k norms, from f32 staged in the gradient scratch) and writes a bf16 output, which the
//! o-projection reads as a bf16 operand; its backward takes the output gradient rounded to
//! bf16 and writes bf16 dq, dk, dv (as PyTorch's autocast around SDPA, and as the CUDA
//! backend's tensor-core kernels require). The q/k norm backward widens dq, dk to f32; dv
//! enters its GEMMs as a bf16 operand. Generation's cached path keeps f32 attention.
//!
//! Routed experts run as one GEMM per expert over the tokens routed to it (rows grouped by
//! expert); the every-token SwiGLU (dense layer or stacked shared experts) is one GEMM for gate
//! and up across all its experts.

use crate::experts::{ExpertExecutor, ExpertsBwdBufs, ExpertsFwdBufs, ExpertsIo};
use crate::step::chunks;
use crate::workspace::{BlockActs, FfnActs, GradScratch, MoeActs, Routing};
use crate::{LayerIdx, MlpIdx, Model};
use anyhow::Result;
use ganymede_config::ModelConfig;
use ganymede_core::{
    AttnDims, AttnGrads, AttnSaved, AuxGrad, Backend, DispatchOut, Dispatched, ExpertRows, Gemm,
    HeadRope, NormSaved, ParamStore, RouterDims, RouterOut, StepPhase, Tensor, View, ViewMut,
};

/// What every kernel call of a block shares: the backend, the model, its parameters as they
/// stand (gathered, under FSDP) and the batch shape.
pub(crate) struct Ctx<'a> {
    pub be: &'a dyn Backend,
    pub model: &'a Model,
    pub params: &'a ParamStore,
    pub batch: usize,
    pub seq: usize,
    /// Each token's document start (u32 `[batch, seq]`) under document masking: attention and
    /// RoPE then run per document.
    pub docs: Option<View<'a>>,
}

/// An every-token SwiGLU: its gate, up and down parameters, of `parts` stacked experts of
/// hidden `fs` each (one part for a dense layer).
#[derive(Clone, Copy)]
struct Ffn {
    idx: (usize, usize, usize),
    parts: usize,
    fs: usize,
}

impl Ffn {
    /// A dense layer's SwiGLU.
    fn dense(cfg: &ModelConfig, idx: (usize, usize, usize)) -> Ffn {
        Ffn {
            idx,
            parts: 1,
            fs: cfg.dense_hidden,
        }
    }

    /// A MoE layer's stacked shared experts.
    fn shared(cfg: &ModelConfig, idx: (usize, usize, usize)) -> Ffn {
        Ffn {
            idx,
            parts: cfg.shared_experts,
            fs: cfg.shared_hidden(),
        }
    }
}

/// Where attention's keys and values live.
pub(crate) enum Kv<'a> {
    /// The block's own buffers (training, evaluation).
    Own,
    /// A cache holding `pos0` earlier positions of one sequence; the call appends its tokens.
    Cache {
        k: &'a mut Tensor,
        v: &'a mut Tensor,
        pos0: usize,
    },
}

/// A block's sizes, read from the config once a call and shared by its forward and backward
/// stages.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    /// Tokens in the batch (`batch * seq`).
    n: usize,
    hidden: usize,
    /// Widths of q and of each of k and v.
    q_dim: usize,
    kv_dim: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    theta: f64,
    experts: usize,
    top_k: usize,
    expert_hidden: usize,
    renorm: bool,
    /// bf16 GEMM operands (`Model::bf16`).
    bf16: bool,
    /// bf16 operands for the router's GEMMs (`Model::with_router_bf16`).
    router_bf16: bool,
}

impl Dims {
    fn of(cx: &Ctx) -> Dims {
        let cfg = cx.model.config();
        Dims {
            batch: cx.batch,
            seq: cx.seq,
            n: cx.batch * cx.seq,
            hidden: cfg.hidden,
            q_dim: cfg.q_dim(),
            kv_dim: cfg.kv_dim(),
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            eps: cfg.norm_eps as f32,
            theta: cfg.rope_theta,
            experts: cfg.experts,
            top_k: cfg.top_k,
            expert_hidden: cfg.expert_hidden,
            renorm: cfg.norm_topk_prob,
            bf16: cx.model.bf16,
            router_bf16: cx.model.bf16 && cx.model.router_bf16,
        }
    }

    /// The q/k norm and RoPE of `heads` heads, the call's first token at position `pos0`.
    fn rope(&self, heads: usize, pos0: usize) -> HeadRope {
        HeadRope {
            heads,
            head_dim: self.head_dim,
            seq: self.seq,
            pos0,
            theta: self.theta,
            eps: self.eps,
        }
    }

    /// Attention of the call's `seq` queries of each of `batch` sequences over `tk` keys.
    fn attn(&self, batch: usize, tk: usize) -> AttnDims {
        AttnDims {
            batch,
            tq: self.seq,
            tk,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    fn router(&self) -> RouterDims {
        RouterDims {
            experts: self.experts,
            k: self.top_k,
            renorm: self.renorm,
        }
    }
}

/// One call of block `layer`: the shared context, the sizes and the layer's parameters.
struct Block<'c, 'a> {
    cx: &'c Ctx<'a>,
    d: Dims,
    li: &'a LayerIdx,
    mlp: Mlp,
}

/// A layer's MLP as its stages run it.
#[derive(Clone, Copy)]
enum Mlp {
    Dense(Ffn),
    /// Routed experts and any stacked shared ones.
    Moe {
        mx: MoeIdx,
        shared: Option<Ffn>,
    },
}

impl<'c, 'a> Block<'c, 'a> {
    fn new(cx: &'c Ctx<'a>, layer: usize) -> Self {
        let li = &cx.model.layers[layer];
        let cfg = cx.model.config();
        let mlp = match li.mlp {
            MlpIdx::Dense { gate, up, down } => Mlp::Dense(Ffn::dense(cfg, (gate, up, down))),
            MlpIdx::Moe {
                router,
                gate,
                up,
                down,
                shared,
                bias,
            } => Mlp::Moe {
                mx: MoeIdx {
                    layer,
                    router,
                    gate,
                    up,
                    down,
                    bias,
                },
                shared: shared.map(|sh| Ffn::shared(cfg, sh)),
            },
        };
        Block {
            cx,
            d: Dims::of(cx),
            li,
            mlp,
        }
    }

    /// Parameter `i` as it stands.
    fn w(&self, i: usize) -> View<'a> {
        self.cx.params.get(i).view()
    }
}

/// A MoE layer's rows of the step's routing statistics: the per-expert sums of router
/// probabilities (`[E]` f64, written) and counts of routed rows (`[E]` f64, added to by each
/// chunk's dispatch; `None` where they must not be counted again, as in a recompute).
pub(crate) struct LayerRoute<'a> {
    pub psum: ViewMut<'a>,
    pub counts: Option<ViewMut<'a>>,
}

/// Forward through block `layer`. `y` receives the output; `None` recomputes the internals
/// only (activation checkpointing: the output is already known). A MoE layer writes its
/// routing statistics into `route`.
pub(crate) fn block_forward(
    cx: &Ctx,
    a: &mut BlockActs,
    g: &mut GradScratch,
    x: View,
    y: Option<ViewMut>,
    kv: Kv,
    (layer, route, ex): (usize, Option<LayerRoute>, &mut dyn ExpertExecutor),
) -> Result<()> {
    let b = Block::new(cx, layer);
    let cached = matches!(kv, Kv::Cache { .. });
    qkv_forward(&b, a, g, x, cached);
    attend_forward(&b, a, g, kv);
    out_proj_forward(&b, a, g, x, cached);
    mlp_forward(&b, a, g, y, route, ex)
}

/// `xn1 = rmsnorm(x)` and its projections q, k and v.
fn qkv_forward(b: &Block, a: &mut BlockActs, g: &mut GradScratch, x: View, cached: bool) {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let (n, h) = (d.n, d.hidden);
    be.phase(StepPhase::Elementwise);
    be.rmsnorm_forward(
        a.xn1.view_mut(),
        a.rstd1.view_mut(),
        x,
        b.w(li.in_norm),
        h,
        d.eps,
    );
    be.phase(StepPhase::Dense);
    be.gemm(
        a.q.view_mut(),
        a.xn1.view(),
        b.w(li.q),
        Gemm::new(n, d.q_dim, h, false, true).bf16_inputs(d.bf16),
    );
    // k and v read the rows q just read: a bf16 backend reuses their cast (`Gemm::unchanged`).
    be.gemm(
        a.k.view_mut(),
        a.xn1.view(),
        b.w(li.k),
        Gemm::new(n, d.kv_dim, h, false, true)
            .bf16_inputs(d.bf16)
            .unchanged(true, false),
    );
    // Under bf16 compute the normed, rotated q and k are made in f32 in the gradient scratch
    // (free during forward) and rounded into the saved bf16 tensors; v is written in bf16 by
    // its GEMM (the f32 product rounded once, the same bits), except for an f32 KV cache.
    let v32 = if d.bf16 && cached {
        &mut g.dv
    } else {
        &mut a.v
    };
    be.gemm(
        v32.view_mut(),
        a.xn1.view(),
        b.w(li.v),
        Gemm::new(n, d.kv_dim, h, false, true)
            .bf16_inputs(d.bf16)
            .unchanged(true, false),
    );
}

/// q and k normed per head and rotated, and attention over the block's own keys and values or
/// a cache's: the output in `a.att` (in `g.datt` under bf16 compute with a cache).
fn attend_forward(b: &Block, a: &mut BlockActs, g: &mut GradScratch, kv: Kv) {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let (bf16, kd) = (d.bf16, d.kv_dim);
    let pos0 = match &kv {
        Kv::Own => 0,
        Kv::Cache { pos0, .. } => *pos0,
    };
    let cached = matches!(kv, Kv::Cache { .. });
    // Under bf16 compute the norms write attention's bf16 rows directly (each value rounded
    // once, as a cast would); a KV cache is f32, so q stays in the f32 staging there.
    let qr = if bf16 && cached {
        &mut g.dqr
    } else {
        &mut a.qr
    };
    let (qr, rstdq) = (qr.view_mut(), a.rstdq.view_mut());
    // Document masking applies to training and evaluation windows, not to a KV cache.
    let docs = if cached { None } else { b.cx.docs };
    let (q, qn) = (a.q.view(), b.w(li.q_norm));
    be.phase(StepPhase::Elementwise);
    match docs {
        Some(dd) => be.head_norm_rope_forward_docs(qr, rstdq, q, qn, dd, d.rope(d.heads, 0)),
        None => be.head_norm_rope_forward(qr, rstdq, q, qn, d.rope(d.heads, pos0)),
    }
    match kv {
        Kv::Own => {
            let (kr, rstdk) = (a.kr.view_mut(), a.rstdk.view_mut());
            let (k, kn) = (a.k.view(), b.w(li.k_norm));
            let rope = d.rope(d.kv_heads, 0);
            match docs {
                Some(dd) => be.head_norm_rope_forward_docs(kr, rstdk, k, kn, dd, rope),
                None => be.head_norm_rope_forward(kr, rstdk, k, kn, rope),
            }
            let (att, lse) = (a.att.view_mut(), a.lse.view_mut());
            let (q, k, v) = (a.qr.view(), a.kr.view(), a.v.view());
            let dims = d.attn(d.batch, d.seq);
            be.phase(StepPhase::Attention);
            match docs {
                Some(dd) => be.attention_forward_docs(att, lse, q, k, v, dd, dims),
                None => be.attention_forward(att, lse, q, k, v, dims),
            }
        }
        Kv::Cache { k, v, pos0 } => {
            assert_eq!(d.batch, 1, "a KV cache holds one sequence");
            let (n, tk) = (d.n, pos0 + d.seq);
            let (kc, rstdk) = (k.slice_mut(pos0 * kd, n * kd), a.rstdk.view_mut());
            let rope = d.rope(d.kv_heads, pos0);
            be.head_norm_rope_forward(kc, rstdk, a.k.view(), b.w(li.k_norm), rope);
            // The cache is f32: under bf16 compute q, v and the output stay in the f32 staging.
            let v32 = if bf16 { &g.dv } else { &a.v };
            be.copy(v.slice_mut(pos0 * kd, n * kd), v32.view());
            let att32 = if bf16 { &mut g.datt } else { &mut a.att };
            let (att, lse) = (att32.view_mut(), a.lse.view_mut());
            let q = if bf16 { g.dqr.view() } else { a.qr.view() };
            let (k, v) = (k.slice(0, tk * kd), v.slice(0, tk * kd));
            be.phase(StepPhase::Attention);
            be.attention_forward(att, lse, q, k, v, d.attn(1, tk));
        }
    }
}

/// `xmid = x + att·Woᵀ`.
fn out_proj_forward(b: &Block, a: &mut BlockActs, g: &GradScratch, x: View, cached: bool) {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let att = if d.bf16 && cached {
        g.datt.view()
    } else {
        a.att.view()
    };
    be.phase(StepPhase::Dense);
    be.gemm(
        a.xmid.view_mut(),
        att,
        b.w(li.o),
        Gemm::new(d.n, d.hidden, d.q_dim, false, true).bf16_inputs(d.bf16),
    );
    be.phase(StepPhase::Elementwise);
    be.add(a.xmid.view_mut(), x);
}

/// `xn2 = rmsnorm(xmid)` and `y = xmid + mlp(xn2)`: a dense SwiGLU, or routed experts and any
/// shared ones.
fn mlp_forward(
    b: &Block,
    a: &mut BlockActs,
    g: &mut GradScratch,
    mut y: Option<ViewMut>,
    route: Option<LayerRoute>,
    ex: &mut dyn ExpertExecutor,
) -> Result<()> {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let (xn2, rstd2) = (a.xn2.view_mut(), a.rstd2.view_mut());
    be.phase(StepPhase::Elementwise);
    be.rmsnorm_forward(
        xn2,
        rstd2,
        a.xmid.view(),
        b.w(li.post_norm),
        d.hidden,
        d.eps,
    );
    if let Some(y) = y.as_mut() {
        be.copy(y.reborrow(), a.xmid.view());
    }
    match b.mlp {
        Mlp::Dense(ffn) => {
            let f = a.ffn.as_mut().expect("dense activations");
            be.phase(StepPhase::Dense);
            ffn_forward(b, f, a.xn2.view(), ffn, y);
        }
        Mlp::Moe { mx, shared } => {
            moe_forward(b, a, g, y.as_mut().map(|y| y.reborrow()), route, mx, ex)?;
            if let Some(ffn) = shared {
                let f = a.ffn.as_mut().expect("shared-expert activations");
                be.phase(StepPhase::Dense);
                ffn_forward(b, f, a.xn2.view(), ffn, y);
            }
        }
    }
    Ok(())
}

/// The router and the routed experts over `a.xn2`, their outputs added into `y` (if any).
fn moe_forward(
    b: &Block,
    a: &mut BlockActs,
    g: &mut GradScratch,
    mut y: Option<ViewMut>,
    route: Option<LayerRoute>,
    mx: MoeIdx,
    ex: &mut dyn ExpertExecutor,
) -> Result<()> {
    let (be, d) = (b.cx.be, b.d);
    let (n, h, e, k) = (d.n, d.hidden, d.experts, d.top_k);
    let m = a.moe.as_mut().expect("MoE activations");
    let rl = g.drl.as_mut().expect("router scratch");
    be.phase(StepPhase::Router);
    be.gemm(
        rl.view_mut(),
        a.xn2.view(),
        b.w(mx.router),
        // f32 logits from f32 or bf16 operands (`Model::with_router_bf16`).
        Gemm::new(n, e, h, false, true).bf16_inputs(d.router_bf16),
    );
    let r = &mut m.r;
    let LayerRoute { psum, mut counts } = route.expect("a MoE layer's routing statistics");
    let out = RouterOut {
        probs: m.probs.view_mut(),
        weights: m.rw.view_mut(),
        idx: r.idx.view_mut(),
        psum,
    };
    be.router_forward(out, rl.slice(0, n * e), mx.bias.map(|i| b.w(i)), d.router());
    // The routed experts a chunk of tokens at a time (one chunk unless
    // `training.moe_chunk_tokens` is set): each is dispatched, run and combined in turn.
    // A recompute (`y` = None) runs only the last chunk's experts: the backward starts
    // there and recomputes the others itself.
    let parts: Vec<_> = chunks(n, b.cx.model.moe_rows(n)).collect();
    for (j, &(t0, tn)) in parts.iter().enumerate() {
        be.phase(StepPhase::Router);
        let totals = counts.as_mut().map(|c| c.reborrow());
        dispatch_chunk(b, &mut m.r, (j, t0, tn), totals, &*ex);
        if y.is_none() && j + 1 < parts.len() {
            continue;
        }
        be.phase(StepPhase::Experts);
        experts_forward(b, m, (j, t0, tn), a.xn2.view(), mx, ex)?;
        if let Some(y) = y.as_mut() {
            let disp = Dispatched {
                pos: m.r.pos.slice(t0 * k, tn * k),
                k,
                dim: h,
            };
            let (yc, rw) = (
                y.reborrow().slice(t0 * h, tn * h),
                m.rw.slice(t0 * k, tn * k),
            );
            be.moe_combine(yc, m.ye.slice(0, tn * k * h), rw, disp);
        }
    }
    Ok(())
}

/// A MoE layer's router and routed-expert parameters in the table, and the layer.
#[derive(Clone, Copy)]
struct MoeIdx {
    layer: usize,
    router: usize,
    gate: usize,
    up: usize,
    down: usize,
    /// The router's selection bias (DeepSeek-V3).
    bias: Option<usize>,
}

/// Whether a MoE layer's per-expert counts must come to the host after each dispatch: for an
/// executor that sizes an all-to-all with them, or a backend whose grouped GEMMs take host
/// sizes. Otherwise the expert GEMMs read them where the dispatch wrote them, and the step
/// reads nothing back before its end.
fn counts_on_host(b: &Block, ex: &dyn ExpertExecutor) -> bool {
    ex.host_counts() || !b.cx.be.experts_on_device(b.d.bf16)
}

/// Dispatch chunk `j` of a MoE layer's tokens (`tn` from `t0`): its rows grouped by expert
/// into its slice of `src` and `pos` (chunk-relative tokens and rows), its per-expert counts
/// added to the layer's `totals` (where given), and where [`counts_on_host`] says so, read back
/// into the chunk's host copy (reused: no allocation a step).
fn dispatch_chunk(
    b: &Block,
    r: &mut Routing,
    (j, t0, tn): (usize, usize, usize),
    totals: Option<ViewMut>,
    ex: &dyn ExpertExecutor,
) {
    let (be, e, k) = (b.cx.be, b.d.experts, b.d.top_k);
    let d = DispatchOut {
        counts: r.counts.view_mut(),
        offsets: r.offsets.view_mut(),
        src: r.src.slice_mut(t0 * k, tn * k),
        pos: r.pos.slice_mut(t0 * k, tn * k),
        totals,
    };
    be.moe_dispatch(d, r.idx.slice(t0 * k, tn * k), e, k);
    if !counts_on_host(b, ex) {
        return;
    }
    // The host read: the counts size the all-to-all or a library's grouped GEMM (as NCCL's
    // send/recv and cuBLAS's grouped GEMM take host sizes). The offsets follow on the host.
    let counts = be.download_u32(r.counts.view());
    let c = &mut r.chunks[j];
    c.counts.clear();
    c.counts.extend(counts.iter().map(|&x| x as usize));
    c.offsets.clear();
    c.offsets.push(0);
    for &x in &c.counts {
        c.offsets.push(c.offsets[c.offsets.len() - 1] + x);
    }
}

/// What the expert executor needs of chunk `j` (`tn` tokens) of layer `mx.layer`'s tokens,
/// dispatched last: its rows by expert on the host, or in device memory.
fn chunk_io<'a>(
    b: &Block<'_, 'a>,
    r: &'a Routing,
    (j, tn): (usize, usize),
    mx: MoeIdx,
    ex: &dyn ExpertExecutor,
) -> ExpertsIo<'a> {
    let routed = tn * b.d.top_k;
    let (rows, counts) = if counts_on_host(b, ex) {
        let c = &r.chunks[j];
        (ExpertRows::Host(&c.offsets), &c.counts[..])
    } else {
        let offsets = r.offsets.view();
        (
            ExpertRows::Device {
                offsets,
                rows: routed,
            },
            &[][..],
        )
    };
    ExpertsIo {
        layer: mx.layer,
        rows,
        routed,
        counts,
        f: b.d.expert_hidden,
        h: b.d.hidden,
        top_k: b.d.top_k,
        params: b.cx.params,
        gate: mx.gate,
        up: mx.up,
        down: mx.down,
        bf16: b.d.bf16,
    }
}

/// The routed experts over chunk `j` (dispatched already; `tn` tokens from `t0`): its rows
/// gathered from `xn2`, the layer's normed tokens, their gate, up and SwiGLU kept in `m`, their
/// outputs in `m.ye`.
fn experts_forward(
    b: &Block,
    m: &mut MoeActs,
    (j, t0, tn): (usize, usize, usize),
    xn2: View,
    mx: MoeIdx,
    ex: &mut dyn ExpertExecutor,
) -> Result<()> {
    let (h, f, k) = (b.d.hidden, b.d.expert_hidden, b.d.top_k);
    let rows = tn * k;
    let (xe, src) = (m.xe.slice_mut(0, rows * h), m.r.src.slice(t0 * k, rows));
    b.cx.be.moe_gather(xe, xn2.slice(t0 * h, tn * h), src, h);
    let io = chunk_io(b, &m.r, (j, tn), mx, &*ex);
    let bufs = ExpertsFwdBufs {
        xe: m.xe.slice(0, rows * h),
        g: m.g.slice_mut(0, rows * f),
        u: m.u.slice_mut(0, rows * f),
        a: m.a.slice_mut(0, rows * f),
        ye: m.ye.slice_mut(0, rows * h),
    };
    ex.forward(b.cx.be, &io, bufs)
}

/// What a MoE chunk's backward reads besides the experts: the chunk's normed tokens and the
/// auxiliary loss's gradient.
struct MoeChunkBwd<'a> {
    xn2: View<'a>,
    dc: AuxGrad<'a>,
}

/// Backward through chunk `j`'s routed experts and router (its internals in `m`), with the
/// gradient of the layer's output in `g.dres`: writes the chunk's rows of `g.dxn` and adds the
/// experts' and router's weight gradients.
#[allow(clippy::too_many_arguments)]
fn moe_chunk_backward(
    b: &Block,
    grads: &mut ParamStore,
    m: &MoeActs,
    g: &mut GradScratch,
    (j, t0, tn): (usize, usize, usize),
    c: MoeChunkBwd,
    mx: MoeIdx,
    ex: &mut dyn ExpertExecutor,
) -> Result<()> {
    let (be, d) = (b.cx.be, b.d);
    let (h, f, k, e) = (d.hidden, d.expert_hidden, d.top_k, d.experts);
    let GradScratch {
        dres,
        dxn,
        drl,
        drw,
        dye,
        da,
        dg,
        du,
        dxe,
        ..
    } = g;
    let (drl, drw, dye, da) = (
        drl.as_mut().unwrap(),
        drw.as_mut().unwrap(),
        dye.as_mut().unwrap(),
        da.as_mut().unwrap(),
    );
    let (dg, du, dxe) = (
        dg.as_mut().unwrap(),
        du.as_mut().unwrap(),
        dxe.as_mut().unwrap(),
    );
    let (rows, tk) = (tn * k, t0 * k);
    let disp = Dispatched {
        pos: m.r.pos.slice(tk, rows),
        k,
        dim: h,
    };
    let (ye, rw) = (m.ye.slice(0, rows * h), m.rw.slice(tk, rows));
    be.phase(StepPhase::Experts);
    be.moe_combine_backward(
        dye.slice_mut(0, rows * h),
        drw.slice_mut(tk, rows),
        dres.slice(t0 * h, tn * h),
        ye,
        rw,
        disp,
    );
    let io = chunk_io(b, &m.r, (j, tn), mx, &*ex);
    let bufs = ExpertsBwdBufs {
        xe: m.xe.slice(0, rows * h),
        g: m.g.slice(0, rows * f),
        u: m.u.slice(0, rows * f),
        a: m.a.slice(0, rows * f),
        dye: dye.slice(0, rows * h),
        da: da.slice_mut(0, rows * f),
        dg: dg.slice_mut(0, rows * f),
        du: du.slice_mut(0, rows * f),
        dxe: dxe.slice_mut(0, rows * h),
    };
    ex.backward(be, &io, grads, bufs)?;
    be.phase(StepPhase::Router);
    let (idx, probs) = (m.r.idx.slice(tk, rows), m.probs.slice(t0 * e, tn * e));
    let (dl, dw) = (drl.slice_mut(t0 * e, tn * e), drw.slice(tk, rows));
    be.router_backward(dl, dw, probs, idx, c.dc, d.router());
    let drl = drl.slice(t0 * e, tn * e);
    let wr = b.w(mx.router);
    let dxn_c = dxn.slice_mut(t0 * h, tn * h);
    let rb = d.router_bf16;
    be.gemm(
        dxn_c,
        drl,
        wr,
        Gemm::new(tn, h, e, false, false).bf16_inputs(rb),
    );
    let gr = Gemm::new(e, h, tn, true, false).beta(1.0).bf16_inputs(rb);
    be.gemm(grads.get_mut(mx.router).view_mut(), drl, c.xn2, gr);
    be.phase(StepPhase::Experts);
    be.moe_gather_backward(dxn.slice_mut(t0 * h, tn * h), dxe.slice(0, rows * h), disp);
    Ok(())
}

/// An every-token SwiGLU; adds its output into `y`.
fn ffn_forward(b: &Block, f: &mut FfnActs, xn: View, ffn: Ffn, y: Option<ViewMut>) {
    let (be, params, bf16) = (b.cx.be, b.cx.params, b.d.bf16);
    let ((gate, up, down), parts, fs) = (ffn.idx, ffn.parts, ffn.fs);
    let (n, h, width) = (b.d.n, b.d.hidden, parts * fs);
    let nw = n * width;
    let gm = Gemm::new(n, width, h, false, true).bf16_inputs(bf16);
    be.gemm(f.g.slice_mut(0, nw), xn, params.get(gate).view(), gm);
    be.gemm(
        f.u.slice_mut(0, nw),
        xn,
        params.get(up).view(),
        gm.unchanged(true, false),
    );
    be.swiglu_forward(f.a.slice_mut(0, nw), f.g.slice(0, nw), f.u.slice(0, nw));
    if let Some(mut y) = y {
        let wd = params.get(down);
        for s in 0..parts {
            be.gemm(
                y.reborrow(),
                f.a.slice(s * fs, (n - 1) * width + fs),
                wd.slice(s * h * fs, h * fs),
                Gemm::new(n, h, fs, false, true)
                    .bf16_inputs(bf16)
                    .ld(width, fs, h)
                    .beta(1.0),
            );
        }
    }
}

/// Backward through one block whose internals are in `a`. On entry `g.dres` holds the gradient
/// of the block's output; on return, of its input `x`. Weight gradients are added to `grads`.
/// `aux` is the auxiliary loss's gradient with respect to each router probability (unused in a
/// dense layer).
pub(crate) fn block_backward(
    cx: &Ctx,
    grads: &mut ParamStore,
    a: &mut BlockActs,
    g: &mut GradScratch,
    x: View,
    aux: Option<AuxGrad>,
    (layer, ex): (usize, &mut dyn ExpertExecutor),
) -> Result<()> {
    let b = Block::new(cx, layer);
    mlp_backward(&b, grads, a, g, aux, ex)?;
    out_proj_backward(&b, grads, a, g);
    attend_backward(&b, grads, a, g);
    qkv_backward(&b, grads, a, g, x);
    Ok(())
}

/// Backward of [`mlp_forward`]: the MLP's gradient into `g.dxn` (the gradient of xn2), then
/// the post-attention norm's, added to `g.dres`.
fn mlp_backward(
    b: &Block,
    grads: &mut ParamStore,
    a: &mut BlockActs,
    g: &mut GradScratch,
    aux: Option<AuxGrad>,
    ex: &mut dyn ExpertExecutor,
) -> Result<()> {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    match b.mlp {
        Mlp::Dense(ffn) => {
            let f = a.ffn.as_ref().expect("dense activations");
            be.phase(StepPhase::Dense);
            ffn_backward(b, grads, f, a.xn2.view(), ffn, g, 0.0);
        }
        Mlp::Moe { mx, shared } => {
            moe_backward(b, grads, a, g, aux, mx, ex)?;
            if let Some(ffn) = shared {
                let f = a.ffn.as_ref().expect("shared-expert activations");
                be.phase(StepPhase::Dense);
                ffn_backward(b, grads, f, a.xn2.view(), ffn, g, 1.0);
            }
        }
    }
    be.phase(StepPhase::Elementwise);
    let saved = NormSaved {
        x: a.xmid.view(),
        w: b.w(li.post_norm),
        rstd: a.rstd2.view(),
    };
    let dw = grads.get_mut(li.post_norm).view_mut();
    be.rmsnorm_backward(g.dres.view_mut(), dw, g.dxn.view(), saved, d.hidden);
    Ok(())
}

/// Backward of [`moe_forward`]: the routed experts' and router's gradient into `g.dxn`.
fn moe_backward(
    b: &Block,
    grads: &mut ParamStore,
    a: &mut BlockActs,
    g: &mut GradScratch,
    aux: Option<AuxGrad>,
    mx: MoeIdx,
    ex: &mut dyn ExpertExecutor,
) -> Result<()> {
    let (n, h) = (b.d.n, b.d.hidden);
    let m = a.moe.as_mut().expect("MoE activations");
    let dc = aux.expect("the auxiliary loss's gradient");
    // Chunk by chunk, last first: the forward (or its recompute) left the last chunk's
    // internals; every other chunk's are recomputed here. The router's backward is per
    // token, so each chunk finishes its tokens' gradient of xn2.
    let parts: Vec<_> = chunks(n, b.cx.model.moe_rows(n)).collect();
    for (j, &(t0, tn)) in parts.iter().enumerate().rev() {
        if j + 1 < parts.len() {
            // Dispatched again (the device's offsets are the last chunk's; integer work next
            // to the GEMMs), its counts not added again.
            b.cx.be.phase(StepPhase::Router);
            dispatch_chunk(b, &mut m.r, (j, t0, tn), None, &*ex);
            b.cx.be.phase(StepPhase::Experts);
            experts_forward(b, m, (j, t0, tn), a.xn2.view(), mx, ex)?;
        }
        let bwd = MoeChunkBwd {
            xn2: a.xn2.slice(t0 * h, tn * h),
            dc,
        };
        moe_chunk_backward(b, grads, m, g, (j, t0, tn), bwd, mx, ex)?;
    }
    Ok(())
}

/// Backward of [`out_proj_forward`]: the residual passes `g.dres` through unchanged; the
/// gradient of attention's output goes to `g.datt`, or under bf16 compute to its bf16 copy,
/// which attention's backward reads (the f32 product rounded once, as a cast of it would be).
fn out_proj_backward(b: &Block, grads: &mut ParamStore, a: &BlockActs, g: &mut GradScratch) {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let (n, h, qd) = (d.n, d.hidden, d.q_dim);
    be.phase(StepPhase::Dense);
    let datt = match g.attn16.as_mut() {
        Some(a16) => a16.datt.view_mut(),
        None => g.datt.view_mut(),
    };
    be.gemm(
        datt,
        g.dres.view(),
        b.w(li.o),
        Gemm::new(n, qd, h, false, false).bf16_inputs(d.bf16),
    );
    // dres again in A: nothing wrote it since the call above cast it.
    let go = Gemm::new(h, qd, n, true, false)
        .bf16_inputs(d.bf16)
        .beta(1.0)
        .unchanged(true, false);
    be.gemm(
        grads.get_mut(li.o).view_mut(),
        g.dres.view(),
        a.att.view(),
        go,
    );
}

/// Backward of [`attend_forward`] (the block's own keys and values): from `g.datt` (its bf16
/// copy under bf16 compute), the gradients of q and k before their norms in `g.datt` and
/// `g.dk`, of v in `g.dv` (or its bf16 copy).
fn attend_backward(b: &Block, grads: &mut ParamStore, a: &BlockActs, g: &mut GradScratch) {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let docs = b.cx.docs;
    be.phase(StepPhase::Elementwise);
    // Under bf16 compute attention's gradients are bf16: the output's written so by its GEMM,
    // dq and dk widened for the norms' backward below, dv read by its GEMMs as a bf16 operand.
    let (ag, dout) = match g.attn16.as_mut() {
        Some(a16) => (
            AttnGrads {
                dq: a16.dq.view_mut(),
                dk: a16.dk.view_mut(),
                dv: a16.dv.view_mut(),
            },
            a16.datt.view(),
        ),
        None => (
            AttnGrads {
                dq: g.dqr.view_mut(),
                dk: g.dkr.view_mut(),
                dv: g.dv.view_mut(),
            },
            g.datt.view(),
        ),
    };
    let saved = AttnSaved {
        out: a.att.view(),
        q: a.qr.view(),
        k: a.kr.view(),
        v: a.v.view(),
        lse: a.lse.view(),
    };
    let dims = d.attn(d.batch, d.seq);
    be.phase(StepPhase::Attention);
    match docs {
        Some(dd) => be.attention_backward_docs(ag, dout, saved, dd, dims),
        None => be.attention_backward(ag, dout, saved, dims),
    }
    be.phase(StepPhase::Elementwise);
    // Under bf16 compute the norms' backward reads attention's bf16 gradients (widened
    // exactly, as a cast would).
    let (dq, dk) = match g.attn16.as_ref() {
        Some(a16) => (&a16.dq, &a16.dk),
        None => (&g.dqr, &g.dkr),
    };
    // q's gradient goes where the output's was: attention's backward has read that (or, under
    // bf16, its bf16 copy).
    for (dx, norm, dout, x, rstd, heads) in [
        (&mut g.datt, li.q_norm, dq, &a.q, &a.rstdq, d.heads),
        (&mut g.dk, li.k_norm, dk, &a.k, &a.rstdk, d.kv_heads),
    ] {
        let saved = NormSaved {
            x: x.view(),
            w: b.w(norm),
            rstd: rstd.view(),
        };
        let dw = grads.get_mut(norm).view_mut();
        let (dx, dout, rope) = (dx.view_mut(), dout.view(), d.rope(heads, 0));
        match docs {
            Some(dd) => be.head_norm_rope_backward_docs(dx, dw, dout, saved, dd, rope),
            None => be.head_norm_rope_backward(dx, dw, dout, saved, rope),
        }
    }
}

/// Backward of [`qkv_forward`]: `g.dxn` from the projections' gradients, then the input norm's,
/// added to `g.dres`.
fn qkv_backward(b: &Block, grads: &mut ParamStore, a: &BlockActs, g: &mut GradScratch, x: View) {
    let (be, li, d) = (b.cx.be, b.li, b.d);
    let (n, h, qd, kd, bf16) = (d.n, d.hidden, d.q_dim, d.kv_dim, d.bf16);
    // dxn = dQ·W_q + dK·W_k + dV·W_v and the weight gradients, in the order that reads dQ, dK
    // and dV twice in a row in A and xn1 in B three times with only bf16 weights in B between
    // (a bf16 backend casts each once; dxn's sum is in the same order).
    let dv = match g.attn16.as_ref() {
        Some(a16) => a16.dv.view(),
        None => g.dv.view(),
    };
    let gx = Gemm::new(n, h, kd, false, false)
        .bf16_inputs(bf16)
        .beta(1.0);
    let gq = Gemm::new(qd, h, n, true, false).bf16_inputs(bf16).beta(1.0);
    let gk = Gemm::new(kd, h, n, true, false).bf16_inputs(bf16).beta(1.0);
    be.phase(StepPhase::Dense);
    be.gemm(
        g.dxn.view_mut(),
        g.datt.view(),
        b.w(li.q),
        Gemm::new(n, h, qd, false, false).bf16_inputs(bf16),
    );
    be.gemm(
        grads.get_mut(li.q).view_mut(),
        g.datt.view(),
        a.xn1.view(),
        gq.unchanged(true, false),
    );
    be.gemm(g.dxn.view_mut(), g.dk.view(), b.w(li.k), gx);
    be.gemm(
        grads.get_mut(li.k).view_mut(),
        g.dk.view(),
        a.xn1.view(),
        gk.unchanged(true, true),
    );
    be.gemm(g.dxn.view_mut(), dv, b.w(li.v), gx);
    be.gemm(
        grads.get_mut(li.v).view_mut(),
        dv,
        a.xn1.view(),
        gk.unchanged(true, true),
    );
    let saved = NormSaved {
        x,
        w: b.w(li.in_norm),
        rstd: a.rstd1.view(),
    };
    let dw = grads.get_mut(li.in_norm).view_mut();
    be.phase(StepPhase::Elementwise);
    be.rmsnorm_backward(g.dres.view_mut(), dw, g.dxn.view(), saved, h);
}

/// Backward of [`ffn_forward`]: reads the output gradient from `g.dres`, writes
/// `g.dxn = beta·g.dxn + ∂/∂xn`, adds weight gradients.
fn ffn_backward(
    b: &Block,
    grads: &mut ParamStore,
    f: &FfnActs,
    xn: View,
    ffn: Ffn,
    g: &mut GradScratch,
    beta: f32,
) {
    let (be, params, bf16) = (b.cx.be, b.cx.params, b.d.bf16);
    let ((gate, up, down), parts, fs) = (ffn.idx, ffn.parts, ffn.fs);
    let (n, h, width) = (b.d.n, b.d.hidden, parts * fs);
    let nw = n * width;
    let ext = (n - 1) * width + fs;
    let (dfa, dfg, dfu) = (
        g.dfa.as_mut().unwrap(),
        g.dfg.as_mut().unwrap(),
        g.dfu.as_mut().unwrap(),
    );
    let wd = params.get(down);
    for s in 0..parts {
        // dres in A each time: cast by the first of these calls only.
        be.gemm(
            dfa.slice_mut(s * fs, ext),
            g.dres.view(),
            wd.slice(s * h * fs, h * fs),
            Gemm::new(n, fs, h, false, false)
                .bf16_inputs(bf16)
                .ld(h, fs, width)
                .unchanged(s > 0, false),
        );
        be.gemm(
            grads.get_mut(down).slice_mut(s * h * fs, h * fs),
            g.dres.view(),
            f.a.slice(s * fs, ext),
            Gemm::new(h, fs, n, true, false)
                .bf16_inputs(bf16)
                .ld(h, width, fs)
                .beta(1.0)
                .unchanged(true, false),
        );
    }
    let (dg, du) = (dfg.slice_mut(0, nw), dfu.slice_mut(0, nw));
    be.swiglu_backward(dg, du, dfa.slice(0, nw), f.g.slice(0, nw), f.u.slice(0, nw));
    // As the routed experts: dG and dU each read twice in a row in A, xn twice in B.
    let gx = Gemm::new(n, h, width, false, false).bf16_inputs(bf16);
    let gw = Gemm::new(width, h, n, true, false)
        .bf16_inputs(bf16)
        .beta(1.0);
    be.gemm(
        g.dxn.view_mut(),
        dfg.slice(0, nw),
        params.get(gate).view(),
        gx.beta(beta),
    );
    let dwg = gw.unchanged(true, false);
    be.gemm(grads.get_mut(gate).view_mut(), dfg.slice(0, nw), xn, dwg);
    be.gemm(
        g.dxn.view_mut(),
        dfu.slice(0, nw),
        params.get(up).view(),
        gx.beta(1.0),
    );
    let dwu = gw.unchanged(true, true);
    be.gemm(grads.get_mut(up).view_mut(), dfu.slice(0, nw), xn, dwu);
}

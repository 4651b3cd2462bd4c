//! The training step: embedding, blocks, head and loss forward; then the same in reverse. With
//! `AcMode::Full` only the block boundaries survive the forward, and backward recomputes each
//! block's internals right before backpropagating through it.

use crate::block::{block_backward, block_forward, Ctx, Kv, LayerRoute};
use crate::experts::{ExpertExecutor, LocalExperts};
use crate::workspace::{moe_slot, Workspace};
use crate::{MlpIdx, Model, StepOutput};
use anyhow::Result;
use ganymede_config::AcMode;
use ganymede_core::{
    embedding_segments, AuxGrad, Backend, Category, DType, EmbedIds, Gemm, NormSaved, ParamStore,
    StepPhase, Tensor, ViewMut,
};

/// Which pass wants a block's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// The backward pass (with `AcMode::Full`, the recompute runs inside it).
    Backward,
}

/// Where a step reads its parameters. Parallelism wraps the model through this trait (FSDP
/// gathers a block's shards in `acquire_block` and frees them in `release_block`) while the
/// model code stays the same at any rank count; [`LocalParams`] is the single-process source.
///
/// The hooks that may communicate return a `Result`: a failed collective (a peer that died or
/// stalled) ends the step, which returns the error as it is. After an error the source's step
/// is abandoned midway; its owner drops it rather than step again.
pub trait ParamSource {
    /// The parameter table as it stands: the final norm always, the embedding until
    /// `acquire_head` and the LM head from then on (FSDP may hold both in one tensor), a
    /// block's entries between its `acquire_block` and `release_block`.
    fn params(&self) -> &ParamStore;
    /// The forward pass is at the final norm: the LM head is about to be read (in this
    /// forward and the backward that follows), the embedding no longer.
    fn acquire_head(&mut self, _be: &dyn Backend) -> Result<()> {
        Ok(())
    }
    /// Block `l` is about to run in `pass`.
    fn acquire_block(&mut self, _be: &dyn Backend, _l: usize, _pass: Pass) -> Result<()> {
        Ok(())
    }
    /// Block `l` is done in `pass` (its parameters may go).
    fn release_block(&mut self, _be: &dyn Backend, _l: usize, _pass: Pass) -> Result<()> {
        Ok(())
    }
    /// The number of tokens the loss is a mean over: larger than `local` when this step sees a
    /// slice of a global batch (gradients and losses are then partial sums to be added up).
    fn global_tokens(&self, local: usize) -> usize {
        local
    }
    /// Sum the per-expert counts of routed rows of every MoE layer (`[moe layers, E]` f64, a
    /// device tensor) over the slices of the global batch, in place, so that the auxiliary
    /// loss's gradient is the global batch's. Called once, after the forward's last layer.
    fn reduce_counts(&mut self, _be: &dyn Backend, _counts: ViewMut) -> Result<()> {
        Ok(())
    }
    /// Sum the per-expert router probability sums of every MoE layer (`[moe layers, E]` f64,
    /// a device tensor) over the slices of the global batch, in place. Called once, at the
    /// step's end, before the step reads them for the auxiliary loss's value.
    fn reduce_psum(&mut self, _be: &dyn Backend, _psum: ViewMut) -> Result<()> {
        Ok(())
    }
}

/// Where a step adds its gradients. A block's gradient entries are written only between
/// `begin_block` and `end_block` (FSDP reduce-scatters them in `end_block`); the final norm's
/// and LM head's before `end_head` (the head's backward, the step's first); the embedding's
/// after `begin_embedding` (its backward, the step's last). FSDP reduce-scatters the head's
/// gradients at `end_head` and reuses their memory for the embedding's. Errors as
/// [`ParamSource`]'s.
pub trait GradSink {
    fn grads(&mut self) -> &mut ParamStore;
    fn begin_block(&mut self, _be: &dyn Backend, _l: usize) -> Result<()> {
        Ok(())
    }
    fn end_block(&mut self, _be: &dyn Backend, _l: usize) -> Result<()> {
        Ok(())
    }
    fn end_head(&mut self, _be: &dyn Backend) -> Result<()> {
        Ok(())
    }
    fn begin_embedding(&mut self, _be: &dyn Backend) -> Result<()> {
        Ok(())
    }
}

/// Every parameter resident: one process, no sharding.
pub struct LocalParams<'a>(pub &'a ParamStore);

impl ParamSource for LocalParams<'_> {
    fn params(&self) -> &ParamStore {
        self.0
    }
}

impl GradSink for ParamStore {
    fn grads(&mut self) -> &mut ParamStore {
        self
    }
}

/// One batch of a step: the input tokens and the token each position should predict, both
/// `[batch, seq]`.
#[derive(Clone, Copy)]
pub struct Tokens<'a> {
    pub inputs: &'a [u32],
    pub targets: &'a [u32],
    /// Under document masking (`data.document_mask`), where each input's document starts in its
    /// sequence (`[batch, seq]`, each at most the input's own position): attention stays within
    /// a document and RoPE positions restart at each. None: one causal sequence per row.
    pub doc_starts: Option<&'a [u32]>,
}

/// Where a pass finds its batch: tokens on the host, which it uploads first, or the ones
/// [`upload_tokens`] put in the workspace before it (a pass that a CUDA graph replays reads its
/// batch from device memory: the upload comes before the graph).
#[derive(Clone, Copy)]
pub enum Batch<'a> {
    Host(Tokens<'a>),
    Uploaded,
}

impl<'a> From<Tokens<'a>> for Batch<'a> {
    fn from(t: Tokens<'a>) -> Self {
        Batch::Host(t)
    }
}

/// What [`upload_tokens`] wrote into a workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Uploaded {
    /// Document starts (document masking).
    pub docs: bool,
    /// The ids' grouping, which a backward pass reads.
    pub backward: bool,
}

/// A batch's tokens into the workspace (host to device, no read): the ids and targets, the
/// document starts, and for a pass with a backward (`backward`) the ids' grouping by id, which
/// the embedding's backward reads. A pass then runs on [`Batch::Uploaded`].
pub fn upload_tokens(
    be: &dyn Backend,
    model: &Model,
    ws: &mut Workspace,
    tokens: Tokens,
    backward: bool,
) {
    check_batch(model, ws, tokens);
    let Tokens {
        inputs,
        targets,
        doc_starts,
    } = tokens;
    let n = ws.batch * ws.seq;
    let head = &mut ws.head;
    be.phase(StepPhase::Head);
    be.write_u32(head.ids.view_mut(), inputs);
    be.write_u32(head.targets.view_mut(), targets);
    if let Some(d) = doc_starts {
        // Made by the first masked step, outside the activation plan (N u32, like the loss).
        let t = head
            .docs
            .get_or_insert_with(|| be.zeros_of(&[n], DType::U32, Category::Buffers));
        be.write_u32(t.view_mut(), d);
    }
    if backward {
        // With the ids, their grouping by id: the host has them, the embedding's backward
        // would otherwise read them back.
        let (order, seg_start, seg_id) = embedding_segments(inputs);
        let mut groups = order;
        groups.extend(&seg_start);
        groups.resize(2 * n + 1, 0);
        groups.extend(&seg_id);
        groups.resize(3 * n + 1, 0);
        be.write_u32(head.id_groups.view_mut(), &groups);
        head.segments = seg_id.len();
    }
    head.uploaded = Some(Uploaded {
        docs: doc_starts.is_some(),
        backward,
    });
}

/// `batch` into the workspace unless it is there already; whether it has document starts.
fn take_batch(
    be: &dyn Backend,
    model: &Model,
    ws: &mut Workspace,
    batch: Batch,
    backward: bool,
) -> bool {
    if let Batch::Host(t) = batch {
        upload_tokens(be, model, ws, t, backward);
    }
    let up = ws
        .head
        .uploaded
        .expect("a pass on uploaded tokens before any upload_tokens");
    assert!(
        up.backward || !backward,
        "a backward pass on tokens uploaded without their grouping (upload_tokens(.., false))"
    );
    up.docs
}

/// What parallelism plugs into a training step: where parameters come from, where gradients
/// go, and who runs the routed experts. One process uses [`LocalParams`], a [`ParamStore`] and
/// [`LocalExperts`].
pub struct Hooks<'a> {
    pub params: &'a mut dyn ParamSource,
    pub grads: &'a mut dyn GradSink,
    pub experts: &'a mut dyn ExpertExecutor,
}

fn check_batch(model: &Model, ws: &Workspace, t: Tokens) {
    let Tokens {
        inputs,
        targets,
        doc_starts,
    } = t;
    let n = ws.batch * ws.seq;
    assert_eq!(
        inputs.len(),
        n,
        "inputs hold {} tokens; the workspace is for batch {} x seq {}",
        inputs.len(),
        ws.batch,
        ws.seq
    );
    assert_eq!(targets.len(), n, "targets and inputs differ in length");
    let v = model.config().vocab_size as u32;
    assert!(
        inputs.iter().chain(targets).all(|&t| t < v),
        "token id out of the vocabulary ({v})"
    );
    if let Some(d) = doc_starts {
        assert_eq!(d.len(), n, "document starts and inputs differ in length");
        // The kernels rely on it: a start after its token would leave it nothing to attend to.
        if let Some(i) = (0..n).find(|&i| i % ws.seq > 0 && d[i] < d[i - 1]) {
            panic!(
                "token {} of sequence {} starts its document at {}, before the token before it",
                i % ws.seq,
                i / ws.seq,
                d[i]
            );
        }
        if let Some(i) = (0..n).find(|&i| d[i] as usize > i % ws.seq) {
            panic!(
                "token {} of sequence {} starts its document at {}, after itself",
                i % ws.seq,
                i / ws.seq,
                d[i]
            );
        }
    }
}

/// Embedding, every block, final norm, logits and the summed cross-entropy. Writes the batch's
/// tokens into the workspace, leaves the logits in `ws.head.logits`, the loss sum in
/// `ws.head.loss` and the routing sums in `ws.route` (read at the step's end), and returns each
/// MoE layer's per-expert counts.
/// `backward`: a backward pass follows (which may read the blocks' internals).
fn forward(
    be: &dyn Backend,
    model: &Model,
    src: &mut dyn ParamSource,
    ex: &mut dyn ExpertExecutor,
    ws: &mut Workspace,
    batch: Batch,
    backward: bool,
) -> Result<()> {
    let docs = take_batch(be, model, ws, batch, backward);
    let cfg = model.config();
    let (batch, seq) = (ws.batch, ws.seq);
    let n = batch * seq;
    let (h, v) = (cfg.hidden, cfg.vocab_size);
    let Workspace {
        res,
        blocks,
        grads,
        head,
        mode,
        route,
        ..
    } = ws;
    be.phase(StepPhase::Head);
    // `head.xf` is free until the final norm: it stages what is rounded into bf16 boundaries.
    res.before_write(be, 0);
    be.embedding_forward(
        res.out(0, &mut head.xf),
        src.params().get(model.embed).view(),
        head.ids.view(),
        h,
    );
    res.store(be, 0, &head.xf);
    if backward {
        res.after_write(be, 0);
    }
    // Each dispatch adds its counts to its layer's row.
    if let Some(r) = route.as_mut() {
        be.fill(r.counts.view_mut(), 0.0);
    }
    for l in 0..model.layers.len() {
        let a = match mode {
            AcMode::None => &mut blocks[l],
            AcMode::Full => &mut blocks[0],
        };
        // The block boundaries' copies and casts.
        be.phase(StepPhase::Elementwise);
        res.before_write(be, l + 1);
        let (x, y) = res.pair(be, l, &mut head.xf);
        src.acquire_block(be, l, Pass::Forward)?;
        let cx = Ctx {
            be,
            model,
            params: src.params(),
            batch,
            seq,
            docs: head.docs.as_ref().filter(|_| docs).map(|d| d.view()),
        };
        let slot = route_slot(cfg, route, l, true);
        block_forward(&cx, a, grads, x, Some(y), Kv::Own, (l, slot, &mut *ex))?;
        src.release_block(be, l, Pass::Forward)?;
        be.phase(StepPhase::Elementwise);
        res.store(be, l + 1, &head.xf);
        if backward {
            res.after_write(be, l + 1);
        }
        // Internals the backward will not read (recomputed under full checkpointing, or no
        // backward at all): an executor holding its own may let them go now.
        if !backward || *mode == AcMode::Full {
            ex.discard(l);
        }
    }
    // The global batch's counts, which the auxiliary loss's gradient reads (on the device).
    if let Some(r) = route.as_mut() {
        src.reduce_counts(be, r.counts.view_mut())?;
    }
    src.acquire_head(be)?;
    be.phase(StepPhase::Head);
    let params = src.params();
    let eps = cfg.norm_eps as f32;
    // The last boundary is stored like the others: the head reads it widened, in forward and
    // (the working copy still holds it) in backward.
    res.widen(be, cfg.layers);
    let (xf, rstd) = (head.xf.view_mut(), head.rstd.view_mut());
    let norm = params.get(model.norm).view();
    be.rmsnorm_forward(xf, rstd, res.get(cfg.layers), norm, h, eps);
    // The loss a chunk of tokens at a time (one chunk unless `training.loss_chunk_tokens`
    // asks for less); the last chunk's logits stay for the backward.
    be.fill(head.loss.view_mut(), 0.0);
    for (r0, rows) in chunks(n, model.head_rows(n)) {
        head_logits(be, model, params, head, r0, rows);
        let lse = head.lse.slice_mut(r0, rows);
        let (logits, targets) = (head.logits.slice(0, rows * v), head.targets.slice(r0, rows));
        be.cross_entropy_forward(lse, logits, targets, v, head.loss.view_mut());
    }
    Ok(())
}

/// `(first row, rows)` of each chunk of `n` rows, `rows` at a time.
pub(crate) fn chunks(n: usize, rows: usize) -> impl DoubleEndedIterator<Item = (usize, usize)> {
    (0..n.div_ceil(rows.max(1))).map(move |c| (c * rows, rows.min(n - c * rows)))
}

/// The logits of tokens `r0 .. r0 + rows` into the head's logits buffer, from the final norm's
/// output.
fn head_logits(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    head: &mut crate::workspace::HeadActs,
    r0: usize,
    rows: usize,
) {
    let (h, v) = (model.config().hidden, model.config().vocab_size);
    be.gemm(
        head.logits.slice_mut(0, rows * v),
        head.xf.slice(r0 * h, rows * h),
        params.get(model.lm_head).view(),
        Gemm::new(rows, v, h, false, true).bf16_inputs(model.bf16),
    );
}

/// Layer `l`'s rows of the step's routing statistics (`None` for a dense layer), its counts
/// only where they are to be `counted` (not in a recompute).
fn route_slot<'a>(
    cfg: &ganymede_config::ModelConfig,
    route: &'a mut Option<crate::workspace::RouteStats>,
    l: usize,
    counted: bool,
) -> Option<LayerRoute<'a>> {
    let e = cfg.experts;
    let (r, slot) = route.as_mut().zip(moe_slot(cfg, l))?;
    Some(LayerRoute {
        psum: r.psum.slice_mut(slot * e, e),
        counts: counted.then(|| r.counts.slice_mut(slot * e, e)),
    })
}

/// The routing sums summed over the global batch's slices, on the device (the counts were
/// summed after the forward): what [`summarise`] and [`stash_output`] take.
fn reduce_route(be: &dyn Backend, src: &mut dyn ParamSource, ws: &mut Workspace) -> Result<()> {
    match ws.route.as_mut() {
        Some(r) => src.reduce_psum(be, r.psum.view_mut()),
        None => Ok(()),
    }
}

/// The step's one read of its scalars, at its end: the loss sum, the routing sums and the
/// global counts.
fn summarise(
    be: &dyn Backend,
    model: &Model,
    src: &mut dyn ParamSource,
    ws: &mut Workspace,
    n: usize,
) -> Result<StepOutput> {
    reduce_route(be, src, ws)?;
    let (psum, counts) = match ws.route.as_ref() {
        Some(r) => (
            be.download_f64(r.psum.view()),
            be.download_f64(r.counts.view()),
        ),
        None => (vec![], vec![]),
    };
    let loss_sum = be.download_f64(ws.head.loss.view())[0];
    Ok(output_of(model, loss_sum, &psum, &counts, n))
}

/// f64s of a step's routing figures in device memory: each MoE layer's routing sums, then
/// its counts (`[moe layers, E]` each; none without MoE layers). See
/// [`forward_backward_into`], [`read_output`].
pub fn route_len(model: &Model) -> usize {
    let cfg = model.config();
    let moe = (0..cfg.layers).filter(|&l| cfg.is_moe_layer(l)).count();
    2 * moe * cfg.experts
}

/// The step's figures copied device to device: the loss sum to `loss` (one f64), the routing
/// figures to `route` ([`route_len`]), to be read after the update with [`read_output`].
fn stash_output(be: &dyn Backend, ws: &Workspace, loss: ViewMut, mut route: ViewMut) {
    be.copy(loss, ws.head.loss.view());
    if let Some(r) = ws.route.as_ref() {
        let s = r.psum.len();
        be.copy(route.reborrow().slice(0, s), r.psum.view());
        be.copy(route.slice(s, s), r.counts.view());
    }
}

/// The [`StepOutput`] of the figures [`forward_backward_into`] stashed, read back: the loss
/// sum and the routing figures, for a global batch of `n` tokens.
pub fn read_output(model: &Model, loss_sum: f64, route: &[f64], n: usize) -> StepOutput {
    assert_eq!(route.len(), route_len(model), "a step's routing figures");
    let (psum, counts) = route.split_at(route.len() / 2);
    output_of(model, loss_sum, psum, counts, n)
}

/// Switch auxiliary loss per layer (`E · Σ_i f_i · P_i`, f_i = selections of i / tokens,
/// P_i = mean probability of i), averaged over MoE layers; and each layer's load; from the
/// loss sum, the routing sums and the global counts of a global batch of `n` tokens.
fn output_of(model: &Model, loss_sum: f64, psum: &[f64], counts: &[f64], n: usize) -> StepOutput {
    let cfg = model.config();
    let (e, k) = (cfg.experts as f64, cfg.top_k as f64);
    let nf = n as f64;
    let mut aux = 0.0;
    let mut loads = vec![];
    // Layer by layer, in order (their slots).
    let per = cfg.experts.max(1);
    for (counts, psum) in counts.chunks(per).zip(psum.chunks(per)) {
        aux += e * counts
            .iter()
            .zip(psum)
            .map(|(&c, &p)| (c / nf) * (p / nf))
            .sum::<f64>();
        loads.push(counts.iter().map(|&c| (c / (nf * k)) as f32).collect());
    }
    StepOutput {
        loss: loss_sum / nf,
        aux_loss: if loads.is_empty() {
            0.0
        } else {
            aux / loads.len() as f64
        },
        tokens: n,
        expert_load: loads,
    }
}

/// Forward + backward on one batch; ADDS grad_scale * d(loss_total)/dθ into `grads` (caller
/// zeroes), where loss_total = mean cross-entropy + aux_loss_coef · aux. Nothing here
/// communicates, so there is no error to return.
pub fn forward_backward(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    grads: &mut ParamStore,
    ws: &mut Workspace,
    tokens: Tokens,
    grad_scale: f32,
) -> StepOutput {
    let hooks = Hooks {
        params: &mut LocalParams(params),
        grads,
        experts: &mut LocalExperts,
    };
    local(forward_backward_with(
        be, model, hooks, ws, tokens, grad_scale,
    ))
}

/// The result of a pass through the single-process hooks ([`LocalParams`], a [`ParamStore`],
/// [`LocalExperts`]), none of which can fail.
pub(crate) fn local<T>(r: Result<T>) -> T {
    r.unwrap_or_else(|e| unreachable!("a single-process hook failed: {e:#}"))
}

/// [`forward_backward`] with parameters, gradients and routed experts through `hooks`, which
/// hear of each block before and after it runs. With a global batch split over ranks
/// (`params.global_tokens(n) > n`), the loss and gradients are this slice's share of the global
/// batch's: summed over the slices they equal one process's on the whole batch. A hook's error
/// (a failed collective) ends the pass and is returned as it is.
pub fn forward_backward_with(
    be: &dyn Backend,
    model: &Model,
    hooks: Hooks,
    ws: &mut Workspace,
    tokens: Tokens,
    grad_scale: f32,
) -> Result<StepOutput> {
    let (src, n) = forward_backward_core(be, model, hooks, ws, tokens.into(), grad_scale)?;
    summarise(be, model, src, ws, n)
}

/// [`forward_backward_with`] that reads nothing back: the step's figures are copied, device
/// to device, into `(loss, route)` (one f64, [`route_len`] f64s; the routing sums reduced over
/// the slices first) for the caller to read when it will, with [`read_output`]: a step's
/// update can then run before any read (issue 32). Returns the global batch's tokens, which
/// `read_output` takes.
pub fn forward_backward_into<'t>(
    be: &dyn Backend,
    model: &Model,
    hooks: Hooks,
    ws: &mut Workspace,
    batch: impl Into<Batch<'t>>,
    grad_scale: f32,
    (loss, route): (ViewMut, ViewMut),
) -> Result<usize> {
    assert_eq!(
        (loss.len(), route.len()),
        (1, route_len(model)),
        "forward_backward_into: the figures' places"
    );
    let (src, n) = forward_backward_core(be, model, hooks, ws, batch.into(), grad_scale)?;
    reduce_route(be, src, ws)?;
    stash_output(be, ws, loss, route);
    Ok(n)
}

/// Forward and backward, the figures left in `ws`; returns the parameter source (for the
/// routing sums' reduction) and the global batch's tokens.
fn forward_backward_core<'h>(
    be: &dyn Backend,
    model: &Model,
    hooks: Hooks<'h>,
    ws: &mut Workspace,
    batch: Batch,
    grad_scale: f32,
) -> Result<(&'h mut dyn ParamSource, usize)> {
    let Hooks {
        params: src,
        grads: sink,
        experts: ex,
    } = hooks;
    forward(be, model, src, ex, ws, batch, true)?;
    let docs = ws.head.uploaded.is_some_and(|u| u.docs);
    let cfg = model.config();
    let (batch, seq) = (ws.batch, ws.seq);
    let n = src.global_tokens(batch * seq);
    let local_n = batch * seq;
    let params = src.params();
    let grads = sink.grads();
    let (h, v) = (cfg.hidden, cfg.vocab_size);
    let Workspace {
        res,
        blocks,
        grads: g,
        head,
        mode,
        route,
        ..
    } = ws;

    // Head: in place, logits become their gradient, a chunk at a time from the last (whose
    // logits the forward left), the others' recomputed.
    let scale = grad_scale / n as f32;
    be.phase(StepPhase::Head);
    for (r0, rows) in chunks(local_n, model.head_rows(local_n)).rev() {
        if r0 + rows != local_n {
            head_logits(be, model, params, head, r0, rows);
        }
        let logits = head.logits.slice_mut(0, rows * v);
        let (lse, targets) = (head.lse.slice(r0, rows), head.targets.slice(r0, rows));
        be.cross_entropy_backward(logits, lse, targets, v, scale);
        let (logits, xf) = (
            head.logits.slice(0, rows * v),
            head.xf.slice(r0 * h, rows * h),
        );
        let gw = Gemm::new(v, h, rows, true, false)
            .bf16_inputs(model.bf16)
            .beta(1.0);
        be.gemm(grads.get_mut(model.lm_head).view_mut(), logits, xf, gw);
        // The logits' gradient again in A (the largest operand a step casts: rows · vocab).
        let gx = Gemm::new(rows, h, v, false, false)
            .bf16_inputs(model.bf16)
            .unchanged(true, false);
        be.gemm(
            g.dxn.slice_mut(r0 * h, rows * h),
            logits,
            params.get(model.lm_head).view(),
            gx,
        );
    }
    be.fill(g.dres.view_mut(), 0.0);
    let saved = NormSaved {
        x: res.get(cfg.layers),
        w: params.get(model.norm).view(),
        rstd: head.rstd.view(),
    };
    let dw = grads.get_mut(model.norm).view_mut();
    be.rmsnorm_backward(g.dres.view_mut(), dw, g.dxn.view(), saved, h);
    sink.end_head(be)?;

    // d(coef · mean_l aux_l)/d p[t, i] = coef · E · f_i / (N · M), the same for every token.
    let moe_layers = (0..cfg.layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .count()
        .max(1) as f64;
    let nf = n as f64;
    for (l, li) in model.layers.iter().enumerate().rev() {
        // The input comes back from host memory if it was offloaded; the next one starts to.
        // Recompute and backward read it widened, as the forward did.
        be.phase(StepPhase::Elementwise);
        res.before_backward(be, l);
        res.widen(be, l);
        src.acquire_block(be, l, Pass::Backward)?;
        sink.begin_block(be, l)?;
        let cx = Ctx {
            be,
            model,
            params: src.params(),
            batch,
            seq,
            docs: head.docs.as_ref().filter(|_| docs).map(|d| d.view()),
        };
        let a = match mode {
            AcMode::None => &mut blocks[l],
            AcMode::Full => {
                let a = &mut blocks[0];
                let slot = route_slot(cfg, route, l, false);
                block_forward(&cx, a, g, res.get(l), None, Kv::Own, (l, slot, &mut *ex))?;
                a
            }
        };
        // From the global counts on the device: no read, no upload.
        let aux = match (&li.mlp, route.as_ref(), moe_slot(cfg, l)) {
            (MlpIdx::Moe { .. }, Some(r), Some(slot)) => Some(AuxGrad {
                counts: r.counts.slice(slot * cfg.experts, cfg.experts),
                coef: grad_scale as f64 * cfg.aux_loss_coef * cfg.experts as f64
                    / (nf * moe_layers),
                tokens: nf,
            }),
            _ => None,
        };
        let x = res.get(l);
        block_backward(&cx, sink.grads(), a, g, x, aux, (l, &mut *ex))?;
        sink.end_block(be, l)?;
        src.release_block(be, l, Pass::Backward)?;
    }
    sink.begin_embedding(be)?;
    be.phase(StepPhase::Head);
    let dwte = sink.grads().get_mut(model.embed).view_mut();
    // This slice's tokens (`n` counts the global batch's), laid out as `forward` wrote them.
    let ln = local_n;
    let ids = EmbedIds {
        ids: head.ids.view(),
        order: head.id_groups.slice(0, ln),
        seg_start: head.id_groups.slice(ln, ln + 1),
        seg_id: head.id_groups.slice(2 * ln + 1, ln),
        segments: head.segments,
    };
    be.embedding_backward(dwte, g.dres.view(), ids, h);
    Ok((src, n))
}

/// Forward only (eval): the same losses, no gradients. Cannot fail, as [`forward_backward`].
pub fn forward_loss(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    ws: &mut Workspace,
    tokens: Tokens,
) -> StepOutput {
    let src = &mut LocalParams(params);
    local(forward_loss_with(
        be,
        model,
        src,
        &mut LocalExperts,
        ws,
        tokens,
    ))
}

/// [`forward_loss`] with parameters from `src` (see [`forward_backward_with`], errors too).
pub fn forward_loss_with<'t>(
    be: &dyn Backend,
    model: &Model,
    src: &mut dyn ParamSource,
    ex: &mut dyn ExpertExecutor,
    ws: &mut Workspace,
    batch: impl Into<Batch<'t>>,
) -> Result<StepOutput> {
    forward(be, model, src, ex, ws, batch.into(), false)?;
    let n = src.global_tokens(ws.batch * ws.seq);
    summarise(be, model, src, ws, n)
}

/// DeepSeek-V3 auxiliary-loss-free balancing, after a step: per MoE layer
/// `b_i += coeff · sign(mean_load - load_i)` (no-op if `router_bias_update == 0`).
pub fn update_router_bias(
    be: &dyn Backend,
    model: &Model,
    params: &mut ParamStore,
    out: &StepOutput,
) {
    let coeff = model.config().router_bias_update;
    if coeff == 0.0 {
        return;
    }
    for (bi, load) in model.router_biases().into_iter().zip(&out.expert_load) {
        router_bias_step(be, params.get_mut(bi), 0..load.len(), load, coeff);
    }
}

/// One layer's bias update on the entries `bias` holds: experts `experts` of that layer (all of
/// them in one process, a rank's slice under FSDP), from the global batch's loads of every
/// expert. Entries of `bias` past the slice (shard padding) are left alone.
pub fn router_bias_step(
    be: &dyn Backend,
    bias: &mut Tensor,
    experts: std::ops::Range<usize>,
    load: &[f32],
    coeff: f64,
) {
    let mean = load.iter().map(|&x| x as f64).sum::<f64>() / load.len() as f64;
    let mut b = be.download_f64(bias.view());
    for (k, e) in experts.enumerate() {
        let d = mean - load[e] as f64;
        // sign(0) = 0: a perfectly balanced expert keeps its bias.
        let step = if d == 0.0 { 0.0 } else { coeff * d.signum() };
        b[k] += step;
    }
    let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
    be.write(bias.view_mut(), &b32);
}

//! One rank's training state and its step: what `parallelize` makes of the model.
//!
//! [`RankState::new`] builds the model and wraps it for the mesh: at world size 1 every
//! parameter stays whole with the single-process optimizer ([`Shards::Whole`]); on more ranks
//! FSDP parameter and gradient hooks, the sharded optimizer and, with `ep > 1`, expert dispatch
//! ([`Shards::Fsdp`]). [`RankState::step`] is then the one training step at every world size:
//! forward and backward through those hooks, the global loss and gradient norm, clipping, the
//! optimizer, the router-bias update. The training loop (`ganymede_train::trainer`) drives it
//! the same way for one process, threads and MPI.
//!
//! Losses and gradients are normalised by the global batch's token count, so at any rank count
//! they are one process's on the same global batch (up to the order of floating-point sums).
//!
//! HSDP (`parallelism.dp_replicate > 1`): every world rank takes its own slice of the batch,
//! each replica runs FSDP over its `dp_shard` ranks, and [`FsdpGrads::finish`] sums the
//! gradient shards across replicas, so every replica takes the same optimizer step on the same
//! shards and the replicas stay identical without ever exchanging parameters.

use crate::compute_copy::ComputeCopy;
use crate::ep::EpExperts;
use crate::flexshard::{plan, policy};
use crate::fsdp::{FsdpGrads, FsdpParams, Groups};
use crate::layout::Layout;
use crate::optim::{OptimizerState, ShardedOptimizer};
use anyhow::{bail, Context, Result};
use ganymede_config::{AcMode, DeviceKind, JobConfig};
use ganymede_core::{
    in_phase, Backend, Category, CpuBackend, DType, GradScale, Ledger, ParamStore, PhaseTimes,
    StepPhase, Stream, Tensor, TwoMemoryOptions, View, ViewMut,
};
use ganymede_data::Dataset;
use ganymede_dist::{
    check_config_hash, config_hash, CommSnapshot, DeviceMesh, Phase, ProcessGroup, Tracer, Track,
};
use ganymede_model::{
    forward_backward_into, forward_loss_with, read_output, route_len, router_bias_step,
    upload_tokens, Batch, ExpertExecutor, Hooks, LocalExperts, LocalParams, Model, ParamSource,
    Pass, RowBufferUse, StepOutput, Tokens, Workspace,
};
use ganymede_optim::{lr_at, Optimizer};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// What one step reports (the same on every rank, except `comm`).
#[derive(Clone, Debug)]
pub struct StepReport {
    pub loss: f64,
    pub aux_loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    /// Tokens of the global batch.
    pub tokens: usize,
    pub expert_load: Vec<Vec<f32>>,
    /// This rank's bytes per phase and collective in the step.
    pub comm: CommSnapshot,
    /// Expert parallelism: this rank's dispatch buffers in the step.
    pub expert_rows: Option<RowBufferUse>,
    /// Expert parallelism: regrowths of the dispatch buffers in the step, summed over ranks.
    pub expert_regrowths: u64,
    /// Expert parallelism: the most rows one layer's experts received on any rank in the step,
    /// over an even routing's (what `parallelism.ep_capacity_factor` is held against).
    pub expert_rows_over_even: Option<f64>,
    /// This rank's milliseconds per phase (`metrics.phase_times`; see `ganymede_core::phase`).
    pub phase_times: Option<PhaseTimes>,
}

/// Add microbatch output `one` into `out`, the mean of `k`: loss, aux loss and expert loads
/// (fractions of equal token counts) averaged, tokens summed.
fn accumulate_output(out: &mut StepOutput, one: StepOutput, k: usize) {
    let w = 1.0 / k as f64;
    out.loss += one.loss * w;
    out.aux_loss += one.aux_loss * w;
    out.tokens += one.tokens;
    if out.expert_load.is_empty() {
        out.expert_load = one.expert_load.iter().map(|l| vec![0.0; l.len()]).collect();
    }
    for (acc, l) in out.expert_load.iter_mut().zip(&one.expert_load) {
        for (a, &x) in acc.iter_mut().zip(l) {
            *a += x * w as f32;
        }
    }
}

/// Expert parallelism's figures of a step, summed over all ranks in one small host
/// all-reduce after the update:
///
/// ```text
/// [ expert regrowths | rows over even: rank 0, rank 1, … ]
/// ```
///
/// Each rank puts its most rows over an even routing in its own slot (zeros in the others'),
/// so that after the sum the most over ranks is known without a max collective. (The loss and
/// the gradient norm are summed on the device, see [`StepScalars`].)
struct StepSums {
    packed: Vec<f64>,
}

impl StepSums {
    const EXPERT_REGROWTHS: usize = 0;
    /// The first of the per-rank slots.
    const ROWS_OVER_EVEN: usize = 1;

    /// Rank `rank` of `world_size`'s figures, in its slots.
    fn pack(u: RowBufferUse, (rank, world_size): (usize, usize)) -> Self {
        let mut packed = vec![0.0; Self::ROWS_OVER_EVEN + world_size];
        packed[Self::EXPERT_REGROWTHS] = u.regrowths as f64;
        packed[Self::ROWS_OVER_EVEN + rank] = u.peak as f64 / u.even.max(1) as f64;
        StepSums { packed }
    }

    /// Collective: every slot summed over all ranks.
    fn all_reduce(mut self, world: &dyn ProcessGroup) -> Result<Self> {
        world.all_reduce(ViewMut::Host64(&mut self.packed), Phase::Other)?;
        Ok(self)
    }

    fn expert_regrowths(&self) -> u64 {
        self.packed[Self::EXPERT_REGROWTHS] as u64
    }

    /// The most over ranks.
    fn expert_rows_over_even(&self) -> f64 {
        let slots = &self.packed[Self::ROWS_OVER_EVEN..];
        slots.iter().copied().fold(0.0, f64::max)
    }
}

/// The step's f64 figures in device memory, written by the step and read back once, after its
/// update (issue 32: nothing is read inside a step on one GPU):
///
/// ```text
/// t: [ grad sumsq | loss sum: microbatch 0 … k−1 | routing figures: microbatch 0 … k−1 ]
/// scale: [ clipping's coefficient ]
/// ```
///
/// Each microbatch's loss sum (this rank's slice's share of the global microbatch's) and
/// routing figures ([`route_len`], already global) are copied here as it ends. `grad sumsq`
/// is this rank's share of the squared gradient norm (over one replica's shards); the norm and
/// the losses are then summed over all ranks in one device all-reduce, so that every rank
/// holds the global figures. `scale`, which the update kernels read, is clipping's
/// coefficient worked out from them ([`ganymede_core::OptimOps::step_scale`]): NaN where one
/// is not finite, on every rank alike, which stops every rank's update.
struct StepScalars {
    t: Tensor,
    /// A microbatch's figures as its pass writes them (loss sum, routing figures), copied
    /// into its slot of `t` after it: every microbatch's pass then writes the same memory,
    /// one CUDA graph for all of them.
    current: Tensor,
    scale: Tensor,
    /// Microbatches per step.
    k: usize,
    route: usize,
}

impl StepScalars {
    const SUMSQ: usize = 0;
    const LOSSES: usize = 1;

    fn new(be: &dyn Backend, model: &Model, k: usize) -> Self {
        let route = route_len(model);
        let len = Self::LOSSES + k * (1 + route);
        StepScalars {
            t: be.zeros_of(&[len], DType::F64, Category::Buffers),
            current: be.zeros_of(&[1 + route], DType::F64, Category::Buffers),
            scale: be.zeros_of(&[1], DType::F64, Category::Buffers),
            k,
            route,
        }
    }

    /// Where a microbatch's pass writes its loss sum and routing figures.
    fn current(&mut self) -> (ViewMut<'_>, ViewMut<'_>) {
        self.current.view_mut().split_at(1)
    }

    /// The figures of the microbatch just run into microbatch `m`'s places.
    fn keep(&mut self, be: &dyn Backend, m: usize) {
        let (k, r) = (self.k, self.route);
        let (head, routes) = self.t.view_mut().split_at(Self::LOSSES + k);
        be.copy(head.slice(Self::LOSSES + m, 1), self.current.slice(0, 1));
        if r > 0 {
            be.copy(routes.slice(m * r, r), self.current.slice(1, r));
        }
    }

    /// The squared gradient norm's place.
    fn sumsq(&mut self) -> ViewMut<'_> {
        self.t.slice_mut(Self::SUMSQ, 1)
    }

    /// The figures summed over the ranks (and checked to be finite): the squared norm and the
    /// losses.
    fn summed(&mut self) -> ViewMut<'_> {
        self.t.slice_mut(Self::SUMSQ, self.summed_len())
    }

    fn summed_len(&self) -> usize {
        Self::LOSSES + self.k
    }

    /// Clipping's coefficient (NaN: no update) from the squared norm and the losses.
    fn set_scale(&mut self, be: &dyn Backend, max_norm: f64) {
        let sums = self.t.slice(Self::SUMSQ, self.summed_len());
        be.step_scale(self.scale.view_mut(), sums, max_norm);
    }

    /// Read back (the step's one read): the global squared norm, and each microbatch's
    /// output, `n` tokens each.
    fn read(&self, be: &dyn Backend, model: &Model, n: usize) -> (f64, Vec<StepOutput>) {
        let all = be.download_f64(self.t.view());
        let (k, r) = (self.k, self.route);
        let routes = &all[Self::LOSSES + k..];
        let outs = (0..k)
            .map(|m| read_output(model, all[Self::LOSSES + m], &routes[m * r..][..r], n))
            .collect();
        (all[Self::SUMSQ], outs)
    }
}

/// Stop a run whose step had a loss or gradient norm that is not finite. A NaN or an infinity
/// in any gradient makes the norm (a sum over all of them) non-finite even when the loss is
/// finite, and an update from it would spread it through every weight it touches: the update
/// kernels already skipped it (the step's NaN scale, [`StepScalars`]), and this says why.
pub fn check_finite(loss: f64, grad_norm: f64, step: usize, lr: f64) -> Result<()> {
    let at = step + 1;
    if !loss.is_finite() {
        bail!(
            "loss is {loss} at step {at}: training diverged (try a lower optimizer.lr than {lr:e})"
        );
    }
    if !grad_norm.is_finite() {
        bail!(
            "gradient norm is {grad_norm} at step {at} (loss {loss:.4}): a gradient overflowed or \
             is NaN; the step's update was not applied (try a lower optimizer.lr than {lr:e})"
        );
    }
    Ok(())
}

/// Where this rank's parameters, gradients and optimizer state live.
// One value per rank, built once: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Shards {
    /// World size 1: the whole model in one process, nothing to gather or scatter.
    Whole {
        params: ParamStore,
        grads: ParamStore,
        opt: Optimizer,
        /// Under bf16 compute, the bf16 weights the model reads (cast once per step).
        compute: Option<ComputeCopy>,
    },
    /// FSDP over the mesh: shards, gather and reduce-scatter hooks, the sharded optimizer.
    Fsdp {
        layout: Arc<Layout>,
        params: FsdpParams,
        grads: FsdpGrads,
        opt: ShardedOptimizer,
    },
}

/// What a microbatch's compute runs on besides the shards: the rank's backend, model,
/// workspace and expert executor.
struct Compute<'a> {
    be: &'a dyn Backend,
    model: &'a Model,
    ws: &'a mut Workspace,
    experts: &'a mut dyn ExpertExecutor,
}

/// Each operation of the step on whole parameters or on shards: the one place that tells the
/// two apart (the checkpoint's are in [`crate::checkpoint`]).
impl Shards {
    /// The layout of this rank's shards; `None` for whole parameters.
    pub fn layout(&self) -> Option<&Arc<Layout>> {
        match self {
            Shards::Whole { .. } => None,
            Shards::Fsdp { layout, .. } => Some(layout),
        }
    }

    /// This rank's gradients (whole, or its shards), in parameter order.
    fn grads_mut(&mut self) -> &mut [Tensor] {
        match self {
            Shards::Whole { grads, .. } => grads.tensors_mut(),
            Shards::Fsdp { grads, .. } => grads.shards_mut(),
        }
    }

    /// Zero the whole gradients before a step's first microbatch adds into them. FSDP's need
    /// no pass: the first microbatch's reduce-scatter replaces the shards.
    fn zero_grads(&mut self, be: &dyn Backend) {
        if let Shards::Whole { grads, .. } = self {
            for g in grads.tensors_mut() {
                be.fill(g.view_mut(), 0.0);
            }
        }
    }

    /// Before a step's work, what it must not do inside a CUDA graph: the bf16 compute copies
    /// cast if they are stale (a checkpoint load), and the update's step number and learning
    /// rate `lr` written to the device.
    fn begin_step(&mut self, be: &dyn Backend, lr: f64) {
        match self {
            Shards::Whole {
                params,
                opt,
                compute,
                ..
            } => {
                if let Some(c) = compute {
                    c.refresh(be, params);
                }
                opt.begin_step(be, lr)
            }
            Shards::Fsdp { opt, .. } => opt.begin_step(be, lr),
        }
    }

    /// The optimizer update at learning rate `lr`, each gradient scaled by the clipping
    /// coefficient `coef` as the update kernels read it.
    fn update(
        &mut self,
        be: &dyn Backend,
        mesh: &DeviceMesh,
        lr: f64,
        coef: GradScale,
    ) -> Result<()> {
        match self {
            Shards::Whole {
                params,
                grads,
                opt,
                compute,
            } => match compute {
                // The bf16 compute copy written by the update kernels themselves.
                Some(c) => {
                    c.update_with(|copy| opt.step_rounded(be, params, grads, lr, coef, copy))
                }
                None => opt.step_scaled(be, params, grads, lr, coef),
            },
            Shards::Fsdp {
                params, grads, opt, ..
            } => {
                let (master, shards) = (params.master_mut(), grads.shards_mut());
                opt.step_scaled(be, mesh, master, shards, lr, coef)?
            }
        }
        Ok(())
    }

    /// Microbatch `m` of `k` of a step: forward and backward on `tokens`, a global microbatch
    /// of `global` tokens, adding `1/k` of its gradients into the step's (FSDP: reduce-scattered,
    /// the first microbatch's replacing the shards, the others added to them).
    fn forward_backward(
        &mut self,
        c: Compute,
        tokens: Batch,
        global: usize,
        (m, k): (usize, usize),
        tracer: &Tracer,
        out: (ViewMut, ViewMut),
    ) -> Result<usize> {
        let Compute {
            be,
            model,
            ws,
            experts,
        } = c;
        let scale = 1.0 / k as f32;
        match self {
            Shards::Whole {
                params,
                grads,
                compute,
                ..
            } => {
                // The bf16 compute copy with the other masters lent in, or the masters alone.
                let mut local;
                let mut lent;
                let inner: &mut dyn ParamSource = match compute {
                    Some(c) => {
                        lent = c.lend(be, params);
                        &mut lent
                    }
                    None => {
                        local = LocalParams(params);
                        &mut local
                    }
                };
                let hooks = Hooks {
                    params: &mut TracedBlocks {
                        inner,
                        tracer,
                        started: None,
                    },
                    grads,
                    experts,
                };
                forward_backward_into(be, model, hooks, ws, tokens, scale, out)
            }
            Shards::Fsdp { params, grads, .. } => {
                in_phase(be, StepPhase::Communication, || -> Result<()> {
                    params.begin(be, true, global)?;
                    grads.begin(be, m > 0)
                })?;
                let hooks = Hooks {
                    params,
                    grads,
                    experts,
                };
                let one = forward_backward_into(be, model, hooks, ws, tokens, scale, out)?;
                in_phase(be, StepPhase::Communication, || {
                    grads.finish(be, m + 1 == k)
                })?;
                Ok(one)
            }
        }
    }

    /// The loss of `tokens`, a global microbatch of `global` tokens, without gradients.
    fn forward_loss(&mut self, c: Compute, tokens: Tokens, global: usize) -> Result<f64> {
        let Compute {
            be,
            model,
            ws,
            experts: ex,
        } = c;
        match self {
            Shards::Whole {
                params,
                compute: Some(c),
                ..
            } => Ok(forward_loss_with(be, model, &mut c.lend(be, params), ex, ws, tokens)?.loss),
            Shards::Whole { params, .. } => {
                Ok(forward_loss_with(be, model, &mut LocalParams(params), ex, ws, tokens)?.loss)
            }
            Shards::Fsdp { params, .. } => {
                params.begin(be, false, global)?;
                Ok(forward_loss_with(be, model, params, ex, ws, tokens)?.loss)
            }
        }
    }

    /// This rank's tensor of parameter `i` as the optimizer holds it (whole, or its master
    /// shard) with the range of its experts that is this `dp_shard` rank's.
    fn expert_part_mut(
        &mut self,
        i: usize,
        experts: usize,
        rank: usize,
    ) -> (&mut Tensor, Range<usize>) {
        match self {
            Shards::Whole { params, .. } => (params.get_mut(i), 0..experts),
            Shards::Fsdp { layout, params, .. } => {
                (&mut params.master_mut()[i], layout.range(i, rank))
            }
        }
    }

    /// The optimizer, whichever it is.
    pub fn opt(&self) -> &dyn OptimizerState {
        match self {
            Shards::Whole { opt, .. } => opt,
            Shards::Fsdp { opt, .. } => opt,
        }
    }

    pub fn opt_mut(&mut self) -> &mut dyn OptimizerState {
        match self {
            Shards::Whole { opt, .. } => opt,
            Shards::Fsdp { opt, .. } => opt,
        }
    }
}

/// The backend `device` asks for, with a fresh ledger, for the CPU kinds. A GPU backend is made
/// by whoever launches the ranks (the `ganymede` binary, the one crate that links it) and handed
/// to [`RankState::with_backend`]; `cuda` here is refused with the reason, never replaced by the
/// CPU.
pub fn backend(cfg: &JobConfig) -> Result<Arc<dyn Backend>> {
    let ledger = Arc::new(Ledger::new());
    let d = &cfg.device;
    Ok(match d.kind {
        DeviceKind::Cpu => Arc::new(CpuBackend::new(ledger)),
        DeviceKind::CpuTwoMemory => Arc::new(CpuBackend::two_memory(
            ledger,
            TwoMemoryOptions {
                device_capacity: (d.memory_gib > 0.0)
                    .then_some((d.memory_gib * (1u64 << 30) as f64) as u64),
                checking: d.check_streams,
            },
        )),
        DeviceKind::Cuda => bail!(
            "device.kind = \"cuda\": the CUDA backend is made by the ganymede binary (built \
             with `--features cuda`) and handed to the training state, not made here"
        ),
    })
}

/// Everything one rank holds.
pub struct RankState {
    pub be: Arc<dyn Backend>,
    pub model: Model,
    pub mesh: DeviceMesh,
    pub shards: Shards,
    pub ws: Workspace,
    /// The step's figures on the device, read once after the update.
    scalars: StepScalars,
    /// Routed experts: here (ep = 1) or over the ep group.
    pub experts: Box<dyn ExpertExecutor>,
    cfg: JobConfig,
    /// Steps this state has run: the first runs eagerly under `training.cuda_graphs` (it makes
    /// the scratch and state the graphs then reuse).
    steps_run: usize,
    /// The first of this state's graph keys (`ganymede_core::graph_keys`), one per
    /// [`StepGraph`].
    graph_keys: u64,
}

impl Drop for RankState {
    fn drop(&mut self) {
        if self.cfg.training.cuda_graphs {
            for g in StepGraph::ALL {
                self.be.forget_graph(self.graph_keys + g as u64);
            }
        }
    }
}

impl RankState {
    /// Collective over `world`: checks the configuration hash, builds the mesh and this rank's
    /// parameters (whole at world size 1, else its shards of the initial tensors).
    pub fn new(world: Arc<dyn ProcessGroup>, cfg: &JobConfig) -> Result<Self> {
        Self::build(world, cfg, None, true)
    }

    /// [`RankState::new`] on `be`, made by the caller for this rank (with a ledger of its own):
    /// how a GPU backend reaches the state.
    pub fn with_backend(
        world: Arc<dyn ProcessGroup>,
        cfg: &JobConfig,
        be: Arc<dyn Backend>,
    ) -> Result<Self> {
        Self::build(world, cfg, Some(be), true)
    }

    /// [`RankState::new`] with every parameter handed to the model in f32 under bf16 compute,
    /// each GEMM casting its weight again (what ran before the bf16 weights): the reference the
    /// tests hold the bf16 weights' losses and bytes against.
    #[doc(hidden)]
    pub fn new_with_f32_weights(world: Arc<dyn ProcessGroup>, cfg: &JobConfig) -> Result<Self> {
        Self::build(world, cfg, None, false)
    }

    /// `be`: the rank's backend, or `None` for the one [`backend`] makes from `cfg`.
    fn build(
        world: Arc<dyn ProcessGroup>,
        cfg: &JobConfig,
        be: Option<Arc<dyn Backend>>,
        bf16_weights: bool,
    ) -> Result<Self> {
        check_config_hash(world.as_ref(), config_hash(cfg))
            .context("ranks started with different configurations")?;
        let mesh = DeviceMesh::new(world.clone(), &cfg.parallelism)?;
        let micro = check_split(cfg, &mesh)?;
        check_graphs(cfg, &mesh)?;
        let shared = match be {
            Some(be) => be,
            None => backend(cfg)?,
        };
        let be: &dyn Backend = shared.as_ref();
        let (m, t) = (&cfg.model, &cfg.training);
        let model = Model::new(m)
            .with_compute_dtype(t.compute_dtype)
            .with_router_bf16(t.router_bf16(be.native_bf16()))
            .with_boundary_dtype(cfg.activation_checkpoint.boundary_dtype)
            .with_loss_chunk(t.loss_chunk_tokens)
            .with_moe_chunk(t.moe_chunk_tokens);
        let shards = build_shards(be, cfg, &model, &mesh, bf16_weights)?;
        let ac = &cfg.activation_checkpoint;
        let offloaded = match ac.mode {
            AcMode::Full => ganymede_config::offloaded_layers(ac.offload_fraction, m.layers),
            AcMode::None => 0,
        };
        let ws = Workspace::with_offload(be, &model, micro, m.seq_len, ac.mode, offloaded);
        let experts: Box<dyn ExpertExecutor> = if mesh.shape.ep > 1 {
            Box::new(EpExperts::new(
                mesh.ep.clone(),
                cfg.parallelism.ep_capacity_factor,
            ))
        } else {
            Box::new(LocalExperts)
        };
        if mesh.dp_shard.ctx().tracer.enabled() {
            be.trace_copies(true);
        }
        let scalars = StepScalars::new(be, &model, cfg.training.microbatches(mesh.world.size()));
        Ok(RankState {
            scalars,
            experts,
            be: shared,
            model,
            mesh,
            shards,
            ws,
            cfg: cfg.clone(),
            steps_run: 0,
            graph_keys: ganymede_core::graph_keys(StepGraph::ALL.len() as u64),
        })
    }

    pub fn config(&self) -> &JobConfig {
        &self.cfg
    }

    /// Every rank of the job (all replicas).
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.mesh.world
    }

    /// This rank's replica (0 without HSDP).
    pub fn replica(&self) -> usize {
        self.mesh.shape.replica_coords(self.mesh.world.rank()).0
    }

    /// Parameter count of the whole model.
    pub fn numel(&self) -> usize {
        self.model.param_specs().iter().map(|s| s.numel()).sum()
    }

    /// One optimizer step on global batch `step` (0-based): this rank's slice of the batch,
    /// forward and backward per microbatch, the gradient norm and clipping on the device, the
    /// update; then the step's one read, the cross-rank sums, the finite check and the router
    /// bias.
    pub fn step(&mut self, data: &Dataset, step: usize) -> Result<StepReport> {
        let world = self.mesh.world.clone();
        let ctx = world.ctx().clone();
        ctx.stats.reset();
        let be = self.be.clone();
        if self.cfg.metrics.phase_times {
            be.start_phases();
        }

        // Batch: this rank's slice of the global batch.
        let (batch, seq) = (self.cfg.training.batch_size, self.cfg.model.seq_len);
        let (x, y) = data.batch_slice(step as u64, batch, seq, world.rank(), world.size());
        let docs = data.batch_doc_starts(step as u64, batch, seq, world.rank(), world.size());

        // Forward and backward per microbatch, the gradients accumulated; the figures stay on
        // the device. Then the gradient norm and clipping's coefficient on the device, which
        // the update kernels read there: nothing is read back before the update. A norm or
        // loss that is not finite makes the coefficient NaN, and the kernels then write
        // nothing. Under `training.cuda_graphs`, after the first step, each of the three is a
        // graph's replay: what changes from step to step (tokens, learning rate) is written to
        // the device before them.
        let graphs =
            (self.cfg.training.cuda_graphs && self.steps_run > 0).then_some(self.graph_keys);
        let lr = lr_at(&self.cfg.optimizer, step, self.cfg.training.steps);
        self.shards.begin_step(be.as_ref(), lr);
        be.phase(StepPhase::Elementwise);
        let shards = &mut self.shards;
        in_graph(be.as_ref(), graphs, StepGraph::ZeroGrads, &mut || {
            shards.zero_grads(be.as_ref())
        });
        let n = self.forward_backward_microbatches(&x, &y, docs.as_deref(), &ctx.tracer, graphs)?;
        let t0 = Instant::now();
        be.phase(StepPhase::Optimizer);
        let mut done = Ok(());
        in_graph(be.as_ref(), graphs, StepGraph::Update, &mut || {
            done = self.norm_and_update(lr);
        });
        done?;
        self.steps_run += 1;

        // The step's one read (global figures), then expert parallelism's summed over ranks.
        let (sumsq, outs) = self.scalars.read(be.as_ref(), &self.model, n);
        let k = outs.len();
        let mut out = StepOutput {
            loss: 0.0,
            aux_loss: 0.0,
            tokens: 0,
            expert_load: Vec::new(),
        };
        for one in outs {
            accumulate_output(&mut out, one, k);
        }
        let expert_rows = self.experts.take_use();
        // Whether there are figures is the config's (expert parallelism), alike on all ranks.
        let sums = match expert_rows {
            Some(u) => Some(in_phase(be.as_ref(), StepPhase::Communication, || {
                StepSums::pack(u, (world.rank(), world.size())).all_reduce(world.as_ref())
            })?),
            None => None,
        };
        let (loss, norm) = (out.loss, sumsq.sqrt());
        // Every rank holds the same reduced values, so every rank stops here alike; the
        // update stopped itself on every rank (a NaN scale), so the weights (and the last
        // checkpoint) stay as they were.
        check_finite(loss, norm, step, self.cfg.optimizer.lr)?;
        if self.cfg.model.router_bias_update > 0.0 {
            self.update_router_bias(&out.expert_load);
        }
        ctx.tracer
            .record("optimizer", Track::Compute, t0, Instant::now(), None);
        self.trace_copies(&ctx.tracer);
        let phase_times = be.take_phase_times();

        // Metrics.
        Ok(StepReport {
            loss,
            aux_loss: out.aux_loss,
            grad_norm: norm,
            lr,
            tokens: out.tokens,
            expert_load: out.expert_load,
            comm: ctx.stats.snapshot(),
            expert_rows,
            expert_regrowths: sums.as_ref().map_or(0, StepSums::expert_regrowths),
            expert_rows_over_even: sums.as_ref().map(StepSums::expert_rows_over_even),
            phase_times,
        })
    }

    /// The gradient norm, clipping's coefficient and the update at learning rate `lr`, all on
    /// the device (after [`Shards::begin_step`]).
    fn norm_and_update(&mut self, lr: f64) -> Result<()> {
        let be = self.be.clone();
        self.global_grad_sumsq()?;
        self.scalars
            .set_scale(be.as_ref(), self.cfg.training.grad_clip);
        let scale = GradScale::Device(self.scalars.scale.view());
        self.shards.update(be.as_ref(), &self.mesh, lr, scale)
    }

    /// Gradient accumulation: forward and backward over this rank's slice (`inputs`, `targets`,
    /// `doc_starts`) in microbatches, each one's gradients its own global microbatch's mean
    /// times 1/k, added up before the one update; each one's figures stashed in
    /// [`StepScalars`]. Each microbatch's tokens go to the device first, then its pass runs on
    /// them (a graph's replay where `graphs`, the state's first graph key). Returns the tokens
    /// of a global microbatch.
    fn forward_backward_microbatches(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        doc_starts: Option<&[u32]>,
        tracer: &Tracer,
        graphs: Option<u64>,
    ) -> Result<usize> {
        let world = self.mesh.world.size();
        let seq = self.cfg.model.seq_len;
        let micro = self.cfg.training.micro_batch(world);
        let global = world * micro * seq;
        let (mut n, k) = (global, self.scalars.k);
        let be = self.be.clone();
        for m in 0..k {
            let rows = m * micro * seq..(m + 1) * micro * seq;
            let tokens = Tokens {
                inputs: &inputs[rows.clone()],
                targets: &targets[rows.clone()],
                doc_starts: doc_starts.map(|d| &d[rows]),
            };
            upload_tokens(be.as_ref(), &self.model, &mut self.ws, tokens, true);
            let mut done = Ok(());
            in_graph(be.as_ref(), graphs, StepGraph::Microbatch, &mut || {
                let c = Compute {
                    be: be.as_ref(),
                    model: &self.model,
                    ws: &mut self.ws,
                    experts: &mut *self.experts,
                };
                let out = self.scalars.current();
                let one =
                    self.shards
                        .forward_backward(c, Batch::Uploaded, global, (m, k), tracer, out);
                done = one.map(|one| n = one);
            });
            done?;
            self.scalars.keep(be.as_ref(), m);
        }
        Ok(n)
    }

    /// The global squared gradient norm into [`StepScalars`], on the device: this rank's
    /// share of the trainable gradients summed there, then summed over the ranks with the
    /// losses.
    fn global_grad_sumsq(&mut self) -> Result<()> {
        let specs = self.model.param_specs();
        let be = self.be.as_ref();
        be.fill(self.scalars.sumsq(), 0.0);
        // The norm is over one replica's shards only: after the cross-replica all-reduce every
        // replica holds the same gradients, so counting them all would multiply the norm by
        // the replica count.
        if self.replica() == 0 {
            let grads = self.shards.grads_mut().iter().zip(specs);
            let trainable = grads.filter(|(_, s)| s.kind.is_trainable());
            let views: Vec<View> = trainable.map(|(g, _)| g.view()).collect();
            be.sumsq_acc_many(self.scalars.sumsq(), &views);
        }
        let world = &self.mesh.world;
        if world.size() > 1 {
            in_phase(be, StepPhase::Communication, || {
                world
                    .all_reduce(self.scalars.summed(), Phase::Other)
                    .context("summing the gradient norm and the loss")
            })?;
        }
        Ok(())
    }

    /// Move the backend's finished asynchronous copies onto the trace's copy tracks.
    fn trace_copies(&self, tracer: &Tracer) {
        if !tracer.enabled() {
            return;
        }
        for c in self.be.take_copy_spans() {
            let (track, what) = match c.stream {
                Stream::ToHost => (Track::ToHost, "to host"),
                Stream::FromHost => (Track::FromHost, "from host"),
                Stream::Comm | Stream::Compute => (Track::Comm, "copy"),
            };
            tracer.record(what, track, c.start, c.end, Some(c.bytes));
        }
    }

    /// Collective: mean loss over `metrics.val_batches` fixed validation batches (aux excluded),
    /// each split over the ranks like a training batch: one process's figure at any rank count.
    /// `source`: a prepared data source's held-out windows (as `Dataset::val_sources` lists
    /// them) instead of the run's one validation split.
    pub fn validate(&mut self, data: &Dataset, source: Option<usize>) -> Result<f64> {
        let world = self.mesh.world.clone();
        let (w, r) = (world.size(), world.rank());
        let (batch, seq) = (self.cfg.training.batch_size, self.cfg.model.seq_len);
        let per = batch / w;
        // In microbatches as training runs them, each its own global batch's mean.
        let micro = self.cfg.training.micro_batch(w);
        let k = per / micro;
        let nb = self.cfg.metrics.val_batches.max(1);
        let mut sums = vec![0f64; nb];
        let be: &dyn Backend = self.be.as_ref();
        for (i, s) in sums.iter_mut().enumerate() {
            let (x, y) = match source {
                Some(src) => data.val_batch_of(src, i, batch, seq),
                None => data.val_batch(i, batch, seq),
            };
            let docs = data.val_doc_starts(source, i, batch, seq);
            for m in 0..k {
                let r0 = (r * per + m * micro) * seq;
                let rows = r0..r0 + micro * seq;
                let tokens = Tokens {
                    inputs: &x[rows.clone()],
                    targets: &y[rows.clone()],
                    doc_starts: docs.as_ref().map(|d| &d[rows]),
                };
                let c = Compute {
                    be,
                    model: &self.model,
                    ws: &mut self.ws,
                    experts: &mut *self.experts,
                };
                *s += self.shards.forward_loss(c, tokens, w * micro * seq)? / k as f64;
            }
        }
        world.all_reduce(ViewMut::Host64(&mut sums), Phase::Other)?;
        Ok(sums.iter().sum::<f64>() / nb as f64)
    }

    /// The DeepSeek-V3 bias update on this rank's part of each bias (loads are the global
    /// batch's, so every rank agrees).
    fn update_router_bias(&mut self, loads: &[Vec<f32>]) {
        let coeff = self.cfg.model.router_bias_update;
        let rank = self.mesh.dp_shard.rank();
        let biases = self.model.router_biases();
        for (&i, load) in biases.iter().zip(loads) {
            // The selection bias is f32 (not in a bf16 compute copy).
            let (t, experts) = self.shards.expert_part_mut(i, load.len(), rank);
            router_bias_step(self.be.as_ref(), t, experts, load, coeff);
        }
    }
}

/// The graphs of a step under `training.cuda_graphs` (see [`RankState::step`]).
#[derive(Clone, Copy)]
enum StepGraph {
    ZeroGrads = 0,
    Microbatch = 1,
    Update = 2,
}

impl StepGraph {
    const ALL: [StepGraph; 3] = [
        StepGraph::ZeroGrads,
        StepGraph::Microbatch,
        StepGraph::Update,
    ];
}

/// `body` as graph `g` of the keys from `keys` on where `Some`, else run as it is (see
/// `Memory::graph`).
fn in_graph(be: &dyn Backend, keys: Option<u64>, g: StepGraph, body: &mut dyn FnMut()) {
    match keys {
        Some(k) => {
            be.graph(k + g as u64, body);
        }
        None => body(),
    }
}

/// What `training.cuda_graphs` cannot capture: collectives (more than one rank) and the
/// offloads' copies on other streams, which wait on the host.
fn check_graphs(cfg: &JobConfig, mesh: &DeviceMesh) -> Result<()> {
    if !cfg.training.cuda_graphs {
        return Ok(());
    }
    let why = if mesh.world.size() > 1 {
        format!("{} ranks (one GPU only)", mesh.world.size())
    } else if cfg.optimizer.offload {
        "optimizer.offload = true".into()
    } else if cfg.activation_checkpoint.offload_fraction > 0.0 {
        format!(
            "activation_checkpoint.offload_fraction = {}",
            cfg.activation_checkpoint.offload_fraction
        )
    } else {
        return Ok(());
    };
    bail!("training.cuda_graphs = true does not go with {why}: set it to false")
}

/// The layout's checks on how the batch splits (every rank's share, whole microbatches of it);
/// the sequences in one microbatch.
fn check_split(cfg: &JobConfig, mesh: &DeviceMesh) -> Result<usize> {
    // The batch is split over every rank (all replicas); parameters over one replica's.
    let (w, t) = (mesh.world.size(), &cfg.training);
    if mesh.shape.dp_replicate > 1 && mesh.shape.dp_shard == 1 {
        bail!("parallelism.dp_replicate > 1 needs parallelism.dp_shard > 1 (plain DDP is not implemented)");
    }
    if !t.batch_size.is_multiple_of(w) {
        bail!(
            "training.batch_size = {} cannot be split evenly over {w} ranks",
            t.batch_size
        );
    }
    let micro = t.micro_batch(w);
    if micro == 0 || !(t.batch_size / w).is_multiple_of(micro) {
        bail!(
            "training.micro_batch_size = {} does not divide a rank's {} sequences \
             (training.batch_size = {} over {w} ranks)",
            t.micro_batch_size,
            t.batch_size / w,
            t.batch_size
        );
    }
    Ok(micro)
}

/// The rank's parameters, gradients and optimizer: whole on one process (`dp_shard` 1), else
/// sharded by FlexShard's plan, every rank drawing the same initial tensors one at a time and
/// keeping its shard of each.
fn build_shards(
    be: &dyn Backend,
    cfg: &JobConfig,
    model: &Model,
    mesh: &DeviceMesh,
    bf16_weights: bool,
) -> Result<Shards> {
    let seed = cfg.training.seed;
    if mesh.shape.dp_shard == 1 {
        let params = model.init_params(be, seed);
        let grads = ParamStore::zeros(be, model.param_specs(), Category::Grads);
        let opt = Optimizer::new(be, &cfg.optimizer, model.param_specs());
        let compute = ComputeCopy::new(be, model).filter(|_| bf16_weights);
        return Ok(Shards::Whole {
            params,
            grads,
            opt,
            compute,
        });
    }
    let pl = plan(model.param_specs(), mesh.shape, policy(cfg))?;
    let layers = cfg.model.layers;
    let layout = Arc::new(Layout::new(
        model.param_specs(),
        layers,
        &pl,
        mesh.ep.rank(),
    ));
    let groups = Groups::of(mesh);
    let p = &cfg.parallelism;
    let init = |i: usize| model.init_param(be, i, seed);
    let bf16 = (0..layout.specs.len())
        .map(|i| bf16_weights && model.bf16_weight(i))
        .collect();
    let params = FsdpParams::new(
        be,
        layout.clone(),
        groups.clone(),
        p.gather_dtype,
        bf16,
        p.prefetch,
        cfg.optimizer.offload,
        &init,
    );
    let grads = FsdpGrads::new(be, layout.clone(), groups, p.gradient_sets);
    let opt = ShardedOptimizer::new(be, &cfg.optimizer, &layout, mesh, pl);
    Ok(Shards::Fsdp {
        layout,
        params,
        grads,
        opt,
    })
}

/// The single-process parameter source, recording each block's compute on the trace as the
/// FSDP hooks do on more ranks (so a world of one shows its copies against its blocks too).
struct TracedBlocks<'a> {
    inner: &'a mut dyn ParamSource,
    tracer: &'a Tracer,
    started: Option<Instant>,
}

impl ParamSource for TracedBlocks<'_> {
    fn params(&self) -> &ParamStore {
        self.inner.params()
    }
    fn acquire_head(&mut self, be: &dyn Backend) -> Result<()> {
        self.inner.acquire_head(be)
    }
    fn acquire_block(&mut self, _be: &dyn Backend, _l: usize, _pass: Pass) -> Result<()> {
        self.started = self.tracer.enabled().then(Instant::now);
        Ok(())
    }
    fn release_block(&mut self, _be: &dyn Backend, l: usize, pass: Pass) -> Result<()> {
        if let Some(t0) = self.started.take() {
            let name = match pass {
                Pass::Forward => format!("block {l} forward"),
                Pass::Backward => format!("block {l} backward"),
            };
            self.tracer
                .record(name, Track::Compute, t0, Instant::now(), None);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{check_finite, RowBufferUse, StepSums};

    /// Two ranks' packed figures, summed slot by slot as the all-reduce would: the regrowths
    /// summed, the most rows over even.
    #[test]
    fn step_sums_name_their_slots() {
        let rows = |peak, regrowths| RowBufferUse {
            capacity: 64,
            peak,
            even: 16,
            regrowths,
        };
        let a = StepSums::pack(rows(40, 2), (0, 2));
        let b = StepSums::pack(rows(24, 1), (1, 2));
        assert_eq!(a.packed, [2.0, 2.5, 0.0]);
        assert_eq!(b.packed, [1.0, 0.0, 1.5]);
        let packed = a.packed.iter().zip(&b.packed).map(|(x, y)| x + y).collect();
        let sum = StepSums { packed };
        assert_eq!(sum.expert_regrowths(), 3);
        assert_eq!(sum.expert_rows_over_even(), 2.5);
    }

    #[test]
    fn a_step_with_a_non_finite_loss_or_gradient_norm_stops() {
        assert!(check_finite(2.5, 0.7, 3, 1e-3).is_ok());
        let e = check_finite(f64::NAN, 0.7, 3, 1e-3)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("loss is NaN at step 4") && e.contains("lower optimizer.lr than 1e-3"),
            "{e}"
        );
        let e = check_finite(f64::INFINITY, 0.7, 0, 1e-3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("loss is inf at step 1"), "{e}");
        // A finite loss does not let a non-finite gradient through.
        for norm in [f64::NAN, f64::INFINITY] {
            let e = check_finite(2.5, norm, 9, 1e-3).unwrap_err().to_string();
            assert!(
                e.contains(&format!("gradient norm is {norm} at step 10"))
                    && e.contains("not applied"),
                "{e}"
            );
        }
    }
}

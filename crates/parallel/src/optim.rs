//! The optimizer on shards. AdamW, Nesterov momentum and the decayed update are elementwise, so
//! they run on each rank's shards through the single-process optimizer's own update rule
//! ([`ganymede_optim::Step::update`]); only Newton–Schulz needs whole matrices, and
//! [`ganymede_dist::muon_exchange`] brings them where the plan ([`crate::flexshard`]) says
//! (FlexShard: experts on their owners with no communication, dense matrices on LPT owners;
//! naive: every matrix gathered on a round-robin root). Padding stays zero throughout (zero
//! gradient, zero state, zero parameter).
//!
//! With `optimizer.offload` the master shards (see [`crate::fsdp`]) and the state shards
//! (momentum, AdamW moments) live in host memory, and the elementwise part streams them through
//! two device slots ([`Staging`]): AdamW's parameter with its moments, Muon's momentum before
//! Newton–Schulz and its parameter after.

use crate::flexshard::batch_counts;
use crate::layout::Layout;
use ganymede_config::OptimizerConfig;
use ganymede_core::{Backend, Category, GradScale, Tensor, ViewMut};
use ganymede_dist::{muon_exchange, root_buffers, DeviceMesh, NsJob, Plan};
use ganymede_optim::{
    indexed_state_mut, newton_schulz_batch, newton_schulz_strided, ns_flops, stream_states,
    update_rule, MuonParam, NsScratch, Optimizer, ParamState, RateBuffer, SkipWait, Staging,
    StateView, Step, UpdateRule, PAR_MATRIX_MAX_FLOPS,
};
use std::sync::Arc;

/// What the rank's checkpoints need of its optimizer, whole-parameter or sharded.
pub trait OptimizerState {
    /// State tensors as `(parameter index, checkpoint suffix, tensor)`, in parameter order.
    fn state_mut(&mut self) -> Vec<(usize, &'static str, &mut Tensor)>;
    /// Block the host until host-resident state written back by the last step is complete.
    fn synchronize_state(&self, be: &dyn Backend);
    /// Steps taken so far (AdamW's bias correction uses it).
    fn step_count(&self) -> u64;
    fn set_step_count(&mut self, n: u64);
}

impl OptimizerState for Optimizer {
    fn state_mut(&mut self) -> Vec<(usize, &'static str, &mut Tensor)> {
        self.state_indexed_mut()
    }
    fn synchronize_state(&self, be: &dyn Backend) {
        Optimizer::synchronize_state(self, be)
    }
    fn step_count(&self) -> u64 {
        Optimizer::step_count(self)
    }
    fn set_step_count(&mut self, n: u64) {
        Optimizer::set_step_count(self, n)
    }
}

impl OptimizerState for ShardedOptimizer {
    fn state_mut(&mut self) -> Vec<(usize, &'static str, &mut Tensor)> {
        ShardedOptimizer::state_mut(self)
    }
    fn synchronize_state(&self, be: &dyn Backend) {
        ShardedOptimizer::synchronize_state(self, be)
    }
    fn step_count(&self) -> u64 {
        ShardedOptimizer::step_count(self)
    }
    fn set_step_count(&mut self, n: u64) {
        ShardedOptimizer::set_step_count(self, n)
    }
}

pub struct ShardedOptimizer {
    cfg: OptimizerConfig,
    rules: Vec<UpdateRule>,
    states: Vec<ParamState>,
    plan: Plan,
    /// Newton–Schulz scratch: `[0]` fits every shape, the rest (one per further thread) the
    /// small ones, whose stacks (experts) are spread across threads whole.
    scratch: Vec<NsScratch>,
    /// With `optimizer.ns_batch` batching (a GPU's default): scratch for the largest strided
    /// batch of a matrix set this rank may orthogonalise ([`batch_counts`]).
    batch: Option<NsScratch>,
    /// With `optimizer.offload`: state in host memory, streamed through these device slots.
    staging: Option<Staging>,
    /// The whole matrices this rank gathers as a Newton–Schulz root (`root_buffers` order).
    roots: Vec<Tensor>,
    /// The step's learning rate and bias corrections in device memory (taken out during a step).
    rate: Option<RateBuffer>,
    step: u64,
}

impl ShardedOptimizer {
    pub fn new(
        be: &dyn Backend,
        cfg: &OptimizerConfig,
        layout: &Arc<Layout>,
        mesh: &DeviceMesh,
        plan: Plan,
    ) -> Self {
        let rules: Vec<UpdateRule> = layout.specs.iter().map(|s| update_rule(cfg, s)).collect();
        let states: Vec<ParamState> = rules
            .iter()
            .enumerate()
            .map(|(i, r)| ParamState::new(be, r, &[layout.shard[i]], cfg.offload))
            .collect();
        let shapes: Vec<(usize, usize)> = rules
            .iter()
            .filter_map(|r| match *r {
                UpdateRule::Muon { rows, cols, .. } => Some((rows, cols)),
                _ => None,
            })
            .collect();
        // Each slot holds the largest one shard's state, and an AdamW shard's parameter with it.
        let staging = cfg.offload.then(|| {
            let elems = states
                .iter()
                .map(|s| match s {
                    ParamState::Muon { momentum } => momentum.len(),
                    ParamState::AdamW { m, v } => 3 * m.len().max(v.len()),
                    ParamState::Frozen => 0,
                })
                .max()
                .unwrap_or(0);
            Staging::new(be, elems)
        });
        let small: Vec<(usize, usize)> = shapes
            .iter()
            .copied()
            .filter(|&(r, c)| ns_flops(r, c, cfg.ns_steps) <= PAR_MATRIX_MAX_FLOPS)
            .collect();
        let (steps, bf16) = (cfg.ns_steps, ganymede_optim::ns_bf16(cfg.ns_dtype, be));
        let mut scratch = vec![NsScratch::for_shapes(be, shapes).prepared(be, steps, bf16)];
        if !small.is_empty() {
            let extra = rayon::current_num_threads() - 1;
            scratch.extend((0..extra).map(|_| {
                NsScratch::for_shapes(be, small.iter().copied()).prepared(be, steps, bf16)
            }));
        }
        // In place on the gradient shards: no Nesterov copy.
        let batch = cfg.ns_batch.on(be.batches_matrices()).then(|| {
            let budget = ganymede_config::NS_STACK_BYTES;
            let (_, ss, sl) = ganymede_config::ns_batch_elems(&batch_counts(&plan), budget);
            NsScratch::from_lens(be, ss, sl).prepared(be, steps, bf16)
        });
        // The matrices this rank gathers whole for Newton–Schulz, made once.
        let roots = root_buffers(&plan, mesh)
            .iter()
            .filter(|&&(i, _)| matches!(rules[i], UpdateRule::Muon { .. }))
            .map(|&(_, n)| be.zeros(&[n], Category::Buffers))
            .collect();
        ShardedOptimizer {
            cfg: cfg.clone(),
            rules,
            states,
            plan,
            scratch,
            batch,
            staging,
            roots,
            rate: Some(RateBuffer::new(be)),
            step: 0,
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }
    pub fn set_step_count(&mut self, n: u64) {
        self.step = n;
    }

    /// State shards as `(parameter index, checkpoint suffix, shard)`, in parameter order; the
    /// suffixes are the single-process optimizer's (`muon_momentum`, `adam_m`, `adam_v`), so a
    /// gathered checkpoint is the same file one process writes.
    pub fn state_mut(&mut self) -> Vec<(usize, &'static str, &mut Tensor)> {
        indexed_state_mut(&mut self.states)
    }

    /// Block the host until host-resident state written back by the last step is complete
    /// (before checkpoints read or overwrite it); a no-op without `optimizer.offload`.
    pub fn synchronize_state(&self, be: &dyn Backend) {
        if let Some(s) = &self.staging {
            s.synchronize(be);
        }
    }

    /// Device bytes of the offload staging slots (0 without `optimizer.offload`).
    pub fn staging_bytes(&self) -> u64 {
        self.staging.as_ref().map_or(0, |s| s.bytes() as u64)
    }

    /// Leave one wait of the offload pipeline out (tests of the checking mode).
    #[doc(hidden)]
    pub fn skip_offload_wait(&mut self, w: SkipWait) {
        self.staging
            .as_mut()
            .expect("optimizer.offload is off")
            .skip_wait(w);
    }

    /// The next step's number and learning rate `lr`, into device memory ahead of its update
    /// (see `Optimizer::begin_step`).
    pub fn begin_step(&mut self, be: &dyn Backend, lr: f64) {
        let rate = self
            .rate
            .as_mut()
            .expect("the rate buffer is back after each step");
        rate.begin(be, &self.cfg, &mut self.step, lr)
    }

    /// One update of the shards `params` from the gradient shards `grads`; collective over the
    /// mesh when Muon is in use. With `optimizer.offload`, `params` are in host memory too, and
    /// complete when this returns. A Muon parameter's gradient shard becomes its update (Nesterov
    /// momentum in place, then Newton–Schulz), so no update buffer is held between steps: the
    /// gradient shards are not read again before the next step's reduce-scatters overwrite them.
    pub fn step(
        &mut self,
        be: &dyn Backend,
        mesh: &DeviceMesh,
        params: &mut [Tensor],
        grads: &mut [Tensor],
        lr: f64,
    ) -> ganymede_dist::Result<()> {
        self.step_scaled(be, mesh, params, grads, lr, GradScale::Host(1.0))
    }

    /// [`Self::step`] from the gradients times `grad_scale` (global-norm clipping's coefficient),
    /// applied by the update kernels as they read each gradient: the same bits as scaling the
    /// shards first, without a pass over them.
    pub fn step_scaled(
        &mut self,
        be: &dyn Backend,
        mesh: &DeviceMesh,
        params: &mut [Tensor],
        grads: &mut [Tensor],
        lr: f64,
        grad_scale: GradScale,
    ) -> ganymede_dist::Result<()> {
        // Out of `self` for the step, which borrows it while `self`'s methods run.
        let mut rate = self
            .rate
            .take()
            .expect("the rate buffer is back after each step");
        let rate_now = rate.for_update(be, &self.cfg, &mut self.step, lr);
        let s = Step::new(be, &self.cfg, self.step, lr, grad_scale, rate_now);
        let rules = &self.rules;
        // Each shard's update; a Muon shard's gradient becomes its update (Nesterov momentum
        // in place), orthogonalised and applied below.
        let momentum = |m: MuonParam<ViewMut>| s.momentum(be, m.momentum, m.g);
        if let Some(staging) = &mut self.staging {
            // Host-resident state and master shards: each shard's through a device slot, an
            // AdamW parameter shard staged before its moments.
            let mut ps: Vec<Option<&mut Tensor>> = params.iter_mut().map(Some).collect();
            let adamw = |i: usize| matches!(rules[i], UpdateRule::AdamW { .. });
            let extra = |i: usize| match adamw(i) {
                true => vec![ps[i].take().expect("each shard staged once")],
                false => vec![],
            };
            stream_states(be, staging, &mut self.states, extra, |i, slot| {
                let (p, slot) = match adamw(i) {
                    true => {
                        let (p, state) = slot.split_at(grads[i].len());
                        (Some(p), state)
                    }
                    false => (None, slot),
                };
                let state = StateView::staged(&rules[i], slot);
                if let Some(m) = s.update(be, &rules[i], state, p, grads[i].view_mut(), None) {
                    momentum(m);
                }
            });
        } else {
            let each = self
                .states
                .iter_mut()
                .zip(params.iter_mut().zip(grads.iter_mut()))
                .enumerate()
                .map(|(i, (state, (p, g)))| {
                    let p = Some(p.view_mut());
                    (&rules[i], state.view_mut(), p, g.view_mut(), None)
                });
            for m in s.update_all(be, each) {
                momentum(m);
            }
        }
        let mut done = Ok(());
        if rules.iter().any(|r| matches!(r, UpdateRule::Muon { .. })) {
            done = self.orthogonalise(be, mesh, grads, s);
            if done.is_ok() {
                self.apply_muon(be, params, grads, s);
            }
        }
        self.rate = Some(rate);
        done?;
        self.settle(be);
        Ok(())
    }

    /// Newton–Schulz where the plan puts each matrix: the Muon updates (in the gradient shards)
    /// come back orthogonalised.
    fn orthogonalise(
        &mut self,
        be: &dyn Backend,
        mesh: &DeviceMesh,
        grads: &mut [Tensor],
        s: Step,
    ) -> ganymede_dist::Result<()> {
        let mut slices: Vec<(usize, ViewMut)> = Vec::new();
        for (i, (rule, g)) in self.rules.iter().zip(grads.iter_mut()).enumerate() {
            if let UpdateRule::Muon { .. } = rule {
                slices.push((i, g.view_mut()));
            }
        }
        let mut roots: Vec<ViewMut> = self.roots.iter_mut().map(|t| t.view_mut()).collect();
        let (scratch, batch) = (&mut self.scratch, &mut self.batch);
        let mut ns = |job: NsJob<'_>| run_ns(be, job, scratch, batch.as_mut(), s);
        muon_exchange(&self.plan, mesh, &mut slices, &mut roots, &mut ns)
    }

    /// Muon's decayed update of each shard from its orthogonalised update; host-resident
    /// parameters each through a slot for it.
    fn apply_muon(&mut self, be: &dyn Backend, params: &mut [Tensor], grads: &[Tensor], s: Step) {
        let mut ps: Vec<Vec<&mut Tensor>> = Vec::new();
        let mut updates = Vec::new();
        for (i, p) in params.iter_mut().enumerate() {
            if let UpdateRule::Muon { scale, .. } = self.rules[i] {
                ps.push(vec![p]);
                updates.push((&grads[i], scale));
            }
        }
        match &mut self.staging {
            Some(staging) => staging.stream(be, &mut ps, |k, p| {
                let (u, scale) = updates[k];
                s.apply(be, p, u.view(), scale, None);
            }),
            None => {
                for (p, (u, scale)) in ps.iter_mut().zip(updates) {
                    s.apply(be, p[0].view_mut(), u.view(), scale, None);
                }
            }
        }
    }

    /// With host-resident parameters: block until the last write-back is complete, so the next
    /// step's gathers (which copy the shards to the device) and the host-side router-bias update
    /// read the new values.
    fn settle(&self, be: &dyn Backend) {
        if let Some(s) = &self.staging {
            s.synchronize(be);
        }
    }
}

/// One Newton–Schulz job of the exchange: a matrix set in strided batches on `batch` where the
/// backend batches matrices (each matrix gets the calls of its own Newton–Schulz, so the same
/// bits where the strided calls are loops), else spread over the scratch lanes when small.
fn run_ns(
    be: &dyn Backend,
    job: NsJob<'_>,
    scratch: &mut [NsScratch],
    batch: Option<&mut NsScratch>,
    s: Step,
) {
    let (r, c, steps, bf16) = (job.rows, job.cols, s.ns_steps(), s.ns_bf16);
    if let (Some(st), true) = (batch, job.count > 1) {
        let n = r * c;
        let b = ganymede_config::ns_stack_batch(r, c, job.count, ganymede_config::NS_STACK_BYTES);
        let mut data = job.data;
        let mut e0 = 0;
        while e0 < job.count {
            let k = b.min(job.count - e0);
            let x = data.reborrow().slice(e0 * n, k * n);
            newton_schulz_strided(be, x, k, r, c, steps, bf16, st);
            e0 += k;
        }
        return;
    }
    let lanes = match ns_flops(r, c, steps.n) <= PAR_MATRIX_MAX_FLOPS {
        true => scratch.len(),
        false => 1,
    };
    let scratch = &mut scratch[..lanes];
    newton_schulz_batch(be, job.data, job.count, r, c, steps, bf16, scratch);
}

//! The optimizer the trainer holds: Muon for hidden matrices (each expert's matrix separately),
//! AdamW for the rest, nothing for buffers.

use crate::ns::{newton_schulz, newton_schulz_strided, ns_bf16, ns_flops, ns_lanes, NsScratch};
use crate::offload::{SkipWait, Staging};
use crate::state::{indexed_state_mut, stream_states, ParamState};
use crate::update::{MuonParam, RateBuffer, StateView, Step};
use ganymede_config::{MuonScale, OptimizerConfig, OptimizerName};
use ganymede_core::{
    Backend, Category, GradScale, ParamKind, ParamSpec, ParamStore, Tensor, View, ViewMut,
};
use rayon::prelude::*;

/// Matrices whose Newton–Schulz costs at most this many FLOPs are spread across threads whole
/// (one matrix per thread at a time); bigger ones run one after another, each GEMM split across
/// threads. Small GEMMs split across threads spend much of their time waiting: measured on 2
/// threads, that took 3.5x the CPU time on `tiny`'s matrices and 1.3x on `small`'s 256x256 ones
/// (`examples/ns_bench.rs`).
/// The bound takes in squares up to about 400 and 256x1024 (1.5 GFLOP); each parallel slot holds
/// scratch for the largest such matrix.
pub const PAR_MATRIX_MAX_FLOPS: u64 = 2_000_000_000;

/// Per-thread working memory for Muon: the Nesterov output `u` (orthogonalised in place) and
/// Newton–Schulz scratch.
struct Slot {
    u: Tensor,
    ns: NsScratch,
}

impl Slot {
    fn new(be: &dyn Backend, shapes: &[(usize, usize)], cfg: &OptimizerConfig) -> Self {
        let n = shapes.iter().map(|&(r, c)| r * c).max().unwrap_or(0);
        Slot {
            u: be.zeros(&[n], Category::Buffers),
            ns: NsScratch::for_shapes(be, shapes.iter().copied()).prepared(
                be,
                cfg.ns_steps,
                ns_bf16(cfg.ns_dtype, be),
            ),
        }
    }
    fn bytes(&self) -> usize {
        self.u.bytes() + self.ns.bytes()
    }
}

/// Working memory of batched Muon on a backend that batches matrices
/// ([`Blas::batches_matrices`]): the Nesterov outputs and Newton–Schulz scratch of up to
/// [`ganymede_config::ns_stack_batch`] matrices of a stack at once.
///
/// [`Blas::batches_matrices`]: ganymede_core::Blas::batches_matrices
struct StackSlot {
    u: Tensor,
    ns: NsScratch,
    /// Bytes a batch may take ([`ganymede_config::NS_STACK_BYTES`] in training).
    budget: usize,
}

impl StackSlot {
    /// Sized for every stack (`count > 1`) of `stacks` (`rows, cols, count`) in batches within
    /// `budget` bytes; `None` if there is none.
    fn new(
        be: &dyn Backend,
        stacks: &[(usize, usize, usize)],
        budget: usize,
        cfg: &OptimizerConfig,
    ) -> Option<Self> {
        let (u, ss, sl) = ganymede_config::ns_batch_elems(stacks, budget);
        let bf16 = ns_bf16(cfg.ns_dtype, be);
        (u > 0).then(|| StackSlot {
            u: be.zeros(&[u], Category::Buffers),
            ns: NsScratch::from_lens(be, ss, sl).prepared(be, cfg.ns_steps, bf16),
            budget,
        })
    }
    fn bytes(&self) -> usize {
        self.u.bytes() + self.ns.bytes()
    }
}

/// `(rows, cols, count)` of every Muon rule.
fn muon_shapes(rules: &[UpdateRule]) -> Vec<(usize, usize, usize)> {
    rules
        .iter()
        .filter_map(|r| match *r {
            UpdateRule::Muon {
                rows, cols, count, ..
            } => Some((rows, cols, count)),
            _ => None,
        })
        .collect()
}

/// What a backend that batches matrices runs in strided batches: every stack (`count > 1`) as
/// `(rows, cols, count)`, and for each shape that several single matrices share (a layer's
/// attention matrices across the layers), `(rows, cols, how many)`. The stack slot is sized for
/// these; the planner counts the same (`ganymede_plan`'s ledger).
fn batched_shapes(rules: &[UpdateRule]) -> Vec<(usize, usize, usize)> {
    let all = muon_shapes(rules);
    let mut out: Vec<(usize, usize, usize)> = all.iter().copied().filter(|s| s.2 > 1).collect();
    let mut singles: Vec<(usize, usize, usize)> = Vec::new();
    for &(r, c, _) in all.iter().filter(|s| s.2 == 1) {
        match singles.iter_mut().find(|s| (s.0, s.1) == (r, c)) {
            Some(s) => s.2 += 1,
            None => singles.push((r, c, 1)),
        }
    }
    out.extend(singles.into_iter().filter(|s| s.2 > 1));
    out
}

/// Same-shape matrices of different parameters, batched as an expert stack is: each batch's
/// gradients gathered into the stack slot and Nesterov'd with their own momenta, orthogonalised
/// by strided products, each parameter updated from its slice. Per matrix the calls of
/// [`run_matrix`], so on a backend whose strided calls are loops the same bits; on a GPU the
/// Newton–Schulz launches of a batch instead of each matrix's.
fn run_group(be: &dyn Backend, items: Vec<Item>, st: &mut StackSlot, s: Step) {
    let (rows, cols) = (items[0].rows, items[0].cols);
    let n = rows * cols;
    let batch = ganymede_config::ns_stack_batch(rows, cols, items.len(), st.budget);
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        let mut chunk: Vec<Item> = items.by_ref().take(batch).collect();
        for (j, it) in chunk.iter_mut().enumerate() {
            debug_assert_eq!((it.rows, it.cols), (rows, cols));
            be.copy(st.u.slice_mut(j * n, n), it.g);
            s.momentum(be, it.mom.reborrow(), st.u.slice_mut(j * n, n));
        }
        let b = chunk.len();
        let u = st.u.slice_mut(0, b * n);
        newton_schulz_strided(be, u, b, rows, cols, s.ns_steps(), s.ns_bf16, &mut st.ns);
        for (j, it) in chunk.into_iter().enumerate() {
            s.apply(be, it.p, st.u.slice(j * n, n), it.scale, it.rounded);
        }
    }
}

/// A stack of `count` Muon matrices (a layer's experts, one after another in its views),
/// [`ganymede_config::ns_stack_batch`] of them at a time: each elementwise step one call over
/// the batch, Newton–Schulz strided ([`newton_schulz_strided`]). Per matrix the calls of
/// [`run_matrix`], so on a backend whose strided calls are loops the same bits.
fn run_stack(be: &dyn Backend, m: MuonParam<View>, st: &mut StackSlot, s: Step) {
    let MuonParam {
        p,
        momentum: mut mom,
        g,
        rows,
        cols,
        count,
        scale,
        mut rounded,
    } = m;
    let mut p = p.expect("the whole parameter");
    let n = rows * cols;
    let batch = ganymede_config::ns_stack_batch(rows, cols, count, st.budget);
    let mut e0 = 0;
    while e0 < count {
        let b = batch.min(count - e0);
        let (off, len) = (e0 * n, b * n);
        let mut u = st.u.slice_mut(0, len);
        be.copy(u.reborrow(), g.slice(off, len));
        s.momentum(be, mom.reborrow().slice(off, len), u.reborrow());
        let (steps, bf16) = (s.ns_steps(), s.ns_bf16);
        newton_schulz_strided(be, u, b, rows, cols, steps, bf16, &mut st.ns);
        let r = rounded.as_mut().map(|r| r.reborrow().slice(off, len));
        s.apply(
            be,
            p.reborrow().slice(off, len),
            st.u.slice(0, len),
            scale,
            r,
        );
        e0 += b;
    }
}

/// One matrix of a Muon step: disjoint views into a parameter, its momentum and its gradient.
struct Item<'a> {
    p: ViewMut<'a>,
    mom: ViewMut<'a>,
    g: View<'a>,
    rows: usize,
    cols: usize,
    scale: f64,
    /// The parameter's bf16 compute copy, written by the update (see `Optimizer::step_rounded`).
    rounded: Option<ViewMut<'a>>,
}

/// One Muon matrix: Nesterov momentum into the slot, Newton–Schulz, decayed update. Both the
/// on-device and the streamed step run every matrix through here.
fn run_matrix(be: &dyn Backend, item: Item, slot: &mut Slot, s: Step) {
    let n = item.rows * item.cols;
    // The update is made in the slot, from a copy of the gradient (the caller's to keep).
    be.copy(slot.u.slice_mut(0, n), item.g);
    s.momentum(be, item.mom, slot.u.slice_mut(0, n));
    let (u, (rows, cols)) = (slot.u.slice_mut(0, n), (item.rows, item.cols));
    newton_schulz(be, u, rows, cols, s.ns_steps(), s.ns_bf16, &mut slot.ns);
    s.apply(be, item.p, slot.u.slice(0, n), item.scale, item.rounded);
}

/// Run Muon matrices on the scratch slots: large ones one after another on `slots[0]` (their
/// GEMMs split across threads), small ones (NS FLOPs ≤ [`PAR_MATRIX_MAX_FLOPS`]) one per slot
/// in parallel when `parallel`. Results do not depend on which slot runs a matrix (scratch is
/// fully overwritten), so every schedule gives the same bits.
fn run_items(be: &dyn Backend, items: Vec<Item>, slots: &mut [Slot], parallel: bool, s: Step) {
    let steps = s.ns_steps();
    let run = |item: Item, slot: &mut Slot| run_matrix(be, item, slot, s);
    let (small, large): (Vec<Item>, Vec<Item>) = items
        .into_iter()
        .partition(|it| ns_flops(it.rows, it.cols, steps.n) <= PAR_MATRIX_MAX_FLOPS);
    for item in large {
        run(item, &mut slots[0]);
    }
    if ns_lanes(be, s.ns_bf16, slots.len()) <= 1 || small.len() <= 1 || !parallel {
        for item in small {
            run(item, &mut slots[0]);
        }
        return;
    }
    // One task per slot, each taking the largest matrix left until none are: dynamic, so a
    // thread slowed by another process simply does fewer matrices.
    let mut small = small;
    small.sort_by_key(|it| ns_flops(it.rows, it.cols, steps.n));
    let queue = std::sync::Mutex::new(small);
    slots.par_iter_mut().for_each(|slot| loop {
        let item = queue.lock().unwrap().pop();
        match item {
            Some(item) => run(item, slot),
            None => break,
        }
    });
}

/// A Muon parameter's matrices as [`Item`]s for [`run_items`].
fn items<'a>(m: MuonParam<'a, View<'a>>) -> Vec<Item<'a>> {
    let (rows, cols, count, scale) = (m.rows, m.cols, m.count, m.scale);
    let n = rows * cols;
    let ps = split_views(m.p.expect("the whole parameter"), count, n);
    let ms = split_views(m.momentum, count, n);
    let mut rs = m.rounded.map(|r| split_views(r, count, n).into_iter());
    ps.into_iter()
        .zip(ms)
        .enumerate()
        .map(|(e, (p, mom))| Item {
            p,
            mom,
            g: m.g.slice(e * n, n),
            rows,
            cols,
            scale,
            rounded: rs.as_mut().and_then(Iterator::next),
        })
        .collect()
}

/// The Newton–Schulz working memory of Muon's whole matrices and how it is scheduled.
struct Matrices {
    /// `slots[0]` fits every Muon matrix; the others only those that run in parallel.
    slots: Vec<Slot>,
    /// Spread small matrices across threads (see [`PAR_MATRIX_MAX_FLOPS`]).
    parallel: bool,
    /// Expert stacks and same-shape matrices batched through strided products (a backend that
    /// batches matrices; see [`run_stack`], [`run_group`]); `None` runs them matrix by matrix.
    stacks: Option<StackSlot>,
}

impl Matrices {
    /// The Muon updates of `params`: expert stacks batched where the backend batches matrices,
    /// then the remaining matrices, same-shape ones batched together there, the rest through
    /// [`run_items`].
    fn run(&mut self, be: &dyn Backend, params: Vec<MuonParam<View>>, s: Step) {
        let mut items = Vec::new();
        for m in params {
            match self.stacks.as_mut() {
                Some(st) if m.count > 1 => run_stack(be, m, st, s),
                _ => items.extend(self::items(m)),
            }
        }
        if let Some(st) = self.stacks.as_mut() {
            let mut groups: Vec<Vec<Item>> = Vec::new();
            for it in items {
                match groups
                    .iter_mut()
                    .find(|g| (g[0].rows, g[0].cols) == (it.rows, it.cols))
                {
                    Some(g) => g.push(it),
                    None => groups.push(vec![it]),
                }
            }
            items = Vec::new();
            for g in groups {
                match g.len() {
                    1 => items.extend(g),
                    _ => run_group(be, g, st, s),
                }
            }
        }
        if !items.is_empty() {
            run_items(be, items, &mut self.slots, self.parallel, s);
        }
    }

    fn bytes(&self) -> u64 {
        let stacks = self.stacks.as_ref().map_or(0, |s| s.bytes() as u64);
        self.slots.iter().map(|s| s.bytes() as u64).sum::<u64>() + stacks
    }
}

pub struct Optimizer {
    cfg: OptimizerConfig,
    names: Vec<String>,
    rules: Vec<UpdateRule>,
    states: Vec<ParamState>,
    matrices: Matrices,
    /// With `optimizer.offload`: state in host memory, streamed through these device slots.
    staging: Option<Staging>,
    /// The step's learning rate and bias corrections in device memory.
    rate: RateBuffer,
    step: u64,
}

/// Muon's update scale for a `rows × cols` matrix (rows = output dimension).
pub fn muon_scale(kind: MuonScale, rows: usize, cols: usize) -> f64 {
    match kind {
        // Moonlight: NS output has RMS ≈ 1/sqrt(max(rows, cols)); this brings it to ≈ 0.2, about
        // AdamW's update RMS, so one lr and weight decay serve both.
        MuonScale::MatchRmsAdamw => 0.2 * (rows.max(cols) as f64).sqrt(),
        MuonScale::Original => (rows as f64 / cols as f64).max(1.0).sqrt(),
    }
}

/// Weight decay by kind: none for norm gains and other vectors (decaying a gain towards 0 fights
/// the normalisation; common practice), the configured value for every matrix, embeddings and the
/// LM head included (as Moonlight and TorchTitan's defaults do).
/// How a parameter is updated: the one rule table of the single-process and the sharded
/// optimizer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UpdateRule {
    /// Muon on `count` matrices of `rows × cols` (1 for a Matrix, E for an expert stack).
    Muon {
        rows: usize,
        cols: usize,
        count: usize,
        scale: f64,
    },
    AdamW {
        weight_decay: f64,
    },
    /// Buffers: saved, never updated.
    Frozen,
}

/// The rule for `spec` under `cfg`: Muon for hidden matrices (each expert's on its own) when
/// the optimizer is Muon, AdamW for every other trainable parameter (decoupled weight decay on
/// matrices, embeddings and LM head included; none on vectors), nothing for buffers.
pub fn update_rule(cfg: &OptimizerConfig, spec: &ParamSpec) -> UpdateRule {
    if !spec.kind.is_trainable() {
        return UpdateRule::Frozen;
    }
    if cfg.name == OptimizerName::Muon && spec.kind.is_muon() {
        let (count, rows, cols) = match (spec.kind, spec.shape.as_slice()) {
            (ParamKind::Matrix, &[r, c]) => (1, r, c),
            (ParamKind::Experts, &[e, r, c]) => (e, r, c),
            _ => panic!(
                "{}: {:?} of shape {:?} is not a matrix",
                spec.name, spec.kind, spec.shape
            ),
        };
        return UpdateRule::Muon {
            rows,
            cols,
            count,
            scale: muon_scale(cfg.muon_scale, rows, cols),
        };
    }
    UpdateRule::AdamW {
        weight_decay: if spec.kind == ParamKind::Vector {
            0.0
        } else {
            cfg.weight_decay
        },
    }
}

/// Each parameter's compute copy in `rounded`, where it has one (a non-empty entry).
fn compute_copies(rounded: Option<&mut ParamStore>, n: usize) -> Vec<Option<ViewMut<'_>>> {
    match rounded {
        Some(r) => r
            .tensors_mut()
            .iter_mut()
            .map(|t| (!t.is_empty()).then(|| t.view_mut()))
            .collect(),
        None => (0..n).map(|_| None).collect(),
    }
}

fn split_views<'a>(mut v: ViewMut<'a>, count: usize, len: usize) -> Vec<ViewMut<'a>> {
    let mut out = Vec::with_capacity(count);
    for _ in 1..count {
        let (head, tail) = v.split_at(len);
        out.push(head);
        v = tail;
    }
    out.push(v);
    out
}

impl Optimizer {
    pub fn new(be: &dyn Backend, cfg: &OptimizerConfig, specs: &[ParamSpec]) -> Optimizer {
        let rules: Vec<UpdateRule> = specs.iter().map(|s| update_rule(cfg, s)).collect();
        let states: Vec<ParamState> = rules
            .iter()
            .zip(specs)
            .map(|(r, s)| ParamState::new(be, r, &s.shape, cfg.offload))
            .collect();
        // Shapes for scratch sizing, and how many matrices may run in parallel.
        let (mut all, mut small, mut n_small) = (Vec::new(), Vec::new(), 0);
        for &(rows, cols, count) in &muon_shapes(&rules) {
            all.push((rows, cols));
            if ns_flops(rows, cols, cfg.ns_steps) <= PAR_MATRIX_MAX_FLOPS {
                small.push((rows, cols));
                n_small += count;
            }
        }
        // Each slot holds the largest one parameter's state.
        let staging = cfg.offload.then(|| {
            let elems = states.iter().map(ParamState::len).max().unwrap_or(0);
            Staging::new(be, elems)
        });
        let mut slots = Vec::new();
        if !all.is_empty() {
            slots.push(Slot::new(be, &all, cfg));
            // Lanes of small matrices on the CPU's threads; a backend that batches matrices (a
            // GPU) runs one stream, where lanes would only queue on it and hold scratch.
            let extra = match be.batches_matrices() {
                true => 0,
                false => rayon::current_num_threads().min(n_small.max(1)) - 1,
            };
            slots.extend((0..extra).map(|_| Slot::new(be, &small, cfg)));
        }
        let stacks = if cfg.ns_batch.on(be.batches_matrices()) {
            let budget = ganymede_config::NS_STACK_BYTES;
            StackSlot::new(be, &batched_shapes(&rules), budget, cfg)
        } else {
            None
        };
        Optimizer {
            cfg: cfg.clone(),
            names: specs.iter().map(|s| s.name.clone()).collect(),
            rules,
            states,
            matrices: Matrices {
                slots,
                parallel: true,
                stacks,
            },
            staging,
            rate: RateBuffer::new(be),
            step: 0,
        }
    }

    /// One update with learning rate `lr` (from [`crate::lr_at`]) from `grads` as they are.
    pub fn step(&mut self, be: &dyn Backend, params: &mut ParamStore, grads: &ParamStore, lr: f64) {
        self.step_scaled(be, params, grads, lr, GradScale::Host(1.0))
    }

    /// One update from the gradients times `grad_scale` (global-norm clipping's coefficient,
    /// [`crate::clip_coef`], on the host or in device memory), which the update kernels apply
    /// as they read each gradient: the same bits as scaling the gradients first, without a
    /// pass over them. `grads` are not written. A device scale that is NaN stops the update:
    /// nothing is written (see [`GradScale`]).
    pub fn step_scaled(
        &mut self,
        be: &dyn Backend,
        params: &mut ParamStore,
        grads: &ParamStore,
        lr: f64,
        grad_scale: GradScale,
    ) {
        self.step_into(be, params, grads, lr, grad_scale, None);
    }

    /// [`Self::step_scaled`] that also writes each updated parameter, rounded to bf16, into its
    /// entry of `rounded` where that entry is not empty (a bf16 compute copy: the parameters
    /// the model reads in bf16, zero-length stand-ins for the rest), from the update kernels
    /// themselves instead of a cast pass over the parameters afterwards; the same bits as that
    /// cast. With the state in host memory (`optimizer.offload`) the copies are left alone.
    /// Returns whether they were written.
    pub fn step_rounded(
        &mut self,
        be: &dyn Backend,
        params: &mut ParamStore,
        grads: &ParamStore,
        lr: f64,
        grad_scale: GradScale,
        rounded: &mut ParamStore,
    ) -> bool {
        assert_eq!(
            rounded.len(),
            params.len(),
            "compute copy of other parameters"
        );
        let written = self.staging.is_none();
        self.step_into(be, params, grads, lr, grad_scale, Some(rounded));
        written
    }

    /// The next step's number and learning rate `lr`, into device memory ahead of its update
    /// (which may then be a CUDA graph's replay, see `ganymede_core::Memory::graph`); the
    /// update that follows, at the same `lr`, uses them instead of writing its own.
    pub fn begin_step(&mut self, be: &dyn Backend, lr: f64) {
        self.rate.begin(be, &self.cfg, &mut self.step, lr)
    }

    fn step_into(
        &mut self,
        be: &dyn Backend,
        params: &mut ParamStore,
        grads: &ParamStore,
        lr: f64,
        grad_scale: GradScale,
        rounded: Option<&mut ParamStore>,
    ) {
        self.check(params, grads);
        let rate = self.rate.for_update(be, &self.cfg, &mut self.step, lr);
        let s = Step::new(be, &self.cfg, self.step, lr, grad_scale, rate);
        let (rules, matrices) = (&self.rules, &mut self.matrices);
        let (ps, gs) = (params.tensors_mut(), grads.tensors());
        if let Some(staging) = &mut self.staging {
            // Host-resident state: one parameter at a time through the device slots (the
            // parameters stay on the device), its Muon matrices run before the slot is written
            // back. The caller casts the compute copies (see step_rounded).
            stream_states(
                be,
                staging,
                &mut self.states,
                |_| vec![],
                |i, slot| {
                    let state = StateView::staged(&rules[i], slot);
                    let p = Some(ps[i].view_mut());
                    let muon = s.update(be, &rules[i], state, p, gs[i].view(), None);
                    matrices.run(be, muon.into_iter().collect(), s);
                },
            );
            return;
        }
        // Every parameter's update, Muon's matrices all run together at the end, so that
        // same-shape ones may share threads or strided batches.
        let each = self
            .states
            .iter_mut()
            .zip(ps)
            .zip(compute_copies(rounded, rules.len()))
            .enumerate()
            .map(|(i, ((state, p), copy))| {
                let (p, g) = (Some(p.view_mut()), gs[i].view());
                (&rules[i], state.view_mut(), p, g, copy)
            });
        let muon = s.update_all(be, each);
        matrices.run(be, muon, s);
    }

    /// That `params` and `grads` are the parameters this optimizer was built for.
    fn check(&self, params: &ParamStore, grads: &ParamStore) {
        assert_eq!(
            params.len(),
            self.rules.len(),
            "optimizer built for other parameters"
        );
        assert_eq!(
            grads.len(),
            self.rules.len(),
            "gradients do not match parameters"
        );
        debug_assert!(
            params
                .specs()
                .iter()
                .zip(&self.names)
                .all(|(s, n)| &s.name == n),
            "optimizer built for other parameters"
        );
    }

    /// Block the host until host-resident state (`optimizer.offload`) written back by the last
    /// step is complete, before CPU code reads or overwrites it (checkpoints). A no-op without
    /// offload.
    pub fn synchronize_state(&self, be: &dyn Backend) {
        if let Some(s) = &self.staging {
            s.synchronize(be);
        }
    }

    /// Device bytes of the offload staging slots (0 without `optimizer.offload`).
    pub fn staging_bytes(&self) -> u64 {
        self.staging.as_ref().map_or(0, |s| s.bytes() as u64)
    }

    /// Leave one wait of the offload pipeline out, to test that the checking two-memory mode
    /// catches it.
    #[doc(hidden)]
    pub fn skip_offload_wait(&mut self, w: SkipWait) {
        self.staging
            .as_mut()
            .expect("optimizer.offload is off")
            .skip_wait(w);
    }

    /// Whether small Muon matrices run whole on separate threads (default) or one after another
    /// with each GEMM split across threads. Same results either way; for benchmarks.
    pub fn set_matrix_parallel(&mut self, on: bool) {
        self.matrices.parallel = on;
    }

    /// Optimizer state for checkpoints, in parameter order: `<param>.muon_momentum` for Muon
    /// parameters, `<param>.adam_m` and `<param>.adam_v` for AdamW ones.
    pub fn state(&self) -> Vec<(String, &Tensor)> {
        let named = self.names.iter().zip(&self.states);
        named
            .flat_map(|(name, st)| {
                st.tensors()
                    .into_iter()
                    .map(move |(suffix, t)| (format!("{name}.{suffix}"), t))
            })
            .collect()
    }

    /// Same names and order as [`Optimizer::state`], for loading a checkpoint into.
    pub fn state_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let names = &self.names;
        indexed_state_mut(&mut self.states)
            .into_iter()
            .map(|(i, suffix, t)| (format!("{}.{suffix}", names[i]), t))
            .collect()
    }

    /// [`Optimizer::state_mut`] as (parameter index, checkpoint suffix, tensor), the form the
    /// sharded optimizer gives too.
    pub fn state_indexed_mut(&mut self) -> Vec<(usize, &'static str, &mut Tensor)> {
        indexed_state_mut(&mut self.states)
    }

    /// Steps taken so far (AdamW's bias correction uses it).
    pub fn step_count(&self) -> u64 {
        self.step
    }
    pub fn set_step_count(&mut self, n: u64) {
        self.step = n;
    }

    /// Bytes of optimizer state (momenta and second moments), excluding scratch.
    pub fn state_bytes(&self) -> u64 {
        self.state().iter().map(|(_, t)| t.bytes() as u64).sum()
    }

    /// Bytes of Newton–Schulz working memory (charged to `Category::Buffers`).
    pub fn scratch_bytes(&self) -> u64 {
        self.matrices.bytes()
    }

    /// Run expert stacks batched (strided products) in batches within `budget` bytes, or
    /// (`None`) matrix by matrix, whatever the backend prefers: the same bits where the strided
    /// calls are per-matrix loops (the CPU's), which the tests hold. Batching allocates the
    /// stack scratch.
    pub fn with_stack_batching(mut self, be: &dyn Backend, budget: Option<usize>) -> Self {
        let shapes = batched_shapes(&self.rules);
        let cfg = &self.cfg;
        self.matrices.stacks = budget.and_then(|b| StackSlot::new(be, &shapes, b, cfg));
        self
    }

    /// Which rule each parameter gets: `"muon"`, `"adamw"` or `"none"`, with its weight decay.
    pub fn assignment(&self) -> Vec<(&str, &'static str, f64)> {
        self.names
            .iter()
            .zip(&self.rules)
            .map(|(n, r)| match r {
                UpdateRule::Muon { .. } => (n.as_str(), "muon", self.cfg.weight_decay),
                UpdateRule::AdamW { weight_decay } => (n.as_str(), "adamw", *weight_decay),
                UpdateRule::Frozen => (n.as_str(), "none", 0.0),
            })
            .collect()
    }
}

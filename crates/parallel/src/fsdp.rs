//! FSDP around the unchanged model: [`FsdpParams`] is the step's [`ParamSource`] and
//! [`FsdpGrads`] its [`GradSink`].
//!
//! - Master parameters are f32 shards (`Category::Params`), on the device or, with
//!   `optimizer.offload`, in pinned host memory: then each gather first copies the shard to a
//!   device buffer of its slot on the from-host stream (FSDP2's CPU offload does the same).
//!   A block's parameters are
//!   all-gathered (bf16 by default, f32 for exactness tests) into a fixed pool of
//!   `prefetch + 1` slots (`Category::Buffers`), so the memory of unsharded parameters is the
//!   same at every step and every block. The gathers of the next `prefetch` blocks are posted
//!   when a block starts, so they travel while it computes.
//! - Mixed precision (`training.compute_dtype = "bf16"`), as FSDP2's `param_dtype`: the weights
//!   that only bf16-input GEMMs read and the embedding
//!   ([`Model::bf16_weight`](ganymede_model::Model)) are handed to the model as bf16 tensors, so
//!   no f32 copy of them is made and their unsharded bytes halve; the GEMMs then cast only their
//!   other operand. Everything else is handed over in f32.
//! - The root unit (embedding, final norm, LM head) is gathered when the step begins, but for
//!   the LM head, which is gathered at the final norm into the embedding's tensor (same shape
//!   and dtype): the embedding's lookup is done by then, so one `[V, H]` tensor serves both.
//! - A parameter gathered in the dtype the model reads is gathered straight into the tensor
//!   handed to the model, whose buffer has room for the padded rows when its rows do not split
//!   evenly over its group ([`Tensor::padded_to`]); only f32 gathers of bf16 weights go through
//!   a receive buffer and a cast.
//! - The step's order of block uses is fixed (forward 0..L, then backward L-1..0), so prefetch is
//!   a walk along that schedule; the backward pass gathers each block again (parameters are freed
//!   after forward, FSDP2's `reshard_after_forward`).
//! - Gradients: a block's full gradients live in one of two reused sets of tensors while its
//!   backward runs, then are reduce-scattered in f32 onto the gradient shards; the reduce-scatter
//!   of block `l` travels while block `l-1` computes in the other set. Each is sent as it is:
//!   its buffer holds the padded rows, which stay zero.
//! - The root's gradients: the final norm's and LM head's are reduce-scattered as soon as the
//!   head's backward (the step's first) ends, travelling during the blocks' backward; the
//!   embedding's backward (the step's last) then writes the LM head's tensor, of the same shape,
//!   so one `[V, H]` f32 gradient serves both.
//! - HSDP (`dp_replicate > 1`): the shards are then all-reduced across replicas, so every
//!   replica holds the global batch's gradient shards; the routing statistics (expert counts,
//!   the auxiliary loss's sums) are summed over all ranks, as each holds its own slice of the batch.
//!
//! Collective failures (a peer that died or stalled) come back from the hooks as errors naming
//! what was being done (`gathering block 3's parameters: …`) with the backend's message, which
//! names the collective, the group and the rank; the step returns them. A step that failed
//! midway leaves gathers and reduce-scatters posted: the owner drops this state (dropping waits
//! for them) rather than step again.

use crate::layout::Layout;
use anyhow::{Context, Result};
use ganymede_config::GatherDtype;
use ganymede_core::{
    in_phase, Backend, Category, DType, ParamStore, StepPhase, Stream, Tensor, ViewMut,
};
use ganymede_dist::placement::ShardGroup;
use ganymede_dist::{CommError, DeviceMesh, Phase, ProcessGroup, Track, Work};
use ganymede_model::{GradSink, ParamSource, Pass};
use std::sync::Arc;
use std::time::Instant;

/// Extend a borrow to `'static` so a posted collective can be kept across hook calls.
///
/// SAFETY (for callers): the memory must stay allocated and untouched by anything else until the
/// returned `Work` is waited on or dropped. Pool buffers are owned by the struct holding the
/// `Work`s, are never reallocated while a `Work` is pending, and the `Work`s are declared first
/// so they are dropped (which waits) before the buffers.
unsafe fn extend_to_static<X: ?Sized>(x: &X) -> &'static X {
    &*(x as *const X)
}
/// [`extend_to_static`] for a tensor a posted collective writes.
unsafe fn extend_to_static_mut<X>(x: &mut X) -> &'static mut X {
    &mut *(x as *mut X)
}

/// Wait for each of `works` in order, calling `then` with its item once it is done. At the first
/// error, walk away from the rest without waiting (a peer that failed one will not join the
/// others, and each wait would run to the timeout) and return it.
fn wait_each<'a, T>(
    works: impl IntoIterator<Item = (Work<'a>, T)>,
    mut then: impl FnMut(T),
) -> std::result::Result<(), CommError> {
    let mut works = works.into_iter();
    while let Some((w, item)) = works.next() {
        if let Err(e) = w.wait() {
            works.for_each(|(w, _)| w.abandon());
            return Err(e);
        }
        then(item);
    }
    Ok(())
}

/// A bf16 staging tensor (send or receive side of a bf16 gather), in the backend's memory.
fn bf16(be: &dyn Backend, n: usize) -> Tensor {
    be.zeros_of(&[n], DType::BF16, Category::Buffers)
}

/// Groups by [`ShardGroup`], plus the ones HSDP adds.
#[derive(Clone)]
pub struct Groups {
    pub dp: Arc<dyn ProcessGroup>,
    pub efsdp: Arc<dyn ProcessGroup>,
    /// Every rank (each with its own slice of the batch): batch-wide sums go here.
    pub world: Arc<dyn ProcessGroup>,
    /// Same shards in every replica; `None` without replicas.
    pub replicate: Option<Arc<dyn ProcessGroup>>,
}

impl Groups {
    pub fn of(mesh: &DeviceMesh) -> Self {
        Groups {
            dp: mesh.dp_shard.clone(),
            efsdp: mesh.efsdp.clone(),
            world: mesh.world.clone(),
            replicate: mesh.replicate.clone(),
        }
    }
    pub fn get(&self, g: ShardGroup) -> &Arc<dyn ProcessGroup> {
        match g {
            ShardGroup::DpShard => &self.dp,
            ShardGroup::Efsdp => &self.efsdp,
        }
    }
}

/// One block's worth of gather buffers.
struct Slot {
    /// Posted gathers; declared first so dropping the slot waits before freeing buffers.
    work: Vec<Work<'static>>,
    /// The block whose parameters the slot holds or receives.
    block: Option<usize>,
    /// Parameters handed to the model (bf16 for the bf16 weights); a gather writes straight
    /// into one that is [`direct`], whose buffer then holds the padded rows.
    full: Vec<Tensor>,
    /// Padded receive buffers (f32 gathers), empty for a direct parameter.
    recv32: Vec<Tensor>,
    /// bf16 send (this rank's shard) and receive buffers (empty for a direct parameter).
    send16: Vec<Tensor>,
    recv16: Vec<Tensor>,
    /// Device copies of host-resident master shards, the gathers' source.
    stage: Vec<Tensor>,
}

/// The parameter side of FSDP for one rank.
pub struct FsdpParams {
    slots: Vec<Slot>,
    layout: Arc<Layout>,
    groups: Groups,
    dtype: GatherDtype,
    /// Whether each parameter is handed to the model in bf16 (see the module documentation).
    bf16_weight: Vec<bool>,
    prefetch: usize,
    /// Master shards, f32, in table order. Private: posted f32 gathers read them, so every
    /// access goes through [`FsdpParams::master_mut`] or [`FsdpParams::shard`], which check that
    /// none is in flight.
    master: Vec<Tensor>,
    /// Whether `master` is in host memory (`optimizer.offload`).
    master_on_host: bool,
    /// What the model reads: root parameters resident, block entries empty except while in use.
    store: ParamStore,
    /// `(embedding, LM head)` when they have one shape, shard and dtype: one tensor holds the
    /// embedding, gathered when the step begins, then the LM head, gathered into it at the
    /// final norm (`acquire_head`); the other's entry is empty meanwhile.
    share: Option<(usize, usize)>,
    /// The receive buffer of the root unit's gathers (f32 or bf16 per the gather dtype; empty
    /// when every root parameter is [`direct`]) and, for bf16 gathers, the send buffer: one each,
    /// sized for the largest root parameter, since the root's gathers run one after another.
    /// Made once so a step allocates nothing.
    root_recv: Tensor,
    root_send16: Tensor,
    root_stage: Vec<Tensor>,
    /// The step's block uses in order, and how far the step has got.
    schedule: Vec<(usize, Pass)>,
    pos: usize,
    /// Items posted so far.
    posted: usize,
    global_tokens: usize,
    started: Option<Instant>,
}

/// Copy the host-resident master shards `idx` into their device buffers `stage` on the
/// from-host stream, and order the compute stream (the casts, the gathers' posting) after it.
fn copy_shards(be: &dyn Backend, master: &[Tensor], idx: &[usize], stage: &mut [Tensor]) {
    // The buffers' last reader (the previous use's cast) is on the compute stream.
    let read = be.record_event(Stream::Compute);
    be.wait_event(Stream::FromHost, &read);
    for (k, &i) in idx.iter().enumerate() {
        be.copy_async(stage[k].view_mut(), master[i].view(), Stream::FromHost);
    }
    let copied = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &copied);
}

/// Whether parameter `i` is gathered straight into the tensor handed to the model: the
/// gather's dtype is the one the model reads. Otherwise (f32 gathers of a bf16 weight) it is
/// gathered into a receive buffer and cast from there.
fn direct(dtype: GatherDtype, bf16_weight: &[bool], i: usize) -> bool {
    (dtype == GatherDtype::Bf16) == bf16_weight[i]
}

/// Elements of parameter `i`'s gathered array: its shard times its group, padding included.
fn padded(layout: &Layout, groups: &Groups, i: usize) -> usize {
    layout.shard[i] * groups.get(layout.group[i]).size()
}

/// The root's embedding, if it has one.
fn embedding(layout: &Layout) -> Option<usize> {
    root_param(layout, "model.embed_tokens.weight")
}

/// `(embedding, LM head)` indices, when the root holds both with one shape, shard and group:
/// then one tensor can serve both in turn.
fn embedding_and_head(layout: &Layout) -> Option<(usize, usize)> {
    let pair = embedding(layout).zip(root_param(layout, "lm_head.weight"));
    pair.filter(|&(e, h)| {
        layout.local_shape[e] == layout.local_shape[h]
            && layout.shard[e] == layout.shard[h]
            && layout.group[e] == layout.group[h]
    })
}

fn root_param(layout: &Layout, name: &str) -> Option<usize> {
    let mut root = layout.root.iter().copied();
    root.find(|&i| layout.specs[i].name == name)
}

/// A zero-length stand-in for a block parameter that is not gathered.
fn empty(be: &dyn Backend) -> Tensor {
    be.zeros(&[0], Category::Buffers)
}

/// An unsharded parameter as the model reads it, bf16 or f32, in a buffer of `len` elements
/// (its gathered array's, padding included, when a gather writes it).
fn full(be: &dyn Backend, shape: &[usize], bf16: bool, len: usize) -> Tensor {
    let dtype = if bf16 { DType::BF16 } else { DType::F32 };
    be.zeros_of(&[len], dtype, Category::Buffers)
        .padded_to(shape)
}

impl FsdpParams {
    /// `init(i)` gives initial parameter `i` whole; each rank keeps its shard of it, one tensor
    /// at a time, in pinned host memory if `master_on_host`. `bf16_weight[i]`: parameter `i` is
    /// handed to the model in bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &dyn Backend,
        layout: Arc<Layout>,
        groups: Groups,
        dtype: GatherDtype,
        bf16_weight: Vec<bool>,
        prefetch: usize,
        master_on_host: bool,
        init: &dyn Fn(usize) -> Tensor,
    ) -> Self {
        assert_eq!(
            bf16_weight.len(),
            layout.specs.len(),
            "one dtype per parameter"
        );
        let master = (0..layout.specs.len())
            .map(|i| {
                let r = layout.range(i, groups.get(layout.group[i]).rank());
                let mut x = vec![0f32; layout.shard[i]];
                let src = be.download(init(i).view());
                let o = layout.offset[i];
                x[..r.len()].copy_from_slice(&src[o + r.start..o + r.end]);
                if master_on_host {
                    let mut t = be.pinned_zeros(&[layout.shard[i]], Category::Params);
                    be.write(t.view_mut(), &x);
                    t
                } else {
                    be.upload(&x, &[layout.shard[i]], Category::Params)
                }
            })
            .collect();
        let share = embedding_and_head(&layout).filter(|&(e, h)| bf16_weight[e] == bf16_weight[h]);
        let mut specs = layout.specs.clone();
        let tensors = (0..specs.len())
            .map(|i| {
                if layout.root.contains(&i) && share.is_none_or(|(_, h)| h != i) {
                    let len = match direct(dtype, &bf16_weight, i) {
                        true => padded(&layout, &groups, i),
                        false => layout.numel(i),
                    };
                    full(be, &layout.local_shape[i], bf16_weight[i], len)
                } else {
                    specs[i].shape = vec![0];
                    empty(be)
                }
            })
            .collect();
        let store = ParamStore::from_tensors(specs, tensors);
        let mut root_stage = Vec::new();
        let (mut recv, mut send) = (0, 0);
        for &i in &layout.root {
            if !direct(dtype, &bf16_weight, i) {
                recv = recv.max(padded(&layout, &groups, i));
            }
            send = send.max(layout.shard[i]);
            if master_on_host {
                root_stage.push(be.zeros(&[layout.shard[i]], Category::Buffers));
            }
        }
        let (root_recv, root_send16) = match dtype {
            GatherDtype::F32 => (be.zeros(&[recv], Category::Buffers), bf16(be, 0)),
            GatherDtype::Bf16 => (bf16(be, recv), bf16(be, send)),
        };
        let slots = (0..prefetch + 1)
            .map(|_| Slot {
                work: Vec::new(),
                block: None,
                full: Vec::new(),
                recv32: Vec::new(),
                send16: Vec::new(),
                recv16: Vec::new(),
                stage: Vec::new(),
            })
            .collect();
        FsdpParams {
            slots,
            layout,
            groups,
            dtype,
            bf16_weight,
            prefetch,
            master,
            master_on_host,
            store,
            share,
            root_recv,
            root_send16,
            root_stage,
            schedule: Vec::new(),
            pos: 0,
            posted: 0,
            global_tokens: 0,
            started: None,
        }
    }

    /// Start a step (`train`: forward and backward; else forward only) over a global batch of
    /// `global_tokens` tokens: gathers the root unit and posts the first blocks' gathers.
    pub fn begin(&mut self, be: &dyn Backend, train: bool, global_tokens: usize) -> Result<()> {
        assert!(
            self.pos == self.schedule.len(),
            "previous step left blocks in use"
        );
        let l = self.layout.blocks.len();
        self.schedule = (0..l).map(|b| (b, Pass::Forward)).collect();
        if train {
            self.schedule
                .extend((0..l).rev().map(|b| (b, Pass::Backward)));
        }
        self.pos = 0;
        self.posted = 0;
        self.global_tokens = global_tokens;
        if self.master_on_host {
            copy_shards(be, &self.master, &self.layout.root, &mut self.root_stage);
        }
        if let Some((e, h)) = self.share {
            if self.store.get(e).is_empty() {
                self.store.tensors_mut().swap(e, h);
            }
        }
        for k in 0..self.layout.root.len() {
            if self.share.is_some_and(|(_, h)| h == self.layout.root[k]) {
                continue;
            }
            self.gather_root(be, k)?;
        }
        self.post_until(be, self.prefetch)
    }

    /// Gather the root unit's `k`-th parameter into the store, in the same dtype as the blocks.
    fn gather_root(&mut self, be: &dyn Backend, k: usize) -> Result<()> {
        let i = self.layout.root[k];
        let g = self.groups.get(self.layout.group[i]).clone();
        let (n, s) = (self.layout.numel(i), self.layout.shard[i]);
        let padded = s * g.size();
        let direct = self.direct(i);
        let shard = match self.master_on_host {
            true => &self.root_stage[k],
            false => &self.master[i],
        };
        let send = match self.dtype {
            GatherDtype::F32 => shard.view(),
            GatherDtype::Bf16 => {
                be.cast(self.root_send16.slice_mut(0, s), shard.view());
                self.root_send16.slice(0, s)
            }
        };
        let recv = match direct {
            true => self.store.get_mut(i).padded_view_mut(),
            false => self.root_recv.slice_mut(0, padded),
        };
        g.all_gather(send, recv, Phase::ForwardGather)
            .context("gathering the root parameters")?;
        if !direct {
            // Widened (an f32 parameter gathered in bf16) or rounded (a bf16 weight in f32).
            be.cast(self.store.get_mut(i).view_mut(), self.root_recv.slice(0, n));
        }
        Ok(())
    }

    /// [`direct`] for parameter `i`.
    fn direct(&self, i: usize) -> bool {
        direct(self.dtype, &self.bf16_weight, i)
    }

    /// Post gathers for schedule items up to `last` (inclusive).
    fn post_until(&mut self, be: &dyn Backend, last: usize) -> Result<()> {
        while self.posted <= last && self.posted < self.schedule.len() {
            self.post(be, self.posted)?;
            self.posted += 1;
        }
        Ok(())
    }

    fn post(&mut self, be: &dyn Backend, item: usize) -> Result<()> {
        let (b, pass) = self.schedule[item];
        let phase = match pass {
            Pass::Forward => Phase::ForwardGather,
            Pass::Backward => Phase::BackwardGather,
        };
        let nslots = self.slots.len();
        let layout = self.layout.clone();
        let idx = &layout.blocks[b];
        let slot = &mut self.slots[item % nslots];
        debug_assert!(slot.work.is_empty(), "slot reused while in flight");
        // (Re)shape the slot for this block; uniform blocks never reallocate.
        let half = &self.bf16_weight;
        let len = |i: usize| match direct(self.dtype, half, i) {
            true => padded(&layout, &self.groups, i),
            false => layout.numel(i),
        };
        let fits = slot.full.len() == idx.len()
            && idx.iter().zip(&slot.full).all(|(&i, t)| {
                t.shape() == layout.local_shape[i].as_slice()
                    && t.capacity() == len(i)
                    && (t.dtype() == DType::BF16) == half[i]
            });
        if !fits {
            slot.full = idx
                .iter()
                .map(|&i| full(be, &layout.local_shape[i], half[i], len(i)))
                .collect();
            slot.recv32.clear();
            slot.send16.clear();
            slot.recv16.clear();
            slot.stage.clear();
            for &i in idx {
                let recv = match direct(self.dtype, half, i) {
                    true => 0,
                    false => padded(&layout, &self.groups, i),
                };
                if self.master_on_host {
                    slot.stage
                        .push(be.zeros(&[layout.shard[i]], Category::Buffers));
                }
                match self.dtype {
                    GatherDtype::F32 => slot.recv32.push(be.zeros(&[recv], Category::Buffers)),
                    GatherDtype::Bf16 => {
                        slot.send16.push(bf16(be, layout.shard[i]));
                        slot.recv16.push(bf16(be, recv));
                    }
                }
            }
        }
        slot.block = Some(b);
        if self.master_on_host {
            copy_shards(be, &self.master, idx, &mut slot.stage);
        }
        for (k, &i) in idx.iter().enumerate() {
            let g: &'static dyn ProcessGroup =
                unsafe { extend_to_static(self.groups.get(layout.group[i]).as_ref()) };
            let shard = match self.master_on_host {
                true => &slot.stage[k],
                false => &self.master[i],
            };
            let send = match self.dtype {
                GatherDtype::F32 => shard,
                GatherDtype::Bf16 => {
                    be.cast(slot.send16[k].view_mut(), shard.view());
                    &slot.send16[k]
                }
            };
            let recv = match (direct(self.dtype, half, i), self.dtype) {
                (true, _) => &mut slot.full[k],
                (false, GatherDtype::F32) => &mut slot.recv32[k],
                (false, GatherDtype::Bf16) => &mut slot.recv16[k],
            };
            // SAFETY: see `extend_to_static`; the master shards are not written while gathers are in
            // flight (`master_mut` checks), nor a slot's stage (the slot's gathers are done);
            // a direct parameter's tensor is in the slot, not handed to the model, until the
            // gather is waited on (`acquire_block`).
            let (send, recv) = unsafe { (extend_to_static(send), extend_to_static_mut(recv)) };
            let w = g.iall_gather(send.view(), recv.padded_view_mut(), phase);
            slot.work.push(w.context("posting a parameter gather")?);
        }
        Ok(())
    }

    /// Whether a posted gather may still read the master shards or write a slot.
    fn in_flight(&self) -> bool {
        self.slots.iter().any(|s| !s.work.is_empty())
    }

    /// Shard of parameter `i`, this rank's. Between steps only: panics while gathers are in
    /// flight (they read the shards).
    pub fn shard(&self, i: usize) -> &Tensor {
        assert!(
            !self.in_flight(),
            "master shards read while gathers are in flight"
        );
        &self.master[i]
    }

    /// The master shards, to update or load. Between steps only: panics while a gather posted
    /// from them is in flight, which is what makes the `'static` borrows of `post` sound.
    pub fn master_mut(&mut self) -> &mut [Tensor] {
        assert!(
            !self.in_flight(),
            "master shards written while gathers are in flight"
        );
        &mut self.master
    }
}

/// Gathers still posted when the state goes are those of a step that failed midway (a step
/// waits for all of its own): walk away from them, as unwinding would, rather than wait for
/// peers that may never join.
impl Drop for FsdpParams {
    fn drop(&mut self) {
        for s in &mut self.slots {
            s.work.drain(..).for_each(Work::abandon);
        }
    }
}

impl ParamSource for FsdpParams {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn acquire_head(&mut self, be: &dyn Backend) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            if let Some((e, h)) = self.share {
                // The embedding's lookup is done: its tensor takes the LM head.
                self.store.tensors_mut().swap(e, h);
                let k = self.layout.root.iter().position(|&r| r == h).unwrap();
                self.gather_root(be, k)?;
            }
            Ok(())
        })
    }

    fn acquire_block(&mut self, be: &dyn Backend, l: usize, pass: Pass) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            let item = self.pos;
            assert_eq!(
                self.schedule.get(item),
                Some(&(l, pass)),
                "blocks used out of the FSDP schedule"
            );
            // Keep `prefetch` blocks in flight beyond this one.
            // Posting allocates only when a block of new shapes takes a slot.
            self.post_until(be, item + self.prefetch)?;
            let nslots = self.slots.len();
            let slot = &mut self.slots[item % nslots];
            debug_assert_eq!(slot.block, Some(l));
            // The backend traces each gather (posted to done) and the time blocked here.
            wait_each(slot.work.drain(..).map(|w| (w, ())), |()| {})
                .with_context(|| format!("gathering block {l}'s parameters"))?;
            let idx = &self.layout.blocks[l];
            for (k, &i) in idx.iter().enumerate() {
                let n = self.layout.numel(i);
                if !direct(self.dtype, &self.bf16_weight, i) {
                    let recv = match self.dtype {
                        GatherDtype::F32 => slot.recv32[k].slice(0, n),
                        GatherDtype::Bf16 => slot.recv16[k].slice(0, n),
                    };
                    be.cast(slot.full[k].view_mut(), recv);
                }
                std::mem::swap(self.store.get_mut(i), &mut slot.full[k]);
            }
            self.started = Some(Instant::now());
            Ok(())
        })
    }

    fn release_block(&mut self, _be: &dyn Backend, l: usize, pass: Pass) -> Result<()> {
        let item = self.pos;
        let nslots = self.slots.len();
        let slot = &mut self.slots[item % nslots];
        for (k, &i) in self.layout.blocks[l].iter().enumerate() {
            std::mem::swap(self.store.get_mut(i), &mut slot.full[k]);
        }
        if let Some(t0) = self.started.take() {
            let name = match pass {
                Pass::Forward => format!("block {l} forward"),
                Pass::Backward => format!("block {l} backward"),
            };
            self.groups
                .dp
                .ctx()
                .tracer
                .record(name, Track::Compute, t0, Instant::now(), None);
        }
        self.pos += 1;
        Ok(())
    }

    fn global_tokens(&self, _local: usize) -> usize {
        self.global_tokens
    }

    fn reduce_counts(&mut self, be: &dyn Backend, counts: ViewMut) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            // Every rank routes its own tokens; the auxiliary loss's gradient is the global
            // batch's. Counts are integers, exact in f64; summed on the device tensor itself.
            self.groups
                .world
                .all_reduce(counts, Phase::Other)
                .context("summing expert counts")
        })
    }

    fn reduce_psum(&mut self, be: &dyn Backend, psum: ViewMut) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            // On the device tensor itself, so the step reads it once, summed.
            self.groups
                .world
                .all_reduce(psum, Phase::Other)
                .context("summing routing statistics")
        })
    }
}

/// Post the reduce-scatter of parameter `i`'s gradient, `send` with its padded rows (zero), onto
/// `shard`.
///
/// SAFETY (for callers): see [`extend_to_static`]: `send` must stay allocated and unwritten until the
/// returned work is waited on or dropped. The shards are read only through
/// [`FsdpGrads::shards`], which checks that no reduce-scatter is pending.
unsafe fn post_reduce_scatter(
    groups: &Groups,
    layout: &Layout,
    i: usize,
    send: &Tensor,
    shard: &mut Tensor,
) -> Result<Work<'static>> {
    let g: &'static dyn ProcessGroup = extend_to_static(groups.get(layout.group[i]).as_ref());
    let (send, recv) = (extend_to_static(send), extend_to_static_mut(shard));
    g.ireduce_scatter(
        send.padded_view(),
        recv.view_mut(),
        Phase::GradReduceScatter,
    )
    .context("posting a gradient reduce-scatter")
}

/// Where an accumulating reduce-scatter lands before it is added into its shard.
#[derive(Clone, Copy, Debug)]
enum Landing {
    /// The first microbatch's: straight into the shard.
    Shard,
    /// Gradient set `t`'s landing shard `k` (the block's `k`-th tensor).
    Block(usize, usize),
    /// The root tensor's landing shard.
    Root,
}

/// The tensor a reduce-scatter of parameter `i` writes, by where it lands.
fn landing_tensor<'a>(
    at: Landing,
    i: usize,
    shards: &'a mut [Tensor],
    landing: &'a mut [Vec<Tensor>],
    landing_root: &'a mut [Tensor],
) -> &'a mut Tensor {
    match at {
        Landing::Shard => &mut shards[i],
        Landing::Block(t, k) => &mut landing[t][k],
        Landing::Root => &mut landing_root[i],
    }
}

/// A zero gradient for parameter `i` in a buffer with room for its padded rows, which stay
/// zero: the model writes only the tensor's own elements.
fn padded_grad(be: &dyn Backend, layout: &Layout, groups: &Groups, i: usize) -> Tensor {
    let len = padded(layout, groups, i);
    be.zeros(&[len], Category::Grads)
        .padded_to(&layout.local_shape[i])
}

/// The gradient side of FSDP for one rank.
pub struct FsdpGrads {
    /// Reduce-scatters in flight, per gradient set, with their parameter's index and where
    /// they land; declared first (dropping waits).
    pending: Vec<Vec<(Work<'static>, usize, Landing)>>,
    /// Reduce-scatters of the head's gradients (final norm, LM head) in flight, posted when
    /// the head's backward ends; declared first (dropping waits).
    head_pending: Vec<(Work<'static>, usize, Landing)>,
    /// Gradient accumulation: a microbatch after a step's first reduce-scatters into landing
    /// shards, each added into its parameter's shard once its reduce-scatter is done (a
    /// reduce-scatter overwrites its output). One block's landing shards per gradient set
    /// (reused as the sets are: a set's reduce-scatters are settled before it is taken again)
    /// and the root's, made at the first such microbatch.
    accumulate: bool,
    landing: Vec<Vec<Tensor>>,
    landing_root: Vec<Tensor>,
    /// `(embedding, LM head)` when they have one shape and shard: one gradient tensor serves
    /// both, the head's until its reduce-scatter is done, then the embedding's, whose backward
    /// is the step's last.
    share: Option<(usize, usize)>,
    /// The head's gradients were reduce-scattered this step (`end_head`).
    head_sent: bool,
    /// The embedding's index in the table, if the root has one.
    embedding: Option<usize>,
    layout: Arc<Layout>,
    groups: Groups,
    /// What the model writes: root gradients resident, block entries empty except in backward.
    /// Each gradient's buffer holds its padded rows (zero, never written): a reduce-scatter
    /// sends the tensor as it is.
    store: ParamStore,
    /// One block's full gradients, in `parallelism.gradient_sets` sets taken in turn: with two,
    /// a reduce-scatter (which sends from its set) travels during the next block's backward;
    /// with one, the next block's backward waits for it. Reused by every block of the same
    /// shapes.
    pool: Vec<Vec<Tensor>>,
    pool_block: Option<usize>,
    /// The set the next block's backward writes.
    turn: usize,
    /// Gradient shards, f32, in table order. Private: posted reduce-scatters write them, so
    /// access goes through [`FsdpGrads::shards`] / [`FsdpGrads::shards_mut`], which check that
    /// none is in flight.
    shards: Vec<Tensor>,
}

impl FsdpGrads {
    /// `sets`: `parallelism.gradient_sets` (1 or 2).
    pub fn new(be: &dyn Backend, layout: Arc<Layout>, groups: Groups, sets: usize) -> Self {
        assert!((1..=2).contains(&sets), "1 or 2 gradient sets, not {sets}");
        let embedding = embedding(&layout);
        let share = embedding_and_head(&layout);
        let shared_embed = |i: usize| share.is_some_and(|(e, _)| e == i);
        let mut specs = layout.specs.clone();
        let tensors = (0..specs.len())
            .map(|i| {
                if layout.root.contains(&i) && !shared_embed(i) {
                    padded_grad(be, &layout, &groups, i)
                } else {
                    specs[i].shape = vec![0];
                    be.zeros(&[0], Category::Grads)
                }
            })
            .collect();
        let shards = (0..layout.specs.len())
            .map(|i| be.zeros(&[layout.shard[i]], Category::Grads))
            .collect();
        FsdpGrads {
            pending: (0..sets).map(|_| Vec::new()).collect(),
            head_pending: Vec::new(),
            accumulate: false,
            landing: (0..sets).map(|_| Vec::new()).collect(),
            landing_root: Vec::new(),
            share,
            head_sent: false,
            embedding,
            store: ParamStore::from_tensors(specs, tensors),
            pool: (0..sets).map(|_| Vec::new()).collect(),
            pool_block: None,
            turn: 0,
            shards,
            layout,
            groups,
        }
    }

    /// Zero the resident root gradients (start of a microbatch); a shared tensor goes back to
    /// the LM head. `accumulate`: this microbatch's gradients are added to the shards (every
    /// microbatch of a step after the first); else they replace them.
    pub fn begin(&mut self, be: &dyn Backend, accumulate: bool) -> Result<()> {
        // A step that ended early (an error between `end_head` and `finish`) left its head's
        // reduce-scatters: done before the tensors are zeroed.
        self.wait_head(be)?;
        self.accumulate = accumulate;
        if accumulate && self.landing_root.is_empty() {
            let root = &self.layout.root;
            self.landing_root = (0..self.layout.shard.len())
                .map(|i| match root.contains(&i) {
                    true => be.zeros(&[self.layout.shard[i]], Category::Grads),
                    false => be.zeros(&[0], Category::Grads),
                })
                .collect();
        }
        self.head_sent = false;
        if let Some((e, h)) = self.share {
            if self.store.get(h).is_empty() {
                self.store.tensors_mut().swap(e, h);
            }
        }
        for &i in &self.layout.root {
            be.fill(self.store.get_mut(i).view_mut(), 0.0);
        }
        Ok(())
    }

    /// Whether root parameter `i` is the embedding (reduce-scattered at the step's end; the
    /// head's others when the head's backward ends).
    fn is_embedding(&self, i: usize) -> bool {
        self.embedding == Some(i)
    }

    /// Wait for the head's reduce-scatters.
    fn wait_head(&mut self, be: &dyn Backend) -> Result<()> {
        let works: Vec<_> = self.head_pending.drain(..).collect();
        self.settle(be, works, "reduce-scattering the head's gradients")
    }

    /// Wait for `works` (reduce-scatters of the parameters they name); when accumulating, add
    /// each landed shard into its parameter's.
    fn settle(
        &mut self,
        be: &dyn Backend,
        works: Vec<(Work<'static>, usize, Landing)>,
        what: &str,
    ) -> Result<()> {
        let works = works.into_iter().map(|(w, i, at)| (w, (i, at)));
        wait_each(works, |(i, at)| self.add_landed(be, i, at)).with_context(|| what.to_string())
    }

    /// Add parameter `i`'s landed shard into its shard (nothing for one that landed there).
    fn add_landed(&mut self, be: &dyn Backend, i: usize, at: Landing) {
        let landed = match at {
            Landing::Shard => return,
            Landing::Block(t, k) => self.landing[t][k].view(),
            Landing::Root => self.landing_root[i].view(),
        };
        be.add(self.shards[i].view_mut(), landed);
    }

    /// Post parameter `i`'s reduce-scatter from `send` to where `at` lands it.
    ///
    /// SAFETY: as [`post_reduce_scatter`]'s.
    unsafe fn post(
        &mut self,
        i: usize,
        send: &'static Tensor,
        at: Landing,
    ) -> Result<Work<'static>> {
        let recv = landing_tensor(
            at,
            i,
            &mut self.shards,
            &mut self.landing,
            &mut self.landing_root,
        );
        post_reduce_scatter(&self.groups, &self.layout, i, send, recv)
    }

    /// Where root parameter `i`'s reduce-scatter lands this microbatch.
    fn root_landing(&self) -> Landing {
        match self.accumulate {
            true => Landing::Root,
            false => Landing::Shard,
        }
    }

    /// Wait for every block reduce-scatter in flight.
    fn wait_blocks(&mut self, be: &dyn Backend) -> Result<()> {
        for t in 0..self.pending.len() {
            let works: Vec<_> = self.pending[t].drain(..).collect();
            self.settle(be, works, "reduce-scattering block gradients")?;
        }
        Ok(())
    }

    /// Reduce-scatter the root gradients not yet sent and wait for every reduce-scatter (the
    /// end of a microbatch); at the step's `last`, (HSDP) sum the shards across replicas: the
    /// shards then hold the global batch's gradients.
    pub fn finish(&mut self, be: &dyn Backend, last: bool) -> Result<()> {
        self.wait_head(be)?;
        let head_sent = std::mem::take(&mut self.head_sent);
        for &i in self.layout.root.clone().iter() {
            if head_sent && !self.is_embedding(i) {
                continue;
            }
            let g = self.groups.get(self.layout.group[i]).clone();
            let at = self.root_landing();
            let send = self.store.get(i).padded_view();
            let recv = landing_tensor(
                at,
                i,
                &mut self.shards,
                &mut self.landing,
                &mut self.landing_root,
            );
            g.reduce_scatter(send, recv.view_mut(), Phase::GradReduceScatter)
                .context("reduce-scattering root gradients")?;
            self.add_landed(be, i, at);
        }
        self.wait_blocks(be)?;
        if !last {
            return Ok(());
        }
        if let Some(rep) = &self.groups.replicate {
            // Each replica's shards are its slices' share of the global mean (the loss is
            // normalised by the global batch's tokens), so the sum is the global gradient. All
            // posted at once so they travel together; padded tails are zero on every replica.
            let works = self
                .shards
                .iter_mut()
                .map(|t| rep.iall_reduce(t.view_mut(), Phase::GradReplicaAllReduce))
                .collect::<Result<Vec<Work<'_>>, _>>()
                .context("posting a gradient all-reduce across replicas")?;
            wait_each(works.into_iter().map(|w| (w, ())), |()| {})
                .context("all-reducing gradients across replicas")?;
        }
        Ok(())
    }

    fn in_flight(&self) -> bool {
        self.pending.iter().any(|p| !p.is_empty()) || !self.head_pending.is_empty()
    }

    /// The gradient shards (the global batch's after [`FsdpGrads::finish`]). Panics while a
    /// reduce-scatter into them is in flight.
    pub fn shards(&self) -> &[Tensor] {
        assert!(
            !self.in_flight(),
            "gradient shards read while reduce-scatters are in flight"
        );
        &self.shards
    }

    /// See [`FsdpGrads::shards`].
    pub fn shards_mut(&mut self) -> &mut [Tensor] {
        assert!(
            !self.in_flight(),
            "gradient shards written while reduce-scatters are in flight"
        );
        &mut self.shards
    }

    fn shape_for(&mut self, be: &dyn Backend, l: usize) -> Result<()> {
        let idx = &self.layout.blocks[l];
        let fits = self.pool[0].len() == idx.len()
            && idx
                .iter()
                .zip(&self.pool[0])
                .all(|(&i, t)| t.shape() == self.layout.local_shape[i].as_slice());
        if fits {
            return Ok(());
        }
        let idx = idx.clone();
        self.wait_blocks(be)?;
        // Drop the old sets first, so the ledger's peak does not count both; landing shards
        // are made again for the new shapes when a microbatch accumulates.
        let sets = self.pool.len();
        self.pool = (0..sets).map(|_| Vec::new()).collect();
        self.landing = (0..sets).map(|_| Vec::new()).collect();
        for t in 0..sets {
            self.pool[t] = idx
                .iter()
                .map(|&i| padded_grad(be, &self.layout, &self.groups, i))
                .collect();
        }
        Ok(())
    }
}

/// As for [`FsdpParams`]: reduce-scatters still posted belong to a failed step.
impl Drop for FsdpGrads {
    fn drop(&mut self) {
        let head = self.head_pending.drain(..);
        let blocks = self.pending.iter_mut().flat_map(|p| p.drain(..));
        head.chain(blocks).for_each(|(w, ..)| w.abandon());
    }
}

impl GradSink for FsdpGrads {
    fn grads(&mut self) -> &mut ParamStore {
        &mut self.store
    }

    fn begin_block(&mut self, be: &dyn Backend, l: usize) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            self.shape_for(be, l)?;
            self.pool_block = Some(l);
            let t = self.turn;
            // The set about to be written: its reduce-scatters (the block that last took it) must
            // be done.
            let works: Vec<_> = self.pending[t].drain(..).collect();
            self.settle(be, works, "reduce-scattering block gradients")?;
            // This block's landing shards in set t, made (again) where their sizes differ: shards
            // can differ between blocks of one shape where ownership does.
            let (shard, idx) = (&self.layout.shard, &self.layout.blocks[l]);
            let fits = self.landing[t].len() == idx.len()
                && (idx.iter().zip(&self.landing[t])).all(|(&i, x)| x.shape() == [shard[i]]);
            if self.accumulate && !fits {
                self.landing[t] = Vec::new();
                self.landing[t] = (idx.iter())
                    .map(|&i| be.zeros(&[shard[i]], Category::Grads))
                    .collect();
            }
            for (k, &i) in self.layout.blocks[l].iter().enumerate() {
                be.fill(self.pool[t][k].view_mut(), 0.0);
                std::mem::swap(self.store.get_mut(i), &mut self.pool[t][k]);
            }
            Ok(())
        })
    }

    fn end_head(&mut self, be: &dyn Backend) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            for i in self.layout.root.clone() {
                if self.is_embedding(i) {
                    continue;
                }
                let at = self.root_landing();
                // SAFETY: the head's gradient is not written again before this work is waited on
                // (`begin_embedding` or `finish`), nor its target read.
                let w = unsafe {
                    let send = extend_to_static(self.store.get(i));
                    self.post(i, send, at)?
                };
                self.head_pending.push((w, i, at));
            }
            self.head_sent = true;
            Ok(())
        })
    }

    fn begin_embedding(&mut self, be: &dyn Backend) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            if let Some((e, h)) = self.share {
                // The LM head's reduce-scatter reads the tensor: done before the embedding writes it.
                self.wait_head(be)?;
                self.store.tensors_mut().swap(e, h);
                be.fill(self.store.get_mut(e).view_mut(), 0.0);
            }
            Ok(())
        })
    }

    fn end_block(&mut self, be: &dyn Backend, l: usize) -> Result<()> {
        in_phase(be, StepPhase::Communication, || {
            let t = self.turn;
            self.turn = (t + 1) % self.pool.len();
            let idx = self.layout.blocks[l].clone();
            for (k, &i) in idx.iter().enumerate() {
                std::mem::swap(self.store.get_mut(i), &mut self.pool[t][k]);
                let at = match self.accumulate {
                    true => Landing::Block(t, k),
                    false => Landing::Shard,
                };
                // SAFETY: the send set and the landing shards are not written again before this
                // work is waited on (`begin_block` of the next block to take this set), nor its
                // target read.
                let w = unsafe {
                    let send = extend_to_static(&self.pool[t][k]);
                    self.post(i, send, at)?
                };
                self.pending[t].push((w, i, at));
            }
            self.pool_block = None;
            Ok(())
        })
    }
}

//! The residual stream at block boundaries, and its offload to host memory (the write-up's
//! activation offload): with full activation checkpointing a block boundary is all that survives
//! the forward, and for the first `n_off` of them (block inputs `0..n_off`) even that leaves the
//! device.
//!
//! - Forward: boundary `b < n_off` is written into device pool slot `b % 2`; once written it is
//!   copied to its pinned host tensor on the to-host stream while block `b` reads it. The slot is
//!   written again (boundary `b + 2`) only after that copy's event.
//! - Backward: when block `l` begins, boundary `l − 1` is fetched back into its slot on the
//!   from-host stream, so it lands while block `l` recomputes and backpropagates (one layer
//!   ahead). Block `l − 1` waits on that copy's event before reading.
//!
//! Boundaries `n_off..=L` keep their own device tensors. The device thus holds
//! `L + 1 − n_off + min(n_off, 2)` boundaries and the host `n_off`, which is what the planner
//! predicts. Copies are exact, so a step's results do not depend on `n_off`.
//!
//! Every use is ordered by events as a GPU requires; the two-memory CPU backend's checking mode
//! turns a missing wait into a panic at the access it leaves unordered.
//!
//! With bf16 boundaries (`Model::bf16_boundaries`) every boundary, its pool slots and its host
//! copies are bf16, and one f32 working copy on the device stands between them and compute: a
//! producer (the embedding, a block) writes its f32 output into a stage the caller lends
//! ([`Boundaries::out`], [`Boundaries::pair`]; the head's `xf`, free until the final norm) and
//! [`Boundaries::store`] rounds it into the boundary; a reader widens the boundary into the
//! working copy ([`Boundaries::widen`]) and reads that ([`Boundaries::get`]). The forward, the
//! recompute and the backward of a block thus read the same widened values, and the copies move
//! half the bytes. Both casts run on the compute stream, between the same event waits as the
//! f32 boundaries' own writes and reads.

use ganymede_core::{Backend, Category, DType, Event, Stream, Tensor, View, ViewMut};

/// Number of device slots the offloaded boundaries rotate through: the one a block reads and
/// the one its neighbour writes (forward) or the prefetch fills (backward).
const SLOTS: usize = 2;

/// A wait the offload code can be told to leave out, to show that the checking mode catches it.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffloadFault {
    /// Compute reads a prefetched boundary without waiting for its from-host copy.
    SkipPrefetchWait,
    /// Compute overwrites a slot without waiting for its to-host copy.
    SkipSlotFreeWait,
}

pub(crate) struct Boundaries {
    /// Device tensors: the kept boundaries' own, then the pool slots.
    dev: Vec<Tensor>,
    /// `loc[b]`: where boundary `b` lives in `dev` (its own tensor or its slot).
    loc: Vec<usize>,
    /// Pinned host copies of boundaries `0..n_off`.
    host: Vec<Tensor>,
    /// Per host copy: its to-host copy's event (the host tensor holds the boundary after it).
    saved: Vec<Option<Event>>,
    /// Per slot: event after which the slot's last to-host copy has read it.
    drained: [Option<Event>; SLOTS],
    /// Per slot: the boundary being fetched into it and the event of that copy.
    fetching: [Option<(usize, Event)>; SLOTS],
    fault: Option<OffloadFault>,
    /// With bf16 boundaries: the f32 working copy readers see, and the boundary it holds.
    work: Option<(Tensor, Option<usize>)>,
}

impl Boundaries {
    /// `layers + 1` boundaries of `len` elements, bf16 or in the backend's precision; the first
    /// `n_off` (at most `layers`, the last boundary feeds the head at once) offloaded.
    pub fn new(be: &dyn Backend, layers: usize, len: usize, n_off: usize, bf16: bool) -> Self {
        let n_off = n_off.min(layers);
        let slots = n_off.min(SLOTS);
        let zeros = |pinned: bool| match (bf16, pinned) {
            (false, false) => be.zeros(&[len], Category::Activations),
            (false, true) => be.pinned_zeros(&[len], Category::Activations),
            (true, false) => be.zeros_of(&[len], DType::BF16, Category::Activations),
            (true, true) => be.pinned_zeros_of(&[len], DType::BF16, Category::Activations),
        };
        let mut dev = Vec::new();
        let mut loc = vec![0; layers + 1];
        for l in loc.iter_mut().skip(n_off) {
            *l = dev.len();
            dev.push(zeros(false));
        }
        let first_slot = dev.len();
        for _ in 0..slots {
            dev.push(zeros(false));
        }
        for (b, l) in loc.iter_mut().enumerate().take(n_off) {
            *l = first_slot + b % SLOTS;
        }
        let work = bf16.then(|| (be.zeros(&[len], Category::Activations), None));
        let host = (0..n_off).map(|_| zeros(true)).collect();
        Boundaries {
            dev,
            loc,
            host,
            saved: vec![None; n_off],
            drained: [None, None],
            fetching: [None, None],
            fault: None,
            work,
        }
    }

    /// Boundaries offloaded to host memory.
    pub fn offloaded(&self) -> usize {
        self.host.len()
    }

    /// Boundary `b`'s values in the compute precision: the boundary itself, or with bf16
    /// boundaries its working copy, which [`Boundaries::widen`] must have filled.
    pub fn get(&self, b: usize) -> View<'_> {
        match &self.work {
            None => self.dev[self.loc[b]].view(),
            Some((w, holds)) => {
                assert_eq!(*holds, Some(b), "boundary {b} read before it was widened");
                w.view()
            }
        }
    }

    /// With bf16 boundaries, widen boundary `b` into the working copy (compute stream) for
    /// [`Boundaries::get`]; nothing with f32 ones.
    pub fn widen(&mut self, be: &dyn Backend, b: usize) {
        if let Some((w, holds)) = &mut self.work {
            be.cast(w.view_mut(), self.dev[self.loc[b]].view());
            *holds = Some(b);
        }
    }

    /// Where boundary `b`'s producer writes its f32 values: the boundary itself, or with bf16
    /// boundaries `stage`, which [`Boundaries::store`] then rounds into it.
    pub fn out<'a>(&'a mut self, b: usize, stage: &'a mut Tensor) -> ViewMut<'a> {
        match self.work {
            None => self.dev[self.loc[b]].view_mut(),
            Some(_) => stage.view_mut(),
        }
    }

    /// With bf16 boundaries, round `stage` (what [`Boundaries::out`] or [`Boundaries::pair`]
    /// lent) into boundary `b` (compute stream); nothing with f32 ones.
    pub fn store(&mut self, be: &dyn Backend, b: usize, stage: &Tensor) {
        if let Some((_, holds)) = &mut self.work {
            be.cast(self.dev[self.loc[b]].view_mut(), stage.view());
            if *holds == Some(b) {
                *holds = None;
            }
        }
    }

    /// Block `b`'s input to read and where to write its output: boundaries `b` and `b + 1`,
    /// or with bf16 boundaries boundary `b` widened and `stage` (then [`Boundaries::store`]).
    pub fn pair<'a>(
        &'a mut self,
        be: &dyn Backend,
        b: usize,
        stage: &'a mut Tensor,
    ) -> (View<'a>, ViewMut<'a>) {
        if self.work.is_some() {
            self.widen(be, b);
            let (w, _) = self.work.as_ref().expect("a working copy");
            return (w.view(), stage.view_mut());
        }
        let (i, o) = (self.loc[b], self.loc[b + 1]);
        assert_ne!(i, o, "a block's input and output share a slot");
        if i < o {
            let (lo, hi) = self.dev.split_at_mut(o);
            (lo[i].view(), hi[0].view_mut())
        } else {
            let (lo, hi) = self.dev.split_at_mut(i);
            (hi[0].view(), lo[o].view_mut())
        }
    }

    pub fn bytes(&self) -> u64 {
        self.dev
            .iter()
            .chain(&self.host)
            .chain(self.work.as_ref().map(|(w, _)| w))
            .map(|t| t.bytes() as u64)
            .sum()
    }

    #[doc(hidden)]
    pub fn inject_fault(&mut self, fault: Option<OffloadFault>) {
        self.fault = fault;
    }

    fn slot(b: usize) -> usize {
        b % SLOTS
    }

    /// Compute is about to write boundary `b`: its slot's previous to-host copy must be done.
    pub fn before_write(&mut self, be: &dyn Backend, b: usize) {
        if b >= self.offloaded() {
            return;
        }
        if let Some(e) = self.drained[Self::slot(b)].take() {
            if self.fault != Some(OffloadFault::SkipSlotFreeWait) {
                be.wait_event(Stream::Compute, &e);
            }
        }
    }

    /// Compute has written boundary `b`: start its copy to host memory (training forward only;
    /// an evaluation forward never reads it back).
    pub fn after_write(&mut self, be: &dyn Backend, b: usize) {
        if b >= self.offloaded() {
            return;
        }
        let written = be.record_event(Stream::Compute);
        be.wait_event(Stream::ToHost, &written);
        let s = self.loc[b];
        be.copy_async(self.host[b].view_mut(), self.dev[s].view(), Stream::ToHost);
        let done = be.record_event(Stream::ToHost);
        self.saved[b] = Some(done.clone());
        self.drained[Self::slot(b)] = Some(done);
    }

    /// Start fetching boundary `b` back into its slot on the from-host stream. The slot's
    /// earlier readers (compute, and the to-host copy of the boundary it held) must be done.
    fn fetch(&mut self, be: &dyn Backend, b: usize) {
        let s = Self::slot(b);
        let readers_done = be.record_event(Stream::Compute);
        be.wait_event(Stream::FromHost, &readers_done);
        if let Some(e) = self.drained[s].take() {
            be.wait_event(Stream::FromHost, &e);
        }
        let saved = self.saved[b]
            .as_ref()
            .expect("boundary fetched before it was offloaded");
        be.wait_event(Stream::FromHost, saved);
        let d = self.loc[b];
        be.copy_async(
            self.dev[d].view_mut(),
            self.host[b].view(),
            Stream::FromHost,
        );
        self.fetching[s] = Some((b, be.record_event(Stream::FromHost)));
    }

    /// Block `l` begins its backward: make its input readable by compute (fetching it now if no
    /// prefetch did), and prefetch the input of block `l − 1`.
    pub fn before_backward(&mut self, be: &dyn Backend, l: usize) {
        let n_off = self.offloaded();
        if l < n_off {
            let s = Self::slot(l);
            if !matches!(self.fetching[s], Some((b, _)) if b == l) {
                // Nothing ran before this block to hide the copy behind (every block offloaded).
                self.fetch(be, l);
            }
            let (_, e) = self.fetching[s].take().expect("fetch in flight");
            if self.fault != Some(OffloadFault::SkipPrefetchWait) {
                be.wait_event(Stream::Compute, &e);
            }
        }
        if l >= 1 && l - 1 < n_off {
            self.fetch(be, l - 1);
        }
    }
}

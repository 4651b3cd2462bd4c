//! Optimizer state in host memory (`optimizer.offload`): each parameter's state lives in pinned
//! host memory and is streamed through two device staging slots for its update, double-buffered
//! so the from-host copy of the next parameter's state overlaps this one's update:
//!
//! ```text
//! from-host:  fill k+1 (after slot's drain k-1) ─┐
//! compute:    (wait fill k) update k ────────────┼─ (wait fill k+1) update k+1
//! to-host:                  (wait update k) drain k
//! ```
//!
//! Each slot is sized for the largest single parameter's state (numel for Muon's momentum,
//! 2·numel for AdamW's m and v), allocated once. Events order every hand-over, so the same code
//! is correct on a GPU; the checking two-memory CPU mode panics at any missing wait.

use ganymede_core::{Backend, Category, Event, Stream, Tensor, ViewMut};

/// A wait of the pipeline to leave out, to test that the checking mode catches it.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipWait {
    /// The update does not wait for its state's from-host copy.
    Fill,
    /// The to-host copy does not wait for the update.
    Drain,
    /// A slot is refilled without waiting for its previous to-host copy.
    Refill,
}

/// The two device staging slots and the events that order their reuse.
pub struct Staging {
    slots: [Tensor; 2],
    /// Per slot: the to-host copy of its last contents; a refill waits for it.
    drained: [Option<Event>; 2],
    /// The last to-host copy issued: the host state is complete once it has completed.
    last: Option<Event>,
    skip: Option<SkipWait>,
}

impl Staging {
    /// Two device slots of `elems` elements each (the largest single parameter's state).
    pub fn new(be: &dyn Backend, elems: usize) -> Self {
        Staging {
            slots: [
                be.zeros(&[elems], Category::Buffers),
                be.zeros(&[elems], Category::Buffers),
            ],
            drained: [None, None],
            last: None,
            skip: None,
        }
    }

    /// Device bytes of the two slots.
    pub fn bytes(&self) -> usize {
        self.slots.iter().map(|s| s.bytes()).sum()
    }

    #[doc(hidden)]
    pub fn skip_wait(&mut self, w: SkipWait) {
        self.skip = Some(w);
    }

    /// For each item `k` in order: bring `states[k]` (host tensors, concatenated) into a slot,
    /// call `update(k, slot)` on the compute stream with the slot's first elements holding them,
    /// and copy the slot back into `states[k]`.
    pub fn stream(
        &mut self,
        be: &dyn Backend,
        states: &mut [Vec<&mut Tensor>],
        mut update: impl FnMut(usize, ViewMut),
    ) {
        let mut ready: [Option<Event>; 2] = [None, None];
        for k in 0..states.len() {
            let s = k % 2;
            if k == 0 {
                ready[s] = Some(self.fill(be, s, &states[0]));
            }
            // Prefetch the next state while this one is updated.
            if k + 1 < states.len() {
                ready[1 - s] = Some(self.fill(be, 1 - s, &states[k + 1]));
            }
            let filled = ready[s].take().expect("slot filled");
            if self.skip != Some(SkipWait::Fill) {
                be.wait_event(Stream::Compute, &filled);
            }
            let len: usize = states[k].iter().map(|t| t.len()).sum();
            update(k, self.slots[s].slice_mut(0, len));
            let updated = be.record_event(Stream::Compute);
            if self.skip != Some(SkipWait::Drain) {
                be.wait_event(Stream::ToHost, &updated);
            }
            let mut off = 0;
            for t in states[k].iter_mut() {
                let n = t.len();
                be.copy_async(t.view_mut(), self.slots[s].slice(off, n), Stream::ToHost);
                off += n;
            }
            let drained = be.record_event(Stream::ToHost);
            self.drained[s] = Some(drained.clone());
            self.last = Some(drained);
        }
    }

    /// Issue the from-host copy of `states` into slot `s` after the slot's previous to-host
    /// copy; returns the event the update waits on. That wait also covers the host state
    /// itself: the state of item `k` was last written by the previous step's drain of item
    /// `k`, and the to-host stream is in order, so the slot's latest drain (of item `k - 2`
    /// this step, or one of the previous step's last two items) comes after it.
    fn fill(&mut self, be: &dyn Backend, s: usize, states: &[&mut Tensor]) -> Event {
        if let Some(e) = &self.drained[s] {
            if self.skip != Some(SkipWait::Refill) {
                be.wait_event(Stream::FromHost, e);
            }
        }
        let mut off = 0;
        for t in states {
            let n = t.len();
            be.copy_async(self.slots[s].slice_mut(off, n), t.view(), Stream::FromHost);
            off += n;
        }
        be.record_event(Stream::FromHost)
    }

    /// Block the host until the state written back by the last step is complete, so CPU code
    /// (checkpoints) may read or overwrite the host tensors.
    pub fn synchronize(&self, be: &dyn Backend) {
        if let Some(e) = &self.last {
            be.synchronize_event(e);
        }
    }
}

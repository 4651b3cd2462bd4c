//! Small host-to-device writes without a host wait: the bytes go into a pinned slot, the slot is
//! copied on the compute stream, and the call returns. A write from pageable memory would either
//! make the host wait for the stream (the old `write_raw` synchronised after every copy) or let
//! the driver do so while it stages; a step writes its ids, targets and id grouping, one
//! aux-loss constant per MoE layer in backward and the grouped GEMMs' pointer arrays, and each
//! wait drained the GPU's queue of launched work.
//!
//! Slots are used in turn; a slot is rewritten only once its previous copy has completed (an
//! event), so the host never races the copy engine, and the host may be [`SLOTS`] writes ahead
//! of the GPU before it waits. Every slot grows to the size of the largest write so far (a
//! slot smaller than that is replaced when it is next used), so after the first steps the ring
//! is `SLOTS` slots of `ganymede_core::staging::staging_slot_bytes` of the step's largest write, as
//! the planner counts it, and allocates nothing. Writes above [`MAX_BYTES`] keep the blocking
//! path; only u32 and f64 writes are staged (see `write_raw_staged`).

use super::memory::Place;
use super::{ok, CudaBackend};
use cudarc::driver::CudaEvent;
use ganymede_core::staging::{staging_slot_bytes, STAGING_MAX_BYTES as MAX_BYTES, STAGING_SLOTS};
use ganymede_core::{Category, DType, Memory, Stream, Tensor};

/// Pinned slots in the ring.
pub(super) const SLOTS: usize = STAGING_SLOTS;

#[derive(Default)]
pub struct Staging {
    slots: Vec<Slot>,
    next: usize,
    /// Every slot's size from its next use on: that of the largest write so far.
    bytes: usize,
}

struct Slot {
    /// Pinned host memory, u32 words (none only while it is being replaced).
    host: Option<Tensor>,
    bytes: usize,
    copied: Option<CudaEvent>,
}

impl CudaBackend {
    /// Copy `src` into device memory at `dst` on the compute stream, ordered like a kernel
    /// writing it there; `src` may be reused as soon as this returns. `false` (nothing done)
    /// where the write is not staged: `dst` is not device memory or `src` is larger than
    /// [`MAX_BYTES`].
    pub(super) fn stage(&self, dst: &Place, src: &[u8]) -> bool {
        if !dst.on_device || src.len() > MAX_BYTES {
            return false;
        }
        assert_eq!(dst.bytes, src.len(), "staged write of a different length");
        if src.is_empty() {
            return true;
        }
        if self.streams.capturing() {
            self.stage_in_capture(dst.addr, src);
            return true;
        }
        let mut ring = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let i = ring.next;
        ring.next = (i + 1) % SLOTS;
        if let Some(ev) = ring.slots.get_mut(i).and_then(|s| s.copied.take()) {
            // The slot's last copy must be done before its memory is rewritten or freed.
            ok(ev.synchronize(), "staged write");
        }
        ring.bytes = ring.bytes.max(staging_slot_bytes(src.len()));
        if ring.slots.get(i).is_none_or(|s| s.bytes < ring.bytes) {
            if let Some(old) = ring.slots.get_mut(i) {
                // Freed first, so the ledger's peak holds the slots the planner counts.
                old.host = None;
            }
            let bytes = ring.bytes;
            let slot = Slot {
                host: Some(self.pinned_zeros_of(&[bytes / 4], DType::U32, Category::Buffers)),
                bytes,
                copied: None,
            };
            if i < ring.slots.len() {
                ring.slots[i] = slot;
            } else {
                ring.slots.push(slot);
            }
        }
        let slot = &mut ring.slots[i];
        let host = super::memory::place(&slot.host.as_ref().expect("staging slot").view());
        // SAFETY: the slot holds `slot.bytes ≥ src.len()` bytes and no copy reads it now (its
        // last one completed above).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), host.addr as *mut u8, src.len());
        }
        self.memcpy(
            &in_bytes(dst, src.len()),
            &in_bytes(&host, src.len()),
            Stream::Compute,
        );
        slot.copied = Some(ok(self.compute().record_event(None), "staged write"));
        true
    }
}

impl CudaBackend {
    /// A staged write inside a graph's capture: from pinned memory of its own, which the graph
    /// keeps and copies from at every replay, so the bytes are the ones written now (a write
    /// that changes from step to step belongs before the graph). No ring slot: a replay must
    /// not read a slot rewritten since.
    /// `dst` is a device address with room for `src`.
    pub(super) fn stage_in_capture(&self, dst: u64, src: &[u8]) {
        let words = src.len().div_ceil(4);
        let host = self.pinned_zeros_of(&[words], DType::U32, Category::Buffers);
        let at = super::memory::place(&host.view());
        // SAFETY: `host` holds at least `src.len()` bytes, and nothing reads it yet.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), at.addr as *mut u8, src.len()) };
        let dst = Place {
            addr: dst,
            bytes: src.len(),
            dtype: DType::F32,
            len: src.len(),
            uses: None,
            on_device: true,
        };
        self.memcpy(&dst, &in_bytes(&at, src.len()), Stream::Compute);
        self.streams.hold(host);
    }
}

/// `p`'s first `n` bytes, counted in bytes: the dtype only has to agree between the two sides.
fn in_bytes<'a>(p: &Place<'a>, n: usize) -> Place<'a> {
    Place {
        addr: p.addr,
        bytes: n,
        dtype: DType::F32,
        len: n,
        uses: p.uses,
        on_device: p.on_device,
    }
}

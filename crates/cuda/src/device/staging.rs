//! Small host-to-device writes without a host wait: the bytes go into a pinned slot, the slot is
//! copied on the compute stream, and the call returns. A write from pageable memory would either
//! make the host wait for the stream (the old `write_raw` synchronised after every copy) or let
//! the driver do so while it stages; a step writes its ids, targets and id grouping, one
//! aux-loss constant per MoE layer in backward and the grouped GEMMs' pointer arrays, and each
//! wait drained the GPU's queue of launched work.
//!
//! Slots are used in turn; a slot is rewritten only once its previous copy has completed (an
//! event), so the host never races the copy engine, and the host may be [`SLOTS`] writes ahead
//! of the GPU before it waits. Slots grow to the largest write they have taken and are then
//! reused: after the first step, staging allocates nothing. Writes above [`MAX_BYTES`]
//! (checkpoint loads, whole tensors) keep the blocking path: they are not per step.

use super::memory::Place;
use super::{ok, CudaBackend};
use cudarc::driver::CudaEvent;
use ganymede_core::{Category, DType, Memory, Stream, Tensor};

/// Pinned slots in the ring.
pub(super) const SLOTS: usize = 32;
/// The largest write that is staged.
pub(super) const MAX_BYTES: usize = 1 << 20;
/// The smallest slot (bytes).
const MIN_SLOT: usize = 4096;

#[derive(Default)]
pub struct Staging {
    slots: Vec<Slot>,
    next: usize,
}

struct Slot {
    /// Pinned host memory, u32 words.
    host: Tensor,
    bytes: usize,
    copied: Option<CudaEvent>,
}

/// The slot size a write of `bytes` grows a slot to.
pub(super) fn slot_bytes(bytes: usize) -> usize {
    bytes.next_power_of_two().max(MIN_SLOT)
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
        let mut ring = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let i = ring.next;
        ring.next = (i + 1) % SLOTS;
        if let Some(ev) = ring.slots.get_mut(i).and_then(|s| s.copied.take()) {
            // The slot's last copy must be done before its memory is rewritten or freed.
            ok(ev.synchronize(), "staged write");
        }
        if ring.slots.get(i).is_none_or(|s| s.bytes < src.len()) {
            let bytes = slot_bytes(src.len());
            let slot = Slot {
                host: self.pinned_zeros_of(&[bytes / 4], DType::U32, Category::Buffers),
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
        let host = super::memory::place(&slot.host.view());
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

//! The size of a GPU backend's staging ring: pinned slots through which the step's small u32
//! and f64 writes reach the device without a host wait. The one rule the CUDA backend and the
//! planner share: every slot grows to [`staging_slot_bytes`] of the largest write staged so far
//! (writes above [`STAGING_MAX_BYTES`] are not staged). It sits in the seam's crate because the
//! backend may depend on nothing above it.

/// Pinned slots in the ring.
pub const STAGING_SLOTS: usize = 32;
/// The largest write that is staged.
pub const STAGING_MAX_BYTES: usize = 1 << 20;
/// A staging slot's bytes once the largest write staged was `bytes`.
pub fn staging_slot_bytes(bytes: usize) -> usize {
    bytes.next_power_of_two().max(4096)
}

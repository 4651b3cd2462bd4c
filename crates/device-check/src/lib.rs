//! The CUDA backend checked from above the seam, where the model and the optimizers are: a
//! crate of its own so that the backend crate (`ganymede-cuda`) depends on the seam alone.
//!
//! - [`model`]: the `tiny` model's gradients on the kernels against the CPU backend, tensor by
//!   tensor; CI runs it on the kernels' host build, the device check on the GPU.
//! - [`reads`]: whole training steps read nothing back before their update, likewise.
//! - [`graphs`]: training steps replayed as CUDA graphs give the bits of eager ones, likewise.
//! - With the `cuda` feature, [`check`]: the prepared self-check behind `ganymede device-check`
//!   (memory, copies, GEMMs, kernels, timings, the model's gradients, the NCCL group), written
//!   to a report.

#[cfg(feature = "cuda")]
pub mod check;
pub mod graphs;
pub mod model;
pub mod reads;

#[cfg(feature = "cuda")]
pub use check::{run, Summary};

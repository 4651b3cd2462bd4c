//! The CUDA backend of the seam (`ganymede_core::Backend`).
//!
//! - `kernels/*.cu`: the model's and optimizers' kernels as CUDA C, one source of truth. NVRTC
//!   compiles them at run time for the device's architecture; CI compiles them for sm_90.
//! - The same source also builds for the host through a shim (`threadIdx`/`blockIdx` per
//!   thread, `__syncthreads` as a barrier), so each kernel's logic is checked against the CPU
//!   backend in CI, where there is no GPU.
//! - With the `cuda` feature: the device through cudarc ([`device::CudaBackend`]: context,
//!   streams, events, pinned memory, cuBLAS, NVRTC), probed before use ([`device::probe()`]) so a
//!   machine without a driver gets one clear error. The prepared self-check behind
//!   `ganymede device-check` is the `ganymede-device-check` crate's, and the NCCL group is
//!   `ganymede_dist::nccl`'s: this crate depends on the seam (`ganymede-core`) and cudarc only.
//! - [`kernel`]: kernels by number, their names resolved at compile time; a launcher keeps each
//!   kernel's handle once resolved, so a launch formats, looks up and allocates nothing.
//! - [`cublas_map`]: the seam's row-major GEMMs as column-major cuBLAS calls, a pure function
//!   tested in CI against the CPU backend.

pub mod bounds;
pub mod cublas_map;
#[cfg(feature = "cuda")]
pub mod device;
pub mod host;
pub mod kernel;
pub mod kernel_backend;
pub mod launch;
pub mod ops;
pub mod sources;

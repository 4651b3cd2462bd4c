//! The CUDA backend of the seam (`ganymede_core::Backend`).
//!
//! - `kernels/*.cu`: the model's and optimizers' kernels as CUDA C, one source of truth. NVRTC
//!   compiles them at run time for the device's architecture; CI compiles them for sm_90.
//! - The same source also builds for the host through a shim (`threadIdx`/`blockIdx` per
//!   thread, `__syncthreads` as a barrier), so each kernel's logic is checked against the CPU
//!   backend in CI, where there is no GPU.
//! - With the `cuda` feature: the device through cudarc (context, streams, events, pinned
//!   memory, cuBLAS), probed before use so a machine without a driver gets one clear error.

pub mod cublas_map;
#[cfg(feature = "cuda")]
pub mod device;
pub mod host;
pub mod kernel_backend;
pub mod launch;
pub mod ops;
pub mod sources;

//! The backend seam of ganymede.
//!
//! Everything above this crate (model, optimizer, trainer, parallelism) holds [`Tensor`]s and calls
//! [`Backend`] operations on views of them; it never touches raw memory. A backend owns the
//! kernels and the memory, and every allocation is charged to the [`Ledger`] by [`Category`] and
//! [`Device`], so measured memory can be held against the planner.
//!
//! # Backends
//! - [`CpuBackend::new`] (f32) and [`CpuBackend::new_f64`]: host memory; streams and events
//!   complete at once.
//! - [`CpuBackend::two_memory`]: an emulated device (`Device::Gpu(0)`, with a capacity) beside
//!   pinned host memory, copies between them on one thread per copy stream, and an optional
//!   checking mode that panics at an access not ordered after the copy it depends on (see
//!   [`cpu::two_memory`]). Offload and prefetch code is tested on it without a GPU.
//! - A CUDA backend lives in its own crate: its memory is a [`DeviceBuffer`] in
//!   [`Buffer::Device`], its views [`DeviceView`]/[`DeviceViewMut`] (buffer, offset, length),
//!   and its kernels downcast [`DeviceBuffer::as_any`] to its own type.
//!
//! # How CUDA maps onto [`Memory`]
//! | seam | CUDA (cudarc) |
//! |---|---|
//! | [`Stream`] `Compute`, `ToHost`, `FromHost`, `Comm` | one `cudaStream_t` each (`ctx.new_stream()`); NCCL runs on `Comm` |
//! | [`Memory::record_event`] | `cudaEventRecord` on the stream (`stream.record_event`) |
//! | [`Memory::wait_event`] | `cudaStreamWaitEvent` (`stream.wait(&event)`); the host does not block |
//! | [`Memory::synchronize_event`] / [`Memory::query_event`] | `cudaEventSynchronize` / `cudaEventQuery` |
//! | [`Memory::elapsed`] | `cudaEventElapsedTime` (events made with timing enabled) |
//! | [`Memory::pinned_zeros`] | `cudaMallocHost` (`alloc_pinned_with_flags(n, 0)`, not write-combined: the CPU reads it) |
//! | [`Memory::copy_async`] | `cudaMemcpyAsync` on the stream (D2H, H2D or D2D by the views' memories) |
//! | [`Memory::try_zeros`] | `cudaMallocAsync`/caching allocator; `cudaErrorMemoryAllocation` becomes [`MemoryError::OutOfMemory`] |
//! | kernels, `upload`/`download`/`copy`/`fill` | launched on `Compute`; `upload`/`download` block the host |
//!
//! The rule that makes code right on a GPU, which the CPU two-memory mode checks: a copy's
//! destination is used (by a kernel, a download, CPU code on pinned memory, or another copy)
//! only after an event recorded on the copy's stream after the copy has been waited on by the
//! stream that uses it (the host: synchronized); a copy's source is not overwritten or freed
//! until then. A CUDA backend must also keep freed memory from being reused while a copy on
//! another stream may still touch it (stream-ordered free, as PyTorch's `recordStream`).
//!
//! bf16 ([`DType::BF16`]) is stored on the host as `u16` bits; [`bf16`] converts with
//! round-to-nearest-even, bit for bit as CUDA's `__float2bfloat16_rn`.
//!
//! [`sample`] holds the seeded inputs that tests, benchmarks and device checks share, and the
//! median their timings use.

pub mod backend;
pub mod bf16;
pub mod counting;
pub mod cpu;
pub mod graph_check;
pub mod hash;
pub mod ledger;
pub mod params;
pub mod phase;
pub mod sample;
pub mod staging;
pub mod stream;
pub mod tensor;

pub use backend::{
    embedding_segments, extent, graph_keys, in_phase, step_scale_value, AdamWStep, AdamWTensor,
    AttnDims, AttnGrads, AttnSaved, AuxGrad, Backend, Blas, CastSlot, DecayStep, DeviceRate,
    DispatchOut, Dispatched, EmbedIds, ExpertGemm, ExpertRows, Gemm, GradScale, GraphRun, HeadRope,
    Memory, NnOps, NormSaved, OptimOps, Routed, RouterDims, RouterOut, Syrk,
};
pub use cpu::{CpuBackend, TwoMemoryOptions};
pub use hash::fnv1a64;
pub use ledger::{Category, Device, Ledger, LedgerReport};
pub use params::{ParamKind, ParamSpec, ParamStore};
pub use phase::{PhaseTimes, StepPhase};
pub use stream::{CopySpan, Event, MemoryError, Stream};
pub use tensor::{
    Buffer, DType, DeviceBuffer, DeviceView, DeviceViewMut, Scalar, Tensor, View, ViewMut,
};

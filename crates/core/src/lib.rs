//! The backend seam of ganymede.
//!
//! Everything above this crate (model, optimizer, trainer, parallelism) holds [`Tensor`]s and calls
//! [`Backend`] operations on views of them; it never touches raw memory. A backend owns the
//! kernels (the CPU one now; a CUDA one through cudarc later, adding a [`Buffer`] variant and an
//! implementation of the same traits), and every allocation is charged to the [`Ledger`] by
//! [`Category`] and [`Device`], so measured memory can be held against the planner.

pub mod backend;
pub mod cpu;
pub mod ledger;
pub mod params;
pub mod tensor;

pub use backend::{AdamWStep, Backend, Blas, Gemm, Memory, NnOps, OptimOps};
pub use cpu::CpuBackend;
pub use ledger::{Category, Device, Ledger, LedgerReport};
pub use params::{ParamKind, ParamSpec, ParamStore};
pub use tensor::{Buffer, DType, Scalar, TMut, Tensor, T};

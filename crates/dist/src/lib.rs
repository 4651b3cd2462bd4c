//! Communication for sharded training (issue 4): process groups behind one interface
//! ([`ProcessGroup`]) with a threads backend ([`threads`]) and an MPI backend (feature `mpi`),
//! the (dp_shard × ep) [`DeviceMesh`], byte accounting per [`Phase`] ([`CommStats`]), per-rank
//! Chrome traces ([`trace`]), fault handling (timeouts, poisoning, the config-hash check), the
//! Muon [`placement`] plan's format with its optimizer byte formulas and the exchange that
//! carries a plan out ([`muon_comm`]; the FlexShard policy that makes plans is a layout
//! decision, `ganymede_parallel::flexshard`), and the [`rendezvous`] that launchers without MPI
//! need (torchrun-style or Slurm variables, a TCP store on rank 0).
//!
//! A backend implements [`Transport`], the moving of data alone; the checked layer ([`checks`])
//! makes every transport a [`ProcessGroup`], validating each collective's arguments and counting
//! its bytes in one place for all backends.
//!
//! With the `nccl` feature, [`nccl`]: the NCCL group, one process per GPU. It is the one part of
//! this crate that depends on a backend, `ganymede-cuda`: NCCL reads and writes the CUDA
//! backend's memory in place and orders its collectives against that backend's streams, so it
//! needs the backend's device types, and the group lives here, beside the other process groups
//! and their shared checks ([`checks`]), rather than in the backend crate, which then depends on
//! the seam alone. [`nccl_lib`] (finding NCCL's library) needs no feature.

pub mod checks;
pub mod conformance;
pub mod error;
pub mod group;
pub mod hash;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod muon_comm;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod nccl_lib;
pub mod placement;
pub mod rendezvous;
pub mod stats;
pub mod threads;
pub mod trace;
pub mod watchdog;

pub use error::{CommError, Result};
pub use group::{wait_all, Call, Membership, Pending, ProcessGroup, RankCtx, Transport, Work};
pub use hash::{check_config_hash, config_hash, fnv1a64};
pub use mesh::{DeviceMesh, MeshError, MeshShape};
pub use muon_comm::{muon_exchange, root_buffers, NsJob};
pub use placement::{optimizer_bytes, Placement, Plan, Policy};
pub use stats::{CommSnapshot, CommStats, Op, Phase};
pub use threads::{run_threads, threads_world, ThreadGroup, ThreadsConfig};
pub use trace::{write_chrome_trace, Tracer, Track};
pub use watchdog::{deadline, watch, DeadlineGuard, Poll, Watch, Watched};

#[cfg(test)]
mod tests;

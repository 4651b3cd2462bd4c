//! Sharded training, applied around the unchanged model (TorchTitan's `parallelize` shape): the
//! model crate's step takes a [`ganymede_model::ParamSource`] and a
//! [`ganymede_model::GradSink`], and this crate supplies FSDP ones.
//!
//! - [`layout`]: units (one per block, plus the root unit) and shard ranges.
//! - [`fsdp`]: per-block all-gathers (bf16 or f32) into a fixed pool with prefetch, gradient
//!   reduce-scatters in f32.
//! - [`optim`]: Muon and AdamW on shards; Muon's Newton–Schulz placed by FlexShard or the naive
//!   baseline through [`ganymede_dist::muon_exchange`].
//! - [`driver`]: one rank's training state and step, and `train_threads` (`ganymede train
//!   --ranks N`).
//!
//! - [`checkpoint`]: checkpoints gathered to rank 0 in the single-process format, or per-rank
//!   shard files with a layout manifest (`parallelism.sharded_checkpoints`); either resumes at
//!   any rank count and mesh shape.
//!
//! - [`ep`]: expert parallelism, tokens to their experts' ranks with uneven all-to-alls.
//!
//! Ranks are threads (`ganymede train --ranks N`, [`train_threads`]) or MPI processes
//! (`mpirun -n N ganymede train`, `driver::train_mpi`, feature `mpi`;
//! `scripts/mpi_train_test.sh` checks it against one process).

pub mod checkpoint;
pub mod driver;
pub mod ep;
pub mod fsdp;
pub mod layout;
pub mod optim;

pub use driver::{train_threads, ParOptions, ParSummary, RankState};

//! Parallelism applied around the unchanged model (TorchTitan's `parallelize` shape): the model
//! crate's step takes a [`ganymede_model::ParamSource`], a [`ganymede_model::GradSink`] and a
//! [`ganymede_model::ExpertExecutor`], and this crate supplies them for a mesh.
//!
//! - [`driver`]: one rank's state and its training step at any world size ([`RankState`]):
//!   whole parameters at world size 1, FSDP shards beyond. The training loop that drives it for
//!   one process, threads and MPI is `ganymede_train::trainer`.
//! - [`compute_copy`]: the bf16 weights the model reads at world size 1 under bf16 compute
//!   (FSDP's gathers hand them over on more ranks).
//! - [`layout`]: units (one per block, plus the root unit) and shard ranges.
//! - [`fsdp`]: per-block all-gathers (bf16 or f32) into a fixed pool with prefetch, gradient
//!   reduce-scatters in f32.
//! - [`flexshard`]: the placement policy (FlexShard or the naive baseline): who stores what,
//!   who runs each matrix's Newton–Schulz.
//! - [`optim`]: Muon and AdamW on shards; Muon's Newton–Schulz where the plan puts it, through
//!   [`ganymede_dist::muon_exchange`].
//! - [`ep`]: expert parallelism, tokens to their experts' ranks with uneven all-to-alls.
//! - [`checkpoint`]: a rank's state saved gathered (rank 0 writes the single-process files) or
//!   as per-rank shards with a layout record; either loads at any rank count and mesh shape.

pub mod checkpoint;
pub mod compute_copy;
pub mod driver;
pub mod ep;
pub mod flexshard;
pub mod fsdp;
pub mod layout;
pub mod optim;

pub use driver::{RankState, Shards, StepReport};
pub use flexshard::policy;

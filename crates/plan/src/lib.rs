//! The planner: predicts, before a job is queued, whether a layout fits and how fast it runs.
//!
//! Pure arithmetic over a [`ganymede_config::JobConfig`] and a [`Cluster`]:
//! - [`params`]: parameter counts tensor by tensor (Qwen3-MoE), by group, Muon's share;
//! - [`plan()`]: FLOPs, memory per GPU and per host by category, communication per step by
//!   collective and link, step time with overlap, tokens/s, MFU and a fit verdict;
//! - [`sweep()`]: layouts that fit, ranked by predicted tokens/s;
//! - [`render`]: the human-readable table; the [`Plan`] itself serialises to JSON;
//! - [`ledger`]: the bytes per category a single-process CPU run's memory ledger should report;
//! - [`hsdp`]: the cross-replica gradient all-reduce of HSDP (`dp_replicate` > 1);
//! - [`fit`]: those bytes placed on the two memories of the CPU backend's two-memory mode, and
//!   the fit check against `device.memory_gib` that `ganymede train` runs before launch;
//! - [`cli`]: `ganymede plan`'s arguments ([`PlanArgs`]) and [`run`].
//!
//! Besides the configuration, the planner reads one rule from `ganymede_core`: the size of the
//! CUDA backend's staging ring (`ganymede_core::staging`), kept in the seam's crate because the
//! backend that follows it may depend on nothing above the seam.

pub mod cli;
pub mod cluster;
pub mod cpu_time;
mod evaluate;
pub mod fit;
pub mod hsdp;
pub mod ledger;
pub mod params;
mod plan;
pub mod render;
mod sweep;

pub use cli::{run, run_cli, PlanArgs};
pub use cluster::{Cluster, ClusterError, CpuSpec, GpuMeasured, InputSource, SourceKind, CLUSTERS};
pub use fit::{fit_check, predict_memory, FitCheck, MemoryPrediction};
pub use ledger::{predict_cpu_ledger, CpuLedger};
pub use params::{count as count_params, ParamCounts};
pub use plan::{
    check, ns_flops, plan, Communication, Flops, Layout, Memory, MemoryCategories, MemoryPolicy,
    NsOn, OptimizerReport, OptimizerSetup, Placement, Plan, PlanError, StepTime,
};
pub use sweep::{sweep, SweepEntry, SweepSpace};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_measured;

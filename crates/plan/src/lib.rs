//! The planner: predicts, before a job is queued, whether a layout fits and how fast it runs.
//!
//! Pure arithmetic over a [`ganymede_config::JobConfig`] and a [`Cluster`]:
//! - [`params`]: parameter counts tensor by tensor (Qwen3-MoE), by group, Muon's share;
//! - [`plan()`]: FLOPs, memory per GPU and per host by category, communication per step by
//!   collective and link, step time with overlap, tokens/s, MFU and a fit verdict;
//! - [`sweep()`]: layouts that fit, ranked by predicted tokens/s;
//! - [`render`]: the human-readable table; the [`Plan`] itself serialises to JSON;
//! - [`ledger`]: the bytes per category a single-process CPU run's memory ledger should report;
//! - [`cli`]: `ganymede plan`'s arguments ([`PlanArgs`]) and [`run`].

pub mod cli;
pub mod cluster;
pub mod ledger;
pub mod params;
mod plan;
pub mod render;
mod sweep;

pub use cli::{run, run_cli, PlanArgs};
pub use cluster::{Cluster, ClusterError, CLUSTERS};
pub use ledger::{predict_cpu_ledger, CpuLedger};
pub use params::{count as count_params, ParamCounts};
pub use plan::{
    check, ns_flops, plan, Communication, Flops, Layout, Memory, MemoryCategories, MemoryPolicy,
    NsOn, OptimizerReport, OptimizerSetup, Placement, Plan, PlanError, StepTime,
};
pub use sweep::{sweep, SweepEntry, SweepSpace};

#[cfg(test)]
mod tests;

//! HSDP's term of the plan: the cross-replica all-reduce of the gradient shards.
//!
//! With `dp_replicate` R > 1 the cluster holds R replicas of one `dp_shard`-way FSDP group,
//! replicate outermost (a replica's ranks are consecutive, so whole nodes when `dp_shard` ≥ the
//! node size). Memory per GPU is FSDP's over `dp_shard` (the all-reduce works in place on the
//! gradient shards), and after backward each GPU all-reduces its f32 gradient shards with the
//! R − 1 GPUs holding the same shards. Kept apart from the rest of the step-time model so the
//! two can change independently.

use crate::plan::group_traffic;
use serde::Serialize;

/// The all-reduce's bytes and time per GPU and step.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HsdpAllReduce {
    /// Bytes one GPU sends (= receives): a ring all-reduce, 2·(R−1)/R of its gradient shards,
    /// once per step (after the last microbatch's reduce-scatter).
    pub bytes: f64,
    pub ib_bytes: f64,
    pub nvlink_bytes: f64,
    /// On its links, plus collective latency when it leaves the node; not overlapped with
    /// compute (ganymede's trainer posts it after the last reduce-scatter).
    pub time_s: f64,
}

/// The all-reduce of `shard_bytes` gradient bytes per GPU over `replicas` replicas of
/// `dp_shard` ranks on nodes of `gpus_per_node`; `link_time(ib, nvlink)` times one collective.
pub(crate) fn all_reduce(
    shard_bytes: f64,
    replicas: usize,
    dp_shard: usize,
    gpus_per_node: usize,
    link_time: impl Fn(f64, f64) -> f64,
) -> HsdpAllReduce {
    if replicas <= 1 {
        return HsdpAllReduce::default();
    }
    // Members of one replicate group on the same node: they are dp_shard ranks apart.
    let per_node = (gpus_per_node / dp_shard.max(1)).clamp(1, replicas);
    // Reduce-scatter then all-gather, each moving what `group_traffic` says.
    let (ib, nv) = group_traffic(shard_bytes, replicas, per_node);
    HsdpAllReduce {
        bytes: 2.0 * (ib + nv),
        ib_bytes: 2.0 * ib,
        nvlink_bytes: 2.0 * nv,
        time_s: 2.0 * link_time(ib, nv),
    }
}

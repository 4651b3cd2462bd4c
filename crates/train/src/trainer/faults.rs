//! Fault injection for tests ([`TrainOptions::fail_at`], [`TrainOptions::stall_at`]): how the
//! launch paths are shown to report a failed or stuck rank instead of hanging.

use super::TrainOptions;
use ganymede_config::JobConfig;
use std::time::Duration;

/// Before 0-based `step` on `rank`: panic if `fail_at` names them, or stall if `stall_at`
/// does, sleeping well past the collective timeout so the other ranks must give up on it.
pub(super) fn inject(opts: &TrainOptions, cfg: &JobConfig, rank: usize, step: usize) {
    if opts.fail_at == Some((rank, step)) {
        panic!("injected failure on rank {rank} at step {}", step + 1);
    }
    if opts.stall_at == Some((rank, step)) {
        std::thread::sleep(Duration::from_secs_f64(cfg.parallelism.timeout_s * 20.0));
    }
}

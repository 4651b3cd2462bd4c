//! Learning-rate schedules: linear warmup, then constant, cosine, or warmup-stable-decay.

use ganymede_config::{OptimizerConfig, Schedule};

/// The learning rate for 0-based `step` of a run of `total_steps` steps.
///
/// - Warmup: `lr·(step+1)/warmup_steps` for `step < warmup_steps` (the first step already moves).
/// - `constant`: `lr` after warmup.
/// - `cosine`: from `lr` at the end of warmup to `min_lr_ratio·lr` at the last step
///   (`total_steps − 1`), along half a cosine.
/// - `wsd`: `lr` until the last `d = round(decay_fraction·total_steps)` steps, then linearly down
///   so that the last step runs at `min_lr_ratio·lr`.
///
/// Steps past the end keep the final value.
pub fn lr_at(cfg: &OptimizerConfig, step: usize, total_steps: usize) -> f64 {
    let lr = cfg.lr;
    let min_lr = cfg.min_lr_ratio * lr;
    if step < cfg.warmup_steps {
        return lr * (step + 1) as f64 / cfg.warmup_steps as f64;
    }
    let last = total_steps.saturating_sub(1);
    match cfg.schedule {
        Schedule::Constant => lr,
        Schedule::Cosine => {
            let span = last.saturating_sub(cfg.warmup_steps);
            if span == 0 {
                return if step >= last { min_lr } else { lr };
            }
            let t = ((step - cfg.warmup_steps) as f64 / span as f64).min(1.0);
            min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
        }
        Schedule::Wsd => {
            let d = (cfg.decay_fraction * total_steps as f64).round() as usize;
            let start = total_steps.saturating_sub(d);
            if d == 0 || step < start {
                return lr;
            }
            // step = start is the first decayed step; step = last reaches min_lr.
            let t = ((step - start + 1) as f64 / d as f64).min(1.0);
            lr + (min_lr - lr) * t
        }
    }
}

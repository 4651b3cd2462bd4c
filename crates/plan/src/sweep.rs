//! `--sweep`: enumerate layouts on a fixed set of GPUs and rank those that fit.

use crate::cluster::Cluster;
use crate::plan::{plan, Layout, MemoryPolicy, OptimizerSetup, Plan};
use ganymede_config::{AcMode, JobConfig};
use serde::Serialize;

/// What to vary. Empty lists mean "the base value only".
#[derive(Clone, Debug, Default)]
pub struct SweepSpace {
    pub ep: Vec<usize>,
    pub offload_fraction: Vec<f64>,
    pub ac: Vec<AcMode>,
    pub seq_len: Vec<usize>,
    pub param_offload: Vec<bool>,
}

impl SweepSpace {
    /// The default space around a base layout: every EP degree that divides the experts and the
    /// FSDP degree and tiles nodes; offload 0, 1/4, 1/2, 3/4, 1 and the smallest that fits;
    /// full and no checkpointing; sequence ÷4, ÷2, ×1, ×2 (same sequences per step); parameter
    /// offload on and off.
    pub fn around(job: &JobConfig, base: &Layout) -> Self {
        let gpn = base.gpus_per_node;
        let ep = (1..=base.dp_shard.min(job.model.experts))
            .filter(|e| {
                job.model.experts.is_multiple_of(*e)
                    && base.dp_shard.is_multiple_of(*e)
                    && (gpn.is_multiple_of(*e) || e % gpn == 0)
            })
            .collect();
        let s = base.seq_len;
        let mut seq: Vec<usize> = [s / 4, s / 2, s, s * 2]
            .into_iter()
            .filter(|&x| x > 0)
            .collect();
        seq.dedup();
        SweepSpace {
            ep,
            offload_fraction: vec![0.0, 0.25, 0.5, 0.75, 1.0],
            ac: vec![AcMode::Full, AcMode::None],
            seq_len: seq,
            param_offload: vec![false, true],
        }
    }
}

/// One candidate that fits.
#[derive(Clone, Debug, Serialize)]
pub struct SweepEntry {
    pub ep: usize,
    pub seq_len: usize,
    pub ac: AcMode,
    pub offload_fraction: f64,
    pub param_offload: bool,
    pub tokens_per_s_per_gpu: f64,
    pub step_time_s: f64,
    pub mfu: f64,
    pub gpu_bytes: f64,
    pub host_bytes: f64,
    #[serde(skip)]
    pub plan: Plan,
}

/// Every combination in `space` that fits, fastest first. Layouts the planner rejects (EP not
/// dividing, a sequence that cannot be held) are skipped.
pub fn sweep(
    job: &JobConfig,
    cluster: &Cluster,
    base: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
    space: &SweepSpace,
) -> Vec<SweepEntry> {
    let or = |v: &Vec<usize>, d: usize| if v.is_empty() { vec![d] } else { v.clone() };
    let eps = or(&space.ep, base.ep);
    let seqs = or(&space.seq_len, base.seq_len);
    let acs = if space.ac.is_empty() {
        vec![policy.ac]
    } else {
        space.ac.clone()
    };
    let fracs = if space.offload_fraction.is_empty() {
        vec![policy.offload_fraction]
    } else {
        space.offload_fraction.clone()
    };
    let pos = if space.param_offload.is_empty() {
        vec![policy.param_offload]
    } else {
        space.param_offload.clone()
    };
    let mut out = vec![];
    for &ep in &eps {
        for &seq_len in &seqs {
            for &ac in &acs {
                for &param_offload in &pos {
                    let layout = Layout {
                        ep,
                        seq_len,
                        ..base.clone()
                    };
                    let mut fr = fracs.clone();
                    if ac == AcMode::None {
                        fr = vec![0.0]; // nothing to offload without boundaries
                    } else {
                        // Add the smallest fraction that fits.
                        let probe = MemoryPolicy {
                            ac,
                            param_offload,
                            offload_fraction: 0.0,
                            ..policy.clone()
                        };
                        if let Ok(p) = plan(job, cluster, &layout, &probe, opt) {
                            if let Some(f) = p.memory.min_offload_fraction {
                                if !fr.iter().any(|x| (x - f).abs() < 1e-9) {
                                    fr.push(f);
                                }
                            }
                        }
                    }
                    for &offload_fraction in &fr {
                        let pol = MemoryPolicy {
                            ac,
                            param_offload,
                            offload_fraction,
                            ..policy.clone()
                        };
                        let Ok(p) = plan(job, cluster, &layout, &pol, opt) else {
                            continue;
                        };
                        if !p.fits {
                            continue;
                        }
                        out.push(SweepEntry {
                            ep,
                            seq_len,
                            ac,
                            offload_fraction,
                            param_offload,
                            tokens_per_s_per_gpu: p.tokens_per_s_per_gpu,
                            step_time_s: p.step_time_s,
                            mfu: p.mfu,
                            gpu_bytes: p.memory.gpu_total,
                            host_bytes: p.memory.host_total,
                            plan: p,
                        });
                    }
                }
            }
        }
    }
    // Fastest first; among equals, the smallest offload fraction (least host memory and copy
    // traffic).
    out.sort_by(|a, b| {
        b.tokens_per_s_per_gpu
            .total_cmp(&a.tokens_per_s_per_gpu)
            .then(a.offload_fraction.total_cmp(&b.offload_fraction))
    });
    out
}

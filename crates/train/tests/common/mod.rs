//! Helpers the training integration tests share: `tiny` configs, losses of a run, loss
//! comparisons, and the ledger's allocation count after the first step.

// Each test file uses a subset.
#![allow(dead_code)]

use ganymede_config::JobConfig;
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_parallel::RankState;
use ganymede_train::trainer::{train, TrainOptions};

/// `tiny` for `steps` steps without checkpoints, with f32 gathers (sharded runs then differ
/// from one process only by the order of floating-point sums), plus `extra` settings.
pub fn tiny(steps: usize, extra: &[&str]) -> JobConfig {
    let mut o: Vec<String> = vec![
        format!("training.steps={steps}"),
        "checkpoint.enable=false".into(),
        "parallelism.gather_dtype=f32".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let c = JobConfig::load(Some("tiny"), None, &o).unwrap();
    c.validate().unwrap();
    c
}

/// Losses of `cfg` on `ranks` thread ranks (1: one process), in run folder `prefix`/`name`.
pub fn losses(cfg: &JobConfig, ranks: usize, prefix: &str, name: &str) -> Vec<f64> {
    let opts = TrainOptions {
        ranks,
        out: Some(ganymede_train::scratch::run_dir(prefix, name)),
        quiet: true,
        ..Default::default()
    };
    train(cfg, None, &opts).unwrap().losses
}

/// Largest |a − b| / |b| over the steps.
pub fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y).abs())
        .fold(0.0, f64::max)
}

/// Ledger allocations in steps 2 and 3 (after step 1 has made every buffer), per rank.
pub fn allocs_after_first_step(cfg: &JobConfig, ranks: usize) -> Vec<u64> {
    allocs_per_step(cfg, ranks, 3)
        .into_iter()
        .map(|steps| steps[1..].iter().sum())
        .collect()
}

/// Ledger allocations of each of `steps` steps, per rank (`[rank][step]`).
pub fn allocs_per_step(cfg: &JobConfig, ranks: usize, steps: usize) -> Vec<Vec<u64>> {
    let mut cfg = cfg.clone();
    cfg.parallelism.dp_shard = ranks;
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap();
    run_threads(ranks, &ThreadsConfig::default(), |world| {
        let mut st = RankState::new(world, &cfg).unwrap();
        (0..steps)
            .map(|s| {
                st.be.ledger().mark_window();
                st.step(&data, s).unwrap();
                st.be.ledger().window_alloc_count()
            })
            .collect::<Vec<u64>>()
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// A finished run's `memory.json`, per device the planner predicted: (device, ledger category
/// or "total", measured peak bytes, planner's bytes). Panics where there is no prediction.
pub fn measured_and_planned(run_dir: &std::path::Path) -> Vec<(String, &'static str, f64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("memory.json")).unwrap();
    let mem: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = vec![];
    for (dev, d) in mem.as_object().unwrap() {
        let Some(pred) = d.get("planner_peak_bytes") else {
            continue;
        };
        for cat in ["params", "grads", "optimizer", "activations", "buffers"] {
            let measured = d["peak_bytes"][cat].as_f64().unwrap_or(0.0);
            out.push((dev.clone(), cat, measured, pred[cat].as_f64().unwrap()));
        }
        let total = |k: &str| d[k].as_f64().unwrap();
        out.push((
            dev.clone(),
            "total",
            total("peak_total_bytes"),
            total("planner_peak_total_bytes"),
        ));
    }
    assert!(!out.is_empty(), "no prediction in {text}");
    out
}

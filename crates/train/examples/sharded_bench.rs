//! The numbers of BENCHMARKS.md's "Sharded training" section, measured side by side in one run:
//! optimizer bytes per step (naive vs FlexShard) for tiny and small at 4 ranks with the
//! formulas and the planner's figures (and the planner's for europa-1t), step time of small at
//! 1, 2 and 4 ranks, and the share of gather time hidden under compute, read from the trace.
//!
//! `cargo run --release -p ganymede-train --example sharded_bench [steps]`

use ganymede_config::{preset, JobConfig};
use ganymede_data::Dataset;
use ganymede_dist::placement::optimizer_bytes;
use ganymede_dist::{run_threads, MeshShape, Phase, Policy, ThreadsConfig};
use ganymede_parallel::RankState;
use ganymede_train::trainer::{train, TrainOptions};

fn mib(b: f64) -> String {
    if b.is_nan() {
        return "n/a".into();
    }
    format!("{:.3} MiB", b / (1u64 << 20) as f64)
}

fn planner(job: &JobConfig, naive: bool) -> f64 {
    let cluster = ganymede_plan::Cluster::preset("dgx-h100").unwrap();
    let layout = ganymede_plan::Layout::from_job(job, &cluster);
    let policy = ganymede_plan::MemoryPolicy::from_job(job);
    let setup = ganymede_plan::OptimizerSetup {
        placement: if naive {
            ganymede_plan::Placement::Naive
        } else {
            ganymede_plan::Placement::Flexshard
        },
        ..ganymede_plan::OptimizerSetup::from_job(job)
    };
    let p = ganymede_plan::plan(job, &cluster, &layout, &policy, &setup).unwrap();
    if naive {
        p.communication.optimizer_naive_muon
    } else {
        p.communication.optimizer_flexshard
    }
}

/// Measured optimizer bytes sent per rank in one step.
fn measured_opt_bytes(cfg: &JobConfig, ranks: usize) -> Vec<u64> {
    let data = Dataset::build(
        &cfg.data,
        cfg.model.vocab_size,
        cfg.model.seq_len,
        cfg.training.seed,
        None,
    )
    .unwrap();
    run_threads(ranks, &ThreadsConfig::default(), |world| {
        let mut st = RankState::new(world, cfg).unwrap();
        st.step(&data, 0).unwrap().comm.phase(Phase::Optimizer).0
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// Merged length of intervals `(start, end)`.
fn union(mut v: Vec<(f64, f64)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut cur): (f64, Option<(f64, f64)>) = (0.0, None);
    for (s, e) in v {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

/// Per rank, the wall time some parameter gather was in flight (posted, not yet complete) and
/// the wall time the rank was blocked waiting for one; summed over ranks. Hidden share =
/// 1 − blocked / in flight.
fn hidden_share(trace: &std::path::Path) -> (f64, f64, f64) {
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap();
    let evs = t["traceEvents"].as_array().cloned().unwrap_or_default();
    let mut per: std::collections::BTreeMap<(i64, bool), Vec<(f64, f64)>> = Default::default();
    for e in &evs {
        let name = e["name"].as_str().unwrap_or("");
        if !name.ends_with("forward_gather") && !name.ends_with("backward_gather") {
            continue;
        }
        let (ts, dur) = (
            e["ts"].as_f64().unwrap_or(0.0),
            e["dur"].as_f64().unwrap_or(0.0),
        );
        let pid = e["pid"].as_i64().unwrap_or(0);
        match e["cat"].as_str() {
            Some("comm") => per.entry((pid, true)).or_default().push((ts, ts + dur)),
            Some("wait") => per.entry((pid, false)).or_default().push((ts, ts + dur)),
            _ => {}
        }
    }
    let (mut comm, mut wait) = (0.0, 0.0);
    for ((_, is_comm), v) in per {
        if is_comm {
            comm += union(v);
        } else {
            wait += union(v);
        }
    }
    (1.0 - wait / comm.max(1e-9), comm / 1e6, wait / 1e6)
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let ranks = 4;
    println!("## optimizer bytes per step, {ranks} ranks (f32, sent per rank, mean over ranks)");
    println!("| preset, ep | naive measured | naive planner | FlexShard measured | FlexShard planner | ratio |");
    println!("|---|---|---|---|---|---|");
    for (name, ep) in [("tiny", 1), ("small", 1), ("tiny", 2), ("small", 2)] {
        let mut row = vec![];
        let mut plan_row = vec![];
        for (naive, place) in [(true, "naive"), (false, "flexshard")] {
            let mut cfg = preset(name).unwrap();
            cfg.parallelism.dp_shard = ranks;
            cfg.parallelism.ep = ep;
            cfg.parallelism.muon_placement = if naive {
                ganymede_config::MuonPlacement::Naive
            } else {
                ganymede_config::MuonPlacement::Flexshard
            };
            let _ = place;
            let m = measured_opt_bytes(&cfg, ranks);
            let specs = ganymede_model::Model::new(&cfg.model)
                .param_specs()
                .to_vec();
            let pol = if naive {
                Policy::Naive
            } else {
                Policy::FlexShard
            };
            let p =
                ganymede_parallel::flexshard::plan(&specs, MeshShape::new(ranks, ep).unwrap(), pol)
                    .unwrap();
            let f: Vec<u64> = optimizer_bytes(&p, 4).iter().map(|x| x.0).collect();
            assert_eq!(
                m, f,
                "{name} {pol:?}: measured bytes differ from the formulas"
            );
            row.push(m.iter().sum::<u64>() as f64 / ranks as f64);
            // The planner's optimizer figure assumes every matrix gathered over all ranks.
            plan_row.push(if ep == 1 {
                planner(&cfg, naive)
            } else {
                f64::NAN
            });
        }
        println!(
            "| {name}, ep {ep} | {} | {} | {} | {} | {:.1}x |",
            mib(row[0]),
            mib(plan_row[0]),
            mib(row[1]),
            mib(plan_row[1]),
            row[0] / row[1]
        );
    }
    let e = preset("europa-1t").unwrap();
    let cluster = ganymede_plan::Cluster::preset("jupiter").unwrap();
    let layout = ganymede_plan::Layout::from_job(&e, &cluster);
    let policy = ganymede_plan::MemoryPolicy::from_job(&e);
    let setup = ganymede_plan::OptimizerSetup::from_job(&e);
    let p = ganymede_plan::plan(&e, &cluster, &layout, &policy, &setup).unwrap();
    println!(
        "europa-1t on jupiter ({} GPUs, ep {}), planner per GPU: naive {:.2} GB, FlexShard {:.3} GB",
        layout.dp_shard,
        layout.ep,
        p.communication.optimizer_naive_muon / 1e9,
        p.communication.optimizer_flexshard / 1e9
    );

    println!("\n## small: step time by rank count ({steps} steps, first excluded; bf16 gathers, prefetch 1, FlexShard)");
    println!(
        "| ranks | s/step | tokens/s | gather time hidden under compute | gathers in flight (s, summed over ranks) | blocked on gathers (s) |"
    );
    println!("|---|---|---|---|---|---|");
    let dir = std::env::temp_dir().join(format!("gm-sharded-bench-{}", std::process::id()));
    for (r, ep) in [(1, 1), (2, 1), (4, 1), (4, 2)] {
        let mut cfg = preset("small").unwrap();
        cfg.parallelism.ep = ep;
        cfg.training.steps = steps;
        cfg.checkpoint.enable = false;
        let trace = dir.join(format!("trace{r}-{ep}.json"));
        let opts = TrainOptions {
            ranks: r,
            out: Some(dir.join(format!("run{r}-{ep}"))),
            quiet: true,
            trace: Some(trace.clone()),
            ..Default::default()
        };
        let s = train(&cfg, None, &opts).unwrap();
        let (hidden, comm, wait) = hidden_share(&trace);
        let label = if ep > 1 {
            format!("{r} (ep {ep})")
        } else {
            r.to_string()
        };
        println!(
            "| {label} | {:.3} | {:.0} | {:.1}% | {comm:.2} | {wait:.2} |",
            s.step_s,
            s.tokens_per_s,
            100.0 * hidden
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

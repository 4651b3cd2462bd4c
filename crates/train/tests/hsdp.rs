//! HSDP (`parallelism.dp_replicate`): replicas of the FSDP group against one process on the
//! same global batch, identical replicas, the cross-replica bytes against the planner, and
//! checkpoints written by replica 0 and resumed by every replica.

use ganymede_config::{JobConfig, OptimizerName};
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, Phase, ThreadsConfig};
use ganymede_parallel::RankState;
use ganymede_train::trainer::{resolve_config, train, TrainOptions};
use std::path::PathBuf;

mod common;
use common::{max_rel, tiny};

fn tmp(name: &str) -> PathBuf {
    ganymede_train::scratch::run_dir("gm-hsdp", name)
}

/// Losses of `cfg` on `ranks` thread ranks (1: one process), resumed from `resume` if given.
fn run(cfg: &JobConfig, ranks: usize, name: &str, resume: Option<PathBuf>) -> Vec<f64> {
    let opts = TrainOptions {
        ranks,
        out: Some(tmp(name)),
        quiet: true,
        ..Default::default()
    };
    train(cfg, resume.as_deref(), &opts).unwrap().losses
}

/// Relative bound on HSDP's losses against one process: only the order of floating-point sums
/// differs (reduce-scatter within a replica, then the all-reduce across replicas).
const REL_BOUND: f64 = 1e-6;

#[test]
fn hsdp_losses_equal_one_process() {
    for opt in [OptimizerName::Adamw, OptimizerName::Muon] {
        let name = format!("{opt:?}").to_lowercase();
        let set = format!("optimizer.name={name}");
        let one = run(&tiny(4, &[&set]), 1, &format!("one-{name}"), None);
        // 2 replicas × dp_shard 2, and 2 replicas × (dp_shard 2 with ep 2) on 4 ranks.
        for (extra, label) in [
            (
                &["parallelism.dp_replicate=2", "parallelism.dp_shard=2"][..],
                "dp_shard 2",
            ),
            (
                &[
                    "parallelism.dp_replicate=2",
                    "parallelism.dp_shard=2",
                    "parallelism.ep=2",
                ][..],
                "dp_shard 2, ep 2",
            ),
        ] {
            let cfg = tiny(4, &[&[set.as_str()][..], extra].concat());
            let dir = format!("{}-{name}", label.replace([' ', ','], ""));
            let got = run(&cfg, 4, &dir, None);
            let d = max_rel(&got, &one);
            println!("{name}, dp_replicate 2 x {label}: max relative loss difference {d:e}");
            assert!(d <= REL_BOUND, "{name} {label}: {d:e}");
        }
    }
}

/// One rank's parameters (gathered whole within its replica) and its bytes (sent, received)
/// of one phase.
type RankResult = (Vec<Vec<f32>>, (u64, u64));

/// `steps` steps of `cfg` on `ranks` thread ranks: each rank's parameters, gathered whole within
/// its replica, and its bytes of `phase` in the last step (sent, received).
fn run_ranks(cfg: &JobConfig, ranks: usize, steps: usize, phase: Phase) -> Vec<RankResult> {
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
        let mut bytes = (0, 0);
        for s in 0..steps {
            bytes = st.step(&data, s).unwrap().comm.phase(phase);
        }
        (st.full_params().unwrap(), bytes)
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn replicas_hold_identical_parameters() {
    for opt in ["adamw", "muon"] {
        let set = format!("optimizer.name={opt}");
        let cfg = tiny(
            3,
            &[&set, "parallelism.dp_replicate=2", "parallelism.dp_shard=2"],
        );
        let res = run_ranks(&cfg, 4, 3, Phase::GradReplicaAllReduce);
        // Rank 0 and 2 gather replica 0's and replica 1's parameters whole.
        assert!(res[0].0 == res[2].0, "{opt}: replicas drifted apart");
        assert!(res[1].0 == res[3].0);
        assert!(
            res.iter().all(|r| r.1 .0 > 0),
            "{opt}: no cross-replica traffic"
        );
    }
}

#[test]
fn replica_all_reduce_bytes_equal_the_planners_figure() {
    // Each rank all-reduces its f32 gradient shards (tiny's shapes divide by 2: no padding)
    // with the other replica: the ring volume 2·(2−1)/2 of its shard bytes each way, which the
    // planner models as the replicate group's reduce-scatter plus all-gather.
    let mut job = tiny(1, &["parallelism.dp_replicate=2", "parallelism.dp_shard=2"]);
    job.parallelism.gather_dtype = ganymede_config::GatherDtype::Bf16;
    let cluster = ganymede_plan::Cluster::preset("dgx-h100").unwrap();
    let mut layout = ganymede_plan::Layout::from_job(&job, &cluster);
    assert_eq!(
        (layout.dp_replicate, layout.dp_shard, layout.gpus()),
        (2, 2, 4)
    );
    layout.micro_batch = job.training.batch_size / 4;
    let policy = ganymede_plan::MemoryPolicy::from_job(&job);
    let setup = ganymede_plan::OptimizerSetup::from_job(&job);
    let plan = ganymede_plan::plan(&job, &cluster, &layout, &policy, &setup).unwrap();
    let res = run_ranks(&job, 4, 1, Phase::GradReplicaAllReduce);
    for (r, (_, (sent, recv))) in res.iter().enumerate() {
        println!("rank {r}: {sent} bytes sent, {recv} received across replicas");
        assert_eq!(*sent as f64, plan.communication.hsdp_all_reduce, "rank {r}");
        assert_eq!(sent, recv);
    }
    // The whole model's f32 gradients over dp_shard = 2.
    let total = ganymede_plan::count_params(&job.model).total as f64;
    assert_eq!(plan.communication.hsdp_all_reduce, 4.0 * total / 2.0);
    // And within a replica the reduce-scatter is FSDP over dp_shard, not the world.
    let rs = run_ranks(&job, 4, 1, Phase::GradReduceScatter);
    assert_eq!(rs[0].1 .0 as f64, plan.communication.fsdp_reduce_scatter);
}

#[test]
fn metrics_and_trace_show_the_replica_all_reduce() {
    let cfg = tiny(1, &["parallelism.dp_replicate=2", "parallelism.dp_shard=2"]);
    let (out, trace) = (tmp("trace-run"), tmp("trace").with_extension("json"));
    let opts = TrainOptions {
        ranks: 4,
        out: Some(out.clone()),
        quiet: true,
        trace: Some(trace.clone()),
        ..Default::default()
    };
    let s = train(&cfg, None, &opts).unwrap();
    assert_eq!(s.ranks, 4);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert!(
        first["comm_bytes"]["grad_replica_all_reduce"]["sent"]
            .as_u64()
            .unwrap()
            > 0,
        "{first}"
    );
    let t = std::fs::read_to_string(&trace).unwrap();
    assert!(t.contains("all_reduce grad_replica_all_reduce"));
}

#[test]
fn hsdp_checkpoints_resume_to_the_same_losses() {
    for sharded in [false, true] {
        let cfg = tiny(
            6,
            &[
                "parallelism.dp_replicate=2",
                "parallelism.dp_shard=2",
                "checkpoint.enable=true",
                "checkpoint.interval=3",
                &format!("parallelism.sharded_checkpoints={sharded}"),
            ],
        );
        let name = if sharded { "sharded" } else { "gathered" };
        let a = tmp(&format!("ck-{name}"));
        let opts = TrainOptions {
            ranks: 4,
            out: Some(a.clone()),
            quiet: true,
            ..Default::default()
        };
        let full = train(&cfg, None, &opts).unwrap().losses;
        let ck = a
            .join("checkpoints")
            .join(ganymede_train::checkpoint::dir_name(3));
        if sharded {
            // Replica 0's two shard ranks wrote; replica 1 wrote nothing.
            assert!(ck.join("shard-rank1.safetensors").is_file());
            assert!(!ck.join("shard-rank2.safetensors").exists());
        } else {
            assert!(ck.join("model.safetensors").is_file());
        }
        let resumed = run(&cfg, 4, &format!("ck-{name}-resumed"), Some(ck.clone()));
        let d = max_rel(&resumed, &full[3..]);
        println!("{name} checkpoint, resumed under HSDP: max relative difference {d:e}");
        assert!(d <= REL_BOUND, "{name}: {d:e}");
        // The same checkpoint in one process (replicas are a layout, not part of the model).
        let one = run(&cfg, 1, &format!("ck-{name}-one"), Some(ck));
        assert!(max_rel(&one, &full[3..]) <= REL_BOUND);
    }
}

#[test]
fn a_replicas_memory_is_fsdp_over_dp_shard_as_planned() {
    // Two-memory mode: each rank's measured peaks per category against the planner's
    // prediction for 2 replicas of dp_shard 2 (shards over 2 ranks, batch over 4), within 5%
    // as the two-memory tests hold single-replica runs.
    let cfg = tiny(
        2,
        &[
            "device.kind=cpu-two-memory",
            "parallelism.dp_replicate=2",
            "parallelism.dp_shard=2",
        ],
    );
    let out = tmp("memory");
    let opts = TrainOptions {
        ranks: 4,
        out: Some(out.clone()),
        quiet: true,
        ..Default::default()
    };
    train(&cfg, None, &opts).unwrap();
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("memory.json")).unwrap()).unwrap();
    let dev = &mem["gpu0"];
    let pred = &dev["planner_peak_bytes"];
    for cat in ["params", "grads", "optimizer", "activations", "buffers"] {
        let measured = dev["peak_bytes"][cat].as_f64().unwrap_or(0.0);
        let predicted = pred[cat].as_f64().unwrap();
        println!("{cat}: measured {measured} bytes, planner {predicted}");
        assert!(
            (measured - predicted).abs() <= 0.05 * predicted.max(1.0),
            "{cat}: measured {measured} bytes, planner {predicted}"
        );
    }
    // The shards are over the replica's 2 ranks, not the world's 4: rank 0's parameter shards
    // are half the model (f32), beyond init's moment with one whole tensor.
    let total = ganymede_plan::count_params(&cfg.model).total as f64;
    assert!(dev["peak_bytes"]["params"].as_f64().unwrap() >= 4.0 * total / 2.0);
}

#[test]
fn mesh_and_config_errors_name_dp_replicate() {
    // A world that is not dp_replicate × dp_shard.
    let cfg = tiny(1, &["parallelism.dp_replicate=2", "parallelism.dp_shard=2"]);
    let errs = run_threads(2, &ThreadsConfig::default(), |world| {
        RankState::new(world, &cfg).err().map(|e| format!("{e:#}"))
    });
    let e = errs[0].as_ref().unwrap().clone().unwrap();
    assert!(
        e.contains("dp_replicate × parallelism.dp_shard = 2 × 2 = 4") && e.contains("2 ranks"),
        "{e}"
    );
    // `--ranks` must be a multiple of a dp_replicate given on the command line.
    let set = ["parallelism.dp_replicate=3".to_string()];
    let e = resolve_config(Some("tiny"), None, &set, None, None, 4)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parallelism.dp_replicate = 3") && e.contains("4 ranks"),
        "{e}"
    );
    let set = ["parallelism.dp_replicate=0".to_string()];
    let e = resolve_config(Some("tiny"), None, &set, None, None, 4)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parallelism.dp_replicate") && e.contains("at least 1"),
        "{e}"
    );
    // And it fits the mesh: 8 ranks with 2 replicas are dp_shard 4.
    let set = ["parallelism.dp_replicate=2".to_string()];
    let (c, _) = resolve_config(Some("tiny"), None, &set, None, None, 8).unwrap();
    assert_eq!((c.parallelism.dp_replicate, c.parallelism.dp_shard), (2, 4));
}

//! `ganymede train --ranks N`: sharded training from the command line.

mod util;
use util::{ganymede, ok, TempDir};

#[test]
fn train_with_ranks_logs_bytes_per_phase_writes_a_trace_and_resumes_at_another_count() {
    let d = TempDir::new("ranks");
    let run = d.path().join("run");
    let trace = d.path().join("trace.json");
    let (run_s, trace_s) = (run.display().to_string(), trace.display().to_string());
    let out = ok(ganymede(
        d.path(),
        &[
            "train",
            "--steps",
            "4",
            "--ranks",
            "2",
            "--out",
            &run_s,
            "--trace",
            &trace_s,
            "--set",
            "checkpoint.interval=2",
        ],
        &[],
    ));
    assert!(out.contains("2 ranks"), "{out}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    for phase in [
        "forward_gather",
        "backward_gather",
        "grad_reduce_scatter",
        "optimizer",
    ] {
        assert!(
            first["comm_bytes"][phase]["sent"].as_u64().unwrap() > 0,
            "{phase}: {first}"
        );
    }
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert!(t.to_string().contains("block 0 forward"));

    // Resume the 2-rank run's step-2 checkpoint on 4 ranks.
    let ck = run.join("checkpoints").join("step_00000002");
    let out = ok(ganymede(
        d.path(),
        &[
            "train",
            "--ranks",
            "4",
            "--resume",
            &ck.display().to_string(),
            "--out",
            &d.path().join("run4").display().to_string(),
        ],
        &[],
    ));
    assert!(
        out.contains("4 ranks") && out.contains("step      4/4"),
        "{out}"
    );
}

#[test]
fn expert_parallelism_from_the_command_line() {
    // --ranks sets dp_shard, so ep validates against it.
    let d = TempDir::new("ranks-ep");
    let run = d.path().join("run").display().to_string();
    let out = ok(ganymede(
        d.path(),
        &[
            "train",
            "--steps",
            "2",
            "--ranks",
            "4",
            "--set",
            "parallelism.ep=2",
            "--out",
            &run,
        ],
        &[],
    ));
    assert!(out.contains("ep 2"), "{out}");
    // Its checkpoint resumes on another mesh: 2 ranks without expert parallelism.
    let ck = d
        .path()
        .join("run")
        .join("checkpoints")
        .join("step_00000002");
    let out = ok(ganymede(
        d.path(),
        &[
            "train",
            "--steps",
            "3",
            "--ranks",
            "2",
            "--set",
            "parallelism.ep=1",
            "--resume",
            &ck.display().to_string(),
            "--out",
            &d.path().join("run2").display().to_string(),
        ],
        &[],
    ));
    assert!(
        out.contains("2 ranks") && out.contains("step      3/3"),
        "{out}"
    );
}

//! `ganymede train --ranks N`: sharded training from the command line.

mod util;
use util::{fails, ganymede, ok, TempDir};

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

/// `metrics.jsonl` lines' steps and the step `checkpoints/latest` names.
fn run_state(run: &std::path::Path) -> (Vec<u64>, String) {
    let steps = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let latest = std::fs::read_to_string(run.join("checkpoints").join("latest")).unwrap();
    (steps, latest.trim().to_string())
}

#[test]
fn a_sharded_run_refuses_a_directory_holding_another_runs_results_and_loses_nothing() {
    let d = TempDir::new("refuse");
    let run = d.path().join("R");
    let r = run.display().to_string();
    ok(ganymede(
        d.path(),
        &["train", "--preset", "tiny", "--steps", "20", "--out", &r],
        &[],
    ));
    let before = run_state(&run);
    assert_eq!(before.0, (1..=20).collect::<Vec<u64>>());
    let metrics_before = std::fs::read(run.join("metrics.jsonl")).unwrap();
    for ranks in ["2", "1"] {
        let e = fails(ganymede(
            d.path(),
            &[
                "train", "--preset", "tiny", "--steps", "5", "--ranks", ranks, "--out", &r,
            ],
            &[],
        ));
        assert!(
            e.contains("already holds checkpoints") && e.contains("--resume"),
            "{e}"
        );
    }
    assert_eq!(run_state(&run), before);
    assert_eq!(
        std::fs::read(run.join("metrics.jsonl")).unwrap(),
        metrics_before
    );
}

#[test]
fn a_sharded_resume_continues_its_own_directory_and_metrics() {
    let d = TempDir::new("continue");
    let run = d.path().join("R");
    let r = run.display().to_string();
    let args = [
        "train",
        "--steps",
        "4",
        "--ranks",
        "2",
        "--out",
        &r,
        "--stop-after",
        "2",
    ];
    let out = ok(ganymede(d.path(), &args, &[]));
    assert!(out.contains("2 ranks"), "{out}");
    assert_eq!(run_state(&run), (vec![1, 2], "step_00000002".into()));
    // No --out: the checkpoint's own run directory, metrics appended.
    let out = ok(ganymede(
        d.path(),
        &["train", "--ranks", "2", "--resume", &r],
        &[],
    ));
    assert!(out.contains("resuming at step 2"), "{out}");
    assert_eq!(run_state(&run), (vec![1, 2, 3, 4], "step_00000004".into()));
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(lines.lines().last().unwrap()).unwrap();
    for k in [
        "tokens_per_s_avg",
        "load_max_over_mean",
        "comm_bytes",
        "val_loss",
    ] {
        assert!(last.get(k).is_some(), "{k} missing: {last}");
    }
    assert!(run.join("memory.json").is_file());
}

#[test]
fn a_sharded_expert_parallel_checkpoint_works_in_every_command() {
    // Saved by 4 ranks with ep 2 as per-rank shard files.
    let d = TempDir::new("shard-cmds");
    let run = d.path().join("R");
    let r = run.display().to_string();
    let sharded = [
        "train",
        "--steps",
        "4",
        "--ranks",
        "4",
        "--set",
        "parallelism.ep=2",
        "--set",
        "parallelism.sharded_checkpoints=true",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "parallelism.gather_dtype=f32",
        "--out",
        &r,
    ];
    ok(ganymede(d.path(), &sharded, &[]));
    let ck = run.join("checkpoints").join("step_00000004");
    assert!(ck.join("shards.json").is_file());
    // The same run with gathered checkpoints: the reference for eval and export.
    let g = d.path().join("G").display().to_string();
    let mut gathered = sharded.to_vec();
    gathered[8] = "parallelism.sharded_checkpoints=false";
    *gathered.last_mut().unwrap() = &g;
    ok(ganymede(d.path(), &gathered, &[]));
    let gck = d.path().join("G").join("checkpoints").join("step_00000004");

    let eval = |c: &std::path::Path| {
        let out = ok(ganymede(
            d.path(),
            &["eval", "--checkpoint", &c.display().to_string(), "--json"],
            &[],
        ));
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(eval(&ck), eval(&gck), "sharded vs gathered checkpoint");
    for (c, o) in [(&ck, "hf-s"), (&gck, "hf-g")] {
        ok(ganymede(
            d.path(),
            &[
                "export",
                "--checkpoint",
                &c.display().to_string(),
                "--out",
                o,
            ],
            &[],
        ));
    }
    assert_eq!(
        std::fs::read(d.path().join("hf-s").join("model.safetensors")).unwrap(),
        std::fs::read(d.path().join("hf-g").join("model.safetensors")).unwrap()
    );
    ok(ganymede(
        d.path(),
        &[
            "generate",
            "--checkpoint",
            &ck.display().to_string(),
            "--prompt",
            "the",
            "--max-new-tokens",
            "5",
        ],
        &[],
    ));
    // A one-process resume of the step-2 shards: ep re-derived from one rank, no --set needed.
    let ck2 = run.join("checkpoints").join("step_00000002");
    let one = d.path().join("one").display().to_string();
    let out = ok(ganymede(
        d.path(),
        &[
            "train",
            "--resume",
            &ck2.display().to_string(),
            "--out",
            &one,
        ],
        &[],
    ));
    assert!(out.contains("resuming at step 2"), "{out}");
    let full = util::losses(&run);
    let resumed = util::losses(&d.path().join("one"));
    assert_eq!(resumed.len(), 2);
    for (a, b) in resumed.iter().zip(&full[2..]) {
        assert!((a - b).abs() <= 1e-6, "one process {a} vs 4 ranks {b}");
    }
}

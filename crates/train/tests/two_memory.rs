//! Training on the two-memory CPU mode (`device.kind = "cpu-two-memory"`): the emulated device
//! memory that GPU memory behaviour is tested on without a GPU.

mod common;

use ganymede_config::JobConfig;
use ganymede_train::trainer::{train, TrainOptions};
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    ganymede_train::scratch::run_dir("gm-two", name)
}

fn tiny(extra: &[&str]) -> JobConfig {
    let mut o: Vec<String> = vec!["training.steps=4".into(), "checkpoint.enable=false".into()];
    o.extend(extra.iter().map(|s| s.to_string()));
    let c = JobConfig::load(Some("tiny"), None, &o).unwrap();
    c.validate().unwrap();
    c
}

fn run(
    cfg: &JobConfig,
    name: &str,
    ranks: usize,
) -> anyhow::Result<ganymede_train::trainer::TrainSummary> {
    let o = TrainOptions {
        out: Some(tmp(name)),
        quiet: true,
        ranks,
        ..Default::default()
    };
    train(cfg, None, &o)
}

#[test]
fn two_memory_training_equals_one_memory_and_charges_the_device() {
    let one = run(&tiny(&[]), "one", 1).unwrap();
    let two_cfg = tiny(&[
        "device.kind=\"cpu-two-memory\"",
        "device.check_streams=true",
    ]);
    let two = run(&two_cfg, "two", 1).unwrap();
    assert_eq!(one.losses, two.losses);
    assert_eq!(one.final_val_loss, two.final_val_loss);
    // Parameters, gradients and optimizer state were charged to the emulated device.
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(two.run_dir.join("memory.json")).unwrap())
            .unwrap();
    for cat in ["params", "grads", "optimizer", "activations"] {
        assert!(
            mem["gpu0"]["peak_bytes"][cat].as_u64().unwrap_or(0) > 0,
            "{cat} not on gpu0: {mem}"
        );
    }
    // On two ranks as well (FSDP hooks allocate their pools on the device too).
    let two_ranks = run(&two_cfg, "two-ranks", 2).unwrap();
    let one_ranks = run(&tiny(&[]), "one-ranks", 2).unwrap();
    assert_eq!(one_ranks.losses, two_ranks.losses);
}

#[test]
fn an_allocation_past_the_device_capacity_ends_the_run_naming_category_and_bytes() {
    // A device exactly as large as the planner's peak for expert parallelism with buffers for
    // an even routing (factor 1): the fit check lets it run, and `tiny`'s uneven first routing
    // grows the buffers past the capacity, which the allocation itself reports.
    let mut even = tiny(&[
        "device.kind=\"cpu-two-memory\"",
        "parallelism.dp_shard=4",
        "parallelism.ep=2",
        "parallelism.ep_capacity_factor=1",
    ]);
    let peak = ganymede_plan::predict_memory(&even, rayon::current_num_threads(), 4).device_peak;
    even.device.memory_gib = peak / (1u64 << 30) as f64;
    let e = format!("{:#}", run(&even, "oom", 4).unwrap_err());
    // The growing dispatch scratch (buffers) or kept rows (activations) is what fails.
    let what = e.contains("buffers") || e.contains("activations");
    assert!(
        e.contains("out of memory") && e.contains("bytes") && what,
        "{e}"
    );
    // One rank is refused before anything is built: the fit check names the categories.
    let cfg = tiny(&[
        "device.kind=\"cpu-two-memory\"",
        "device.memory_gib=0.0009765625",
    ]);
    let dir = tmp("oom-one");
    let o = TrainOptions {
        out: Some(dir.clone()),
        quiet: true,
        ..Default::default()
    };
    let e = format!("{:#}", train(&cfg, None, &o).unwrap_err());
    assert!(
        e.contains("does not fit in device memory") && e.contains("params"),
        "{e}"
    );
    assert!(!dir.exists(), "a refused run wrote {}", dir.display());
}

/// Measured peaks per device and category (and the device totals) of a finished run against
/// the planner's prediction in its memory.json, within 5%.
fn check_prediction(run_dir: &std::path::Path, what: &str) {
    for (dev, cat, measured, predicted) in common::measured_and_planned(run_dir) {
        assert!(
            (measured - predicted).abs() <= 0.05 * predicted.max(1.0),
            "{what}: {dev} {cat}: measured {measured} bytes, planner {predicted}"
        );
    }
}

/// The planner's two-memory prediction against the ledger of real runs: checkpointing modes,
/// optimizers, FSDP settings, and activation offload (0.5 and 1, with four layers so whole
/// boundaries move) and optimizer offload at 1 and 4 ranks.
#[test]
fn the_two_memory_prediction_matches_the_measured_peaks() {
    let two = "device.kind=\"cpu-two-memory\"";
    let cases: Vec<(usize, &str, &str, Vec<&str>)> = vec![
        (1, "tiny", "full checkpointing", vec![]),
        (
            1,
            "tiny",
            "no checkpointing",
            vec!["activation_checkpoint.mode=\"none\""],
        ),
        (1, "tiny", "adamw", vec!["optimizer.name=\"adamw\""]),
        // A capacity that fits: the check lets it run and the run stays within it.
        (1, "tiny", "capacity", vec!["device.memory_gib=0.5"]),
        // FSDP: shards, gather slots and staging; bf16 staging in host memory.
        (2, "tiny", "two ranks", vec![]),
        (4, "tiny", "four ranks", vec!["device.memory_gib=0.5"]),
        (
            4,
            "tiny",
            "four ranks, f32 gathers, naive Muon, prefetch 2",
            vec![
                "parallelism.gather_dtype=\"f32\"",
                "parallelism.muon_placement=\"naive\"",
                "parallelism.prefetch=2",
            ],
        ),
        // bf16 compute: the cast scratch, and the GEMM weights in bf16 (a compute copy at one
        // rank, bf16 unsharded weights in the gather slots on more).
        (
            1,
            "tiny",
            "bf16 compute",
            vec!["training.compute_dtype=\"bf16\""],
        ),
        (
            4,
            "tiny",
            "bf16 compute, four ranks, optimizer offload",
            vec!["training.compute_dtype=\"bf16\"", "optimizer.offload=true"],
        ),
        // small on a short corpus, one step (its BPE vocabulary is trained first).
        (
            1,
            "small",
            "small",
            vec![
                "training.steps=1",
                "data.builtin_bytes=300000",
                "metrics.val_batches=1",
            ],
        ),
        (
            1,
            "small",
            "small, everything offloaded",
            vec![
                "training.steps=1",
                "data.builtin_bytes=300000",
                "metrics.val_batches=1",
                "activation_checkpoint.offload_fraction=1",
                "optimizer.offload=true",
            ],
        ),
    ];
    // The memory milestones: activation offload (half and all of four layers) and optimizer
    // offload, alone and together, at 1 and 4 ranks.
    let mut cases = cases;
    for ranks in [1, 4] {
        for (what, extra) in [
            (
                "offload 0.5",
                vec!["activation_checkpoint.offload_fraction=0.5"],
            ),
            (
                "offload 1",
                vec!["activation_checkpoint.offload_fraction=1"],
            ),
            ("optimizer offload", vec!["optimizer.offload=true"]),
            (
                "optimizer offload, adamw",
                vec!["optimizer.offload=true", "optimizer.name=\"adamw\""],
            ),
            (
                "both offloads",
                vec![
                    "optimizer.offload=true",
                    "activation_checkpoint.offload_fraction=1",
                ],
            ),
            (
                "bf16 compute, offload 1",
                vec![
                    "training.compute_dtype=\"bf16\"",
                    "activation_checkpoint.offload_fraction=1",
                ],
            ),
        ] {
            let mut e = vec!["model.layers=4"];
            e.extend(extra);
            let what: &'static str = Box::leak(format!("{what}, {ranks} ranks").into_boxed_str());
            cases.push((ranks, "tiny", what, e));
        }
    }
    for (ranks, preset, what, extra) in cases {
        let mut o: Vec<String> = vec![
            "training.steps=2".into(),
            "checkpoint.enable=false".into(),
            two.into(),
        ];
        o.extend(extra.iter().map(|s| s.to_string()));
        let cfg = JobConfig::load(Some(preset), None, &o).unwrap();
        cfg.validate().unwrap();
        let dir = format!("pred-{}", what.replace([' ', ','], "-"));
        let r = run(&cfg, &dir, ranks).unwrap();
        let mem: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(r.run_dir.join("memory.json")).unwrap())
                .unwrap();
        assert!(
            mem["gpu0"]["planner_peak_bytes"].is_object(),
            "{what}: {mem}"
        );
        check_prediction(&r.run_dir, what);
    }
    // One memory: everything on the host, as before; and sharded.
    let r = run(&tiny(&[]), "pred-one-memory", 1).unwrap();
    check_prediction(&r.run_dir, "one memory");
    let r = run(&tiny(&[]), "pred-one-memory-ranks", 4).unwrap();
    check_prediction(&r.run_dir, "one memory, four ranks");
}

#[test]
fn device_keys_are_validated() {
    let e = JobConfig::load(Some("tiny"), None, &["device.memory_gib=4".into()])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("device.kind") && e.contains("cpu-two-memory"),
        "{e}"
    );
    let e = JobConfig::load(
        Some("tiny"),
        None,
        &[
            "device.kind=\"cpu-two-memory\"".into(),
            "device.memory_gib=-1".into(),
        ],
    )
    .unwrap()
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("device.memory_gib"), "{e}");
}

#[test]
fn activation_offload_changes_no_loss_at_one_and_four_ranks() {
    // Four layers, so that offloading all of them (4 boundaries to host, 2 device slots) also
    // shrinks the device's share. With and without optimizer offload: every combination gives
    // the same losses, bit for bit.
    for ranks in [1, 4] {
        let mut base: Option<(Vec<f64>, u64)> = None;
        for opt in [false, true] {
            for f in ["0", "0.5", "1"] {
                let cfg = tiny(&[
                    "model.layers=4",
                    "device.kind=\"cpu-two-memory\"",
                    "device.check_streams=true",
                    &format!("activation_checkpoint.offload_fraction={f}"),
                    &format!("optimizer.offload={opt}"),
                ]);
                let s = run(&cfg, &format!("offload-{ranks}-{f}-{opt}"), ranks).unwrap();
                let mem: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(s.run_dir.join("memory.json")).unwrap(),
                )
                .unwrap();
                let peak = |dev: &str| mem[dev]["peak_bytes"]["activations"].as_u64().unwrap_or(0);
                let n_off = ganymede_config::offloaded_layers(f.parse().unwrap(), 4) as u64;
                // One boundary: the rank's tokens × hidden, f32.
                let boundary = 4 * (8 / ranks * 128 * 64) as u64;
                let what = format!("{ranks} ranks, fraction {f}, optimizer offload {opt}");
                assert_eq!(peak("host"), n_off * boundary, "{what}");
                match &base {
                    None => base = Some((s.losses.clone(), peak("gpu0"))),
                    Some((losses, dev)) => {
                        assert_eq!(&s.losses, losses, "{what}");
                        // Kept boundaries plus two slots instead of every boundary.
                        let kept = 5 - n_off + n_off.min(2);
                        assert_eq!(peak("gpu0") + (5 - kept) * boundary, *dev, "{what}");
                    }
                }
            }
        }
    }
}

/// The offloaded boundaries are in the boundaries' dtype: 4·N·H bytes each at f32 compute and
/// under bf16 compute with `activation_checkpoint.boundary_dtype = "f32"`, 2·N·H under bf16
/// compute's default (`auto`, bf16) and with `bf16` at f32 compute. Each memory's activation
/// peak equals the planner's to the byte, at 1 and 4 ranks, with half and all of four layers
/// offloaded.
#[test]
fn offloaded_boundaries_take_their_dtype_as_the_planner_says() {
    for ranks in [1, 4] {
        for f in ["0.5", "1"] {
            let mut host_f32 = None;
            for (compute, boundary) in [
                ("f32", "auto"),
                ("bf16", "f32"),
                ("bf16", "auto"),
                ("f32", "bf16"),
            ] {
                let cfg = tiny(&[
                    "model.layers=4",
                    "training.steps=2",
                    "device.kind=\"cpu-two-memory\"",
                    &format!("training.compute_dtype=\"{compute}\""),
                    &format!("activation_checkpoint.boundary_dtype=\"{boundary}\""),
                    &format!("activation_checkpoint.offload_fraction={f}"),
                ]);
                let name = format!("offload-dtype-{ranks}-{f}-{compute}-{boundary}");
                let s = run(&cfg, &name, ranks).unwrap();
                let mem: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(s.run_dir.join("memory.json")).unwrap(),
                )
                .unwrap();
                let act = |dev: &str, key: &str| mem[dev][key]["activations"].as_f64().unwrap();
                let (host, dev) = (act("host", "peak_bytes"), act("gpu0", "peak_bytes"));
                let what = format!("{compute} compute, {boundary} boundaries, {ranks} ranks, {f}");
                println!(
                    "{what}: activations host {host} bytes (planner {}), device {dev} (planner {})",
                    act("host", "planner_peak_bytes"),
                    act("gpu0", "planner_peak_bytes")
                );
                let n_off = ganymede_config::offloaded_layers(f.parse().unwrap(), 4) as f64;
                let bf16 = boundary == "bf16" || (boundary == "auto" && compute == "bf16");
                // One boundary: the rank's tokens × hidden, 2 or 4 bytes an element.
                let size = if bf16 { 2.0 } else { 4.0 };
                let boundary_bytes = size * (8 / ranks * 128 * 64) as f64;
                assert_eq!(host, n_off * boundary_bytes, "{what}");
                assert_eq!(host, act("host", "planner_peak_bytes"), "{what}");
                assert_eq!(dev, act("gpu0", "planner_peak_bytes"), "{what}");
                match host_f32 {
                    None => host_f32 = Some(host),
                    Some(h) => assert_eq!(host, if bf16 { h / 2.0 } else { h }, "{what}"),
                }
            }
        }
    }
}

#[test]
fn the_trace_shows_offload_copies_on_their_own_tracks() {
    let cfg = tiny(&[
        "model.layers=4",
        "training.steps=2",
        "device.kind=\"cpu-two-memory\"",
        "device.check_streams=true",
        "activation_checkpoint.offload_fraction=0.75",
    ]);
    let path = tmp("trace.json");
    let o = TrainOptions {
        out: Some(tmp("trace")),
        quiet: true,
        trace: Some(path.clone()),
        ..Default::default()
    };
    train(&cfg, None, &o).unwrap();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let evs = doc["traceEvents"].as_array().unwrap();
    let track = |name: &str| {
        evs.iter()
            .find(|e| e["name"] == "thread_name" && e["args"]["name"] == name)
            .map(|e| e["tid"].clone())
            .unwrap_or_else(|| panic!("no {name} track"))
    };
    let count = |tid: &serde_json::Value, prefix: &str| {
        evs.iter()
            .filter(|e| e["ph"] == "X" && &e["tid"] == tid)
            .filter(|e| e["name"].as_str().unwrap().starts_with(prefix))
            .count()
    };
    let (compute, to_host, from_host) = (
        track("compute"),
        track("to-host copies"),
        track("from-host copies"),
    );
    assert!(compute != to_host && to_host != from_host && compute != from_host);
    // Three of four block inputs go out in each step's forward and come back in its backward.
    assert_eq!(count(&to_host, "to host"), 3 * 2);
    assert_eq!(count(&from_host, "from host"), 3 * 2);
    assert_eq!(count(&compute, "block"), 4 * 2 * 2);
}

#[test]
fn small_on_four_ranks_offloads_without_changing_a_loss_and_as_predicted() {
    // `small` (4 layers, where offloading all of them moves two boundaries off the device) on
    // four ranks: everything offloaded against nothing, bitwise equal losses, both runs' peaks
    // within 5% of the planner's.
    let mut losses = vec![];
    for (what, extra) in [
        ("small-4-none", vec![]),
        (
            "small-4-all",
            vec![
                "activation_checkpoint.offload_fraction=1",
                "optimizer.offload=true",
            ],
        ),
    ] {
        let mut o: Vec<String> = [
            "training.steps=2",
            "checkpoint.enable=false",
            "device.kind=\"cpu-two-memory\"",
            "device.check_streams=true",
            "data.builtin_bytes=300000",
            "metrics.val_batches=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        o.extend(extra.iter().map(|s| s.to_string()));
        let cfg = JobConfig::load(Some("small"), None, &o).unwrap();
        cfg.validate().unwrap();
        let r = run(&cfg, what, 4).unwrap();
        check_prediction(&r.run_dir, what);
        losses.push(r.losses);
    }
    assert_eq!(losses[0], losses[1]);
}

/// The head and the MoE layers a chunk of tokens at a time (`training.loss_chunk_tokens`,
/// `training.moe_chunk_tokens`): the planner's prediction equal to the ledger to the byte (1
/// and 2 ranks, f32 and bf16 compute, with and without checkpointing, chunks that leave a short
/// last one); and expert parallelism's buffers at a capacity no routing outgrows, f32 and bf16.
#[test]
fn the_planner_predicts_chunked_heads_and_moe_passes_to_the_byte() {
    for (ranks, extra) in [
        (1, vec!["training.loss_chunk_tokens=100"]),
        (
            2,
            vec![
                "training.loss_chunk_tokens=100",
                "training.compute_dtype=\"bf16\"",
            ],
        ),
        (1, vec!["training.moe_chunk_tokens=100"]),
        (
            1,
            vec![
                "training.moe_chunk_tokens=100",
                "activation_checkpoint.mode=\"none\"",
            ],
        ),
        (
            2,
            vec![
                "training.moe_chunk_tokens=48",
                "training.loss_chunk_tokens=100",
                "training.compute_dtype=\"bf16\"",
            ],
        ),
        // bf16 with experts narrower than the model (F < H): the CPU's output slot is then
        // sized by the experts' outputs, not their gate and up.
        (
            1,
            vec!["model.expert_hidden=32", "training.compute_dtype=\"bf16\""],
        ),
        // Expert parallelism with buffers for the most a rank can receive (no regrowth), f32
        // and bf16 (the rows and GEMM outputs through its buffers in bf16).
        (
            2,
            vec![
                "parallelism.dp_shard=2",
                "parallelism.ep=2",
                "parallelism.ep_capacity_factor=2",
            ],
        ),
        (
            2,
            vec![
                "parallelism.dp_shard=2",
                "parallelism.ep=2",
                "parallelism.ep_capacity_factor=2",
                "training.compute_dtype=\"bf16\"",
            ],
        ),
        // Gradient accumulation: a microbatch's activations, and under FSDP the landing shards
        // (one block's per gradient set and the root's: with four layers, half the blocks').
        (1, vec!["training.micro_batch_size=2"]),
        (
            2,
            vec!["parallelism.dp_shard=2", "training.micro_batch_size=1"],
        ),
        (
            2,
            vec![
                "parallelism.dp_shard=2",
                "training.micro_batch_size=1",
                "model.layers=4",
            ],
        ),
        (
            2,
            vec![
                "parallelism.dp_shard=2",
                "parallelism.ep=2",
                "parallelism.ep_capacity_factor=2",
                "training.micro_batch_size=2",
            ],
        ),
    ] {
        let mut o = vec!["device.kind=\"cpu-two-memory\"", "training.steps=2"];
        o.extend(extra.iter());
        let mut cfg = tiny(&o);
        cfg.parallelism.dp_shard = ranks;
        let s = run(&cfg, "chunked-head", ranks).unwrap();
        for (dev, cat, measured, planned) in common::measured_and_planned(&s.run_dir) {
            assert_eq!(measured, planned, "{ranks} ranks {extra:?}: {dev} {cat}");
        }
    }
}

/// Muon's expert stacks in strided batches (`optimizer.ns_batch = "on"`, a GPU's default): the
/// same losses bit for bit as matrix by matrix (the CPU's strided calls are per-matrix loops),
/// and the planner's prediction equal to the ledger to the byte with the batch scratch on the
/// device: one process (with and without optimizer offload), FSDP over 2 and 4 ranks (FlexShard's
/// owned experts, naive placement's whole stacks on their roots). The batch scratch is what the
/// two runs' buffers differ by: tiny's 8 experts of 128 x 64 in one batch on one process, a
/// Nesterov copy, A, B and Y (4 (65,536 + 2 x 32,768 + 65,536) bytes); on several ranks in place
/// on the gradient shards, A, B and Y of the experts a rank owns (FlexShard: 4 on 2 ranks, 2 on
/// 4) or of the whole stack (naive).
#[test]
fn batched_stacks_are_on_the_ledger_as_the_planner_says() {
    let per = |experts: f64, u: bool| {
        4.0 * experts * (if u { 8_192.0 } else { 0.0 } + 2.0 * 4_096.0 + 8_192.0)
    };
    for (ranks, extra, slot) in [
        (1, "optimizer.offload=false", per(8.0, true)),
        (1, "optimizer.offload=true", per(8.0, true)),
        (
            2,
            "parallelism.muon_placement=\"flexshard\"",
            per(4.0, false),
        ),
        (
            4,
            "parallelism.muon_placement=\"flexshard\"",
            per(2.0, false),
        ),
        (2, "parallelism.muon_placement=\"naive\"", per(8.0, false)),
    ] {
        let mut losses = Vec::new();
        let mut buffers = Vec::new();
        for batch in ["off", "on"] {
            let b = format!("optimizer.ns_batch=\"{batch}\"");
            let mut cfg = tiny(&["device.kind=\"cpu-two-memory\"", &b, extra]);
            cfg.parallelism.dp_shard = ranks;
            let s = run(&cfg, "ns-batch", ranks).unwrap();
            for (dev, cat, measured, planned) in common::measured_and_planned(&s.run_dir) {
                assert_eq!(
                    measured, planned,
                    "ns_batch {batch}, {ranks} ranks, {extra}: {dev} {cat}"
                );
                if dev == "gpu0" && cat == "buffers" {
                    buffers.push(measured);
                }
            }
            losses.push(s.losses);
        }
        assert_eq!(losses[0], losses[1], "{ranks} ranks, {extra}");
        assert_eq!(
            buffers[1] - buffers[0],
            slot,
            "{ranks} ranks, {extra}: {buffers:?}"
        );
    }
}

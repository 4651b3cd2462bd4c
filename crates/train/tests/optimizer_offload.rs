//! Optimizer state in host memory (`optimizer.offload`) in the checking two-memory mode: the
//! same losses, parameters and state as with the state on the device, checkpoints that resume
//! across the switch, the ledger's view of where the bytes live, and no allocation after the
//! first step.

use ganymede_config::JobConfig;
use ganymede_train::trainer::{train, TrainOptions, TrainSummary};
use std::path::{Path, PathBuf};

mod common;
use common::allocs_after_first_step;

fn tmp(name: &str) -> PathBuf {
    ganymede_train::scratch::run_dir("gm-optoff", name)
}

/// `tiny` in the checking two-memory mode (a missing event wait panics), f32 gathers.
fn tiny(steps: usize, extra: &[&str]) -> JobConfig {
    let mut o: Vec<String> = vec![
        format!("training.steps={steps}"),
        "device.kind=\"cpu-two-memory\"".into(),
        "device.check_streams=true".into(),
        "parallelism.gather_dtype=f32".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let c = JobConfig::load(Some("tiny"), None, &o).unwrap();
    c.validate().unwrap();
    c
}

fn run(
    cfg: &JobConfig,
    name: &str,
    ranks: usize,
    resume: Option<&Path>,
    stop_after: Option<usize>,
) -> TrainSummary {
    let o = TrainOptions {
        out: Some(tmp(name)),
        quiet: true,
        ranks,
        stop_after,
        ..Default::default()
    };
    train(cfg, resume, &o).unwrap()
}

/// Every tensor of a checkpoint, parameters then optimizer state, by name.
fn tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let (model, opt) = ganymede_checkpoint::read_tensors(dir).unwrap();
    model
        .into_iter()
        .chain(opt)
        .map(|(n, (_, d))| (n, d))
        .collect()
}

fn assert_same_tensors(a: &Path, b: &Path, what: &str) {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.len(), b.len(), "{what}: tensor count");
    for ((na, da), (nb, db)) in a.iter().zip(&b) {
        assert_eq!(na, nb, "{what}");
        let same = da.iter().zip(db).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same && da.len() == db.len(), "{what}: {na} differs");
    }
}

/// Losses, final parameters and optimizer state with the state in host memory equal,
/// bitwise, those with it on the device: Muon and AdamW, one process and sharded ranks
/// (FlexShard at 4).
#[test]
fn offloaded_state_trains_bitwise_like_device_state() {
    for (opt, ranks) in [
        ("muon", 1),
        ("adamw", 1),
        ("muon", 2),
        ("adamw", 2),
        ("muon", 4),
    ] {
        let name = format!("optimizer.name=\"{opt}\"");
        let on = tiny(4, &[&name, "optimizer.offload=true"]);
        let off = tiny(4, &[&name, "optimizer.offload=false"]);
        let tag = format!("{opt}-{ranks}");
        let a = run(&off, &format!("off-{tag}"), ranks, None, None);
        let b = run(&on, &format!("on-{tag}"), ranks, None, None);
        assert_eq!(a.losses, b.losses, "{tag}: losses");
        assert_eq!(a.final_val_loss, b.final_val_loss, "{tag}: validation");
        let (ca, cb) = (a.checkpoint.unwrap(), b.checkpoint.unwrap());
        assert_same_tensors(&ca, &cb, &tag);
    }
}

/// A checkpoint written with the state on the device resumes with it in host memory and vice
/// versa, continuing bit-identically.
#[test]
fn checkpoints_resume_across_the_offload_switch() {
    for ranks in [1, 2] {
        let full = run(&tiny(6, &[]), &format!("full-{ranks}"), ranks, None, None);
        for (first, then) in [(false, true), (true, false)] {
            let tag = format!("{ranks}-{first}-{then}");
            let a = tiny(6, &[&format!("optimizer.offload={first}")]);
            let part = run(&a, &format!("part-{tag}"), ranks, None, Some(3));
            let ck = part.checkpoint.unwrap();
            let b = tiny(6, &[&format!("optimizer.offload={then}")]);
            let rest = run(&b, &format!("rest-{tag}"), ranks, Some(&ck), None);
            assert_eq!(part.losses, full.losses[..3], "{tag}: before");
            assert_eq!(rest.losses, full.losses[3..], "{tag}: resumed");
            assert_same_tensors(
                &full.checkpoint.clone().unwrap(),
                &rest.checkpoint.unwrap(),
                &tag,
            );
        }
    }
}

/// memory.json: with offload the optimizer's bytes are on the host and none on the device,
/// whose buffers hold the two staging slots (each the largest parameter's state).
#[test]
fn the_ledger_puts_offloaded_state_on_the_host() {
    let mut peaks = Vec::new();
    for (opt, offload) in [
        ("muon", false),
        ("muon", true),
        ("adamw", false),
        ("adamw", true),
    ] {
        let cfg = tiny(
            2,
            &[
                &format!("optimizer.name=\"{opt}\""),
                &format!("optimizer.offload={offload}"),
                "checkpoint.enable=false",
            ],
        );
        let s = run(&cfg, &format!("mem-{opt}-{offload}"), 1, None, None);
        let text = std::fs::read_to_string(s.run_dir.join("memory.json")).unwrap();
        let mem: serde_json::Value = serde_json::from_str(&text).unwrap();
        let peak = |dev: &str, cat: &str| mem[dev]["peak_bytes"][cat].as_u64().unwrap_or(0);
        let (dev_opt, host_opt) = (peak("gpu0", "optimizer"), peak("host", "optimizer"));
        let dev_buf = peak("gpu0", "buffers");
        eprintln!(
            "{opt} offload={offload}: gpu0 optimizer {dev_opt}, host optimizer {host_opt}, \
             gpu0 buffers {dev_buf}"
        );
        if offload {
            assert_eq!(dev_opt, 0, "{opt}: {text}");
            assert!(host_opt > 0, "{opt}: {text}");
        } else {
            assert!(dev_opt > 0, "{opt}: {text}");
        }
        peaks.push((dev_opt, host_opt, dev_buf));
    }
    // Under FSDP too (rank 0's ledger): the state shards on the host.
    let cfg = tiny(2, &["optimizer.offload=true", "checkpoint.enable=false"]);
    let s = run(&cfg, "mem-fsdp", 2, None, None);
    let text = std::fs::read_to_string(s.run_dir.join("memory.json")).unwrap();
    let mem: serde_json::Value = serde_json::from_str(&text).unwrap();
    let peak = |dev: &str, cat: &str| mem[dev]["peak_bytes"][cat].as_u64().unwrap_or(0);
    eprintln!(
        "muon offload=true, 2 ranks, rank 0: gpu0 optimizer {}, host optimizer {}, gpu0 buffers \
         {}, gpu0 params {}, host params {}",
        peak("gpu0", "optimizer"),
        peak("host", "optimizer"),
        peak("gpu0", "buffers"),
        peak("gpu0", "params"),
        peak("host", "params")
    );
    assert_eq!(peak("gpu0", "optimizer"), 0, "{text}");
    let host = peak("host", "optimizer");
    assert!(
        host > 0 && host < peaks[1].1,
        "a shard of the state: {text}"
    );
    // And the f32 master shards: the device holds a parameter only while it is drawn whole at
    // initialisation (the largest, the embedding, is far less than this rank's shards).
    let (dev_params, host_params) = (peak("gpu0", "params"), peak("host", "params"));
    assert!(
        host_params > 0 && dev_params < host_params,
        "master shards on the host: {text}"
    );
    for pair in peaks.chunks(2) {
        let ((dev_off, _, buf_off), (_, host_on, buf_on)) = (pair[0], pair[1]);
        // The same state bytes, moved; the device gains only the staging slots.
        assert_eq!(dev_off, host_on);
        assert!(buf_on > buf_off && buf_on - buf_off < dev_off, "{pair:?}");
    }
}

/// Fixed buffers: after the first step a training step allocates nothing, at one rank, with
/// and without offload, Muon and AdamW.
#[test]
fn a_step_after_the_first_allocates_nothing() {
    for opt in ["muon", "adamw"] {
        for offload in [false, true] {
            // Activation offload too: its slots and host copies are made with the workspace.
            for f in ["0", "1"] {
                let cfg = tiny(
                    4,
                    &[
                        &format!("optimizer.name=\"{opt}\""),
                        &format!("optimizer.offload={offload}"),
                        &format!("activation_checkpoint.offload_fraction={f}"),
                    ],
                );
                let n = allocs_after_first_step(&cfg, 1);
                assert_eq!(
                    n,
                    [0],
                    "{opt}, offload={offload}, fraction {f}: allocations in steps 2-3"
                );
            }
        }
    }
}

/// The same at 2 ranks (FSDP), with f32 and bf16 gathers.
#[test]
fn a_sharded_step_after_the_first_allocates_nothing() {
    for (opt, gather) in [("muon", "f32"), ("adamw", "f32"), ("muon", "bf16")] {
        for offload in [false, true] {
            let f = if offload { "1" } else { "0" };
            let cfg = tiny(
                4,
                &[
                    &format!("optimizer.name=\"{opt}\""),
                    &format!("optimizer.offload={offload}"),
                    &format!("parallelism.gather_dtype={gather}"),
                    &format!("activation_checkpoint.offload_fraction={f}"),
                ],
            );
            let n = allocs_after_first_step(&cfg, 2);
            assert_eq!(n, [0, 0], "{opt}, {gather} gathers, offload={offload}");
        }
    }
}

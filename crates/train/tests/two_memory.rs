//! Training on the two-memory CPU mode (`device.kind = "cpu-two-memory"`): the emulated device
//! memory that GPU memory behaviour is tested on without a GPU.

use ganymede_config::JobConfig;
use ganymede_train::trainer::{train, TrainOptions};
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gm-two-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
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
    // tiny's parameters alone are ~1.8 MB: 1 MiB of device memory cannot hold them.
    let cfg = tiny(&[
        "device.kind=\"cpu-two-memory\"",
        "device.memory_gib=0.0009765625",
    ]);
    let e = format!("{:#}", run(&cfg, "oom", 1).unwrap_err());
    assert!(
        e.contains("out of memory") && e.contains("params") && e.contains("bytes"),
        "{e}"
    );
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

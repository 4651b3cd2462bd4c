//! Bad input gives one clear line on stderr naming the file, key or value, and a non-zero exit.

mod util;

use std::fs;
use util::{fails, ganymede, ok, TempDir};

fn err_of(args: &[&str]) -> String {
    let tmp = TempDir::new("err");
    fails(ganymede(tmp.path(), args, &[]))
}

#[test]
fn bad_config_values_name_the_key() {
    let e = err_of(&["train", "--preset", "huge"]);
    assert!(
        e.contains("unknown preset 'huge'") && e.contains("tiny"),
        "{e}"
    );
    let e = err_of(&["train", "--set", "model.wings=2"]);
    assert!(e.contains("wings"), "{e}");
    let e = err_of(&["train", "--set", "model.top_k=9"]);
    assert!(e.contains("model.top_k") && e.contains('9'), "{e}");
    let e = err_of(&["train", "--set", "model.kv_heads=3"]);
    assert!(e.contains("model.kv_heads"), "{e}");
    let e = err_of(&["train", "--set", "optimizer.name=sgd"]);
    assert!(e.contains("sgd"), "{e}");
    let e = err_of(&["train", "--set", "optimizer.lr=-1"]);
    assert!(e.contains("optimizer.lr"), "{e}");
    let e = err_of(&["train", "--set", "activation_checkpoint.mode=half"]);
    assert!(e.contains("half"), "{e}");
    let e = err_of(&["train", "--set", "training.steps"]);
    assert!(e.contains("training.steps"), "{e}");
    let e = err_of(&["train", "--set", "training.compute_dtype=fp16"]);
    assert!(
        e.contains("training.compute_dtype") && e.contains("fp16") && e.contains("bf16"),
        "{e}"
    );
    let e = err_of(&["train", "--set", "optimizer.ns_batch=sometimes"]);
    assert!(
        e.contains("optimizer.ns_batch") && e.contains("sometimes") && e.contains("\"on\""),
        "{e}"
    );
    let e = err_of(&["train", "--set", "activation_checkpoint.boundary_dtype=fp8"]);
    assert!(
        e.contains("activation_checkpoint.boundary_dtype")
            && e.contains("fp8")
            && e.contains("auto"),
        "{e}"
    );
    let e = err_of(&["plan", "--set", "activation_checkpoint.boundary_dtype=f16"]);
    assert!(
        e.contains("activation_checkpoint.boundary_dtype") && e.contains("f16"),
        "{e}"
    );
    let e = err_of(&["train", "--steps", "0"]);
    assert!(e.contains("training.steps"), "{e}");
}

#[test]
fn missing_files_are_named() {
    let e = err_of(&["train", "--config", "/no/such/job.toml"]);
    assert!(e.contains("/no/such/job.toml"), "{e}");
    let e = err_of(&["train", "--set", "data.path=/no/such/corpus.txt"]);
    assert!(
        e.contains("data.path") && e.contains("/no/such/corpus.txt"),
        "{e}"
    );
    let e = err_of(&["eval", "--checkpoint", "/no/such/run"]);
    assert!(e.contains("/no/such/run"), "{e}");
    let e = err_of(&["train", "--resume", "/no/such/run"]);
    assert!(e.contains("/no/such/run"), "{e}");
    let e = err_of(&["export", "--checkpoint", "/no/such/run", "--out", "x"]);
    assert!(e.contains("/no/such/run"), "{e}");

    let tmp = TempDir::new("badtoml");
    let f = tmp.path().join("job.toml");
    fs::write(&f, "[model]\nhidden = \"wide\"\n").unwrap();
    let e = fails(ganymede(
        tmp.path(),
        &["train", "--config", f.to_str().unwrap()],
        &[],
    ));
    assert!(e.contains("job.toml"), "{e}");
}

/// A two-step tiny run in `dir/run`, with extra overrides.
fn quick_run(dir: &std::path::Path, extra: &[&str]) -> std::path::PathBuf {
    let run = dir.join("run");
    let mut args = vec![
        "train",
        "--steps",
        "2",
        "--set",
        "data.builtin_bytes=100000",
        "--out",
        run.to_str().unwrap(),
    ];
    for e in extra {
        args.extend(["--set", e]);
    }
    ok(ganymede(dir, &args, &[]));
    run
}

#[test]
fn bad_checkpoints_and_mismatched_configs() {
    let tmp = TempDir::new("ckpt");
    let run = quick_run(tmp.path(), &[]);
    let r = run.to_str().unwrap();

    // A config that differs from the checkpoint in a key that matters.
    let e = fails(ganymede(
        tmp.path(),
        &[
            "train",
            "--resume",
            r,
            "--steps",
            "4",
            "--set",
            "model.top_k=3",
        ],
        &[],
    ));
    assert!(
        e.contains("does not match") && e.contains("model.top_k"),
        "{e}"
    );
    let e = fails(ganymede(
        tmp.path(),
        &["train", "--resume", r, "--preset", "small"],
        &[],
    ));
    assert!(
        e.contains("model.hidden") && e.contains("model.vocab_size"),
        "{e}"
    );
    // A fresh run into a directory that already holds one.
    let e = fails(ganymede(
        tmp.path(),
        &["train", "--steps", "2", "--out", r],
        &[],
    ));
    assert!(
        e.contains("already holds checkpoints") && e.contains("--resume"),
        "{e}"
    );
    // Nothing left to run.
    let e = fails(ganymede(tmp.path(), &["train", "--resume", r], &[]));
    assert!(e.contains("--steps"), "{e}");

    // A directory that is not a checkpoint.
    let e = fails(ganymede(
        tmp.path(),
        &["eval", "--checkpoint", tmp.path().to_str().unwrap()],
        &[],
    ));
    assert!(e.contains("not a checkpoint"), "{e}");

    // A truncated parameter file.
    let ckpt = run.join("checkpoints/step_00000002");
    let model = ckpt.join("model.safetensors");
    let bytes = fs::read(&model).unwrap();
    fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let e = fails(ganymede(tmp.path(), &["eval", "--checkpoint", r], &[]));
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    let e = fails(ganymede(
        tmp.path(),
        &["train", "--resume", r, "--steps", "4"],
        &[],
    ));
    assert!(e.contains("model.safetensors"), "{e}");

    // A manifest that is not JSON.
    fs::write(ckpt.join("manifest.json"), "{ not json").unwrap();
    let e = fails(ganymede(tmp.path(), &["eval", "--checkpoint", r], &[]));
    assert!(e.contains("manifest.json"), "{e}");
}

#[test]
fn export_refuses_what_qwen3_cannot_express() {
    let tmp = TempDir::new("export");
    let run = quick_run(tmp.path(), &["model.shared_experts=1"]);
    let e = fails(ganymede(
        tmp.path(),
        &[
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--format",
            "hf",
            "--out",
            "hf",
        ],
        &[],
    ));
    assert!(e.contains("shared experts"), "{e}");

    let tmp = TempDir::new("export-bias");
    let run = quick_run(tmp.path(), &["model.router_bias_update=0.01"]);
    let e = fails(ganymede(
        tmp.path(),
        &[
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--out",
            "hf",
        ],
        &[],
    ));
    assert!(
        e.contains("e_score_correction_bias") && e.contains("nonzero"),
        "{e}"
    );
}

#[test]
fn eval_errors() {
    let tmp = TempDir::new("evalerr");
    let run = quick_run(tmp.path(), &[]);
    let r = run.to_str().unwrap();
    let e = fails(ganymede(
        tmp.path(),
        &["eval", "--checkpoint", r, "--tokens", "/no/such/tokens.bin"],
        &[],
    ));
    assert!(e.contains("/no/such/tokens.bin"), "{e}");
    let short = tmp.path().join("short.bin");
    fs::write(&short, [1u8, 0, 0, 0, 2, 0, 0, 0]).unwrap();
    let e = fails(ganymede(
        tmp.path(),
        &[
            "eval",
            "--checkpoint",
            r,
            "--tokens",
            short.to_str().unwrap(),
        ],
        &[],
    ));
    assert!(e.contains("fewer than one window"), "{e}");
    let big = tmp.path().join("big.bin");
    fs::write(&big, 1000u32.to_le_bytes().repeat(200)).unwrap();
    let e = fails(ganymede(
        tmp.path(),
        &["eval", "--checkpoint", r, "--tokens", big.to_str().unwrap()],
        &[],
    ));
    assert!(e.contains("1000") && e.contains("big.bin"), "{e}");
}

/// A gradient that overflows while the loss is still finite (`tiny` at lr 1e30: step 2's loss
/// is 5.5, its gradient norm NaN) stops the run before the update, so no checkpoint holds the
/// NaN weights: the latest is still step 1's. Without the gradient's check the run went on to
/// write step 2's checkpoint from poisoned weights.
#[test]
fn a_non_finite_gradient_stops_before_it_reaches_a_checkpoint() {
    let tmp = TempDir::new("nonfinite");
    let run = tmp.path().join("run");
    let r = run.display().to_string();
    let args = [
        "train",
        "--steps",
        "4",
        "--set",
        "optimizer.lr=1e30",
        "--set",
        "optimizer.warmup_steps=0",
        "--set",
        "checkpoint.interval=1",
        "--set",
        "metrics.val_every=0",
        "--out",
        &r,
    ];
    let e = fails(ganymede(tmp.path(), &args, &[]));
    assert!(
        e.contains("gradient norm is NaN at step 2") && e.contains("not applied"),
        "{e}"
    );
    let latest = fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step_00000001");
}

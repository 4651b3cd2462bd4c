//! End to end through the binary: train, crash mid-checkpoint, resume bit-identically, eval,
//! export to Hugging Face and (when a Python with transformers is available) check the exported
//! model gives the same loss in `transformers`.

mod util;

use std::path::Path;
use std::process::Command;
use util::{ganymede, losses, ok, python_with_transformers, TempDir};

/// Short tiny run: 24 steps, a checkpoint every 12, validation every 8 on 2 batches.
const STEPS: &str = "24";
fn short_run_args(out: &Path) -> Vec<String> {
    [
        "train",
        "--steps",
        STEPS,
        "--set",
        "checkpoint.interval=12",
        "--set",
        "metrics.val_every=8",
        "--set",
        "metrics.val_batches=2",
        "--set",
        "data.builtin_bytes=400000",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

#[test]
fn train_crash_resume_eval_export_parity() {
    let tmp = TempDir::new("e2e");
    let straight = tmp.path().join("straight");
    let out = ok(ganymede(tmp.path(), &short_run_args(&straight), &[]));
    assert!(out.contains("loss"), "{out}");
    for f in [
        "config.toml",
        "metrics.jsonl",
        "memory.json",
        "checkpoints/latest",
    ] {
        assert!(straight.join(f).exists(), "missing {f}");
    }
    let a = losses(&straight);
    assert_eq!(a.len(), 24);
    assert!(a[23] < a[0], "loss did not fall: {} -> {}", a[0], a[23]);
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(straight.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .nth(7)
            .unwrap(),
    )
    .unwrap();
    for k in [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "aux_loss",
        "load_max_over_mean",
        "load_cv",
        "val_loss",
    ] {
        assert!(first.get(k).is_some(), "metrics line lacks {k}: {first}");
    }

    // The ledger's measured peaks against the planner's prediction of them.
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(straight.join("memory.json")).unwrap())
            .unwrap();
    for cat in ["params", "grads", "optimizer", "activations", "buffers"] {
        let measured = mem["host"]["peak_bytes"][cat].as_f64().unwrap_or(0.0);
        let predicted = mem["planner_predicted_peak_bytes"][cat].as_f64().unwrap();
        assert!(
            (measured - predicted).abs() <= 0.02 * predicted.max(1.0),
            "{cat}: measured {measured} bytes, planner {predicted}"
        );
    }

    // The same run, killed while writing its final checkpoint: the step-12 one must survive,
    // and resuming from the run directory must redo steps 13..24 bit-identically.
    let crashed = tmp.path().join("crashed");
    let r = ganymede(
        tmp.path(),
        &short_run_args(&crashed),
        &[("GANYMEDE_CRASH_AT_CHECKPOINT", STEPS)],
    );
    assert!(!r.status.success(), "the crash hook did not fire");
    let latest = std::fs::read_to_string(crashed.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step_00000012");
    ok(ganymede(
        tmp.path(),
        &[
            "train".into(),
            "--resume".into(),
            crashed.display().to_string(),
        ],
        &[],
    ));
    let b = losses(&crashed);
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "step {}: {x} vs {y}", i + 1);
    }

    // eval on the validation split, and on a token file.
    let ckpt = straight.display().to_string();
    let val = straight.join("data/val.bin");
    let eval_json = ok(ganymede(
        tmp.path(),
        &[
            "eval".into(),
            "--checkpoint".into(),
            ckpt.clone(),
            "--tokens".into(),
            val.display().to_string(),
            "--json".into(),
        ],
        &[],
    ));
    let ours: serde_json::Value = serde_json::from_str(eval_json.trim()).unwrap();
    let ours_loss = ours["loss"].as_f64().unwrap();
    assert!(ours_loss.is_finite() && ours_loss > 0.0);
    let default_eval = ok(ganymede(
        tmp.path(),
        &[
            "eval".into(),
            "--checkpoint".into(),
            ckpt.clone(),
            "--json".into(),
        ],
        &[],
    ));
    assert_eq!(
        default_eval.trim(),
        eval_json.trim(),
        "default eval is the validation split"
    );

    // generate something.
    let text = ok(ganymede(
        tmp.path(),
        &[
            "generate".into(),
            "--checkpoint".into(),
            ckpt.clone(),
            "--prompt".into(),
            "the cat ".into(),
            "--max-new-tokens".into(),
            "20".into(),
        ],
        &[],
    ));
    assert!(text.starts_with("the cat "), "{text}");

    // export and compare with transformers.
    let hf = tmp.path().join("hf");
    ok(ganymede(
        tmp.path(),
        &[
            "export".into(),
            "--checkpoint".into(),
            ckpt,
            "--format".into(),
            "hf".into(),
            "--out".into(),
            hf.display().to_string(),
        ],
        &[],
    ));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(hf.join(f).is_file(), "export lacks {f}");
    }
    let Some(py) = python_with_transformers() else {
        skipped();
        return;
    };
    assert_parity(&py, &hf, &val, 128, ours_loss);
    // The exported byte tokenizer loads in transformers and maps bytes to themselves.
    let r = Command::new(&py)
        .arg("-c")
        .arg(
            "import sys; from transformers import AutoTokenizer; \
             t = AutoTokenizer.from_pretrained(sys.argv[1]); s = 'the cat, Über'; \
             assert t(s)['input_ids'] == list(s.encode()), t(s)['input_ids']; print('ok')",
        )
        .arg(&hf)
        .output()
        .expect("run python");
    ok(r);
}

fn skipped() {
    util::loud(
        "*** SKIPPED: HF parity check (no Python with torch + transformers + safetensors; \
         set GANYMEDE_PYTHON) ***",
    );
}

/// `scripts/hf_parity.py` on the export `hf` gives `ours` within a relative 1e-4.
fn assert_parity(py: &str, hf: &Path, tokens: &Path, seq: usize, ours: f64) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_parity.py");
    let r = Command::new(py)
        .arg(&script)
        .arg(hf)
        .arg(tokens)
        .arg(seq.to_string())
        .output()
        .expect("run python");
    let theirs = ok(r);
    let theirs: serde_json::Value = serde_json::from_str(theirs.trim().lines().last().unwrap())
        .unwrap_or_else(|e| panic!("hf_parity.py printed {theirs}: {e}"));
    let hf_loss = theirs["loss"].as_f64().unwrap();
    let rel = (hf_loss - ours).abs() / hf_loss.abs();
    util::loud(&format!(
        "HF parity ({}): ganymede {ours:.8}, transformers {hf_loss:.8}, relative {rel:.2e}",
        hf.display()
    ));
    assert!(
        rel < 1e-4,
        "ganymede {ours} vs transformers {hf_loss}: relative {rel:.2e}"
    );
}

/// The export's config fields beyond the default shape: a dense first layer (`mlp_only_layers`,
/// `intermediate_size`), unnormalised top-k weights (`norm_topk_prob = false`) and another RoPE
/// base (`rope_parameters`).
#[test]
fn hf_parity_dense_layer_unnormalised_topk_rope_theta() {
    let tmp = TempDir::new("e2e-dense");
    let run = tmp.path().join("run");
    let args = [
        "train",
        "--steps",
        "6",
        "--set",
        "model.layers=3",
        "--set",
        "model.dense_layers=1",
        "--set",
        "model.dense_hidden=96",
        "--set",
        "model.norm_topk_prob=false",
        "--set",
        "model.rope_theta=10000",
        "--set",
        "data.builtin_bytes=200000",
        "--out",
        run.to_str().unwrap(),
    ];
    ok(ganymede(tmp.path(), &args, &[]));
    let hf = tmp.path().join("hf");
    let (r, h) = (run.to_str().unwrap(), hf.to_str().unwrap());
    ok(ganymede(
        tmp.path(),
        &["export", "--checkpoint", r, "--out", h],
        &[],
    ));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["mlp_only_layers"], serde_json::json!([0]));
    assert_eq!(config["norm_topk_prob"], false);
    let val = run.join("data/val.bin");
    let out = ok(ganymede(
        tmp.path(),
        &[
            "eval",
            "--checkpoint",
            r,
            "--tokens",
            val.to_str().unwrap(),
            "--json",
        ],
        &[],
    ));
    let ours: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let Some(py) = python_with_transformers() else {
        skipped();
        return;
    };
    assert_parity(&py, &hf, &val, 128, ours["loss"].as_f64().unwrap());
}

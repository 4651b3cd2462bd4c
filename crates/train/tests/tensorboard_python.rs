//! TensorBoard's own Python reader reads back, from `RUN/tb/`, the values of `metrics.jsonl`.
//! Runs where a Python with `tensorboard` is importable (`GANYMEDE_PYTHON`, default python3);
//! prints a SKIPPED line otherwise.

use ganymede_train::metrics::{MetricsWriter, StepMetrics};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

fn python_with_tensorboard() -> Option<String> {
    let py = std::env::var("GANYMEDE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

fn metrics(step: usize) -> StepMetrics {
    let s = step as f64;
    StepMetrics {
        step,
        loss: 5.0 / (1.0 + s) + 0.123_456_789,
        aux_loss: 0.01 * s,
        lr: 3e-4 * s.min(3.0) / 3.0,
        grad_norm: 1.0 + (s * 0.7).sin(),
        tokens_per_s: 1000.0 + s,
        tokens_per_s_avg: 999.5 + s,
        tokens_seen: 1024 * step as u64,
        elapsed_s: 0.25 * s,
        load_max_over_mean: 1.5 - 0.01 * s,
        load_cv: vec![0.1 * s, 0.2],
        val_loss: step.is_multiple_of(3).then_some(4.0 / s),
        val_loss_by_source: Default::default(),
        step_s: 0.5 + 0.001 * s,
        ranks: 1,
        comm_bytes: None,
        comm: None,
        ep_rows_over_even: None,
        ep_regrowths: None,
        expert_load: None,
        phase_ms: Some(
            [("attention", 12.5 + s), ("optimizer", 3.25)]
                .into_iter()
                .collect(),
        ),
        phase_marks: Some(40),
    }
}

#[test]
fn tensorboard_reads_back_the_metrics() {
    let run = ganymede_train::scratch::run_dir("gm-tb", "run");
    std::fs::create_dir_all(&run).unwrap();
    // The run's own config turns it on, as `metrics.tensorboard = true` does for a real run.
    std::fs::write(run.join("config.toml"), "[metrics]\ntensorboard = true\n").unwrap();
    let jsonl = run.join("metrics.jsonl");
    {
        let mut w = MetricsWriter::open(&jsonl, 0).unwrap();
        assert!(w
            .tensorboard_file()
            .is_some_and(|p| p.starts_with(run.join("tb"))));
        for step in 1..=12 {
            w.write(&metrics(step)).unwrap();
        }
    }
    // Without the key there are no event files.
    let plain = run.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let w = MetricsWriter::open(&plain.join("metrics.jsonl"), 0).unwrap();
    assert!(w.tensorboard_file().is_none());

    // What metrics.jsonl says, as f32 (TensorBoard's simple_value).
    let mut want: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    for line in std::fs::read_to_string(&jsonl).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_i64().unwrap();
        for (tag, x) in ganymede_train::tensorboard::scalars_of(&v) {
            want.entry(tag).or_default().push((step, x));
        }
    }
    assert!(want.contains_key("val_loss") && want.contains_key("load_cv/1"));
    assert!(want.contains_key("phase_ms/attention") && want.contains_key("phase_marks"));

    let Some(py) = python_with_tensorboard() else {
        // Straight to stderr, past the test harness's capture, so CI logs show it.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "\n*** SKIPPED: TensorBoard read-back (no Python with tensorboard; set GANYMEDE_PYTHON) ***\n"
        );
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tb_read.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(run.join("tb"))
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: BTreeMap<String, Vec<(i64, f64)>> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (tag, w) in &want {
        let g = &got[tag];
        assert_eq!(g.len(), w.len(), "{tag}");
        for ((gs, gv), (ws, wv)) in g.iter().zip(w) {
            assert_eq!(gs, ws, "{tag}");
            // Python reads the float32 back as a double: exactly the f32 we wrote.
            assert_eq!(*gv as f32, *wv, "{tag} at step {ws}");
        }
    }
    std::fs::remove_dir_all(&run).unwrap();
}

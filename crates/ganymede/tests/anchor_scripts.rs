//! The device check's scripts and issue 32's anchor scripts, checked where there is no GPU, so
//! that the one device run they are written for meets no syntax error: every shell script parses
//! (`bash -n`), and, with a Python that imports torch (`GANYMEDE_PYTHON`, else `python3`), the
//! TorchTitan anchor's own checks pass (its batched Newton–Schulz against torch's per-matrix
//! function, its FLOPs per token against the planner's) and the SDPA ceiling prints its table
//! on the CPU. TorchTitan itself needs its wheels (`scripts/fetch_wheelhouse.sh`, network):
//! docs/cuda.md has the dry run of the whole check.

mod util;

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn every_device_script_parses() {
    let mut n = 0;
    for dir in ["scripts", "bench"] {
        for e in std::fs::read_dir(repo().join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "sh") {
                let o = Command::new("bash").arg("-n").arg(&p).output().unwrap();
                assert!(
                    o.status.success(),
                    "{}: {}",
                    p.display(),
                    String::from_utf8_lossy(&o.stderr)
                );
                n += 1;
            }
        }
    }
    // device_check, device_train_check, device_anchor_check, device_plan_check, device_build,
    // fetch_wheelhouse at least.
    assert!(n >= 6, "{n} scripts");
    for s in [
        "device_check.sh",
        "device_anchor_check.sh",
        "fetch_wheelhouse.sh",
    ] {
        assert!(repo().join("scripts").join(s).exists(), "{s}");
    }
}

fn python_with_torch() -> Option<String> {
    let py = std::env::var("GANYMEDE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

#[test]
fn anchor_helpers_and_sdpa_ceiling_run_on_the_cpu() {
    let Some(py) = python_with_torch() else {
        util::loud("*** SKIPPED: anchor scripts (no Python with torch; set GANYMEDE_PYTHON) ***");
        return;
    };
    let out = util::ok(
        Command::new(&py)
            .arg(repo().join("bench/torchtitan_qwen3moe.py"))
            .arg("--selftest")
            .output()
            .unwrap(),
    );
    assert!(out.contains("selftest: pass"), "{out}");
    let out = util::ok(
        Command::new(&py)
            .arg(repo().join("bench/sdpa_ceiling.py"))
            .args(["--device", "cpu", "--tiny", "--iters", "2"])
            .output()
            .unwrap(),
    );
    let row = out
        .lines()
        .find(|l| l.starts_with("| tiny") && l.contains("| math |"))
        .unwrap_or_else(|| panic!("no math row:\n{out}"));
    // forward ms and TFLOP/s, backward ms and TFLOP/s: all measured, all positive.
    let cells: Vec<f64> = row
        .split('|')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    assert_eq!(cells.len(), 4, "{row}");
    assert!(cells.iter().all(|&x| x > 0.0), "{row}");
}

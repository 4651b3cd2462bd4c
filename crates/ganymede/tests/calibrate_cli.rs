//! `ganymede calibrate`: quick, and what it writes is a cluster file the planner accepts.

mod util;
use util::{fails, ganymede, ok, TempDir};

#[test]
fn calibrate_quickly_writes_a_cluster_file_plan_accepts() {
    let tmp = TempDir::new("calibrate");
    let file = tmp.path().join("cal.toml");
    let t = std::time::Instant::now();
    let out = ok(ganymede(
        tmp.path(),
        &["calibrate", "--quick", "--out", file.to_str().unwrap()],
        &[],
    ));
    // A few seconds quiet (--quick: about one); generous for a loaded machine.
    assert!(t.elapsed().as_secs_f64() < 30.0, "{:?}", t.elapsed());
    assert!(
        out.contains("GEMM GFLOP/s") && out.contains("wrote"),
        "{out}"
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("[cpu]") && text.contains("gemm_one_thread"),
        "{text}"
    );

    for ranks in ["1", "4"] {
        let json = ok(ganymede(
            tmp.path(),
            &[
                "plan",
                "--preset",
                "tiny",
                "--dp-shard",
                ranks,
                "--cluster",
                file.to_str().unwrap(),
                "--json",
            ],
            &[],
        ));
        let p: serde_json::Value = serde_json::from_str(&json).unwrap();
        let step = p["step_time_s"].as_f64().unwrap();
        assert!(step > 0.0 && step.is_finite(), "{step}");
        assert_eq!(p["cluster"], "local-calibrated");
        // Threads default to all cores, so ranks as threads share them: the share is the
        // rank count.
        assert_eq!(
            p["time"]["cpu"]["share"].as_f64().unwrap(),
            ranks.parse::<f64>().unwrap()
        );
    }

    // A bad value names the file and the key.
    std::fs::write(
        &file,
        text.replace("elementwise_bytes_per_s = ", "elementwise_bytes_per_s = -"),
    )
    .unwrap();
    let e = fails(ganymede(
        tmp.path(),
        &[
            "plan",
            "--preset",
            "tiny",
            "--cluster",
            file.to_str().unwrap(),
        ],
        &[],
    ));
    assert!(
        e.contains("cal.toml") && e.contains("cpu.elementwise_bytes_per_s"),
        "{e}"
    );
}

/// `calibrate --device` measures through the backend seam (here the CPU backend's two-memory
/// mode at small sizes; on a GPU, `--device cuda`) and writes `--base` with a `[gpu_measured]`
/// section that `plan --cluster FILE` prices the step by.
#[test]
fn device_calibration_writes_a_measured_section_plan_uses() {
    let tmp = TempDir::new("calibrate-device");
    let file = tmp.path().join("gpu.toml");
    let out = ok(ganymede(
        tmp.path(),
        &[
            "calibrate",
            "--device",
            "cpu-two-memory",
            "--out",
            file.to_str().unwrap(),
        ],
        &[],
    ));
    assert!(
        out.contains("GEMM TFLOP/s") && out.contains("Newton-Schulz"),
        "{out}"
    );
    let text = std::fs::read_to_string(&file).unwrap();
    for key in [
        "[gpu_measured]",
        "gemm_bf16",
        "gemm_grouped",
        "attention",
        "newton_schulz",
        "d2h_bytes_per_s",
        "[sources]",
    ] {
        assert!(text.contains(key), "{key}: {text}");
    }
    let plan = |cluster: &str| -> serde_json::Value {
        let json = ok(ganymede(
            tmp.path(),
            &["plan", "--preset", "medium", "--cluster", cluster, "--json"],
            &[],
        ));
        serde_json::from_str(&json).unwrap()
    };
    let measured = plan(file.to_str().unwrap());
    let assumed = plan("dgx-h200");
    assert_eq!(measured["cluster"], "dgx-h200-measured");
    assert!(measured["time"]["measured"]
        .as_str()
        .unwrap()
        .contains("two-memory"));
    assert!(assumed["time"].get("measured").is_none());
    // The CPU's measured rates are thousands of times below an H200's assumed ones: a plan
    // that ignored them would predict the H200's step.
    let (m, a) = (
        measured["step_time_s"].as_f64().unwrap(),
        assumed["step_time_s"].as_f64().unwrap(),
    );
    assert!(m > 100.0 * a, "measured {m} s vs assumed {a} s");
    // Memory is the base cluster's: the same peak.
    assert_eq!(
        measured["memory"]["gpu_total"],
        assumed["memory"]["gpu_total"]
    );
    let inputs = measured["inputs"].as_array().unwrap();
    let gm: Vec<_> = inputs
        .iter()
        .filter(|i| i["key"].as_str().unwrap().starts_with("gpu_measured."))
        .collect();
    assert!(gm.len() >= 7 && gm.iter().all(|i| i["kind"] == "measured"));
    // An unknown device is refused by name.
    let e = fails(ganymede(
        tmp.path(),
        &[
            "calibrate",
            "--device",
            "tpu",
            "--out",
            tmp.path().join("x.toml").to_str().unwrap(),
        ],
        &[],
    ));
    assert!(e.contains("\"tpu\"") && e.contains("cpu-two-memory"), "{e}");
}

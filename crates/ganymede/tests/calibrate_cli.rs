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

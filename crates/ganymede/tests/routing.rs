//! Routing collapse through the binary: a run without any balancing collapses onto a few experts
//! and says so, naming the layer and the keys to change; a run with the default balancing does
//! not warn.

mod util;

use util::{ganymede, ok, TempDir};

fn run(tmp: &TempDir, name: &str, extra: &[&str]) -> String {
    let out = tmp.path().join(name);
    let mut args = vec![
        "train",
        "--steps",
        "100",
        "--set",
        "data.builtin_bytes=400000",
        "--set",
        "checkpoint.enable=false",
    ];
    args.extend(extra);
    args.extend(["--out", out.to_str().unwrap()]);
    ok(ganymede(tmp.path(), &args, &[]))
}

#[test]
fn collapsed_routing_warns_once_per_layer_and_balanced_routing_does_not() {
    let tmp = TempDir::new("routing");
    let collapsed = run(
        &tmp,
        "collapsed",
        &[
            "--set",
            "model.aux_loss_coef=0",
            "--set",
            "model.router_bias_update=0",
        ],
    );
    let warnings: Vec<&str> = collapsed
        .lines()
        .filter(|l| l.starts_with("warning: routing collapse"))
        .collect();
    // tiny has two MoE layers; each warns at most once.
    assert!(!warnings.is_empty(), "no warning:\n{collapsed}");
    assert!(warnings.len() <= 2, "{warnings:?}");
    for w in &warnings {
        assert!(w.contains("layer "), "{w}");
        assert!(w.contains("model.aux_loss_coef"), "{w}");
        assert!(w.contains("model.router_bias_update"), "{w}");
    }

    let balanced = run(&tmp, "balanced", &[]);
    assert!(!balanced.contains("warning"), "{balanced}");
    // Per-expert loads reach metrics.jsonl at validation steps only.
    let metrics = std::fs::read_to_string(tmp.path().join("balanced/metrics.jsonl")).unwrap();
    let with_loads: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v.get("expert_load").is_some())
        .collect();
    assert_eq!(with_loads.len(), 2, "val_every = 50 in 100 steps");
    for v in &with_loads {
        assert!(v.get("val_loss").is_some());
        let layers = v["expert_load"].as_array().unwrap();
        assert_eq!(layers.len(), 2);
        for l in layers {
            let loads: Vec<f64> = l
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(loads.len(), 8);
            assert!((loads.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{loads:?}");
        }
    }
}

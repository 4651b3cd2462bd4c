//! Time by phase (`metrics.phase_times`, `phase_ms` in `metrics.jsonl`): on the CPU backend
//! the phases are wall-clock intervals between marks, so each step's phases fit in its measured
//! time and cover most of it; a dense model spends nothing on experts or a router; a sharded run
//! spends time communicating; and the switch turns it all off.

mod common;

use common::tiny;
use ganymede_config::JobConfig;
use ganymede_train::trainer::{train, TrainOptions};
use serde_json::Value;

/// `metrics.jsonl`'s lines of `cfg` on `ranks` thread ranks.
fn lines(cfg: &JobConfig, ranks: usize, name: &str) -> Vec<Value> {
    let out = ganymede_train::scratch::run_dir("gm-phases", name);
    let opts = TrainOptions {
        ranks,
        out: Some(out.clone()),
        quiet: true,
        ..Default::default()
    };
    train(cfg, None, &opts).unwrap();
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    std::fs::remove_dir_all(&out).unwrap();
    lines
}

const PHASES: [&str; 8] = [
    "head",
    "attention",
    "dense",
    "router",
    "experts",
    "elementwise",
    "optimizer",
    "communication",
];

/// Each line's phase milliseconds by name, checked against its step time: no more than it, and
/// at least `cover` of it.
fn phases(lines: &[Value], cover: f64) -> Vec<Vec<(String, f64)>> {
    lines
        .iter()
        .map(|l| {
            let p = l["phase_ms"].as_object().expect("phase_ms on every line");
            let named: Vec<(String, f64)> = PHASES
                .iter()
                .map(|&k| (k.to_string(), p[k].as_f64().expect(k)))
                .collect();
            assert_eq!(p.len(), PHASES.len(), "{p:?}");
            let sum: f64 = named.iter().map(|x| x.1).sum();
            let step_ms = l["step_s"].as_f64().unwrap() * 1e3;
            let step = &l["step"];
            assert!(
                sum <= step_ms,
                "step {step}: phases {sum} ms over the step's {step_ms} ms: {p:?}"
            );
            assert!(
                sum >= cover * step_ms,
                "step {step}: phases {sum} ms cover less than {cover} of {step_ms} ms: {p:?}"
            );
            assert!(l["phase_marks"].as_u64().unwrap() > 0);
            named
        })
        .collect()
}

fn ms(step: &[(String, f64)], name: &str) -> f64 {
    step.iter().find(|x| x.0 == name).unwrap().1
}

#[test]
fn phases_cover_the_step_and_follow_the_model() {
    let moe = lines(&tiny(3, &["optimizer.name=adamw"]), 1, "moe");
    let dense = lines(
        &tiny(
            3,
            &[
                "optimizer.name=adamw",
                "model.dense_layers=2",
                "model.dense_hidden=128",
            ],
        ),
        1,
        "dense",
    );
    for (label, lines) in [("moe", &moe), ("dense", &dense)] {
        for step in phases(lines, 0.8) {
            for p in ["head", "attention", "dense", "elementwise", "optimizer"] {
                assert!(ms(&step, p) > 0.0, "{label}: no {p} time: {step:?}");
            }
            let routed = ms(&step, "experts") + ms(&step, "router");
            match label {
                "moe" => assert!(
                    ms(&step, "experts") > 0.0 && ms(&step, "router") > 0.0,
                    "{step:?}"
                ),
                _ => assert_eq!(routed, 0.0, "a dense model routed: {step:?}"),
            }
        }
    }
    // A MoE step marks more (router and experts stages) than a dense one.
    let marks = |l: &[Value]| l[1]["phase_marks"].as_u64().unwrap();
    assert!(
        marks(&moe) > marks(&dense),
        "{} {}",
        marks(&moe),
        marks(&dense)
    );
}

#[test]
fn a_sharded_run_times_its_communication() {
    let lines = lines(&tiny(2, &[]), 2, "fsdp2");
    for step in phases(&lines, 0.8) {
        assert!(ms(&step, "communication") > 0.0, "{step:?}");
        assert!(ms(&step, "experts") > 0.0, "{step:?}");
    }
}

#[test]
fn the_switch_turns_phase_times_off() {
    let lines = lines(&tiny(2, &["metrics.phase_times=false"]), 1, "off");
    for l in &lines {
        assert!(
            l.get("phase_ms").is_none() && l.get("phase_marks").is_none(),
            "{l}"
        );
    }
}

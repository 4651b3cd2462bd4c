use super::*;

/// Every element opened is closed in order (void `meta` aside), and the document is one `html`.
/// Returns the element names in document order.
pub fn check_balanced(html: &str) -> Vec<String> {
    let body = html
        .strip_prefix("<!DOCTYPE html>\n")
        .expect("doctype first");
    let mut stack: Vec<String> = vec![];
    let mut names = vec![];
    let mut rest = body;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest.find('>').expect("tag closed");
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().unwrap_or_else(|| panic!("stray </{name}>"));
            assert_eq!(open, name, "</{name}> closes <{open}>");
            continue;
        }
        let name: String = tag
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        assert!(!name.is_empty(), "bad tag <{tag}>");
        names.push(name.clone());
        if !(tag.ends_with('/') || name == "meta") {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
    assert_eq!(names.first().map(String::as_str), Some("html"));
    names
}

fn temp_run(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ganymede-report-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

/// A sharded-looking run: every optional input present.
fn full_run() -> PathBuf {
    full_run_in("full")
}

fn full_run_in(tag: &str) -> PathBuf {
    let d = temp_run(tag);
    let mut text = String::new();
    for step in 1..=20u64 {
        let s = step as f64;
        let mut v = serde_json::json!({
            "step": step,
            "loss": 6.0 - 0.1 * s,
            "lr": 1e-3 * s / 20.0,
            "grad_norm": 2.0 / s,
            "tokens_per_s": 1000.0 + s,
            "tokens_per_s_avg": 1000.0,
            "tokens_seen": 512 * step,
            "step_s": 0.5,
            "ranks": 4,
            "load_max_over_mean": 1.25,
            "load_cv": [0.1, 0.3],
            "comm_bytes": {"forward_gather": {"sent": 3000, "recv": 9000},
                           "grad_reduce_scatter": {"sent": 6000, "recv": 2000}},
            "expert_load": [[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]],
            "ep_rows_over_even": 1.0 + 0.05 * s,
            "ep_regrowths": if step == 7 { 3 } else { 0 },
            // The first step slow (left out of the medians), then 100 ms of the 500 ms
            // step in attention and 50 in experts (medians of 90..110 and 50).
            "phase_ms": if step == 1 {
                serde_json::json!({"attention": 400.0, "experts": 90.0})
            } else {
                serde_json::json!({"attention": 90.0 + (step % 5) as f64 * 5.0, "experts": 50.0})
            },
        });
        if step % 10 == 0 {
            v["val_loss"] = (5.5 - 0.01 * s).into();
        }
        text.push_str(&format!("{v}\n"));
    }
    text.push_str("not json\n");
    fs::write(d.join("metrics.jsonl"), text).unwrap();
    fs::write(
        d.join("memory.json"),
        r#"{"cpu": {"peak_bytes": {"params": 1048576, "activations": 3145728},
                    "final_bytes": {}, "peak_total_bytes": 4194304},
            "planner_predicted_peak_bytes": {"params": 1048576, "activations": 2097152}}"#,
    )
    .unwrap();
    fs::write(
        d.join("config.toml"),
        ganymede_config::preset("tiny").unwrap().to_toml(),
    )
    .unwrap();
    d
}

#[test]
fn a_full_run_has_every_chart_and_its_values() {
    let d = full_run();
    let path = write(&d).unwrap();
    let html = fs::read_to_string(&path).unwrap();
    check_balanced(&html);
    // No network and no script: nothing fetched, nothing run.
    for bad in ["<script", "http://", "https://", "src="] {
        let allowed = "http://www.w3.org/2000/svg";
        assert!(
            !html.replace(allowed, "").contains(bad),
            "{bad} in the page"
        );
    }
    // One SVG per chart, each inside its figure.
    let ids = [
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time",
        "phase_ms",
        "load_max",
        "load_cv",
        "ep_rows",
        "expert_load",
        "memory",
        "comm",
    ];
    assert_eq!(html.matches("<svg").count(), ids.len());
    assert_eq!(html.matches("<figure class=\"chart\"").count(), ids.len());
    for id in ids {
        assert!(html.contains(&format!("id=\"{id}\"")), "chart {id} missing");
    }
    // Values: 20 train-loss points, 2 validation points, final numbers in the summary.
    assert!(html.contains(r#"data-name="train loss" data-points="20""#));
    assert!(html.contains(r#"data-name="validation loss" data-points="2""#));
    assert!(html.contains("<td>4.0000</td>"), "final loss 6 - 2");
    assert!(html.contains("5.3000 (step 20)"));
    assert!(html.contains("0.5000 s"), "median step time");
    // Per-layer load CV lines and the heatmap's 2 x 4 cells, the skewed one titled.
    assert!(html.contains(r#"data-name="layer 1""#));
    assert_eq!(html.matches("class=\"cell\"").count(), 8);
    assert!(html.contains("layer 1, expert 0: 0.7000 (2.80x mean)"));
    // Time by phase: medians without the first step, shares of the 500 ms step.
    assert!(html.contains("<td>attention</td><td>100.000</td><td>20.0%</td>"));
    assert!(html.contains("<td>experts</td><td>50.000</td><td>10.0%</td>"));
    assert!(html.contains("<td>all phases</td><td>150.000</td><td>30.0%</td>"));
    assert!(html.contains(r#"data-name="attention" data-points="20""#));
    // Memory: measured against the planner, per category.
    assert!(html.contains("<td>activations</td><td>3.0 MiB</td><td>2.0 MiB</td>"));
    // Communication: mean bytes per step per phase.
    assert!(html.contains("<td>forward_gather</td><td>2.9 KiB</td><td>8.8 KiB</td>"));
    // Expert parallelism: the routing against the config's capacity, and the growth named.
    assert!(html.contains(r#"data-name="rank 0, most / even" data-points="20""#));
    assert!(html.contains(r#"data-name="capacity factor" data-points="20""#));
    assert!(html.contains("grew past the planned capacity at step 7 (3 times)"));
    // The configuration, escaped, and a planner prediction for it.
    assert!(html.contains("[model]"));
    assert!(html.contains("step time, planner (cluster local)"));
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_calibrated_cluster_in_the_run_directory_replaces_the_preset() {
    let d = full_run_in("calibrated");
    let preset = ganymede_plan::Cluster::preset("local").unwrap();
    // The same machine, GEMMs and attention ten times slower: a longer prediction.
    let mut slow = preset.clone();
    let cpu = slow.cpu.as_mut().unwrap();
    for p in cpu.gemm.iter_mut().chain(cpu.gemm_one_thread.iter_mut()) {
        p[1] /= 10.0;
    }
    for a in cpu.attention.iter_mut() {
        (a[1], a[2]) = (a[1] / 10.0, a[2] / 10.0);
    }
    let run = Run::load(&d).unwrap();
    let before = predicted_step_s(&run).unwrap();
    fs::write(d.join("cluster.toml"), slow.to_toml()).unwrap();
    let after = predicted_step_s(&run).unwrap();
    assert!(after > 3.0 * before, "{after} vs {before}");
    let html = fs::read_to_string(write(&d).unwrap()).unwrap();
    assert!(html.contains("step time, planner (cluster RUN/cluster.toml)"));
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_bare_run_renders_with_notes_for_what_is_missing() {
    let d = temp_run("bare");
    fs::write(
        d.join("metrics.jsonl"),
        "{\"step\":1,\"loss\":3.5}\n{\"step\":2,\"loss\":3.25}\n",
    )
    .unwrap();
    let html = render(&Run::load(&d).unwrap());
    check_balanced(&html);
    assert_eq!(html.matches("<svg").count(), 1, "only the loss chart");
    for id in ["lr-missing", "expert_load-missing", "memory-missing"] {
        assert!(html.contains(id), "{id}");
    }
    assert!(!html.contains("Communication"));
    assert!(
        !html.contains("phase-table"),
        "no phase table without phase_ms"
    );
    assert!(
        !html.contains("ep_rows"),
        "no expert-parallel chart without its metrics"
    );
    assert!(html.contains("no config.toml"));
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn not_a_run_directory_is_named() {
    let d = temp_run("empty");
    let e = write(&d).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl"), "{e}");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn step_times_come_from_tokens_when_step_s_is_absent() {
    let d = temp_run("tokens");
    fs::write(
        d.join("metrics.jsonl"),
        "{\"step\":1,\"tokens_seen\":1000,\"tokens_per_s\":500}\n{\"step\":2,\"tokens_seen\":2000,\"tokens_per_s\":250}\n",
    )
    .unwrap();
    let r = Run::load(&d).unwrap();
    assert_eq!(r.step_times(), vec![(1.0, 2.0), (2.0, 4.0)]);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_two_memory_run_shows_each_memory_beside_its_prediction() {
    let d = temp_run("two-memory");
    fs::write(d.join("metrics.jsonl"), "{\"step\":1,\"loss\":3.5}\n").unwrap();
    fs::write(
        d.join("memory.json"),
        r#"{"gpu0": {"peak_bytes": {"params": 1048576, "optimizer": 0},
                     "final_bytes": {}, "peak_total_bytes": 1048576,
                     "planner_peak_bytes": {"params": 1048576, "optimizer": 0}},
            "host": {"peak_bytes": {"optimizer": 3145728},
                     "final_bytes": {}, "peak_total_bytes": 3145728,
                     "planner_peak_bytes": {"params": 0, "optimizer": 2097152}}}"#,
    )
    .unwrap();
    let html = render(&Run::load(&d).unwrap());
    check_balanced(&html);
    // Columns: gpu0 measured, host measured, gpu0 planner, host planner.
    assert!(html.contains("<th>gpu0 planner</th><th>host planner</th>"));
    assert!(
        html.contains("<td>optimizer</td><td>0 B</td><td>3.0 MiB</td><td>0 B</td><td>2.0 MiB</td>")
    );
    fs::remove_dir_all(&d).unwrap();
}

//! `ganymede report` on fresh runs: the README's first command (one process) and a 4-rank run.
//! Structural checks here; `scripts/report_browser_check.sh` loads the page in headless
//! Chromium where it is installed.

mod util;
use util::{ganymede, ok, TempDir};

fn report_of(run: &std::path::Path) -> String {
    let tmp = run.parent().unwrap();
    let out = ok(ganymede(tmp, &["report", run.to_str().unwrap()], &[]));
    let page = run.join("report.html");
    assert_eq!(out.trim(), page.display().to_string());
    std::fs::read_to_string(page).unwrap()
}

fn steps_in(run: &std::path::Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count()
}

#[test]
fn report_of_a_single_process_and_a_four_rank_run() {
    let tmp = TempDir::new("report");
    let one = tmp.path().join("one");
    ok(ganymede(
        tmp.path(),
        &["train", "--steps", "12", "--out", one.to_str().unwrap()],
        &[],
    ));
    let html = report_of(&one);
    assert!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
    assert!(!html.contains("<script"));
    for id in [
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "load_cv",
        "memory",
    ] {
        assert!(html.contains(&format!("id=\"{id}\"")), "chart {id}");
    }
    let n = steps_in(&one);
    assert!(html.contains(&format!("data-name=\"train loss\" data-points=\"{n}\"")));
    assert!(!html.contains("id=\"comm\""), "one process sends nothing");
    assert!(html.contains("planner"), "memory against the planner");

    let four = tmp.path().join("four");
    ok(ganymede(
        tmp.path(),
        &[
            "train",
            "--ranks",
            "4",
            "--steps",
            "6",
            "--out",
            four.to_str().unwrap(),
        ],
        &[],
    ));
    let html = report_of(&four);
    assert!(html.contains("id=\"comm\""), "bytes per phase");
    assert!(html.contains("<td>grad_reduce_scatter</td>"));
    assert!(html.contains("<th>ranks</th><td>4</td>"));
}

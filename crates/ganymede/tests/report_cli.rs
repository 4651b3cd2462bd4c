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
        "phase_ms",
    ] {
        assert!(html.contains(&format!("id=\"{id}\"")), "chart {id}");
    }
    let n = steps_in(&one);
    assert!(html.contains(&format!("data-name=\"train loss\" data-points=\"{n}\"")));
    assert!(!html.contains("id=\"comm\""), "one process sends nothing");
    assert!(html.contains("planner"), "memory against the planner");
    // Time by phase: the table has the model's phases (a MoE model: experts too).
    for phase in ["attention", "experts", "optimizer"] {
        assert!(
            html.contains(&format!("<tr><td>{phase}</td>")),
            "phase {phase}"
        );
    }

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
    assert!(
        html.contains("<tr><td>communication</td>"),
        "four ranks communicate"
    );
}

#[test]
fn the_report_reads_overlap_from_the_trace() {
    // Four ranks with activation offload on the two-memory mode: communication on every rank,
    // and to-host and from-host copies, each with the share of it hidden behind compute.
    let tmp = TempDir::new("report-trace");
    let run = tmp.path().join("run");
    let trace = tmp.path().join("elsewhere.json");
    ok(ganymede(
        tmp.path(),
        &[
            "train",
            "--ranks",
            "4",
            "--steps",
            "3",
            "--out",
            run.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--set",
            "device.kind=cpu-two-memory",
            "--set",
            "activation_checkpoint.offload_fraction=1",
        ],
        &[],
    ));
    // Without the trace there is no overlap section; given it, one row per rank.
    assert!(!report_of(&run).contains("overlap-table"));
    let out = ok(ganymede(
        tmp.path(),
        &[
            "report",
            run.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ],
        &[],
    ));
    assert_eq!(out.trim(), run.join("report.html").display().to_string());
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    let table = &html[html.find("id=\"overlap-table\"").expect("overlap table")..];
    let table = &table[..table.find("</table>").unwrap()];
    assert_eq!(table.matches("<tr><td>").count(), 4, "{table}");
    // Every rank communicated and copied: no idle mark in its row's busy columns, and shares
    // are percentages.
    for row in table.split("<tr><td>").skip(1) {
        let cells: Vec<&str> = row.split("</td><td>").collect();
        assert_eq!(cells.len(), 8, "{row}");
        for busy in [1, 4, 6] {
            let v: f64 = cells[busy]
                .strip_suffix(" ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("not a duration: {row}"));
            assert!(v > 0.0, "{row}");
        }
        for share in [2, 5, 7] {
            let pct = cells[share]
                .trim_end_matches("</td></tr>\n")
                .trim_end_matches('%');
            let v: f64 = pct.parse().unwrap_or_else(|_| panic!("{row}"));
            assert!((0.0..=100.0).contains(&v), "{row}");
        }
    }
    // A missing trace file is named.
    let e = util::fails(ganymede(
        tmp.path(),
        &["report", run.to_str().unwrap(), "--trace", "nope.json"],
        &[],
    ));
    assert!(e.contains("nope.json"), "{e}");
}

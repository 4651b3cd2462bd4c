//! `ganymede report RUN`: one self-contained HTML page (no network, no script) of a run
//! directory: loss, learning rate, gradient norm, throughput and expert balance over steps;
//! step time by phase (attention, experts, ...); memory by category against the planner; bytes
//! per communication phase for sharded runs; step time against the planner; the resolved
//! configuration.
//!
//! Every input but `metrics.jsonl` is optional, and so is every key of its lines but `step`:
//! a chart whose data is absent is left out with a note saying so.

pub mod overlap;
mod svg;

use anyhow::{bail, Context, Result};
use ganymede_core::sample::median;
use serde_json::Value;
use std::fmt::Write;
use std::fs;
use std::path::{Path, PathBuf};
use svg::{escape, Series};

/// What a run directory holds, read leniently.
pub struct Run {
    pub dir: PathBuf,
    /// `metrics.jsonl`, one object per line (unparsable lines skipped).
    pub lines: Vec<Value>,
    pub memory: Option<Value>,
    pub config_text: Option<String>,
    /// A Chrome trace of the run (`ganymede train --trace`): `RUN/trace.json` if present, or
    /// the file given to [`write_with_trace`].
    pub trace: Option<Value>,
}

impl Run {
    pub fn load(dir: &Path) -> Result<Run> {
        let metrics = dir.join("metrics.jsonl");
        let text = fs::read_to_string(&metrics).with_context(|| {
            format!(
                "cannot read {} (is {} a run directory?)",
                metrics.display(),
                dir.display()
            )
        })?;
        let lines: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v.get("step").and_then(Value::as_f64).is_some())
            .collect();
        if lines.is_empty() {
            bail!("{} holds no metrics lines", metrics.display());
        }
        let memory = fs::read_to_string(dir.join("memory.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let config_text = fs::read_to_string(dir.join("config.toml")).ok();
        let trace = fs::read_to_string(dir.join("trace.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        Ok(Run {
            dir: dir.to_path_buf(),
            lines,
            memory,
            config_text,
            trace,
        })
    }

    /// (step, value) for every line carrying a number at `key`.
    pub fn series(&self, key: &str) -> Vec<(f64, f64)> {
        self.lines
            .iter()
            .filter_map(|l| Some((l["step"].as_f64()?, l.get(key)?.as_f64()?)))
            .collect()
    }

    /// Seconds per step: `step_s` where the line has it, else the tokens the step added over
    /// its tokens/s.
    pub fn step_times(&self) -> Vec<(f64, f64)> {
        let mut prev_tokens = 0.0;
        let mut out = vec![];
        for l in &self.lines {
            let step = l["step"].as_f64().unwrap_or(0.0);
            let seen = l.get("tokens_seen").and_then(Value::as_f64);
            let t = l.get("step_s").and_then(Value::as_f64).or_else(|| {
                let tps = l.get("tokens_per_s").and_then(Value::as_f64)?;
                let added = seen? - prev_tokens;
                (tps > 0.0 && added > 0.0).then(|| added / tps)
            });
            if let Some(s) = seen {
                prev_tokens = s;
            }
            if let Some(t) = t {
                out.push((step, t));
            }
        }
        out
    }
}

fn gib(b: f64) -> String {
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

/// Which cluster [`predicted_step_s`] used, for labels.
fn planner_cluster(run: &Run) -> &'static str {
    if run.dir.join("cluster.toml").exists() {
        "RUN/cluster.toml"
    } else {
        "local"
    }
}

/// The planner's step time for the run's own config on the `local` cluster, with the layout
/// the run used (its `[parallelism]` degree as the GPU count). A calibrated cluster file in the
/// run directory (`ganymede calibrate --out RUN/cluster.toml`, measured under the run's load)
/// replaces the preset.
fn predicted_step_s(run: &Run) -> Option<f64> {
    let config_text = run.config_text.as_deref()?;
    let job = ganymede_config::JobConfig::from_toml_str(config_text, "config.toml").ok()?;
    let file = run.dir.join("cluster.toml");
    let cluster = if file.exists() {
        ganymede_plan::Cluster::from_file(&file).ok()?
    } else {
        ganymede_plan::Cluster::preset("local").ok()?
    };
    let layout = ganymede_plan::Layout::from_job(&job, &cluster);
    let policy = ganymede_plan::MemoryPolicy::from_job(&job);
    let opt = ganymede_plan::OptimizerSetup::from_job(&job);
    ganymede_plan::plan(&job, &cluster, &layout, &policy, &opt)
        .ok()
        .map(|p| p.step_time_s)
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;max-width:1360px;color:#222}\
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ccc}\
.grid{display:flex;flex-wrap:wrap;gap:12px}figure.chart{margin:0;border:1px solid #eee;padding:6px}\
figcaption{font-size:13px;font-weight:600}table{border-collapse:collapse;font-size:13px}\
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4}\
td:first-child,th:first-child{text-align:left}pre{background:#f7f7f7;padding:8px;font-size:12px;overflow:auto}\
.note{color:#777;font-size:13px}";

/// The whole page.
pub fn render(run: &Run) -> String {
    let mut h = String::new();
    let name = run.dir.file_name().map_or_else(
        || run.dir.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>ganymede report: {n}</title><style>{STYLE}</style></head><body>\n<h1>ganymede report: {n}</h1>\n",
        n = escape(&name)
    );
    summary(&mut h, run);
    training_charts(&mut h, run);
    phase_section(&mut h, run);
    balance_charts(&mut h, run);
    memory_section(&mut h, run);
    comm_section(&mut h, run);
    overlap_section(&mut h, run);
    h.push_str("<h2>Configuration</h2>\n");
    match &run.config_text {
        Some(c) => {
            let _ = writeln!(h, "<pre id=\"config\">{}</pre>", escape(c));
        }
        None => h.push_str("<p class=\"note\">no config.toml in this run</p>\n"),
    }
    h.push_str("</body></html>\n");
    h
}

fn summary(h: &mut String, run: &Run) {
    let last = run.lines.last().expect("at least one line");
    let get = |k: &str| last.get(k).and_then(Value::as_f64);
    let val = run.series("val_loss");
    let times: Vec<f64> = run.step_times().into_iter().map(|p| p.1).collect();
    // The first step warms caches and allocators; leave it out when there are others.
    let measured = median(&times[usize::from(times.len() > 1)..]);
    let predicted = predicted_step_s(run);
    h.push_str("<h2>Summary</h2>\n<table id=\"summary\">\n");
    let mut row = |k: &str, v: String| {
        let _ = writeln!(h, "<tr><th>{}</th><td>{}</td></tr>", escape(k), escape(&v));
    };
    row("run directory", run.dir.display().to_string());
    row("steps", format!("{}", get("step").unwrap_or(0.0)));
    if let Some(r) = get("ranks") {
        row("ranks", format!("{r}"));
    }
    if let Some(l) = get("loss") {
        row("final loss", format!("{l:.4}"));
    }
    if let Some(&(s, v)) = val.last() {
        row("final validation loss", format!("{v:.4} (step {s})"));
    }
    if let Some(t) = get("tokens_seen") {
        row("tokens seen", format!("{t:.0}"));
    }
    if let Some(m) = measured {
        row("step time, measured (median)", format!("{m:.4} s"));
    }
    match (predicted, measured) {
        (Some(p), Some(m)) => row(
            &format!("step time, planner (cluster {})", planner_cluster(run)),
            format!("{p:.4} s (measured / predicted = {:.2})", m / p),
        ),
        (Some(p), None) => row(
            &format!("step time, planner (cluster {})", planner_cluster(run)),
            format!("{p:.4} s"),
        ),
        _ => {}
    }
    h.push_str("</table>\n");
}

fn chart_or_note(h: &mut String, id: &str, title: &str, series: Vec<Series>) {
    let series: Vec<Series> = series
        .into_iter()
        .filter(|s| !s.points.is_empty())
        .collect();
    if series.is_empty() {
        let _ = writeln!(
            h,
            "<p class=\"note\" id=\"{id}-missing\">{}: not in this run's metrics</p>",
            escape(title)
        );
    } else {
        h.push_str(&svg::line_chart(id, title, "step", &series));
    }
}

fn named(name: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        name: name.into(),
        points,
    }
}

fn training_charts(h: &mut String, run: &Run) {
    h.push_str("<h2>Training</h2>\n<div class=\"grid\">\n");
    chart_or_note(
        h,
        "loss",
        "Loss",
        vec![
            named("train loss", run.series("loss")),
            named("validation loss", run.series("val_loss")),
        ],
    );
    chart_or_note(
        h,
        "lr",
        "Learning rate",
        vec![named("lr", run.series("lr"))],
    );
    chart_or_note(
        h,
        "grad_norm",
        "Gradient norm (before clipping)",
        vec![named("grad norm", run.series("grad_norm"))],
    );
    chart_or_note(
        h,
        "tokens_per_s",
        "Tokens/s",
        vec![
            named("tokens/s", run.series("tokens_per_s")),
            named("running mean", run.series("tokens_per_s_avg")),
        ],
    );
    let mut st = vec![named("measured", run.step_times())];
    if let Some(p) = predicted_step_s(run) {
        let steps: Vec<f64> = run
            .lines
            .iter()
            .filter_map(|l| l["step"].as_f64())
            .collect();
        st.push(named(
            "planner (local)",
            steps.iter().map(|&s| (s, p)).collect(),
        ));
    }
    chart_or_note(h, "step_time", "Step time (s)", st);
    h.push_str("</div>\n");
}

/// Time by phase (`phase_ms`, `metrics.phase_times`): each phase's median milliseconds per step
/// and its share of the median step (the first step left out when there are others: it warms
/// caches and allocators), and each phase over the steps.
fn phase_section(h: &mut String, run: &Run) {
    let lines: Vec<(f64, &serde_json::Map<String, Value>)> = run
        .lines
        .iter()
        .filter_map(|l| Some((l["step"].as_f64()?, l.get("phase_ms")?.as_object()?)))
        .collect();
    if lines.is_empty() {
        return;
    }
    // The seam's phases in their order, then any others a line names.
    let mut names: Vec<String> = ganymede_core::StepPhase::ALL
        .iter()
        .map(|p| p.name().to_string())
        .filter(|n| lines.iter().any(|(_, m)| m.contains_key(n)))
        .collect();
    for (_, m) in &lines {
        for k in m.keys() {
            if !names.contains(k) {
                names.push(k.clone());
            }
        }
    }
    let skip = usize::from(lines.len() > 1);
    let steps: Vec<f64> = lines[skip..].iter().map(|l| l.0).collect();
    let step_ms = median(
        &run.step_times()
            .into_iter()
            .filter(|(s, _)| steps.contains(s))
            .map(|(_, t)| t * 1e3)
            .collect::<Vec<_>>(),
    );
    let of = |name: &str, from: usize| -> Vec<(f64, f64)> {
        lines[from..]
            .iter()
            .filter_map(|(s, m)| Some((*s, m.get(name)?.as_f64()?)))
            .collect()
    };
    h.push_str("<h2>Time by phase (rank 0)</h2>\n");
    h.push_str(
        "<p class=\"note\">Each step's time between phase marks: wall clock on the CPU, \
         events on the compute stream on a GPU (where a step's last intervals, its update, \
         are read at the next step's end). Medians over the steps",
    );
    h.push_str(if skip == 1 {
        " after the first.</p>\n"
    } else {
        ".</p>\n"
    });
    h.push_str(
        "<table id=\"phase-table\"><tr><th>phase</th><th>median ms per step</th>\
         <th>share of the step</th></tr>\n",
    );
    let share = |ms: f64| match step_ms {
        Some(st) if st > 0.0 => format!("{:.1}%", 100.0 * ms / st),
        _ => "–".to_string(),
    };
    let mut total = 0.0;
    for n in &names {
        let vals: Vec<f64> = of(n, skip).into_iter().map(|p| p.1).collect();
        let Some(ms) = median(&vals) else { continue };
        total += ms;
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{ms:.3}</td><td>{}</td></tr>",
            escape(n),
            share(ms)
        );
    }
    let _ = writeln!(
        h,
        "<tr><td>all phases</td><td>{total:.3}</td><td>{}</td></tr>",
        share(total)
    );
    if let Some(st) = step_ms {
        let _ = writeln!(h, "<tr><td>step</td><td>{st:.3}</td><td>100%</td></tr>");
    }
    h.push_str("</table>\n<div class=\"grid\">\n");
    let series = names.iter().map(|n| named(n, of(n, 0))).collect();
    chart_or_note(h, "phase_ms", "Time by phase (ms per step)", series);
    h.push_str("</div>\n");
}

fn balance_charts(h: &mut String, run: &Run) {
    h.push_str("<h2>Expert load balance</h2>\n<div class=\"grid\">\n");
    chart_or_note(
        h,
        "load_max",
        "Busiest expert over the mean, worst layer",
        vec![named("max/mean", run.series("load_max_over_mean"))],
    );
    let layers = run
        .lines
        .iter()
        .filter_map(|l| l.get("load_cv")?.as_array().map(Vec::len))
        .max()
        .unwrap_or(0);
    let cv: Vec<Series> = (0..layers)
        .map(|i| {
            let pts = run
                .lines
                .iter()
                .filter_map(|l| Some((l["step"].as_f64()?, l.get("load_cv")?.get(i)?.as_f64()?)))
                .collect();
            named(&format!("layer {i}"), pts)
        })
        .collect();
    chart_or_note(
        h,
        "load_cv",
        "Coefficient of variation of expert loads, per layer",
        cv,
    );
    ep_rows_chart(h, run);
    // The latest per-layer per-expert loads, where the lines carry them.
    let loads = run.lines.iter().rev().find_map(|l| {
        let rows: Vec<Vec<f64>> = l
            .get("expert_load")?
            .as_array()?
            .iter()
            .map(|r| {
                r.as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default()
            })
            .collect();
        Some((l["step"].as_f64().unwrap_or(0.0), rows))
    });
    match loads {
        Some((step, rows)) => h.push_str(&svg::heatmap(
            "expert_load",
            &format!("Expert load per layer at step {step}"),
            &rows,
        )),
        None => h.push_str(
            "<p class=\"note\" id=\"expert_load-missing\">per-expert loads (expert_load) are not in this run's metrics</p>\n",
        ),
    }
    h.push_str("</div>\n");
}

/// Expert-parallel runs only: how close the routing came to the dispatch buffers' capacity
/// (`ep_rows_over_even` against `parallelism.ep_capacity_factor`), and the steps that grew them.
fn ep_rows_chart(h: &mut String, run: &Run) {
    let rows = run.series("ep_rows_over_even");
    if rows.is_empty() {
        return;
    }
    let mut series = vec![named("rank 0, most / even", rows.clone())];
    let factor = run.config_text.as_deref().and_then(|t| {
        ganymede_config::JobConfig::from_toml_str(t, "config.toml")
            .ok()
            .map(|j| j.parallelism.ep_capacity_factor)
    });
    if let Some(f) = factor {
        series.push(named(
            "capacity factor",
            rows.iter().map(|&(s, _)| (s, f)).collect(),
        ));
    }
    h.push_str(&svg::line_chart(
        "ep_rows",
        "Expert parallelism: most rows a layer sent rank 0, over an even routing's",
        "step",
        &series,
    ));
    let grew: Vec<(f64, f64)> = run
        .series("ep_regrowths")
        .into_iter()
        .filter(|&(_, n)| n > 0.0)
        .collect();
    let text = if grew.is_empty() {
        "the dispatch buffers never grew: the capacity held the routing".to_string()
    } else {
        let steps: Vec<String> = grew
            .iter()
            .map(|(s, n)| format!("step {s} ({n} times)"))
            .collect();
        format!(
            "the dispatch buffers grew past the planned capacity at {} (summed over ranks)",
            steps.join(", ")
        )
    };
    let _ = writeln!(
        h,
        "<p class=\"note\" id=\"ep_regrowths\">{}</p>",
        escape(&text)
    );
}

fn memory_section(h: &mut String, run: &Run) {
    h.push_str("<h2>Memory</h2>\n");
    let Some(Value::Object(mem)) = &run.memory else {
        h.push_str("<p class=\"note\" id=\"memory-missing\">no memory.json in this run</p>\n");
        return;
    };
    let predicted = mem
        .get("planner_predicted_peak_bytes")
        .and_then(Value::as_object);
    let devices: Vec<(&String, &Value)> = mem
        .iter()
        .filter(|(k, v)| *k != "planner_predicted_peak_bytes" && v.get("peak_bytes").is_some())
        .collect();
    let mut cats: Vec<String> = vec![];
    for (_, d) in &devices {
        for k in d["peak_bytes"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|x| x.0)
        {
            if !cats.contains(k) {
                cats.push(k.clone());
            }
        }
    }
    let mut groups: Vec<(String, Vec<f64>)> = devices
        .iter()
        .map(|(name, d)| {
            let vals = cats
                .iter()
                .map(|c| d["peak_bytes"][c.as_str()].as_f64().unwrap_or(0.0))
                .collect();
            (format!("{name} measured"), vals)
        })
        .collect();
    // The prediction: one set for a one-memory run, else one per device.
    let planned: Vec<(String, &serde_json::Map<String, Value>)> = match predicted {
        Some(p) => vec![("planner".into(), p)],
        None => devices
            .iter()
            .filter_map(|(name, d)| {
                let p = d.get("planner_peak_bytes")?.as_object()?;
                Some((format!("{name} planner"), p))
            })
            .collect(),
    };
    for (label, p) in planned {
        let vals = cats
            .iter()
            .map(|c| p.get(c.as_str()).and_then(Value::as_f64).unwrap_or(0.0))
            .collect();
        groups.push((label, vals));
    }
    h.push_str(&svg::bar_chart(
        "memory",
        "Peak bytes by category",
        &cats,
        &groups,
        gib,
    ));
    h.push_str("<table id=\"memory-table\"><tr><th>category</th>");
    for (g, _) in &groups {
        let _ = write!(h, "<th>{}</th>", escape(g));
    }
    h.push_str("</tr>\n");
    for (i, c) in cats.iter().enumerate() {
        let _ = write!(h, "<tr><td>{}</td>", escape(c));
        for (_, v) in &groups {
            let _ = write!(h, "<td>{}</td>", gib(v[i]));
        }
        h.push_str("</tr>\n");
    }
    for (name, d) in &devices {
        if let Some(t) = d.get("peak_total_bytes").and_then(Value::as_f64) {
            let _ = writeln!(
                h,
                "<tr><td>peak total, {}</td><td colspan=\"{}\">{}</td></tr>",
                escape(name),
                groups.len(),
                gib(t)
            );
        }
    }
    h.push_str("</table>\n");
}

fn comm_section(h: &mut String, run: &Run) {
    // Mean bytes per step by phase, over the lines that carry `comm_bytes`.
    let mut phases: Vec<String> = vec![];
    let mut sums: Vec<(f64, f64)> = vec![];
    let mut n = 0usize;
    for l in &run.lines {
        let Some(m) = l.get("comm_bytes").and_then(Value::as_object) else {
            continue;
        };
        n += 1;
        for (p, v) in m {
            let i = phases.iter().position(|x| x == p).unwrap_or_else(|| {
                phases.push(p.clone());
                sums.push((0.0, 0.0));
                phases.len() - 1
            });
            sums[i].0 += v.get("sent").and_then(Value::as_f64).unwrap_or(0.0);
            sums[i].1 += v.get("recv").and_then(Value::as_f64).unwrap_or(0.0);
        }
    }
    if n == 0 {
        return; // a single-process run communicates nothing
    }
    h.push_str("<h2>Communication (rank 0, mean per step)</h2>\n");
    let nf = n as f64;
    let groups = vec![
        ("sent".to_string(), sums.iter().map(|s| s.0 / nf).collect()),
        (
            "received".to_string(),
            sums.iter().map(|s| s.1 / nf).collect(),
        ),
    ];
    h.push_str(&svg::bar_chart(
        "comm",
        "Bytes per step by phase",
        &phases,
        &groups,
        gib,
    ));
    h.push_str("<table id=\"comm-table\"><tr><th>phase</th><th>sent</th><th>received</th></tr>\n");
    for (p, (s, r)) in phases.iter().zip(&sums) {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(p),
            gib(s / nf),
            gib(r / nf)
        );
    }
    h.push_str("</table>\n");
}

/// The share of communication and offload copying hidden behind compute, per rank, from the
/// run's trace.
fn overlap_section(h: &mut String, run: &Run) {
    let Some(doc) = &run.trace else {
        return;
    };
    let ranks = overlap::from_trace(doc);
    if ranks.is_empty() {
        return;
    }
    h.push_str("<h2>Overlap with compute (from the trace)</h2>\n");
    h.push_str(
        "<p class=\"note\">Time each track was busy over the traced steps, and the share of it \
         during which compute ran too (hidden: it cost no step time). Waiting is time blocked \
         on a collective: communication that was not hidden.</p>\n",
    );
    h.push_str(
        "<table id=\"overlap-table\"><tr><th>rank</th><th>communication</th><th>hidden</th>\
         <th>waiting</th><th>to-host copies</th><th>hidden</th><th>from-host copies</th>\
         <th>hidden</th></tr>\n",
    );
    // Offload copies of small runs take microseconds: keep them visible.
    let ms = |us: f64| {
        if us >= 1e3 {
            format!("{:.1} ms", us / 1e3)
        } else {
            format!("{:.3} ms", us / 1e3)
        }
    };
    let share = |b: &overlap::Busy| {
        b.hidden_share()
            .map_or_else(|| "–".to_string(), |s| format!("{:.0}%", 100.0 * s))
    };
    for r in &ranks {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            r.rank,
            ms(r.comm.busy_us),
            share(&r.comm),
            ms(r.wait_us),
            ms(r.to_host.busy_us),
            share(&r.to_host),
            ms(r.from_host.busy_us),
            share(&r.from_host)
        );
    }
    h.push_str("</table>\n");
}

/// Write `RUN/report.html` and return its path.
pub fn write(dir: &Path) -> Result<PathBuf> {
    write_with_trace(dir, None)
}

/// [`write`], reading the run's trace from `trace` (default: `RUN/trace.json` if present).
pub fn write_with_trace(dir: &Path, trace: Option<&Path>) -> Result<PathBuf> {
    let mut run = Run::load(dir)?;
    if let Some(t) = trace {
        let text =
            fs::read_to_string(t).with_context(|| format!("cannot read trace {}", t.display()))?;
        run.trace = Some(
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not a Chrome trace (JSON)", t.display()))?,
        );
    }
    let path = dir.join("report.html");
    fs::write(&path, render(&run)).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests;

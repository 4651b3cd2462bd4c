//! Per-step metrics (`metrics.jsonl`), expert-load statistics, progress display and the memory
//! report.

use anyhow::{Context, Result};
use ganymede_core::{Category, Device, LedgerReport};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::fs;
use std::io::{IsTerminal, Write};
use std::path::Path;

use crate::tensorboard::{self, EventWriter};

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// Steps completed (1 for the first step).
    pub step: usize,
    pub loss: f64,
    /// Unscaled Switch auxiliary loss (mean over MoE layers).
    pub aux_loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    /// Mean tokens/s over the steps run so far in this process (steps only, no validation).
    pub tokens_per_s_avg: f64,
    pub tokens_seen: u64,
    pub elapsed_s: f64,
    /// Seconds of this step (validation and checkpoints excluded).
    pub step_s: f64,
    /// Worst layer's busiest-expert load over the mean load (1 = perfectly balanced).
    pub load_max_over_mean: f64,
    /// Per MoE layer: coefficient of variation of the expert loads (0 = perfectly balanced).
    pub load_cv: Vec<f64>,
    /// Mean validation loss; with several data sources, their losses weighted by the mixture.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Per data source, `val_loss/<source>` (prepared sources only; on validation steps).
    #[serde(flatten)]
    pub val_loss_by_source: std::collections::BTreeMap<String, f64>,
    /// World size (1: one process).
    pub ranks: usize,
    /// Sharded runs: rank 0's bytes per phase in this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_bytes: Option<serde_json::Value>,
    /// Sharded runs: rank 0's bytes and calls per phase and collective kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<serde_json::Value>,
    /// Expert parallelism: the most rows one layer's experts received on any rank in the step,
    /// over an even routing's (1 = even; the buffers hold `parallelism.ep_capacity_factor`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ep_rows_over_even: Option<f64>,
    /// Expert parallelism: times in the step that a rank's dispatch buffers grew (all ranks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ep_regrowths: Option<u64>,
    /// Per MoE layer, each expert's share of the step's top-k assignments; written on
    /// validation steps only, so a report can draw the loads without bloating every line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<Vec<f32>>>,
    /// Rank 0's milliseconds per phase of the step (`metrics.phase_times`), by phase name:
    /// head, attention, dense, router, experts, elementwise, optimizer, communication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_ms: Option<std::collections::BTreeMap<&'static str, f64>>,
    /// Marks (phase changes, each an event on a GPU) the step's phase clock took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_marks: Option<u32>,
}

/// The end-of-run line of time by phase: each phase's median milliseconds per step and its
/// share of the median step (`step_s`, seconds), the first step left out when there are others
/// (it warms caches and allocators). `None` without phase times.
pub fn phase_summary(steps: &[ganymede_core::PhaseTimes], step_s: &[f64]) -> Option<String> {
    use ganymede_core::sample::median;
    let skip = usize::from(steps.len() > 1);
    let steps = steps.get(skip..).filter(|s| !s.is_empty())?;
    let step_ms = median(step_s.get(skip..).unwrap_or_default()).map(|s| s * 1e3);
    let marks = median(&steps.iter().map(|t| f64::from(t.marks)).collect::<Vec<_>>())?;
    let mut parts = vec![];
    for p in ganymede_core::StepPhase::ALL {
        let ms = median(&steps.iter().map(|t| t.get(p)).collect::<Vec<_>>())?;
        // What would print as 0.0 (a world of one's no-op collectives, say) is left out.
        if ms < 0.05 {
            continue;
        }
        parts.push(match step_ms {
            Some(step) if step > 0.0 => {
                format!("{} {ms:.1} ({:.0}%)", p.name(), 100.0 * ms / step)
            }
            _ => format!("{} {ms:.1}", p.name()),
        });
    }
    Some(format!(
        "time by phase, median ms per step{}: {} ({marks:.0} marks a step)",
        step_ms.map_or(String::new(), |s| format!(" of {s:.1}")),
        parts.join(", ")
    ))
}

/// `phase_ms` of a step's phase times.
pub fn phase_ms(t: &ganymede_core::PhaseTimes) -> std::collections::BTreeMap<&'static str, f64> {
    t.named().collect()
}

/// (max over layers of max/mean, per-layer coefficient of variation) of expert loads.
pub fn load_balance(expert_load: &[Vec<f32>]) -> (f64, Vec<f64>) {
    let mut worst = 0.0f64;
    let mut cvs = Vec::with_capacity(expert_load.len());
    for layer in expert_load {
        if layer.is_empty() {
            continue;
        }
        let n = layer.len() as f64;
        let mean = layer.iter().map(|&x| x as f64).sum::<f64>() / n;
        if mean <= 0.0 {
            cvs.push(0.0);
            continue;
        }
        let max = layer.iter().map(|&x| x as f64).fold(f64::MIN, f64::max);
        let var = layer
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        worst = worst.max(max / mean);
        cvs.push(var.sqrt() / mean);
    }
    (worst, cvs)
}

/// Appends one JSON object per step to `metrics.jsonl`, and with `metrics.tensorboard` its
/// numeric values to a TensorBoard event file under `RUN/tb/`.
/// Notices a dead run: the loss pinned at ln(vocab_size), the uniform prediction's loss, while
/// the gradient norm has vanished, for [`Self::WINDOW`] steps in a row. A fresh model starts
/// near ln(vocab_size) too, but with a healthy gradient (about 2.6 for `tiny`); a run blown up
/// by too high a learning rate sits there with a gradient norm of 1e-34 and never leaves.
#[derive(Clone, Debug)]
pub struct DeadWatch {
    ln_vocab: f64,
    streak: usize,
}

impl DeadWatch {
    pub const WINDOW: usize = 3;
    /// A gradient norm below this is vanished (healthy runs are many orders above).
    pub const GRAD_NORM: f64 = 1e-6;
    /// Relative distance from ln(vocab_size) that counts as pinned there.
    pub const LOSS_TOL: f64 = 1e-3;

    pub fn new(vocab_size: usize) -> Self {
        DeadWatch {
            ln_vocab: (vocab_size as f64).ln(),
            streak: 0,
        }
    }

    /// Record a step; a message once the run has been dead for the window (and at every step
    /// after, so a caller that stops can stop at once).
    pub fn observe(&mut self, step: usize, loss: f64, grad_norm: f64) -> Option<String> {
        let pinned = (loss - self.ln_vocab).abs() <= Self::LOSS_TOL * self.ln_vocab;
        if pinned && grad_norm < Self::GRAD_NORM {
            self.streak += 1;
        } else {
            self.streak = 0;
        }
        (self.streak >= Self::WINDOW).then(|| {
            format!(
                "the run is dead at step {step}: the loss has been ln(vocab_size) = {:.4} (uniform predictions) with a gradient norm below {:.0e} for {} steps (now {grad_norm:.1e}); a lower optimizer.lr usually avoids it",
                self.ln_vocab,
                Self::GRAD_NORM,
                self.streak
            )
        })
    }
}

/// Notices a loss spike: a step's loss above `factor` times the median of the previous steps'
/// (the last [`Self::WINDOW`]), once there are [`Self::MIN_HISTORY`] of them. A median, unlike a
/// mean, is not dragged up by the spikes themselves. Says so when a spike begins, not at every
/// step of it.
#[derive(Clone, Debug)]
pub struct SpikeWatch {
    factor: f64,
    history: std::collections::VecDeque<f64>,
    in_spike: bool,
}

impl SpikeWatch {
    pub const WINDOW: usize = 50;
    pub const MIN_HISTORY: usize = 10;

    /// `factor` 0: never.
    pub fn new(factor: f64) -> Self {
        SpikeWatch {
            factor,
            history: Default::default(),
            in_spike: false,
        }
    }

    pub fn observe(&mut self, step: usize, loss: f64) -> Option<String> {
        let mut msg = None;
        if self.factor > 0.0 && self.history.len() >= Self::MIN_HISTORY {
            let mut sorted: Vec<f64> = self.history.iter().copied().collect();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            let spike = loss > self.factor * median;
            if spike && !self.in_spike {
                msg = Some(format!(
                    "warning: loss spike at step {step}: {loss:.4} is {:.1}x the median of the previous {} steps ({median:.4}; metrics.spike_factor = {})",
                    loss / median,
                    sorted.len(),
                    self.factor
                ));
            }
            self.in_spike = spike;
        }
        self.history.push_back(loss);
        if self.history.len() > Self::WINDOW {
            self.history.pop_front();
        }
        msg
    }
}

/// Watches for routing collapse: an MoE layer whose busiest expert takes more than `threshold`
/// times the mean load for `window` consecutive steps. Each layer warns at most once, so a long
/// collapsed run says it once instead of flooding the log.
#[derive(Clone, Debug)]
pub struct CollapseWatch {
    threshold: f64,
    window: usize,
    /// Model layer index of each MoE layer, in the order of a step's `expert_load`.
    layers: Vec<usize>,
    /// Consecutive steps each MoE layer has been above the threshold.
    streak: Vec<usize>,
    warned: Vec<bool>,
    aux_loss_coef: f64,
    router_bias_update: f64,
}

impl CollapseWatch {
    /// Busiest expert over the mean load above which a step counts as collapsed: with top-k
    /// routing a balanced layer sits near 1; 2 means one expert does the work of two.
    pub const THRESHOLD: f64 = 2.0;
    /// Steps a layer must stay above the threshold before it warns, for long runs.
    pub const WINDOW: usize = 50;

    /// A watch for `model` in a run of `steps` steps. The window is [`Self::WINDOW`] steps, or a
    /// quarter of a shorter run but at least 25 steps, so a short run can still warn while the
    /// first steps cannot: balanced `tiny` runs were seen above 2x for up to 13 steps in a row
    /// early on, while collapsed ones stay above it from about step 5 to the end.
    pub fn for_run(model: &ganymede_config::ModelConfig, steps: usize) -> Self {
        let layers = (0..model.layers)
            .filter(|&l| model.is_moe_layer(l))
            .collect();
        let window = (steps / 4).clamp(25, Self::WINDOW);
        Self::new(layers, Self::THRESHOLD, window)
            .with_settings(model.aux_loss_coef, model.router_bias_update)
    }

    /// `layers`: the model layer index of each MoE layer, in `expert_load` order.
    pub fn new(layers: Vec<usize>, threshold: f64, window: usize) -> Self {
        let n = layers.len();
        Self {
            threshold,
            window: window.max(1),
            layers,
            streak: vec![0; n],
            warned: vec![false; n],
            aux_loss_coef: 0.0,
            router_bias_update: 0.0,
        }
    }

    /// The balancing settings the warning quotes, so the user sees what to raise from.
    pub fn with_settings(mut self, aux_loss_coef: f64, router_bias_update: f64) -> Self {
        self.aux_loss_coef = aux_loss_coef;
        self.router_bias_update = router_bias_update;
        self
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// Feed step `step`'s per-MoE-layer expert loads; returns a warning for each layer whose
    /// collapse has just lasted `window` steps (never twice for a layer).
    pub fn observe(&mut self, step: usize, expert_load: &[Vec<f32>]) -> Vec<String> {
        let mut out = vec![];
        for (i, load) in expert_load.iter().enumerate().take(self.layers.len()) {
            let ratio = max_over_mean(load);
            if ratio > self.threshold {
                self.streak[i] += 1;
            } else {
                self.streak[i] = 0;
            }
            if self.streak[i] >= self.window && !self.warned[i] {
                self.warned[i] = true;
                out.push(format!(
                    "warning: routing collapse in layer {}: its busiest expert has taken more than {:.1}x the mean load for {} consecutive steps (step {step}: {ratio:.2}x); raise model.aux_loss_coef (now {}) or model.router_bias_update (now {})",
                    self.layers[i], self.threshold, self.window, self.aux_loss_coef, self.router_bias_update
                ));
            }
        }
        out
    }
}

/// Busiest expert's load over the mean load of one layer (0 for an empty or idle layer).
fn max_over_mean(load: &[f32]) -> f64 {
    let mean = load.iter().map(|&x| x as f64).sum::<f64>() / load.len().max(1) as f64;
    if mean <= 0.0 {
        return 0.0;
    }
    load.iter().map(|&x| x as f64).fold(0.0, f64::max) / mean
}

/// Appends one JSON object per step to `metrics.jsonl`.
pub struct MetricsWriter {
    file: fs::File,
    tensorboard: Option<EventWriter>,
}

impl MetricsWriter {
    /// Open `path` for appending; lines for steps after `keep_up_to` (a resumed run redoing
    /// them) are dropped first, so the file reads as one continuous run.
    ///
    /// TensorBoard output follows the run's own resolved `config.toml` beside `path`
    /// (`metrics.tensorboard = true` writes under `tb/` there), so every loop that keeps a
    /// run directory gets it without passing the setting down.
    pub fn open(path: &Path, keep_up_to: usize) -> Result<Self> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let tb = tensorboard_enabled(&dir.join("config.toml"))?.then(|| dir.join("tb"));
        Self::open_with(path, keep_up_to, tb.as_deref())
    }

    /// [`open`](Self::open) with the TensorBoard directory given (`None`: no event files).
    pub fn open_with(path: &Path, keep_up_to: usize, tensorboard: Option<&Path>) -> Result<Self> {
        if path.exists() {
            let text = fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| s as usize <= keep_up_to)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            fs::write(path, kept).with_context(|| format!("cannot write {}", path.display()))?;
        }
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let tensorboard = tensorboard.map(EventWriter::create).transpose()?;
        Ok(Self { file, tensorboard })
    }

    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m)?;
        writeln!(self.file, "{line}")?;
        if let Some(tb) = &mut self.tensorboard {
            // Whatever numbers the line carries, so new metrics need no change here.
            tb.scalars(
                m.step as i64,
                &tensorboard::scalars_of(&serde_json::to_value(m)?),
            )?;
        }
        Ok(())
    }

    /// The TensorBoard event file being written, if any.
    pub fn tensorboard_file(&self) -> Option<&Path> {
        self.tensorboard.as_ref().map(|t| t.path())
    }
}

/// `metrics.tensorboard` of a resolved config file; false when there is no such file.
fn tensorboard_enabled(config: &Path) -> Result<bool> {
    let Ok(text) = fs::read_to_string(config) else {
        return Ok(false);
    };
    let v: toml::Value =
        toml::from_str(&text).with_context(|| format!("cannot parse {}", config.display()))?;
    Ok(v.get("metrics")
        .and_then(|m| m.get("tensorboard"))
        .and_then(|t| t.as_bool())
        .unwrap_or(false))
}

/// How progress is shown: a bar on a terminal, log lines otherwise, or nothing.
pub enum Progress {
    Bar(ProgressBar),
    Lines { every: usize },
    Quiet,
}

impl Progress {
    pub fn new(start: usize, total: usize, log_every: usize, quiet: bool) -> Self {
        if quiet {
            return Progress::Quiet;
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {pos}/{len} {msg} [{elapsed_precise} < {eta}]",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_position(start as u64);
            bar.reset_eta();
            Progress::Bar(bar)
        } else {
            Progress::Lines {
                every: log_every.max(1),
            }
        }
    }

    pub fn step(&self, m: &StepMetrics, total: usize) {
        match self {
            Progress::Bar(bar) => {
                let mut msg = format!("loss {:.4} | {:.0} tok/s", m.loss, m.tokens_per_s_avg);
                if let Some(v) = m.val_loss {
                    msg.push_str(&format!(" | val {v:.4}"));
                }
                bar.set_message(msg);
                bar.set_position(m.step as u64);
            }
            Progress::Lines { every } => {
                if m.step.is_multiple_of(*every)
                    || m.step == total
                    || m.step == 1
                    || m.val_loss.is_some()
                {
                    let mut line = format!(
                        "step {:>6}/{total} | loss {:.4} | aux {:.4} | lr {:.2e} | grad_norm {:.3} | {:.0} tok/s | load max/mean {:.2}",
                        m.step, m.loss, m.aux_loss, m.lr, m.grad_norm, m.tokens_per_s_avg, m.load_max_over_mean
                    );
                    if let Some(v) = m.val_loss {
                        line.push_str(&format!(" | val_loss {v:.4}"));
                    }
                    println!("{line}");
                }
            }
            Progress::Quiet => {}
        }
    }

    /// A message that must not be torn by the bar.
    pub fn println(&self, msg: &str) {
        match self {
            Progress::Bar(bar) => bar.println(msg),
            Progress::Lines { .. } => println!("{msg}"),
            Progress::Quiet => {}
        }
    }

    pub fn finish(&self) {
        if let Progress::Bar(bar) = self {
            bar.finish();
        }
    }
}

/// The planner's predicted peak bytes per memory and category, and of each memory's total,
/// to print beside the measured ones.
#[derive(Clone, Debug, Default)]
pub struct Predicted {
    pub categories: Vec<(Device, Category, u64)>,
    pub totals: Vec<(Device, u64)>,
}

impl Predicted {
    fn total(&self, dev: Device) -> u64 {
        self.totals
            .iter()
            .find(|(d, _)| *d == dev)
            .map_or(0, |(_, b)| *b)
    }
}

const CATEGORIES: [Category; 5] = [
    Category::Params,
    Category::Grads,
    Category::Optimizer,
    Category::Activations,
    Category::Buffers,
];

fn predicted_on(p: &Predicted, dev: Device) -> impl Iterator<Item = (Category, u64)> + '_ {
    p.categories
        .iter()
        .filter(move |(d, _, _)| *d == dev)
        .map(|&(_, c, b)| (c, b))
}

/// Devices measured or predicted, in ledger order.
fn devices(report: &LedgerReport, predicted: Option<&Predicted>) -> Vec<Device> {
    let mut devs: Vec<Device> = report.device_peaks.iter().map(|(d, _)| *d).collect();
    for &(d, _, b) in predicted.iter().flat_map(|p| &p.categories) {
        if b > 0 && !devs.contains(&d) {
            devs.push(d);
        }
    }
    devs.sort();
    devs
}

/// `memory.json`: per device, the ledger's peak (and final) bytes per category, the peak of
/// the total, and the planner's prediction of both (`planner_peak_bytes`,
/// `planner_peak_total_bytes`). A one-memory run also keeps the prediction at the top level
/// (`planner_predicted_peak_bytes`), where earlier runs have it.
pub fn memory_json(report: &LedgerReport, predicted: Option<&Predicted>) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for dev in devices(report, predicted) {
        let mut peak = serde_json::Map::new();
        let mut current = serde_json::Map::new();
        for e in report.entries.iter().filter(|e| e.device == dev) {
            peak.insert(e.category.name().into(), e.peak.into());
            current.insert(e.category.name().into(), e.current.into());
        }
        let total_peak = report
            .device_peaks
            .iter()
            .find(|(d, _)| *d == dev)
            .map_or(0, |(_, b)| *b);
        let mut entry = serde_json::json!({
            "peak_bytes": peak,
            "final_bytes": current,
            "peak_total_bytes": total_peak,
        });
        if let Some(p) = predicted {
            let m: serde_json::Map<String, serde_json::Value> = predicted_on(p, dev)
                .map(|(c, b)| (c.name().to_string(), b.into()))
                .collect();
            entry["planner_peak_bytes"] = m.into();
            entry["planner_peak_total_bytes"] = p.total(dev).into();
        }
        out.insert(dev.to_string(), entry);
    }
    if let Some(p) = predicted.filter(|p| p.categories.iter().all(|(d, _, _)| *d == Device::Host)) {
        let m: serde_json::Map<String, serde_json::Value> = predicted_on(p, Device::Host)
            .map(|(c, b)| (c.name().to_string(), b.into()))
            .collect();
        out.insert("planner_predicted_peak_bytes".into(), m.into());
    }
    serde_json::Value::Object(out)
}

/// The memory table printed at the end of a run.
pub fn memory_table(report: &LedgerReport, predicted: Option<&Predicted>) -> String {
    let mut s = format!(
        "memory, peak per category{}\n",
        if predicted.is_some() {
            " (measured | planner)"
        } else {
            ""
        }
    );
    for dev in devices(report, predicted) {
        // A category's prediction, or with `None` the memory's peak total.
        let pred = |c: Option<Category>| {
            predicted.map_or(String::new(), |p| {
                let b: u64 = match c {
                    Some(c) => predicted_on(p, dev)
                        .filter(|(pc, _)| *pc == c)
                        .map(|(_, b)| b)
                        .sum(),
                    None => p.total(dev),
                };
                format!(" | {:>10}", human_bytes(b))
            })
        };
        for c in CATEGORIES {
            s.push_str(&format!(
                "  {:<6} {:<12} {:>10}{}\n",
                dev.to_string(),
                c.name(),
                human_bytes(report.peak(dev, c)),
                pred(Some(c))
            ));
        }
        let total_peak = report
            .device_peaks
            .iter()
            .find(|(d, _)| *d == dev)
            .map_or(0, |(_, b)| *b);
        s.push_str(&format!(
            "  {:<6} {:<12} {:>10}{}\n",
            dev.to_string(),
            "peak total",
            human_bytes(total_peak),
            pred(None)
        ));
    }
    s
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_summary_takes_medians_without_the_first_step() {
        use ganymede_core::{PhaseTimes, StepPhase};
        let step = |attn: f64, opt: f64| {
            let mut t = PhaseTimes {
                marks: 30,
                ..Default::default()
            };
            t.add(StepPhase::Attention, attn);
            t.add(StepPhase::Optimizer, opt);
            t
        };
        // The first step (slow) is left out; medians of the other three.
        let mut steps = [
            step(500.0, 90.0),
            step(30.0, 9.0),
            step(40.0, 10.0),
            step(20.0, 11.0),
        ];
        // A phase that rounds to 0.0 ms (a world of one's collectives) is left out.
        for s in &mut steps {
            s.add(StepPhase::Communication, 0.01);
        }
        let line = phase_summary(&steps, &[1.0, 0.08, 0.1, 0.09]).unwrap();
        assert_eq!(
            line,
            "time by phase, median ms per step of 90.0: attention 30.0 (33%), optimizer 10.0 \
             (11%) (30 marks a step)"
        );
        assert_eq!(phase_summary(&[], &[]), None);
    }

    #[test]
    fn balance_statistics() {
        let (worst, cv) = load_balance(&[vec![0.25; 4], vec![0.5, 0.5, 0.0, 0.0]]);
        assert!((worst - 2.0).abs() < 1e-9);
        assert_eq!(cv[0], 0.0);
        assert!((cv[1] - 1.0).abs() < 1e-9);
    }

    /// Layer loads: `hot` is the busiest expert's multiple of the mean, over 8 experts.
    fn loads(hot: f32) -> Vec<f32> {
        let mean = 1.0 / 8.0;
        let rest = (1.0 - hot * mean) / 7.0;
        let mut l = vec![rest; 8];
        l[3] = hot * mean;
        l
    }

    #[test]
    fn collapse_watch_warns_once_after_a_sustained_window() {
        // Model layers 1 and 2 are MoE (layer 0 dense); only the second collapses.
        let mut w = CollapseWatch::new(vec![1, 2], 2.0, 5).with_settings(0.0, 0.0);
        for step in 1..=4 {
            assert!(w.observe(step, &[loads(1.1), loads(3.0)]).is_empty());
        }
        let warn = w.observe(5, &[loads(1.1), loads(3.0)]);
        assert_eq!(warn.len(), 1, "{warn:?}");
        assert!(warn[0].contains("layer 2"), "{}", warn[0]);
        assert!(warn[0].contains("model.aux_loss_coef"), "{}", warn[0]);
        assert!(warn[0].contains("model.router_bias_update"), "{}", warn[0]);
        // Once per layer, however long the collapse lasts.
        for step in 6..=30 {
            assert!(w.observe(step, &[loads(1.1), loads(3.0)]).is_empty());
        }
    }

    #[test]
    fn collapse_watch_needs_consecutive_steps() {
        let mut w = CollapseWatch::new(vec![0], 2.0, 5);
        // Four collapsed steps, one balanced, repeated: never five in a row.
        for step in 1..=50 {
            let hot = if step % 5 == 0 { 1.5 } else { 2.5 };
            assert!(w.observe(step, &[loads(hot)]).is_empty(), "step {step}");
        }
        // Exactly at the threshold is not above it.
        for step in 51..=100 {
            assert!(w.observe(step, &[loads(2.0)]).is_empty());
        }
        let warned: Vec<_> = (101..=105)
            .flat_map(|s| w.observe(s, &[loads(2.1)]))
            .collect();
        assert_eq!(warned.len(), 1);
    }

    #[test]
    fn collapse_window_scales_with_short_runs() {
        let m = ganymede_config::preset("tiny").unwrap().model;
        assert_eq!(CollapseWatch::for_run(&m, 600).window(), 50);
        assert_eq!(CollapseWatch::for_run(&m, 100).window(), 25);
        assert_eq!(CollapseWatch::for_run(&m, 8).window(), 25);
    }

    #[test]
    fn resumed_metrics_drop_redone_steps() {
        let p = std::env::temp_dir().join(format!("ganymede-metrics-{}.jsonl", std::process::id()));
        fs::write(&p, "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n").unwrap();
        drop(MetricsWriter::open(&p, 2).unwrap());
        assert_eq!(
            fs::read_to_string(&p).unwrap(),
            "{\"step\":1}\n{\"step\":2}\n"
        );
        fs::remove_file(&p).unwrap();
    }
}

//! What the loop records of each step: rank 0's metrics line, progress and warnings, and every
//! rank's watch for a dead run.

use super::Run;
use crate::metrics::{
    self, CollapseWatch, DeadWatch, MetricsWriter, Progress, SpikeWatch, StepMetrics,
};
use anyhow::{bail, Result};
use ganymede_config::DeadCheck;
use ganymede_parallel::StepReport;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// A validation's mean loss and, with prepared sources, each one's (`val_loss/<name>`).
pub(super) type Validation = (f64, BTreeMap<String, f64>);

/// One rank's log of the run's steps. Only rank 0 writes (`writer`); every rank keeps the
/// dead-run watch, whose decision must be the same everywhere.
pub(super) struct StepLog {
    writer: Option<MetricsWriter>,
    pub(super) progress: Progress,
    ranks: usize,
    total: usize,
    run_start: Instant,
    /// Tokens and seconds of the steps run in this process, for the mean rate (steps only).
    timed_tokens: u64,
    step_secs: f64,
    collapse: CollapseWatch,
    spikes: SpikeWatch,
    dead: DeadWatch,
    dead_warned: bool,
    /// `parallelism.ep_capacity_factor`, named in the regrowth notice.
    ep_capacity_factor: f64,
    dead_check: DeadCheck,
}

impl StepLog {
    /// Rank 0 (`writer`) appends to `RUN/metrics.jsonl`, without the steps from `start` on
    /// that a resumed run redoes. `run_start` is when the rank began (its `elapsed_s` zero).
    pub(super) fn open(
        run: &Run,
        start: usize,
        ranks: usize,
        run_start: Instant,
        writer: bool,
    ) -> Result<Self> {
        let (cfg, total) = (&run.cfg, run.cfg.training.steps);
        let writer = writer
            .then(|| MetricsWriter::open(&run.run_dir.join("metrics.jsonl"), start))
            .transpose()?;
        let quiet = run.opts.quiet || writer.is_none();
        Ok(StepLog {
            ep_capacity_factor: cfg.parallelism.ep_capacity_factor,
            dead_check: cfg.metrics.dead_check,
            progress: Progress::new(start, total, cfg.metrics.log_every, quiet),
            writer,
            ranks,
            total,
            run_start,
            timed_tokens: 0,
            step_secs: 0.0,
            collapse: CollapseWatch::for_run(&cfg.model, total),
            spikes: SpikeWatch::new(cfg.metrics.spike_factor),
            dead: DeadWatch::new(cfg.model.vocab_size),
            dead_warned: false,
        })
    }

    pub(super) fn is_writer(&self) -> bool {
        self.writer.is_some()
    }

    /// Completed step `done` (its report `r`, `dt` seconds, the validation if it had one):
    /// counted toward the mean rate, and on rank 0 written, shown, and watched for expert
    /// collapse, loss spikes and expert-buffer regrowths.
    pub(super) fn record(
        &mut self,
        r: &StepReport,
        (done, dt): (usize, f64),
        tokens_seen: u64,
        val: Option<Validation>,
        val_due: bool,
    ) -> Result<()> {
        self.timed_tokens += r.tokens as u64;
        self.step_secs += dt;
        // Only rank 0 writes and shows.
        if !self.is_writer() {
            return Ok(());
        }
        let sm = self.metrics(r, (done, dt), tokens_seen, val, val_due);
        if let Some(w) = &mut self.writer {
            w.write(&sm)?;
        }
        if r.expert_regrowths > 0 {
            self.progress.println(&format!(
                "step {done}: expert-parallel dispatch buffers grew {} time(s) over the ranks: \
                 a layer routed a rank more rows than parallelism.ep_capacity_factor = {} \
                 holds (the most on any rank: {:.2}x an even routing); they allocate until \
                 the factor covers the routing",
                r.expert_regrowths,
                self.ep_capacity_factor,
                sm.ep_rows_over_even.unwrap_or(0.0)
            ));
        }
        for warning in self.collapse.observe(done, &r.expert_load) {
            self.progress.println(&warning);
        }
        if let Some(warning) = self.spikes.observe(done, r.loss) {
            self.progress.println(&warning);
        }
        self.progress.step(&sm, self.total);
        Ok(())
    }

    /// Step `done`'s line of `metrics.jsonl` (the expert loads only on validation steps).
    fn metrics(
        &self,
        r: &StepReport,
        (done, dt): (usize, f64),
        tokens_seen: u64,
        val: Option<Validation>,
        val_due: bool,
    ) -> StepMetrics {
        let (val_loss, val_loss_by_source) = match val {
            Some((v, by)) => (Some(v), by),
            None => (None, Default::default()),
        };
        let n = self.ranks;
        let (load_max_over_mean, load_cv) = metrics::load_balance(&r.expert_load);
        StepMetrics {
            step: done,
            loss: r.loss,
            aux_loss: r.aux_loss,
            lr: r.lr,
            grad_norm: r.grad_norm,
            tokens_per_s: r.tokens as f64 / dt.max(1e-9),
            tokens_per_s_avg: self.timed_tokens as f64 / self.step_secs.max(1e-9),
            tokens_seen,
            elapsed_s: self.run_start.elapsed().as_secs_f64(),
            step_s: dt,
            load_max_over_mean,
            load_cv,
            val_loss,
            val_loss_by_source,
            ranks: n,
            comm_bytes: (n > 1).then(|| r.comm.by_phase_json()),
            comm: (n > 1).then(|| serde_json::json!(r.comm.entries)),
            ep_rows_over_even: r.expert_rows_over_even,
            ep_regrowths: r.expert_rows.map(|_| r.expert_regrowths),
            expert_load: val_due.then(|| r.expert_load.clone()),
            phase_ms: r.phase_times.as_ref().map(metrics::phase_ms),
            phase_marks: r.phase_times.as_ref().map(|t| t.marks),
        }
    }

    /// Stop (or warn, once, on rank 0) when step `done` looks like a dead run, as
    /// `metrics.dead_check` asks. Every rank sees the same loss and gradient norm, so every
    /// rank decides alike. `last_checkpoint` names the one a stop leaves behind.
    pub(super) fn check_dead(
        &mut self,
        done: usize,
        r: &StepReport,
        last_checkpoint: Option<&Path>,
    ) -> Result<()> {
        let Some(msg) = self.dead.observe(done, r.loss, r.grad_norm) else {
            return Ok(());
        };
        match self.dead_check {
            DeadCheck::Stop => bail!(
                "{msg}; stopped before writing a checkpoint of it{} (metrics.dead_check = \"warn\" lets such a run go on)",
                last_checkpoint.map_or(String::new(), |c| format!(
                    " (the last one is {})",
                    c.display()
                ))
            ),
            DeadCheck::Warn if !self.dead_warned && self.writer.is_some() => {
                self.dead_warned = true;
                self.progress.println(&format!("warning: {msg}"));
            }
            _ => {}
        }
        Ok(())
    }
}

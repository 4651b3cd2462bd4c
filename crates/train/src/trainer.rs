//! The training loop and the run directory.
//!
//! ```text
//! RUN/config.toml       the resolved job configuration
//! RUN/metrics.jsonl     one JSON object per step
//! RUN/memory.json       peak bytes per ledger category at the end
//! RUN/data/             tokenised splits (and tokenizer.json) built by the data crate
//! RUN/checkpoints/      see `checkpoint`
//! ```

use crate::checkpoint::{self, CheckpointData, Manifest, Position};
use crate::metrics::{self, CollapseWatch, MetricsWriter, Progress, StepMetrics};
use anyhow::{bail, Context, Result};
use ganymede_config::JobConfig;
use ganymede_core::{Backend, Category, CpuBackend, ParamStore};
use ganymede_data::Dataset;
use ganymede_model::{forward_backward, forward_loss, update_router_bias, Model, Workspace};
use ganymede_optim::{clip_grad_norm, lr_at, Optimizer};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How a run is driven, beyond its configuration.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Run directory; default `runs/<name>-<UTC timestamp>` (or the resumed run's directory).
    pub out: Option<PathBuf>,
    /// Stop (and checkpoint) after this many completed steps, as if interrupted there.
    pub stop_after: Option<usize>,
    /// Name used for the default run directory (the preset).
    pub name: String,
    /// No progress output at all (tests).
    pub quiet: bool,
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub run_dir: PathBuf,
    /// Step the run started from (0, or the resumed checkpoint's step).
    pub start_step: usize,
    pub end_step: usize,
    /// Training loss of each step run here, in order.
    pub losses: Vec<f64>,
    pub final_val_loss: Option<f64>,
    pub tokens_per_s: f64,
    pub checkpoint: Option<PathBuf>,
    /// The corpus's entropy floor in nats per token (built-in corpus only).
    pub entropy_floor: Option<f64>,
}

/// Size rayon's global pool from `training.threads` (0 = all cores). Only the first call in a
/// process takes effect; later runs in the same process share that pool.
pub fn init_threads(threads: usize) {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
}

/// The job configuration for `ganymede train`: from a preset or file (or, when resuming with
/// neither, the checkpoint's own), with overrides and `--steps` applied, validated, and checked
/// against the checkpoint being resumed (naming every key that differs).
pub fn resolve_config(
    preset: Option<&str>,
    file: Option<&Path>,
    overrides: &[String],
    steps: Option<usize>,
    resume: Option<&Path>,
) -> Result<(JobConfig, Option<PathBuf>)> {
    let ckpt = resume.map(checkpoint::resolve).transpose()?;
    let saved = match &ckpt {
        Some(dir) => Some(checkpoint::read_manifest(dir)?.job_config()?),
        None => None,
    };
    let mut cfg = match (&saved, preset, file) {
        (Some(saved), None, None) => saved.with_overrides(overrides)?,
        _ => JobConfig::load(preset, file, overrides)?,
    };
    if let Some(n) = steps {
        cfg.training.steps = n;
    }
    cfg.validate()?;
    if let (Some(saved), Some(dir)) = (&saved, &ckpt) {
        let differing: Vec<String> = checkpoint::config_diff(saved, &cfg)
            .into_iter()
            .filter(|k| !checkpoint::resumable_difference(k))
            .collect();
        if !differing.is_empty() {
            bail!(
                "config does not match checkpoint {}: {} differ ({})",
                dir.display(),
                if differing.len() == 1 {
                    "this key"
                } else {
                    "these keys"
                },
                differing
                    .iter()
                    .map(|k| format!(
                        "{k}: checkpoint {} vs now {}",
                        value_of(saved, k),
                        value_of(&cfg, k)
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    Ok((cfg, ckpt))
}

fn value_of(cfg: &JobConfig, key: &str) -> String {
    let v = toml::Value::try_from(cfg).expect("config serialises");
    let mut cur = &v;
    for part in key.split('.') {
        match cur.get(part) {
            Some(x) => cur = x,
            None => return "(unset)".into(),
        }
    }
    cur.to_string()
}

/// `runs/<name>-YYYYmmdd-HHMMSS` (UTC).
pub fn default_run_dir(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86400, secs % 86400);
    let (y, m, d) = civil_from_days(days as i64);
    PathBuf::from("runs").join(format!(
        "{name}-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    ))
}

/// Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The run directory a checkpoint belongs to (`RUN/checkpoints/step_N` → `RUN`), if any.
fn run_dir_of(ckpt: &Path) -> Option<PathBuf> {
    let parent = ckpt.parent()?;
    (parent.file_name()? == "checkpoints").then(|| parent.parent().map(Path::to_path_buf))?
}

/// Train `cfg` (already resolved and validated; see [`resolve_config`]), from scratch or from
/// the checkpoint `ckpt`.
pub fn train(cfg: &JobConfig, ckpt: Option<&Path>, opts: &TrainOptions) -> Result<TrainSummary> {
    init_threads(cfg.training.threads);
    let run_dir = match (&opts.out, ckpt.and_then(run_dir_of)) {
        (Some(o), _) => o.clone(),
        (None, Some(r)) => r,
        (None, None) => default_run_dir(if opts.name.is_empty() {
            "run"
        } else {
            &opts.name
        }),
    };
    if ckpt.is_none() && !checkpoint::list(&checkpoint::checkpoints_root(&run_dir)).is_empty() {
        bail!(
            "run directory {} already holds checkpoints: continue it with --resume {0}, or pick another --out",
            run_dir.display()
        );
    }
    fs::create_dir_all(&run_dir)
        .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    checkpoint::write_atomic(&run_dir.join("config.toml"), cfg.to_toml().as_bytes())?;

    let (m, t) = (&cfg.model, &cfg.training);
    let (batch, seq, total) = (t.batch_size, m.seq_len, t.steps);
    let data_dir = run_dir.join("data");
    let data = Dataset::build(&cfg.data, m.vocab_size, seq, t.seed, Some(&data_dir))?;

    let be = CpuBackend::default();
    let be: &dyn Backend = &be;
    let model = Model::new(m);
    let mut params = model.init_params(be, t.seed);
    let mut grads = ParamStore::zeros(be, model.param_specs(), Category::Grads);
    let mut opt = Optimizer::new(be, &cfg.optimizer, model.param_specs());
    let mut ws = Workspace::new(be, &model, batch, seq, cfg.activation_checkpoint.mode);

    let mut start = 0;
    let mut tokens_seen = 0u64;
    if let Some(dir) = ckpt {
        let manifest = checkpoint::read_manifest(dir)?;
        checkpoint::load_params(be, dir, &mut params)?;
        checkpoint::load_into(be, &dir.join(checkpoint::OPTIMIZER_FILE), opt.state_mut())?;
        opt.set_step_count(manifest.optimizer_step);
        start = manifest.data.next_step;
        tokens_seen = manifest.tokens_seen;
        if start >= total {
            bail!(
                "checkpoint {} is at step {start}, and training.steps = {total}: nothing left to run (raise --steps)",
                dir.display()
            );
        }
    }
    let end = opts.stop_after.map_or(total, |s| s.clamp(start, total));

    let mut writer = MetricsWriter::open(&run_dir.join("metrics.jsonl"), start)?;
    let progress = Progress::new(start, total, cfg.metrics.log_every, opts.quiet);
    progress.println(&format!(
        "ganymede train: {} parameters, {} on {}, {} threads, run directory {}{}",
        params.numel(),
        format!("{:?}", cfg.optimizer.name).to_lowercase(),
        data.source(),
        rayon::current_num_threads(),
        run_dir.display(),
        if start > 0 {
            format!(", resuming at step {start}")
        } else {
            String::new()
        }
    ));

    let par = &cfg.parallelism;
    if par.dp_shard > 1 || par.ep > 1 {
        progress.println(&format!(
            "note: parallelism.dp_shard = {}, parallelism.ep = {} take effect with `ganymede train --ranks N`; without it the whole batch runs in one process",
            par.dp_shard, par.ep
        ));
    }
    let mut losses = Vec::new();
    let mut final_val = None;
    let mut last_ckpt = None;
    let run_start = Instant::now();
    let mut timed_tokens = 0u64;
    // Seconds spent in training steps proper (validation and checkpoints excluded).
    let mut step_secs = 0.0f64;
    let mut collapse = CollapseWatch::for_run(m, total);
    for step in start..end {
        // One optimizer step; `step` is 0-based, metrics count completed steps.
        let t0 = Instant::now();
        let (inputs, targets) = data.batch(step as u64, batch, seq);
        for g in grads.tensors_mut() {
            be.fill(g.vm(), 0.0);
        }
        let out = forward_backward(
            be, &model, &params, &mut grads, &mut ws, &inputs, &targets, 1.0,
        );
        if !out.loss.is_finite() {
            bail!(
                "loss is {} at step {}: training diverged (try a lower optimizer.lr than {})",
                out.loss,
                step + 1,
                cfg.optimizer.lr
            );
        }
        let grad_norm = clip_grad_norm(be, &mut grads, t.grad_clip);
        let lr = lr_at(&cfg.optimizer, step, total);
        opt.step(be, &mut params, &grads, lr);
        if m.router_bias_update > 0.0 {
            update_router_bias(be, &model, &mut params, &out);
        }
        be.synchronize();
        let dt = t0.elapsed().as_secs_f64();
        step_secs += dt;
        tokens_seen += out.tokens as u64;
        timed_tokens += out.tokens as u64;

        let done = step + 1;
        let val_due = done == end
            || (cfg.metrics.val_every > 0 && done.is_multiple_of(cfg.metrics.val_every));
        let val_loss = val_due.then(|| validate(be, &model, &params, &mut ws, &data, cfg));
        if val_loss.is_some() {
            final_val = val_loss;
        }
        let (load_max_over_mean, load_cv) = metrics::load_balance(&out.expert_load);
        let sm = StepMetrics {
            step: done,
            loss: out.loss,
            aux_loss: out.aux_loss,
            lr,
            grad_norm,
            tokens_per_s: out.tokens as f64 / dt.max(1e-9),
            tokens_per_s_avg: timed_tokens as f64 / step_secs.max(1e-9),
            tokens_seen,
            elapsed_s: run_start.elapsed().as_secs_f64(),
            load_max_over_mean,
            load_cv,
            val_loss,
            expert_load: val_due.then(|| out.expert_load.clone()),
        };
        writer.write(&sm)?;
        for warning in collapse.observe(done, &out.expert_load) {
            progress.println(&warning);
        }
        progress.step(&sm, total);
        losses.push(out.loss);

        let ckpt_due = cfg.checkpoint.enable
            && (done == end
                || (cfg.checkpoint.interval > 0 && done.is_multiple_of(cfg.checkpoint.interval)));
        if ckpt_due {
            let at = Position {
                step: done,
                tokens_seen,
                data_seed: data.seed(),
            };
            last_ckpt = Some(save_checkpoint(be, cfg, &run_dir, &params, &opt, at)?);
        }
    }
    progress.finish();

    let report = be.ledger().report();
    let p = ganymede_plan::predict_cpu_ledger(cfg, rayon::current_num_threads());
    let predicted: metrics::Predicted = [
        (Category::Params, p.params as u64),
        (Category::Grads, p.grads as u64),
        (Category::Optimizer, p.optimizer as u64),
        (Category::Activations, p.activations as u64),
        (Category::Buffers, p.buffers as u64),
    ];
    let mem = serde_json::to_string_pretty(&metrics::memory_json(&report, Some(&predicted)))?;
    checkpoint::write_atomic(&run_dir.join("memory.json"), mem.as_bytes())?;
    if !opts.quiet {
        println!("{}", metrics::memory_table(&report, Some(&predicted)));
        if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
            println!(
                "steps {}..{}: loss {first:.4} -> {last:.4}{}; {:.0} tokens/s; run directory {}",
                start + 1,
                end,
                final_val.map_or(String::new(), |v| format!(", val_loss {v:.4}")),
                timed_tokens as f64 / step_secs.max(1e-9),
                run_dir.display()
            );
        }
        if let Some(floor) = data.entropy_floor_nats_per_token() {
            println!(
                "entropy floor of the built-in corpus: {floor:.4} nats/token{}",
                final_val.map_or(String::new(), |v| format!(
                    " (val_loss is {:.4} above it)",
                    v - floor
                ))
            );
        }
    }
    Ok(TrainSummary {
        run_dir,
        start_step: start,
        end_step: end,
        losses,
        final_val_loss: final_val,
        tokens_per_s: timed_tokens as f64 / step_secs.max(1e-9),
        checkpoint: last_ckpt,
        entropy_floor: data.entropy_floor_nats_per_token(),
    })
}

/// Save parameters, optimizer state and the manifest (and the run's tokenizer) under
/// `RUN/checkpoints`.
fn save_checkpoint(
    be: &dyn Backend,
    cfg: &JobConfig,
    run_dir: &Path,
    params: &ParamStore,
    opt: &Optimizer,
    at: Position,
) -> Result<PathBuf> {
    let manifest = Manifest::at(cfg, &at, opt.step_count());
    let cd = CheckpointData {
        manifest: &manifest,
        params: checkpoint::host_tensors(be, params.iter().map(|(s, t)| (s.name.clone(), t))),
        optimizer: checkpoint::host_tensors(be, opt.state()),
        extra_files: checkpoint::run_tokenizer_file(run_dir),
    };
    checkpoint::save(run_dir, &cd)
}

/// Mean loss over `metrics.val_batches` fixed batches of the validation split (aux excluded).
fn validate(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    ws: &mut Workspace,
    data: &Dataset,
    cfg: &JobConfig,
) -> f64 {
    let n = cfg.metrics.val_batches.max(1);
    let mut sum = 0.0;
    for i in 0..n {
        let (x, y) = data.val_batch(i, cfg.training.batch_size, cfg.model.seq_len);
        sum += forward_loss(be, model, params, ws, &x, &y).loss;
    }
    sum / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_423), (2025, 12, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn run_dir_of_checkpoint() {
        assert_eq!(
            run_dir_of(Path::new("runs/a/checkpoints/step_00000010")),
            Some(PathBuf::from("runs/a"))
        );
        assert_eq!(run_dir_of(Path::new("elsewhere/step_00000010")), None);
    }
}

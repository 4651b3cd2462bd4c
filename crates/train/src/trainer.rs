//! The training loop and the run directory: one loop for one process, ranks as threads, and
//! MPI processes.
//!
//! ```text
//! RUN/config.toml       the resolved job configuration
//! RUN/train.lock        the writer's lock (`guard::RunLock`): one `train` per directory
//! RUN/metrics.jsonl     one JSON object per step
//! RUN/memory.json       peak bytes per ledger category at the end (rank 0's)
//! RUN/data/             tokenised splits (and tokenizer.json) built by the data crate
//! RUN/checkpoints/      see `checkpoint`
//! ```
//!
//! Every rank runs [`rank_loop`] on the backend its launcher made for it ([`MakeBackend`]: the
//! binary's, which alone links the GPU backend): build its state ([`RankState::with_backend`]
//! applies the parallelism the mesh asks for, none at world size 1), resume, then step, validate, log (rank 0) and
//! checkpoint. A single process is world size 1 of the same loop.

use crate::checkpoint::{self, Position};
use crate::metrics;
use anyhow::{bail, Context, Result};
use ganymede_config::JobConfig;
use ganymede_core::ledger::CATEGORIES;
use ganymede_core::{Backend, Device};
use ganymede_data::Dataset;
use ganymede_dist::threads::panic_message;
use ganymede_dist::{write_chrome_trace, CommSnapshot, ProcessGroup, ThreadsConfig, Tracer};
use ganymede_parallel::{RankState, StepReport};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use step_log::StepLog;

mod faults;
#[cfg(feature = "cuda")]
mod nccl;
mod step_log;
#[cfg(feature = "cuda")]
pub use nccl::train_nccl;

/// Makes one rank's backend, with a ledger of its own. Whoever launches the ranks gives it (the
/// binary: the one crate that links the CUDA backend), and each rank calls it once, on its own
/// thread, so nothing below the launch picks a device.
pub type MakeBackend = Arc<dyn Fn() -> Result<Arc<dyn Backend>> + Send + Sync>;

/// The backends of `cfg.device`'s CPU kinds ([`ganymede_parallel::driver::backend`]).
pub fn cpu_backends(cfg: &JobConfig) -> MakeBackend {
    let cfg = cfg.clone();
    Arc::new(move || ganymede_parallel::driver::backend(&cfg))
}

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
    /// Ranks, as threads of this process (0 or 1: one process, world size 1).
    pub ranks: usize,
    /// Write every rank's timeline here as a Chrome trace.
    pub trace: Option<PathBuf>,
    /// Start from this Hugging Face model folder's weights instead of random ones (the config
    /// must already carry its shape: [`crate::hf_import::init_overrides`]). With `stop_after`
    /// 0 the imported weights are saved as the step-0 checkpoint.
    pub init_from: Option<PathBuf>,
    /// Fault injection for tests: `(rank, step)` panics on that rank before that step.
    pub fail_at: Option<(usize, usize)>,
    /// Fault injection for tests: `(rank, step)` stalls that rank (sleeps past the timeout).
    pub stall_at: Option<(usize, usize)>,
    /// Resuming from a checkpoint older than its run's newest, into that run's own directory:
    /// delete the newer checkpoints (and metrics) instead of refusing.
    pub truncate_history: bool,
    /// Resume even though the tokenised data differ from the checkpoint's run's.
    pub allow_data_change: bool,
}

/// What a finished run reports (rank 0's view).
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub run_dir: PathBuf,
    /// Step the run started from (0, or the resumed checkpoint's step).
    pub start_step: usize,
    pub end_step: usize,
    /// Training loss of each step run here, in order.
    pub losses: Vec<f64>,
    pub final_val_loss: Option<f64>,
    /// Tokens per second over the steps run here (steps only: no validation or checkpoints).
    pub tokens_per_s: f64,
    /// Mean seconds per step, the first step excluded when there are several.
    pub step_s: f64,
    pub checkpoint: Option<PathBuf>,
    /// The corpus's entropy floor in nats per token (built-in corpus only).
    pub entropy_floor: Option<f64>,
    pub ranks: usize,
    /// Rank 0's bytes of each step.
    pub comm: Vec<CommSnapshot>,
    /// Every rank's bytes of the last step (rank 0's only under MPI).
    pub last_comm: Vec<CommSnapshot>,
    /// The signal that stopped the run early (after checkpointing at `end_step`), if any.
    pub stopped: Option<i32>,
    /// Rank 0's time by phase of each step (empty with `metrics.phase_times = false`).
    pub phase_times: Vec<ganymede_core::PhaseTimes>,
}

/// Size rayon's global pool from `training.threads` (0 = all cores; more than the cores is
/// capped to them, with a note: extra threads only contend, and 100,000 would take the machine).
/// Only the first call in a process takes effect; later runs in the same process share that
/// pool.
pub fn init_threads(threads: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if threads > cores {
        eprintln!("note: training.threads = {threads} capped to this machine's {cores} cores");
        cores
    } else {
        threads
    };
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
}

/// The job configuration for `ganymede train` on `ranks` ranks: from a preset or file (or, when
/// resuming with neither, the checkpoint's own), with overrides and `--steps` applied, the mesh
/// fitted to the rank count, validated, and checked against the checkpoint being resumed
/// (naming every key that differs).
///
/// `parallelism.dp_shard` is the rank count over `parallelism.dp_replicate` (HSDP replicas, 1 by
/// default). A `dp_replicate` set on the command line must divide the rank count; one from a
/// checkpoint or file that does not (or would leave one rank per replica) becomes 1. When
/// `parallelism.ep` does not divide `dp_shard` and was not set on the command line, it becomes
/// the largest value that does (gcd), so a checkpoint saved on any mesh resumes on any rank
/// count.
pub fn resolve_config(
    preset: Option<&str>,
    file: Option<&Path>,
    overrides: &[String],
    steps: Option<usize>,
    resume: Option<&Path>,
    ranks: usize,
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
    let r = cfg.parallelism.dp_replicate;
    if given(overrides, "parallelism.dp_replicate") && r > 0 && !ranks.max(1).is_multiple_of(r) {
        bail!(
            "parallelism.dp_replicate = {r} must divide the {} ranks (the world is dp_replicate × dp_shard)",
            ranks.max(1)
        );
    }
    fit_mesh(&mut cfg, ranks, overrides);
    cfg.validate()?;
    if let (Some(saved), Some(dir)) = (&saved, &ckpt) {
        let differing: Vec<String> = checkpoint::config_diff(saved, &cfg)
            .into_iter()
            .filter(|k| !checkpoint::resumable_difference(k))
            .collect();
        if !differing.is_empty() {
            bail!(
                "config does not match checkpoint {}: {} ({})",
                dir.display(),
                if differing.len() == 1 {
                    "this key differs"
                } else {
                    "these keys differ"
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

/// Set the mesh keys for `ranks` ranks (see [`resolve_config`]).
pub fn fit_mesh(cfg: &mut JobConfig, ranks: usize, overrides: &[String]) {
    let ranks = ranks.max(1);
    let p = &mut cfg.parallelism;
    let r = p.dp_replicate;
    if !given(overrides, "parallelism.dp_replicate")
        && r > 1
        && (!ranks.is_multiple_of(r) || ranks / r < 2)
    {
        // Replicas are a layout, not part of the model: a checkpoint's or file's value that
        // does not fit this rank count falls back to plain FSDP, so any checkpoint resumes.
        p.dp_replicate = 1;
    }
    let r = p.dp_replicate;
    p.dp_shard = if r > 0 && ranks.is_multiple_of(r) {
        ranks / r
    } else {
        ranks
    };
    let dp = p.dp_shard;
    if !given(overrides, "parallelism.ep") && p.ep > 0 && !dp.is_multiple_of(p.ep) {
        p.ep = gcd(p.ep, dp);
    }
}

/// Whether an override sets `key`.
fn given(overrides: &[String], key: &str) -> bool {
    overrides.iter().any(|o| {
        o.trim_start()
            .strip_prefix(key)
            .is_some_and(|rest| rest.trim_start().starts_with('='))
    })
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
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

/// The run directory for a run from `ckpt` (or from scratch), refusing one that holds another
/// run's results: its checkpoints or metrics would be overwritten. A resumed run continues its
/// own directory (or writes `--out`).
pub fn run_dir_for(ckpt: Option<&Path>, opts: &TrainOptions) -> Result<PathBuf> {
    let run_dir = run_dir_path(ckpt, opts);
    check_run_dir(ckpt, opts, &run_dir)?;
    Ok(run_dir)
}

/// Where a run from `ckpt` (or from scratch) writes: `--out`, else the checkpoint's own run
/// directory, else a new `runs/<name>-<time>`.
pub fn run_dir_path(ckpt: Option<&Path>, opts: &TrainOptions) -> PathBuf {
    match (&opts.out, ckpt.and_then(run_dir_of)) {
        (Some(o), _) => o.clone(),
        (None, Some(r)) => r,
        (None, None) => default_run_dir(if opts.name.is_empty() {
            "run"
        } else {
            &opts.name
        }),
    }
}

/// The checks of [`run_dir_for`] on `run_dir`; the caller holds its lock, so nothing can change
/// it between these checks and the run's first write.
pub fn check_run_dir(ckpt: Option<&Path>, opts: &TrainOptions, run_dir: &Path) -> Result<()> {
    let run_dir = run_dir.to_path_buf();
    if let Some(dir) = ckpt {
        check_history(dir, &run_dir, opts.truncate_history)?;
    }
    if ckpt.is_none() {
        if !checkpoint::list(&checkpoint::checkpoints_root(&run_dir)).is_empty() {
            bail!(
                "run directory {} already holds checkpoints: continue it with --resume {0}, or pick another --out",
                run_dir.display()
            );
        }
        let m = run_dir.join("metrics.jsonl");
        if fs::metadata(&m).is_ok_and(|md| md.len() > 0) {
            bail!(
                "run directory {} already holds a run's metrics ({}): pick another --out",
                run_dir.display(),
                m.display()
            );
        }
    } else if let (Some(dir), Some(out)) = (ckpt, &opts.out) {
        // Resuming into another run's directory would mix two runs' metrics and checkpoints.
        let holds = !checkpoint::list(&checkpoint::checkpoints_root(out)).is_empty();
        let canon = |p: &Path| fs::canonicalize(p).ok();
        if holds && run_dir_of(dir).and_then(|r| canon(&r)) != canon(out) {
            bail!(
                "run directory {} already holds checkpoints of another run: resume into the checkpoint's own run directory, or pick another --out",
                out.display()
            );
        }
    }
    Ok(())
}

/// Refuse to resume from a checkpoint older than its run's newest into that run's own
/// directory: the newer checkpoints and metrics would be rewritten by another continuation.
/// A branch goes to a new `--out`; `--truncate-history` accepts the loss.
fn check_history(ckpt: &Path, run_dir: &Path, truncate: bool) -> Result<()> {
    let canon = |p: &Path| fs::canonicalize(p).ok();
    let Some(own) = run_dir_of(ckpt) else {
        return Ok(());
    };
    if canon(&own).is_none() || canon(&own) != canon(run_dir) {
        return Ok(());
    }
    let step = checkpoint::read_manifest(ckpt)?.step;
    let newer: Vec<(usize, PathBuf)> = checkpoint::list(&checkpoint::checkpoints_root(run_dir))
        .into_iter()
        .filter(|(s, _)| *s > step)
        .collect();
    if let (Some((_, newest)), false) = (newer.last(), truncate) {
        bail!(
            "checkpoint {} (step {step}) is older than its run's newest, {}: resuming it into {} would rewrite the run's history after step {step}; write the branch elsewhere with --out DIR, or pass --truncate-history to delete the {} newer checkpoint(s)",
            ckpt.display(),
            newest.display(),
            run_dir.display(),
            newer.len()
        );
    }
    Ok(())
}

/// `--truncate-history`: point `latest` at `ckpt` and delete its run's newer checkpoints (the
/// caller holds the run's lock and has passed every check).
fn truncate_history(ckpt: &Path, run_dir: &Path) -> Result<()> {
    if run_dir_of(ckpt).and_then(|r| fs::canonicalize(r).ok()) != fs::canonicalize(run_dir).ok() {
        return Ok(());
    }
    let step = checkpoint::read_manifest(ckpt)?.step;
    checkpoint::truncate_after(&checkpoint::checkpoints_root(run_dir), step)
}

/// The data's fingerprint, refusing a resume whose tokens differ from those the checkpoint's
/// run trained on (unless `--allow-data-change`): the continuation would silently be another
/// run's.
fn check_data(
    cfg: &JobConfig,
    data: &Dataset,
    ckpt: Option<&Path>,
    opts: &TrainOptions,
    run_dir: &Path,
) -> Result<checkpoint::DataFingerprint> {
    let fp = checkpoint::DataFingerprint::of(data.train_tokens(), data.val_tokens());
    let Some(dir) = ckpt else { return Ok(fp) };
    let then = checkpoint::read_manifest(dir)?.data.fingerprint;
    if let (Some(diff), false) = (then.and_then(|t| fp.difference(&t)), opts.allow_data_change) {
        let source = if cfg.data.path.is_empty() {
            "the built-in corpus".to_string()
        } else {
            format!("data.path = {}", cfg.data.path)
        };
        bail!(
            "the data differ from checkpoint {}'s: {diff} ({source}, tokenised in {}); resume on the data it trained on, or pass --allow-data-change if the change is deliberate",
            dir.display(),
            run_dir.join("data").display()
        );
    }
    Ok(fp)
}

/// A `--trace` file that could not be written is refused at the start, not after training.
fn check_trace_path(opts: &TrainOptions) -> Result<()> {
    let Some(t) = &opts.trace else { return Ok(()) };
    let parent = t.parent().filter(|p| !p.as_os_str().is_empty());
    if t.is_dir() {
        bail!("--trace {}: is a folder, not a file", t.display());
    }
    if let Some(p) = parent.filter(|p| !p.is_dir()) {
        bail!(
            "--trace {}: folder {} does not exist",
            t.display(),
            p.display()
        );
    }
    Ok(())
}

/// Refuse a resume with nothing left to run before anything is written.
fn check_steps_left(cfg: &JobConfig, ckpt: Option<&Path>) -> Result<()> {
    if let Some(dir) = ckpt {
        let start = checkpoint::read_manifest(dir)?.data.next_step;
        let total = cfg.training.steps;
        if start >= total {
            bail!(
                "checkpoint {} is at step {start}, and training.steps = {total}: nothing left to run (raise --steps)",
                dir.display()
            );
        }
    }
    Ok(())
}

/// Train `cfg` (already resolved and validated; see [`resolve_config`]), from scratch or from
/// the checkpoint `ckpt`, on `opts.ranks` ranks as threads of this process (one: this thread),
/// on the CPU kinds' backends.
pub fn train(cfg: &JobConfig, ckpt: Option<&Path>, opts: &TrainOptions) -> Result<TrainSummary> {
    train_on(cfg, ckpt, opts, cpu_backends(cfg))
}

/// [`train`] with every rank's backend made by `backends`.
pub fn train_on(
    cfg: &JobConfig,
    ckpt: Option<&Path>,
    opts: &TrainOptions,
    backends: MakeBackend,
) -> Result<TrainSummary> {
    let n = opts.ranks.max(1);
    let mut run = prepare_run(cfg, ckpt, opts, 0, n, n)?;
    // Held until this function returns, not by rank threads that may outlive it.
    let _lock = run.lock.take();
    let tcfg = ThreadsConfig {
        timeout: Duration::from_secs_f64(run.cfg.parallelism.timeout_s),
        trace: opts.trace.is_some(),
    };
    let run = Arc::new(run);
    let outs = if n == 1 {
        let world = ganymede_dist::threads_world(1, &tcfg)
            .pop()
            .expect("one rank");
        // Failed collectives come back as errors; this catches a panic (an allocation past
        // `device.memory_gib`, which the backend cannot return, or a bug) so that it ends the
        // run with its message as an error, as it does on several ranks.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rank_loop(Arc::new(world), backends()?, &run, true)
        }));
        match r {
            Ok(out) => vec![out?],
            Err(p) => bail!("training failed: {}", panic_message(p.as_ref())),
        }
    } else {
        run_ranks_as_threads(n, &tcfg, run.clone(), backends)?
    };
    if let Some(path) = &opts.trace {
        let tracers: Vec<&Tracer> = outs.iter().map(|o| o.tracer.as_ref()).collect();
        write_chrome_trace(path, &tracers)
            .with_context(|| format!("cannot write trace {}", path.display()))?;
    }
    Ok(summary(&outs, &run))
}

/// Refuse, before anything is built or written, a job whose predicted device peak exceeds
/// `device.memory_gib`, naming the overflowing categories and the smallest change that fits
/// (the planner's [`ganymede_plan::fit_check`]). Layouts the planner does not model yet
/// (several ranks) pass; an allocation past the capacity still ends them.
pub fn check_fit(cfg: &JobConfig, ranks: usize) -> Result<()> {
    match ganymede_plan::fit_check(cfg, rayon::current_num_threads(), ranks) {
        Some(c) if !c.fits => bail!("the job does not fit in device memory: {}", c.message()),
        _ => Ok(()),
    }
}

/// Refuse, before anything is allocated, a job whose predicted host memory (the planner's
/// prediction of the ledger's peak, per rank, times the `local` ranks this process runs) exceeds
/// the machine's memory (`MemTotal`), where it would end in an allocation failure's abort; warn
/// when it exceeds what is available now (`MemAvailable`).
pub fn check_host_fit(cfg: &JobConfig, local: usize, ranks: usize) -> Result<()> {
    let Some((total, available)) = host_memory() else {
        return Ok(());
    };
    let p = ganymede_plan::predict_memory(cfg, rayon::current_num_threads(), ranks);
    let need = p.host_peak * local.max(1) as f64;
    let g = |b: f64| format!("{:.3} GiB", b / (1u64 << 30) as f64);
    let per_rank = if local > 1 {
        format!(" ({local} ranks of {} each)", g(p.host_peak))
    } else {
        String::new()
    };
    if need > total {
        let mut cats: Vec<(String, f64)> = p
            .host
            .entries()
            .into_iter()
            .map(|(c, b)| (c.to_string(), b))
            .filter(|(_, b)| *b > 0.0)
            .collect();
        cats.sort_by(|a, b| b.1.total_cmp(&a.1));
        bail!(
            "the job does not fit in host memory: predicted host peak {}{per_rank} exceeds this machine's {} (MemTotal); per rank: {}; lower training.batch_size or the model's size, or set training.micro_batch_size (gradient accumulation)",
            g(need),
            g(total),
            cats.iter()
                .map(|(c, b)| format!("{c} {}", g(*b)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if need > available {
        eprintln!(
            "warning: predicted host peak {}{per_rank} exceeds the memory available now ({}, MemAvailable of {})",
            g(need),
            g(available),
            g(total)
        );
    }
    Ok(())
}

/// (MemTotal, MemAvailable) in bytes from /proc/meminfo, where there is one.
fn host_memory() -> Option<(f64, f64)> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024.0)
    };
    let total = field("MemTotal:")?;
    Some((total, field("MemAvailable:").unwrap_or(total)))
}

/// What every rank needs to run.
struct Run {
    cfg: JobConfig,
    ckpt: Option<PathBuf>,
    opts: TrainOptions,
    data: Dataset,
    /// `data`'s fingerprint, recorded in every checkpoint.
    data_fp: checkpoint::DataFingerprint,
    run_dir: PathBuf,
    /// The writer's lock (rank 0's), held while this struct lives (a process of several) or
    /// taken out by the launch that holds it.
    lock: Option<crate::guard::RunLock>,
}

/// What one rank reports.
struct RankOut {
    losses: Vec<f64>,
    /// Each step's time by phase (`metrics.phase_times`).
    phases: Vec<ganymede_core::PhaseTimes>,
    comm: Vec<CommSnapshot>,
    step_secs: Vec<f64>,
    /// Tokens of one global batch.
    tokens: usize,
    val_loss: Option<f64>,
    /// First step run here (0, or the resumed checkpoint's).
    start: usize,
    end: usize,
    checkpoint: Option<PathBuf>,
    tracer: Arc<Tracer>,
    /// The signal this rank stopped on (every rank agrees).
    stopped: Option<i32>,
}

impl RankOut {
    /// Nothing run yet, of steps `start..end`.
    fn new(start: usize, end: usize, tracer: Arc<Tracer>) -> Self {
        RankOut {
            losses: vec![],
            phases: vec![],
            comm: vec![],
            step_secs: vec![],
            tokens: 0,
            val_loss: None,
            start,
            end,
            checkpoint: None,
            tracer,
            stopped: None,
        }
    }

    /// A step's loss, seconds and global batch.
    fn record_step(&mut self, r: &StepReport, secs: f64) {
        self.losses.push(r.loss);
        self.phases.extend(r.phase_times);
        self.step_secs.push(secs);
        self.tokens = r.tokens;
    }
}

/// Collective: whether any rank has been asked to stop (the signal, or SIGTERM's number when
/// only another rank knows which), decided by all ranks together so that they stop after the
/// same step. One float all-reduced per step; outside the step's counted communication.
fn agreed_stop(group: &dyn ProcessGroup, mine: Option<i32>) -> Result<Option<i32>> {
    if group.size() == 1 {
        return Ok(mine);
    }
    let mut flag = [f32::from(u8::from(mine.is_some()))];
    group.all_reduce(
        ganymede_core::ViewMut::Host(&mut flag),
        ganymede_dist::Phase::Other,
    )?;
    Ok((flag[0] > 0.0).then(|| mine.unwrap_or(libc::SIGTERM)))
}

/// What the lock holder does once every check has passed: clear leftovers of killed saves
/// (any rank count's), and cut the history `--truncate-history` asked to cut.
fn claim_run_dir(ckpt: Option<&Path>, opts: &TrainOptions, run_dir: &Path) -> Result<()> {
    checkpoint::remove_leftovers(&checkpoint::checkpoints_root(run_dir));
    if let (Some(dir), true) = (ckpt, opts.truncate_history) {
        truncate_history(dir, run_dir)?;
    }
    Ok(())
}

/// `RUN/config.toml`, written once the checkpoint (if any) has loaded: a refused run leaves the
/// directory's description as it was.
fn write_run_config(cfg: &JobConfig, run_dir: &Path) -> Result<()> {
    checkpoint::write_atomic(&run_dir.join("config.toml"), cfg.to_toml().as_bytes())
}

fn build_data(cfg: &JobConfig, dir: Option<&Path>, opts: &TrainOptions) -> Result<Dataset> {
    let (m, t) = (&cfg.model, &cfg.training);
    let allow = opts.allow_data_change;
    Dataset::build_with(&cfg.data, m.vocab_size, m.seq_len, t.seed, dir, allow)
}

/// `n` ranks on detached threads, so a rank stuck outside any collective cannot hold the job:
/// once one rank has failed, the others get the collective timeout (plus a second) to report,
/// and any still running are left behind with an error naming them.
fn run_ranks_as_threads(
    n: usize,
    tcfg: &ThreadsConfig,
    shared: Arc<Run>,
    backends: MakeBackend,
) -> Result<Vec<RankOut>> {
    let (tx, rx) = std::sync::mpsc::channel();
    for g in ganymede_dist::threads_world(n, tcfg) {
        let (tx, shared, backends) = (tx.clone(), shared.clone(), backends.clone());
        std::thread::Builder::new()
            .name(format!("rank{}", g.rank()))
            .spawn(move || {
                let rank = g.rank();
                let world: Arc<dyn ProcessGroup> = Arc::new(g);
                // Failed collectives come back as errors; this catches a panic (an allocation
                // past the device's capacity, an injected fault, a bug), which drops the world
                // handle while unwinding and so poisons the world: every other rank's collective
                // fails at once naming this rank, and the panic is reported as the root cause.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rank_loop(world, backends()?, &shared, rank == 0)
                }));
                let _ = tx.send((rank, r));
            })
            .context("cannot start a rank thread")?;
    }
    drop(tx);
    let mut results: Vec<Option<std::thread::Result<Result<RankOut>>>> =
        (0..n).map(|_| None).collect();
    let mut deadline: Option<Instant> = None;
    let grace = tcfg.timeout + Duration::from_secs(1);
    while results.iter().any(Option::is_none) {
        let got = match deadline {
            None => rx.recv().ok(),
            Some(d) => rx
                .recv_timeout(d.saturating_duration_since(Instant::now()))
                .ok(),
        };
        let Some((rank, r)) = got else { break };
        if deadline.is_none() && !matches!(r, Ok(Ok(_))) {
            deadline = Some(Instant::now() + grace);
        }
        results[rank] = Some(r);
    }
    // The first failure in rank order; a panic (the root cause) before the errors it caused.
    let mut outs = Vec::new();
    let mut panics = Vec::new();
    let mut errors = Vec::new();
    let mut stuck = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Some(Ok(Ok(o))) => outs.push(o),
            Some(Ok(Err(e))) => errors.push((r, format!("{e:#}"))),
            Some(Err(p)) => panics.push((r, panic_message(p.as_ref()).to_string())),
            None => stuck.push(r),
        }
    }
    if !panics.is_empty() || !errors.is_empty() || !stuck.is_empty() {
        let mut all = panics;
        all.extend(errors);
        let mut clauses = vec![summarise_ranks(&all)];
        if !stuck.is_empty() {
            clauses.push(format!(
                "{} {} did not finish within {:.0} s of the first failure (stuck outside a collective?)",
                if stuck.len() > 1 { "ranks" } else { "rank" },
                rank_spans(&stuck),
                grace.as_secs_f64()
            ));
        }
        clauses.retain(|c| !c.is_empty());
        bail!("sharded training failed: {}", clauses.join("; "));
    }
    Ok(outs)
}

/// Per-rank messages, each distinct message once with the ranks that gave it (`ranks 0-3, 5`),
/// in order of first appearance: a failure every rank shares is one clause, not one per rank.
fn summarise_ranks(msgs: &[(usize, String)]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, m) in msgs {
        match groups.iter_mut().find(|(g, _)| *g == m.as_str()) {
            Some((_, ranks)) => ranks.push(*r),
            None => groups.push((m, vec![*r])),
        }
    }
    groups
        .into_iter()
        .map(|(m, ranks)| {
            let word = if ranks.len() > 1 { "ranks" } else { "rank" };
            format!("{word} {}: {m}", rank_spans(&ranks))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `0-2, 4` for ranks 0, 1, 2 and 4.
fn rank_spans(ranks: &[usize]) -> String {
    let mut ranks = ranks.to_vec();
    ranks.sort_unstable();
    let mut spans: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        spans.push(if j > i {
            format!("{}-{}", ranks[i], ranks[j])
        } else {
            ranks[i].to_string()
        });
        i = j + 1;
    }
    spans.join(", ")
}

/// One rank's whole run: build its state, resume, then step, validate, log (`writer`: rank 0),
/// checkpoint, stop.
fn rank_loop(
    world: Arc<dyn ProcessGroup>,
    be: Arc<dyn Backend>,
    run: &Run,
    writer: bool,
) -> Result<RankOut> {
    let (cfg, opts, data, run_dir) = (&run.cfg, &run.opts, &run.data, &run.run_dir);
    let run_start = Instant::now();
    let (rank, n) = (world.rank(), world.size());
    let tracer = world.ctx().tracer.clone();
    let group = world.clone();
    let (mut st, start, mut tokens_seen) = start_rank(world, be, run, writer)?;
    let total = cfg.training.steps;
    let end = opts.stop_after.map_or(total, |s| s.clamp(start, total));
    let mut log = StepLog::open(run, start, n, run_start, writer)?;
    log.progress
        .println(&banner(cfg, &st, n, data, run_dir, start));
    let mut out = RankOut::new(start, end, tracer);
    // Signals stop gracefully from here (before, there was nothing to save).
    crate::stop::arm();
    for step in start..end {
        faults::inject(opts, cfg, rank, step);
        // Step: one optimizer step; `step` is 0-based, metrics count completed steps.
        let t0 = Instant::now();
        let r = st.step(data, step)?;
        let dt = t0.elapsed().as_secs_f64();
        let done = step + 1;
        tokens_seen += r.tokens as u64;
        out.record_step(&r, dt);

        // Evaluate, then log (the step's line carries the validation).
        let val_due = validation_due(cfg, done, end);
        let val = val_due.then(|| validate(&mut st, data)).transpose()?;
        if let Some((v, _)) = &val {
            out.val_loss = Some(*v);
        }
        log.record(&r, (done, dt), tokens_seen, val, val_due)?;
        log.check_dead(done, &r, out.checkpoint.as_deref())?;
        out.comm.push(r.comm);

        // Stop: a signal ends the run here, as if `end` were this step (no validation: a
        // cluster's warning leaves little time).
        let stop = if done < end {
            agreed_stop(&*group, crate::stop::requested())?
        } else {
            None
        };
        if let Some(sig) = stop {
            (out.end, out.stopped) = (done, Some(sig));
        }

        // Checkpoint, every `checkpoint.interval` and at the end.
        if checkpoint_due(cfg, done, done == end || stop.is_some()) {
            out.checkpoint = save_checkpoint(&mut st, run, done, tokens_seen)?;
        }
        if stop.is_some() {
            break;
        }
    }
    if opts.init_from.is_some() && run.ckpt.is_none() && end == 0 && cfg.checkpoint.enable {
        // An import without training: the imported weights as a checkpoint that eval, export
        // and `train --resume` read.
        out.checkpoint = save_checkpoint(&mut st, run, 0, 0)?;
    }
    log.progress.finish();
    if log.is_writer() {
        write_memory(cfg, &st, run_dir, n, opts.quiet)?;
    }
    Ok(out)
}

/// A rank's state, ready for its first step: built on `be`, resumed from the run's checkpoint
/// or initialised from `--init-from`, with `RUN/config.toml` written (`writer`: rank 0).
/// Returns it with the first step to run and the tokens seen before it.
fn start_rank(
    world: Arc<dyn ProcessGroup>,
    be: Arc<dyn Backend>,
    run: &Run,
    writer: bool,
) -> Result<(RankState, usize, u64)> {
    let (cfg, opts) = (&run.cfg, &run.opts);
    let mut st = RankState::with_backend(world, cfg, be)?;
    let total = cfg.training.steps;
    let (mut start, mut tokens_seen) = (0, 0u64);
    if let Some(dir) = &run.ckpt {
        let m = st.load_checkpoint(dir)?;
        (start, tokens_seen) = (m.data.next_step, m.tokens_seen);
        if start >= total {
            bail!(
                "checkpoint {} is at step {start}, and training.steps = {total}: nothing left to run (raise --steps)",
                dir.display()
            );
        }
    }
    if let (Some(hf), None) = (&opts.init_from, &run.ckpt) {
        let hf = crate::hf_import::HfCheckpoint::open(hf)?;
        crate::hf_import::load_into(&mut st, &hf, cfg)?;
    }
    if writer {
        write_run_config(cfg, &run.run_dir)?;
    }
    Ok((st, start, tokens_seen))
}

/// Whether to validate after `done` completed steps: every `metrics.val_every`, and at `end`.
fn validation_due(cfg: &JobConfig, done: usize, end: usize) -> bool {
    done == end || (cfg.metrics.val_every > 0 && done.is_multiple_of(cfg.metrics.val_every))
}

/// Whether to checkpoint after `done` completed steps (`last`: the run ends there).
fn checkpoint_due(cfg: &JobConfig, done: usize, last: bool) -> bool {
    let ck = &cfg.checkpoint;
    ck.enable && (last || (ck.interval > 0 && done.is_multiple_of(ck.interval)))
}

/// Collective: a checkpoint after `step` completed steps and `tokens_seen` tokens.
fn save_checkpoint(
    st: &mut RankState,
    run: &Run,
    step: usize,
    tokens_seen: u64,
) -> Result<Option<PathBuf>> {
    let at = Position {
        step,
        tokens_seen,
        data_seed: run.data.seed(),
        data: Some(run.data_fp.clone()),
    };
    st.save(&run.run_dir, &at, run.cfg.parallelism.sharded_checkpoints)
}

/// Collective: the validation loss, and with prepared sources each one's (`val_loss/<name>`),
/// the overall figure their mixture-weighted mean.
fn validate(
    st: &mut RankState,
    data: &Dataset,
) -> Result<(f64, std::collections::BTreeMap<String, f64>)> {
    let sources = data.val_sources();
    if sources.is_empty() {
        return Ok((st.validate(data, None)?, Default::default()));
    }
    let mut by = std::collections::BTreeMap::new();
    let mut mean = 0.0;
    for (i, (name, w)) in sources.iter().enumerate() {
        let v = st.validate(data, Some(i))?;
        mean += w * v;
        by.insert(format!("val_loss/{name}"), v);
    }
    Ok((mean, by))
}

fn banner(
    cfg: &JobConfig,
    st: &RankState,
    n: usize,
    data: &Dataset,
    run_dir: &Path,
    start: usize,
) -> String {
    let p = &cfg.parallelism;
    let ranks = if n == 1 {
        format!("{} threads", rayon::current_num_threads())
    } else {
        format!(
            "{n} ranks ({}FSDP with {:?} gathers, prefetch {}, ep {}, Muon placement {:?}), {} threads",
            if p.dp_replicate > 1 {
                format!("{} replicas of {}-way ", p.dp_replicate, p.dp_shard)
            } else {
                String::new()
            },
            p.gather_dtype,
            p.prefetch,
            p.ep,
            p.muon_placement,
            rayon::current_num_threads()
        )
    };
    format!(
        "ganymede train: {} parameters, {} on {}, {ranks}, run directory {}{}",
        st.numel(),
        format!("{:?}", cfg.optimizer.name).to_lowercase(),
        data.source(),
        run_dir.display(),
        if start > 0 {
            format!(", resuming at step {start}")
        } else {
            String::new()
        }
    )
}

/// `memory.json` and the printed table: rank 0's peaks by device and category, with the
/// planner's prediction where it models this layout (one or two memories; several ranks
/// without expert parallelism).
fn write_memory(
    cfg: &JobConfig,
    st: &RankState,
    run_dir: &Path,
    n: usize,
    quiet: bool,
) -> Result<()> {
    let report = st.be.ledger().report();
    let p = ganymede_plan::predict_memory(cfg, rayon::current_num_threads(), n);
    let mut predicted = metrics::Predicted::default();
    for (dev, cats, peak) in [
        (Device::Gpu(0), &p.device, p.device_peak),
        (Device::Host, &p.host, p.host_peak),
    ] {
        if dev == Device::Gpu(0) && peak == 0.0 {
            continue;
        }
        for (name, bytes) in cats.entries() {
            let c = *CATEGORIES
                .iter()
                .find(|c| c.name() == name)
                .expect("the planner's categories are the ledger's");
            predicted.categories.push((dev, c, bytes as u64));
        }
        predicted.totals.push((dev, peak as u64));
    }
    let predicted = Some(predicted);
    let mem = serde_json::to_string_pretty(&metrics::memory_json(&report, predicted.as_ref()))?;
    checkpoint::write_atomic(&run_dir.join("memory.json"), mem.as_bytes())?;
    if !quiet {
        println!("{}", metrics::memory_table(&report, predicted.as_ref()));
    }
    Ok(())
}

fn summary(outs: &[RankOut], run: &Run) -> TrainSummary {
    let o0 = &outs[0];
    let n = run.cfg.parallelism.world();
    let total_secs: f64 = o0.step_secs.iter().sum();
    let tokens_per_s = (o0.tokens * o0.step_secs.len()) as f64 / total_secs.max(1e-9);
    let skip = usize::from(o0.step_secs.len() > 1);
    let timed = &o0.step_secs[skip..];
    let step_s = timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    let floor = run.data.entropy_floor_nats_per_token();
    if !run.opts.quiet {
        if let (Some(first), Some(last)) = (o0.losses.first(), o0.losses.last()) {
            println!(
                "steps {}..{}: loss {first:.4} -> {last:.4}{}; {tokens_per_s:.0} tokens/s{}; run directory {}",
                o0.start + 1,
                o0.end,
                o0.val_loss.map_or(String::new(), |v| format!(", val_loss {v:.4}")),
                if n > 1 { format!(" on {n} ranks") } else { String::new() },
                run.run_dir.display()
            );
        }
        if let Some(line) = metrics::phase_summary(&o0.phases, &o0.step_secs) {
            println!("{line}");
        }
        if let Some(sig) = o0.stopped {
            println!(
                "stopped by {} after step {}: {}; resume with: ganymede train --resume {}{}",
                crate::stop::signal_name(sig),
                o0.end,
                o0.checkpoint.as_ref().map_or(
                    "no checkpoint (checkpoint.enable = false)".to_string(),
                    |c| format!("checkpoint {}", c.display())
                ),
                run.run_dir.display(),
                match (n > 1, run.opts.ranks > 1) {
                    (true, true) => format!(" --ranks {n}"),
                    // Processes as ranks (mpirun, srun): the launcher gives their number.
                    (true, false) => format!(" (under the same launcher, {n} processes)"),
                    _ => String::new(),
                }
            );
        }
        if let Some(floor) = floor {
            println!(
                "entropy floor of the built-in corpus: {floor:.4} nats/token{}",
                o0.val_loss.map_or(String::new(), |v| format!(
                    " (val_loss is {:.4} above it)",
                    v - floor
                ))
            );
        }
    }
    TrainSummary {
        run_dir: run.run_dir.clone(),
        start_step: o0.start,
        end_step: o0.end,
        losses: o0.losses.clone(),
        final_val_loss: o0.val_loss,
        tokens_per_s,
        step_s,
        checkpoint: o0.checkpoint.clone(),
        entropy_floor: floor,
        ranks: n,
        comm: o0.comm.clone(),
        last_comm: outs
            .iter()
            .map(|o| o.comm.last().cloned().unwrap_or_default())
            .collect(),
        stopped: o0.stopped,
        phase_times: o0.phases.clone(),
    }
}

/// The start every launch shares: the config fitted to the `n` ranks and validated, the fit and
/// resume checks (`local`: the ranks this process runs, for the host's memory), the run directory
/// (rank 0 takes the writer's lock, prepares the directory and writes the data cache; every
/// rank checks it, with the same answer on a shared file system, so a refusal ends every rank
/// rather than leaving the others waiting) and the data.
fn prepare_run(
    cfg: &JobConfig,
    ckpt: Option<&Path>,
    opts: &TrainOptions,
    rank: usize,
    n: usize,
    local: usize,
) -> Result<Run> {
    let mut cfg = cfg.clone();
    fit_mesh(&mut cfg, n, &[]);
    cfg.validate()?;
    init_threads(cfg.training.threads);
    check_fit(&cfg, n)?;
    check_host_fit(&cfg, local, n)?;
    check_steps_left(&cfg, ckpt)?;
    check_trace_path(opts)?;
    // A second job's rank 0 fails on the lock (and its launcher ends that job).
    let run_dir = run_dir_path(ckpt, opts);
    let lock = (rank == 0)
        .then(|| crate::guard::RunLock::acquire(&run_dir))
        .transpose()?;
    check_run_dir(ckpt, opts, &run_dir)?;
    let data = if rank == 0 {
        claim_run_dir(ckpt, opts, &run_dir)?;
        build_data(&cfg, Some(&run_dir.join("data")), opts)?
    } else {
        build_data(&cfg, None, opts)?
    };
    let data_fp = check_data(&cfg, &data, ckpt, opts, &run_dir)?;
    Ok(Run {
        cfg,
        ckpt: ckpt.map(Path::to_path_buf),
        opts: opts.clone(),
        data,
        data_fp,
        run_dir,
        lock,
    })
}

/// Train as one rank of an MPI job (`mpirun -n N ganymede train …`); `dp_replicate × dp_shard`
/// is the job's size. Rank 0 writes the run directory and builds the data folder; the others build
/// the same tokens in memory. A failing rank prints its error and aborts the job, and a stalled
/// collective fails after `parallelism.timeout_s`, so no rank hangs. With a trace, each rank
/// writes `FILE.rank<r>.json`.
#[cfg(feature = "mpi")]
pub fn train_mpi(
    cfg: &JobConfig,
    ckpt: Option<&Path>,
    opts: &TrainOptions,
    backends: MakeBackend,
) -> Result<TrainSummary> {
    let mcfg = ganymede_dist::mpi::MpiConfig {
        timeout: Duration::from_secs_f64(cfg.parallelism.timeout_s),
        trace: opts.trace.is_some(),
    };
    let (_mpi, world) = ganymede_dist::mpi::init(&mcfg)?;
    let (rank, n) = (world.rank(), world.size());
    let run = process_run(cfg, ckpt, opts, rank, n, "under mpirun")?;
    let out = process_loop(world.clone(), || backends(), &run).unwrap_or_else(|failure| {
        eprintln!("error: {failure}; aborting the MPI job");
        world.abort(1)
    });
    process_summary(rank, out, run)
}

/// [`prepare_run`] for one process of `n` (MPI or NCCL ranks), which must be told where the
/// run directory is (`launcher`: how the refusal names the job).
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn process_run(
    cfg: &JobConfig,
    ckpt: Option<&Path>,
    opts: &TrainOptions,
    rank: usize,
    n: usize,
    launcher: &str,
) -> Result<Run> {
    if opts.out.is_none() && ckpt.and_then(run_dir_of).is_none() {
        bail!("{launcher}, give --out: every rank must write to the same run directory");
    }
    prepare_run(cfg, ckpt, opts, rank, n, 1)
}

/// This process's rank of a multi-process job (MPI, NCCL) runs the loop on the backend `be`
/// makes; a failure or a panic comes back as one line naming the rank, for the launch to end the
/// whole job with rather than leave the other processes waiting.
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn process_loop(
    world: Arc<dyn ProcessGroup>,
    be: impl FnOnce() -> Result<Arc<dyn Backend>>,
    run: &Run,
) -> std::result::Result<RankOut, String> {
    let rank = world.rank();
    // Failed collectives come back as errors; a panic (an allocation the backend cannot
    // return, a bug) is caught too, so the launch still ends the whole job naming this rank.
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rank_loop(world, be()?, run, rank == 0)
    }));
    match res {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(e)) => Err(format!("rank {rank}: {e:#}")),
        Err(p) => Err(format!("rank {rank} died: {}", panic_message(p.as_ref()))),
    }
}

/// The end every multi-process launch shares: this rank's trace (`FILE.rank<r>.json`), and the
/// summary, which rank 0 alone prints.
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn process_summary(rank: usize, out: RankOut, mut run: Run) -> Result<TrainSummary> {
    if let Some(path) = &run.opts.trace {
        let p = path.with_extension(format!("rank{rank}.json"));
        write_chrome_trace(&p, &[out.tracer.as_ref()])
            .with_context(|| format!("cannot write trace {}", p.display()))?;
    }
    run.opts.quiet |= rank != 0;
    // The processes are the ranks (no --ranks in the resume command).
    run.opts.ranks = 1;
    Ok(summary(&[out], &run))
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
    fn rank_failures_are_summarised() {
        let m = |r: usize, s: &str| (r, s.to_string());
        let msgs = [
            m(0, "bad file"),
            m(1, "bad file"),
            m(2, "bad file"),
            m(4, "bad file"),
            m(3, "timeout"),
        ];
        assert_eq!(
            summarise_ranks(&msgs),
            "ranks 0-2, 4: bad file; rank 3: timeout"
        );
    }

    /// A signal seen by one rank only stops every rank: they agree through the all-reduce.
    #[test]
    fn one_ranks_stop_request_stops_every_rank() {
        let world = ganymede_dist::threads_world(3, &ThreadsConfig::default());
        let handles: Vec<_> = world
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let mine = (g.rank() == 1).then_some(libc::SIGUSR1);
                    let none = agreed_stop(&g, None).unwrap();
                    (none, agreed_stop(&g, mine).unwrap())
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let (none, some) = h.join().unwrap();
            assert_eq!(none, None, "rank {r}");
            let want = if r == 1 { libc::SIGUSR1 } else { libc::SIGTERM };
            assert_eq!(some, Some(want), "rank {r}");
        }
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

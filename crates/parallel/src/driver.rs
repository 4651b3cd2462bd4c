//! One rank's training state and step ([`RankState`]), and the threads-backend driver
//! ([`train_threads`], `ganymede train --ranks N`).
//!
//! The step reads like the single-process one: take this rank's slice of the global batch,
//! forward and backward through the FSDP hooks, reduce-scatter gradients, clip by the global
//! norm, step the sharded optimizer. Losses and gradients are normalised by the global batch's
//! token count, so at any rank count they are one process's on the same global batch (up to
//! the order of floating-point sums).

use crate::ep::EpExperts;
use crate::fsdp::{FsdpGrads, FsdpParams, Groups};
use crate::layout::Layout;
use crate::optim::ShardedOptimizer;
use anyhow::{bail, Context, Result};
use ganymede_config::{JobConfig, MuonPlacement};
use ganymede_core::{Blas, CpuBackend, Ledger, Memory, ParamKind, TMut};
use ganymede_data::Dataset;
use ganymede_dist::placement::plan;
use ganymede_dist::threads::panic_message;
use ganymede_dist::{
    check_config_hash, config_hash, write_chrome_trace, CommSnapshot, DeviceMesh, Phase, Policy,
    ProcessGroup, ThreadsConfig, Tracer, Track,
};
use ganymede_model::{
    forward_backward_with, forward_loss_with, ExpertExecutor, LocalExperts, Model, Workspace,
};
use ganymede_optim::lr_at;
use ganymede_train::metrics::load_balance;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one sharded step reports (the same on every rank, except `comm`).
#[derive(Clone, Debug)]
pub struct StepReport {
    pub loss: f64,
    pub aux_loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens: usize,
    pub expert_load: Vec<Vec<f32>>,
    /// This rank's bytes per phase and collective in the step.
    pub comm: CommSnapshot,
}

/// The placement policy a config asks for.
pub fn policy(cfg: &JobConfig) -> Policy {
    match cfg.parallelism.muon_placement {
        MuonPlacement::Flexshard => Policy::FlexShard,
        MuonPlacement::Naive => Policy::Naive,
    }
}

/// Everything one rank holds.
pub struct RankState {
    pub be: CpuBackend,
    pub model: Model,
    pub layout: Arc<Layout>,
    pub mesh: DeviceMesh,
    pub params: FsdpParams,
    pub grads: FsdpGrads,
    pub opt: ShardedOptimizer,
    pub ws: Workspace,
    /// Routed experts: here (ep = 1) or over the ep group.
    pub experts: Box<dyn ExpertExecutor>,
    cfg: JobConfig,
}

impl RankState {
    /// Collective over `world`: checks the configuration hash, builds the mesh and this rank's
    /// shards of the initial parameters.
    pub fn new(world: Arc<dyn ProcessGroup>, cfg: &JobConfig) -> Result<Self> {
        check_config_hash(world.as_ref(), config_hash(cfg))
            .context("ranks started with different configurations")?;
        let mesh = DeviceMesh::new(world.clone(), &cfg.parallelism)?;
        let (w, r) = (world.size(), world.rank());
        let (m, t) = (&cfg.model, &cfg.training);
        if !t.batch_size.is_multiple_of(w) {
            bail!(
                "training.batch_size = {} cannot be split evenly over {w} ranks",
                t.batch_size
            );
        }
        let be = CpuBackend::new(Arc::new(Ledger::new()));
        let model = Model::new(m);
        let pl = plan(model.param_specs(), mesh.shape, policy(cfg))?;
        let layout = Arc::new(Layout::new(
            model.param_specs(),
            m.layers,
            &pl,
            mesh.ep.rank(),
        ));
        // Every rank draws the same initial tensors, one at a time, keeping its shard of each.
        let groups = Groups::of(&mesh);
        let p = &cfg.parallelism;
        let init = |i: usize| model.init_param(&be, i, t.seed);
        let params = FsdpParams::new(
            &be,
            layout.clone(),
            groups.clone(),
            p.gather_dtype,
            p.prefetch,
            &init,
        );
        let grads = FsdpGrads::new(&be, layout.clone(), groups);
        let opt = ShardedOptimizer::new(&be, &cfg.optimizer, &layout, pl);
        let ws = Workspace::new(
            &be,
            &model,
            t.batch_size / w,
            m.seq_len,
            cfg.activation_checkpoint.mode,
        );
        let _ = r;
        let experts: Box<dyn ExpertExecutor> = if mesh.shape.ep > 1 {
            Box::new(EpExperts::new(mesh.ep.clone()))
        } else {
            Box::new(LocalExperts)
        };
        Ok(RankState {
            experts,
            be,
            model,
            layout,
            mesh,
            params,
            grads,
            opt,
            ws,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &JobConfig {
        &self.cfg
    }

    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.mesh.dp_shard
    }

    /// One optimizer step on global batch `step` (0-based).
    pub fn step(&mut self, data: &Dataset, step: usize) -> Result<StepReport> {
        let world = self.mesh.dp_shard.clone();
        let ctx = world.ctx().clone();
        ctx.stats.reset();
        let (cfg, be) = (&self.cfg, &self.be);
        let (batch, seq) = (cfg.training.batch_size, cfg.model.seq_len);
        let (x, y) = data.batch_slice(step as u64, batch, seq, world.rank(), world.size());
        self.params.begin(be, true, batch * seq);
        self.grads.begin(be);
        let out = forward_backward_with(
            be,
            &self.model,
            &mut self.params,
            &mut self.grads,
            &mut *self.experts,
            &mut self.ws,
            &x,
            &y,
            1.0,
        );
        self.grads.finish(be);

        // The loss is this slice's share of the global mean; the aux loss is already global.
        let t0 = Instant::now();
        let trainable: Vec<bool> = self
            .layout
            .specs
            .iter()
            .map(|s| s.kind.is_trainable())
            .collect();
        let sumsq: f64 = self
            .grads
            .shards
            .iter()
            .zip(&trainable)
            .filter(|(_, &t)| t)
            .map(|(g, _)| be.sumsq(g.v()))
            .sum();
        let mut red = [out.loss, sumsq];
        world.all_reduce(TMut::Host64(&mut red), Phase::Other)?;
        let (loss, norm) = (red[0], red[1].sqrt());
        if !loss.is_finite() {
            bail!(
                "loss is {loss} at step {}: training diverged (try a lower optimizer.lr than {})",
                step + 1,
                cfg.optimizer.lr
            );
        }
        let max_norm = cfg.training.grad_clip;
        if max_norm > 0.0 && norm.is_finite() && norm > max_norm {
            let coef = (max_norm / (norm + 1e-6)) as f32;
            for (g, _) in self
                .grads
                .shards
                .iter_mut()
                .zip(&trainable)
                .filter(|x| *x.1)
            {
                be.scale(g.vm(), coef);
            }
        }
        let lr = lr_at(&cfg.optimizer, step, cfg.training.steps);
        self.opt.step(
            be,
            &self.mesh,
            &mut self.params.master,
            &self.grads.shards,
            lr,
        )?;
        if cfg.model.router_bias_update > 0.0 {
            self.update_router_bias(&out.expert_load);
        }
        ctx.tracer
            .record("optimizer", Track::Compute, t0, Instant::now(), None);
        Ok(StepReport {
            loss,
            aux_loss: out.aux_loss,
            grad_norm: norm,
            lr,
            tokens: out.tokens,
            expert_load: out.expert_load,
            comm: ctx.stats.snapshot(),
        })
    }

    /// Collective: mean loss over `metrics.val_batches` fixed validation batches (aux excluded),
    /// each split over the ranks like a training batch: the single-process trainer's figure.
    pub fn validate(&mut self, data: &Dataset) -> Result<f64> {
        let world = self.mesh.dp_shard.clone();
        let (w, r) = (world.size(), world.rank());
        let (batch, seq) = (self.cfg.training.batch_size, self.cfg.model.seq_len);
        let per = batch / w;
        let nb = self.cfg.metrics.val_batches.max(1);
        let mut sums = vec![0f64; nb];
        for (i, s) in sums.iter_mut().enumerate() {
            let (x, y) = data.val_batch(i, batch, seq);
            let rows = r * per * seq..(r + 1) * per * seq;
            self.params.begin(&self.be, false, batch * seq);
            *s = forward_loss_with(
                &self.be,
                &self.model,
                &mut self.params,
                &mut *self.experts,
                &mut self.ws,
                &x[rows.clone()],
                &y[rows],
            )
            .loss;
        }
        world.all_reduce(TMut::Host64(&mut sums), Phase::Other)?;
        Ok(sums.iter().sum::<f64>() / nb as f64)
    }

    /// Collective: every parameter whole, gathered from the shards (checks, rank-0 saves).
    pub fn full_params(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.layout.specs.len())
            .map(|i| self.gather_whole(i, &self.params.master[i]))
            .collect()
    }

    /// The DeepSeek-V3 bias update of `ganymede_model::update_router_bias`, on this rank's
    /// slice of each bias (loads are the global batch's, so every rank agrees).
    fn update_router_bias(&mut self, loads: &[Vec<f32>]) {
        let coeff = self.cfg.model.router_bias_update;
        let biases: Vec<usize> = (0..self.layout.specs.len())
            .filter(|&i| {
                self.layout.specs[i].kind == ParamKind::Buffer
                    && self.layout.specs[i]
                        .name
                        .ends_with("e_score_correction_bias")
            })
            .collect();
        for (&i, load) in biases.iter().zip(loads) {
            let mean = load.iter().map(|&x| x as f64).sum::<f64>() / load.len() as f64;
            let rank = self.mesh.dp_shard.rank();
            let range = self.layout.range(i, rank);
            let t = &mut self.params.master[i];
            let mut b = self.be.download_f64(t.v());
            for (k, e) in range.enumerate() {
                let d = mean - load[e] as f64;
                let step = if d == 0.0 { 0.0 } else { coeff * d.signum() };
                b[k] = ((b[k] + step) as f32) as f64;
            }
            let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
            self.be.write(t.vm(), &b32);
        }
    }
}

/// How `train_threads` runs, beyond the configuration.
#[derive(Clone, Debug, Default)]
pub struct ParOptions {
    pub ranks: usize,
    /// Run directory (default `runs/<name>-<UTC timestamp>`).
    pub out: Option<PathBuf>,
    pub name: String,
    pub quiet: bool,
    /// Write a Chrome trace of every rank here.
    pub trace: Option<PathBuf>,
    /// Fault injection for tests: `(rank, step)` panics on that rank before that step.
    pub fail_at: Option<(usize, usize)>,
    /// Fault injection for tests: `(rank, step)` stalls that rank (sleeps past the timeout).
    pub stall_at: Option<(usize, usize)>,
    /// Checkpoint directory to continue from (written at any rank count).
    pub resume: Option<PathBuf>,
    /// Each rank writes its own shards (plus a layout manifest) instead of gathering every
    /// tensor to rank 0, as `parallelism.sharded_checkpoints` does; see [`crate::checkpoint`].
    pub sharded_checkpoints: bool,
}

/// What a sharded run reports.
#[derive(Clone, Debug)]
pub struct ParSummary {
    pub run_dir: PathBuf,
    pub losses: Vec<f64>,
    /// Rank 0's bytes of each step.
    pub comm: Vec<CommSnapshot>,
    /// Every rank's bytes of the last step.
    pub last_comm: Vec<CommSnapshot>,
    pub tokens_per_s: f64,
    /// Mean seconds per step, the first step excluded when there are several.
    pub step_s: f64,
    /// Validation loss after the last step.
    pub final_val_loss: Option<f64>,
}

struct RankOut {
    losses: Vec<f64>,
    comm: Vec<CommSnapshot>,
    step_secs: Vec<f64>,
    tokens: usize,
    val_loss: Option<f64>,
    /// First step run here (0, or the resumed checkpoint's).
    start: usize,
    tracer: Arc<Tracer>,
}

/// The run directory, its `config.toml` and (on the writing rank) `metrics.jsonl`.
fn prepare_run(
    cfg: &JobConfig,
    opts: &ParOptions,
    writer: bool,
) -> Result<(PathBuf, Option<std::fs::File>)> {
    let run_dir = opts.out.clone().unwrap_or_else(|| {
        ganymede_train::trainer::default_run_dir(if opts.name.is_empty() {
            "run"
        } else {
            &opts.name
        })
    });
    if !writer {
        return Ok((run_dir, None));
    }
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    ganymede_train::checkpoint::write_atomic(
        &run_dir.join("config.toml"),
        cfg.to_toml().as_bytes(),
    )?;
    let metrics_path = run_dir.join("metrics.jsonl");
    // A resumed run appends to the metrics of the run it continues.
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(opts.resume.is_some())
        .write(true)
        .truncate(opts.resume.is_none())
        .open(&metrics_path)
        .with_context(|| format!("cannot write {}", metrics_path.display()))?;
    Ok((run_dir, Some(f)))
}

fn banner(cfg: &JobConfig, n: usize, backend: &str, run_dir: &std::path::Path) {
    println!(
        "ganymede train: {n} ranks ({backend}), FSDP with {:?} gathers, prefetch {}, ep {}, Muon placement {:?}, run directory {}",
        cfg.parallelism.gather_dtype,
        cfg.parallelism.prefetch,
        cfg.parallelism.ep,
        cfg.parallelism.muon_placement,
        run_dir.display()
    );
}

/// One rank's whole run: build its state, resume, step, log (rank 0), checkpoint.
fn rank_loop(
    world: Arc<dyn ProcessGroup>,
    cfg: &JobConfig,
    opts: &ParOptions,
    data: &Dataset,
    run_dir: &std::path::Path,
    metrics: Option<&std::sync::Mutex<std::fs::File>>,
) -> Result<RankOut> {
    let run_start = Instant::now();
    let (rank, n) = (world.rank(), world.size());
    let tracer = world.ctx().tracer.clone();
    let mut st = RankState::new(world, cfg)?;
    let (mut start, mut tokens_seen) = (0, 0u64);
    if let Some(dir) = &opts.resume {
        let m = st.load_checkpoint(dir)?;
        (start, tokens_seen) = (m.data.next_step, m.tokens_seen);
        if start >= cfg.training.steps {
            bail!(
                "checkpoint {} is at step {start}, and training.steps = {}: nothing left to run",
                dir.display(),
                cfg.training.steps
            );
        }
    }
    let mut out = RankOut {
        losses: vec![],
        comm: vec![],
        step_secs: vec![],
        tokens: 0,
        val_loss: None,
        start,
        tracer,
    };
    for step in start..cfg.training.steps {
        if opts.fail_at == Some((rank, step)) {
            panic!("injected failure on rank {rank} at step {}", step + 1);
        }
        if opts.stall_at == Some((rank, step)) {
            std::thread::sleep(Duration::from_secs_f64(cfg.parallelism.timeout_s * 20.0));
        }
        let t0 = Instant::now();
        let r = st.step(data, step)?;
        let dt = t0.elapsed().as_secs_f64();
        tokens_seen += r.tokens as u64;
        out.losses.push(r.loss);
        out.step_secs.push(dt);
        out.tokens = r.tokens;
        let done = step + 1;
        let val_every = cfg.metrics.val_every;
        let val_loss =
            if done == cfg.training.steps || (val_every > 0 && done.is_multiple_of(val_every)) {
                Some(st.validate(data)?)
            } else {
                None
            };
        if val_loss.is_some() {
            out.val_loss = val_loss;
        }
        if let Some(metrics) = metrics {
            let (load_max_over_mean, load_cv) = load_balance(&r.expert_load);
            // metrics.jsonl's fields (see ganymede_train::metrics::StepMetrics) plus the
            // rank count and this rank's bytes per phase.
            let v = serde_json::json!({
                "step": step + 1,
                "loss": r.loss,
                "aux_loss": r.aux_loss,
                "lr": r.lr,
                "grad_norm": r.grad_norm,
                "tokens_per_s": r.tokens as f64 / dt.max(1e-9),
                "tokens_seen": tokens_seen,
                "elapsed_s": run_start.elapsed().as_secs_f64(),
                "load_max_over_mean": load_max_over_mean,
                "load_cv": load_cv,
                "ranks": n,
                "step_s": dt,
                "comm_bytes": r.comm.by_phase_json(),
                "comm": r.comm.entries,
            });
            let mut v = v;
            if let Some(vl) = val_loss {
                v["val_loss"] = vl.into();
            }
            writeln!(metrics.lock().unwrap(), "{v}")?;
            let every = cfg.metrics.log_every.max(1);
            if !opts.quiet
                && (done == 1
                    || done.is_multiple_of(every)
                    || done == cfg.training.steps
                    || val_loss.is_some())
            {
                println!(
                    "step {done:>6}/{} | loss {:.4} | aux {:.4} | lr {:.2e} | grad_norm {:.3} | {:.0} tok/s | sent {}{}",
                    cfg.training.steps,
                    r.loss,
                    r.aux_loss,
                    r.lr,
                    r.grad_norm,
                    r.tokens as f64 / dt.max(1e-9),
                    ganymede_train::metrics::human_bytes(r.comm.total().0),
                    val_loss.map_or(String::new(), |v| format!(" | val_loss {v:.4}"))
                );
            }
        }
        out.comm.push(r.comm);
        let ck = &cfg.checkpoint;
        if ck.enable
            && (done == cfg.training.steps || (ck.interval > 0 && done.is_multiple_of(ck.interval)))
        {
            let at = crate::checkpoint::Position {
                step: done,
                tokens_seen,
                data_seed: data.seed(),
            };
            if opts.sharded_checkpoints || cfg.parallelism.sharded_checkpoints {
                st.save_sharded_checkpoint(run_dir, &at)?;
            } else {
                st.save_checkpoint(run_dir, &at)?;
            }
        }
    }
    if metrics.is_some() {
        // Rank 0's peaks by category: Buffers holds the constant gather pool.
        let mem = ganymede_train::metrics::memory_json(&st.be.ledger().report(), None);
        ganymede_train::checkpoint::write_atomic(
            &run_dir.join("memory.json"),
            serde_json::to_string_pretty(&mem)?.as_bytes(),
        )?;
    }
    Ok(out)
}

fn summary(outs: &[RankOut], n: usize, run_dir: PathBuf, quiet: bool) -> ParSummary {
    let o0 = &outs[0];
    let skip = usize::from(o0.step_secs.len() > 1);
    let timed = &o0.step_secs[skip..];
    let step_s = timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    if !quiet {
        if let (Some(a), Some(b)) = (o0.losses.first(), o0.losses.last()) {
            println!(
                "steps {}..{}: loss {a:.4} -> {b:.4}{}; {:.0} tokens/s on {n} ranks; run directory {}",
                o0.start + 1,
                o0.start + o0.losses.len(),
                o0.val_loss.map_or(String::new(), |v| format!(", val_loss {v:.4}")),
                o0.tokens as f64 / step_s.max(1e-9),
                run_dir.display()
            );
        }
    }
    ParSummary {
        run_dir,
        losses: o0.losses.clone(),
        comm: o0.comm.clone(),
        last_comm: outs
            .iter()
            .map(|o| o.comm.last().cloned().unwrap_or_default())
            .collect(),
        tokens_per_s: o0.tokens as f64 / step_s.max(1e-9),
        step_s,
        final_val_loss: o0.val_loss,
    }
}

fn build_data(cfg: &JobConfig, dir: Option<&std::path::Path>) -> Result<Dataset> {
    let (m, t) = (&cfg.model, &cfg.training);
    Dataset::build(&cfg.data, m.vocab_size, m.seq_len, t.seed, dir)
}

/// Train with `opts.ranks` ranks as threads of this process; `parallelism.dp_shard` is set to
/// the rank count. Every step's metrics (rank 0's view, with its bytes per phase) go to
/// `RUN/metrics.jsonl`.
pub fn train_threads(cfg: &JobConfig, opts: &ParOptions) -> Result<ParSummary> {
    let n = opts.ranks.max(1);
    let mut cfg = cfg.clone();
    // The rank count decides dp_shard (a resumed checkpoint may come from another count).
    cfg.parallelism.dp_shard = n;
    cfg.validate()?;
    ganymede_train::trainer::init_threads(cfg.training.threads);
    let (run_dir, metrics) = prepare_run(&cfg, opts, true)?;
    let data = build_data(&cfg, Some(&run_dir.join("data")))?;
    let metrics = std::sync::Mutex::new(metrics.expect("writer"));
    if !opts.quiet {
        banner(&cfg, n, "threads", &run_dir);
    }
    let tcfg = ThreadsConfig {
        timeout: Duration::from_secs_f64(cfg.parallelism.timeout_s),
        trace: opts.trace.is_some(),
    };
    // Ranks run on detached threads, so a rank stuck outside any collective cannot hold the
    // job: once one rank has failed, the others get the collective timeout (plus a second) to
    // report, and any still running are left behind with an error naming them.
    let shared = Arc::new((cfg.clone(), opts.clone(), data, run_dir.clone(), metrics));
    let (tx, rx) = std::sync::mpsc::channel();
    for g in ganymede_dist::threads_world(n, &tcfg) {
        let (tx, shared) = (tx.clone(), shared.clone());
        std::thread::Builder::new()
            .name(format!("rank{}", g.rank()))
            .spawn(move || {
                let rank = g.rank();
                let world: Arc<dyn ProcessGroup> = Arc::new(g);
                let (cfg, opts, data, run_dir, metrics) = &*shared;
                // A panic drops the world handle while unwinding, which poisons the world, so
                // every other rank's collective fails at once naming this rank.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let w = (rank == 0).then_some(metrics);
                    rank_loop(world, cfg, opts, data, run_dir, w)
                }));
                let _ = tx.send((rank, r));
            })
            .context("cannot start a rank thread")?;
    }
    drop(tx);
    let mut results: Vec<Option<std::thread::Result<Result<RankOut>>>> =
        (0..n).map(|_| None).collect();
    let mut deadline: Option<Instant> = None;
    let grace = Duration::from_secs_f64(cfg.parallelism.timeout_s) + Duration::from_secs(1);
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
    let results: Vec<std::thread::Result<Result<RankOut>>> = results
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|| {
                Ok(Err(anyhow::anyhow!(
                    "rank {r} did not finish within {:.0} s of the first failure (stuck outside a collective?)",
                    grace.as_secs_f64()
                )))
            })
        })
        .collect();

    // The first failure in rank order; a panic (the root cause) before the errors it caused.
    let mut outs = Vec::new();
    let mut panics = Vec::new();
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(Ok(o)) => outs.push(o),
            Ok(Err(e)) => errors.push(format!("rank {r}: {e:#}")),
            Err(p) => panics.push(format!("rank {r}: {}", panic_message(p.as_ref()))),
        }
    }
    if !panics.is_empty() || !errors.is_empty() {
        let mut all = panics;
        all.extend(errors);
        bail!("sharded training failed: {}", all.join("; "));
    }
    if let Some(path) = &opts.trace {
        let tracers: Vec<&Tracer> = outs.iter().map(|o| o.tracer.as_ref()).collect();
        write_chrome_trace(path, &tracers)
            .with_context(|| format!("cannot write trace {}", path.display()))?;
    }
    Ok(summary(&outs, n, run_dir, opts.quiet))
}

/// Train as one rank of an MPI job (`mpirun -n N ganymede train …`); `parallelism.dp_shard`
/// is set to the job's size. Rank 0 writes the run directory and builds the data folder; the
/// others build the same tokens in memory. A failing rank prints its error and aborts the job,
/// and a stalled collective fails after `parallelism.timeout_s`, so no rank hangs. With a trace,
/// each rank writes `FILE.rank<r>.json`.
#[cfg(feature = "mpi")]
pub fn train_mpi(cfg: &JobConfig, opts: &ParOptions) -> Result<ParSummary> {
    let mcfg = ganymede_dist::mpi::MpiConfig {
        timeout: Duration::from_secs_f64(cfg.parallelism.timeout_s),
        trace: opts.trace.is_some(),
    };
    let (_mpi, world) = ganymede_dist::mpi::init(&mcfg)?;
    let (rank, n) = (world.rank(), world.size());
    if opts.out.is_none() {
        bail!("under mpirun, give --out: every rank must write to the same run directory");
    }
    let mut cfg = cfg.clone();
    cfg.parallelism.dp_shard = n;
    cfg.validate()?;
    ganymede_train::trainer::init_threads(cfg.training.threads);
    let (run_dir, metrics) = prepare_run(&cfg, opts, rank == 0)?;
    let data = if rank == 0 {
        build_data(&cfg, Some(&run_dir.join("data")))?
    } else {
        build_data(&cfg, None)?
    };
    if rank == 0 && !opts.quiet {
        banner(&cfg, n, "MPI", &run_dir);
    }
    let metrics = metrics.map(std::sync::Mutex::new);
    let dynw: Arc<dyn ProcessGroup> = world.clone();
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rank_loop(dynw, &cfg, opts, &data, &run_dir, metrics.as_ref())
    }));
    let out = match res {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            eprintln!("error: rank {rank}: {e:#}; aborting the MPI job");
            world.abort(1)
        }
        Err(p) => {
            eprintln!(
                "error: rank {rank} died: {}; aborting the MPI job",
                panic_message(p.as_ref())
            );
            world.abort(1)
        }
    };
    if let Some(path) = &opts.trace {
        let p = path.with_extension(format!("rank{rank}.json"));
        write_chrome_trace(&p, &[out.tracer.as_ref()])
            .with_context(|| format!("cannot write trace {}", p.display()))?;
    }
    Ok(summary(&[out], n, run_dir, opts.quiet || rank != 0))
}

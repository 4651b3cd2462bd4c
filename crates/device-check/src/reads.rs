//! The device check's step-reads section (issue 32: "no host read inside a step on one GPU",
//! then CUDA graphs): whole training steps of `RankState` (bf16 compute, two microbatches, Muon
//! and AdamW) on a backend wrapped in the read-counting one ([`CountingReads`]), its kernels
//! launched through a [`Recording`] launcher. Each step must run every update kernel before
//! anything is read back, never make the host wait for the device, and read its figures once
//! after the update: the squared norm, then each microbatch's loss sum and routing sums and
//! counts (`tiny`: two MoE layers of eight experts, `1 + 2·(1 + 32)` f64s). After the first
//! step, each step must launch what the one before it launched, kernel for kernel, shape for
//! shape and argument for argument (new batches and learning rates arrive in device memory),
//! which is what a CUDA graph captured from one step replays. The losses are held against the
//! CPU backend's. CI runs it on the kernels' host build, the device check on the GPU (with the
//! experts' GEMMs reading their rows from device offsets: the library's grouped GEMM reads each
//! layer's counts back).

use ganymede_config::JobConfig;
use ganymede_core::counting::CountingReads;
use ganymede_core::{Backend, CpuBackend, DType, Ledger};
use ganymede_cuda::launch::{Launch, LaunchLog};
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_parallel::RankState;
use std::fmt::Write as _;
use std::sync::Arc;

/// Steps per optimizer: the first, then two to compare launch for launch.
const STEPS: usize = 3;
/// The losses of the device against the CPU's, relative (bf16 compute, after updates).
const LOSS_TOL: f64 = 1e-3;

/// `tiny` small enough for the kernels' host build: 2 × 2 sequences of 64 a step, bf16, with
/// Newton–Schulz as a GPU runs it (bf16 products, matrices in batches; `auto` picks these on a
/// GPU), so that the host build, too, runs Muon's matrices one after another, in the order a
/// GPU launches them (on the CPU's threads they would interleave).
pub(crate) fn job(optimizer: &str) -> Result<JobConfig, String> {
    job_with(optimizer, &[])
}

/// [`job`] with more `--set`s.
pub(crate) fn job_with(optimizer: &str, more: &[&str]) -> Result<JobConfig, String> {
    let mut sets = vec![
        "optimizer.ns_dtype=bf16".into(),
        "optimizer.ns_batch=on".into(),
        format!("training.steps={STEPS}"),
        "training.batch_size=4".into(),
        "training.micro_batch_size=2".into(),
        "model.seq_len=64".into(),
        "training.compute_dtype=bf16".into(),
        "checkpoint.enable=false".into(),
        format!("optimizer.name={optimizer}"),
    ];
    sets.extend(more.iter().map(|s| s.to_string()));
    let cfg = JobConfig::load(Some("tiny"), None, &sets).map_err(|e| e.to_string())?;
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// What one step showed.
struct Seen {
    loss: f64,
    /// Per update kernel: reads and `sumsq`s before it (see [`CountingReads::updates`]).
    updates: Vec<(usize, usize)>,
    sumsqs: usize,
    reads: Vec<(DType, usize)>,
    waits: usize,
    /// The kernels it launched (none where the backend's launches are not recorded).
    launches: Vec<Launch>,
}

/// `STEPS` steps of `cfg` on `be` (one rank), each step's figures.
fn run<B: Backend + 'static>(
    be: Arc<CountingReads<B>>,
    log: Option<&LaunchLog>,
    cfg: &JobConfig,
    data: &Dataset,
) -> Result<Vec<Seen>, String> {
    let r = run_threads(1, &ThreadsConfig::default(), |world| {
        let dyn_be: Arc<dyn Backend> = be.clone();
        let mut st = RankState::with_backend(world, cfg, dyn_be).map_err(|e| format!("{e:#}"))?;
        let mut seen = vec![];
        for s in 0..STEPS {
            be.take();
            log.map(LaunchLog::take);
            let (sumsqs, waits) = (be.sumsqs(), be.waits());
            let loss = st.step(data, s).map_err(|e| format!("{e:#}"))?.loss;
            seen.push(Seen {
                loss,
                updates: be.updates(),
                sumsqs,
                reads: be.take(),
                waits: be.waits() - waits,
                launches: log.map(LaunchLog::take).unwrap_or_default(),
            });
        }
        Ok(seen)
    });
    r.into_iter().next().expect("one rank").unwrap_or_else(|p| {
        Err(p
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| "panicked".into()))
    })
}

/// Where two steps' launches first differ, if they do.
fn first_difference(a: &[Launch], b: &[Launch]) -> Option<String> {
    let at = a.iter().zip(b).position(|(a, b)| a != b);
    match (at, a.len() == b.len()) {
        (None, true) => None,
        (None, false) => Some(format!("{} launches, then {}", a.len(), b.len())),
        (Some(i), _) => Some(format!("launch {i} was\n    {}\nthen\n    {}", a[i], b[i])),
    }
}

/// The section's body for the backend `make` returns (wrapped here in the read-counting
/// backend) with the log of its kernel launches, against the CPU backend: markdown on success,
/// the table and the reasons on failure.
pub fn step_reads<B: Backend + 'static>(
    make: impl Fn() -> (B, LaunchLog),
) -> Result<String, String> {
    let mut md = String::from(
        "| optimizer | step | update kernels | reads before the first update | host waits | reads after | launches (as the step before) | loss (device / CPU) |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut failures = vec![];
    let want = [(DType::F64, 1 + 2 * 33)];
    for optimizer in ["muon", "adamw"] {
        let cfg = job(optimizer)?;
        let m = &cfg.model;
        let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None)
            .map_err(|e| e.to_string())?;
        let (be, log) = make();
        let dev = run(Arc::new(CountingReads::new(be)), Some(&log), &cfg, &data)?;
        let cpu = CpuBackend::new(Arc::new(Ledger::new()));
        let cpu = run(Arc::new(CountingReads::new(cpu)), None, &cfg, &data)?;
        for (s, (d, c)) in dev.iter().zip(&cpu).enumerate() {
            let before = d.updates.first().map_or(0, |u| u.0);
            let rel = (d.loss - c.loss).abs() / c.loss.abs().max(1e-30);
            let at = format!("{optimizer}, step {s}");
            // The first step makes what the others reuse (scratch, kernel handles, the compute
            // copies' first cast); the second is the first to compare.
            let repeat = match s {
                0 | 1 => None,
                _ => Some(first_difference(&dev[s - 1].launches, &d.launches)),
            };
            let same = match &repeat {
                None => "",
                Some(None) => " (same)",
                Some(Some(_)) => " (differ)",
            };
            let _ = writeln!(
                md,
                "| {optimizer} | {s} | {} | {before} | {} | {:?} | {}{same} | {:.6} / {:.6} ({rel:.1e}) |",
                d.updates.len(),
                d.waits,
                d.reads,
                d.launches.len(),
                d.loss,
                c.loss
            );
            if d.launches.is_empty() {
                failures.push(format!("{at}: no kernel launch was recorded"));
            }
            if let Some(Some(diff)) = repeat {
                failures.push(format!("{at}: not the launches of the step before: {diff}"));
            }
            if d.updates.is_empty() {
                failures.push(format!("{at}: no update kernel ran"));
            }
            if d.updates.iter().any(|&u| u != (0, d.sumsqs)) {
                failures.push(format!("{at}: reads before an update: {:?}", d.updates));
            }
            if d.reads != want {
                failures.push(format!("{at}: read {:?}, not {want:?}", d.reads));
            }
            if d.waits > 0 {
                failures.push(format!("{at}: the host waited {} times", d.waits));
            }
            if rel > LOSS_TOL {
                failures.push(format!(
                    "{at}: loss {rel:.1e} from the CPU's (tol {LOSS_TOL})"
                ));
            }
        }
    }
    match failures.is_empty() {
        true => Ok(md),
        false => Err(format!("{md}\n{}", failures.join("\n\n"))),
    }
}

/// The section on the GPU: the device's tuning with the experts' GEMMs on device offsets.
#[cfg(feature = "cuda")]
pub fn gpu_step_reads(be: &ganymede_cuda::device::CudaBackend) -> Result<String, String> {
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::kernel_backend::KernelBackend;
    use ganymede_cuda::launch::Recording;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    let tuning = Tuning {
        grouped_tc: true,
        ..Tuning::for_device(be.compute_major())?
    };
    step_reads(|| {
        let (launcher, log) = Recording::new(CudaLauncher::new(be.clone()));
        let ops = KernelOps::with_tuning(launcher, tuning);
        (KernelBackend::new(ops, be.clone()), log)
    })
}

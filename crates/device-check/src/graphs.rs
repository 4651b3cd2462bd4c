//! The device check's graph section (issue 32: "a CUDA-graph replay bitwise equal to eager"):
//! the same training steps of `RankState` (tiny, bf16 compute, two microbatches, a learning
//! rate that changes every step), once eagerly and once under `training.cuda_graphs`, each from
//! the same start on a fresh backend. Every step's loss and gradient norm, and every parameter
//! after the last step, must be the same bits. Both runs go through [`GraphCheck`]: on the
//! kernels' host build (CI), which has no graphs, it holds every later run of a graph's body to
//! what its first run wrote, so a write that belongs before the graph fails there too; on a GPU
//! the graphs are the driver's own.

use crate::reads::job_with;
use ganymede_config::JobConfig;
use ganymede_core::graph_check::{GraphCheck, GraphRuns};
use ganymede_core::Backend;
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_parallel::RankState;
use std::fmt::Write as _;
use std::sync::Arc;

/// Steps per run: the first is eager in both; the second captures the graphs (its second
/// microbatch already replays one), the third replays them all.
const STEPS: usize = 3;

/// What a run showed: each step's (loss, gradient norm), the parameters after the last step,
/// and its graphs' runs.
struct Run {
    steps: Vec<(f64, f64)>,
    params: Vec<Vec<f32>>,
    runs: GraphRuns,
}

fn run<B: Backend + 'static>(be: B, cfg: &JobConfig) -> Result<Run, String> {
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None)
        .map_err(|e| e.to_string())?;
    let be = Arc::new(GraphCheck::new(be));
    let r = run_threads(1, &ThreadsConfig::default(), |world| {
        let dyn_be: Arc<dyn Backend> = be.clone();
        let mut st = RankState::with_backend(world, cfg, dyn_be).map_err(|e| format!("{e:#}"))?;
        let mut steps = vec![];
        for s in 0..STEPS {
            let r = st.step(&data, s).map_err(|e| format!("{e:#}"))?;
            steps.push((r.loss, r.grad_norm));
        }
        let params = st.full_params().map_err(|e| format!("{e:#}"))?;
        Ok(Run {
            steps,
            params,
            runs: be.runs(),
        })
    });
    r.into_iter().next().expect("one rank").unwrap_or_else(|p| {
        Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into()))
    })
}

/// The first parameter (index, element) whose bits differ, if one does.
fn first_param_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> Option<(usize, usize)> {
    a.iter().zip(b).enumerate().find_map(|(i, (x, y))| {
        let j = x
            .iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != q.to_bits());
        match (j, x.len() == y.len()) {
            (Some(j), _) => Some((i, j)),
            (None, false) => Some((i, x.len().min(y.len()))),
            (None, true) => None,
        }
    })
}

/// The section's body on the backends `make` returns (a fresh one per run): markdown on
/// success, the table and the reasons on failure.
pub fn graph_replay<B: Backend + 'static>(make: impl Fn() -> B) -> Result<String, String> {
    let mut md = String::from(
        "| optimizer | step | loss eager | loss graphs | gradient norm eager / graphs | same bits |\n|---|---|---|---|---|---|\n",
    );
    let mut failures = vec![];
    let mut notes = vec![];
    for optimizer in ["muon", "adamw"] {
        let cfg = job_with(optimizer, &[])?;
        let eager = run(make(), &cfg)?;
        let graphs = run(
            make(),
            &job_with(optimizer, &["training.cuda_graphs=true"])?,
        )?;
        for (s, (e, g)) in eager.steps.iter().zip(&graphs.steps).enumerate() {
            let same = e.0.to_bits() == g.0.to_bits() && e.1.to_bits() == g.1.to_bits();
            let _ = writeln!(
                md,
                "| {optimizer} | {s} | {:.9} | {:.9} | {:.6e} / {:.6e} | {} |",
                e.0,
                g.0,
                e.1,
                g.1,
                if same { "yes" } else { "no" }
            );
            if !same {
                failures.push(format!(
                    "{optimizer}, step {s}: loss and norm {e:?} eagerly, {g:?} from graphs"
                ));
            }
        }
        let differs = first_param_difference(&eager.params, &graphs.params);
        if let Some((i, j)) = differs {
            failures.push(format!(
                "{optimizer}: after {STEPS} steps, parameter {i}'s element {j} differs: {:?} eagerly, {:?} from graphs",
                eager.params[i].get(j),
                graphs.params[i].get(j)
            ));
        }
        // Steps after the first: the zeroing, each microbatch and the update.
        let k = cfg.training.microbatches(1);
        let want = (STEPS - 1) * (2 + k);
        let GraphRuns {
            captured, replayed, ..
        } = graphs.runs;
        if captured != 3 || captured + replayed != want {
            failures.push(format!(
                "{optimizer}: {captured} graphs captured and {replayed} replays, not 3 and {}",
                want - 3
            ));
        }
        if eager.runs != GraphRuns::default() {
            failures.push(format!(
                "{optimizer}: the eager run made graphs: {:?}",
                eager.runs
            ));
        }
        notes.push(format!(
            "- {optimizer}: {captured} graphs captured ({} host writes or allocations in their bodies), {replayed} replays; all {} parameters' bits equal: {}",
            graphs.runs.captured_effects,
            eager.params.iter().map(Vec::len).sum::<usize>(),
            differs.is_none()
        ));
    }
    let _ = writeln!(md, "\n{}", notes.join("\n"));
    match failures.is_empty() {
        true => Ok(md),
        false => Err(format!("{md}\n{}", failures.join("\n\n"))),
    }
}

/// The section on the GPU: the device's tuning with the experts' GEMMs on device offsets (the
/// library's grouped GEMM reads each layer's counts back, which no graph can hold) and the
/// deterministic attention backward.
#[cfg(feature = "cuda")]
pub fn gpu_graph_replay(be: &ganymede_cuda::device::CudaBackend) -> Result<String, String> {
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::kernel_backend::KernelBackend;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    // dq in its own pass: the fused backward adds it with float atomics, whose order (and so
    // bits) changes from run to run, graphs or not.
    let tuning = Tuning {
        grouped_tc: true,
        attn_fused_dq: false,
        ..Tuning::for_device(be.compute_major())?
    };
    let md = graph_replay(|| {
        let ops = KernelOps::with_tuning(CudaLauncher::new(be.clone()), tuning);
        KernelBackend::new(ops, be.clone())
    })?;
    Ok(format!(
        "{md}\n- graphs held by the backend after both runs: {} (each run forgets its own)\n",
        be.graphs_held()
    ))
}

//! Train-step throughput of `forward_backward` at the `tiny` and `small` presets, both
//! activation-checkpointing modes: median tokens/s over N timed steps after warm-up.
//!
//! `cargo run --release -p ganymede-model --example step_bench -- [steps] [preset...]`
//! Threads: RAYON_NUM_THREADS (default: all cores).
//!
//! With `GANYMEDE_BENCH=casts`, instead: bf16 compute (`ac=none`), steps alternating between a
//! backend that honours `Gemm::unchanged` (the experts' cast reuse) and one that ignores it, side
//! by side, with the median of each and their ratio. `GANYMEDE_BENCH=outputs` likewise between
//! bf16 gate/up GEMM outputs (the default) and f32 ones (`Model::with_f32_outputs`).

use ganymede_config::{preset, AcMode};
use ganymede_core::{sample, Category, CpuBackend, ParamStore};
use ganymede_model::{activation_bytes, forward_backward, Model, Tokens, Workspace};
use std::time::Instant;

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}
extern "C" {
    fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
}
/// CPU seconds used by this process (all threads): on a machine shared with other jobs,
/// tokens per CPU-second × threads estimates the quiet-machine rate.
fn cpu_time() -> f64 {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // Safety: CLOCK_PROCESS_CPUTIME_ID (2) with a valid out-pointer.
    unsafe { clock_gettime(2, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(10);
    let names: Vec<&str> = if args.len() > 1 {
        args[1..].iter().map(|s| s.as_str()).collect()
    } else {
        vec!["tiny", "small"]
    };
    println!("threads: {}", rayon::current_num_threads());
    if let Ok(what @ ("casts" | "outputs")) = std::env::var("GANYMEDE_BENCH").as_deref() {
        return ab(steps, &names, what);
    }
    for name in names {
        let job = preset(name).expect("preset");
        let cfg = job.model;
        let (batch, seq) = (job.training.batch_size, cfg.seq_len);
        let be = CpuBackend::default();
        let model = Model::new(&cfg);
        let params = model.init_params(&be, 1);
        let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
        let n = batch * seq;
        let tokens = sample::tokens(2 * n, cfg.vocab_size, 12345);
        let (inputs, targets) = tokens.split_at(n);
        for mode in [AcMode::None, AcMode::Full] {
            println!(
                "{name:6} ac={mode:?}: activation workspace {:.1} MiB",
                activation_bytes(&cfg, batch, seq, mode) as f64 / (1 << 20) as f64
            );
            let mut ws = Workspace::new(&be, &model, batch, seq, mode);
            let (mut times, mut cpus) = (vec![], vec![]);
            for i in 0..steps + 2 {
                let (t, c) = (Instant::now(), cpu_time());
                forward_backward(
                    &be,
                    &model,
                    &params,
                    &mut grads,
                    &mut ws,
                    Tokens {
                        inputs,
                        targets,
                        doc_starts: None,
                    },
                    1.0,
                );
                if i >= 2 {
                    times.push(t.elapsed().as_secs_f64());
                    cpus.push(cpu_time() - c);
                }
            }
            let median = |v: &[f64]| sample::median(v).expect("timed steps");
            let (med, cpu) = (median(&times), median(&cpus));
            let best = times.iter().copied().fold(f64::INFINITY, f64::min);
            let threads = rayon::current_num_threads() as f64;
            println!(
                "{name:6} batch {batch} x seq {seq}  ac={mode:?}: {:8.0} tokens/s (median {:.1} ms/step, best {:.1} ms); {:.1} CPU-ms/step -> {:.0} tokens/s if the cores were free",
                n as f64 / med,
                med * 1e3,
                best * 1e3,
                cpu * 1e3,
                n as f64 / cpu * threads
            );
        }
    }
}

/// Median step seconds of two bf16-compute setups (backend, model) side by side, steps
/// alternating, `ac=none`: `GANYMEDE_BENCH=casts` compares the cast promises honoured and
/// ignored, `GANYMEDE_BENCH=outputs` bf16 gate/up outputs and f32 ones
/// (`Model::with_f32_outputs`).
fn ab(steps: usize, names: &[&str], what: &str) {
    use ganymede_config::ComputeDtype;
    for &name in names {
        let job = preset(name).expect("preset");
        let cfg = job.model;
        let (batch, seq) = (job.training.batch_size, cfg.seq_len);
        let model = || Model::new(&cfg).with_compute_dtype(ComputeDtype::Bf16);
        let (labels, setups) = match what {
            "casts" => (
                ["promises honoured", "ignored"],
                [
                    (CpuBackend::default(), model()),
                    (CpuBackend::default().with_cast_promises(false), model()),
                ],
            ),
            _ => (
                ["bf16 outputs", "f32 outputs"],
                [
                    (CpuBackend::default(), model()),
                    (CpuBackend::default(), model().with_f32_outputs(true)),
                ],
            ),
        };
        let n = batch * seq;
        let tokens = sample::tokens(2 * n, cfg.vocab_size, 12345);
        let (inputs, targets) = tokens.split_at(n);
        let mut state: Vec<_> = setups
            .iter()
            .map(|(be, model)| {
                let params = model.init_params(be, 1);
                let grads = ParamStore::zeros(be, model.param_specs(), Category::Grads);
                let ws = Workspace::new(be, model, batch, seq, AcMode::None);
                (params, grads, ws)
            })
            .collect();
        let mut times = [vec![], vec![]];
        for i in 0..steps + 2 {
            for (j, ((be, model), (params, grads, ws))) in
                setups.iter().zip(state.iter_mut()).enumerate()
            {
                let t = Instant::now();
                forward_backward(
                    be,
                    model,
                    params,
                    grads,
                    ws,
                    Tokens {
                        inputs,
                        targets,
                        doc_starts: None,
                    },
                    1.0,
                );
                if i >= 2 {
                    times[j].push(t.elapsed().as_secs_f64());
                }
            }
        }
        let med = |v: &[f64]| sample::median(v).expect("timed steps");
        let (a, b) = (med(&times[0]), med(&times[1]));
        println!(
            "{name:6} bf16 ac=none: {} {:.1} ms/step, {} {:.1} ms/step (median of {steps}); second/first {:.3}",
            labels[0],
            a * 1e3,
            labels[1],
            b * 1e3,
            b / a
        );
    }
}

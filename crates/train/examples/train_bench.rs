//! Whole training steps (zero grads, forward+backward, clip, optimizer, router-bias update), timed:
//! the same calls in the same order as the step loop in `ganymede_train::trainer::train`, minus
//! data loading, validation and metrics, so the number compares with a PyTorch step
//! (`bench/pytorch_qwen3moe.py`) on equal terms. Tokens are random: only speed is measured.
//!
//! `cargo run --release -p ganymede-train --example train_bench -- PRESET [--steps N]
//!     [--warmup N] [--set section.key=value]...`
//! Threads: `training.threads` (0 = RAYON_NUM_THREADS, else all cores). Prints one JSON line.

use ganymede_config::JobConfig;
use ganymede_core::{sample, Backend, Category, CpuBackend, GradScale, ParamStore};
use ganymede_model::{forward_backward, update_router_bias, Model, Tokens, Workspace};
use ganymede_optim::{clip_coef, global_norm, lr_at, Optimizer};
use std::time::Instant;

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}
extern "C" {
    fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
}
/// CPU seconds used by this process, all threads (CLOCK_PROCESS_CPUTIME_ID): on a shared
/// machine, wall time alone mixes our speed with the neighbours' load.
fn cpu_time() -> f64 {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // Safety: clock id 2 with a valid out-pointer.
    unsafe { clock_gettime(2, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let preset = args.next().unwrap_or_else(|| "tiny".into());
    let (mut steps, mut warmup, mut sets) = (20usize, 3usize, Vec::new());
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--steps" => steps = v.parse()?,
            "--warmup" => warmup = v.parse()?,
            "--set" => sets.push(v),
            _ => anyhow::bail!("unknown argument {a}"),
        }
    }
    let cfg = JobConfig::load(Some(&preset), None, &sets)?;
    cfg.validate()?;
    ganymede_train::trainer::init_threads(cfg.training.threads);

    let (m, t) = (&cfg.model, &cfg.training);
    let (batch, seq) = (t.batch_size, m.seq_len);
    let be = CpuBackend::default();
    let be: &dyn Backend = &be;
    let model = Model::new(m);
    let mut params = model.init_params(be, t.seed);
    let mut grads = ParamStore::zeros(be, model.param_specs(), Category::Grads);
    let mut opt = Optimizer::new(be, &cfg.optimizer, model.param_specs());
    let mut ws = Workspace::new(be, &model, batch, seq, cfg.activation_checkpoint.mode);

    // A fixed random batch (as step_bench's), like the PyTorch script.
    let n = batch * seq;
    let tokens = sample::tokens(2 * n, m.vocab_size, 12345);
    let (inputs, targets) = tokens.split_at(n);

    // Per step: wall, CPU, and the wall time of the optimizer part alone (clip + update), so
    // Muon's Newton–Schulz cost shows separately.
    let (mut wall, mut cpu, mut opt_wall) = (vec![], vec![], vec![]);
    let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
    let total = warmup + steps;
    for step in 0..total {
        let (t0, c0) = (Instant::now(), cpu_time());
        for g in grads.tensors_mut() {
            be.fill(g.view_mut(), 0.0);
        }
        let out = forward_backward(
            be,
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
        let t1 = Instant::now();
        // As the trainer: the clip coefficient goes into the update kernels.
        let coef = clip_coef(global_norm(be, &grads), t.grad_clip).unwrap_or(1.0);
        let lr = lr_at(&cfg.optimizer, step, total);
        opt.step_scaled(be, &mut params, &grads, lr, GradScale::Host(coef));
        if m.router_bias_update > 0.0 {
            update_router_bias(be, &model, &mut params, &out);
        }
        be.synchronize();
        if step == 0 {
            first_loss = out.loss;
        }
        last_loss = out.loss;
        if step >= warmup {
            wall.push(t0.elapsed().as_secs_f64());
            cpu.push(cpu_time() - c0);
            opt_wall.push(t1.elapsed().as_secs_f64());
        }
    }
    let median = |v: &[f64]| sample::median(v).expect("at least one timed step (--steps)");
    let (med, med_cpu) = (median(&wall), median(&cpu));
    println!(
        "{}",
        serde_json::json!({
            "framework": "ganymede",
            "preset": preset,
            "threads": rayon::current_num_threads(),
            "optimizer": format!("{:?}", cfg.optimizer.name).to_lowercase(),
            "ac": format!("{:?}", cfg.activation_checkpoint.mode).to_lowercase(),
            "params": params.numel(),
            "tokens_per_step": n,
            "median_step_s": med,
            "median_cpu_s": med_cpu,
            "median_opt_s": median(&opt_wall),
            "tokens_per_s": n as f64 / med,
            "tokens_per_cpu_s": n as f64 / med_cpu,
            "first_loss": first_loss,
            "last_loss": last_loss,
        })
    );
    Ok(())
}

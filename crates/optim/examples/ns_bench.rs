//! Newton–Schulz timings on the CPU backend: time per matrix size (median and minimum of several
//! runs, and CPU time per run), and a whole optimizer step for the `tiny` and `small` presets'
//! parameter shapes (Muon with small matrices across threads or one after another; AdamW).
//!
//! cargo run --release -p ganymede-optim --example ns_bench [-- THREADS]

use ganymede_config::{OptimizerConfig, OptimizerName};
use ganymede_core::sample::median;
use ganymede_core::{Backend, Category, CpuBackend, Memory, ParamKind, ParamSpec, ParamStore};
use ganymede_optim::{newton_schulz, ns_flops, NsScratch, NsSteps, Optimizer};
use std::time::Instant;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Seconds of CPU time this process has used (user + system), from /proc on Linux; None
/// elsewhere. Wall time on a shared machine swings with other processes' load; CPU time per run
/// shows the work itself, and wall/CPU the parallel efficiency.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ is 100 on Linux
}

struct Timing {
    median: f64,
    min: f64,
    /// Mean CPU seconds per run (NaN where unavailable).
    cpu: f64,
}

impl Timing {
    fn ms(&self) -> String {
        format!(
            "median {:8.2} ms, min {:8.2} ms, cpu {:8.2} ms",
            self.median * 1e3,
            self.min * 1e3,
            self.cpu * 1e3
        )
    }
}

/// Times the closures round-robin (one run of each per round, so that all see the same load on
/// a shared machine) for about `budget` seconds, at least 5 and at most 50 rounds, after a
/// warm-up round.
fn time(budget: f64, fs: &mut [&mut dyn FnMut()]) -> Vec<Timing> {
    fs.iter_mut().for_each(|f| f());
    let mut walls = vec![Vec::new(); fs.len()];
    let mut cpus = vec![0.0; fs.len()];
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < 5 || (rounds < 50 && start.elapsed().as_secs_f64() < budget) {
        for (i, f) in fs.iter_mut().enumerate() {
            let (t, c) = (Instant::now(), cpu_seconds());
            f();
            walls[i].push(t.elapsed().as_secs_f64());
            cpus[i] += match (c, cpu_seconds()) {
                (Some(a), Some(b)) => b - a,
                _ => f64::NAN,
            };
        }
        rounds += 1;
    }
    walls
        .into_iter()
        .zip(cpus)
        .map(|(w, cpu)| Timing {
            median: median(&w).expect("at least 5 rounds"),
            min: w.iter().copied().fold(f64::INFINITY, f64::min),
            cpu: cpu / rounds as f64,
        })
        .collect()
}

/// Parameter shapes of a preset's model (as the model lays them out for MoE-only presets).
fn preset_specs(preset: &str) -> Vec<ParamSpec> {
    let m = ganymede_config::preset(preset).expect("a preset").model;
    let (v, h, layers) = (m.vocab_size, m.hidden, m.layers);
    let (q, kv, e, f, hd) = (
        m.q_dim(),
        m.kv_dim(),
        m.experts,
        m.expert_hidden,
        m.head_dim,
    );
    let mut s = vec![ParamSpec::new("embed", &[v, h], ParamKind::Embedding)];
    for l in 0..layers {
        let p = |n: &str| format!("layers.{l}.{n}");
        s.push(ParamSpec::new(p("input_norm"), &[h], ParamKind::Vector));
        s.push(ParamSpec::new(p("q_proj"), &[q, h], ParamKind::Matrix));
        s.push(ParamSpec::new(p("k_proj"), &[kv, h], ParamKind::Matrix));
        s.push(ParamSpec::new(p("v_proj"), &[kv, h], ParamKind::Matrix));
        s.push(ParamSpec::new(p("o_proj"), &[h, q], ParamKind::Matrix));
        s.push(ParamSpec::new(p("q_norm"), &[hd], ParamKind::Vector));
        s.push(ParamSpec::new(p("k_norm"), &[hd], ParamKind::Vector));
        s.push(ParamSpec::new(p("post_norm"), &[h], ParamKind::Vector));
        s.push(ParamSpec::new(p("router"), &[e, h], ParamKind::Router));
        s.push(ParamSpec::new(p("gate"), &[e, f, h], ParamKind::Experts));
        s.push(ParamSpec::new(p("up"), &[e, f, h], ParamKind::Experts));
        s.push(ParamSpec::new(p("down"), &[e, h, f], ParamKind::Experts));
    }
    s.push(ParamSpec::new("norm", &[h], ParamKind::Vector));
    s.push(ParamSpec::new("lm_head", &[v, h], ParamKind::LmHead));
    s
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("THREADS"))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    let be = CpuBackend::default();
    let dynbe: &dyn Backend = &be;
    println!("Newton–Schulz, 5 steps, f32, {threads} thread(s)");
    for &(r, c) in &[
        (64, 64),
        (128, 128),
        (256, 256),
        (512, 512),
        (1024, 1024),
        (256, 1024),
        (1024, 256),
    ] {
        let g = random(r * c, (r * c) as u64);
        let mut x = be.upload(&g, &[r, c], Category::Params);
        let mut scratch = NsScratch::new(dynbe, r, c);
        let t = time(
            3.0,
            &mut [&mut || {
                be.write(x.view_mut(), &g);
                newton_schulz(
                    dynbe,
                    x.view_mut(),
                    r,
                    c,
                    NsSteps::muon(5),
                    false,
                    &mut scratch,
                );
            }],
        )
        .remove(0);
        let gf = ns_flops(r, c, 5) as f64 / t.median / 1e9;
        println!(
            "{:>10}: {} ({gf:5.1} GFLOP/s at the median)",
            format!("{r}x{c}"),
            t.ms()
        );
    }

    // A whole optimizer step for the presets' parameters: Muon + AdamW with small matrices spread
    // across threads (the default) or one after another with each GEMM split, and AdamW alone.
    // tiny: vocab 256, hidden 64, 2 layers, 4 q / 2 kv heads of 16, 8 experts of 128.
    // small: vocab 4096, hidden 256, 4 layers, 8 q / 4 kv heads of 32, 16 experts of 256.
    let presets = [
        ("tiny", preset_specs("tiny")),
        ("small", preset_specs("small")),
    ];
    for (name, specs) in presets {
        let mut grads = ParamStore::zeros(dynbe, &specs, Category::Grads);
        for (i, (_, g)) in grads.iter_mut().enumerate() {
            let data = random(g.len(), 100 + i as u64);
            be.write(g.view_mut(), &data);
        }
        let nsf: u64 = specs
            .iter()
            .filter(|s| s.kind.is_muon())
            .map(|s| {
                let d = &s.shape[s.shape.len() - 2..];
                (s.numel() / (d[0] * d[1])) as u64 * ns_flops(d[0], d[1], 5)
            })
            .sum();
        println!(
            "{name} ({:.2}M params; Newton–Schulz {:.2} GFLOP per step):",
            grads.numel() as f64 / 1e6,
            nsf as f64 / 1e9
        );
        let setups = [
            ("muon, matrices across  ", OptimizerName::Muon, true),
            ("muon, one after another", OptimizerName::Muon, false),
            ("adamw                  ", OptimizerName::Adamw, true),
        ];
        let mut runs: Vec<(Optimizer, ParamStore)> = setups
            .iter()
            .map(|&(_, name, parallel)| {
                let cfg = OptimizerConfig {
                    name,
                    ..Default::default()
                };
                let mut opt = Optimizer::new(dynbe, &cfg, &specs);
                opt.set_matrix_parallel(parallel);
                (opt, ParamStore::zeros(dynbe, &specs, Category::Params))
            })
            .collect();
        let grads = &grads;
        let mut steps: Vec<Box<dyn FnMut() + '_>> = runs
            .iter_mut()
            .map(|(opt, params)| {
                Box::new(move || opt.step(dynbe, params, grads, 1e-3)) as Box<dyn FnMut()>
            })
            .collect();
        let mut fs: Vec<&mut dyn FnMut()> = steps.iter_mut().map(|f| &mut **f as _).collect();
        let times = time(12.0, &mut fs);
        drop(steps);
        for ((how, _, _), (t, (opt, _))) in setups.iter().zip(times.iter().zip(&runs)) {
            println!(
                "  {how}: {}; state {:.1} MiB, scratch {:.2} MiB",
                t.ms(),
                opt.state_bytes() as f64 / (1 << 20) as f64,
                opt.scratch_bytes() as f64 / (1 << 20) as f64
            );
        }
    }
}

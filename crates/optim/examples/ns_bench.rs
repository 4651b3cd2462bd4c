//! Newton–Schulz timings on the CPU backend: time per matrix size (median and minimum of several
//! runs, and CPU time per run), and a whole optimizer step for the `tiny` and `small` presets'
//! parameter shapes (Muon with small matrices across threads or one after another; AdamW).
//!
//! cargo run --release -p ganymede-optim --example ns_bench [-- THREADS]

use ganymede_config::{OptimizerConfig, OptimizerName};
use ganymede_core::{Backend, Category, CpuBackend, Memory, ParamKind, ParamSpec, ParamStore};
use ganymede_optim::{newton_schulz, ns_flops, NsScratch, Optimizer};
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

/// Times `f` over enough runs to fill about `budget` seconds (at least 5, at most 50), after a
/// warm-up run.
fn time(budget: f64, mut f: impl FnMut()) -> Timing {
    f();
    let mut times = Vec::new();
    let (start, cpu0) = (Instant::now(), cpu_seconds());
    while times.len() < 5 || (times.len() < 50 && start.elapsed().as_secs_f64() < budget) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    let cpu = match (cpu0, cpu_seconds()) {
        (Some(a), Some(b)) => (b - a) / times.len() as f64,
        _ => f64::NAN,
    };
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Timing {
        median: times[times.len() / 2],
        min: times[0],
        cpu,
    }
}

/// Parameter shapes of a preset (as the model lays them out): vocab, hidden, layers, q and kv
/// width, experts, expert hidden, head dim.
#[allow(clippy::too_many_arguments)]
fn preset_specs(
    v: usize,
    h: usize,
    layers: usize,
    q: usize,
    kv: usize,
    e: usize,
    f: usize,
    hd: usize,
) -> Vec<ParamSpec> {
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
        let t = time(3.0, || {
            be.write(x.vm(), &g);
            newton_schulz(dynbe, x.vm(), r, c, 5, &mut scratch);
        });
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
        ("tiny", preset_specs(256, 64, 2, 64, 32, 8, 128, 16)),
        ("small", preset_specs(4096, 256, 4, 256, 128, 16, 256, 32)),
    ];
    for (name, specs) in presets {
        let mut params = ParamStore::zeros(dynbe, &specs, Category::Params);
        let mut grads = ParamStore::zeros(dynbe, &specs, Category::Grads);
        for (i, (_, g)) in grads.iter_mut().enumerate() {
            let data = random(g.len(), 100 + i as u64);
            be.write(g.vm(), &data);
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
            params.numel() as f64 / 1e6,
            nsf as f64 / 1e9
        );
        for (opt_name, parallel) in [
            (OptimizerName::Muon, true),
            (OptimizerName::Muon, false),
            (OptimizerName::Adamw, true),
        ] {
            let cfg = OptimizerConfig {
                name: opt_name,
                ..Default::default()
            };
            let mut opt = Optimizer::new(dynbe, &cfg, &specs);
            opt.set_matrix_parallel(parallel);
            let t = time(6.0, || opt.step(dynbe, &mut params, &grads, 1e-3));
            let how = match (opt_name, parallel) {
                (OptimizerName::Adamw, _) => "adamw                 ",
                (_, true) => "muon, matrices across ",
                (_, false) => "muon, one after another",
            };
            println!(
                "  {how}: {}; state {:.1} MiB, scratch {:.2} MiB",
                t.ms(),
                opt.state_bytes() as f64 / (1 << 20) as f64,
                opt.scratch_bytes() as f64 / (1 << 20) as f64
            );
        }
    }
}

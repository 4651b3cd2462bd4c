//! Newton–Schulz timings on the CPU backend: time per matrix size (median of several runs), the
//! `small` preset's expert stacks one after another versus spread across threads, and a whole
//! Muon + AdamW step for `small`'s parameter shapes.
//!
//! cargo run --release -p ganymede-optim --example ns_bench [-- THREADS]

use ganymede_config::OptimizerConfig;
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

/// Median seconds of `f` over enough runs to fill about `budget` seconds (at least 3, at most 25).
fn median(budget: f64, mut f: impl FnMut()) -> f64 {
    f(); // warm-up
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (times.len() < 25 && start.elapsed().as_secs_f64() < budget) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[times.len() / 2]
}

fn small_preset_specs() -> Vec<ParamSpec> {
    // `small`: vocab 4096, hidden 256, 4 layers, 8 q heads and 4 kv heads of 32, 16 experts of 256.
    let (v, h, q, kv, e, f) = (4096, 256, 256, 128, 16, 256);
    let mut s = vec![ParamSpec::new("embed", &[v, h], ParamKind::Embedding)];
    for l in 0..4 {
        let p = |n: &str| format!("layers.{l}.{n}");
        s.push(ParamSpec::new(p("input_norm"), &[h], ParamKind::Vector));
        s.push(ParamSpec::new(p("q_proj"), &[q, h], ParamKind::Matrix));
        s.push(ParamSpec::new(p("k_proj"), &[kv, h], ParamKind::Matrix));
        s.push(ParamSpec::new(p("v_proj"), &[kv, h], ParamKind::Matrix));
        s.push(ParamSpec::new(p("o_proj"), &[h, q], ParamKind::Matrix));
        s.push(ParamSpec::new(p("q_norm"), &[32], ParamKind::Vector));
        s.push(ParamSpec::new(p("k_norm"), &[32], ParamKind::Vector));
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
    println!("Newton–Schulz, 5 steps, f32, {threads} thread(s); median of runs");
    println!("{:>11} {:>10} {:>9}", "shape", "ms", "GFLOP/s");
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
        let t = median(2.0, || {
            be.write(x.vm(), &g);
            newton_schulz(dynbe, x.vm(), r, c, 5, &mut scratch);
        });
        let gf = ns_flops(r, c, 5) as f64 / t / 1e9;
        println!("{:>11} {:>10.3} {:>9.1}", format!("{r}x{c}"), t * 1e3, gf);
    }

    // The `small` preset's 192 expert matrices of 256×256 (12 stacks of 16) through the
    // optimizer: one after another with each GEMM split across threads, versus whole matrices
    // spread across threads.
    let specs: Vec<ParamSpec> = (0..12)
        .map(|i| ParamSpec::new(format!("experts.{i}"), &[16, 256, 256], ParamKind::Experts))
        .collect();
    let mut params = ParamStore::zeros(dynbe, &specs, Category::Params);
    let mut grads = ParamStore::zeros(dynbe, &specs, Category::Grads);
    for (i, (_, g)) in grads.iter_mut().enumerate() {
        let data = random(g.len(), 7 + i as u64);
        be.write(g.vm(), &data);
    }
    let mut opt = Optimizer::new(dynbe, &OptimizerConfig::default(), &specs);
    let mut time = |parallel: bool| {
        opt.set_matrix_parallel(parallel);
        median(4.0, || opt.step(dynbe, &mut params, &grads, 1e-3))
    };
    let (seq, par) = (time(false), time(true));
    println!(
        "192 x 256x256 Muon (small's experts): one after another {:.0} ms, across threads {:.0} ms",
        seq * 1e3,
        par * 1e3
    );

    // A whole optimizer step for `small`'s parameters (Muon + AdamW).
    let specs = small_preset_specs();
    let mut params = ParamStore::zeros(dynbe, &specs, Category::Params);
    let mut grads = ParamStore::zeros(dynbe, &specs, Category::Grads);
    for (i, (_, g)) in grads.iter_mut().enumerate() {
        let data = random(g.len(), 100 + i as u64);
        be.write(g.vm(), &data);
    }
    let cfg = OptimizerConfig::default();
    let mut opt = Optimizer::new(dynbe, &cfg, &specs);
    let t = median(6.0, || opt.step(dynbe, &mut params, &grads, 1e-3));
    println!(
        "small preset optimizer step ({:.1}M params, Muon + AdamW): {:.1} ms; state {:.1} MiB, scratch {:.1} MiB",
        params.numel() as f64 / 1e6,
        t * 1e3,
        opt.state_bytes() as f64 / (1 << 20) as f64,
        opt.scratch_bytes() as f64 / (1 << 20) as f64
    );
}

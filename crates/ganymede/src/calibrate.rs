//! `ganymede calibrate`: measure this machine's CPU backend in a few seconds and write a cluster
//! file (the `local` preset with a measured `[cpu]` section) for `ganymede plan --cluster FILE`.
//!
//! Measures, on a rayon pool of the training thread count: GEMM rate over a range of sizes (the
//! presets' shapes run far below peak when small), on the whole pool and on one thread; the
//! streaming element-wise rate on activation-sized buffers; the fork/join cost of one parallel
//! kernel; and one barrier round among ranks as threads. Each figure is the median of several
//! timed batches, so a neighbour's burst moves it less.

use anyhow::{Context, Result};
use ganymede_core::{Blas, Category, CpuBackend, Gemm, Memory};
use ganymede_plan::{Cluster, CpuSpec};
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// GEMM shapes m×n×k (B transposed, as the model's weights), from 65 kFLOP to 1 GFLOP: the
/// sizes of `tiny`'s and `small`'s projections, experts, attention heads and Newton–Schulz.
const SHAPES: &[(usize, usize, usize)] = &[
    (32, 32, 32),
    (64, 64, 64),
    (128, 64, 64),
    (128, 128, 64),
    (256, 128, 64),
    (256, 128, 128),
    (256, 256, 256),
    (512, 256, 256),
    (1024, 256, 256),
    (2048, 256, 256),
    (1024, 1024, 512),
];

/// Median seconds of one call of `f`, timing batches of about `batch_s` seconds.
fn median_time(batch_s: f64, batches: usize, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    f();
    let once = t.elapsed().as_secs_f64().max(1e-8);
    let reps = ((batch_s / once) as usize).clamp(1, 100_000);
    let mut v: Vec<f64> = (0..batches)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GEMM rate of every shape on the whole pool and on one thread, `[FLOPs, FLOP/s]` each.
/// Rounds go over all shapes and both pools in turn, so a change of load during calibration
/// lands on every point alike instead of bending the curve; each point is its median round.
fn gemm_curves(
    be: &CpuBackend,
    pool: &rayon::ThreadPool,
    one: &rayon::ThreadPool,
    batch_s: f64,
    rounds: usize,
) -> (Vec<[f64; 2]>, Vec<[f64; 2]>) {
    let mut cases: Vec<_> = SHAPES
        .iter()
        .map(|&(m, n, k)| {
            let a = be.upload(&vec![0.5; m * k], &[m * k], Category::Buffers);
            let b = be.upload(&vec![0.25; n * k], &[n * k], Category::Buffers);
            let c = be.zeros(&[m * n], Category::Buffers);
            (Gemm::new(m, n, k, false, true), a, b, c, 1usize)
        })
        .collect();
    // Calls per batch: as many as fit in `batch_s` when warm, so that a batch is long against
    // the timer and the wake-up of the pool.
    for (g, a, b, c, reps) in &mut cases {
        pool.install(|| {
            let t = Instant::now();
            let mut n = 0;
            while n < 3 || t.elapsed().as_secs_f64() < batch_s {
                be.gemm(c.view_mut(), a.view(), b.view(), *g);
                n += 1;
            }
            *reps = n;
        });
    }
    let mut times = vec![[vec![], vec![]]; cases.len()];
    for _ in 0..rounds {
        for (i, (g, a, b, c, reps)) in cases.iter_mut().enumerate() {
            for (j, p) in [pool, one].into_iter().enumerate() {
                let t = p.install(|| {
                    let t = Instant::now();
                    for _ in 0..*reps {
                        be.gemm(c.view_mut(), a.view(), b.view(), *g);
                    }
                    t.elapsed().as_secs_f64() / *reps as f64
                });
                times[i][j].push(t);
            }
        }
    }
    let curve = |j: usize| {
        cases
            .iter()
            .zip(&times)
            .map(|((g, ..), t)| {
                let mut t = t[j].clone();
                t.sort_by(f64::total_cmp);
                let flops = g.flops() as f64;
                [flops, flops / t[t.len() / 2]]
            })
            .collect()
    };
    (curve(0), curve(1))
}

/// Measure with a pool of `threads` (0 = all cores).
pub fn measure(threads: usize, quick: bool) -> Result<CpuSpec> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if threads == 0 { cores } else { threads };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building the calibration thread pool")?;
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("building the one-thread pool")?;
    let (batch_s, rounds) = if quick { (0.003, 3) } else { (0.01, 9) };
    let be = CpuBackend::default();
    let (gemm, gemm_one_thread) = gemm_curves(&be, &pool, &one, batch_s, rounds);
    // Streaming: y += a·x (12 bytes per element: read x and y, write y) at two
    // activation-sized lengths, both above the backend's parallel threshold; a line through the
    // two times gives the fixed cost of one parallel kernel (fork/join, waking the pool) and the
    // bytes per second.
    let stream = |n: usize| {
        let x = be.upload(&vec![1.0; n], &[n], Category::Buffers);
        let mut y = be.zeros(&[n], Category::Buffers);
        let t = pool.install(|| median_time(batch_s, 7, || be.axpy(y.view_mut(), 1e-3, x.view())));
        (12.0 * n as f64, t)
    };
    let (b1, t1) = stream(1 << 16);
    let (b2, t2) = stream(1 << 19);
    let per_byte = ((t2 - t1) / (b2 - b1)).max(t2 / b2 * 0.5);
    let elementwise_bytes_per_s = 1.0 / per_byte;
    let op_overhead_s = (t1 - b1 * per_byte).max(0.0);
    // One barrier round among 4 threads (ranks as threads meet at every collective).
    let ranks = 4;
    let rounds = if quick { 200 } else { 2000 };
    let barrier = Arc::new(Barrier::new(ranks));
    let t = Instant::now();
    let hs: Vec<_> = (0..ranks)
        .map(|_| {
            let b = barrier.clone();
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    b.wait();
                }
            })
        })
        .collect();
    for h in hs {
        h.join()
            .map_err(|_| anyhow::anyhow!("a barrier thread panicked"))?;
    }
    let sync_s = t.elapsed().as_secs_f64() / rounds as f64;
    Ok(CpuSpec {
        cores: cores as f64,
        threads,
        gemm,
        gemm_one_thread,
        elementwise_bytes_per_s,
        op_overhead_s,
        sync_s,
        calibrated: String::new(),
    })
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn utc_now() -> String {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (s / 86_400, s % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Calibrate and write the cluster file; returns the cluster written.
pub fn run(threads: usize, out: &Path, quick: bool) -> Result<Cluster> {
    let before = loadavg();
    let t = Instant::now();
    let mut spec = measure(threads, quick)?;
    spec.calibrated = format!(
        "{}, {} threads on {} cores, load average {} before / {} after, {:.1} s",
        utc_now(),
        spec.threads,
        spec.cores,
        before,
        loadavg(),
        t.elapsed().as_secs_f64()
    );
    let mut c = Cluster::preset("local")?;
    c.name = "local-calibrated".into();
    c.description = format!("{} Calibrated {}.", c.description, spec.calibrated);
    c.gpu.peak_flops = spec.gemm.iter().map(|p| p[1]).fold(0.0, f64::max);
    c.gpu.gemm_efficiency = 1.0;
    c.gpu.memory_bytes_per_s = spec.elementwise_bytes_per_s;
    c.cpu = Some(spec);
    // What is written must be what the planner accepts.
    c.validate(&out.display().to_string())?;
    let text = format!(
        "# Written by `ganymede calibrate`; use with `ganymede plan --cluster {}`.\n{}",
        out.display(),
        c.to_toml()
    );
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    Ok(c)
}

/// The summary `calibrate` prints.
pub fn summary(c: &Cluster, out: &Path) -> String {
    let s = c.cpu.as_ref().expect("calibrated");
    let curve = |v: &[[f64; 2]]| {
        v.iter()
            .map(|p| format!("{:.2}M:{:.1}", p[0] / 1e6, p[1] / 1e9))
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        "calibrated {}\nGEMM GFLOP/s by MFLOP per call, {} threads: {}\n  one thread: {}\nelement-wise {:.1} GB/s, fork/join {:.1} us, barrier (4 threads) {:.1} us\nwrote {}\n",
        s.calibrated,
        s.threads,
        curve(&s.gemm),
        curve(&s.gemm_one_thread),
        s.elementwise_bytes_per_s / 1e9,
        s.op_overhead_s * 1e6,
        s.sync_s * 1e6,
        out.display()
    )
}

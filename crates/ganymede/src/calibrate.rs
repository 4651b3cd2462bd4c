//! `ganymede calibrate`: measure this machine's CPU backend in a few seconds and write a cluster
//! file (the `local` preset with a measured `[cpu]` section) for `ganymede plan --cluster FILE`.
//!
//! Measures, on a rayon pool of the training thread count: GEMM rate over a range of sizes (the
//! presets' shapes run far below peak when small), on the whole pool and on one thread, operands
//! from memory; the fused attention kernel by head dim; the element-wise rate (SwiGLU) and the
//! fixed cost of one parallel kernel; the optimizer update's rate over state in memory (AdamW);
//! and one barrier round among ranks as threads. Each figure is the median of several timed
//! batches, so a neighbour's burst moves it less.

use anyhow::{Context, Result};
use ganymede_core::sample::{median, values};
use ganymede_core::{
    AdamWStep, AttnDims, AttnGrads, AttnSaved, Backend, Blas, Category, CpuBackend, DType, Gemm,
    Ledger, Memory, NnOps, OptimOps, Stream, Tensor, TwoMemoryOptions,
};
use ganymede_plan::{Cluster, CpuSpec, GpuMeasured};
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
    let v: Vec<f64> = (0..batches)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    median(&v).expect("at least one batch")
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
    // Each shape cycles through copies of its operands covering `COLD_BYTES`, so that, as in
    // a training step (which touches every layer's weights and activations in between), a
    // call finds its operands in memory rather than in the cache the previous call warmed.
    const COLD_BYTES: usize = 48 << 20;
    let mut cases: Vec<_> = SHAPES
        .iter()
        .map(|&(m, n, k)| {
            let bytes = 4 * (m * k + n * k + m * n);
            let copies = (COLD_BYTES / bytes).clamp(1, 4096);
            let ops: Vec<_> = (0..copies)
                .map(|_| {
                    let a = be.upload(&vec![0.5; m * k], &[m * k], Category::Buffers);
                    let b = be.upload(&vec![0.25; n * k], &[n * k], Category::Buffers);
                    let c = be.zeros(&[m * n], Category::Buffers);
                    (a, b, c)
                })
                .collect();
            (Gemm::new(m, n, k, false, true), ops, 1usize)
        })
        .collect();
    let call = |g: &Gemm,
                ops: &mut Vec<(
        ganymede_core::Tensor,
        ganymede_core::Tensor,
        ganymede_core::Tensor,
    )>,
                i: usize| {
        let j = i % ops.len();
        let (a, b, c) = &mut ops[j];
        be.gemm(c.view_mut(), a.view(), b.view(), *g);
    };
    // Calls per batch: as many as fit in `batch_s`, so that a batch is long against the timer
    // and the wake-up of the pool.
    for (g, ops, reps) in &mut cases {
        pool.install(|| {
            let t = Instant::now();
            let mut n = 0;
            while n < 3 || t.elapsed().as_secs_f64() < batch_s {
                call(g, ops, n);
                n += 1;
            }
            *reps = n;
        });
    }
    let mut times = vec![[vec![], vec![]]; cases.len()];
    let mut next = 0;
    for _ in 0..rounds {
        for (i, (g, ops, reps)) in cases.iter_mut().enumerate() {
            for (j, p) in [pool, one].into_iter().enumerate() {
                let t = p.install(|| {
                    let t = Instant::now();
                    for _ in 0..*reps {
                        call(g, ops, next);
                        next += 1;
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
                let flops = g.flops() as f64;
                [flops, flops / median(&t[j]).expect("at least one round")]
            })
            .collect()
    };
    (curve(0), curve(1))
}

/// The fused causal attention kernel's forward and backward rates at head dims 16, 32 and 64
/// (2 sequences of 256, 8 query and 4 KV heads), FLOPs counted as the planner counts them.
fn attention_rates(
    be: &CpuBackend,
    pool: &rayon::ThreadPool,
    batch_s: f64,
    rounds: usize,
) -> Vec<[f64; 3]> {
    [16usize, 32, 64]
        .iter()
        .map(|&hd| {
            let (b, s, h, kv) = (2, 256, 8, 4);
            let d = AttnDims {
                batch: b,
                tq: s,
                tk: s,
                heads: h,
                kv_heads: kv,
                head_dim: hd,
            };
            let buf = |n: usize, x: f32| be.upload(&vec![x; n], &[n], Category::Buffers);
            let (q, k, v) = (
                buf(b * s * h * hd, 0.1),
                buf(b * s * kv * hd, 0.2),
                buf(b * s * kv * hd, 0.3),
            );
            let mut out = buf(b * s * h * hd, 0.0);
            let mut lse = buf(b * h * s, 0.0);
            let dout = buf(b * s * h * hd, 0.01);
            let (mut dq, mut dk, mut dv) =
                (buf(q.len(), 0.0), buf(k.len(), 0.0), buf(v.len(), 0.0));
            let (mut tf, mut tb) = (vec![], vec![]);
            pool.install(|| {
                for _ in 0..rounds {
                    tf.push(median_time(batch_s, 1, || {
                        be.attention_forward(
                            out.view_mut(),
                            lse.view_mut(),
                            q.view(),
                            k.view(),
                            v.view(),
                            d,
                        )
                    }));
                    tb.push(median_time(batch_s, 1, || {
                        let g = AttnGrads {
                            dq: dq.view_mut(),
                            dk: dk.view_mut(),
                            dv: dv.view_mut(),
                        };
                        let saved = AttnSaved {
                            out: out.view(),
                            q: q.view(),
                            k: k.view(),
                            v: v.view(),
                            lse: lse.view(),
                        };
                        be.attention_backward(g, dout.view(), saved, d)
                    }));
                }
            });
            let med = |t: &[f64]| median(t).expect("at least one round");
            // Causal: QKᵀ and AV over half the square, 2·s²·hd per head and sequence.
            let fwd = (b * h) as f64 * 2.0 * (s * s * hd) as f64;
            [hd as f64, fwd / med(&tf), 2.5 * fwd / med(&tb)]
        })
        .collect()
}

/// Measure with a pool of `threads` (0 = all cores).
pub fn measure(threads: usize, quick: bool) -> Result<CpuSpec> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if threads == 0 { cores } else { threads };
    // More threads than cores measure nothing more (and 100,000 would take the machine).
    let threads = if threads > cores {
        eprintln!("note: --threads {threads} capped to this machine's {cores} cores");
        cores
    } else {
        threads
    };
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
    let attention = attention_rates(&be, &pool, batch_s, rounds.min(5));
    // Element-wise: SwiGLU (reads gate and up, writes out: 12 bytes per element, with an exp
    // per element like the norms and softmaxes) at two sizes above the backend's parallel
    // threshold, the larger past the L2 caches as a step's activations are; a line through
    // the two times gives the fixed cost of one parallel kernel (fork/join, waking the pool)
    // and the bytes per second.
    let swiglu = |n: usize| {
        let g = be.upload(&vec![0.5; n], &[n], Category::Buffers);
        let u = be.upload(&vec![0.25; n], &[n], Category::Buffers);
        let mut o = be.zeros(&[n], Category::Buffers);
        let t = pool.install(|| {
            median_time(batch_s, 7, || {
                be.swiglu_forward(o.view_mut(), g.view(), u.view())
            })
        });
        (12.0 * n as f64, t)
    };
    let (b1, t1) = swiglu(1 << 16);
    let (b2, t2) = swiglu(1 << 20);
    let per_byte = ((t2 - t1) / (b2 - b1)).max(t2 / b2 * 0.5);
    let elementwise_bytes_per_s = 1.0 / per_byte;
    let op_overhead_s = (t1 - b1 * per_byte).max(0.0);
    // The optimizer's update streams every parameter's state from memory: AdamW over 4M
    // parameters (48 MiB of state, past the L3), 28 bytes each (reads p, g, m, v; writes p,
    // m, v).
    let n = 1 << 22;
    let buf = |x: f32| be.upload(&vec![x; n], &[n], Category::Buffers);
    let (mut p, g, mut m, mut v) = (buf(0.1), buf(0.01), buf(0.0), buf(0.0));
    let h = AdamWStep::at_step(1e-3, (0.9, 0.95), 1e-8, 0.1, 10);
    let t = pool.install(|| {
        median_time(batch_s.max(0.02), 5, || {
            be.adamw_step(p.view_mut(), m.view_mut(), v.view_mut(), g.view(), &h, None)
        })
    });
    let optimizer_bytes_per_s = 28.0 * n as f64 / t;
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
        attention,
        elementwise_bytes_per_s,
        optimizer_bytes_per_s,
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
        "calibrated {}\nGEMM GFLOP/s by MFLOP per call, {} threads: {}\n  one thread: {}\nattention GFLOP/s by head dim (forward/backward): {}\nelement-wise {:.1} GB/s, optimizer {:.1} GB/s, fork/join {:.1} us, barrier (4 threads) {:.1} us\nwrote {}\n",
        s.calibrated,
        s.threads,
        curve(&s.gemm),
        curve(&s.gemm_one_thread),
        s.attention
            .iter()
            .map(|a| format!("{}:{:.1}/{:.1}", a[0], a[1] / 1e9, a[2] / 1e9))
            .collect::<Vec<_>>()
            .join(" "),
        s.elementwise_bytes_per_s / 1e9,
        s.optimizer_bytes_per_s / 1e9,
        s.op_overhead_s * 1e6,
        s.sync_s * 1e6,
        out.display()
    )
}

// ------------------------------------------------------------------ the accelerator (issue 37)

/// What the device calibration times: GEMMs `(m, n, k)`, grouped expert GEMMs `(experts, rows,
/// hidden, expert_hidden)`, attention `(sequence, head_dim)` with `heads` query and `kv_heads`
/// KV heads, Newton–Schulz `(rows, cols)`, element-wise elements and copy bytes; `reps` timed
/// calls each (the median counts).
pub struct DeviceSizes {
    pub gemm: Vec<(usize, usize, usize)>,
    pub grouped: Vec<(usize, usize, usize, usize)>,
    pub attention: Vec<(usize, usize)>,
    pub heads: (usize, usize),
    pub ns: Vec<(usize, usize)>,
    pub elementwise: usize,
    pub copy_bytes: usize,
    pub reps: usize,
}

impl DeviceSizes {
    /// A GPU's: GEMMs from 2·256³ to 2·8192³, the expert GEMMs of `medium` and of one rank's
    /// `europa-1t` slice (96 experts of 6,144 x 1,792, 8,192 tokens x top-8), attention up to
    /// the write-up's 65,536 tokens at head dims 64 and 128, Newton–Schulz at `medium`'s and
    /// `europa-1t`'s matrix shapes; about a minute on an H200.
    pub fn gpu() -> Self {
        DeviceSizes {
            gemm: [256, 512, 1024, 2048, 4096, 8192]
                .iter()
                .map(|&s| (s, s, s))
                .chain([(65536, 1792, 6144), (65536, 6144, 6144)])
                .collect(),
            grouped: vec![
                (8, 8192, 1024, 512),
                (64, 32768, 1024, 512),
                (96, 65536, 6144, 1792),
            ],
            attention: [1024, 4096, 16384, 65536]
                .iter()
                .flat_map(|&s| [(s, 64), (s, 128)])
                .collect(),
            heads: (8, 8),
            ns: vec![(512, 1024), (1024, 1024), (1792, 6144), (6144, 6144)],
            elementwise: 1 << 26,
            copy_bytes: 1 << 30,
            reps: 5,
        }
    }

    /// The CPU backends' (tests, `--quick`): the same sections at sizes of a few milliseconds.
    pub fn small() -> Self {
        DeviceSizes {
            gemm: vec![(32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256)],
            grouped: vec![(4, 256, 64, 32), (8, 1024, 64, 64)],
            attention: vec![(64, 16), (128, 16), (64, 32), (128, 32)],
            heads: (2, 2),
            ns: vec![(32, 64), (64, 64)],
            elementwise: 1 << 16,
            copy_bytes: 1 << 20,
            reps: 3,
        }
    }
}

/// Median seconds of `reps` calls of `f`, each timed by events on `stream` (device time on a
/// GPU, host time on the CPU), after one untimed warm-up.
fn event_time(be: &dyn Backend, stream: Stream, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let v: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let a = be.record_event(stream);
            f();
            let b = be.record_event(stream);
            be.elapsed(&a, &b).as_secs_f64().max(1e-9)
        })
        .collect();
    median(&v).expect("at least one call")
}

/// A device tensor of `n` values in (0, 1) (any spread: only the time is read).
fn filled(be: &dyn Backend, n: usize, seed: u64) -> Tensor {
    be.upload(&values(n, seed), &[n], Category::Buffers)
}

/// Measure `be` at `sizes` through the backend seam alone, so the same code measures the CUDA
/// backend on a GPU and the CPU backends here.
pub fn measure_device(be: &dyn Backend, sizes: &DeviceSizes, device: &str) -> GpuMeasured {
    let reps = sizes.reps;
    // GEMMs, B transposed as the model's weights; bf16: operands cast once to bf16 tensors,
    // as the model's bf16 compute copies.
    let gemm_curve = |bf16: bool| -> Vec<[f64; 2]> {
        let mut v: Vec<[f64; 2]> = sizes
            .gemm
            .iter()
            .map(|&(m, n, k)| {
                let (a32, b32) = (filled(be, m * k, 1), filled(be, n * k, 2));
                let mut c = be.zeros(&[m * n], Category::Buffers);
                let g = Gemm::new(m, n, k, false, true).bf16_inputs(bf16);
                let t = if bf16 {
                    let mut a = be.zeros_of(&[m * k], DType::BF16, Category::Buffers);
                    let mut b = be.zeros_of(&[n * k], DType::BF16, Category::Buffers);
                    be.cast(a.view_mut(), a32.view());
                    be.cast(b.view_mut(), b32.view());
                    event_time(be, Stream::Compute, reps, || {
                        be.gemm(c.view_mut(), a.view(), b.view(), g)
                    })
                } else {
                    event_time(be, Stream::Compute, reps, || {
                        be.gemm(c.view_mut(), a32.view(), b32.view(), g)
                    })
                };
                let f = g.flops() as f64;
                [f, f / t]
            })
            .collect();
        v.sort_by(|a, b| a[0].total_cmp(&b[0]));
        v.dedup_by(|a, b| a[0] == b[0]);
        v
    };
    let gemm_bf16 = gemm_curve(true);
    let gemm_f32 = gemm_curve(false);
    // The routed experts' grouped GEMM (the gate's: rows x hidden by hidden x expert_hidden)
    // over uneven counts: expert i gets a share proportional to 1 + (i mod 7), as a router
    // leaves them, the rows adding up to `rows`.
    let mut gemm_grouped: Vec<[f64; 2]> = sizes
        .grouped
        .iter()
        .map(|&(e, rows, h, i)| {
            let w: Vec<usize> = (0..e).map(|j| 1 + j % 7).collect();
            let total: usize = w.iter().sum();
            let mut counts: Vec<usize> = w.iter().map(|x| rows * x / total).collect();
            counts[0] += rows - counts.iter().sum::<usize>();
            let x = filled(be, rows * h, 3);
            let wt = filled(be, e * i * h, 4);
            let mut y = be.zeros(&[rows * i], Category::Buffers);
            let mut groups = Vec::with_capacity(e);
            let mut row = 0;
            for (j, &c) in counts.iter().enumerate() {
                let g = Gemm::new(c, i, h, false, true).bf16_inputs(true);
                groups.push((g, row * h, j * i * h, row * i));
                row += c;
            }
            let t = event_time(be, Stream::Compute, reps, || {
                be.gemm_grouped(y.view_mut(), x.view(), wt.view(), &groups)
            });
            let f = 2.0 * (rows * h * i) as f64;
            [f, f / t]
        })
        .collect();
    gemm_grouped.sort_by(|a, b| a[0].total_cmp(&b[0]));
    gemm_grouped.dedup_by(|a, b| a[0] == b[0]);
    // Attention forward and backward, one sequence, FLOPs as the planner counts them.
    let (heads, kv) = sizes.heads;
    let mut attention: Vec<[f64; 4]> = sizes
        .attention
        .iter()
        .map(|&(s, hd)| {
            let d = AttnDims {
                batch: 1,
                tq: s,
                tk: s,
                heads,
                kv_heads: kv,
                head_dim: hd,
            };
            let (q, k, v) = (
                filled(be, s * heads * hd, 5),
                filled(be, s * kv * hd, 6),
                filled(be, s * kv * hd, 7),
            );
            let mut out = be.zeros(&[s * heads * hd], Category::Buffers);
            let mut lse = be.zeros(&[heads * s], Category::Buffers);
            let dout = filled(be, s * heads * hd, 8);
            let mut dq = be.zeros(&[q.len()], Category::Buffers);
            let mut dk = be.zeros(&[k.len()], Category::Buffers);
            let mut dv = be.zeros(&[v.len()], Category::Buffers);
            let tf = event_time(be, Stream::Compute, reps, || {
                be.attention_forward(
                    out.view_mut(),
                    lse.view_mut(),
                    q.view(),
                    k.view(),
                    v.view(),
                    d,
                )
            });
            let tb = event_time(be, Stream::Compute, reps, || {
                let g = AttnGrads {
                    dq: dq.view_mut(),
                    dk: dk.view_mut(),
                    dv: dv.view_mut(),
                };
                let saved = AttnSaved {
                    out: out.view(),
                    q: q.view(),
                    k: k.view(),
                    v: v.view(),
                    lse: lse.view(),
                };
                be.attention_backward(g, dout.view(), saved, d)
            });
            let fwd = heads as f64 * 2.0 * (s * s * hd) as f64;
            [s as f64, hd as f64, fwd / tf, 2.5 * fwd / tb]
        })
        .collect();
    attention.sort_by(|a, b| (a[1], a[0]).partial_cmp(&(b[1], b[0])).expect("finite"));
    // Newton–Schulz per shape, 5 steps, bf16 and f32 products (the optimizer's own code).
    let newton_schulz = ganymede_optim::ns_timings(be, &sizes.ns, 5, reps)
        .iter()
        .map(|t| {
            [
                t.rows as f64,
                t.cols as f64,
                t.steps as f64,
                (t.bf16_ms / 1e3).max(1e-9),
                (t.f32_ms / 1e3).max(1e-9),
            ]
        })
        .collect();
    // Element-wise: SwiGLU, 12 bytes per element; the optimizer: AdamW, 28 bytes per element.
    let n = sizes.elementwise;
    let (g, u) = (filled(be, n, 9), filled(be, n, 10));
    let mut o = be.zeros(&[n], Category::Buffers);
    let t = event_time(be, Stream::Compute, reps, || {
        be.swiglu_forward(o.view_mut(), g.view(), u.view())
    });
    let elementwise_bytes_per_s = 12.0 * n as f64 / t;
    let (mut p, mut m, mut v) = (
        filled(be, n, 11),
        be.zeros(&[n], Category::Buffers),
        be.zeros(&[n], Category::Buffers),
    );
    let h = AdamWStep::at_step(1e-3, (0.9, 0.95), 1e-8, 0.1, 10);
    let t = event_time(be, Stream::Compute, reps, || {
        be.adamw_step(p.view_mut(), m.view_mut(), v.view_mut(), g.view(), &h, None)
    });
    let optimizer_bytes_per_s = 28.0 * n as f64 / t;
    // Copies between device memory and pinned host memory on the copy streams.
    let c = sizes.copy_bytes / 4;
    let mut dev = filled(be, c, 12);
    let mut host = be.pinned_zeros(&[c], Category::Buffers);
    let d2h = event_time(be, Stream::ToHost, reps, || {
        be.copy_async(host.view_mut(), dev.view(), Stream::ToHost)
    });
    let h2d = event_time(be, Stream::FromHost, reps, || {
        be.copy_async(dev.view_mut(), host.view(), Stream::FromHost)
    });
    be.synchronize();
    GpuMeasured {
        device: device.to_string(),
        gemm_bf16,
        gemm_f32,
        gemm_grouped,
        attention,
        newton_schulz,
        elementwise_bytes_per_s,
        optimizer_bytes_per_s,
        d2h_bytes_per_s: (4 * c) as f64 / d2h,
        h2d_bytes_per_s: (4 * c) as f64 / h2d,
        calibrated: String::new(),
    }
}

/// The backend `kind` names (`cpu`, `cpu-two-memory`, `cuda`) and its description. The one
/// place calibration makes a CUDA backend.
fn device_backend(kind: &str) -> Result<(Arc<dyn Backend>, String)> {
    let ledger = Arc::new(Ledger::new());
    Ok(match kind {
        "cpu" => (Arc::new(CpuBackend::new(ledger)), "the CPU backend".into()),
        "cpu-two-memory" => (
            Arc::new(CpuBackend::two_memory(
                ledger,
                TwoMemoryOptions {
                    device_capacity: None,
                    checking: false,
                },
            )),
            "the CPU backend's two-memory mode".into(),
        ),
        "cuda" => cuda_backend(ledger)?,
        other => {
            anyhow::bail!("calibrate --device {other:?}: expected cpu, cpu-two-memory or cuda")
        }
    })
}

#[cfg(feature = "cuda")]
fn cuda_backend(ledger: Arc<Ledger>) -> Result<(Arc<dyn Backend>, String)> {
    let be = ganymede_cuda::device::kernel_backend(0, ledger)
        .map_err(|e| anyhow::anyhow!("calibrate --device cuda: {e}"))?;
    Ok((Arc::new(be), "the CUDA backend on GPU 0".into()))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_ledger: Arc<Ledger>) -> Result<(Arc<dyn Backend>, String)> {
    anyhow::bail!(
        "calibrate --device cuda: this binary was built without CUDA: build it with \
         `cargo build --release -p ganymede --features cuda`"
    )
}

/// Calibrate the accelerator `kind` and write `base` (a cluster preset or file) with the
/// measured `[gpu_measured]` section; returns the cluster written. A GPU is measured at
/// [`DeviceSizes::gpu`]; the CPU backends (and `quick`) at [`DeviceSizes::small`].
pub fn run_device(kind: &str, base: &str, out: &Path, quick: bool) -> Result<Cluster> {
    let (be, what) = device_backend(kind)?;
    let sizes = if kind == "cuda" && !quick {
        DeviceSizes::gpu()
    } else {
        DeviceSizes::small()
    };
    let t = Instant::now();
    let mut m = measure_device(be.as_ref(), &sizes, &what);
    m.calibrated = format!("{}, {:.1} s", utc_now(), t.elapsed().as_secs_f64());
    let mut c = Cluster::resolve(base)?;
    c.name = format!("{}-measured", c.name);
    c.description = format!("{} Measured on {what}, {}.", c.description, m.calibrated);
    c.gpu_measured = Some(m);
    c.validate(&out.display().to_string())?;
    let text = format!(
        "# Written by `ganymede calibrate --device {kind}`; use with `ganymede plan --cluster {}`.\n{}",
        out.display(),
        c.to_toml()
    );
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    Ok(c)
}

/// The summary `calibrate --device` prints.
pub fn device_summary(c: &Cluster, out: &Path) -> String {
    let g = c.gpu_measured.as_ref().expect("measured");
    let curve = |v: &[[f64; 2]]| {
        v.iter()
            .map(|p| format!("{:.3}G:{:.1}", p[0] / 1e9, p[1] / 1e12))
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        "measured {} ({})\nGEMM TFLOP/s by GFLOP per call, bf16: {}\n  f32: {}\n  grouped experts: {}\nattention TFLOP/s (seq/head_dim: forward/backward): {}\nNewton-Schulz ms (rows x cols: bf16/f32): {}\nelement-wise {:.1} GB/s, optimizer {:.1} GB/s, D2H {:.1} GB/s, H2D {:.1} GB/s\nwrote {}\n",
        g.device,
        g.calibrated,
        curve(&g.gemm_bf16),
        curve(&g.gemm_f32),
        curve(&g.gemm_grouped),
        g.attention
            .iter()
            .map(|a| format!("{}/{}:{:.2}/{:.2}", a[0], a[1], a[2] / 1e12, a[3] / 1e12))
            .collect::<Vec<_>>()
            .join(" "),
        g.newton_schulz
            .iter()
            .map(|n| format!("{}x{}:{:.3}/{:.3}", n[0], n[1], n[3] * 1e3, n[4] * 1e3))
            .collect::<Vec<_>>()
            .join(" "),
        g.elementwise_bytes_per_s / 1e9,
        g.optimizer_bytes_per_s / 1e9,
        g.d2h_bytes_per_s / 1e9,
        g.h2d_bytes_per_s / 1e9,
        out.display()
    )
}

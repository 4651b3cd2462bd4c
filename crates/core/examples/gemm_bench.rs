//! GEMM throughput of the CPU backend: `cargo run --release -p ganymede-core --example gemm_bench`.
//! Prints the median GFLOP/s over repeated runs for square and training-shaped problems, the
//! packed f32 kernel side by side with `matrixmultiply`, at the rayon thread count given by RAYON_NUM_THREADS (default: all cores).

use ganymede_core::cpu::{gemm_host, gemm_host_matrixmultiply, syrk_host_strips};
use ganymede_core::sample::median;
use ganymede_core::{Blas, Category, CpuBackend, Gemm, Memory, Syrk};
use std::time::Instant;

fn med(t: &[f64]) -> f64 {
    median(t).expect("7 timings")
}

fn main() {
    let be = CpuBackend::default();
    let shapes: &[(usize, usize, usize, bool, bool)] = &[
        (1024, 1024, 1024, false, false),
        (512, 512, 512, false, false),
        // Newton–Schulz at `small`: the polynomial times X.
        (256, 256, 256, false, false),
        // tiny/small training shapes: tokens x in -> out (weights [out, in], B transposed)
        (1024, 128, 64, false, true),
        (2048, 256, 256, false, true),
        (2048, 4096, 256, false, true),
        (512, 256, 256, false, true),
        // backward: dX = dY·W (B plain), dW = dYᵀ·X (A transposed, k = tokens)
        (2048, 256, 4096, false, false),
        (512, 256, 256, false, false),
        (256, 256, 2048, true, false),
        (4096, 256, 2048, true, false),
    ];
    println!("threads {}", rayon::current_num_threads());
    // This crate's packed kernel (the backend's f32 path) against `matrixmultiply`, timed
    // alternately so that both see the same load.
    for &(m, n, k, ta, tb) in shapes {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut c = vec![0f32; m * n];
        let g = Gemm::new(m, n, k, ta, tb);
        let reps = (1e9 / g.flops() as f64).clamp(3.0, 200.0) as usize;
        let (mut tp, mut tm) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            for _ in 0..reps {
                gemm_host(&mut c, &a, &b, g);
            }
            tp.push(t.elapsed().as_secs_f64() / reps as f64);
            let t = Instant::now();
            for _ in 0..reps {
                gemm_host_matrixmultiply(&mut c, &a, &b, g);
            }
            tm.push(t.elapsed().as_secs_f64() / reps as f64);
        }
        let (p, mm) = (med(&tp), med(&tm));
        let gf = |t: f64| g.flops() as f64 / t / 1e9;
        println!(
            "{m:>5}x{n:>5}x{k:>5} ta={ta:<5} tb={tb:<5}: packed {:6.1} GFLOP/s, \
             matrixmultiply {:6.1} GFLOP/s, {:.2}x",
            gf(p),
            gf(mm),
            mm / p
        );
    }

    // The symmetric product against the same product as a plain GEMM (what Newton–Schulz used
    // before), timed alternately so that both see the same load.
    for &(n, k, trans) in &[
        (256, 256, false),
        (512, 512, false),
        (1024, 1024, false),
        (256, 1024, false),
        (256, 1024, true),
    ] {
        let a = be.upload(&vec![0.5; n * k], &[n * k], Category::Buffers);
        let mut c = be.zeros(&[n * n], Category::Buffers);
        let s = Syrk::new(n, k, trans);
        let reps = (1e9 / s.as_gemm().flops() as f64).clamp(3.0, 200.0) as usize;
        let (mut tg, mut ts, mut tp) = (Vec::new(), Vec::new(), Vec::new());
        let cpu: &mut [f32] = &mut vec![0.0; n * n];
        let ah = vec![0.5f32; n * k];
        for _ in 0..7 {
            let t = Instant::now();
            for _ in 0..reps {
                be.gemm(c.view_mut(), a.view(), a.view(), s.as_gemm());
            }
            tg.push(t.elapsed().as_secs_f64() / reps as f64);
            let t = Instant::now();
            for _ in 0..reps {
                syrk_host_strips(cpu, &ah, s);
            }
            ts.push(t.elapsed().as_secs_f64() / reps as f64);
            let t = Instant::now();
            for _ in 0..reps {
                be.syrk(c.view_mut(), a.view(), s);
            }
            tp.push(t.elapsed().as_secs_f64() / reps as f64);
        }
        let (g, y, p) = (med(&tg), med(&ts), med(&tp));
        println!(
            "syrk n={n:>5} k={k:>5} trans={trans}: gemm {:8.3} ms, strips {:8.3} ms ({:.2}x), \
             packed {:8.3} ms ({:.2}x)",
            g * 1e3,
            y * 1e3,
            g / y,
            p * 1e3,
            g / p
        );
    }
}

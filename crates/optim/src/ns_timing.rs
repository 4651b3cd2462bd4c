//! Newton–Schulz time per matrix size, f32 against bf16 products (`optimizer.ns_dtype`): the
//! device check's section, written against the backend seam so that the same code (inputs,
//! timing by the backend's events, median, deviation, the report's table) runs and is tested on
//! the CPU backend.

use crate::ns::{newton_schulz, ns_flops, NsScratch};
use ganymede_core::sample::{median, values};
use ganymede_core::{Backend, Category, Stream};
use std::fmt::Write as _;

/// One matrix shape's measurements.
#[derive(Clone, Debug, PartialEq)]
pub struct NsTiming {
    pub rows: usize,
    pub cols: usize,
    pub steps: usize,
    /// Median milliseconds of one call with f32 products.
    pub f32_ms: f64,
    /// The same with bf16 products.
    pub bf16_ms: f64,
    /// Largest |bf16 result − f32 result| over the matrix's entries.
    pub max_dev: f64,
    /// Root mean square of the entries of the f32 result, to read `max_dev` against.
    pub rms: f64,
}

/// For each `(rows, cols)`: `reps` timed calls of [`newton_schulz`] with `steps` steps in f32
/// and in bf16 (after one untimed warm-up each, which also gives the results compared), timed
/// by events on the compute stream (device time on a GPU, host time on the CPU), each call on a
/// fresh copy of the same input.
pub fn ns_timings(
    be: &dyn Backend,
    shapes: &[(usize, usize)],
    steps: usize,
    reps: usize,
) -> Vec<NsTiming> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(rows, cols))| {
            let n = rows * cols;
            // Any spread of values does: Newton–Schulz normalises first.
            let input = be.upload(&values(n, i as u64 + 1), &[n], Category::Buffers);
            let mut x = be.zeros(&[n], Category::Buffers);
            let mut scratch = NsScratch::new(be, rows, cols);
            let mut run = |bf16: bool| {
                be.copy(x.view_mut(), input.view());
                newton_schulz(be, x.view_mut(), rows, cols, steps, bf16, &mut scratch);
                let out = be.download(x.view());
                let ms: Vec<f64> = (0..reps)
                    .map(|_| {
                        be.copy(x.view_mut(), input.view());
                        let a = be.record_event(Stream::Compute);
                        newton_schulz(be, x.view_mut(), rows, cols, steps, bf16, &mut scratch);
                        let b = be.record_event(Stream::Compute);
                        be.elapsed(&a, &b).as_secs_f64() * 1e3
                    })
                    .collect();
                // NaN for no repetitions.
                (out, median(&ms).unwrap_or(f64::NAN))
            };
            let (f32_out, f32_ms) = run(false);
            let (bf16_out, bf16_ms) = run(true);
            let max_dev = f32_out
                .iter()
                .zip(&bf16_out)
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0.0, f64::max);
            let rms = (f32_out.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n.max(1) as f64)
                .sqrt();
            NsTiming {
                rows,
                cols,
                steps,
                f32_ms,
                bf16_ms,
                max_dev,
                rms,
            }
        })
        .collect()
}

/// The measurements as a markdown table, with the GEMM-equivalent rate ([`ns_flops`]).
pub fn ns_timings_markdown(rows: &[NsTiming]) -> String {
    let mut md = String::from(
        "| matrix | steps | f32 ms | f32 TFLOP/s | bf16 ms | bf16 TFLOP/s | bf16/f32 speed-up | max abs(bf16 − f32) | rms of entries |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for t in rows {
        let flops = ns_flops(t.rows, t.cols, t.steps) as f64;
        let rate = |ms: f64| flops / (ms * 1e-3) / 1e12;
        let _ = writeln!(
            md,
            "| {}×{} | {} | {:.3} | {:.2} | {:.3} | {:.2} | {:.2}× | {:.2e} | {:.2e} |",
            t.rows,
            t.cols,
            t.steps,
            t.f32_ms,
            rate(t.f32_ms),
            t.bf16_ms,
            rate(t.bf16_ms),
            t.f32_ms / t.bf16_ms,
            t.max_dev,
            t.rms
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NsSteps;
    use ganymede_core::{CpuBackend, Memory};

    #[test]
    fn timings_on_the_cpu_compare_the_same_runs_as_direct_calls() {
        let be = CpuBackend::default();
        let shapes = [(24, 40), (40, 24), (32, 32)];
        let got = ns_timings(&be, &shapes, 5, 3);
        assert_eq!(got.len(), 3);
        for (i, (t, &(r, c))) in got.iter().zip(&shapes).enumerate() {
            assert_eq!((t.rows, t.cols, t.steps), (r, c, 5));
            assert!(t.f32_ms > 0.0 && t.bf16_ms > 0.0, "{t:?}");
            // The deviation is that of the two precisions on the input the timings used.
            let input = values(r * c, i as u64 + 1);
            let outs = [false, true].map(|bf16| {
                let mut x = be.upload(&input, &[r * c], Category::Buffers);
                let mut sc = NsScratch::new(&be, r, c);
                newton_schulz(&be, x.view_mut(), r, c, NsSteps::muon(5), bf16, &mut sc);
                be.download(x.view())
            });
            let [f, b] = &outs;
            let dev = f
                .iter()
                .zip(b.iter())
                .map(|(x, y)| (x - y).abs() as f64)
                .fold(0.0, f64::max);
            assert_eq!(t.max_dev, dev);
            // bf16 rounding shows, but stays a small part of the entries (ns.rs's band test).
            assert!(t.max_dev > 1e-4 * t.rms && t.max_dev < 0.2 * t.rms, "{t:?}");
            let rms = (f.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / (r * c) as f64).sqrt();
            assert_eq!(t.rms, rms);
        }
        let md = ns_timings_markdown(&got);
        assert_eq!(md.lines().count(), 2 + shapes.len());
        let row = md.lines().nth(2).unwrap();
        assert!(row.starts_with("| 24×40 | 5 | "), "{row}");
        assert!(row.contains(&format!("{:.2e}", got[0].max_dev)), "{row}");
    }

    #[test]
    fn markdown_rates_follow_the_flop_count() {
        let t = NsTiming {
            rows: 1000,
            cols: 2000,
            steps: 5,
            f32_ms: 10.0,
            bf16_ms: 2.5,
            max_dev: 1.5e-3,
            rms: 2e-2,
        };
        // ns_flops = 5·(4·1000²·2000 + 2·1000³) = 5e10: 5 TFLOP/s at 10 ms, 20 at 2.5 ms.
        assert_eq!(ns_flops(1000, 2000, 5), 50_000_000_000);
        let md = ns_timings_markdown(&[t]);
        let row = md.lines().nth(2).unwrap();
        assert_eq!(
            row,
            "| 1000×2000 | 5 | 10.000 | 5.00 | 2.500 | 20.00 | 4.00× | 1.50e-3 | 2.00e-2 |"
        );
    }
}

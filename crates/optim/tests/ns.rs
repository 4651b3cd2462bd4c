//! Newton–Schulz against closed forms: NS is an odd matrix polynomial in the normalised input, so
//! it keeps the singular vectors and maps each singular value σ/‖σ‖ through the quintic
//! p(σ) = aσ + bσ³ + cσ⁵ five times. Everything below follows from that.

mod common;
use common::*;
use ganymede_core::{Backend, Category, CpuBackend, Memory};
use ganymede_optim::{
    newton_schulz, newton_schulz_batch, newton_schulz_strided, NsScratch, NsSteps,
};

fn run_ns(be: &CpuBackend, g: &[f64], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    let mut t = be.upload_f64(g, &[rows, cols], Category::Params);
    let mut scratch = NsScratch::new(be, rows, cols);
    newton_schulz(
        be as &dyn Backend,
        t.view_mut(),
        rows,
        cols,
        steps,
        false,
        &mut scratch,
    );
    be.download_f64(t.view())
}

/// Five iterations of Muon's quintic.
const MUON5: NsSteps = NsSteps::muon(5);

const SHAPES: [(usize, usize); 5] = [(48, 48), (32, 80), (80, 32), (1, 40), (64, 96)];

/// The quintic's behaviour at σ = 1 (an orthogonal matrix with all singular values equal, after
/// normalisation, would sit there if ‖·‖ were the spectral norm): 1 is not a fixed point;
/// p(1) = a + b + c = 0.7010, and the orbit then alternates between about 0.69–0.73 and
/// 1.08–1.13 for the next ten steps (slowly drifting inward after that). That band is what
/// "roughly orthogonal" means for these coefficients.
#[test]
fn quintic_orbit_of_one_alternates_in_a_band() {
    assert!((p(1.0) - 0.7010).abs() < 1e-12);
    let mut s = 1.0;
    for i in 0..10 {
        s = p(s);
        if i % 2 == 0 {
            assert!((0.68..0.74).contains(&s), "step {i}: {s}");
        } else {
            assert!((1.07..1.13).contains(&s), "step {i}: {s}");
        }
    }
}

/// Random Gaussian matrices: output singular values land in [0.6, 1.2] except, for square
/// matrices, the very smallest input ones (σ_min of a square Gaussian is ~1/n of the Frobenius
/// norm, and five steps multiply a small value by at most a⁵ ≈ 486); those are predicted exactly
/// by the scalar map and checked against it. The input's own singular values spread widely.
#[test]
fn random_matrices_singular_values() {
    let be = CpuBackend::default();
    let mut rng = Rng::new(1);
    for &(r, c) in &SHAPES {
        let g = rng.normals(r * c);
        let sv_in = singular_values(&g, r, c);
        let out = run_ns(&be, &g, r, c, 5);
        let sv_out = singular_values(&out, r, c);
        // Prediction: p⁵(σ/‖σ‖_F), sorted (p⁵ is not monotone).
        let fro = sv_in.iter().map(|s| s * s).sum::<f64>().sqrt();
        let mut want: Vec<f64> = sv_in.iter().map(|s| p_iter(s / (fro + 1e-7), 5)).collect();
        want.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let err = max_abs_diff(&sv_out, &want);
        assert!(
            err < 2e-3,
            "{r}x{c}: singular values off the closed form by {err}"
        );
        let in_band = sv_out.iter().filter(|s| (0.6..=1.2).contains(*s)).count();
        let predicted_in_band = want.iter().filter(|s| (0.6..=1.2).contains(*s)).count();
        assert!(sv_out.iter().all(|&s| s <= 1.2), "{r}x{c}: {sv_out:?}");
        if r != c {
            assert_eq!(in_band, sv_out.len(), "{r}x{c}: {sv_out:?}");
        } else {
            assert!(in_band >= sv_out.len() - 3, "{r}x{c}: {sv_out:?}");
            assert_eq!(in_band, predicted_in_band);
        }
        let spread_in = sv_in.last().unwrap() / sv_in[0].max(1e-300);
        let spread_out = sv_out.last().unwrap() / sv_out[0];
        eprintln!(
            "{r}x{c}: input σ max/min {spread_in:.1}, output σ in [{:.3}, {:.3}]",
            sv_out[0],
            sv_out.last().unwrap()
        );
        if r > 1 && c > 1 {
            assert!(spread_in > 3.0 && spread_out < spread_in);
        }
    }
}

/// Built from a known SVD with singular values spread over two decades: NS(X) must equal
/// U·diag(p⁵(σ/‖σ‖))·Vᵀ entrywise, and the singular values that start above ~1e-3·‖σ‖ must end in
/// [0.6, 1.2].
#[test]
fn known_svd_maps_through_the_quintic() {
    let be = CpuBackend::default();
    let mut rng = Rng::new(2);
    for &(r, c) in &[(40usize, 40usize), (24, 56), (56, 24)] {
        let s = r.min(c);
        let u = orthonormal_columns(r, s, &mut rng);
        let v = orthonormal_columns(c, s, &mut rng);
        // Log-spaced from 1 down to 0.01.
        let sigma: Vec<f64> = (0..s)
            .map(|i| 10f64.powf(-2.0 * i as f64 / (s - 1) as f64))
            .collect();
        let x = from_svd(&u, &sigma, &v, r, c);
        let out = run_ns(&be, &x, r, c, 5);
        let fro = sigma.iter().map(|s| s * s).sum::<f64>().sqrt();
        let mapped: Vec<f64> = sigma.iter().map(|s| p_iter(s / (fro + 1e-7), 5)).collect();
        let want = from_svd(&u, &mapped, &v, r, c);
        let err = max_abs_diff(&out, &want);
        assert!(err < 1e-4, "{r}x{c}: NS differs from U p⁵(Σ) Vᵀ by {err}");
        for (s0, s5) in sigma.iter().zip(&mapped) {
            if s0 / fro > 1e-3 {
                assert!((0.6..=1.2).contains(s5), "σ {s0} → {s5}");
            }
        }
    }
}

/// An orthogonal Q: ‖Q‖_F = √n, so NS sees all singular values at 1/√n and returns γ·Q with
/// γ = p⁵(1/(√n + 1e-7)). The direction is exactly preserved; γ lies in the band.
#[test]
fn orthogonal_input_stays_itself_up_to_the_predicted_factor() {
    let be = CpuBackend::default();
    let mut rng = Rng::new(3);
    for n in [8usize, 64, 100] {
        let q = orthogonal(n, &mut rng);
        let out = run_ns(&be, &q, n, n, 5);
        let gamma = p_iter(1.0 / ((n as f64).sqrt() + 1e-7), 5);
        assert!((0.6..=1.2).contains(&gamma), "n={n}: γ={gamma}");
        let want: Vec<f64> = q.iter().map(|x| gamma * x).collect();
        let err = max_abs_diff(&out, &want);
        assert!(err < 1e-5, "n={n}: NS(Q) differs from {gamma}·Q by {err}");
    }
}

#[test]
fn transposition_symmetry() {
    let be = CpuBackend::default();
    let mut rng = Rng::new(4);
    for &(r, c) in &[(24usize, 72usize), (72, 24), (33, 34)] {
        let g = rng.normals(r * c);
        let a = run_ns(&be, &g, r, c, 5);
        let b = run_ns(&be, &transpose(&g, r, c), c, r, 5);
        let err = max_abs_diff(&a, &transpose(&b, c, r));
        assert!(err < 1e-5, "{r}x{c}: NS(Xᵀ) vs NS(X)ᵀ differ by {err}");
    }
}

/// On the f64 backend, the GEMM formulation (tall matrices via Xᵀ·X without a transpose) equals a
/// textbook loop implementation to rounding, for any number of steps (odd counts end in scratch).
/// The reference takes the coefficients as the f32 `Syrk` fields carry them (`coeffs_f32`; with
/// the exact ones the two differ by ~3e-9 per step).
#[test]
fn matches_reference_loops_in_f64() {
    let be = CpuBackend::new_f64(Default::default());
    let mut rng = Rng::new(5);
    for &(r, c) in &SHAPES {
        for steps in [0usize, 1, 2, 5] {
            let g = rng.normals(r * c);
            let got = run_ns(&be, &g, r, c, steps);
            let want = ns_reference_with(coeffs_f32(), &g, r, c, steps);
            let err = max_abs_diff(&got, &want);
            assert!(err < 1e-12, "{r}x{c} steps {steps}: {err}");
        }
    }
}

#[test]
fn zero_input_stays_zero_and_scratch_is_reused() {
    let be = CpuBackend::default();
    // One scratch for the largest shape serves smaller ones.
    let mut scratch = NsScratch::for_shapes(&be, [(16, 64), (64, 16), (32, 32)]);
    let mut rng = Rng::new(6);
    for &(r, c) in &[(16usize, 64usize), (64, 16), (32, 32), (8, 8)] {
        let g = rng.normals(r * c);
        let mut t = be.upload_f64(&g, &[r, c], Category::Params);
        newton_schulz(&be, t.view_mut(), r, c, MUON5, false, &mut scratch);
        let want = ns_reference(&g, r, c, 5);
        assert!(max_abs_diff(&be.download_f64(t.view()), &want) < 1e-4);
    }
    let mut z = be.zeros(&[8, 8], Category::Params);
    newton_schulz(&be, z.view_mut(), 8, 8, MUON5, false, &mut scratch);
    assert!(be.download(z.view()).iter().all(|&x| x == 0.0));
}

#[test]
fn batch_equals_one_call_per_matrix_bitwise() {
    // Batched NS runs each matrix through the same backend calls as a lone call, only on another
    // thread; the GEMMs' split across threads does not change any element's sum (each element
    // is one k-long dot product in a fixed order), so the results must match to the bit, at any
    // thread count and number of scratches.
    let be = CpuBackend::default();
    let count = 5;
    for &(r, c) in &[(48usize, 80usize), (80, 48), (256, 256), (1, 40)] {
        let n = r * c;
        let g: Vec<f32> = Rng::new(9)
            .normals(count * n)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let mut want = Vec::new();
        let mut scratch = NsScratch::new(&be, r, c);
        for e in 0..count {
            let mut t = be.upload(&g[e * n..(e + 1) * n], &[r, c], Category::Params);
            newton_schulz(&be, t.view_mut(), r, c, MUON5, false, &mut scratch);
            want.extend(be.download(t.view()));
        }
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for lanes in [1, 3] {
                let mut scratch: Vec<NsScratch> =
                    (0..lanes).map(|_| NsScratch::new(&be, r, c)).collect();
                let mut t = be.upload(&g, &[count, r, c], Category::Params);
                pool.install(|| {
                    newton_schulz_batch(&be, t.view_mut(), count, r, c, MUON5, false, &mut scratch)
                });
                let got = be.download(t.view());
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{r}x{c}, {threads} threads, {lanes} scratches");
            }
        }
    }
}

/// The strided form (one call per product over a whole stack, what a GPU runs) gives every
/// matrix the calls of its own `newton_schulz`: on the CPU, whose strided calls are per-matrix
/// loops, the same bits, f32 and bf16 products, wide and tall, odd and even step counts (the
/// result ending in the scratch and copied back, or not).
#[test]
fn the_strided_form_is_the_per_matrix_one() {
    let be = CpuBackend::default();
    let count = 3;
    for &(r, c) in &[(24usize, 40usize), (40, 24), (16, 16), (1, 9)] {
        let n = r * c;
        let g: Vec<f32> = Rng::new(13)
            .normals(count * n)
            .iter()
            .map(|&x| x as f32)
            .collect();
        for bf16 in [false, true] {
            for steps in [5, 4] {
                let mut want = Vec::new();
                let mut scratch = NsScratch::new(&be, r, c);
                for e in 0..count {
                    let mut t = be.upload(&g[e * n..(e + 1) * n], &[r, c], Category::Params);
                    newton_schulz(&be, t.view_mut(), r, c, steps, bf16, &mut scratch);
                    want.extend(be.download(t.view()));
                }
                let mut scratch = NsScratch::for_batch(&be, r, c, count);
                let mut t = be.upload(&g, &[count, r, c], Category::Params);
                newton_schulz_strided(&be, t.view_mut(), count, r, c, steps, bf16, &mut scratch);
                let got = be.download(t.view());
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{r}x{c}, bf16 {bf16}, {steps} steps");
                // And it is an orthogonalisation, not the input: the singular values moved.
                assert!(got.iter().zip(&g).any(|(x, y)| (x - y).abs() > 1e-3));
            }
        }
    }
}

/// [`run_ns`] on the f32 backend with the products' operands in bf16 or f32.
fn run_ns_prec(be: &CpuBackend, g: &[f64], rows: usize, cols: usize, bf16: bool) -> Vec<f64> {
    let mut t = be.upload_f64(g, &[rows, cols], Category::Params);
    let mut scratch = NsScratch::new(be, rows, cols);
    newton_schulz(be, t.view_mut(), rows, cols, MUON5, bf16, &mut scratch);
    be.download_f64(t.view())
}

fn bf16_round(v: f64) -> f64 {
    use ganymede_core::bf16;
    bf16::to_f32(bf16::from_f32(v as f32)) as f64
}

/// The shifted iteration (`ns_shifted`, coefficients as f32) in f64 with every product's
/// operands rounded to bf16, as `ns_dtype = "bf16"` defines it: `A' = r(X)·r(X)ᵀ + β·I`,
/// `P = c·r(A')·r(A')ᵀ + δ·I`, `X = r(P)·r(X)` (wide orientation; a tall matrix transposed).
fn ns_reference_bf16(g: &[f64], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    let f = |v: f64| v as f32 as f64;
    let (ca, cb, cc) = ganymede_optim::NS_COEFFS;
    let (beta, cc) = (f(cb / (2.0 * cc)), f(cc));
    let delta = f(ca - cc * beta * beta);
    let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut x: Vec<f64> = g.iter().map(|v| v / (norm + 1e-7)).collect();
    let tall = rows > cols;
    let (s, l) = if tall { (cols, rows) } else { (rows, cols) };
    if tall {
        x = transpose(&x, rows, cols);
    }
    let r = |v: &[f64]| v.iter().map(|&v| bf16_round(v)).collect::<Vec<f64>>();
    let add_diag = |m: &mut [f64], d: f64| (0..s).for_each(|i| m[i * s + i] += d);
    for _ in 0..steps {
        let xr = r(&x);
        let mut a = matmul(&xr, &transpose(&xr, s, l), s, l, s);
        add_diag(&mut a, beta);
        let ar = r(&a);
        let mut p: Vec<f64> = matmul(&ar, &transpose(&ar, s, s), s, s, s)
            .iter()
            .map(|v| cc * v)
            .collect();
        add_diag(&mut p, delta);
        x = matmul(&r(&p), &xr, s, s, l);
    }
    if tall {
        x = transpose(&x, s, l);
    }
    x
}

/// `ns_dtype = "bf16"` on the CPU backend: the result follows the bf16-operand reference far
/// more closely than it follows f32 NS (so every product really rounds its inputs), stays
/// within a bound of f32 NS, and its singular values land in the same band as f32's.
///
/// The reference cannot match exactly: where an f32 intermediate and its f64 counterpart
/// round to different bf16 values (about one of the ~10⁴ roundings of a run), the two runs
/// part by 2⁻⁸ of that entry, and the following steps spread it. Measured (max / rms of the
/// difference; entries' rms 0.08 to 0.13): 48×48 bf16 vs f32 7.7e-3 / 1.8e-3, vs the reference
/// 6e-8 / 7e-9; 32×80 (one such split) 6.1e-3 / 1.4e-3 against 1.9e-3 / 4.4e-4; 80×32 9.2e-3 /
/// 1.5e-3 against 4e-8 / 4e-9; 64×96 7.0e-3 / 1.3e-3 against 8e-8 / 6e-9; 128×128 5.1e-3 /
/// 1.0e-3 against 2.2e-3 / 2.4e-4. With the flag ignored every reference distance would be the
/// f32 one.
#[test]
fn bf16_products_follow_the_rounded_reference_and_keep_the_band() {
    let be = CpuBackend::default();
    let mut rng = Rng::new(21);
    let rms_diff = |a: &[f64], b: &[f64]| {
        let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        rms(&d)
    };
    let mut exact = 0;
    for &(r, c) in &[(48usize, 48usize), (32, 80), (80, 32), (64, 96), (128, 128)] {
        let g = rng.normals(r * c);
        let f32_out = run_ns_prec(&be, &g, r, c, false);
        let bf16_out = run_ns_prec(&be, &g, r, c, true);
        let reference = ns_reference_bf16(&g, r, c, 5);
        let max_f32 = max_abs_diff(&bf16_out, &f32_out);
        let max_ref = max_abs_diff(&bf16_out, &reference);
        let (rms_f32, rms_ref) = (
            rms_diff(&bf16_out, &f32_out),
            rms_diff(&bf16_out, &reference),
        );
        let scale = rms(&f32_out);
        eprintln!(
            "{r}x{c}: bf16 vs f32 max {max_f32:.2e} rms {rms_f32:.2e}; vs the rounded \
             reference max {max_ref:.2e} rms {rms_ref:.2e} (entries' rms {scale:.3})"
        );
        // Operand rounding is relative 2⁻⁹ per product, 15 products: measured up to 10% of the
        // entries' rms at worst; f32 rounding alone would be ~1e-6.
        assert!(max_f32 < 0.2 * scale, "{r}x{c}: {max_f32}");
        assert!(
            rms_f32 > 3e-3 * scale,
            "{r}x{c}: bf16 indistinguishable from f32"
        );
        assert!(
            rms_ref < rms_f32 / 2.0,
            "{r}x{c}: {rms_ref} from the rounded reference, {rms_f32} from f32"
        );
        if rms_ref < 1e-6 {
            exact += 1;
        }
        // The band of `random_matrices_singular_values`.
        let sv = singular_values(&bf16_out, r, c);
        let sv_f32 = singular_values(&f32_out, r, c);
        let in_band = |v: &[f64]| v.iter().filter(|s| (0.6..=1.2).contains(*s)).count();
        assert!(sv.iter().all(|&s| s <= 1.2), "{r}x{c}: {sv:?}");
        if r != c {
            assert_eq!(in_band(&sv), sv.len(), "{r}x{c}: {sv:?}");
        } else {
            assert!(in_band(&sv) + 1 >= in_band(&sv_f32), "{r}x{c}: {sv:?}");
        }
    }
    // Runs without a split rounding match to f32 accumulation error.
    assert!(
        exact >= 3,
        "only {exact} of 5 shapes match the reference closely"
    );
}

/// bf16 batched NS equals one call per matrix bitwise, one matrix at a time on a backend
/// without native bf16 (`ns_lanes`) whatever the scratch count, and never deadlocks.
#[test]
fn bf16_batch_equals_one_call_per_matrix() {
    let be = CpuBackend::default();
    assert_eq!(ganymede_optim::ns_lanes(&be, true, 3), 1);
    assert_eq!(ganymede_optim::ns_lanes(&be, false, 3), 3);
    let (count, r, c) = (4, 96, 64);
    let n = r * c;
    let g: Vec<f32> = Rng::new(22)
        .normals(count * n)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let mut scratch = NsScratch::new(&be, r, c);
    let mut want = Vec::new();
    for e in 0..count {
        let mut t = be.upload(&g[e * n..(e + 1) * n], &[r, c], Category::Params);
        newton_schulz(&be, t.view_mut(), r, c, MUON5, true, &mut scratch);
        want.extend(be.download(t.view()));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut scratch: Vec<NsScratch> = (0..3).map(|_| NsScratch::new(&be, r, c)).collect();
    let mut t = be.upload(&g, &[count, r, c], Category::Params);
    pool.install(|| newton_schulz_batch(&be, t.view_mut(), count, r, c, MUON5, true, &mut scratch));
    let got = be.download(t.view());
    assert!(got
        .iter()
        .zip(&want)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// Polar Express's quintics are each the best for their interval: `1 − p` equioscillates,
/// `+E` at the interval's low end, `−E` at its high end and `∓E` at the two interior extrema,
/// and nowhere exceeds `E` (Chebyshev's criterion for the minimax polynomial). Each interval
/// is the one the quintic before it leaves, `[1 − E, 1 + E]`, and the errors shrink to the
/// figures docs/config.md states: below 0.12 after five iterations, 0.001 after six.
#[test]
fn polar_express_quintics_equioscillate() {
    use ganymede_optim::{polar_express, POLAR_EXPRESS_LOW};
    let list = polar_express();
    assert_eq!(list.len(), 7, "{list:?}");
    let (mut l, mut u) = (POLAR_EXPRESS_LOW, 1.0);
    for (i, &((a, b, c), e)) in list.iter().enumerate() {
        let p = |x: f64| a * x + b * x.powi(3) + c * x.powi(5);
        let n = 20_000;
        let xs: Vec<f64> = (0..=n).map(|k| l + (u - l) * k as f64 / n as f64).collect();
        let worst = xs.iter().map(|&x| (1.0 - p(x)).abs()).fold(0.0, f64::max);
        let tol = 1e-9 * e.max(1e-6);
        assert!(
            worst <= e + tol,
            "iteration {i}: max |1 - p| {worst} > E {e}"
        );
        assert!(
            (1.0 - p(l) - e).abs() <= tol,
            "iteration {i}: 1 - p(l) = {}",
            1.0 - p(l)
        );
        assert!(
            (1.0 - p(u) + e).abs() <= tol,
            "iteration {i}: 1 - p(u) = {}",
            1.0 - p(u)
        );
        // The interior extrema: p's largest value left of its interior minimum, and that minimum.
        let inner = &xs[1..n];
        let lo = inner.iter().copied().fold(f64::MAX, |m, x| m.min(p(x)));
        let hi = inner.iter().copied().fold(f64::MIN, |m, x| m.max(p(x)));
        assert!(
            (lo - (1.0 - e)).abs() <= 1e-6 * e.max(1e-3),
            "iteration {i}: min {lo}"
        );
        assert!(
            (hi - (1.0 + e)).abs() <= 1e-6 * e.max(1e-3),
            "iteration {i}: max {hi}"
        );
        (l, u) = (1.0 - e, 1.0 + e);
    }
    assert!(list[4].1 < 0.12 && list[5].1 < 1e-3, "{list:?}");
}

/// Orthogonalisation on the CPU backend from a known SVD whose normalised singular values lie
/// in Polar Express's interval [0.001, 1] (one at 1, the rest from 0.003 to 0.1): each comes out
/// as the composition of the quintics (the closed form, to f32 rounding); after five
/// iterations all are within 0.12 of 1, where Muon's quintic leaves some 0.25 or more away;
/// after six within 0.002.
#[test]
fn polar_express_takes_singular_values_to_one() {
    use ganymede_config::NsCoefficients;
    let be = CpuBackend::default();
    let mut rng = Rng::new(5);
    let (r, c) = (48usize, 80usize);
    let s = r.min(c);
    let u = orthonormal_columns(r, s, &mut rng);
    let v = orthonormal_columns(c, s, &mut rng);
    let mut sigma: Vec<f64> = (0..s)
        .map(|i| 0.003 * (0.1f64 / 0.003).powf(i as f64 / (s - 2) as f64))
        .collect();
    sigma[s - 1] = 1.0;
    let x = from_svd(&u, &sigma, &v, r, c);
    let fro = sigma.iter().map(|s| s * s).sum::<f64>().sqrt();
    let worst = |steps: NsSteps| {
        let mut t = be.upload_f64(&x, &[r, c], Category::Params);
        let mut scratch = NsScratch::new(&be, r, c);
        newton_schulz(
            &be as &dyn Backend,
            t.view_mut(),
            r,
            c,
            steps,
            false,
            &mut scratch,
        );
        let out = be.download_f64(t.view());
        // Closed form: each σ/(‖σ‖ + ε) through the iterations' quintics.
        let mapped: Vec<f64> = sigma
            .iter()
            .map(|&sg| {
                (0..steps.n).fold(sg / (fro + 1e-7), |x, i| {
                    let (a, b, c) = steps.coeffs(i);
                    a * x + b * x.powi(3) + c * x.powi(5)
                })
            })
            .collect();
        let want = from_svd(&u, &mapped, &v, r, c);
        let err = max_abs_diff(&out, &want);
        assert!(err < 2e-4, "{steps:?}: off the closed form by {err}");
        let sv = singular_values(&out, r, c);
        sv.iter().map(|s| (s - 1.0).abs()).fold(0.0, f64::max)
    };
    let pe = |n| NsSteps {
        n,
        coefficients: NsCoefficients::PolarExpress,
    };
    let (pe5, muon5, pe6) = (worst(pe(5)), worst(NsSteps::from(5)), worst(pe(6)));
    eprintln!("max |σ - 1|: Polar Express 5 {pe5:.4}, 6 {pe6:.5}; Muon 5 {muon5:.4}");
    assert!(pe5 < 0.12, "{pe5}");
    assert!(muon5 > 0.25, "{muon5}");
    assert!(pe6 < 2e-3, "{pe6}");
}

//! The elementwise loops around `exp` (softmax, SiLU, cross-entropy spend most of their
//! non-GEMM time here), with a branch-free f32 `exp` the compiler vectorises (error within 2 ulp
//! over the range used); f64 keeps the library `exp` so gradient checks stay exact.

use crate::tensor::{DType, Scalar};

#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    // exp(x) = 2^n · exp(r), n = round(x / ln 2), |r| <= ln2 / 2 (Cody–Waite split of ln 2).
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor polynomial of degree 6 (remainder < 2e-8 relative on |r| <= 0.347), Horner's rule.
    let mut p = 1.0 / 720.0;
    for k in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = k + r * p;
    }
    // 2^n without a float-to-int conversion (Rust's saturating `as` does not vectorise): in
    // n + 127 + 2^23 the low mantissa bits are n + 127 (1..=254), which `<< 23` moves into the
    // exponent field.
    let scale = f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23);
    p * scale
}

/// Eight independent partial sums: a fixed order, whichever path ran.
#[inline(always)]
fn lanes_sum(acc: [f32; 8], rest: f32) -> f32 {
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + rest
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// 8-lane versions of the loops below. They evaluate `exp_f32` with the same operations in the
/// same order (no fused multiply-adds), so each element is bitwise what the scalar code gives.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let x = _mm256_min_ps(_mm256_max_ps(x, c(-87.0)), c(88.0));
        let magic = c(12_582_912.0);
        let n = _mm256_sub_ps(
            _mm256_add_ps(_mm256_mul_ps(x, c(std::f32::consts::LOG2_E)), magic),
            magic,
        );
        let r = _mm256_sub_ps(
            _mm256_sub_ps(x, _mm256_mul_ps(n, c(0.693_145_75))),
            _mm256_mul_ps(n, c(1.428_606_8e-6)),
        );
        let mut p = c(1.0 / 720.0);
        for k in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_add_ps(c(k), _mm256_mul_ps(r, p));
        }
        let e = _mm256_castps_si256(_mm256_add_ps(n, c(127.0 + 8_388_608.0)));
        _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)))
    }

    #[inline(always)]
    unsafe fn store_acc(acc: __m256) -> [f32; 8] {
        let mut a = [0.0f32; 8];
        _mm256_storeu_ps(a.as_mut_ptr(), acc);
        a
    }

    /// Returns (sum of the 8-lane part as lanes, elements done).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_sum(x: &mut [f32], m: f32) -> ([f32; 8], usize) {
        let n8 = x.len() / 8 * 8;
        let (mv, mut acc) = (_mm256_set1_ps(m), _mm256_setzero_ps());
        let p = x.as_mut_ptr();
        for i in (0..n8).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
            _mm256_storeu_ps(p.add(i), e);
            acc = _mm256_add_ps(acc, e);
        }
        (store_acc(acc), n8)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sum_exp_sub(x: &[f32], m: f32) -> ([f32; 8], usize) {
        let n8 = x.len() / 8 * 8;
        let (mv, mut acc) = (_mm256_set1_ps(m), _mm256_setzero_ps());
        let p = x.as_ptr();
        for i in (0..n8).step_by(8) {
            acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv)));
        }
        (store_acc(acc), n8)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_scale(x: &mut [f32], m: f32, scale: f32) -> usize {
        let n8 = x.len() / 8 * 8;
        let (mv, sv) = (_mm256_set1_ps(m), _mm256_set1_ps(scale));
        let p = x.as_mut_ptr();
        for i in (0..n8).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(e, sv));
        }
        n8
    }

    #[inline(always)]
    unsafe fn sigmoid8(g: __m256) -> __m256 {
        let one = _mm256_set1_ps(1.0);
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_div_ps(one, _mm256_add_ps(one, e))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu_fwd(o: &mut [f32], g: &[f32], u: &[f32]) -> usize {
        let n8 = o.len().min(g.len()).min(u.len()) / 8 * 8;
        for i in (0..n8).step_by(8) {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let uv = _mm256_loadu_ps(u.as_ptr().add(i));
            let y = _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), uv);
            _mm256_storeu_ps(o.as_mut_ptr().add(i), y);
        }
        n8
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu_bwd(
        dg: &mut [f32],
        du: &mut [f32],
        d: &[f32],
        g: &[f32],
        u: &[f32],
    ) -> usize {
        let n8 = dg
            .len()
            .min(du.len())
            .min(d.len())
            .min(g.len())
            .min(u.len())
            / 8
            * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            let dv = _mm256_loadu_ps(d.as_ptr().add(i));
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let uv = _mm256_loadu_ps(u.as_ptr().add(i));
            let s = sigmoid8(gv);
            _mm256_storeu_ps(
                du.as_mut_ptr().add(i),
                _mm256_mul_ps(_mm256_mul_ps(dv, gv), s),
            );
            // silu'(g) = s (1 + g (1 - s))
            let ds = _mm256_add_ps(one, _mm256_mul_ps(gv, _mm256_sub_ps(one, s)));
            let r = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dv, uv), s), ds);
            _mm256_storeu_ps(dg.as_mut_ptr().add(i), r);
        }
        n8
    }
}

fn exp_sub_sum_f32(x: &mut [f32], m: f32) -> f32 {
    let (mut acc, mut done) = ([0.0f32; 8], 0);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // Safety: AVX2 was detected.
        (acc, done) = unsafe { avx2::exp_sub_sum(x, m) };
    }
    let mut rest = 0.0;
    let n8 = x.len() / 8 * 8;
    for (i, v) in x.iter_mut().enumerate().skip(done) {
        let e = exp_f32(*v - m);
        *v = e;
        if i < n8 {
            acc[i % 8] += e;
        } else {
            rest += e;
        }
    }
    lanes_sum(acc, rest)
}

fn sum_exp_sub_f32(x: &[f32], m: f32) -> f32 {
    let (mut acc, mut done) = ([0.0f32; 8], 0);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // Safety: AVX2 was detected.
        (acc, done) = unsafe { avx2::sum_exp_sub(x, m) };
    }
    let mut rest = 0.0;
    for (i, &v) in x.iter().enumerate().skip(done) {
        let e = exp_f32(v - m);
        if i < x.len() / 8 * 8 {
            acc[i % 8] += e;
        } else {
            rest += e;
        }
    }
    lanes_sum(acc, rest)
}

fn exp_sub_scale_f32(x: &mut [f32], m: f32, scale: f32) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // Safety: AVX2 was detected.
        done = unsafe { avx2::exp_sub_scale(x, m, scale) };
    }
    for v in &mut x[done..] {
        *v = exp_f32(*v - m) * scale;
    }
}

fn sigmoid_f32(g: f32) -> f32 {
    1.0 / (1.0 + exp_f32(0.0 - g))
}

fn swiglu_fwd_f32(o: &mut [f32], g: &[f32], u: &[f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // Safety: AVX2 was detected.
        done = unsafe { avx2::swiglu_fwd(o, g, u) };
    }
    for i in done..o.len() {
        o[i] = g[i] * sigmoid_f32(g[i]) * u[i];
    }
}

fn swiglu_bwd_f32(dg: &mut [f32], du: &mut [f32], d: &[f32], g: &[f32], u: &[f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // Safety: AVX2 was detected.
        done = unsafe { avx2::swiglu_bwd(dg, du, d, g, u) };
    }
    for i in done..dg.len() {
        let s = sigmoid_f32(g[i]);
        du[i] = d[i] * g[i] * s;
        dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
    }
}

fn f32s<S: Scalar>(x: &[S]) -> &[f32] {
    debug_assert!(S::DTYPE == DType::F32);
    // Safety: only called when S is f32 (checked through its dtype tag).
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) }
}
fn f32s_mut<S: Scalar>(x: &mut [S]) -> &mut [f32] {
    debug_assert!(S::DTYPE == DType::F32);
    // Safety: as above.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut f32, x.len()) }
}

/// `x[i] = exp(x[i] - m)`; returns Σ x[i] (the softmax normaliser).
pub fn exp_sub_sum<S: Scalar>(x: &mut [S], m: S) -> S {
    if S::DTYPE == DType::F32 {
        return S::of_f64(exp_sub_sum_f32(f32s_mut(x), m.to_f32().unwrap()) as f64);
    }
    let mut s = S::zero();
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    s
}

/// Σ exp(x[i] - m), leaving `x` alone.
pub fn sum_exp_sub<S: Scalar>(x: &[S], m: S) -> S {
    if S::DTYPE == DType::F32 {
        return S::of_f64(sum_exp_sub_f32(f32s(x), m.to_f32().unwrap()) as f64);
    }
    x.iter().map(|&v| (v - m).exp()).sum()
}

/// `x[i] = exp(x[i] - m) * scale`.
pub fn exp_sub_scale<S: Scalar>(x: &mut [S], m: S, scale: S) {
    if S::DTYPE == DType::F32 {
        return exp_sub_scale_f32(f32s_mut(x), m.to_f32().unwrap(), scale.to_f32().unwrap());
    }
    x.iter_mut().for_each(|v| *v = (*v - m).exp() * scale);
}

/// Largest element (`-inf` for an empty slice), in eight lanes the compiler vectorises, where a
/// single running maximum waits on each compare. A maximum is exact, so the value is the one
/// the serial fold gives.
#[inline]
pub fn max_of<S: Scalar>(x: &[S]) -> S {
    let mut acc = [S::neg_infinity(); 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    let m = it
        .remainder()
        .iter()
        .fold(S::neg_infinity(), |a, &v| a.max(v));
    acc.iter().fold(m, |a, &v| a.max(v))
}

/// Eight partial sums added in a fixed tree, as [`lanes_sum`] does for f32.
#[inline(always)]
fn tree8<S: Scalar>(a: [S; 8], rest: S) -> S {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])) + rest
}

/// Σ a[i]·b[i] in eight interleaved partial sums (lane `i % 8`, the tail in its own sum) added
/// in a fixed tree: independent adds the compiler vectorises, where one running sum waits on
/// each add. No fused multiply-add, so every CPU rounds it the same way.
#[inline]
pub fn dot<S: Scalar>(a: &[S], b: &[S]) -> S {
    assert_eq!(a.len(), b.len());
    let mut acc = [S::zero(); 8];
    let (mut ia, mut ib) = (a.chunks_exact(8), b.chunks_exact(8));
    for (ca, cb) in (&mut ia).zip(&mut ib) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let rest = ia
        .remainder()
        .iter()
        .zip(ib.remainder())
        .fold(S::zero(), |s, (&x, &y)| s + x * y);
    tree8(acc, rest)
}

/// Σ a[i]·b[i]·c[i] (multiplied left to right), summed as [`dot`] does.
#[inline]
pub fn dot3<S: Scalar>(a: &[S], b: &[S], c: &[S]) -> S {
    assert!(a.len() == b.len() && a.len() == c.len());
    let mut acc = [S::zero(); 8];
    let (mut ia, mut ib, mut ic) = (a.chunks_exact(8), b.chunks_exact(8), c.chunks_exact(8));
    for ((ca, cb), cc) in (&mut ia).zip(&mut ib).zip(&mut ic) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l] * cc[l];
        }
    }
    let rest = ia
        .remainder()
        .iter()
        .zip(ib.remainder())
        .zip(ic.remainder())
        .fold(S::zero(), |s, ((&x, &y), &z)| s + x * y * z);
    tree8(acc, rest)
}

/// `o = silu(g) * u`.
pub fn swiglu_fwd<S: Scalar>(o: &mut [S], g: &[S], u: &[S]) {
    if S::DTYPE == DType::F32 {
        return swiglu_fwd_f32(f32s_mut(o), f32s(g), f32s(u));
    }
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = g / (S::one() + (-g).exp()) * u;
    }
}

/// Gradients of `silu(g) * u` given the output gradient `d`.
pub fn swiglu_bwd<S: Scalar>(dg: &mut [S], du: &mut [S], d: &[S], g: &[S], u: &[S]) {
    if S::DTYPE == DType::F32 {
        return swiglu_bwd_f32(f32s_mut(dg), f32s_mut(du), f32s(d), f32s(g), f32s(u));
    }
    for i in 0..dg.len() {
        let s = S::one() / (S::one() + (-g[i]).exp());
        du[i] = d[i] * g[i] * s;
        dg[i] = d[i] * u[i] * s * (S::one() + g[i] * (S::one() - s));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn vector_and_scalar_paths_agree() {
        // Lengths that leave tails; the 8-lane path must give each element bitwise.
        let x: Vec<f32> = (0..203)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        for len in [0, 5, 8, 13, 64, 203] {
            let mut a = x[..len].to_vec();
            let sa = super::exp_sub_sum_f32(&mut a, 1.5);
            let want: Vec<f32> = x[..len].iter().map(|&v| super::exp_f32(v - 1.5)).collect();
            assert_eq!(a, want);
            assert_eq!(super::sum_exp_sub_f32(&x[..len], 1.5), sa);
            let mut o = vec![0.0; len];
            super::swiglu_fwd_f32(&mut o, &x[..len], &x[..len]);
            let want: Vec<f32> = x[..len]
                .iter()
                .map(|&g| g * super::sigmoid_f32(g) * g)
                .collect();
            assert_eq!(o, want);
        }
    }

    #[test]
    fn lane_reductions_match_their_definitions() {
        // Lengths with and without tails. The maximum is exact, so it equals the serial fold;
        // the sums are checked against f64 and against the lane order written out by hand.
        let x: Vec<f32> = (0..203)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        let y: Vec<f32> = (0..203)
            .map(|i| ((i * 53 % 89) as f32 - 40.0) * 0.11)
            .collect();
        for len in [0, 1, 7, 8, 9, 32, 203] {
            let (a, b) = (&x[..len], &y[..len]);
            let serial = a.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert_eq!(super::max_of(a).to_bits(), serial.to_bits());
            let want: f64 = a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum();
            let got = super::dot(a, b);
            assert!(
                (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{len}: {got} {want}"
            );
            let mut lanes = [0f32; 8];
            let n8 = len / 8 * 8;
            for i in 0..n8 {
                lanes[i % 8] += a[i] * b[i];
            }
            let rest = (n8..len).fold(0f32, |s, i| s + a[i] * b[i]);
            assert_eq!(got.to_bits(), super::lanes_sum(lanes, rest).to_bits());
            let got3 = super::dot3(a, b, a);
            let mut lanes = [0f32; 8];
            for i in 0..n8 {
                lanes[i % 8] += a[i] * b[i] * a[i];
            }
            let rest = (n8..len).fold(0f32, |s, i| s + a[i] * b[i] * a[i]);
            assert_eq!(got3.to_bits(), super::lanes_sum(lanes, rest).to_bits());
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -80.0f32;
        while x < 80.0 {
            let got = super::exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
    }
}

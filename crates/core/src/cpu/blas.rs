//! GEMM and vector kernels. f32 GEMMs on a CPU with AVX2 + FMA run this crate's packed kernel
//! ([`gemm_avx2`]), which splits the work between rayon's threads itself. Otherwise (f64, other
//! CPUs) GEMMs above a size are split across rayon's threads along the longer output dimension,
//! each piece one `matrixmultiply` call. The symmetric rank-k product has a packed kernel
//! ([`syrk_avx2`]) and a fallback of `matrixmultiply` strips of its lower triangle.

use super::{gemm_avx2, syrk_avx2, CpuBackend, PAR_MIN};
use crate::backend::{extent, Blas, CastSlot, Gemm, Memory, Syrk};
use crate::ledger::Category;
use crate::tensor::{DType, Scalar, View, ViewMut};
use rayon::prelude::*;

/// Below this many multiply-adds a GEMM runs on one thread.
const GEMM_PAR_MIN: usize = 1 << 17;

#[derive(Clone, Copy)]
struct Ptr<S>(*mut S);
unsafe impl<S> Send for Ptr<S> {}
unsafe impl<S> Sync for Ptr<S> {}

/// The element types `matrixmultiply` has kernels for.
pub trait GemmScalar: Scalar {
    /// # Safety
    /// The pointers and strides must describe valid matrices, as for `matrixmultiply::sgemm`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
    /// The whole product by this crate's packed kernel (see [`gemm_avx2`]), where this type
    /// and CPU have one, split between rayon's threads with `parallel`; `false` means nothing
    /// was done. Operands are (pointer, row stride, column stride) of op(A) and op(B).
    ///
    /// # Safety
    /// As for [`gemm_avx2::gemm`]: valid extents, `c` not aliasing `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn packed(
        _m: usize,
        _n: usize,
        _k: usize,
        _alpha: Self,
        _a: (*const Self, usize, usize),
        _b: (*const Self, usize, usize),
        _beta: Self,
        _c: *mut Self,
        _ldc: usize,
        _parallel: bool,
    ) -> bool {
        false
    }
    /// One product on the calling thread (for callers that split the work themselves), by the
    /// packed kernel where there is one, else `matrixmultiply`; `C[i][j]` at `c[i·ldc + j]`.
    ///
    /// # Safety
    /// As for [`GemmScalar::raw`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn serial(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        (rsa, csa): (usize, usize),
        b: *const Self,
        (rsb, csb): (usize, usize),
        beta: Self,
        c: *mut Self,
        ldc: usize,
    ) {
        let (oa, ob) = ((a, rsa, csa), (b, rsb, csb));
        if Self::packed(m, n, k, alpha, oa, ob, beta, c, ldc, false) {
            return;
        }
        let i = |x: usize| x as isize;
        Self::raw(
            m,
            k,
            n,
            alpha,
            a,
            i(rsa),
            i(csa),
            b,
            i(rsb),
            i(csb),
            beta,
            c,
            i(ldc),
            1,
        )
    }
    /// A symmetric rank-k product (lower triangle, then mirrored) by a packed kernel, where
    /// this type and CPU have one: the GEMM's 6×16 kernel over the lower tiles, or with
    /// `own_8x8` the symmetric module's own; `false` means nothing was done.
    ///
    /// # Safety
    /// As for [`syrk_avx2::syrk_lower`]: valid extents, `c` not aliasing `a`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn syrk_lower(
        _n: usize,
        _k: usize,
        _alpha: Self,
        _beta: Self,
        _a: &[Self],
        _rsa: usize,
        _csa: usize,
        _c: *mut Self,
        _ldc: usize,
        _own_8x8: bool,
    ) -> bool {
        false
    }
}

impl GemmScalar for f32 {
    unsafe fn packed(
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: (*const f32, usize, usize),
        b: (*const f32, usize, usize),
        beta: f32,
        c: *mut f32,
        ldc: usize,
        parallel: bool,
    ) -> bool {
        if !gemm_avx2::available() {
            return false;
        }
        gemm_avx2::gemm(m, n, k, alpha, a, b, beta, c, ldc, parallel);
        true
    }

    unsafe fn syrk_lower(
        n: usize,
        k: usize,
        alpha: f32,
        beta: f32,
        a: &[f32],
        rsa: usize,
        csa: usize,
        c: *mut f32,
        ldc: usize,
        own_8x8: bool,
    ) -> bool {
        if !syrk_avx2::available() {
            return false;
        }
        if gemm_avx2::available() && !own_8x8 {
            gemm_avx2::syrk_lower(n, k, alpha, (a.as_ptr(), rsa, csa), beta, c, ldc);
        } else {
            syrk_avx2::syrk_lower(n, k, alpha, beta, a, rsa, csa, c, ldc);
        }
        // Safety: `c` holds the n×n matrix (the caller checked its extent).
        let len = (n - 1) * ldc + n;
        syrk_avx2::mirror_lower(std::slice::from_raw_parts_mut(c, len), n, ldc);
        true
    }

    unsafe fn raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
    }
}

impl GemmScalar for f64 {
    unsafe fn raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: f64,
        a: *const f64,
        rsa: isize,
        csa: isize,
        b: *const f64,
        rsb: isize,
        csb: isize,
        beta: f64,
        c: *mut f64,
        rsc: isize,
        csc: isize,
    ) {
        matrixmultiply::dgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
    }
}

/// Row-major GEMM on host slices, with bounds checked once up front.
pub fn gemm_host<S: GemmScalar>(c: &mut [S], a: &[S], b: &[S], g: Gemm) {
    gemm_with(c, a, b, g, true)
}

/// [`gemm_host`] by `matrixmultiply` only, never the packed kernel: the path f64 and CPUs
/// without AVX2 + FMA take, here so that tests and benchmarks can hold the two side by side.
pub fn gemm_host_matrixmultiply<S: GemmScalar>(c: &mut [S], a: &[S], b: &[S], g: Gemm) {
    gemm_with(c, a, b, g, false)
}

fn gemm_with<S: GemmScalar>(c: &mut [S], a: &[S], b: &[S], g: Gemm, packed: bool) {
    let Gemm {
        m,
        n,
        k,
        trans_a,
        trans_b,
        alpha,
        beta,
        lda,
        ldb,
        ldc,
        ..
    } = g;
    if m == 0 || n == 0 {
        return;
    }
    let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if trans_b { (n, k) } else { (k, n) };
    assert!(
        a_cols <= lda && a.len() >= extent(a_rows, a_cols, lda),
        "gemm: A too small {g:?}"
    );
    assert!(
        b_cols <= ldb && b.len() >= extent(b_rows, b_cols, ldb),
        "gemm: B too small {g:?}"
    );
    assert!(
        n <= ldc && c.len() >= extent(m, n, ldc),
        "gemm: C too small {g:?}"
    );
    // (row stride, column stride) of op(A) and op(B).
    let (rsa, csa) = if trans_a { (1, lda) } else { (lda, 1) };
    let (rsb, csb) = if trans_b { (1, ldb) } else { (ldb, 1) };
    let (alpha, beta) = (S::of_f64(alpha as f64), S::of_f64(beta as f64));
    // Safety: bounds were checked above; `c` is a distinct mutable slice.
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    let (oa, ob) = ((ap, rsa, csa), (bp, rsb, csb));
    if packed && unsafe { S::packed(m, n, k, alpha, oa, ob, beta, cp, ldc, true) } {
        return;
    }
    let threads = rayon::current_num_threads();
    let work = m * n * k;
    let cp = Ptr(c.as_mut_ptr());
    let (ap, bp) = (a.as_ptr() as usize, b.as_ptr() as usize);
    // Safety: bounds were checked above; pieces write disjoint blocks of C.
    let run = move |i0: usize, i1: usize, j0: usize, j1: usize| unsafe {
        let cp = cp;
        S::raw(
            i1 - i0,
            k,
            j1 - j0,
            alpha,
            (ap as *const S).add(i0 * rsa),
            rsa as isize,
            csa as isize,
            (bp as *const S).add(j0 * csb),
            rsb as isize,
            csb as isize,
            beta,
            cp.0.add(i0 * ldc + j0),
            ldc as isize,
            1,
        )
    };
    if threads == 1 || work < GEMM_PAR_MIN || k == 0 {
        run(0, m, 0, n);
        return;
    }
    // Split the longer side in pieces that keep micro-kernel tiles (8x8) whole.
    let split_m = m >= n;
    let len = if split_m { m } else { n };
    let pieces = threads.min(len.div_ceil(16)).max(1);
    let step = len.div_ceil(pieces).next_multiple_of(8);
    (0..len.div_ceil(step)).into_par_iter().for_each(|p| {
        let s = p * step;
        let e = (s + step).min(len);
        if split_m {
            run(s, e, 0, n)
        } else {
            run(0, m, s, e)
        }
    });
}

/// Output rows per strip of [`syrk_host`]: strips of `t` rows over `n` do `(n/t + 1) / (2·n/t)`
/// of the square's multiply-adds (62.5% at 4 strips, 53% at 16), but each strip is one
/// `matrixmultiply` call that packs its operands anew, which thin strips do not amortise: on
/// this CPU 16-row strips were no faster than the full GEMM, 64-row ones the best of 32–128
/// (`gemm_bench`, BENCHMARKS.md).
fn syrk_strip(n: usize) -> usize {
    (n / 16).next_multiple_of(8).clamp(64, 512)
}

/// Symmetric rank-k product on host slices (see [`Syrk`]): strip `r` computes rows `[r·t, r·t+t)`
/// of C for columns up to the end of its diagonal block, one `matrixmultiply` call each, and the
/// strictly upper triangle is then copied from the lower. Each element is the same k-long dot
/// product a full GEMM computes; strips run on rayon's threads above a size.
pub fn syrk_host<S: GemmScalar>(c: &mut [S], a: &[S], s: Syrk) {
    // Measured (BENCHMARKS.md, "Newton–Schulz without copies"): at n = 256 the 8×8 kernel's
    // smaller diagonal tiles win (best of 400 at k = 256: 0.208–0.213 against 0.219–0.230 ms);
    // from n = 512 the GEMM's 6×16 kernel does (1.98 / 1.85 against 2.65 / 1.94 ms at 512²,
    // 18.2 / 14.5 against 22.1 / 20.0 ms at 1024², two runs each).
    let path = match syrk_avx2::forced() {
        Some(own_8x8) if own_8x8 => SyrkPath::Packed8x8,
        Some(_) => SyrkPath::Packed,
        None if s.n >= 512 => SyrkPath::Packed,
        None => SyrkPath::Packed8x8,
    };
    syrk_with(c, a, s, path)
}

/// [`syrk_host`] by `matrixmultiply` strips only, never the packed kernel: the path f64 and
/// CPUs without AVX2 + FMA take, here so that tests and benchmarks can hold the two side by side.
pub fn syrk_host_strips<S: GemmScalar>(c: &mut [S], a: &[S], s: Syrk) {
    syrk_with(c, a, s, SyrkPath::Strips)
}

/// Which kernel [`syrk_with`] tries first (it falls back to the strips where the CPU or the
/// type has no packed kernel).
#[derive(Clone, Copy, PartialEq)]
enum SyrkPath {
    /// The GEMM's 6×16 kernel over the lower tiles.
    Packed,
    /// [`syrk_avx2`]'s own 8×8 and 4×16 kernels.
    Packed8x8,
    Strips,
}

fn syrk_with<S: GemmScalar>(c: &mut [S], a: &[S], s: Syrk, path: SyrkPath) {
    let Syrk {
        n,
        k,
        trans,
        alpha,
        beta,
        lda,
        ldc,
        diag,
        ..
    } = s;
    if n == 0 {
        return;
    }
    let (a_rows, a_cols) = if trans { (k, n) } else { (n, k) };
    assert!(
        a_cols <= lda && a.len() >= extent(a_rows, a_cols, lda),
        "syrk: A too small {s:?}"
    );
    assert!(
        n <= ldc && c.len() >= extent(n, n, ldc),
        "syrk: C too small {s:?}"
    );
    // (row stride, column stride) of op(A); op(A)ᵀ has them swapped.
    let (rsa, csa) = if trans { (1, lda) } else { (lda, 1) };
    let (alpha, beta) = (S::of_f64(alpha as f64), S::of_f64(beta as f64));
    // Safety: bounds were checked above; `c` and `a` are distinct slices.
    let own_8x8 = path == SyrkPath::Packed8x8;
    let packed = path != SyrkPath::Strips
        && unsafe { S::syrk_lower(n, k, alpha, beta, a, rsa, csa, c.as_mut_ptr(), ldc, own_8x8) };
    // The diagonal term last: the product's sums stay what a GEMM computes.
    let add_diag = |c: &mut [S]| {
        if diag != 0.0 {
            let d = S::of_f64(diag as f64);
            (0..n).for_each(|i| c[i * ldc + i] += d);
        }
    };
    if packed {
        // The packed kernel mirrored the triangle itself.
        add_diag(c);
        return;
    }
    syrk_strips(c, a, n, k, alpha, beta, rsa, csa, ldc);
    add_diag(c);
    // Upper triangle from the lower, in tiles so that both sides stay in cache.
    const TILE: usize = 32;
    for i0 in (0..n).step_by(TILE) {
        for j0 in (i0..n).step_by(TILE) {
            for i in i0..(i0 + TILE).min(n) {
                for j in j0.max(i + 1)..(j0 + TILE).min(n) {
                    c[i * ldc + j] = c[j * ldc + i];
                }
            }
        }
    }
}

/// The strip fallback of [`syrk_host`] (f64, or a CPU without AVX2 + FMA): strip `r` computes
/// rows `[r·t, r·t+t)` of C for columns up to the end of its diagonal block, one
/// `matrixmultiply` call each.
#[allow(clippy::too_many_arguments)]
fn syrk_strips<S: GemmScalar>(
    c: &mut [S],
    a: &[S],
    n: usize,
    k: usize,
    alpha: S,
    beta: S,
    rsa: usize,
    csa: usize,
    ldc: usize,
) {
    let t = syrk_strip(n);
    let strips = n.div_ceil(t);
    let cp = Ptr(c.as_mut_ptr());
    let ap = a.as_ptr() as usize;
    // Safety: bounds were checked above; strips write disjoint rows of C.
    let run = move |r: usize| unsafe {
        let cp = cp;
        let (i0, i1) = (r * t, (r * t + t).min(n));
        S::raw(
            i1 - i0,
            k,
            i1,
            alpha,
            (ap as *const S).add(i0 * rsa),
            rsa as isize,
            csa as isize,
            ap as *const S,
            csa as isize,
            rsa as isize,
            beta,
            cp.0.add(i0 * ldc),
            ldc as isize,
            1,
        )
    };
    if rayon::current_num_threads() == 1 || strips == 1 || n * n * k / 2 < GEMM_PAR_MIN {
        (0..strips).for_each(run);
    } else {
        // Longest strips (the bottom ones) first, so the short ones fill in at the end.
        (0..strips)
            .into_par_iter()
            .for_each(|r| run(strips - 1 - r));
    }
}

fn axpy<S: Scalar>(y: ViewMut, alpha: f32, x: View) {
    let (y, x): (&mut [S], &[S]) = (y.host(), x.host());
    assert_eq!(y.len(), x.len(), "axpy length");
    let alpha = S::of_f64(alpha as f64);
    if y.len() < PAR_MIN {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x);
    } else {
        y.par_chunks_mut(PAR_MIN)
            .zip(x.par_chunks(PAR_MIN))
            .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x));
    }
}

fn scale<S: Scalar>(y: ViewMut, alpha: f32) {
    let y: &mut [S] = y.host();
    let alpha = S::of_f64(alpha as f64);
    if y.len() < PAR_MIN {
        y.iter_mut().for_each(|y| *y *= alpha);
    } else {
        y.par_chunks_mut(PAR_MIN)
            .for_each(|y| y.iter_mut().for_each(|y| *y *= alpha));
    }
}

fn sumsq<S: Scalar>(x: View) -> f64 {
    let x: &[S] = x.host();
    let chunk = |c: &[S]| c.iter().map(|&v| v.as_f64() * v.as_f64()).sum::<f64>();
    if x.len() < PAR_MIN {
        chunk(x)
    } else {
        // Fixed chunking keeps the sum's rounding independent of the thread count.
        let parts: Vec<f64> = x.par_chunks(PAR_MIN).map(chunk).collect();
        parts.iter().sum()
    }
}

fn cast_to_bf16<S: Scalar>(dst: ViewMut, src: View) {
    let (d, s): (&mut [u16], &[S]) = (dst.host_bf16(), src.host());
    d.par_iter_mut()
        .zip(s.par_iter())
        .with_min_len(PAR_MIN)
        .for_each(|(d, &x)| *d = crate::bf16::from_f32(x.as_f64() as f32));
}

fn cast_from_bf16<S: Scalar>(dst: ViewMut, src: View) {
    let (d, s): (&mut [S], &[u16]) = (dst.host(), src.host_bf16());
    d.par_iter_mut()
        .zip(s.par_iter())
        .with_min_len(PAR_MIN)
        .for_each(|(d, &h)| *d = S::of_f64(crate::bf16::to_f32(h) as f64));
}

fn gemm<S: GemmScalar>(c: ViewMut, a: View, b: View, g: Gemm) {
    gemm_host::<S>(c.host(), a.host(), b.host(), g)
}

fn syrk<S: GemmScalar>(c: ViewMut, a: View, s: Syrk) {
    syrk_host::<S>(c.host(), a.host(), s)
}

/// `dst[..n] = src[..n]` rounded to bf16 and held in f32 (bf16 sources widen exactly).
fn round_into(dst: &mut [f32], src: View, n: usize) {
    let dst = &mut dst[..n];
    match src.dtype() {
        DType::F32 => dst
            .par_iter_mut()
            .zip(src.host::<f32>()[..n].par_iter())
            .with_min_len(PAR_MIN)
            .for_each(|(d, &x)| *d = crate::bf16::to_f32(crate::bf16::from_f32(x))),
        DType::BF16 => dst
            .par_iter_mut()
            .zip(src.host_bf16()[..n].par_iter())
            .with_min_len(PAR_MIN)
            .for_each(|(d, &h)| *d = crate::bf16::to_f32(h)),
        d => panic!("bf16-input gemm on a {} operand", d.name()),
    }
}

impl CpuBackend {
    /// Run `f` on A and B rounded to bf16 (in f32, so `matrixmultiply` runs them: a product of
    /// two bf16 values is exact in f32, so this is what a bf16 × bf16 → f32 GEMM computes, up
    /// to summation order). The scratch is sized by the operand views' lengths, which are fixed
    /// buffers from step to step, so it grows in the first step only; `na`/`nb` elements (what
    /// the GEMM reads) are rounded.
    pub(crate) fn with_bf16_operands(
        &self,
        a: View,
        b: View,
        (na, nb): (usize, usize),
        unchanged: [bool; 2],
        f: impl FnOnce(View, View),
    ) {
        let mut slots = self.bf16_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let [sa, sb] = &mut *slots;
        let [ua, ub] = unchanged.map(|u| u && self.cast_promises);
        self.round_into_slot(sa, a, na, ua);
        self.round_into_slot(sb, b, nb, ub);
        f(sa.view(a.len()), sb.view(b.len()))
    }

    /// `n` values of `v` rounded to bf16 into `slot` (grown to `v.len()` first if short),
    /// unless `unchanged` is promised and the slot holds them already (see [`Gemm::unchanged`]).
    fn round_into_slot(&self, slot: &mut CastSlot, v: View, n: usize, unchanged: bool) {
        slot.cast_into(
            &v,
            n,
            unchanged,
            |len| self.zeros_of(&[len], DType::F32, Category::Buffers),
            |t, n| round_into(t.view_mut().host::<f32>(), v, n),
        );
    }

    /// [`Self::with_bf16_operands`] for the one operand of a symmetric product: rounded once,
    /// into the first slot, so the product reads the same rounded values on both sides and its
    /// result is what rounding the input first gives. As there, the lock is held through `f`,
    /// whose product may run on rayon's threads: callers must not run bf16 products from
    /// several rayon tasks at once (a thread waiting inside `f` could pick up another task that
    /// then waits for the lock it holds), which is why Newton–Schulz runs its matrices one at a
    /// time in bf16 on a backend without native bf16 ([`Blas::native_bf16`]).
    fn with_bf16_operand(&self, a: View, na: usize, f: impl FnOnce(View)) {
        let mut slots = self.bf16_scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.round_into_slot(&mut slots[0], a, na, false);
        f(slots[0].view(a.len()))
    }
}

/// Where a GEMM writes in its C view: `rows` rows of `cols` from element `at`, `ld` apart.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    pub at: usize,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

impl Region {
    pub(crate) fn of(g: &Gemm, at: usize) -> Region {
        Region {
            at,
            rows: g.m,
            cols: g.n,
            ld: g.ldc,
        }
    }
}

impl CpuBackend {
    /// A bf16-input GEMM's product into C: as it is into an f32 C; into a bf16 C, `f` writes
    /// it in f32 into the output scratch (grown to `c.len()` first if short, the old one freed
    /// first), and each element of `regions` is rounded once from there into C, as cuBLAS's
    /// bf16 × bf16 → bf16 GemmEx writes (f32 accumulation, one rounding). A bf16 C is written,
    /// never accumulated into: every GEMM of `regions` has beta 0.
    pub(crate) fn with_f32_output(
        &self,
        c: ViewMut,
        regions: &[(Region, f32)],
        f: impl FnOnce(ViewMut),
    ) {
        if c.dtype() == DType::F32 {
            return f(c);
        }
        assert_eq!(
            c.dtype(),
            DType::BF16,
            "bf16-input gemm into {}",
            c.dtype().name()
        );
        assert!(
            regions.iter().all(|&(_, beta)| beta == 0.0),
            "a bf16 C is written, not accumulated into (beta 0)"
        );
        let mut slot = self.bf16_out.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_none_or(|t| t.len() < c.len()) {
            *slot = None;
            *slot = Some(self.zeros_of(&[c.len()], DType::F32, Category::Buffers));
        }
        let t = slot.as_mut().expect("sized above");
        f(t.slice_mut(0, c.len()));
        let (src, dst) = (t.view().host::<f32>(), c.host_bf16());
        for &(r, _) in regions {
            if r.rows == 0 || r.cols == 0 {
                continue;
            }
            let end = r.at + (r.rows - 1) * r.ld + r.cols;
            dst[r.at..end]
                .par_chunks_mut(r.ld)
                .zip(src[r.at..end].par_chunks(r.ld))
                .with_min_len((PAR_MIN / r.ld.max(1)).max(1))
                .for_each(|(d, s)| {
                    d[..r.cols]
                        .iter_mut()
                        .zip(&s[..r.cols])
                        .for_each(|(d, &x)| *d = crate::bf16::from_f32(x))
                });
        }
    }
}

impl Blas for CpuBackend {
    fn gemm(&self, c: ViewMut, a: View, b: View, g: Gemm) {
        if g.bf16_inputs {
            let [na, nb, _] = g.extents();
            let n = (na, nb);
            let regions = [(Region::of(&g, 0), g.beta)];
            return self.with_bf16_operands(a, b, n, g.unchanged, |a, b| {
                self.with_f32_output(c, &regions, |c| gemm::<f32>(c, a, b, g))
            });
        }
        crate::by_dtype!(c.dtype(), gemm(c, a, b, g))
    }
    fn syrk(&self, c: ViewMut, a: View, s: Syrk) {
        if s.bf16_inputs {
            assert_eq!(c.dtype(), DType::F32, "bf16-input syrk writes f32");
            let [na, _] = s.extents();
            return self.with_bf16_operand(a, na, |a| syrk::<f32>(c, a, s));
        }
        crate::by_dtype!(c.dtype(), syrk(c, a, s))
    }
    fn axpy(&self, y: ViewMut, alpha: f32, x: View) {
        crate::by_dtype!(y.dtype(), axpy(y, alpha, x))
    }
    fn scale(&self, y: ViewMut, alpha: f32) {
        crate::by_dtype!(y.dtype(), scale(y, alpha))
    }
    fn sumsq(&self, x: View) -> f64 {
        crate::by_dtype!(x.dtype(), sumsq(x))
    }
    fn sumsq_acc(&self, acc: ViewMut, x: View) {
        let s = crate::by_dtype!(x.dtype(), sumsq(x));
        acc.host::<f64>()[0] += s;
    }
    fn cast(&self, dst: ViewMut, src: View) {
        assert_eq!(dst.len(), src.len(), "cast between different lengths");
        match (src.dtype(), dst.dtype()) {
            (a, b) if a == b => self.copy(dst, src),
            (DType::F32, DType::BF16) => cast_to_bf16::<f32>(dst, src),
            (DType::F64, DType::BF16) => cast_to_bf16::<f64>(dst, src),
            (DType::BF16, DType::F32) => cast_from_bf16::<f32>(dst, src),
            (DType::BF16, DType::F64) => cast_from_bf16::<f64>(dst, src),
            (a, b) => panic!("no cast from {} to {}", a.name(), b.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;

    fn naive(a: &[f32], b: &[f32], g: Gemm, c: &mut [f32]) {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0.0f64;
                for p in 0..g.k {
                    let av = if g.trans_a {
                        a[p * g.lda + i]
                    } else {
                        a[i * g.lda + p]
                    };
                    let bv = if g.trans_b {
                        b[j * g.ldb + p]
                    } else {
                        b[p * g.ldb + j]
                    };
                    s += av as f64 * bv as f64;
                }
                let cv = &mut c[i * g.ldc + j];
                *cv = g.alpha * s as f32 + g.beta * *cv;
            }
        }
    }

    /// Uniform in [-0.5, 0.5).
    fn rand(n: usize, seed: u64) -> Vec<f32> {
        crate::sample::Lcg::new(seed).values(n, 0.5)
    }

    #[test]
    fn gemm_matches_naive_all_transposes_and_strides() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for &(m, n, k) in &[(3, 5, 7), (64, 96, 80), (130, 17, 65), (9, 200, 33)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    // Leading dimensions larger than the matrices: strided views.
                    let g = Gemm::new(m, n, k, ta, tb).alpha(0.7).beta(0.3);
                    let g = g.ld(g.lda + 3, g.ldb + 2, g.ldc + 5);
                    let a = rand(
                        extent(if ta { k } else { m }, if ta { m } else { k }, g.lda),
                        1,
                    );
                    let b = rand(
                        extent(if tb { n } else { k }, if tb { k } else { n }, g.ldb),
                        2,
                    );
                    let c0 = rand(extent(m, n, g.ldc), 3);
                    let mut want = c0.clone();
                    naive(&a, &b, g, &mut want);
                    let mut got = c0.clone();
                    pool.install(|| gemm_host(&mut got, &a, &b, g));
                    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (x - y).abs() < 1e-4,
                            "{m}x{n}x{k} ta={ta} tb={tb} at {i}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }

    /// A symmetric matrix with leading dimension `ld` (padding filled with a marker).
    fn sym(n: usize, ld: usize, seed: u64) -> Vec<f32> {
        let r = rand(n * n, seed);
        let mut c = vec![9.0f32; extent(n, n, ld)];
        for i in 0..n {
            for j in 0..n {
                c[i * ld + j] = r[i.max(j) * n + i.min(j)];
            }
        }
        c
    }

    #[test]
    fn syrk_matches_naive_gemm_odd_sizes_and_strides() {
        let pools: Vec<_> = [1, 2]
            .iter()
            .map(|&t| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap()
            })
            .collect();
        // Odd sizes (partial 8×8 tiles), one strip or panel and many, k over several of the
        // packed kernel's 256-long blocks, k = 0, and sizes big enough for the 2-thread pool
        // to split the work.
        for &(n, k) in &[
            (1, 1),
            (3, 7),
            (33, 65),
            (130, 17),
            (257, 300),
            (300, 64),
            (75, 600),
            (8, 0),
        ] {
            for trans in [false, true] {
                for (alpha, beta, pad, diag) in [(1.0, 0.0, 0, 0.0), (0.7, -0.3, 5, -1.25)] {
                    let s = Syrk::new(n, k, trans).alpha(alpha).beta(beta).diag(diag);
                    let s = s.ld(s.lda + pad, s.ldc + pad + 1);
                    let a_rows = if trans { k } else { n };
                    let a = rand(extent(a_rows, s.lda - pad, s.lda), 4);
                    let c0 = sym(n, s.ldc, 5);
                    let mut want = c0.clone();
                    naive(&a, &a, s.as_gemm(), &mut want);
                    (0..n).for_each(|i| want[i * s.ldc + i] += diag);
                    // Both packed kernels (where the CPU has them) and the strip fallback.
                    type Path = fn(&mut [f32], &[f32], Syrk);
                    let paths: [Path; 3] = [
                        |c, a, s| syrk_with::<f32>(c, a, s, SyrkPath::Packed),
                        |c, a, s| syrk_with::<f32>(c, a, s, SyrkPath::Packed8x8),
                        syrk_host_strips::<f32>,
                    ];
                    for (pool, path) in pools.iter().flat_map(|p| paths.map(|f| (p, f))) {
                        let mut got = c0.clone();
                        pool.install(|| path(&mut got, &a, s));
                        for i in 0..n {
                            for j in 0..s.ldc.min(extent(n, n, s.ldc) - i * s.ldc) {
                                let (x, y) = (got[i * s.ldc + j], want[i * s.ldc + j]);
                                // Padding untouched; values as a plain GEMM, f32 accumulation
                                // over k ≤ 300 products of magnitude ≤ 0.25.
                                assert!(
                                    (x - y).abs() < 1e-4 && (j < n || x == y),
                                    "n={n} k={k} trans={trans} at ({i},{j}): {x} vs {y}"
                                );
                                if j < n {
                                    assert_eq!(x.to_bits(), got[j * s.ldc + i].to_bits());
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn syrk_through_the_backend_equals_default_gemm_f64() {
        use crate::{Category, Ledger, Memory};
        // The CPU kernel against what the trait's default does (a full GEMM of A with itself),
        // plus the diagonal term, in f64, where the two differ by far less than the tolerance.
        let be = CpuBackend::new_f64(std::sync::Arc::new(Ledger::new()));
        let (n, k) = (70, 45);
        for trans in [false, true] {
            let a: Vec<f64> = rand(n * k, 7).iter().map(|&v| v as f64).collect();
            let a = be.upload_f64(&a, &[n * k], Category::Params);
            let s = Syrk::new(n, k, trans).alpha(0.5).diag(0.75);
            let mut c1 = be.zeros(&[n, n], Category::Params);
            let mut c2 = be.zeros(&[n, n], Category::Params);
            be.syrk(c1.view_mut(), a.view(), s);
            be.gemm(c2.view_mut(), a.view(), a.view(), s.as_gemm());
            let (x, mut y) = (be.download_f64(c1.view()), be.download_f64(c2.view()));
            (0..n).for_each(|i| y[i * n + i] += 0.75);
            for (i, (x, y)) in x.iter().zip(&y).enumerate() {
                assert!((x - y).abs() < 1e-12, "trans={trans} at {i}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn bf16_syrk_is_the_f32_product_of_rounded_inputs() {
        use crate::{Category, Ledger, Memory};
        let be = CpuBackend::new(std::sync::Arc::new(Ledger::new()));
        let round = |v: f32| crate::bf16::to_f32(crate::bf16::from_f32(v));
        // Sizes on both sides of the packed kernels' switch (n = 512 is too slow to hold
        // against the naive reference here; the switch itself is covered above in f32).
        for &(n, k) in &[(37, 90), (130, 257)] {
            for trans in [false, true] {
                let s = Syrk::new(n, k, trans).alpha(0.7).beta(-0.3).diag(0.25);
                let a: Vec<f32> = rand(n * k, 11).iter().map(|v| v * 3.0).collect();
                let c0 = sym(n, n, 12);
                let rounded: Vec<f32> = a.iter().map(|&v| round(v)).collect();
                let mut want = c0.clone();
                naive(&rounded, &rounded, s.as_gemm(), &mut want);
                (0..n).for_each(|i| want[i * n + i] += 0.25);
                let mut f32_want = c0.clone();
                naive(&a, &a, s.as_gemm(), &mut f32_want);
                (0..n).for_each(|i| f32_want[i * n + i] += 0.25);

                let ta = be.upload(&a, &[a.len()], Category::Params);
                let run = |s: Syrk| {
                    let mut c = be.upload(&c0, &[n, n], Category::Params);
                    be.syrk(c.view_mut(), ta.view(), s);
                    be.download(c.view())
                };
                let got = run(s.bf16_inputs(true));
                let (mut err, mut off_f32) = (0f32, 0f32);
                for i in 0..n * n {
                    err = err.max((got[i] - want[i]).abs());
                    off_f32 = off_f32.max((got[i] - f32_want[i]).abs());
                }
                // f32 summation of k ≤ 257 exact products of size ≤ 2.25: a few ulps of the
                // sums (≤ ~600), against bf16 rounding of the inputs (relative 2⁻⁹), which moves
                // the result by far more: the flag is honoured.
                assert!(
                    err < 2e-4,
                    "{n}x{k} trans={trans}: {err} from the rounded reference"
                );
                assert!(
                    off_f32 > 1e-2,
                    "{n}x{k} trans={trans}: only {off_f32} from f32"
                );
                for i in 0..n {
                    for j in 0..n {
                        assert_eq!(got[i * n + j].to_bits(), got[j * n + i].to_bits());
                    }
                }
                // The trait's default (a full GEMM through `as_gemm`, which carries the flag)
                // computes the same thing.
                let mut c = be.upload(&c0, &[n, n], Category::Params);
                let g = s.bf16_inputs(true).as_gemm();
                assert!(g.bf16_inputs);
                be.gemm(c.view_mut(), ta.view(), ta.view(), g);
                let mut via_gemm = be.download(c.view());
                (0..n).for_each(|i| via_gemm[i * n + i] += 0.25);
                for i in 0..n * n {
                    assert!((via_gemm[i] - got[i]).abs() < 2e-4, "{n}x{k} at {i}");
                }
            }
        }
    }

    #[test]
    fn a_promised_operand_reuses_its_cast_and_nothing_else_does() {
        let (m, n, k) = (5, 4, 7);
        let g = Gemm::new(m, n, k, false, false).bf16_inputs(true);
        let (a0, a1, b) = (rand(m * k, 1), rand(m * k, 2), rand(k * n, 3));
        let check = |be: &CpuBackend, honoured: bool| {
            let bt = be.upload(&b, &[k, n], Category::Params);
            let run = |a: &Tensor, g: Gemm| {
                let mut c = be.zeros(&[g.m, n], Category::Activations);
                be.gemm(c.view_mut(), a.view(), bt.view(), g);
                be.download(c.view())
            };
            let mut a = be.upload(&a0, &[m, k], Category::Activations);
            let c0 = run(&a, g);
            assert_eq!(run(&a, g.unchanged(true, true)), c0, "a kept promise");
            // A changes in place and a (false) promise says it did not: the old cast is
            // multiplied, which shows that the cast was skipped; without the promise, or on a
            // backend ignoring promises, the new values are.
            be.write(a.view_mut(), &a1);
            let stale = run(&a, g.unchanged(true, false));
            let fresh = run(&a, g);
            assert_ne!(fresh, c0);
            assert_eq!(stale == c0, honoured);
            assert_eq!(stale == fresh, !honoured);
            // A promise about another view (same values as before, another place) casts.
            let other = be.upload(&a0, &[m, k], Category::Activations);
            assert_eq!(run(&other, g.unchanged(true, false)), c0);
            // So does one about a view the slot holds fewer elements of than the call reads.
            let a2 = be.upload(
                &[a0.clone(), a1.clone()].concat(),
                &[2 * m, k],
                Category::Activations,
            );
            run(&a2, Gemm::new(m, n, k, false, false).bf16_inputs(true));
            let g2 = Gemm::new(2 * m, n, k, false, false).bf16_inputs(true);
            let mut want = c0.clone();
            want.extend(fresh.clone());
            assert_eq!(run(&a2, g2.unchanged(true, false)), want);
        };
        check(&CpuBackend::default(), true);
        check(&CpuBackend::default().with_cast_promises(false), false);
    }
    /// A bf16 C holds the f32 product rounded once, bit for bit, and only where the GEMM
    /// writes (rows ldc apart; a grouped GEMM's groups): the elements between them keep what
    /// they held. The f32 product passes through an output scratch on the ledger's buffers.
    #[test]
    fn a_bf16_c_is_the_f32_product_rounded_once() {
        use crate::backend::NnOps;
        use crate::Device;
        let be = CpuBackend::default();
        let (m, n, k, ldc) = (7, 5, 9, 8);
        let (a, b) = (rand(2 * m * k, 4), rand(k * n, 5));
        let (ta, tb) = (
            be.upload(&a, &[a.len()], Category::Activations),
            be.upload(&b, &[b.len()], Category::Params),
        );
        let g = Gemm::new(m, n, k, false, false)
            .ld(k, n, ldc)
            .bf16_inputs(true);
        // Two groups over the two halves of A, into rows 0..m and m + 1..2m + 1 of C (a row
        // between them that no group writes).
        let groups = [(g, 0, 0, 0), (g, m * k, 0, (m + 1) * ldc)];
        let len = (2 * m + 2) * ldc;
        let written = |i: usize, grouped: bool| {
            let (r, c) = (i / ldc, i % ldc);
            c < n && (r < m || (grouped && r > m && r <= 2 * m))
        };
        let sentinel = 0x1234u16;
        for grouped in [false, true] {
            let run = |c: ViewMut| match grouped {
                false => be.gemm(c, ta.view(), tb.view(), g),
                true => be.gemm_grouped(c, ta.view(), tb.view(), &groups),
            };
            let mut c32 = be.zeros(&[len], Category::Activations);
            run(c32.view_mut());
            let want = be.download(c32.view());
            let mut c16 = be.zeros_of(&[len], DType::BF16, Category::Activations);
            c16.view_mut().host_bf16().fill(sentinel);
            run(c16.view_mut());
            let got = c16.view().host_bf16();
            for i in 0..len {
                let w = match written(i, grouped) {
                    true => crate::bf16::from_f32(want[i]),
                    false => sentinel,
                };
                assert_eq!(got[i], w, "grouped {grouped}: element {i}");
            }
        }
        // The scratch on the ledger: f32 slots of A's and B's views and of the C view.
        let buffers = be
            .ledger()
            .report()
            .current(Device::Host, Category::Buffers);
        assert_eq!(buffers, 4 * (a.len() + b.len() + len) as u64);
        // No group (an expert-parallel rank that received no rows): bf16 operands and C, and
        // nothing written.
        let (a16, b16) = (
            be.zeros_of(&[a.len()], DType::BF16, Category::Activations),
            be.zeros_of(&[b.len()], DType::BF16, Category::Activations),
        );
        let mut c16 = be.zeros_of(&[len], DType::BF16, Category::Activations);
        c16.view_mut().host_bf16().fill(sentinel);
        be.gemm_grouped(c16.view_mut(), a16.view(), b16.view(), &[]);
        assert!(c16.view().host_bf16().iter().all(|&x| x == sentinel));
    }
}

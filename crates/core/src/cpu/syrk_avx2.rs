//! The f32 symmetric rank-k product on AVX2 + FMA, as BLAS `ssyrk` does it: `op(A)` is packed
//! once into 8-row panels (`[p][8]` per panel), and the same packed panels serve as both
//! operands of an 8×8 micro-kernel, which runs only the tiles on and below the diagonal. That
//! is about half a GEMM's multiply-adds with a single packing; splitting the product into
//! `matrixmultiply` strips instead repacks the operands for every strip (BENCHMARKS.md,
//! "Cheaper Newton–Schulz"). From n = 512 the GEMM's 6×16 kernel over the lower tiles
//! ([`super::gemm_avx2::syrk_lower`]) is faster, and `syrk_host` takes it there; at n = 256
//! (Newton–Schulz at `small`) this kernel's smaller diagonal tiles win.
//!
//! Each element of C is one fixed-order sum: a fused multiply-add chain over `KC`-long blocks
//! of `k`, the blocks added in order. Threads split the rows, so the result does not
//! depend on the thread count.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::gemm_avx2::transpose8;
use rayon::prelude::*;

/// Rows per panel and micro-tile side.
const MR: usize = 8;
/// `k` per block: two panels' blocks (2 × 8 KiB) stay in L1 while the micro-kernel runs.
const KC: usize = 256;
/// Row panels per block (128 rows): a block's packed rows stay in L2.
const MC: usize = 16;
/// Below this many multiply-adds the product runs on the calling thread.
const PAR_MIN: usize = 1 << 17;

/// Whether to use the kernel: this CPU has AVX2 and FMA (detected at run time), and
/// `GANYMEDE_CPU_SYRK` is not `strips` (which keeps the `matrixmultiply` strips, for side-by-side
/// benchmarks in one binary). Read once per process.
pub fn available() -> bool {
    static USE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USE.get_or_init(|| {
        let strips = std::env::var("GANYMEDE_CPU_SYRK").is_ok_and(|v| v == "strips");
        super::gemm_avx2::avx2_fma() && !strips
    })
}

/// `GANYMEDE_CPU_SYRK=8x8` (`Some(true)`): this module's kernel for every size; `=6x16`
/// (`Some(false)`): the GEMM's kernel over the lower tiles ([`super::gemm_avx2::syrk_lower`]) for
/// every size; unset, the size decides (`syrk_host`). For side-by-side benchmarks in one binary.
/// Read once per process.
pub fn forced() -> Option<bool> {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| match std::env::var("GANYMEDE_CPU_SYRK").as_deref() {
        Ok("8x8") => Some(true),
        Ok("6x16") => Some(false),
        _ => None,
    })
}

#[derive(Clone, Copy)]
struct Ptr(*mut f32);
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

/// Packed operands kept between calls, so that Newton–Schulz's loop does not allocate. A pool,
/// not one buffer per thread: a rayon worker waiting inside one product may run another.
static PACKED: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// `C[i][j] = alpha·Σ_p op(A)[i][p]·op(A)[j][p] + beta·C[i][j]` for `j ≤ i` (the lower
/// triangle, and the diagonal tiles' upper part, which the caller overwrites by mirroring).
/// `op(A)[i][p]` is at `a[i·rsa + p·csa]`; with `beta == 0` C is not read.
///
/// # Safety
/// `available()` must be true; `a` and `c` must describe valid matrices (the caller checks the
/// extents), and `c` must not alias `a`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn syrk_lower(
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    a: &[f32],
    rsa: usize,
    csa: usize,
    c: *mut f32,
    ldc: usize,
) {
    let panels = n.div_ceil(MR);
    let len = panels * k * MR;
    let run = |packed: &mut [f32]| {
        pack(packed, n, k, a, rsa, csa);
        let packed: &[f32] = packed;
        let cp = Ptr(c);
        let threads = rayon::current_num_threads();
        let serial = threads == 1 || n * n * k / 2 < PAR_MIN;
        // Threads take row blocks, whose work grows down the triangle: a few per thread balance.
        let mc = if serial {
            MC
        } else {
            MC.min(panels.div_ceil(4 * threads)).max(1)
        };
        let blocks = panels.div_ceil(mc);
        let rows = move |rb: usize| {
            let cp = cp;
            // Safety: row block `rb` writes only its own rows of C.
            unsafe { row_block(rb, mc, panels, n, k, alpha, beta, packed, cp.0, ldc) }
        };
        if serial || blocks == 1 {
            (0..blocks).for_each(rows);
        } else {
            // The longest row blocks (the bottom ones) first, the short ones fill in at the end.
            (0..blocks)
                .into_par_iter()
                .for_each(|b| rows(blocks - 1 - b));
        }
    };
    let take = || PACKED.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut buf = take().unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    run(&mut buf[..len]);
    PACKED.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
}

/// The strictly upper triangle of the n×n matrix `c` (row stride `ldc`) from its lower one,
/// whole 8×8 tiles by register transposes, the rest element by element.
///
/// # Safety
/// `available()` must be true and `c` must hold the matrix.
pub unsafe fn mirror_lower(c: &mut [f32], n: usize, ldc: usize) {
    let full = n - n % MR;
    let cp = c.as_mut_ptr();
    for i0 in (0..full).step_by(MR) {
        for j0 in (i0 + MR..full).step_by(MR) {
            // Rows i0.., columns j0.. (upper) from rows j0.., columns i0.. (lower).
            transpose8(cp.add(j0 * ldc + i0), ldc, cp.add(i0 * ldc + j0), ldc);
        }
    }
    // Inside the diagonal tiles, the columns past the last whole tile, and the rows below it.
    for i in 0..n {
        let (tile_end, tail) = if i < full {
            (i - i % MR + MR, full)
        } else {
            (n, n)
        };
        for j in (i + 1..tile_end).chain(tail..n) {
            c[i * ldc + j] = c[j * ldc + i];
        }
    }
}

/// `packed[r][p][ii] = op(A)[r·8 + ii][p]`, zero past row `n`.
fn pack(packed: &mut [f32], n: usize, k: usize, a: &[f32], rsa: usize, csa: usize) {
    if k == 0 {
        return;
    }
    let fill = |(r, panel): (usize, &mut [f32])| {
        let rows = MR.min(n - r * MR);
        if rows < MR {
            panel.fill(0.0);
        }
        let i0 = r * MR;
        if rsa == 1 {
            // op(A) = Aᵀ of a row-major A: a panel's 8 values of one p are contiguous.
            for p in 0..k {
                let src = &a[p * csa + i0..p * csa + i0 + rows];
                panel[p * MR..p * MR + rows].copy_from_slice(src);
            }
        } else if csa == 1 && rows == MR {
            // Rows contiguous (op(A) = A): eight rows by eight columns at a time, transposed in
            // registers, instead of eight strided stores per value read.
            let p8 = k - k % 8;
            for p in (0..p8).step_by(8) {
                // Safety: rows i0..i0+8 hold k ≥ p+8 values from i·rsa (checked by the caller);
                // the panel holds 8·k values.
                unsafe {
                    transpose8(
                        a.as_ptr().add(i0 * rsa + p),
                        rsa,
                        panel[p * MR..].as_mut_ptr(),
                        MR,
                    )
                };
            }
            for ii in 0..MR {
                let i = i0 + ii;
                for p in p8..k {
                    panel[p * MR + ii] = a[i * rsa + p];
                }
            }
        } else {
            for ii in 0..rows {
                let i = i0 + ii;
                for p in 0..k {
                    panel[p * MR + ii] = a[i * rsa + p * csa];
                }
            }
        }
    };
    if n * k < PAR_MIN || rayon::current_num_threads() == 1 {
        packed.chunks_mut(k * MR).enumerate().for_each(fill);
    } else {
        packed.par_chunks_mut(k * MR).enumerate().for_each(fill);
    }
}

/// Row block `rb` (panels `[rb·mc, rb·mc + mc)`, `mc ≤ MC`): its tiles on and left of the diagonal, `k`
/// block by block. The block's packed rows (`MC · 8 · KC` floats, 128 KiB) stay in L2 while every
/// column panel passes by; a column panel's block (8 KiB) stays in L1 across the rows.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_block(
    rb: usize,
    mc: usize,
    panels: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    packed: &[f32],
    c: *mut f32,
    ldc: usize,
) {
    let panel = |r: usize, p0: usize| packed.as_ptr().add(r * k * MR + p0 * MR);
    let (r0, r1) = (rb * mc, (rb * mc + mc).min(panels));
    let mut p0 = 0;
    loop {
        let kc = KC.min(k - p0);
        // The first block applies beta; later ones add to what is there.
        let b = if p0 == 0 { beta } else { 1.0 };
        // Column panels two at a time (their blocks stay in L1), each row panel's two halves
        // by the 4×16 kernel; the diagonal panel of an even row panel by the 8×8.
        for g in (0..r1).step_by(2) {
            for ip in r0.max(g)..r1 {
                if ip > g {
                    let (b0, b1) = (panel(g, p0), panel(g + 1, p0));
                    for half in 0..2 {
                        let acc = kernel4x16(kc, panel(ip, p0).add(4 * half), b0, b1);
                        store(&acc, 2, ip * MR + 4 * half, g * MR, n, alpha, b, c, ldc);
                    }
                } else {
                    let acc = kernel(kc, panel(ip, p0), panel(g, p0));
                    store(&acc, 1, ip * MR, g * MR, n, alpha, b, c, ldc);
                }
            }
        }
        p0 += kc;
        if p0 >= k {
            break;
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn row_block(
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: f32,
    _: f32,
    _: &[f32],
    _: *mut f32,
    _: usize,
) {
    unreachable!("syrk_avx2 on a CPU without AVX2")
}

/// One 8×8 tile: `acc[ii]` holds columns `jj = 0..8` of row `ii`, Σ_p a[p][ii]·b[p][jj].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
unsafe fn kernel(kc: usize, a: *const f32, b: *const f32) -> [__m256; MR] {
    // Named accumulators so that all eight stay in registers: eight independent chains cover
    // the FMA latency on two pipes.
    let (mut c0, mut c1, mut c2, mut c3) = (
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    );
    let (mut c4, mut c5, mut c6, mut c7) = (
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    );
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        let bv = _mm256_loadu_ps(b);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a), bv, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(1)), bv, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(2)), bv, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(3)), bv, c3);
        c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(4)), bv, c4);
        c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(5)), bv, c5);
        c6 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(6)), bv, c6);
        c7 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a.add(7)), bv, c7);
        a = a.add(MR);
        b = b.add(MR);
    }
    [c0, c1, c2, c3, c4, c5, c6, c7]
}

/// Four rows by 16 columns: rows from half a packed panel (`a`, stride 8 per p), columns from
/// two panels. A step loads 2 vectors and 4 scalars for 8 FMAs (the 8×8 tile: 9 loads for 8).
/// `acc[ii·2 + v]` holds row `ii`, columns `8v..8v+8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
// Out of line: inlined, the caller's live vectors crowd the accumulators' registers.
#[inline(never)]
unsafe fn kernel4x16(kc: usize, a: *const f32, b0: *const f32, b1: *const f32) -> [__m256; 8] {
    let z = _mm256_setzero_ps;
    let (mut c00, mut c01, mut c10, mut c11) = (z(), z(), z(), z());
    let (mut c20, mut c21, mut c30, mut c31) = (z(), z(), z(), z());
    macro_rules! step {
        ($o:expr) => {{
            let o = $o;
            let (x0, x1) = (_mm256_loadu_ps(b0.add(o)), _mm256_loadu_ps(b1.add(o)));
            let r = _mm256_broadcast_ss(&*a.add(o));
            c00 = _mm256_fmadd_ps(r, x0, c00);
            c01 = _mm256_fmadd_ps(r, x1, c01);
            let r = _mm256_broadcast_ss(&*a.add(o + 1));
            c10 = _mm256_fmadd_ps(r, x0, c10);
            c11 = _mm256_fmadd_ps(r, x1, c11);
            let r = _mm256_broadcast_ss(&*a.add(o + 2));
            c20 = _mm256_fmadd_ps(r, x0, c20);
            c21 = _mm256_fmadd_ps(r, x1, c21);
            let r = _mm256_broadcast_ss(&*a.add(o + 3));
            c30 = _mm256_fmadd_ps(r, x0, c30);
            c31 = _mm256_fmadd_ps(r, x1, c31);
        }};
    }
    // Four steps per iteration: fewer loop instructions among the FMAs (as in gemm_avx2).
    let p4 = kc - kc % 4;
    for p in (0..p4).step_by(4) {
        step!(p * MR);
        step!((p + 1) * MR);
        step!((p + 2) * MR);
        step!((p + 3) * MR);
    }
    for p in p4..kc {
        step!(p * MR);
    }
    [c00, c01, c10, c11, c20, c21, c30, c31]
}

/// `C_tile = alpha·acc + beta·C_tile` over the tile's part inside the n×n matrix: `acc` holds
/// rows of `vecs` 8-wide vectors, starting at `(i0, j0)`.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store(
    acc: &[__m256],
    vecs: usize,
    i0: usize,
    j0: usize,
    n: usize,
    alpha: f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    let va = _mm256_set1_ps(alpha);
    let vb = _mm256_set1_ps(beta);
    for (t, &acc) in acc.iter().enumerate() {
        let (i, j) = (i0 + t / vecs, j0 + (t % vecs) * MR);
        if i >= n || j >= n {
            continue;
        }
        let cols = MR.min(n - j);
        let row = c.add(i * ldc + j);
        if cols == MR {
            let v = if beta == 0.0 {
                _mm256_mul_ps(va, acc)
            } else {
                _mm256_fmadd_ps(vb, _mm256_loadu_ps(row), _mm256_mul_ps(va, acc))
            };
            _mm256_storeu_ps(row, v);
        } else {
            let mut t = [0f32; MR];
            _mm256_storeu_ps(t.as_mut_ptr(), _mm256_mul_ps(va, acc));
            for (jj, &t) in t.iter().enumerate().take(cols) {
                let x = row.add(jj);
                *x = if beta == 0.0 { t } else { beta.mul_add(*x, t) };
            }
        }
    }
}

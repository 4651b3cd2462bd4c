//! The f32 GEMM on AVX2 + FMA, blocked and packed as BLIS does it: `op(B)` is packed once per
//! `KC × NC` block into 16-column panels, shared by every thread; each thread packs its own
//! `MC × KC` blocks of `op(A)` into 6-row panels; a 6×16 micro-kernel keeps twelve accumulators
//! in registers and loads two vectors and six scalars for twelve FMAs. `matrixmultiply`'s
//! 8×8 kernel loads nine values for eight FMAs and is held by the load ports, and splitting a
//! product between threads there means packing `op(B)` once per piece (BENCHMARKS.md, "A packed
//! GEMM").
//!
//! Each element of C is one fixed-order sum: a fused multiply-add chain over `KC`-long blocks of
//! `k`, the blocks added in order. Neither the thread count nor the partition changes it, and
//! row `i` of C depends only on row `i` of `op(A)`, whatever `m` is.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rayon::prelude::*;

/// Rows per packed panel of `op(A)` and per micro-tile.
const MR: usize = 6;
/// Columns per packed panel of `op(B)` and per micro-tile: two vectors.
const NR: usize = 16;
/// `k` per block: a 16-column panel's block (16 KiB) stays in L1 while a row block passes.
const KC: usize = 256;
/// Rows per block of `op(A)` (96 KiB packed at `KC`): stays in L2.
const MC: usize = 96;
/// Columns per block of `op(B)` (2 MiB packed at `KC`): in L3, shared by the threads.
const NC: usize = 2048;
/// Below this many multiply-adds the product runs on the calling thread.
const PAR_MIN: usize = 1 << 17;

/// Whether this CPU has AVX2 and FMA (detected at run time; also for [`super::syrk_avx2`]).
pub(super) fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether to use the kernel: [`avx2_fma`], and `GANYMEDE_CPU_GEMM` is not `matrixmultiply`
/// (which keeps that crate's kernels, for side-by-side benchmarks in one binary). Read once per
/// process.
pub fn available() -> bool {
    static USE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USE.get_or_init(|| {
        let other = std::env::var("GANYMEDE_CPU_GEMM").is_ok_and(|v| v == "matrixmultiply");
        avx2_fma() && !other
    })
}

#[derive(Clone, Copy)]
struct Ptr(*mut f32);
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Ptr {
    /// Through a method, so that a closure captures the `Sync` wrapper, not its raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[derive(Clone, Copy)]
struct ConstPtr(*const f32);
unsafe impl Send for ConstPtr {}
unsafe impl Sync for ConstPtr {}

/// Packing buffers kept between calls, so that a training step does not allocate. A pool, not
/// one buffer per thread: a rayon worker waiting inside one product may run another.
static POOL: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

fn take(len: usize) -> Vec<f32> {
    let mut buf = POOL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    buf
}

fn give(buf: Vec<f32>) {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
}

/// An operand: `op(X)[i][p]` is at `ptr[i·rs + p·cs]`.
#[derive(Clone, Copy)]
struct Operand {
    ptr: ConstPtr,
    rs: usize,
    cs: usize,
}

impl ConstPtr {
    /// Through a method, so that a closure captures the `Sync` wrapper, not its raw field.
    fn get(self) -> *const f32 {
        self.0
    }
}

/// Whether a parallel product splits C into one whole product per thread (each packing its own
/// op(B)) rather than sharing each packed block of op(B) between the threads: when k spans
/// several blocks (a join per block) or the product is small (the shared packing runs on one
/// thread while the others wait). `GANYMEDE_GEMM_SPLIT=shared|whole` forces one, to measure.
fn split_whole(m: usize, n: usize, k: usize) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = MODE.get_or_init(|| match std::env::var("GANYMEDE_GEMM_SPLIT").as_deref() {
        Ok("whole") => Some(true),
        Ok("shared") => Some(false),
        _ => None,
    });
    forced.unwrap_or(k > KC || m * n * k <= 1 << 26)
}

impl Operand {
    /// Through a method, so that a closure captures the `Sync` operand, not its raw field.
    fn base(self) -> *const f32 {
        self.ptr.0
    }
}

/// `C = alpha·op(A)·op(B) + beta·C` for an m×k `op(A)` and a k×n `op(B)`, with `op(A)[i][p]` at
/// `a[i·rsa + p·csa]`, `op(B)[p][j]` at `b[p·rsb + j·csb]` and `C[i][j]` at `c[i·ldc + j]`. With
/// `beta == 0` C is not read. With `parallel` the work is split between rayon's threads above a
/// size; without, it all runs on the calling thread (for callers that split the work already).
///
/// # Safety
/// `available()` must be true; the pointers must describe valid matrices (the caller checks the
/// extents), and `c` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
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
) {
    gemm_impl(m, n, k, alpha, a, b, beta, c, ldc, parallel, None)
}

/// The lower triangle of the symmetric `C = alpha·op(A)·op(A)ᵀ + beta·C` (n×n, `op(A)` n×k at
/// `a[i·rsa + p·csa]`) by the GEMM's kernel, skipping every 6×16 tile above the diagonal: about
/// half the product's multiply-adds, at the GEMM's rate (the 16-column panels of `op(A)ᵀ` are
/// packed once per block of k, as for any `op(B)`). Tiles that cross the diagonal also write
/// some of the upper triangle, which the caller overwrites by mirroring. Above a size, rayon's
/// threads take row bands of equal triangle area.
///
/// # Safety
/// As for [`gemm`], with `a` as both operands.
#[allow(clippy::too_many_arguments)]
pub unsafe fn syrk_lower(
    n: usize,
    k: usize,
    alpha: f32,
    (a, rsa, csa): (*const f32, usize, usize),
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    let (opa, opb) = ((a, rsa, csa), (a, csa, rsa));
    let threads = rayon::current_num_threads();
    if threads == 1 || n * n * k / 2 < PAR_MIN {
        return gemm_impl(n, n, k, alpha, opa, opb, beta, c, ldc, false, Some(0));
    }
    // Row band t of T ends at n·√(t/T) (so each holds ~1/T of the triangle), rounded to whole
    // tiles; a band needs only the columns up to its last row.
    let bands = 2 * threads;
    let ends: Vec<usize> = (1..=bands)
        .map(|t| {
            let e = (n as f64 * (t as f64 / bands as f64).sqrt()).round() as usize;
            if t == bands {
                n
            } else {
                e.next_multiple_of(MR).min(n)
            }
        })
        .collect();
    let (ap, cp) = (ConstPtr(a), Ptr(c));
    // The longest bands (the bottom ones) first.
    (0..bands).into_par_iter().rev().for_each(|t| {
        let s = if t == 0 { 0 } else { ends[t - 1] };
        let e = ends[t];
        if s >= e {
            return;
        }
        let (a, c) = (ap.get(), cp.get());
        // Safety: bands are disjoint row ranges of C inside the caller's extents.
        unsafe {
            gemm_impl(
                e - s,
                e,
                k,
                alpha,
                (a.wrapping_add(s * rsa), rsa, csa),
                (a, csa, rsa),
                beta,
                c.wrapping_add(s * ldc),
                ldc,
                false,
                Some(s),
            )
        }
    });
}

/// [`gemm`], or with `lower = Some(r0)` only the tiles that reach on or below the diagonal of a
/// C whose first row is row `r0` of a square matrix (column `j` of C being column `j` there).
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_impl(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    (a, rsa, csa): (*const f32, usize, usize),
    (b, rsb, csb): (*const f32, usize, usize),
    beta: f32,
    c: *mut f32,
    ldc: usize,
    parallel: bool,
    lower: Option<usize>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        scale_c(m, n, beta, c, ldc);
        return;
    }
    let threads = rayon::current_num_threads();
    let parallel = parallel && threads > 1 && m * n * k >= PAR_MIN;
    if parallel && lower.is_none() && split_whole(m, n, k) {
        // One independent product per thread over all of k, each packing its own op(B): no
        // join per block of k, which small products (a weight gradient's 256 × 256 over 2,048
        // tokens, Newton–Schulz's 256 × 256 × 256) cannot amortise.
        let split_m = m >= n;
        let (len, unit) = if split_m { (m, MR) } else { (n, NR) };
        let pieces = threads.min(len.div_ceil(unit));
        let step = len.div_ceil(pieces).next_multiple_of(unit);
        let (ap, bp, cp) = (ConstPtr(a), ConstPtr(b), Ptr(c));
        (0..len.div_ceil(step)).into_par_iter().for_each(|p| {
            let (s, e) = (p * step, (p * step + step).min(len));
            let (a, b, c) = (ap.get(), bp.get(), cp.get());
            // The piece: rows s..e of C (and of op(A)), or columns s..e (and of op(B)).
            let (mp, np, a, b, c) = if split_m {
                (
                    e - s,
                    n,
                    a.wrapping_add(s * rsa),
                    b,
                    c.wrapping_add(s * ldc),
                )
            } else {
                (m, e - s, a, b.wrapping_add(s * csb), c.wrapping_add(s))
            };
            // Safety: pieces are disjoint blocks of C inside the caller's extents.
            unsafe {
                gemm(
                    mp,
                    np,
                    k,
                    alpha,
                    (a, rsa, csa),
                    (b, rsb, csb),
                    beta,
                    c,
                    ldc,
                    false,
                )
            }
        });
        return;
    }
    let a = Operand {
        ptr: ConstPtr(a),
        rs: rsa,
        cs: csa,
    };
    let b = Operand {
        ptr: ConstPtr(b),
        rs: rsb,
        cs: csb,
    };
    let nc_max = NC.min(n.next_multiple_of(NR));
    let kc_max = KC.min(k);
    let mut bbuf = take(nc_max * kc_max);
    let cp = Ptr(c);
    for j0 in (0..n).step_by(NC) {
        let nc = NC.min(n - j0);
        let mut p0 = 0;
        while p0 < k {
            let kc = KC.min(k - p0);
            let bpack = &mut bbuf[..nc.next_multiple_of(NR) * kc];
            pack_b(bpack, b, p0, kc, j0, nc, parallel);
            let bpack: &[f32] = bpack;
            // The first block of k applies beta; later ones add to what is there.
            let bet = if p0 == 0 { beta } else { 1.0 };
            let (mc, col_groups) = partition(m, nc, threads, parallel);
            let row_blocks = m.div_ceil(mc);
            let panels = nc.div_ceil(NR);
            let per_group = panels.div_ceil(col_groups);
            let task = |t: usize| {
                let (rb, cg) = (t / col_groups, t % col_groups);
                let (i0, i1) = (rb * mc, (rb * mc + mc).min(m));
                let (q0, q1) = (cg * per_group, (cg * per_group + per_group).min(panels));
                if q0 >= q1 {
                    return;
                }
                let rows = i1 - i0;
                // A row-major op(A) is read in place: the kernel broadcasts from six row
                // pointers as cheaply as from a packed panel, and its rows stream from L2.
                // Only a last partial panel is packed (zero rows past m). Other layouts are
                // packed whole.
                let direct = a.cs == 1;
                let packed_rows = if direct { rows % MR } else { rows };
                let mut abuf = take(packed_rows.next_multiple_of(MR) * kc + 2);
                let panels_a = if direct {
                    let full = rows / MR;
                    if packed_rows > 0 {
                        pack_a(&mut abuf, a, i0 + full * MR, packed_rows, p0, kc);
                    }
                    APanels::Direct {
                        base: ConstPtr(a.base().wrapping_add(i0 * a.rs + p0)),
                        rs: a.rs,
                        full,
                        tail: &abuf,
                    }
                } else {
                    pack_a(&mut abuf, a, i0, rows, p0, kc);
                    APanels::Packed(&abuf)
                };
                // Safety: task `t` writes only rows i0..i1, columns of panels q0..q1, of C.
                macro_block(
                    &panels_a,
                    bpack,
                    i0,
                    rows,
                    j0,
                    nc,
                    q0,
                    q1,
                    kc,
                    alpha,
                    bet,
                    cp.get(),
                    ldc,
                    lower,
                );
                give(abuf);
            };
            let tasks = row_blocks * col_groups;
            if parallel && tasks > 1 {
                (0..tasks).into_par_iter().for_each(task);
            } else {
                (0..tasks).for_each(task);
            }
            p0 += kc;
        }
    }
    give(bbuf);
}

/// Rows per block and column groups per `op(B)` block: serial, the cache sizes decide; in
/// parallel, a multiple of the thread count of equal tasks, splitting the columns too when
/// there are too few rows to go round.
fn partition(m: usize, nc: usize, threads: usize, parallel: bool) -> (usize, usize) {
    if !parallel {
        return (MC, 1);
    }
    let blocks = m.div_ceil(MC).next_multiple_of(threads);
    let mc = m.div_ceil(blocks).next_multiple_of(MR).min(MC);
    let row_blocks = m.div_ceil(mc);
    let panels = nc.div_ceil(NR);
    let col_groups = if row_blocks >= threads {
        1
    } else {
        threads.div_ceil(row_blocks).min(panels)
    };
    (mc, col_groups)
}

fn scale_c(m: usize, n: usize, beta: f32, c: *mut f32, ldc: usize) {
    for i in 0..m {
        // Safety: the caller's C holds m rows of n values ldc apart.
        let row = unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), n) };
        if beta == 0.0 {
            row.fill(0.0);
        } else {
            row.iter_mut().for_each(|x| *x *= beta);
        }
    }
}

/// `out[q][p][jj] = op(B)[p0 + p][j0 + q·16 + jj]`, zero past column `j0 + nc`.
fn pack_b(out: &mut [f32], b: Operand, p0: usize, kc: usize, j0: usize, nc: usize, par: bool) {
    let fill = |(q, panel): (usize, &mut [f32])| {
        let j = j0 + q * NR;
        let cols = NR.min(j0 + nc - j);
        let bp = b.base();
        // Safety (all three arms): the caller checked that op(B) holds k × n values.
        if b.cs == 1 {
            for p in 0..kc {
                let src = unsafe { bp.add((p0 + p) * b.rs + j) };
                let dst = &mut panel[p * NR..p * NR + NR];
                if cols == NR {
                    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), NR) };
                } else {
                    let src = unsafe { std::slice::from_raw_parts(src, cols) };
                    dst[..cols].copy_from_slice(src);
                    dst[cols..].fill(0.0);
                }
            }
        } else if b.rs == 1 && cols == NR {
            // op(B) = Bᵀ of a row-major B: 16 rows of B, each contiguous in p, go through
            // 8×8 register transposes into the panel's [p][16] layout.
            let p8 = kc - kc % 8;
            for p in (0..p8).step_by(8) {
                for half in 0..2 {
                    unsafe {
                        transpose8(
                            bp.add((j + 8 * half) * b.cs + p0 + p),
                            b.cs,
                            panel[p * NR + 8 * half..].as_mut_ptr(),
                            NR,
                        )
                    };
                }
            }
            for p in p8..kc {
                for jj in 0..NR {
                    panel[p * NR + jj] = unsafe { *bp.add((j + jj) * b.cs + p0 + p) };
                }
            }
        } else {
            for p in 0..kc {
                for jj in 0..NR {
                    panel[p * NR + jj] = if jj < cols {
                        unsafe { *bp.add((p0 + p) * b.rs + (j + jj) * b.cs) }
                    } else {
                        0.0
                    };
                }
            }
        }
    };
    let panels = nc.div_ceil(NR);
    let out = &mut out[..panels * NR * kc];
    if par && panels * kc * NR >= PAR_MIN {
        out.par_chunks_mut(NR * kc).enumerate().for_each(fill);
    } else {
        out.chunks_mut(NR * kc).enumerate().for_each(fill);
    }
}

/// `out[r][p][ii] = op(A)[i0 + r·6 + ii][p0 + p]` for `rows` rows, zero past them. `out` has
/// two floats of slack past the last panel (the transposing path stores 8 where 6 are kept).
fn pack_a(out: &mut [f32], a: Operand, i0: usize, rows: usize, p0: usize, kc: usize) {
    let ap = a.base();
    let mut tmp = [0f32; 64];
    for (r, panel) in out[..rows.next_multiple_of(MR) * kc]
        .chunks_mut(MR * kc)
        .enumerate()
    {
        let i = i0 + r * MR;
        let live = MR.min(rows - r * MR);
        // Safety (all arms): the caller checked that op(A) holds m × k values.
        if a.rs == 1 && live == MR {
            // op(A) = Aᵀ of a row-major A: a panel's six values of one p are contiguous.
            for p in 0..kc {
                let src = unsafe { ap.add((p0 + p) * a.cs + i) };
                unsafe { std::ptr::copy_nonoverlapping(src, panel[p * MR..].as_mut_ptr(), MR) };
            }
        } else if a.cs == 1 && live == MR {
            // Rows contiguous in p: eight p at a time through a register transpose of six rows
            // (two repeated), keeping six of each transposed row.
            let p8 = kc - kc % 8;
            for p in (0..p8).step_by(8) {
                unsafe { transpose6x8(ap.add(i * a.rs + p0 + p), a.rs, tmp.as_mut_ptr()) };
                for q in 0..8 {
                    panel[(p + q) * MR..(p + q) * MR + MR].copy_from_slice(&tmp[q * 8..q * 8 + MR]);
                }
            }
            for p in p8..kc {
                for ii in 0..MR {
                    panel[p * MR + ii] = unsafe { *ap.add((i + ii) * a.rs + p0 + p) };
                }
            }
        } else {
            for p in 0..kc {
                for ii in 0..MR {
                    panel[p * MR + ii] = if ii < live {
                        unsafe { *ap.add((i + ii) * a.rs + (p0 + p) * a.cs) }
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

/// Where a block's row panels of `op(A)` are: packed (`[r][p][6]`), or in place with a packed
/// last partial panel.
enum APanels<'a> {
    Packed(&'a [f32]),
    Direct {
        /// Row 0 of the block at its first `p`.
        base: ConstPtr,
        /// Row stride (the column stride is 1).
        rs: usize,
        /// Whole panels read in place; the panel after them is `tail`.
        full: usize,
        tail: &'a [f32],
    },
}

impl APanels<'_> {
    /// Row panel `r` as (pointer, row stride, stride between consecutive `p`).
    fn panel(&self, r: usize, kc: usize) -> (*const f32, usize, usize) {
        match *self {
            APanels::Packed(p) => (p[r * MR * kc..].as_ptr(), 1, MR),
            APanels::Direct {
                base,
                rs,
                full,
                tail,
            } => {
                if r < full {
                    (base.0.wrapping_add(r * MR * rs), rs, 1)
                } else {
                    (tail.as_ptr(), 1, MR)
                }
            }
        }
    }
}

/// The tiles of rows `i0..i0+rows` and column panels `q0..q1` of the block at column `j0` (with
/// `lower`, only those reaching the diagonal or below it, see [`gemm_impl`]).
#[allow(clippy::too_many_arguments)]
fn macro_block(
    apanels: &APanels,
    bpack: &[f32],
    i0: usize,
    rows: usize,
    j0: usize,
    nc: usize,
    q0: usize,
    q1: usize,
    kc: usize,
    alpha: f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
    lower: Option<usize>,
) {
    let row_panels = rows.div_ceil(MR);
    for q in q0..q1 {
        let bq = bpack[q * NR * kc..].as_ptr();
        let j = j0 + q * NR;
        let cols = NR.min(j0 + nc - j);
        for r in 0..row_panels {
            let (ar, rs, cs) = apanels.panel(r, kc);
            let live = MR.min(rows - r * MR);
            // Lower triangle only: a tile whose first column is right of its last row's
            // diagonal entry lies wholly above the diagonal.
            if lower.is_some_and(|r0| j >= r0 + i0 + r * MR + live) {
                continue;
            }
            // Safety: the panels hold kc·6 and kc·16 values (or the rows of op(A) kc long);
            // the tile is inside C.
            unsafe {
                // C's rows are `ldc` apart and far from cache after the previous block of k:
                // fetch the tile's lines while the kernel runs, or the stores wait on them.
                prefetch_tile(c.add((i0 + r * MR) * ldc + j), live, ldc);
                let acc = kernel6x16(kc, ar, rs, cs, bq);
                store(
                    &acc,
                    live,
                    cols,
                    alpha,
                    beta,
                    c.add((i0 + r * MR) * ldc + j),
                    ldc,
                );
            }
        }
    }
}

/// Prefetch the `rows` rows of 16 floats of a C tile (each may straddle two cache lines).
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn prefetch_tile(c: *const f32, rows: usize, ldc: usize) {
    for ii in 0..rows {
        let row = c.add(ii * ldc) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(row);
        _mm_prefetch::<_MM_HINT_T0>(row.add(63));
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn prefetch_tile(_: *const f32, _: usize, _: usize) {}

/// One 6×16 tile: `acc[2·ii + v]` holds row `ii`, columns `8v..8v+8`, Σ_p a[ii·rs + p·cs]·b[p][·]
/// (a packed panel has rs = 1, cs = 6; a row-major operand in place rs = its stride, cs = 1).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
// Out of line: inlined, the caller's live values crowd the accumulators' registers.
#[inline(never)]
unsafe fn kernel6x16(
    kc: usize,
    a: *const f32,
    rs: usize,
    cs: usize,
    b: *const f32,
) -> [__m256; 12] {
    let z = _mm256_setzero_ps;
    let (mut c00, mut c01, mut c10, mut c11) = (z(), z(), z(), z());
    let (mut c20, mut c21, mut c30, mut c31) = (z(), z(), z(), z());
    let (mut c40, mut c41, mut c50, mut c51) = (z(), z(), z(), z());
    // The six rows' offsets from the current column of A.
    let (o1, o2, o3, o4, o5) = (rs, 2 * rs, 3 * rs, 4 * rs, 5 * rs);
    // One step of p: two vectors of B, six broadcasts of A, twelve FMAs.
    macro_rules! step {
        ($a:expr, $b:expr) => {{
            let (x0, x1) = (_mm256_loadu_ps($b), _mm256_loadu_ps($b.add(8)));
            let r = _mm256_broadcast_ss(&*$a);
            c00 = _mm256_fmadd_ps(r, x0, c00);
            c01 = _mm256_fmadd_ps(r, x1, c01);
            let r = _mm256_broadcast_ss(&*$a.add(o1));
            c10 = _mm256_fmadd_ps(r, x0, c10);
            c11 = _mm256_fmadd_ps(r, x1, c11);
            let r = _mm256_broadcast_ss(&*$a.add(o2));
            c20 = _mm256_fmadd_ps(r, x0, c20);
            c21 = _mm256_fmadd_ps(r, x1, c21);
            let r = _mm256_broadcast_ss(&*$a.add(o3));
            c30 = _mm256_fmadd_ps(r, x0, c30);
            c31 = _mm256_fmadd_ps(r, x1, c31);
            let r = _mm256_broadcast_ss(&*$a.add(o4));
            c40 = _mm256_fmadd_ps(r, x0, c40);
            c41 = _mm256_fmadd_ps(r, x1, c41);
            let r = _mm256_broadcast_ss(&*$a.add(o5));
            c50 = _mm256_fmadd_ps(r, x0, c50);
            c51 = _mm256_fmadd_ps(r, x1, c51);
        }};
    }
    let (mut a, mut b) = (a, b);
    // Four steps per iteration: fewer loop instructions among the FMAs.
    for _ in 0..kc / 4 {
        step!(a, b);
        step!(a.add(cs), b.add(NR));
        step!(a.add(2 * cs), b.add(2 * NR));
        step!(a.add(3 * cs), b.add(3 * NR));
        a = a.add(4 * cs);
        b = b.add(4 * NR);
    }
    for _ in 0..kc % 4 {
        step!(a, b);
        a = a.add(cs);
        b = b.add(NR);
    }
    [c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51]
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel6x16(_: usize, _: *const f32, _: usize, _: usize, _: *const f32) -> [f32; 12] {
    unreachable!("gemm_avx2 on a CPU without AVX2")
}

/// `C_tile = alpha·acc + beta·C_tile` over the tile's `rows × cols` live part.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn store(
    acc: &[__m256; 12],
    rows: usize,
    cols: usize,
    alpha: f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    let va = _mm256_set1_ps(alpha);
    let vb = _mm256_set1_ps(beta);
    for ii in 0..rows {
        let row = c.add(ii * ldc);
        if cols == NR {
            for v in 0..2 {
                let x = _mm256_mul_ps(va, acc[2 * ii + v]);
                let out = if beta == 0.0 {
                    x
                } else {
                    _mm256_fmadd_ps(vb, _mm256_loadu_ps(row.add(8 * v)), x)
                };
                _mm256_storeu_ps(row.add(8 * v), out);
            }
        } else {
            let mut t = [0f32; NR];
            _mm256_storeu_ps(t.as_mut_ptr(), _mm256_mul_ps(va, acc[2 * ii]));
            _mm256_storeu_ps(t.as_mut_ptr().add(8), _mm256_mul_ps(va, acc[2 * ii + 1]));
            for (jj, &t) in t.iter().enumerate().take(cols) {
                let x = row.add(jj);
                *x = if beta == 0.0 { t } else { beta.mul_add(*x, t) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn store(_: &[f32; 12], _: usize, _: usize, _: f32, _: f32, _: *mut f32, _: usize) {
    unreachable!("gemm_avx2 on a CPU without AVX2")
}

/// `dst[q·ldd + ii] = src[ii·ld + q]` for an 8×8 block (also packing and mirroring in
/// [`super::syrk_avx2`]).
///
/// # Safety
/// `src` and `dst` must hold 8 rows of 8 values `ld` / `ldd` apart; the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn transpose8(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
    let r = |ii: usize| _mm256_loadu_ps(src.add(ii * ld));
    let rows = [r(0), r(1), r(2), r(3), r(4), r(5), r(6), r(7)];
    for (q, v) in transpose8_regs(rows).iter().enumerate() {
        _mm256_storeu_ps(dst.add(q * ldd), *v);
    }
}

/// Six rows of eight values (`ld` apart) transposed into `dst[q·8 + ii]`, `ii < 6` (entries 6
/// and 7 of each output row are copies of rows 4 and 5, not read).
///
/// # Safety
/// `src` must hold 6 rows of 8 values `ld` apart and `dst` 64 values; the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose6x8(src: *const f32, ld: usize, dst: *mut f32) {
    let r = |ii: usize| _mm256_loadu_ps(src.add(ii * ld));
    let (r4, r5) = (r(4), r(5));
    let rows = [r(0), r(1), r(2), r(3), r4, r5, r4, r5];
    for (q, v) in transpose8_regs(rows).iter().enumerate() {
        _mm256_storeu_ps(dst.add(q * 8), *v);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn transpose8_regs(r: [__m256; 8]) -> [__m256; 8] {
    // Interleave pairs of rows, then pairs of pairs, then the 128-bit halves.
    let (t0, t1) = (
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
    );
    let (t2, t3) = (
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
    );
    let (t4, t5) = (
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
    );
    let (t6, t7) = (
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    );
    let lo = |x, y| _mm256_shuffle_ps::<0x44>(x, y);
    let hi = |x, y| _mm256_shuffle_ps::<0xEE>(x, y);
    let (u0, u1, u2, u3) = (lo(t0, t2), hi(t0, t2), lo(t1, t3), hi(t1, t3));
    let (u4, u5, u6, u7) = (lo(t4, t6), hi(t4, t6), lo(t5, t7), hi(t5, t7));
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn transpose8(_: *const f32, _: usize, _: *mut f32, _: usize) {
    unreachable!("gemm_avx2 on a CPU without AVX2")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn transpose6x8(_: *const f32, _: usize, _: *mut f32) {
    unreachable!("gemm_avx2 on a CPU without AVX2")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// One product through [`gemm`] with operands laid out per the transposes, leading
    /// dimensions padded by 3: returns (got, reference in f64, the ldc).
    fn run(m: usize, n: usize, k: usize, ta: bool, tb: bool, beta: f32) -> (Vec<f32>, Vec<f64>) {
        let (lda, ldb, ldc) = (
            if ta { m } else { k } + 3,
            if tb { k } else { n } + 3,
            n + 3,
        );
        let a = rand(if ta { k * lda } else { m * lda }, 1);
        let b = rand(if tb { n * ldb } else { k * ldb }, 2);
        let (rsa, csa) = if ta { (1, lda) } else { (lda, 1) };
        let (rsb, csb) = if tb { (1, ldb) } else { (ldb, 1) };
        // With beta = 0, C must not be read: NaN there would show.
        let c0 = if beta == 0.0 {
            vec![f32::NAN; m * ldc]
        } else {
            rand(m * ldc, 3)
        };
        let alpha = 0.75f32;
        let mut want = vec![0f64; m * ldc];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| a[i * rsa + p * csa] as f64 * b[p * rsb + j * csb] as f64)
                    .sum();
                let old = if beta == 0.0 {
                    0.0
                } else {
                    c0[i * ldc + j] as f64
                };
                want[i * ldc + j] = alpha as f64 * s + beta as f64 * old;
            }
        }
        let mut got = c0;
        // Safety: the buffers hold the matrices described.
        unsafe {
            gemm(
                m,
                n,
                k,
                alpha,
                (a.as_ptr(), rsa, csa),
                (b.as_ptr(), rsb, csb),
                beta,
                got.as_mut_ptr(),
                ldc,
                true,
            )
        };
        // Only the live part of each row is compared; the padding is outside C.
        let live = |v: &[f32]| -> Vec<f32> {
            (0..m)
                .flat_map(|i| v[i * ldc..i * ldc + n].to_vec())
                .collect()
        };
        let want = (0..m)
            .flat_map(|i| want[i * ldc..i * ldc + n].to_vec())
            .collect();
        (live(&got), want)
    }

    #[test]
    fn matches_f64_reference_on_edges_transposes_and_blocks() {
        if !available() {
            eprintln!("SKIPPED: no AVX2 + FMA");
            return;
        }
        // Partial 6-row and 16-column tiles, one tile and many, k over several 256-long blocks,
        // n over two 2048-column blocks, k = 0.
        let shapes = [
            (1, 1, 1),
            (5, 15, 3),
            (6, 16, 8),
            (7, 17, 9),
            (13, 33, 300),
            (97, 40, 513),
            (200, 70, 64),
            (3, 2100, 20),
            (12, 20, 0),
        ];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for &(m, n, k) in &shapes {
            for ta in [false, true] {
                for tb in [false, true] {
                    for beta in [0.0, 0.5] {
                        let (got, want) = pool.install(|| run(m, n, k, ta, tb, beta));
                        for (i, (&x, &y)) in got.iter().zip(&want).enumerate() {
                            let tol = 1e-5 * (1.0 + (k as f64).sqrt());
                            assert!(
                                (x as f64 - y).abs() <= tol,
                                "{m}x{n}x{k} ta={ta} tb={tb} beta={beta} at {i}: {x} vs {y}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn result_does_not_depend_on_threads_or_rows() {
        if !available() {
            eprintln!("SKIPPED: no AVX2 + FMA");
            return;
        }
        let (m, n, k) = (301, 90, 700);
        let one = |t: usize, m: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            pool.install(|| run(m, n, k, false, true, 0.25).0)
        };
        let base = one(1, m);
        for t in [2, 3] {
            assert!(base == one(t, m), "{t} threads changed the result");
        }
        // The first 17 rows alone: the same values bit for bit (a rank holding fewer tokens
        // computes its rows as a rank holding more does).
        assert!(one(2, 17)[..] == base[..17 * n]);
    }
}

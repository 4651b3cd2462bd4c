//! Newton–Schulz orthogonalisation, Muon's core: five quintic iterations push every singular value
//! of `G/‖G‖_F` into roughly [0.7, 1.1] while keeping the singular vectors, i.e. an approximate
//! `U·Vᵀ` of `G = U·Σ·Vᵀ`. A normalisation kernel, GEMMs and copies, all through the backend, so
//! a device backend runs it where the matrix lives with no host round trip. `X·Xᵀ` and `A·A` are
//! symmetric, so they go through the backend's symmetric product (`Blas::syrk`), which on the
//! CPU does about half of their multiply-adds.

use ganymede_core::{Backend, Category, DType, Gemm, Syrk, Tensor, View, ViewMut};
use rayon::prelude::*;

/// Coefficients of the quintic `p(σ) = a·σ + b·σ³ + c·σ⁵` (Keller Jordan's tuning: steep at 0,
/// so small singular values grow fast, at the price of not converging to exactly 1).
pub const NS_COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// Added to the Frobenius norm before dividing, so a zero gradient stays zero.
pub const NS_EPS: f64 = 1e-7;

/// Working memory of [`newton_schulz`]: `A = X·Xᵀ` and `B` (each s×s) and the ping-pong copy of
/// `X` (s×l), where s ≤ l are the matrix's short and long sides. Allocated once and reused.
/// In bf16 on a backend that normalises into bf16 ([`OptimOps::normalizes_into_bf16`]), also
/// the normalised X's bf16 copy (as long as the ping-pong copy, half its bytes), allocated at
/// its first use.
///
/// [`OptimOps::normalizes_into_bf16`]: ganymede_core::OptimOps::normalizes_into_bf16
pub struct NsScratch {
    a: Tensor,
    b: Tensor,
    y: Tensor,
    x16: Option<Tensor>,
}

impl NsScratch {
    /// Scratch big enough for every matrix shape `(rows, cols)` in `shapes`.
    pub fn for_shapes(be: &dyn Backend, shapes: impl IntoIterator<Item = (usize, usize)>) -> Self {
        let (mut ss, mut sl) = (0, 0);
        for (r, c) in shapes {
            let (s, l) = (r.min(c), r.max(c));
            ss = ss.max(s * s);
            sl = sl.max(s * l);
        }
        NsScratch {
            a: be.zeros(&[ss], Category::Buffers),
            b: be.zeros(&[ss], Category::Buffers),
            y: be.zeros(&[sl], Category::Buffers),
            x16: None,
        }
    }

    /// Scratch for one shape.
    pub fn new(be: &dyn Backend, rows: usize, cols: usize) -> Self {
        Self::for_shapes(be, [(rows, cols)])
    }

    pub fn bytes(&self) -> usize {
        self.a.bytes()
            + self.b.bytes()
            + self.y.bytes()
            + self.x16.as_ref().map_or(0, Tensor::bytes)
    }

    /// Room for `count` matrices of short side `s` and long side `l`.
    fn fits(&self, count: usize, s: usize, l: usize) -> bool {
        self.a.len() >= count * s * s && self.y.len() >= count * s * l
    }

    /// Scratch with `ss` elements for each of A and B and `sl` for the ping-pong copy.
    pub fn from_lens(be: &dyn Backend, ss: usize, sl: usize) -> Self {
        NsScratch {
            a: be.zeros(&[ss], Category::Buffers),
            b: be.zeros(&[ss], Category::Buffers),
            y: be.zeros(&[sl], Category::Buffers),
            x16: None,
        }
    }

    /// Scratch for [`newton_schulz_strided`] on `count` matrices of `rows × cols`.
    pub fn for_batch(be: &dyn Backend, rows: usize, cols: usize, count: usize) -> Self {
        let (s, l) = (rows.min(cols), rows.max(cols));
        Self::from_lens(be, count * s * s, count * s * l)
    }
}

/// Orthogonalise the row-major `rows × cols` matrix in `x` in place with `steps` quintic
/// Newton–Schulz iterations: `X = x/(‖x‖_F + 1e-7)`, then per step (wide orientation, s ≤ l)
/// `A = X·Xᵀ, X = (a·I + b·A + c·A·A)·X`, the polynomial as [`ns_shifted`] writes it.
///
/// With `bf16`, every product takes its operands rounded to bf16 (nearest even) and
/// accumulates and writes f32 ([`Syrk::bf16_inputs`], [`Gemm::bf16_inputs`]), as PyTorch's Muon
/// iterates in bf16 on a GPU; X, A and P stay f32 between products, so the only extra error is
/// the operand rounding (relative 2⁻⁹), which the iteration does not amplify: its fixed point
/// is a band, not a value (`optimizer.ns_dtype`).
///
/// A tall matrix (rows > cols) is not transposed in memory: with `X` tall the same iteration on
/// `Xᵀ` reads `A = Xᵀ·X, X = X·P` (the polynomial `P` is symmetric), which the GEMM's transpose flags
/// express directly. So `NS(Xᵀ) = NS(X)ᵀ` up to rounding.
pub fn newton_schulz(
    be: &dyn Backend,
    x: ViewMut,
    rows: usize,
    cols: usize,
    steps: usize,
    bf16: bool,
    scratch: &mut NsScratch,
) {
    assert_eq!(
        x.len(),
        rows * cols,
        "newton_schulz: view is not {rows}x{cols}"
    );
    newton_schulz_strided(be, x, 1, rows, cols, steps, bf16, scratch)
}

/// [`newton_schulz`] on `count` matrices of `rows × cols` stored one after another in `x`, each
/// of its products one strided call over all of them ([`Blas::gemm_strided`],
/// [`Blas::syrk_strided`]; the normalisation one call per matrix): on a GPU a few launches per
/// step instead of a few per matrix per step. [`newton_schulz`] is this with one matrix, so on a
/// backend whose strided calls are the default loops each matrix gets the bits it would alone.
/// `scratch` from [`NsScratch::for_batch`] for at least `count`.
///
/// [`Blas::gemm_strided`]: ganymede_core::Blas::gemm_strided
/// [`Blas::syrk_strided`]: ganymede_core::Blas::syrk_strided
#[allow(clippy::too_many_arguments)]
pub fn newton_schulz_strided(
    be: &dyn Backend,
    mut x: ViewMut,
    count: usize,
    rows: usize,
    cols: usize,
    steps: usize,
    bf16: bool,
    scratch: &mut NsScratch,
) {
    let n = rows * cols;
    assert_eq!(
        x.len(),
        count * n,
        "newton_schulz_strided: view is not {count}x{rows}x{cols}"
    );
    let (s, l) = (rows.min(cols), rows.max(cols));
    assert!(
        scratch.fits(count, s, l),
        "newton_schulz: scratch too small for {count}x{rows}x{cols}"
    );
    if count == 0 {
        return;
    }
    let wide = rows <= cols;
    let (shift, offset, cc) = ns_shifted();
    // In bf16, where the backend has the pass, the first step's operand is the normalisation's
    // bf16 output (the same bits its products would cast to), and X itself is not normalised:
    // the first step reads only the copy, and its result goes to the ping-pong copy.
    let into_bf16 = bf16 && steps > 0 && be.normalizes_into_bf16();
    if into_bf16 {
        let len = scratch.y.len();
        let x16 = scratch
            .x16
            .get_or_insert_with(|| be.zeros_of(&[len], DType::BF16, Category::Buffers));
        let x16 = x16.slice_mut(0, count * n);
        be.normalize_frobenius_strided_bf16(x.as_view(), x16, count, NS_EPS);
    } else {
        be.normalize_frobenius_strided(x.reborrow(), count, NS_EPS);
    }
    let NsScratch { a, b, y, x16 } = scratch;
    let x16: Option<View> = match into_bf16 {
        true => x16.as_ref().map(|t| t.slice(0, count * n)),
        false => None,
    };
    let ss = s * s;
    let mut a = a.slice_mut(0, count * ss);
    let mut b = b.slice_mut(0, count * ss);
    let mut y = y.slice_mut(0, count * n);
    let mut in_x = true;
    for step in 0..steps {
        let (src, dst) = if in_x {
            (x.reborrow(), y.reborrow())
        } else {
            (y.reborrow(), x.reborrow())
        };
        let src = match x16 {
            Some(x16) if step == 0 => x16,
            _ => src.as_view(),
        };
        let sy = Syrk::new(s, l, !wide).diag(shift as f32).bf16_inputs(bf16);
        be.syrk_strided(a.reborrow(), src, sy, count, [n, ss]);
        let sy = Syrk::new(s, s, false)
            .alpha(cc as f32)
            .diag(offset as f32)
            .bf16_inputs(bf16);
        be.syrk_strided(b.reborrow(), a.as_view(), sy, count, [ss, ss]);
        if wide {
            let g = Gemm::new(s, l, s, false, false).bf16_inputs(bf16);
            be.gemm_strided(dst, b.as_view(), src, g, count, [ss, n, n]);
        } else {
            let g = Gemm::new(l, s, s, false, false).bf16_inputs(bf16);
            be.gemm_strided(dst, src, b.as_view(), g, count, [n, ss, n]);
        }
        in_x = !in_x;
    }
    if !in_x {
        be.copy(x, y.as_view());
    }
}

/// The quintic's matrix polynomial completed to a square: `a·I + b·A + c·A² = c·(A + β·I)² + δ·I`
/// with `β = b/(2c)` and `δ = a − c·β²`, returned as `(β, δ, c)`. Each step is then two
/// symmetric products with a diagonal term and one GEMM, with no copy of A (for `b·A`) or of X
/// (for `a·X`); the same polynomial, rounded differently.
pub fn ns_shifted() -> (f64, f64, f64) {
    let (ca, cb, cc) = NS_COEFFS;
    let shift = cb / (2.0 * cc);
    (shift, ca - cc * shift * shift, cc)
}

/// [`newton_schulz_batch`]: `count` matrices of `rows × cols` stored one after another in `x`
/// (a layer's routed experts, say), orthogonalised each on its own. With more than one scratch
/// (each fitting the shape) and more than one thread, matrices go whole to rayon's threads, at
/// most one per scratch, each taking the next matrix when done: for small matrices that beats
/// splitting every GEMM across threads, whose pieces spend much of their time waiting. Each
/// matrix gets exactly the backend calls of one [`newton_schulz`] call, so the result is the same
/// bitwise. In bf16 on a backend that only emulates it (the CPU's, [`ns_lanes`]) matrices go one
/// at a time.
#[allow(clippy::too_many_arguments)]
pub fn newton_schulz_batch(
    be: &dyn Backend,
    x: ViewMut,
    count: usize,
    rows: usize,
    cols: usize,
    steps: usize,
    bf16: bool,
    scratch: &mut [NsScratch],
) {
    let n = rows * cols;
    assert_eq!(
        x.len(),
        count * n,
        "newton_schulz_batch: view is not {count}x{rows}x{cols}"
    );
    assert!(!scratch.is_empty(), "newton_schulz_batch: no scratch");
    let mut mats = Vec::with_capacity(count);
    let mut rest = x;
    for _ in 1..count {
        let (head, tail) = rest.split_at(n);
        mats.push(head);
        rest = tail;
    }
    if count > 0 {
        mats.push(rest);
    }
    let lanes = ns_lanes(be, bf16, scratch.len())
        .min(rayon::current_num_threads())
        .min(count);
    if lanes <= 1 {
        for m in mats {
            newton_schulz(be, m, rows, cols, steps, bf16, &mut scratch[0]);
        }
        return;
    }
    // A shared queue rather than fixed chunks: a thread slowed by a neighbour does fewer.
    mats.reverse();
    let queue = std::sync::Mutex::new(mats);
    scratch[..lanes].par_iter_mut().for_each(|sc| loop {
        let m = queue.lock().unwrap().pop();
        match m {
            Some(m) => newton_schulz(be, m, rows, cols, steps, bf16, sc),
            None => break,
        }
    });
}

/// How many matrices may run Newton–Schulz at once given `slots` scratch slots: one in bf16 on
/// a backend without native bf16, whose emulation rounds into one shared scratch under a lock
/// held through a product that itself runs on rayon's threads (a thread waiting there could
/// pick up another matrix's task, which would wait for that lock forever).
pub fn ns_lanes(be: &dyn Backend, bf16: bool, slots: usize) -> usize {
    if bf16 && !be.native_bf16() {
        slots.min(1)
    } else {
        slots
    }
}

/// Whether Newton–Schulz runs in bf16 under `ns_dtype` on `be` (`optimizer.ns_dtype`).
pub fn ns_bf16(ns_dtype: ganymede_config::NsDtype, be: &dyn Backend) -> bool {
    ns_dtype.bf16_on(be.native_bf16())
}

/// FLOPs of one [`newton_schulz`] call counted as plain GEMMs: per step `2·s²·l` for A, `2·s³`
/// for A·A and `2·s²·l` for P·X. (The symmetric products of A and A·A do about half of theirs;
/// rates quoted against this count are GEMM-equivalent.)
pub fn ns_flops(rows: usize, cols: usize, steps: usize) -> u64 {
    let (s, l) = (rows.min(cols) as u64, rows.max(cols) as u64);
    steps as u64 * (4 * s * s * l + 2 * s * s * s)
}

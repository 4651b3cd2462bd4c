//! Newton–Schulz orthogonalisation, Muon's core: five quintic iterations push every singular value
//! of `G/‖G‖_F` into roughly [0.7, 1.1] while keeping the singular vectors, i.e. an approximate
//! `U·Vᵀ` of `G = U·Σ·Vᵀ`. A normalisation kernel, GEMMs and copies, all through the backend, so
//! a device backend runs it where the matrix lives with no host round trip. `X·Xᵀ` and `A·A` are
//! symmetric, so they go through the backend's symmetric product (`Blas::syrk`), which on the
//! CPU does about half of their multiply-adds.
//!
//! Each iteration's quintic is [`NsSteps::coeffs`]'s: Muon's one quintic every time, or Polar
//! Express's list ([`polar_express`]), each the minimax quintic for the interval the singular
//! values are in by then, which takes them to 1 rather than into a band.

use ganymede_config::NsCoefficients;
use ganymede_core::{Backend, Category, DType, Gemm, Syrk, Tensor, View, ViewMut};
use rayon::prelude::*;

/// Coefficients of the quintic `p(σ) = a·σ + b·σ³ + c·σ⁵` (Keller Jordan's tuning: steep at 0,
/// so small singular values grow fast, at the price of not converging to exactly 1).
pub const NS_COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// How many Newton–Schulz iterations, and the quintic of each (`optimizer.ns_steps`,
/// `optimizer.ns_coefficients`). A bare count is that many of Muon's ([`NS_COEFFS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NsSteps {
    pub n: usize,
    pub coefficients: NsCoefficients,
}

impl NsSteps {
    /// `n` iterations of Muon's quintic.
    pub const fn muon(n: usize) -> Self {
        NsSteps {
            n,
            coefficients: NsCoefficients::Muon,
        }
    }
    /// The optimizer's (`optimizer.ns_steps`, `optimizer.ns_coefficients`).
    pub fn of(cfg: &ganymede_config::OptimizerConfig) -> Self {
        NsSteps {
            n: cfg.ns_steps,
            coefficients: cfg.ns_coefficients,
        }
    }
    /// Iteration `i`'s `(a, b, c)`: `p(σ) = a·σ + b·σ³ + c·σ⁵`.
    pub fn coeffs(&self, i: usize) -> Quintic {
        match self.coefficients {
            NsCoefficients::Muon => NS_COEFFS,
            NsCoefficients::PolarExpress => {
                let pe = polar_express();
                pe[i.min(pe.len() - 1)].0
            }
        }
    }
}

impl From<usize> for NsSteps {
    fn from(n: usize) -> Self {
        NsSteps::muon(n)
    }
}

/// An odd quintic's `(a, b, c)`: `p(x) = a·x + b·x³ + c·x⁵`.
pub type Quintic = (f64, f64, f64);

/// The lower end of the singular values Polar Express is made for, relative to the Frobenius
/// norm that divides the matrix first (which bounds the largest by 1).
pub const POLAR_EXPRESS_LOW: f64 = 1e-3;

/// Polar Express's quintics (Amsel, Persson, Musco, Gower, arXiv 2505.16932), each with the
/// interval's worst error: the odd quintic closest to 1 in the maximum norm on `[ℓ, u]`
/// ([`minimax_quintic`]), from `[`[`POLAR_EXPRESS_LOW`]`, 1]`; the singular values then lie in
/// `[1 − E, 1 + E]`, the next iteration's interval. The list ends at the first `E` below 10⁻⁶
/// (the seventh); later iterations repeat it. Computed once, in f64. Without the paper's
/// safety factor for bf16 rounding: a value just past the interval's ends maps just past
/// `1 ± E` (the quintics rise through both ends), which the next interval absorbs.
pub fn polar_express() -> &'static [(Quintic, f64)] {
    static LIST: std::sync::OnceLock<Vec<(Quintic, f64)>> = std::sync::OnceLock::new();
    LIST.get_or_init(|| {
        let (mut l, mut u) = (POLAR_EXPRESS_LOW, 1.0);
        let mut list = vec![];
        loop {
            let (p, e) = minimax_quintic(l, u);
            list.push((p, e));
            if e < 1e-6 || list.len() == 16 {
                return list;
            }
            (l, u) = (1.0 - e, 1.0 + e);
        }
    })
}

/// The odd quintic `p(x) = a·x + b·x³ + c·x⁵` with the least `E = max |1 − p(x)|` over
/// `[l, u]` (`0 < l < u`), and that `E`, by the Remez exchange: the best one equioscillates,
/// `1 − p = ±E` with alternating signs at `l`, its two interior extrema and `u` (four points
/// for three coefficients). Each round solves for the coefficients and `E` on the current
/// points, then moves the interior points to the new polynomial's extrema.
pub fn minimax_quintic(l: f64, u: f64) -> (Quintic, f64) {
    assert!(0.0 < l && l < u, "minimax_quintic: interval [{l}, {u}]");
    let mut xs = [l, l + (u - l) / 3.0, l + 2.0 * (u - l) / 3.0, u];
    let mut sol = [0.0; 4];
    for _ in 0..200 {
        let mut m = [[0.0; 5]; 4];
        for (i, &x) in xs.iter().enumerate() {
            let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
            m[i] = [x, x.powi(3), x.powi(5), sign, 1.0];
        }
        sol = solve4(m);
        let (a, b, c) = (sol[0], sol[1], sol[2]);
        // p'(x) = a + 3b·x² + 5c·x⁴: its roots in x² solve 5c·y² + 3b·y + a = 0.
        let disc = 9.0 * b * b - 20.0 * a * c;
        if disc <= 0.0 || c == 0.0 {
            break;
        }
        let (y1, y2) = (
            (-3.0 * b - disc.sqrt()) / (10.0 * c),
            (-3.0 * b + disc.sqrt()) / (10.0 * c),
        );
        let (y1, y2) = (y1.min(y2), y1.max(y2));
        if y1 <= 0.0 {
            break;
        }
        let next = [l, y1.sqrt(), y2.sqrt(), u];
        if !(l < next[1] && next[1] < next[2] && next[2] < u) {
            break;
        }
        let moved = next
            .iter()
            .zip(&xs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        xs = next;
        if moved <= 1e-15 * u {
            break;
        }
    }
    ((sol[0], sol[1], sol[2]), sol[3].abs())
}

/// `m`'s 4×4 system (its last column the right-hand side) by Gaussian elimination with partial
/// pivoting.
fn solve4(mut m: [[f64; 5]; 4]) -> [f64; 4] {
    for k in 0..4 {
        let p = (k..4)
            .max_by(|&i, &j| m[i][k].abs().total_cmp(&m[j][k].abs()))
            .expect("rows");
        m.swap(k, p);
        let pivot = m[k];
        for row in &mut m[k + 1..] {
            let f = row[k] / pivot[k];
            for (x, p) in row[k..].iter_mut().zip(&pivot[k..]) {
                *x -= f * p;
            }
        }
    }
    let mut x = [0.0; 4];
    for k in (0..4).rev() {
        let s: f64 = (k + 1..4).map(|j| m[k][j] * x[j]).sum();
        x[k] = (m[k][4] - s) / m[k][k];
    }
    x
}

/// Added to the Frobenius norm before dividing, so a zero gradient stays zero.
pub const NS_EPS: f64 = 1e-7;

/// Working memory of [`newton_schulz`], for matrices of short side s and long side l, allocated
/// once and reused. In f32 products: `A = X·Xᵀ` and `B` (each s×s) and the ping-pong copy of `X`
/// (s×l), all f32. In bf16 on a backend that normalises into bf16
/// ([`OptimOps::normalizes_into_bf16`], a GPU) the iterates stay in bf16 (issue 32): the f32 A
/// (each symmetric product's f32 result, read once), A and B in bf16 and two bf16 copies of X
/// (`4·s² + 2·s² + 2·s² + 2·s·l + 2·s·l` bytes: what the f32 set takes, `4·(2·s² + s·l)`).
/// A constructor makes A; [`NsScratch::prepared`] makes the set the products will use (the
/// optimizers call it, so their working memory is on the ledger from the start, as the
/// planner counts it), else it is made at first use.
///
/// [`OptimOps::normalizes_into_bf16`]: ganymede_core::OptimOps::normalizes_into_bf16
pub struct NsScratch {
    /// Capacity in elements: s² of each square matrix, s·l of each copy of X.
    ss: usize,
    sl: usize,
    a: Tensor,
    b: Option<Tensor>,
    y: Option<Tensor>,
    half: Option<HalfScratch>,
}

/// The bf16 iterates: A and B (s² each) and X's two copies (s·l each).
struct HalfScratch {
    a: Tensor,
    b: Tensor,
    x: Tensor,
    y: Tensor,
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
        Self::from_lens(be, ss, sl)
    }

    /// Scratch for one shape.
    pub fn new(be: &dyn Backend, rows: usize, cols: usize) -> Self {
        Self::for_shapes(be, [(rows, cols)])
    }

    pub fn bytes(&self) -> usize {
        let half = self
            .half
            .as_ref()
            .map_or(0, |h| h.a.bytes() + h.b.bytes() + h.x.bytes() + h.y.bytes());
        self.a.bytes()
            + self.b.as_ref().map_or(0, Tensor::bytes)
            + self.y.as_ref().map_or(0, Tensor::bytes)
            + half
    }

    /// Room for `count` matrices of short side `s` and long side `l`.
    fn fits(&self, count: usize, s: usize, l: usize) -> bool {
        self.ss >= count * s * s && self.sl >= count * s * l
    }

    /// Scratch with `ss` elements for each of A and B and `sl` for each copy of X.
    pub fn from_lens(be: &dyn Backend, ss: usize, sl: usize) -> Self {
        NsScratch {
            ss,
            sl,
            a: be.zeros(&[ss], Category::Buffers),
            b: None,
            y: None,
            half: None,
        }
    }

    /// This scratch with the set made now that [`newton_schulz_strided`] with `steps` steps
    /// and `bf16` products will use on `be`.
    pub fn prepared(mut self, be: &dyn Backend, steps: usize, bf16: bool) -> Self {
        match iterates_in_bf16(be, steps, bf16) {
            true => self.half(be),
            false => self.f32_set(be),
        }
        self
    }

    /// Scratch for [`newton_schulz_strided`] on `count` matrices of `rows × cols`.
    pub fn for_batch(be: &dyn Backend, rows: usize, cols: usize, count: usize) -> Self {
        let (s, l) = (rows.min(cols), rows.max(cols));
        Self::from_lens(be, count * s * s, count * s * l)
    }

    /// The f32 B and ping-pong copy, made at first need.
    fn f32_set(&mut self, be: &dyn Backend) {
        let (ss, sl) = (self.ss, self.sl);
        self.b
            .get_or_insert_with(|| be.zeros(&[ss], Category::Buffers));
        self.y
            .get_or_insert_with(|| be.zeros(&[sl], Category::Buffers));
    }

    /// The bf16 iterates, made at first need.
    fn half(&mut self, be: &dyn Backend) {
        let (ss, sl) = (self.ss, self.sl);
        let bf = |n| be.zeros_of(&[n], DType::BF16, Category::Buffers);
        self.half.get_or_insert_with(|| HalfScratch {
            a: bf(ss),
            b: bf(ss),
            x: bf(sl),
            y: bf(sl),
        });
    }
}

/// Orthogonalise the row-major `rows × cols` matrix in `x` in place with `steps` quintic
/// Newton–Schulz iterations: `X = x/(‖x‖_F + 1e-7)`, then per step (wide orientation, s ≤ l)
/// `A = X·Xᵀ, X = (a·I + b·A + c·A·A)·X`, the polynomial as [`ns_shifted`] writes it.
///
/// With `bf16`, every product takes its operands rounded to bf16 (nearest even) and
/// accumulates and writes f32 ([`Syrk::bf16_inputs`], [`Gemm::bf16_inputs`]), as PyTorch's Muon
/// iterates in bf16 on a GPU, so the only extra error is the operand rounding (relative 2⁻⁹),
/// which the iteration does not amplify: its fixed point is a band, not a value
/// (`optimizer.ns_dtype`). X, A and P are held in f32 between products, except on a backend
/// that normalises into bf16 (a GPU), which keeps them in bf16, rounded as its next product
/// would round them (the same values, no cast passes).
///
/// A tall matrix (rows > cols) is not transposed in memory: with `X` tall the same iteration on
/// `Xᵀ` reads `A = Xᵀ·X, X = X·P` (the polynomial `P` is symmetric), which the GEMM's transpose flags
/// express directly. So `NS(Xᵀ) = NS(X)ᵀ` up to rounding.
pub fn newton_schulz(
    be: &dyn Backend,
    x: ViewMut,
    rows: usize,
    cols: usize,
    steps: impl Into<NsSteps>,
    bf16: bool,
    scratch: &mut NsScratch,
) {
    let steps = steps.into();
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
    steps: impl Into<NsSteps>,
    bf16: bool,
    scratch: &mut NsScratch,
) {
    let steps = steps.into();
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
    if iterates_in_bf16(be, steps.n, bf16) {
        return iterate_in_bf16(be, x, count, rows, cols, steps, scratch);
    }
    be.normalize_frobenius_strided(x.reborrow(), count, NS_EPS);
    let ss = s * s;
    scratch.f32_set(be);
    let NsScratch { a, b, y, .. } = scratch;
    let mut a = a.slice_mut(0, count * ss);
    let mut b = b.as_mut().expect("made above").slice_mut(0, count * ss);
    let mut y = y.as_mut().expect("made above").slice_mut(0, count * n);
    let mut in_x = true;
    for i in 0..steps.n {
        let (src, dst) = if in_x {
            (x.reborrow(), y.reborrow())
        } else {
            (y.reborrow(), x.reborrow())
        };
        let src = src.as_view();
        let (sa, sb) = ns_syrks(rows, cols, bf16, steps.coeffs(i));
        be.syrk_strided(a.reborrow(), src, sa, count, [n, ss]);
        be.syrk_strided(b.reborrow(), a.as_view(), sb, count, [ss, ss]);
        polynomial_times_x(be, dst, b.as_view(), src, rows, cols, count, bf16);
        in_x = !in_x;
    }
    if !in_x {
        be.copy(x, y.as_view());
    }
}

/// Whether Newton–Schulz keeps its iterates in bf16: bf16 products on a backend that
/// normalises into bf16 (a GPU), with at least one step.
fn iterates_in_bf16(be: &dyn Backend, steps: usize, bf16: bool) -> bool {
    bf16 && steps > 0 && be.normalizes_into_bf16()
}

/// [`newton_schulz_strided`] in bf16 on a backend that normalises into bf16, with X, A and B
/// held in bf16 between products: the normalisation writes X's first bf16 copy, each symmetric
/// product goes through an f32 result rounded once ([`Blas::syrk_strided_into_bf16`]), and
/// `P·X` writes the next copy of X in bf16, the last step writing f32 into `x`. Every value is
/// rounded where the f32 path's next product would have rounded it as its operand, so the
/// result is that path's, bit for bit where the backend's bf16-output GEMM rounds its f32
/// result (the CPU's, the host build's), with no cast passes and half the bytes read.
///
/// [`Blas::syrk_strided_into_bf16`]: ganymede_core::Blas::syrk_strided_into_bf16
fn iterate_in_bf16(
    be: &dyn Backend,
    x: ViewMut,
    count: usize,
    rows: usize,
    cols: usize,
    steps: NsSteps,
    scratch: &mut NsScratch,
) {
    let n = rows * cols;
    let ss = rows.min(cols).pow(2);
    scratch.half(be);
    let NsScratch { a, half, .. } = scratch;
    let h = half.as_mut().expect("made above");
    let mut a = a.slice_mut(0, count * ss);
    let (mut a16, mut b16) = (h.a.slice_mut(0, count * ss), h.b.slice_mut(0, count * ss));
    let (mut x16, mut y16) = (h.x.slice_mut(0, count * n), h.y.slice_mut(0, count * n));
    be.normalize_frobenius_strided_bf16(x.as_view(), x16.reborrow(), count, NS_EPS);
    let mut out = Some(x);
    for step in 0..steps.n {
        let (src, dst) = match step % 2 {
            0 => (x16.as_view(), y16.reborrow()),
            _ => (y16.as_view(), x16.reborrow()),
        };
        let dst = match step + 1 == steps.n {
            true => out.take().expect("one last step"),
            false => dst,
        };
        let (sa, sb) = ns_syrks(rows, cols, true, steps.coeffs(step));
        be.syrk_strided_into_bf16(a.reborrow(), a16.reborrow(), src, sa, count, [n, ss]);
        let a16 = a16.as_view();
        be.syrk_strided_into_bf16(a.reborrow(), b16.reborrow(), a16, sb, count, [ss, ss]);
        polynomial_times_x(be, dst, b16.as_view(), src, rows, cols, count, true);
    }
}

/// The two symmetric products of a Newton–Schulz step on `rows × cols` matrices:
/// `A = X·Xᵀ + β·I` (`Xᵀ·X` for a tall X) and `B = c·A·A + δ·I` ([`ns_shifted`]).
fn ns_syrks(rows: usize, cols: usize, bf16: bool, coeffs: (f64, f64, f64)) -> (Syrk, Syrk) {
    let (s, l) = (rows.min(cols), rows.max(cols));
    let (shift, offset, cc) = ns_shifted_of(coeffs);
    let a = Syrk::new(s, l, rows > cols)
        .diag(shift as f32)
        .bf16_inputs(bf16);
    let b = Syrk::new(s, s, false)
        .alpha(cc as f32)
        .diag(offset as f32)
        .bf16_inputs(bf16);
    (a, b)
}

/// The step's new X: `B·X` for a wide X, `X·B` for a tall one (B is symmetric), over `count`
/// matrices.
#[allow(clippy::too_many_arguments)]
fn polynomial_times_x(
    be: &dyn Backend,
    dst: ViewMut,
    b: View,
    x: View,
    rows: usize,
    cols: usize,
    count: usize,
    bf16: bool,
) {
    let (s, l) = (rows.min(cols), rows.max(cols));
    let (n, ss) = (rows * cols, s * s);
    if rows <= cols {
        let g = Gemm::new(s, l, s, false, false).bf16_inputs(bf16);
        be.gemm_strided(dst, b, x, g, count, [ss, n, n]);
    } else {
        let g = Gemm::new(l, s, s, false, false).bf16_inputs(bf16);
        be.gemm_strided(dst, x, b, g, count, [n, ss, n]);
    }
}

/// The quintic's matrix polynomial completed to a square: `a·I + b·A + c·A² = c·(A + β·I)² + δ·I`
/// with `β = b/(2c)` and `δ = a − c·β²`, returned as `(β, δ, c)`. Each step is then two
/// symmetric products with a diagonal term and one GEMM, with no copy of A (for `b·A`) or of X
/// (for `a·X`); the same polynomial, rounded differently.
pub fn ns_shifted() -> (f64, f64, f64) {
    ns_shifted_of(NS_COEFFS)
}

/// [`ns_shifted`] for the quintic `(a, b, c)`.
pub fn ns_shifted_of((ca, cb, cc): (f64, f64, f64)) -> (f64, f64, f64) {
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
    steps: impl Into<NsSteps>,
    bf16: bool,
    scratch: &mut [NsScratch],
) {
    let steps = steps.into();
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

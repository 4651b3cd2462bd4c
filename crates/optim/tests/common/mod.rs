//! Test helpers, all plain f64 loops independent of the backend: random numbers, matrices,
//! orthogonal factors from Householder reflections, a Jacobi eigen-solver, and a reference
//! Newton–Schulz.
#![allow(dead_code)]

/// Deterministic generator (SplitMix64) with Gaussian draws by Box–Muller.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    pub fn normals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// `C = A·B` for row-major `A` (m×k) and `B` (k×n).
pub fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let aip = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += aip * b[p * n + j];
            }
        }
    }
    c
}

pub fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0.0; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = a[i * cols + j];
        }
    }
    t
}

/// A random n×n orthogonal matrix: the product of n Householder reflections `I − 2vvᵀ/‖v‖²`.
pub fn orthogonal(n: usize, rng: &mut Rng) -> Vec<f64> {
    let mut q = vec![0.0; n * n];
    for i in 0..n {
        q[i * n + i] = 1.0;
    }
    for _ in 0..n {
        let v = rng.normals(n);
        let vv: f64 = v.iter().map(|x| x * x).sum();
        // Q ← Q·(I − 2vvᵀ/vv): each row r of Q loses 2(r·v)/vv · v.
        for i in 0..n {
            let row = &mut q[i * n..(i + 1) * n];
            let d: f64 = row.iter().zip(&v).map(|(a, b)| a * b).sum();
            let f = 2.0 * d / vv;
            row.iter_mut().zip(&v).for_each(|(r, &vj)| *r -= f * vj);
        }
    }
    q
}

/// The first `k` columns of a random n×n orthogonal matrix (n×k, orthonormal columns).
pub fn orthonormal_columns(n: usize, k: usize, rng: &mut Rng) -> Vec<f64> {
    let q = orthogonal(n, rng);
    (0..n).flat_map(|i| q[i * n..i * n + k].to_vec()).collect()
}

/// `U·diag(σ)·Vᵀ` with `U` rows×s and `V` cols×s (s = σ.len()).
pub fn from_svd(u: &[f64], sigma: &[f64], v: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let s = sigma.len();
    let mut us = u.to_vec();
    for i in 0..rows {
        for j in 0..s {
            us[i * s + j] *= sigma[j];
        }
    }
    matmul(&us, &transpose(v, cols, s), rows, s, cols)
}

/// Eigenvalues of a symmetric n×n matrix by cyclic Jacobi rotations, ascending.
pub fn jacobi_eigenvalues(a: &[f64], n: usize) -> Vec<f64> {
    let mut a = a.to_vec();
    let scale: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-300);
    for _sweep in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum::<f64>()
            .sqrt();
        if off <= 1e-14 * scale {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                // Rotation angle that zeroes a[p][q] (Golub & Van Loan, sym.schur2).
                let tau = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = tau.signum() / (tau.abs() + (1.0 + tau * tau).sqrt());
                let t = if tau == 0.0 { 1.0 } else { t };
                let c = 1.0 / (1.0 + t * t).sqrt();
                let s = t * c;
                // A ← Jᵀ·A·J on rows and columns p, q.
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
        }
    }
    let mut ev: Vec<f64> = (0..n).map(|i| a[i * n + i]).collect();
    ev.sort_by(|x, y| x.partial_cmp(y).unwrap());
    ev
}

/// Singular values (ascending) of a rows×cols matrix, from the eigenvalues of the smaller Gram
/// matrix.
pub fn singular_values(m: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let gram = if rows <= cols {
        matmul(m, &transpose(m, rows, cols), rows, cols, rows)
    } else {
        matmul(&transpose(m, rows, cols), m, cols, rows, cols)
    };
    jacobi_eigenvalues(&gram, rows.min(cols))
        .into_iter()
        .map(|e| e.max(0.0).sqrt())
        .collect()
}

pub const A: f64 = 3.4445;
pub const B: f64 = -4.7750;
pub const C: f64 = 2.0315;

/// The quintic applied to one singular value: NS maps each singular value σ of the normalised
/// matrix through p, leaving singular vectors alone.
pub fn p(s: f64) -> f64 {
    A * s + B * s.powi(3) + C * s.powi(5)
}

pub fn p_iter(s: f64, steps: usize) -> f64 {
    (0..steps).fold(s, |s, _| p(s))
}

/// The coefficients as the backend receives them: `ns_shifted`'s (β, δ, c) rounded to f32 (the
/// `Syrk` fields are f32) and mapped back to `a = δ + c·β², b = 2·c·β, c`. An f64 backend matches
/// a reference using these to rounding.
pub fn coeffs_f32() -> (f64, f64, f64) {
    let (shift, offset, c) = ganymede_optim::ns_shifted();
    let f = |x: f64| x as f32 as f64;
    let (shift, offset, c) = (f(shift), f(offset), f(c));
    (offset + c * shift * shift, 2.0 * c * shift, c)
}

/// Reference Newton–Schulz, written out the textbook way: explicit transpose of tall matrices.
pub fn ns_reference(g: &[f64], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    ns_reference_with((A, B, C), g, rows, cols, steps)
}

pub fn ns_reference_with(
    (a_, b_, c_): (f64, f64, f64),
    g: &[f64],
    rows: usize,
    cols: usize,
    steps: usize,
) -> Vec<f64> {
    let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut x: Vec<f64> = g.iter().map(|v| v / (norm + 1e-7)).collect();
    let tall = rows > cols;
    let (s, l) = if tall { (cols, rows) } else { (rows, cols) };
    if tall {
        x = transpose(&x, rows, cols);
    }
    for _ in 0..steps {
        let a = matmul(&x, &transpose(&x, s, l), s, l, s);
        let aa = matmul(&a, &a, s, s, s);
        let b: Vec<f64> = a.iter().zip(&aa).map(|(a, aa)| b_ * a + c_ * aa).collect();
        let bx = matmul(&b, &x, s, s, l);
        x = x.iter().zip(&bx).map(|(x, bx)| a_ * x + bx).collect();
    }
    if tall {
        x = transpose(&x, s, l);
    }
    x
}

pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

pub fn rms(a: &[f64]) -> f64 {
    (a.iter().map(|x| x * x).sum::<f64>() / a.len() as f64).sqrt()
}

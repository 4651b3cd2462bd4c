//! Every kernel's host build (kernels/*.cu through the shim) against the CPU backend, op by op,
//! on small shapes that are not multiples of the block size. Each check also runs the kernel on
//! one perturbed input and requires the comparison to fail, so a check cannot pass vacuously.
//!
//! Tolerances: f32 kernels within 1e-5 relative (plus a small absolute floor for values near
//! zero, stated per test); bf16 kernels against the CPU in f32 on the same bf16-rounded inputs,
//! within twice what one bf16 rounding of the output allows (2^-7 relative: a rounding is up
//! to 2^-8, and the f32 work before it differs by a few ulps).

use ganymede_core::{bf16, Blas, Category, CpuBackend, Ledger, Memory, Tensor};
use ganymede_cuda::host::{launch, Arg, LaunchConfig};
use std::sync::Arc;

fn cpu() -> CpuBackend {
    CpuBackend::new(Arc::new(Ledger::new()))
}
fn up(b: &CpuBackend, x: &[f32]) -> Tensor {
    b.upload(x, &[x.len()], Category::Activations)
}
fn down(b: &CpuBackend, t: &Tensor) -> Vec<f32> {
    b.download(t.view())
}

struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    #[allow(dead_code)]
    fn below(&mut self, n: usize) -> u32 {
        ((self.next() * 0.5 + 0.5) * n as f32).min(n as f32 - 1.0) as u32
    }
}

/// `|got - want| <= atol + rtol * |want|` elementwise.
#[derive(Clone, Copy, Debug)]
struct Tol {
    rtol: f64,
    atol: f64,
}
const F32: Tol = Tol {
    rtol: 1e-5,
    atol: 1e-6,
};
const BF16: Tol = Tol {
    rtol: 1.0 / 128.0,
    atol: 1e-4,
};

/// Largest absolute and relative error, or the first element out of tolerance.
fn compare(got: &[f32], want: &[f32], tol: Tol) -> Result<(f64, f64), String> {
    if got.len() != want.len() {
        return Err(format!("length {} != {}", got.len(), want.len()));
    }
    let (mut abs, mut rel) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g as f64, w as f64);
        let e = (g - w).abs();
        // NaN fails too.
        if e.is_nan() || e > tol.atol + tol.rtol * w.abs() {
            return Err(format!("element {i}: got {g}, want {w}"));
        }
        abs = abs.max(e);
        if w != 0.0 {
            rel = rel.max(e / w.abs());
        }
    }
    Ok((abs, rel))
}

/// Runs `kernel` and `reference` on `inputs` and compares every output; then runs `kernel` on
/// the inputs with one element of input `perturb` changed and requires a mismatch.
fn parity(
    name: &str,
    inputs: &[Vec<f32>],
    perturb: usize,
    tol: Tol,
    kernel: impl Fn(&[Vec<f32>]) -> Vec<Vec<f32>>,
    reference: impl Fn(&[Vec<f32>]) -> Vec<Vec<f32>>,
) {
    let want = reference(inputs);
    let got = kernel(inputs);
    assert_eq!(got.len(), want.len(), "{name}: outputs");
    let (mut abs, mut rel) = (0.0f64, 0.0f64);
    for (o, (g, w)) in got.iter().zip(&want).enumerate() {
        let (a, r) = compare(g, w, tol).unwrap_or_else(|e| panic!("{name}: output {o}: {e}"));
        abs = abs.max(a);
        rel = rel.max(r);
    }
    println!("{name}: max abs err {abs:.3e}, max rel err {rel:.3e} ({tol:?})");
    let mut bad = inputs.to_vec();
    let j = bad[perturb].len() / 2;
    bad[perturb][j] += 0.5 * (1.0 + bad[perturb][j].abs());
    let got = kernel(&bad);
    let caught = got
        .iter()
        .zip(&want)
        .any(|(g, w)| compare(g, w, tol).is_err());
    assert!(caught, "{name}: a perturbed input went unnoticed");
}

fn to_bf16(x: &[f32]) -> Vec<u16> {
    bf16::from_f32_slice(x)
}
fn from_bf16(x: &[u16]) -> Vec<f32> {
    bf16::to_f32_slice(x)
}
/// The values a bf16 tensor would hold.
fn round_bf16(x: &[f32]) -> Vec<f32> {
    from_bf16(&to_bf16(x))
}

fn ptr<T>(v: &mut [T]) -> Arg {
    v.as_mut_ptr().into()
}
fn cptr<T>(v: &[T]) -> Arg {
    v.as_ptr().into()
}
fn len(v: &[impl Sized]) -> Arg {
    (v.len() as i64).into()
}

/// Grid-stride kernels: few small blocks, so every thread loops over several elements.
const EW: LaunchConfig = LaunchConfig {
    grid: [3, 1, 1],
    block: [64, 1, 1],
    shared: 0,
};

// ---------------------------------------------------------------------------------------------
// Casts, vector ops, sums of squares

#[test]
fn casts_match_core_bit_for_bit() {
    let mut rng = Rng::new(1);
    let mut x: Vec<f32> = rng.vec(1001, 3.0);
    // Ties, NaNs (one whose payload truncation would lose), infinities, subnormals, f32::MAX.
    for bits in [
        0x3f80_8000u32,
        0x3f81_8000,
        0x7fc0_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7f80_0000,
        0xff80_0000,
        0x0001_8000,
        0x0000_8000,
        0x7f7f_ffff,
        0x8000_0000,
    ] {
        x.push(f32::from_bits(bits));
    }
    let mut h = vec![0u16; x.len()];
    unsafe { launch("cast_f32_to_bf16", EW, &[ptr(&mut h), cptr(&x), len(&x)]) };
    assert_eq!(h, to_bf16(&x), "f32 -> bf16");
    let mut back = vec![0f32; x.len()];
    unsafe { launch("cast_bf16_to_f32", EW, &[ptr(&mut back), cptr(&h), len(&h)]) };
    let want = from_bf16(&h);
    assert!(back
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    // Through the CPU backend's cast too (what the device must agree with).
    let b = cpu();
    let src = up(&b, &x);
    let mut dst = b.zeros_of(
        &[x.len()],
        ganymede_core::DType::BF16,
        Category::Activations,
    );
    b.cast(dst.view_mut(), src.view());
    assert_eq!(dst.view().host_bf16(), &h[..]);
}

#[test]
fn axpy_scale_add() {
    let mut rng = Rng::new(2);
    let (y, x) = (rng.vec(999, 1.0), rng.vec(999, 1.0));
    let b = cpu();
    parity(
        "axpy_f32",
        &[y.clone(), x.clone()],
        1,
        F32,
        |v| {
            let mut y = v[0].clone();
            unsafe {
                launch(
                    "axpy_f32",
                    EW,
                    &[ptr(&mut y), 0.37f32.into(), cptr(&v[1]), len(&y)],
                )
            };
            vec![y]
        },
        |v| {
            let mut y = up(&b, &v[0]);
            b.axpy(y.view_mut(), 0.37, up(&b, &v[1]).view());
            vec![down(&b, &y)]
        },
    );
    parity(
        "scale_f32",
        std::slice::from_ref(&y),
        0,
        F32,
        |v| {
            let mut y = v[0].clone();
            unsafe { launch("scale_f32", EW, &[ptr(&mut y), (-1.7f32).into(), len(&y)]) };
            vec![y]
        },
        |v| {
            let mut y = up(&b, &v[0]);
            b.scale(y.view_mut(), -1.7);
            vec![down(&b, &y)]
        },
    );
    parity(
        "add_f32",
        &[y, x],
        1,
        F32,
        |v| {
            let mut y = v[0].clone();
            unsafe { launch("add_f32", EW, &[ptr(&mut y), cptr(&v[1]), len(&y)]) };
            vec![y]
        },
        |v| {
            let mut y = up(&b, &v[0]);
            b.add(y.view_mut(), up(&b, &v[1]).view());
            vec![down(&b, &y)]
        },
    );
}

/// `acc[0] += Σ x²` through the two passes, as the device runs them.
fn sumsq_host(kernel: &str, x: Arg, n: usize, acc: f64) -> f64 {
    let blocks = 5usize;
    let mut partial = vec![f64::NAN; blocks];
    let mut acc = [acc];
    unsafe {
        launch(
            kernel,
            LaunchConfig::linear(blocks as u32, 96),
            &[ptr(&mut partial), x, (n as i64).into()],
        );
        launch(
            "sum_acc_f64",
            LaunchConfig::linear(1, 64),
            &[ptr(&mut acc), cptr(&partial), (blocks as i32).into()],
        );
    }
    acc[0]
}

#[test]
fn sumsq_accumulates_in_f64() {
    let mut rng = Rng::new(3);
    let x = rng.vec(1237, 2.0);
    let b = cpu();
    let mut acc = b.zeros_of(&[1], ganymede_core::DType::F64, Category::Activations);
    b.write_f64_first(&mut acc, 0.25);
    b.sumsq_acc(acc.view_mut(), up(&b, &x).view());
    let want = b.download_f64(acc.view())[0];
    let got = sumsq_host("sumsq_partial_f32", cptr(&x), x.len(), 0.25);
    let err = ((got - want) / want).abs();
    println!("sumsq_partial_f32 + sum_acc_f64: rel err {err:.3e} (tol 1e-12)");
    assert!(err < 1e-12, "sumsq {got} vs {want}");
    let mut bad = x.clone();
    bad[600] += 1e-3;
    let got_bad = sumsq_host("sumsq_partial_f32", cptr(&bad), bad.len(), 0.25);
    assert!(((got_bad - want) / want).abs() > 1e-12);

    // bf16 input: exactly the sum over the values the bf16 tensor holds.
    let h = to_bf16(&x);
    let xr = from_bf16(&h);
    let want: f64 = 0.25 + xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
    let got = sumsq_host("sumsq_partial_bf16", cptr(&h), h.len(), 0.25);
    let err = ((got - want) / want).abs();
    println!("sumsq_partial_bf16: rel err {err:.3e} (tol 1e-12)");
    assert!(err < 1e-12);
}

trait WriteF64 {
    fn write_f64_first(&self, t: &mut Tensor, v: f64);
}
impl WriteF64 for CpuBackend {
    fn write_f64_first(&self, t: &mut Tensor, v: f64) {
        t.view_mut().host::<f64>()[0] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

#[test]
fn swiglu_forward_backward() {
    use ganymede_core::NnOps;
    let mut rng = Rng::new(4);
    let n = 1111;
    let (g, u, d) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
    let b = cpu();
    let reference = |v: &[Vec<f32>]| {
        let mut o = b.zeros(&[n], Category::Activations);
        b.swiglu_forward(o.view_mut(), up(&b, &v[0]).view(), up(&b, &v[1]).view());
        let (mut dg, mut du) = (
            b.zeros(&[n], Category::Activations),
            b.zeros(&[n], Category::Activations),
        );
        b.swiglu_backward(
            dg.view_mut(),
            du.view_mut(),
            up(&b, &v[2]).view(),
            up(&b, &v[0]).view(),
            up(&b, &v[1]).view(),
        );
        vec![down(&b, &o), down(&b, &dg), down(&b, &du)]
    };
    parity(
        "swiglu_f32",
        &[g.clone(), u.clone(), d.clone()],
        0,
        F32,
        |v| {
            let (mut o, mut dg, mut du) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            unsafe {
                launch(
                    "swiglu_forward_f32",
                    EW,
                    &[ptr(&mut o), cptr(&v[0]), cptr(&v[1]), len(&o)],
                );
                launch(
                    "swiglu_backward_f32",
                    EW,
                    &[
                        ptr(&mut dg),
                        ptr(&mut du),
                        cptr(&v[2]),
                        cptr(&v[0]),
                        cptr(&v[1]),
                        len(&o),
                    ],
                );
            }
            vec![o, dg, du]
        },
        reference,
    );
    // bf16 storage: the CPU in f32 on the same bf16 values.
    let rounded: Vec<Vec<f32>> = [g, u, d].iter().map(|v| round_bf16(v)).collect();
    parity(
        "swiglu_bf16",
        &rounded,
        0,
        BF16,
        |v| {
            let (g, u, d) = (to_bf16(&v[0]), to_bf16(&v[1]), to_bf16(&v[2]));
            let (mut o, mut dg, mut du) = (vec![0u16; n], vec![0u16; n], vec![0u16; n]);
            unsafe {
                launch(
                    "swiglu_forward_bf16",
                    EW,
                    &[ptr(&mut o), cptr(&g), cptr(&u), len(&o)],
                );
                launch(
                    "swiglu_backward_bf16",
                    EW,
                    &[
                        ptr(&mut dg),
                        ptr(&mut du),
                        cptr(&d),
                        cptr(&g),
                        cptr(&u),
                        len(&o),
                    ],
                );
            }
            vec![from_bf16(&o), from_bf16(&dg), from_bf16(&du)]
        },
        reference,
    );
}

#[test]
fn unknown_kernel_and_wrong_argument_kinds_are_refused() {
    assert!(ganymede_cuda::host::signature("no_such_kernel").is_none());
    let r = std::panic::catch_unwind(|| {
        let mut y = vec![0f32; 4];
        // `n` as i32 where the kernel takes long long.
        unsafe { launch("scale_f32", EW, &[ptr(&mut y), 2.0f32.into(), 4i32.into()]) };
    });
    assert!(r.is_err());
}

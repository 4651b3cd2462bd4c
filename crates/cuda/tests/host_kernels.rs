//! Every kernel's host build (kernels/*.cu through the shim) against the CPU backend, op by op,
//! on small shapes that are not multiples of the block size. Each check also runs the kernel on
//! one perturbed input and requires the comparison to fail, so a check cannot pass vacuously.
//!
//! Tolerances: f32 kernels within 1e-5 relative (plus a small absolute floor for values near
//! zero, stated per test); bf16 kernels against the CPU in f32 on the same bf16-rounded inputs,
//! within twice what one bf16 rounding of the output allows (2^-7 relative: a rounding is up
//! to 2^-8, and the f32 work before it differs by a few ulps).

use ganymede_core::{bf16, Blas, Category, CpuBackend, Ledger, Memory, Tensor};
use ganymede_cuda::host::{launch, set_schedule, Arg, LaunchConfig, Schedule};
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

/// Runs `kernel` and `reference` on `inputs` and compares every output, with the threads of each
/// block run first to last and again last to first (a missing barrier shows in one of them);
/// then runs `kernel` on the inputs with one element of input `perturb` changed and requires a
/// mismatch. `tols` holds one tolerance per output, or one for all.
fn parity(
    name: &str,
    inputs: &[Vec<f32>],
    perturb: usize,
    tols: &[Tol],
    kernel: impl Fn(&[Vec<f32>]) -> Vec<Vec<f32>>,
    reference: impl Fn(&[Vec<f32>]) -> Vec<Vec<f32>>,
) {
    let want = reference(inputs);
    let tol = |o: usize| tols[o.min(tols.len() - 1)];
    let got = kernel(inputs);
    assert_eq!(got.len(), want.len(), "{name}: outputs");
    for (o, (g, w)) in got.iter().zip(&want).enumerate() {
        let (a, r) = compare(g, w, tol(o)).unwrap_or_else(|e| panic!("{name}: output {o}: {e}"));
        println!(
            "{name} output {o}: max abs err {a:.3e}, max rel err {r:.3e} ({:?})",
            tol(o)
        );
    }
    set_schedule(Schedule::LastToFirst);
    let reversed = kernel(inputs);
    set_schedule(Schedule::FirstToLast);
    for (o, (g, w)) in reversed.iter().zip(&want).enumerate() {
        compare(g, w, tol(o))
            .unwrap_or_else(|e| panic!("{name}: output {o}, threads last to first: {e}"));
    }
    let mut bad = inputs.to_vec();
    let j = bad[perturb].len() / 2;
    // Large against the data (0.5 + its largest magnitude), so the change shows in any output.
    let big = bad[perturb].iter().fold(0.0f32, |a, x| a.max(x.abs()));
    bad[perturb][j] += 0.5 + big;
    let got = kernel(&bad);
    let caught = got
        .iter()
        .zip(&want)
        .enumerate()
        .any(|(o, (g, w))| compare(g, w, tol(o)).is_err());
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
    for st in [St::F32, St::Bf16] {
        let tol = [st.tols_with_reduction()[0]];
        let inputs = st.inputs(&[y.clone(), x.clone()]);
        parity(
            &st.name("axpy"),
            &inputs,
            1,
            &tol,
            |v| {
                let (mut y, mut x) = (st.buf(&v[0]), st.buf(&v[1]));
                let n = Arg::I64(v[0].len() as i64);
                unsafe { launch(&st.name("axpy"), EW, &[y.arg(), 0.37f32.into(), x.arg(), n]) };
                vec![y.read()]
            },
            |v| {
                let mut y = up(&b, &v[0]);
                b.axpy(y.view_mut(), 0.37, up(&b, &v[1]).view());
                vec![down(&b, &y)]
            },
        );
        parity(
            &st.name("scale"),
            &inputs[..1],
            0,
            &tol,
            |v| {
                let mut y = st.buf(&v[0]);
                let n = Arg::I64(v[0].len() as i64);
                unsafe { launch(&st.name("scale"), EW, &[y.arg(), (-1.7f32).into(), n]) };
                vec![y.read()]
            },
            |v| {
                let mut y = up(&b, &v[0]);
                b.scale(y.view_mut(), -1.7);
                vec![down(&b, &y)]
            },
        );
        parity(
            &st.name("add"),
            &inputs,
            1,
            &tol,
            |v| {
                let (mut y, mut x) = (st.buf(&v[0]), st.buf(&v[1]));
                let n = Arg::I64(v[0].len() as i64);
                unsafe { launch(&st.name("add"), EW, &[y.arg(), x.arg(), n]) };
                vec![y.read()]
            },
            |v| {
                let mut y = up(&b, &v[0]);
                b.add(y.view_mut(), up(&b, &v[1]).view());
                vec![down(&b, &y)]
            },
        );
    }
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
        &[F32],
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
        &[BF16],
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

// ---------------------------------------------------------------------------------------------
// Storage types: the same check for f32 and bf16 kernels.

#[derive(Clone, Copy, Debug)]
enum St {
    F32,
    Bf16,
}
impl St {
    fn name(self, kernel: &str) -> String {
        match self {
            St::F32 => format!("{kernel}_f32"),
            St::Bf16 => format!("{kernel}_bf16"),
        }
    }
    /// For [out, rstd, dx, dw]: dw sums a product over every row, in the CPU's order but from
    /// rstd and dots that differ in the last bits, so its floor is that of a sum of ~500 terms
    /// of order one (500 · 2^-24 ≈ 3e-5).
    fn tols_with_reduction(self) -> [Tol; 4] {
        let sum = Tol {
            rtol: 1e-5,
            atol: 3e-5,
        };
        match self {
            St::F32 => [F32, F32, F32, sum],
            St::Bf16 => [BF16, F32, BF16, sum],
        }
    }
    fn buf(self, x: &[f32]) -> Buf {
        match self {
            St::F32 => Buf::F32(x.to_vec()),
            St::Bf16 => Buf::Bf16(to_bf16(x)),
        }
    }
    /// The inputs as this storage holds them.
    fn inputs(self, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
        match self {
            St::F32 => x.to_vec(),
            St::Bf16 => x.iter().map(|v| round_bf16(v)).collect(),
        }
    }
}
enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}
impl Buf {
    fn arg(&mut self) -> Arg {
        match self {
            Buf::F32(v) => ptr(v),
            Buf::Bf16(v) => ptr(v),
        }
    }
    fn read(&self) -> Vec<f32> {
        match self {
            Buf::F32(v) => v.clone(),
            Buf::Bf16(v) => from_bf16(v),
        }
    }
}

fn cfg(grid: [u32; 3], block: u32) -> LaunchConfig {
    LaunchConfig {
        grid,
        block: [block, 1, 1],
        shared: 0,
    }
}

/// The CPU backend's rows per partial sum of a weight gradient.
const CHUNK_ROWS: usize = 64;

/// dw += the partials, as the device does after a *_dw_partial kernel.
fn col_sum_acc(dw: &mut [f32], partial: &[f32]) {
    let cols = dw.len();
    let parts = partial.len() / cols;
    unsafe {
        launch(
            "col_sum_acc_f32",
            cfg([cols.div_ceil(32) as u32, 1, 1], 32),
            &[
                ptr(dw),
                cptr(partial),
                (parts as i32).into(),
                (cols as i32).into(),
            ],
        )
    };
}

#[test]
fn rmsnorm_forward_backward() {
    use ganymede_core::{NnOps, NormSaved};
    let (rows, dim, eps) = (150usize, 100usize, 1e-6f32);
    let mut rng = Rng::new(5);
    let x = rng.vec(rows * dim, 2.0);
    let w: Vec<f32> = rng.vec(dim, 0.5).iter().map(|v| 1.0 + v).collect();
    let dout = rng.vec(rows * dim, 1.0);
    let dx0 = rng.vec(rows * dim, 0.3);
    let dw0 = rng.vec(dim, 0.3);
    let b = cpu();
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[x.clone(), w.clone(), dout.clone(), dx0.clone()]);
        parity(
            &st.name("rmsnorm"),
            &inputs,
            0,
            &st.tols_with_reduction(),
            |v| {
                let (mut xb, mut wb, mut db) = (st.buf(&v[0]), st.buf(&v[1]), st.buf(&v[2]));
                let (mut out, mut dx) = (st.buf(&vec![0.0; rows * dim]), st.buf(&v[3]));
                let mut rstd = vec![0f32; rows];
                let mut dw = dw0.clone();
                let chunks = rows.div_ceil(CHUNK_ROWS);
                let mut partial = vec![f32::NAN; chunks * dim];
                unsafe {
                    launch(
                        &st.name("rmsnorm_forward"),
                        cfg([rows as u32, 1, 1], 64),
                        &[
                            out.arg(),
                            ptr(&mut rstd),
                            xb.arg(),
                            wb.arg(),
                            (dim as i32).into(),
                            eps.into(),
                        ],
                    );
                    launch(
                        &st.name("rmsnorm_backward_dx"),
                        cfg([rows as u32, 1, 1], 64),
                        &[
                            dx.arg(),
                            db.arg(),
                            xb.arg(),
                            wb.arg(),
                            cptr(&rstd),
                            (dim as i32).into(),
                        ],
                    );
                    launch(
                        &st.name("rmsnorm_backward_dw_partial"),
                        cfg([dim.div_ceil(32) as u32, chunks as u32, 1], 32),
                        &[
                            ptr(&mut partial),
                            db.arg(),
                            xb.arg(),
                            cptr(&rstd),
                            (rows as i32).into(),
                            (dim as i32).into(),
                            (CHUNK_ROWS as i32).into(),
                        ],
                    );
                }
                col_sum_acc(&mut dw, &partial);
                vec![out.read(), rstd, dx.read(), dw]
            },
            |v| {
                let (xt, wt) = (up(&b, &v[0]), up(&b, &v[1]));
                let mut out = b.zeros(&[rows * dim], Category::Activations);
                let mut rstd = b.zeros(&[rows], Category::Activations);
                b.rmsnorm_forward(
                    out.view_mut(),
                    rstd.view_mut(),
                    xt.view(),
                    wt.view(),
                    dim,
                    eps,
                );
                let (mut dx, mut dw) = (up(&b, &v[3]), up(&b, &dw0));
                let saved = NormSaved {
                    x: xt.view(),
                    w: wt.view(),
                    rstd: rstd.view(),
                };
                b.rmsnorm_backward(
                    dx.view_mut(),
                    dw.view_mut(),
                    up(&b, &v[2]).view(),
                    saved,
                    dim,
                );
                vec![
                    down(&b, &out),
                    down(&b, &rstd),
                    down(&b, &dx),
                    down(&b, &dw),
                ]
            },
        );
    }
}

#[test]
fn head_norm_rope_forward_backward() {
    use ganymede_core::{HeadRope, NnOps, NormSaved};
    let d = HeadRope {
        heads: 3,
        head_dim: 70,
        seq: 13,
        // Far positions: angles of thousands of radians, where the frequencies must match.
        pos0: 4000,
        theta: 1_000_000.0,
        eps: 1e-6,
    };
    let rows = 150usize;
    let n = rows * d.heads * d.head_dim;
    let mut rng = Rng::new(6);
    let x = rng.vec(n, 2.0);
    let w: Vec<f32> = rng.vec(d.head_dim, 0.5).iter().map(|v| 1.0 + v).collect();
    let dout = rng.vec(n, 1.0);
    let dw0 = rng.vec(d.head_dim, 0.3);
    let inv_freq = ganymede_cuda::host::rope_inv_freq(d.head_dim, d.theta);
    let b = cpu();
    let sizes = |rows: usize| -> Vec<Arg> {
        vec![
            (d.heads as i32).into(),
            (d.head_dim as i32).into(),
            (d.seq as i32).into(),
            (d.pos0 as i32).into(),
            cptr(&inv_freq),
        ]
        .into_iter()
        .chain(std::iter::once(Arg::I32(rows as i32)))
        .collect()
    };
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[x.clone(), w.clone(), dout.clone()]);
        parity(
            &st.name("head_norm_rope"),
            &inputs,
            0,
            &st.tols_with_reduction(),
            |v| {
                let (mut xb, mut wb, mut db) = (st.buf(&v[0]), st.buf(&v[1]), st.buf(&v[2]));
                let (mut out, mut dx) = (st.buf(&vec![0.0; n]), st.buf(&vec![f32::NAN; n]));
                let mut rstd = vec![0f32; rows * d.heads];
                let mut dw = dw0.clone();
                let chunks = rows.div_ceil(CHUNK_ROWS);
                let mut partial = vec![f32::NAN; chunks * d.head_dim];
                let s = &sizes(rows)[..5];
                let blocks = cfg([(rows * d.heads) as u32, 1, 1], 32);
                unsafe {
                    let mut a = vec![out.arg(), ptr(&mut rstd), xb.arg(), wb.arg()];
                    a.extend_from_slice(s);
                    a.push(d.eps.into());
                    launch(&st.name("head_norm_rope_forward"), blocks, &a);
                    let mut a = vec![dx.arg(), db.arg(), xb.arg(), wb.arg(), cptr(&rstd)];
                    a.extend_from_slice(s);
                    launch(&st.name("head_norm_rope_backward_dx"), blocks, &a);
                    let mut a = vec![
                        ptr(&mut partial),
                        db.arg(),
                        xb.arg(),
                        cptr(&rstd),
                        (rows as i32).into(),
                    ];
                    a.extend_from_slice(s);
                    a.push((CHUNK_ROWS as i32).into());
                    launch(
                        &st.name("head_norm_rope_backward_dw_partial"),
                        cfg([d.head_dim.div_ceil(32) as u32, chunks as u32, 1], 32),
                        &a,
                    );
                }
                col_sum_acc(&mut dw, &partial);
                vec![out.read(), rstd, dx.read(), dw]
            },
            |v| {
                let (xt, wt) = (up(&b, &v[0]), up(&b, &v[1]));
                let mut out = b.zeros(&[n], Category::Activations);
                let mut rstd = b.zeros(&[rows * d.heads], Category::Activations);
                b.head_norm_rope_forward(out.view_mut(), rstd.view_mut(), xt.view(), wt.view(), d);
                let mut dx = b.zeros(&[n], Category::Activations);
                let mut dw = up(&b, &dw0);
                let saved = NormSaved {
                    x: xt.view(),
                    w: wt.view(),
                    rstd: rstd.view(),
                };
                b.head_norm_rope_backward(
                    dx.view_mut(),
                    dw.view_mut(),
                    up(&b, &v[2]).view(),
                    saved,
                    d,
                );
                vec![
                    down(&b, &out),
                    down(&b, &rstd),
                    down(&b, &dx),
                    down(&b, &dw),
                ]
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding

#[test]
fn embedding_forward_backward() {
    use ganymede_core::NnOps;
    let (rows, vocab, dim) = (57usize, 23usize, 70usize);
    let mut rng = Rng::new(7);
    let ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab)).collect();
    let (order, seg_start, seg_id) = ganymede_cuda::host::embedding_segments(&ids);
    assert!(seg_id.len() < rows, "the test wants repeated ids");
    let wte = rng.vec(vocab * dim, 1.0);
    let dout = rng.vec(rows * dim, 1.0);
    let dwte0 = rng.vec(vocab * dim, 0.3);
    let b = cpu();
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[wte.clone(), dout.clone()]);
        parity(
            &st.name("embedding"),
            &inputs,
            0,
            &[st.tols_with_reduction()[0], F32],
            |v| {
                let (mut wb, mut db) = (st.buf(&v[0]), st.buf(&v[1]));
                let mut out = st.buf(&vec![f32::NAN; rows * dim]);
                let mut dwte = dwte0.clone();
                unsafe {
                    launch(
                        &st.name("embedding_forward"),
                        cfg([rows as u32, 1, 1], 32),
                        &[out.arg(), wb.arg(), cptr(&ids), (dim as i32).into()],
                    );
                    launch(
                        &st.name("embedding_backward_sorted"),
                        cfg([seg_id.len() as u32, 1, 1], 64),
                        &[
                            ptr(&mut dwte),
                            db.arg(),
                            cptr(&order),
                            cptr(&seg_start),
                            cptr(&seg_id),
                            (dim as i32).into(),
                        ],
                    );
                }
                vec![out.read(), dwte]
            },
            |v| {
                let mut out = b.zeros(&[rows * dim], Category::Activations);
                let ids = b.upload_u32(&ids, &[ids.len()], Category::Activations);
                b.embedding_forward(out.view_mut(), up(&b, &v[0]).view(), ids.view(), dim);
                let mut dwte = up(&b, &dwte0);
                b.embedding_backward(dwte.view_mut(), up(&b, &v[1]).view(), ids.view(), dim);
                vec![down(&b, &out), down(&b, &dwte)]
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Optimizers

#[test]
fn optimizer_updates() {
    use ganymede_core::{AdamWStep, OptimOps};
    let n = 1001usize;
    let mut rng = Rng::new(8);
    let p = rng.vec(n, 1.0);
    let m = rng.vec(n, 0.1);
    let v: Vec<f32> = rng.vec(n, 0.01).iter().map(|x| x.abs()).collect();
    let g = rng.vec(n, 0.5);
    let b = cpu();
    let h = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        bias_correction1: 1.0 - 0.9f64.powi(3),
        bias_correction2: 1.0 - 0.95f64.powi(3),
    };
    parity(
        "adamw_step_f32",
        &[p.clone(), m.clone(), v.clone(), g.clone()],
        3,
        &[F32],
        |x| {
            let (mut p, mut m, mut v) = (x[0].clone(), x[1].clone(), x[2].clone());
            let c = |x: f64| Arg::F32(x as f32);
            unsafe {
                launch(
                    "adamw_step_f32",
                    EW,
                    &[
                        ptr(&mut p),
                        ptr(&mut m),
                        ptr(&mut v),
                        cptr(&x[3]),
                        len(&x[3]),
                        c(h.beta1),
                        c(h.beta2),
                        c(1.0 - h.beta1),
                        c(1.0 - h.beta2),
                        c(1.0 - h.lr * h.weight_decay),
                        c(h.lr / h.bias_correction1),
                        c(1.0 / h.bias_correction2.sqrt()),
                        c(h.eps),
                    ],
                )
            };
            vec![p, m, v]
        },
        |x| {
            let (mut p, mut m, mut v) = (up(&b, &x[0]), up(&b, &x[1]), up(&b, &x[2]));
            b.adamw_step(
                p.view_mut(),
                m.view_mut(),
                v.view_mut(),
                up(&b, &x[3]).view(),
                &h,
            );
            vec![down(&b, &p), down(&b, &m), down(&b, &v)]
        },
    );
    let mu = 0.95;
    parity(
        "nesterov_f32",
        &[m.clone(), g.clone()],
        1,
        &[F32],
        |x| {
            let (mut buf, mut out) = (x[0].clone(), vec![f32::NAN; n]);
            unsafe {
                launch(
                    "nesterov_f32",
                    EW,
                    &[
                        ptr(&mut buf),
                        cptr(&x[1]),
                        ptr(&mut out),
                        len(&out),
                        (mu as f32).into(),
                    ],
                )
            };
            vec![buf, out]
        },
        |x| {
            let (mut buf, mut out) = (up(&b, &x[0]), b.zeros(&[n], Category::Activations));
            b.nesterov_momentum(buf.view_mut(), up(&b, &x[1]).view(), out.view_mut(), mu);
            vec![down(&b, &buf), down(&b, &out)]
        },
    );
    let eps = 1e-7;
    parity(
        "normalize_frobenius (sumsq_partial_f32, sum_acc_f64, scale_by_inv_norm_f32)",
        std::slice::from_ref(&g),
        0,
        &[F32],
        |x| {
            let mut x = x[0].clone();
            let s = sumsq_host("sumsq_partial_f32", cptr(&x), n, 0.0);
            unsafe {
                launch(
                    "scale_by_inv_norm_f32",
                    EW,
                    &[ptr(&mut x), cptr(&[s]), eps.into(), len(&g)],
                )
            };
            vec![x]
        },
        |x| {
            let mut t = up(&b, &x[0]);
            b.normalize_frobenius(t.view_mut(), eps);
            vec![down(&b, &t)]
        },
    );
    let (alpha, decay) = (0.02, 0.001);
    parity(
        "decay_update_f32",
        &[p, g],
        1,
        &[F32],
        |x| {
            let mut p = x[0].clone();
            unsafe {
                launch(
                    "decay_update_f32",
                    EW,
                    &[
                        ptr(&mut p),
                        cptr(&x[1]),
                        len(&p),
                        (alpha as f32).into(),
                        ((1.0 - decay) as f32).into(),
                    ],
                )
            };
            vec![p]
        },
        |x| {
            let mut p = up(&b, &x[0]);
            b.decay_update(p.view_mut(), up(&b, &x[1]).view(), alpha, decay);
            vec![down(&b, &p)]
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

#[test]
fn cross_entropy_forward_backward() {
    use ganymede_core::{DType, NnOps};
    let (rows, vocab) = (13usize, 1000usize);
    let mut rng = Rng::new(9);
    let logits = rng.vec(rows * vocab, 4.0);
    let targets: Vec<u32> = (0..rows).map(|_| rng.below(vocab)).collect();
    let (scale, loss0) = (1.0f32 / 13.0, 0.5f64);
    let b = cpu();
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(std::slice::from_ref(&logits));
        parity(
            &st.name("cross_entropy"),
            &inputs,
            0,
            &[F32, F32, st.tols_with_reduction()[0]],
            |v| {
                let mut x = st.buf(&v[0]);
                let mut lse = vec![f32::NAN; rows];
                let mut loss = [loss0];
                unsafe {
                    launch(
                        &st.name("cross_entropy_forward"),
                        cfg([rows as u32, 1, 1], 128),
                        &[ptr(&mut lse), x.arg(), (vocab as i32).into()],
                    );
                    launch(
                        &st.name("cross_entropy_loss_acc"),
                        cfg([1, 1, 1], 32),
                        &[
                            ptr(&mut loss),
                            cptr(&lse),
                            x.arg(),
                            cptr(&targets),
                            (rows as i32).into(),
                            (vocab as i32).into(),
                        ],
                    );
                    launch(
                        &st.name("cross_entropy_backward"),
                        cfg([rows as u32, 1, 1], 128),
                        &[
                            x.arg(),
                            cptr(&lse),
                            cptr(&targets),
                            (vocab as i32).into(),
                            scale.into(),
                        ],
                    );
                }
                vec![lse, vec![(loss[0] - loss0) as f32], x.read()]
            },
            |v| {
                let mut x = up(&b, &v[0]);
                let mut lse = b.zeros(&[rows], Category::Activations);
                let mut loss = b.zeros_of(&[1], DType::F64, Category::Activations);
                b.write_f64_first(&mut loss, loss0);
                let t = b.upload_u32(&targets, &[targets.len()], Category::Activations);
                b.cross_entropy_forward(lse.view_mut(), x.view(), t.view(), vocab, loss.view_mut());
                let l = b.download_f64(loss.view())[0];
                b.cross_entropy_backward(x.view_mut(), lse.view(), t.view(), vocab, scale);
                vec![down(&b, &lse), vec![(l - loss0) as f32], down(&b, &x)]
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Router

#[test]
fn router_forward_backward() {
    use ganymede_core::{NnOps, RouterDims, RouterOut};
    let (rows, experts, k) = (150usize, 40usize, 3usize);
    let mut rng = Rng::new(10);
    let mut logits = rng.vec(rows * experts, 3.0);
    // Ties, which must go to the lower index: a uniform row, and a row whose two best are equal.
    logits[5 * experts..6 * experts].fill(0.7);
    logits[6 * experts + 3] = 9.0;
    logits[6 * experts + 7] = 9.0;
    let bias = rng.vec(experts, 0.05);
    let dweights = rng.vec(rows * k, 1.0);
    let dconst: Vec<f64> = rng.vec(experts, 0.1).iter().map(|&v| v as f64).collect();
    let b = cpu();
    let chunks = rows.div_ceil(CHUNK_ROWS);
    for (renorm, with_bias) in [(true, true), (false, false), (true, false)] {
        let d = RouterDims { experts, k, renorm };
        let name = format!("router_f32 (renorm {renorm}, bias {with_bias})");
        // Outputs: probs, weights, idx (as f32: exact), psum, dlogits.
        parity(
            &name,
            &[logits.clone(), bias.clone(), dweights.clone()],
            0,
            &[F32, F32, F32, F32, F32],
            |v| {
                let mut probs = vec![f32::NAN; rows * experts];
                let mut weights = vec![f32::NAN; rows * k];
                let mut idx = vec![u32::MAX; rows * k];
                let mut partial = vec![f64::NAN; chunks * experts];
                let mut psum = vec![f64::NAN; experts];
                let mut dl = vec![f32::NAN; rows * experts];
                let bias_arg: Arg = if with_bias {
                    cptr(&v[1])
                } else {
                    Arg::Ptr(std::ptr::null_mut())
                };
                let one_warp = cfg([rows as u32, 1, 1], 32);
                unsafe {
                    launch(
                        "router_forward_f32",
                        one_warp,
                        &[
                            ptr(&mut probs),
                            ptr(&mut weights),
                            ptr(&mut idx),
                            cptr(&v[0]),
                            bias_arg,
                            (experts as i32).into(),
                            (k as i32).into(),
                            (renorm as i32).into(),
                        ],
                    );
                    launch(
                        "col_sum_partial_f64",
                        cfg([experts.div_ceil(32) as u32, chunks as u32, 1], 32),
                        &[
                            ptr(&mut partial),
                            cptr(&probs),
                            (rows as i32).into(),
                            (experts as i32).into(),
                            (CHUNK_ROWS as i32).into(),
                        ],
                    );
                    launch(
                        "col_sum_set_f64",
                        cfg([experts.div_ceil(32) as u32, 1, 1], 32),
                        &[
                            ptr(&mut psum),
                            cptr(&partial),
                            (chunks as i32).into(),
                            (experts as i32).into(),
                        ],
                    );
                    launch(
                        "router_backward_f32",
                        one_warp,
                        &[
                            ptr(&mut dl),
                            cptr(&v[2]),
                            cptr(&probs),
                            cptr(&idx),
                            cptr(&dconst),
                            (experts as i32).into(),
                            (k as i32).into(),
                            (renorm as i32).into(),
                        ],
                    );
                }
                let idx: Vec<f32> = idx.iter().map(|&i| i as f32).collect();
                let psum: Vec<f32> = psum.iter().map(|&s| s as f32).collect();
                vec![probs, weights, idx, psum, dl]
            },
            |v| {
                let mut probs = b.zeros(&[rows * experts], Category::Activations);
                let mut weights = b.zeros(&[rows * k], Category::Activations);
                let mut idx_t = b.zeros_of(
                    &[rows * k],
                    ganymede_core::DType::U32,
                    Category::Activations,
                );
                let mut psum_t =
                    b.zeros_of(&[experts], ganymede_core::DType::F64, Category::Activations);
                let bias_t = up(&b, &v[1]);
                b.router_forward(
                    RouterOut {
                        probs: probs.view_mut(),
                        weights: weights.view_mut(),
                        idx: idx_t.view_mut(),
                        psum: psum_t.view_mut(),
                    },
                    up(&b, &v[0]).view(),
                    with_bias.then(|| bias_t.view()),
                    d,
                );
                let mut dl = b.zeros(&[rows * experts], Category::Activations);
                let mut dconst_t =
                    b.zeros_of(&[experts], ganymede_core::DType::F64, Category::Activations);
                b.write_f64(dconst_t.view_mut(), &dconst);
                b.router_backward(
                    dl.view_mut(),
                    up(&b, &v[2]).view(),
                    probs.view(),
                    idx_t.view(),
                    dconst_t.view(),
                    d,
                );
                let idx: Vec<f32> = b
                    .download_u32(idx_t.view())
                    .iter()
                    .map(|&i| i as f32)
                    .collect();
                let psum: Vec<f32> = b
                    .download_f64(psum_t.view())
                    .iter()
                    .map(|&s| s as f32)
                    .collect();
                vec![
                    down(&b, &probs),
                    down(&b, &weights),
                    idx,
                    psum,
                    down(&b, &dl),
                ]
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch and combine

/// The model's dispatch (crates/model Routing::dispatch), written out: a stable counting sort.
fn dispatch_reference(idx: &[u32], experts: usize, k: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0u32; experts + 1];
    for &i in idx {
        offsets[i as usize + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    let mut next = offsets[..experts].to_vec();
    let (mut src, mut pos) = (vec![0u32; idx.len()], vec![0u32; idx.len()]);
    for (tj, &i) in idx.iter().enumerate() {
        let p = next[i as usize];
        next[i as usize] += 1;
        src[p as usize] = (tj / k) as u32;
        pos[tj] = p;
    }
    (offsets, src, pos)
}

/// Distinct experts per token, some experts left empty.
fn routing(rng: &mut Rng, tokens: usize, experts: usize, k: usize) -> Vec<u32> {
    let mut idx = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut chosen = Vec::new();
        while chosen.len() < k {
            let e = rng.below(experts - 2) + 1; // experts 0 and last stay empty
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        idx.extend(chosen);
    }
    idx
}

#[test]
fn dispatch_counting_sort() {
    let (tokens, experts, k) = (301usize, 13usize, 4usize);
    let mut rng = Rng::new(11);
    let idx = routing(&mut rng, tokens, experts, k);
    let n = idx.len();
    let (want_off, want_src, want_pos) = dispatch_reference(&idx, experts, k);
    let run = |idx: &[u32]| {
        let mut counts = vec![0u32; experts];
        let mut offsets = vec![u32::MAX; experts + 1];
        let (mut src, mut pos) = (vec![u32::MAX; n], vec![u32::MAX; n]);
        unsafe {
            launch(
                "dispatch_count",
                EW,
                &[ptr(&mut counts), cptr(idx), (n as i32).into()],
            );
            launch(
                "dispatch_offsets",
                cfg([1, 1, 1], 1),
                &[ptr(&mut offsets), cptr(&counts), (experts as i32).into()],
            );
            launch(
                "dispatch_place",
                cfg([experts as u32, 1, 1], 96),
                &[
                    ptr(&mut src),
                    ptr(&mut pos),
                    cptr(&offsets),
                    cptr(idx),
                    (n as i32).into(),
                    (k as i32).into(),
                ],
            );
        }
        (offsets, src, pos)
    };
    let (off, src, pos) = run(&idx);
    assert_eq!(off, want_off, "offsets");
    assert_eq!(src, want_src, "src");
    assert_eq!(pos, want_pos, "pos");
    println!("dispatch: {n} choices over {experts} experts: offsets, src, pos equal");
    // Swapping two choices of different experts must show.
    let mut bad = idx.clone();
    let j = (0..n).find(|&j| bad[j] != bad[n / 2]).unwrap();
    bad.swap(j, n / 2);
    assert_ne!(run(&bad).2, want_pos);
}

#[test]
fn moe_gather_combine_forward_backward() {
    use ganymede_core::{Dispatched, NnOps};
    let (tokens, experts, k, dim) = (37usize, 7usize, 3usize, 70usize);
    let mut rng = Rng::new(12);
    let idx = routing(&mut rng, tokens, experts, k);
    let (_, src, pos) = dispatch_reference(&idx, experts, k);
    let n = tokens * k;
    let x = rng.vec(tokens * dim, 1.0);
    let ye = rng.vec(n * dim, 1.0);
    let dout = rng.vec(tokens * dim, 1.0);
    let dxe = rng.vec(n * dim, 1.0);
    let acc0 = rng.vec(tokens * dim, 0.3);
    let w = rng.vec(n, 1.0);
    let b = cpu();
    let (pos_t, src_t) = (
        b.upload_u32(&pos, &[pos.len()], Category::Activations),
        b.upload_u32(&src, &[src.len()], Category::Activations),
    );
    let d = Dispatched {
        pos: pos_t.view(),
        k,
        dim,
    };
    for st in [St::F32, St::Bf16] {
        // w stays f32 (router weights); the rest is storage.
        let mut inputs = st.inputs(&[
            ye.clone(),
            x.clone(),
            dout.clone(),
            dxe.clone(),
            acc0.clone(),
        ]);
        inputs.push(w.clone());
        let t = st.tols_with_reduction()[0];
        // Outputs: xe, dx (+=), out (+=), dye, dw (a dot over dim: the reduction's floor).
        parity(
            &st.name("moe_gather_combine"),
            &inputs,
            0,
            &[t, t, t, t, st.tols_with_reduction()[3]],
            |v| {
                let (mut yb, mut xb, mut db, mut dxeb) =
                    (st.buf(&v[0]), st.buf(&v[1]), st.buf(&v[2]), st.buf(&v[3]));
                let (mut xe, mut dx, mut out) = (
                    st.buf(&vec![f32::NAN; n * dim]),
                    st.buf(&v[4]),
                    st.buf(&v[4]),
                );
                let mut dye = st.buf(&vec![f32::NAN; n * dim]);
                let mut dw = vec![f32::NAN; n];
                let (rows, toks) = (cfg([n as u32, 1, 1], 32), cfg([tokens as u32, 1, 1], 64));
                let dimk = [(k as i32).into(), (dim as i32).into()];
                unsafe {
                    launch(
                        &st.name("moe_gather"),
                        rows,
                        &[xe.arg(), xb.arg(), cptr(&src), (dim as i32).into()],
                    );
                    launch(
                        &st.name("moe_gather_backward"),
                        toks,
                        &[dx.arg(), dxeb.arg(), cptr(&pos), dimk[0], dimk[1]],
                    );
                    launch(
                        &st.name("moe_combine"),
                        toks,
                        &[
                            out.arg(),
                            yb.arg(),
                            cptr(&v[5]),
                            cptr(&pos),
                            dimk[0],
                            dimk[1],
                        ],
                    );
                    launch(
                        &st.name("moe_combine_backward"),
                        toks,
                        &[
                            dye.arg(),
                            ptr(&mut dw),
                            db.arg(),
                            yb.arg(),
                            cptr(&v[5]),
                            cptr(&pos),
                            dimk[0],
                            dimk[1],
                        ],
                    );
                }
                vec![xe.read(), dx.read(), out.read(), dye.read(), dw]
            },
            |v| {
                let mut xe = b.zeros(&[n * dim], Category::Activations);
                b.moe_gather(xe.view_mut(), up(&b, &v[1]).view(), src_t.view(), dim);
                let mut dx = up(&b, &v[4]);
                b.moe_gather_backward(dx.view_mut(), up(&b, &v[3]).view(), d);
                let mut out = up(&b, &v[4]);
                let (yt, wt) = (up(&b, &v[0]), up(&b, &v[5]));
                b.moe_combine(out.view_mut(), yt.view(), wt.view(), d);
                let mut dye = b.zeros(&[n * dim], Category::Activations);
                let mut dw = b.zeros(&[n], Category::Activations);
                b.moe_combine_backward(
                    dye.view_mut(),
                    dw.view_mut(),
                    up(&b, &v[2]).view(),
                    yt.view(),
                    wt.view(),
                    d,
                );
                vec![
                    down(&b, &xe),
                    down(&b, &dx),
                    down(&b, &out),
                    down(&b, &dye),
                    down(&b, &dw),
                ]
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

/// `warps`: query rows per forward block.
fn attention_case(d: ganymede_core::AttnDims, warps: usize, seed: u64) {
    use ganymede_core::{AttnGrads, AttnSaved, NnOps};
    let (nq, nk) = (
        d.batch * d.tq * d.heads * d.head_dim,
        d.batch * d.tk * d.kv_heads * d.head_dim,
    );
    let nl = d.batch * d.heads * d.tq;
    let mut rng = Rng::new(seed);
    let (q, k, v, dout) = (
        rng.vec(nq, 1.5),
        rng.vec(nk, 1.5),
        rng.vec(nk, 1.0),
        rng.vec(nq, 1.0),
    );
    let scale = (1.0 / (d.head_dim as f64).sqrt()) as f32;
    let b = cpu();
    let i = |x: usize| Arg::I32(x as i32);
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[q.clone(), k.clone(), v.clone(), dout.clone()]);
        // Outputs: out, lse, dq, dk, dv. The gradients sum over keys or queries: in f32 the
        // reduction floor; in bf16 they are bf16 (the CPU's backward then reads the bf16-rounded
        // out, as the device's does).
        let g = match st {
            St::F32 => st.tols_with_reduction()[3],
            St::Bf16 => BF16,
        };
        parity(
            &format!("{} {d:?}", st.name("attention")),
            &inputs,
            1,
            &[st.tols_with_reduction()[0], F32, g, g, g],
            |x| {
                let (mut qb, mut kb, mut vb, mut db) =
                    (st.buf(&x[0]), st.buf(&x[1]), st.buf(&x[2]), st.buf(&x[3]));
                let mut out = st.buf(&vec![f32::NAN; nq]);
                let (mut lse, mut delta) = (vec![f32::NAN; nl], vec![f32::NAN; nl]);
                let (mut dq, mut dk, mut dv) = (
                    st.buf(&vec![f32::NAN; nq]),
                    st.buf(&vec![f32::NAN; nk]),
                    st.buf(&vec![f32::NAN; nk]),
                );
                let dims = [i(d.tq), i(d.tk), i(d.heads), i(d.kv_heads), i(d.head_dim)];
                let (bt, h, kvh) = (d.batch as u32, d.heads as u32, d.kv_heads as u32);
                unsafe {
                    let mut a = vec![out.arg(), ptr(&mut lse), qb.arg(), kb.arg(), vb.arg()];
                    a.extend_from_slice(&dims);
                    a.push(scale.into());
                    let w = warps;
                    launch(
                        &st.name("attention_forward"),
                        cfg([d.tq.div_ceil(w) as u32, h, bt], 32 * w as u32),
                        &a,
                    );
                    launch(
                        &st.name("attention_backward_delta"),
                        cfg([(d.batch * d.tq * d.heads) as u32, 1, 1], 32),
                        &[
                            ptr(&mut delta),
                            db.arg(),
                            out.arg(),
                            i(d.tq),
                            i(d.heads),
                            i(d.head_dim),
                        ],
                    );
                    let mut a = vec![
                        dk.arg(),
                        dv.arg(),
                        db.arg(),
                        qb.arg(),
                        kb.arg(),
                        vb.arg(),
                        cptr(&lse),
                        cptr(&delta),
                    ];
                    a.extend_from_slice(&dims);
                    a.push(scale.into());
                    launch(
                        &st.name("attention_backward_dkdv"),
                        cfg([d.tk.div_ceil(16) as u32, kvh, bt], 128),
                        &a,
                    );
                    let mut a = vec![
                        dq.arg(),
                        db.arg(),
                        qb.arg(),
                        kb.arg(),
                        vb.arg(),
                        cptr(&lse),
                        cptr(&delta),
                    ];
                    a.extend_from_slice(&dims);
                    a.push(scale.into());
                    launch(
                        &st.name("attention_backward_dq"),
                        cfg([d.tq.div_ceil(8) as u32, h, bt], 128),
                        &a,
                    );
                }
                vec![out.read(), lse, dq.read(), dk.read(), dv.read()]
            },
            |x| {
                let (qt, kt, vt) = (up(&b, &x[0]), up(&b, &x[1]), up(&b, &x[2]));
                let mut out = b.zeros(&[nq], Category::Activations);
                let mut lse = b.zeros(&[nl], Category::Activations);
                b.attention_forward(
                    out.view_mut(),
                    lse.view_mut(),
                    qt.view(),
                    kt.view(),
                    vt.view(),
                    d,
                );
                let (mut dq, mut dk, mut dv) = (
                    b.zeros(&[nq], Category::Activations),
                    b.zeros(&[nk], Category::Activations),
                    b.zeros(&[nk], Category::Activations),
                );
                let saved_out = up(&b, &st.inputs(&[down(&b, &out)])[0]);
                b.attention_backward(
                    AttnGrads {
                        dq: dq.view_mut(),
                        dk: dk.view_mut(),
                        dv: dv.view_mut(),
                    },
                    up(&b, &x[3]).view(),
                    AttnSaved {
                        out: saved_out.view(),
                        q: qt.view(),
                        k: kt.view(),
                        v: vt.view(),
                        lse: lse.view(),
                    },
                    d,
                );
                vec![
                    down(&b, &out),
                    down(&b, &lse),
                    down(&b, &dq),
                    down(&b, &dk),
                    down(&b, &dv),
                ]
            },
        );
    }
}

#[test]
fn attention_gqa_with_a_key_prefix() {
    // tq < tk (queries at the end), two query heads per kv head, head_dim past one warp.
    attention_case(
        ganymede_core::AttnDims {
            batch: 2,
            tq: 13,
            tk: 37,
            heads: 4,
            kv_heads: 2,
            head_dim: 40,
        },
        4,
        13,
    );
}

#[test]
fn attention_square_multi_query() {
    attention_case(
        ganymede_core::AttnDims {
            batch: 1,
            tq: 45,
            tk: 45,
            heads: 3,
            kv_heads: 1,
            head_dim: 16,
        },
        16,
        14,
    );
}

#[test]
fn attention_at_the_largest_head_dim() {
    // head_dim 128 (the kernels' limit, Qwen3's size): every lane holds four output columns.
    attention_case(
        ganymede_core::AttnDims {
            batch: 1,
            tq: 21,
            tk: 40,
            heads: 2,
            kv_heads: 2,
            head_dim: 128,
        },
        8,
        15,
    );
}

/// Run by `a_broken_launch_precondition_traps` in a child process: attention past its
/// head_dim limit, which must trap (abort) rather than compute.
#[test]
#[ignore]
fn trap_child() {
    let (hd, n) = (129usize, 129usize);
    let (mut out, mut lse, x) = (vec![0f32; n], vec![0f32; 1], vec![0f32; n]);
    let i = |x: usize| Arg::I32(x as i32);
    unsafe {
        launch(
            "attention_forward_f32",
            cfg([1, 1, 1], 32),
            &[
                ptr(&mut out),
                ptr(&mut lse),
                cptr(&x),
                cptr(&x),
                cptr(&x),
                i(1),
                i(1),
                i(1),
                i(1),
                i(hd),
                1.0f32.into(),
            ],
        )
    };
}

#[test]
fn a_broken_launch_precondition_traps() {
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "trap_child", "--nocapture"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&child.stderr);
    assert!(!child.status.success(), "the launch did not fail");
    assert!(err.contains("a kernel trapped"), "{err}");
}

//! Every kernel's host build (kernels/*.cu through the shim) against the CPU backend, op by op,
//! on small shapes that are not multiples of the block size. Each check also runs the kernel on
//! one perturbed input and requires the comparison to fail, so a check cannot pass vacuously.
//!
//! The kernels run through the ops layer (`ganymede_cuda::ops`, here as `HostKernelBackend`),
//! which holds the launch logic a GPU runs too, at small launch sizes ([`SMALL`]) so that
//! grid-stride loops and multi-row blocks are exercised; only the kernels outside the seam
//! (dispatch's counting sort) and the shim's own checks launch directly.
//!
//! Tolerances: f32 kernels within 1e-5 relative (plus a small absolute floor for values near
//! zero, stated per test); bf16 kernels against the CPU in f32 on the same bf16-rounded inputs,
//! within twice what one bf16 rounding of the output allows (2^-7 relative: a rounding is up
//! to 2^-8, and the f32 work before it differs by a few ulps).

use ganymede_core::sample::Lcg;
use ganymede_core::{
    bf16, AuxGrad, Backend, Blas, Category, CpuBackend, DType, EmbedIds, Gemm, Ledger, Memory,
    NnOps, OptimOps, Tensor,
};
use ganymede_cuda::bounds::{set_bounds, Bounds};
use ganymede_cuda::host::{
    launch, set_copy_timing, set_schedule, Arg, CopyTiming, LaunchConfig, Schedule,
};
use ganymede_cuda::kernel_backend::{HostKernelBackend, KernelBackend};
use ganymede_cuda::launch::{HostLauncher, Launcher};
use ganymede_cuda::ops::{KernelOps, Tuning};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn cpu() -> CpuBackend {
    CpuBackend::new(Arc::new(Ledger::new()))
}
/// Grid-stride kernels in few small blocks, so every thread loops over several elements, and
/// row kernels in blocks of one warp, so rows wider than 32 loop.
const SMALL: Tuning = Tuning {
    ew_block: 64,
    ew_max_blocks: 3,
    attn_rows: 4,
    row_block_max: 32,
    attn_tc: false,
    attn_fused_dq: false,
    attn_wide_fwd: false,
    grouped_tc: false,
};
/// Launches from this thread run under the bounds check (`ganymede_cuda::bounds`): a kernel
/// that touches memory outside what it was given fails its test.
fn kernels(tuning: Tuning) -> HostKernelBackend {
    set_bounds(Bounds::Guarded);
    HostKernelBackend::host(cpu(), tuning)
}
fn up(b: &dyn Backend, x: &[f32]) -> Tensor {
    b.upload(x, &[x.len()], Category::Activations)
}
fn down(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    b.download(t.view())
}
/// A tensor's values as f32, whatever its dtype (bf16 widened exactly).
fn down_any(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    b.download(t.view())
}
fn set_f64(t: &mut Tensor, v: f64) {
    t.view_mut().host::<f64>()[0] = v;
}
fn zeros(b: &dyn Backend, n: usize) -> Tensor {
    b.zeros(&[n], Category::Activations)
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
    let mut rng = Lcg::new(1);
    let mut x: Vec<f32> = rng.values(1001, 3.0);
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
    let kb = kernels(SMALL);
    let n = x.len();
    let src = up(&kb, &x);
    let mut h = kb.zeros_of(&[n], DType::BF16, Category::Activations);
    kb.cast(h.view_mut(), src.view());
    assert_eq!(h.view().host_bf16(), &to_bf16(&x)[..], "f32 -> bf16");
    let mut back = zeros(&kb, n);
    kb.cast(back.view_mut(), h.view());
    let want = from_bf16(h.view().host_bf16());
    assert!(down(&kb, &back)
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    // Through the CPU backend's cast too (what the device must agree with).
    let b = cpu();
    let mut dst = b.zeros_of(&[n], DType::BF16, Category::Activations);
    b.cast(dst.view_mut(), up(&b, &x).view());
    assert_eq!(dst.view().host_bf16(), h.view().host_bf16());
}

#[test]
fn axpy_scale_add() {
    let mut rng = Lcg::new(2);
    let (y, x) = (rng.values(999, 1.0), rng.values(999, 1.0));
    let (b, kb) = (cpu(), kernels(SMALL));
    for st in [St::F32, St::Bf16] {
        let tol = [st.tols_with_reduction()[0]];
        let inputs = st.inputs(&[y.clone(), x.clone()]);
        // The same calls on both backends; the kernels' on tensors of the storage type.
        let axpy = |be: &dyn Backend, st: St, v: &[Vec<f32>]| {
            let mut y = st.up(be, &v[0]);
            be.axpy(y.view_mut(), 0.37, st.up(be, &v[1]).view());
            vec![down(be, &y)]
        };
        let scale = |be: &dyn Backend, st: St, v: &[Vec<f32>]| {
            let mut y = st.up(be, &v[0]);
            be.scale(y.view_mut(), -1.7);
            vec![down(be, &y)]
        };
        let add = |be: &dyn Backend, st: St, v: &[Vec<f32>]| {
            let mut y = st.up(be, &v[0]);
            be.add(y.view_mut(), st.up(be, &v[1]).view());
            vec![down(be, &y)]
        };
        let name = |op: &str| format!("{op}_{st:?}");
        parity(
            &name("axpy"),
            &inputs,
            1,
            &tol,
            |v| axpy(&kb, st, v),
            |v| axpy(&b, St::F32, v),
        );
        parity(
            &name("scale"),
            &inputs[..1],
            0,
            &tol,
            |v| scale(&kb, st, v),
            |v| scale(&b, St::F32, v),
        );
        parity(
            &name("add"),
            &inputs,
            1,
            &tol,
            |v| add(&kb, st, v),
            |v| add(&b, St::F32, v),
        );
    }
}

/// One array of an elementwise kernel: element bytes (2 bf16, 4 f32 or u32, 8 f64), and a
/// length of its own (sumsq's per-block partials) or None for the kernel's n.
#[derive(Clone, Copy)]
struct EwArray {
    bytes: usize,
    len: Option<usize>,
}
const A_F32: EwArray = EwArray {
    bytes: 4,
    len: None,
};
const A_BF16: EwArray = EwArray {
    bytes: 2,
    len: None,
};

/// Where an elementwise kernel's arrays start.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Placement {
    /// Every array at a 16-byte boundary: the 4-wide path.
    Aligned,
    /// Every array one element past one.
    AllShifted,
    /// Only the last array of length n shifted: one misaligned array is enough for the
    /// scalar path.
    LastShifted,
}

/// Runs `kernel` (arguments from `args(pointers, n)`) over arrays of `n` elements placed each
/// way; returns each placement's output bytes per array and its count of wide accesses.
fn ew_placements(
    kernel: &str,
    arrays: &[EwArray],
    n: usize,
    args: &dyn Fn(&[Arg], Arg) -> Vec<Arg>,
) -> Vec<(Placement, Vec<Vec<u8>>, u64)> {
    let last_n = arrays.iter().rposition(|a| a.len.is_none()).unwrap();
    let mut out = Vec::new();
    for placement in [
        Placement::Aligned,
        Placement::AllShifted,
        Placement::LastShifted,
    ] {
        let mut rng = Lcg::new(41);
        let mut bufs: Vec<(Vec<u8>, usize)> = arrays
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let len = a.len.unwrap_or(n);
                // The same contents at every placement: values in (0.01, 1), every storage
                // valid (v of AdamW takes a square root).
                let vals: Vec<f32> = rng
                    .values(len, 1.0)
                    .iter()
                    .map(|x| 0.01 + x.abs())
                    .collect();
                let bytes: Vec<u8> = match a.bytes {
                    2 => to_bf16(&vals)
                        .iter()
                        .flat_map(|h| h.to_le_bytes())
                        .collect(),
                    4 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    _ => vals
                        .iter()
                        .flat_map(|&x| f64::from(x).to_le_bytes())
                        .collect(),
                };
                let mut buf = vec![0u8; bytes.len() + 32];
                let mut at = (16 - buf.as_ptr() as usize % 16) % 16;
                let shifted = a.len.is_none()
                    && match placement {
                        Placement::Aligned => false,
                        Placement::AllShifted => true,
                        Placement::LastShifted => i == last_n,
                    };
                if shifted {
                    at += a.bytes;
                }
                buf[at..at + bytes.len()].copy_from_slice(&bytes);
                (buf, at)
            })
            .collect();
        let ptrs: Vec<Arg> = bufs
            .iter_mut()
            .map(|(b, at)| b[*at..].as_mut_ptr().into())
            .collect();
        let before = ganymede_cuda::host::wide_accesses();
        // Safety: every array holds its length from its pointer on.
        unsafe { launch(kernel, EW, &args(&ptrs, Arg::I64(n as i64))) };
        let wide = ganymede_cuda::host::wide_accesses() - before;
        let contents = bufs
            .iter()
            .zip(arrays)
            .map(|((b, at), a)| b[*at..*at + a.len.unwrap_or(n) * a.bytes].to_vec())
            .collect();
        out.push((placement, contents, wide));
    }
    out
}

/// The 4-wide and the scalar paths of every elementwise kernel: the same bytes out (sums of
/// squares: the same sum within rounding), and the wide path taken exactly where every array
/// is aligned.
#[test]
fn elementwise_kernels_are_bitwise_the_same_on_both_paths() {
    let f = |x: f32| Arg::F32(x);
    const NULL: Arg = Arg::Ptr(std::ptr::null_mut());
    let sq = EwArray {
        bytes: 8,
        len: Some(EW.grid[0] as usize),
    };
    type Args = Box<dyn Fn(&[Arg], Arg) -> Vec<Arg>>;
    let cases: Vec<(&str, Vec<EwArray>, Args)> = vec![
        ("zero_u32", vec![A_F32], Box::new(|p, n| vec![p[0], n])),
        (
            "cast_f32_to_bf16",
            vec![A_BF16, A_F32],
            Box::new(|p, n| vec![p[0], p[1], n]),
        ),
        (
            "cast_bf16_to_f32",
            vec![A_F32, A_BF16],
            Box::new(|p, n| vec![p[0], p[1], n]),
        ),
        (
            "axpy_f32",
            vec![A_F32, A_F32],
            Box::new(move |p, n| vec![p[0], f(0.37), p[1], n]),
        ),
        (
            "axpy_bf16",
            vec![A_BF16, A_BF16],
            Box::new(move |p, n| vec![p[0], f(-1.3), p[1], n]),
        ),
        (
            "scale_f32",
            vec![A_F32],
            Box::new(move |p, n| vec![p[0], f(-1.7), n]),
        ),
        (
            "scale_bf16",
            vec![A_BF16],
            Box::new(move |p, n| vec![p[0], f(0.3), n]),
        ),
        (
            "add_f32",
            vec![A_F32, A_F32],
            Box::new(|p, n| vec![p[0], p[1], n]),
        ),
        (
            "add_bf16",
            vec![A_BF16, A_BF16],
            Box::new(|p, n| vec![p[0], p[1], n]),
        ),
        (
            "sumsq_partial_f32",
            vec![sq, A_F32],
            Box::new(|p, n| vec![p[0], p[1], n]),
        ),
        (
            "sumsq_partial_bf16",
            vec![sq, A_BF16],
            Box::new(|p, n| vec![p[0], p[1], n]),
        ),
    ];
    let mut cases = cases;
    for (s, o, t) in [
        ("f32", A_F32, A_F32),
        ("bf16", A_BF16, A_BF16),
        ("f32_to_bf16", A_BF16, A_F32),
    ] {
        let fwd: Args = Box::new(|p, n| vec![p[0], p[1], p[2], n]);
        let bwd: Args = Box::new(|p, n| vec![p[0], p[1], p[2], p[3], p[4], n]);
        let (fname, bname) = (
            format!("swiglu_forward_{s}"),
            format!("swiglu_backward_{s}"),
        );
        cases.push((Box::leak(fname.into_boxed_str()), vec![o, t, t], fwd));
        cases.push((Box::leak(bname.into_boxed_str()), vec![o, o, t, t, t], bwd));
    }
    cases.push((
        "adamw_step_f32",
        vec![A_F32; 4],
        Box::new(move |p, n| {
            // The scale given (a null device scale), then the constants (a null device rate).
            let h = [0.9, 0.95, 0.1, 0.05, 0.999, 0.01, 1.2, 1e-8].map(f);
            [
                &p[..4],
                &[n, f(0.8), NULL][..],
                &h[..],
                &[NULL, Arg::F64(0.1)],
            ]
            .concat()
        }),
    ));
    cases.push((
        "adamw_step_f32_rounded",
        vec![A_F32, A_F32, A_F32, A_F32, A_BF16],
        Box::new(move |p, n| {
            let h = [0.9, 0.95, 0.1, 0.05, 0.999, 0.01, 1.2, 1e-8].map(f);
            [
                &p[..5],
                &[n, f(0.8), NULL][..],
                &h[..],
                &[NULL, Arg::F64(0.1)],
            ]
            .concat()
        }),
    ));
    cases.push((
        "nesterov_f32",
        vec![A_F32; 2],
        Box::new(move |p, n| vec![p[0], p[1], n, f(0.95), f(0.7), NULL]),
    ));
    cases.push((
        "scale_by_inv_norm_f32",
        vec![
            A_F32,
            EwArray {
                bytes: 8,
                len: Some(1),
            },
        ],
        Box::new(|p, n| vec![p[0], p[1], Arg::F64(1e-7), n]),
    ));
    cases.push((
        "decay_update_f32",
        vec![A_F32; 2],
        Box::new(move |p, n| {
            let rate = [NULL, Arg::F64(2.0), Arg::F64(0.1)];
            [&[p[0], p[1], n, f(0.02), f(0.999), NULL][..], &rate].concat()
        }),
    ));
    cases.push((
        "decay_update_f32_rounded",
        vec![A_F32, A_F32, A_BF16],
        Box::new(move |p, n| {
            let rate = [NULL, Arg::F64(2.0), Arg::F64(0.1)];
            [&[p[0], p[1], p[2], n, f(0.02), f(0.999), NULL][..], &rate].concat()
        }),
    ));
    // Every elementwise and optimizer kernel but the partials' final sums and the stack
    // kernels on a 2-D grid: frobenius_normalisation_of_a_stack holds those to the bits of
    // the per-matrix kernels checked here, at aligned and unaligned matrix sizes; and the
    // one-thread step_scale_f64 (step_scale_matches_the_host); and the multi-tensor sum of
    // squares, held to the per-tensor kernels' bits at aligned and unaligned tensors by
    // sumsq_of_many_tensors_in_two_launches, and multi-tensor AdamW, held to adamw_step_f32's
    // bits by adamw_over_many_tensors_in_one_launch. The update kernels' scale is given here (a
    // null device scale); optimizer_updates reads it from the device too.
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let elsewhere = [
        "sum_acc_f64",
        "sumsq_partial_multi_f32",
        "sum_acc_multi_f64",
        "adamw_step_multi_f32",
        "sum_rows_f64",
        "sumsq_partial_strided_f32",
        "scale_by_inv_norm_strided_f32",
        "scale_by_inv_norm_strided_f32_to_bf16",
        "step_scale_f64",
    ];
    for k in ganymede_cuda::host::kernel_names() {
        let file = ganymede_cuda::sources::file_of(&k).unwrap();
        if matches!(file, "elementwise.cu" | "optim.cu") && !elsewhere.contains(&k.as_str()) {
            assert!(names.contains(&k.as_str()), "{k} is not checked here");
        }
    }
    let n = 1003;
    for (name, arrays, args) in &cases {
        let runs = ew_placements(name, arrays, n, args.as_ref());
        let (_, want, wide) = &runs[0];
        assert!(*wide > 0, "{name}: aligned arrays took no wide access");
        for (placement, got, wide) in &runs[1..] {
            assert_eq!(*wide, 0, "{name}: {placement:?} took a wide access");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                if name.starts_with("sumsq_partial") && i == 0 {
                    let sum = |b: &[u8]| -> f64 {
                        b.chunks(8)
                            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                            .sum()
                    };
                    let (g, w) = (sum(g), sum(w));
                    assert!(
                        (g - w).abs() <= 1e-12 * w,
                        "{name}: {placement:?}: {g} vs {w}"
                    );
                } else {
                    assert!(g == w, "{name}: {placement:?}: array {i} differs");
                }
            }
        }
    }
}

/// `acc + Σ x²` through `be.sumsq_acc` (storage `st`), and `be.sumsq` (a host read) with it.
fn sumsq_with(be: &dyn Backend, st: St, x: &[f32], acc: f64) -> (f64, f64) {
    let t = st.up(be, x);
    let mut a = be.zeros_of(&[1], DType::F64, Category::Activations);
    set_f64(&mut a, acc);
    be.sumsq_acc(a.view_mut(), t.view());
    (be.download_f64(a.view())[0], be.sumsq(t.view()))
}

#[test]
fn sumsq_accumulates_in_f64() {
    let mut rng = Lcg::new(3);
    let x = rng.values(1237, 2.0);
    let (b, kb) = (cpu(), kernels(SMALL));
    let (want, want_read) = sumsq_with(&b, St::F32, &x, 0.25);
    let (got, got_read) = sumsq_with(&kb, St::F32, &x, 0.25);
    let err = ((got - want) / want).abs();
    println!("sumsq_acc (sumsq_partial_f32 + sum_acc_f64): rel err {err:.3e} (tol 1e-12)");
    assert!(err < 1e-12, "sumsq {got} vs {want}");
    assert!(
        ((got_read - want_read) / want_read).abs() < 1e-12,
        "sumsq read"
    );
    let mut bad = x.clone();
    bad[600] += 1e-3;
    let (got_bad, _) = sumsq_with(&kb, St::F32, &bad, 0.25);
    assert!(((got_bad - want) / want).abs() > 1e-12);

    // bf16 input: exactly the sum over the values the bf16 tensor holds.
    let xr = round_bf16(&x);
    let want: f64 = 0.25 + xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
    let (got, _) = sumsq_with(&kb, St::Bf16, &x, 0.25);
    let err = ((got - want) / want).abs();
    println!("sumsq_partial_bf16: rel err {err:.3e} (tol 1e-12)");
    assert!(err < 1e-12);
}

/// A step's gradient norm over many tensors in two launches (`sumsq_acc_many`): the bits of
/// `sumsq_acc` on each tensor in turn, over lengths below one block, ragged ones, ones that fill
/// the grid, views one element off alignment and an empty one; the CPU's sum within rounding.
/// The table of tensors is uploaded once: a second call with the same tensors uploads nothing
/// and launches with the same arguments. A bf16 tensor among them takes the per-tensor path.
#[test]
fn sumsq_of_many_tensors_in_two_launches() {
    use ganymede_cuda::launch::Recording;
    let mut rng = Lcg::new(17);
    let lens = [5usize, 64, 1237, 0, 4099, 3, 777, 190, 2, 1500];
    // Magnitudes far apart, so that adding the tensors' sums in another order rounds otherwise.
    let xs: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| rng.values(n + 1, 1.5 * 7f32.powi(i as i32 % 5)))
        .collect();
    set_bounds(Bounds::Guarded);
    let c = cpu();
    let (launcher, log) = Recording::new(HostLauncher::new(c.clone()));
    let kb = KernelBackend::new(KernelOps::with_tuning(launcher, SMALL), c);
    let b = cpu();
    // Every other tensor one element off its start (unaligned for the wide loads).
    let run = |be: &dyn Backend, many: bool| {
        let ts: Vec<Tensor> = xs.iter().map(|x| up(be, x)).collect();
        let views: Vec<ganymede_core::View> = ts
            .iter()
            .zip(&lens)
            .enumerate()
            .map(|(i, (t, &n))| t.view().slice(i % 2, n))
            .collect();
        let mut a = be.zeros_of(&[1], DType::F64, Category::Activations);
        let mut again = be.zeros_of(&[1], DType::F64, Category::Activations);
        set_f64(&mut a, 0.5);
        set_f64(&mut again, 0.5);
        match many {
            true => {
                be.sumsq_acc_many(a.view_mut(), &views);
                be.sumsq_acc_many(again.view_mut(), &views);
            }
            false => {
                for v in &views {
                    be.sumsq_acc(a.view_mut(), *v);
                    be.sumsq_acc(again.view_mut(), *v);
                }
            }
        }
        let (a, again) = (
            be.download_f64(a.view())[0],
            be.download_f64(again.view())[0],
        );
        assert_eq!(a.to_bits(), again.to_bits());
        a
    };
    log.take();
    let many = run(&kb, true);
    let launches = log.take();
    let names: Vec<&str> = launches.iter().map(|l| l.kernel).collect();
    assert_eq!(
        names,
        ["sumsq_partial_multi_f32", "sum_acc_multi_f64"].repeat(2),
        "two launches a call"
    );
    assert_eq!(launches[0], launches[2], "the same table, the same launch");
    let each = run(&kb, false);
    assert_eq!(many.to_bits(), each.to_bits(), "{many} vs {each}");
    let want = run(&b, false);
    assert!(((many - want) / want).abs() < 1e-12, "{many} vs {want}");
    // A bf16 tensor among them: each on its own, the same bits.
    let x16 = St::Bf16.up(&kb, &xs[2]);
    let f = up(&kb, &xs[1]);
    let mut a = kb.zeros_of(&[1], DType::F64, Category::Activations);
    let mut e = kb.zeros_of(&[1], DType::F64, Category::Activations);
    kb.sumsq_acc_many(a.view_mut(), &[f.view(), x16.view()]);
    kb.sumsq_acc(e.view_mut(), f.view());
    kb.sumsq_acc(e.view_mut(), x16.view());
    let (a, e) = (kb.download_f64(a.view())[0], kb.download_f64(e.view())[0]);
    assert_eq!(a.to_bits(), e.to_bits());
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

fn swiglu_run(be: &dyn Backend, st: St, v: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let n = v[0].len();
    let (g, u, d) = (st.up(be, &v[0]), st.up(be, &v[1]), st.up(be, &v[2]));
    let mut o = st.zeros(be, n);
    be.swiglu_forward(o.view_mut(), g.view(), u.view());
    let (mut dg, mut du) = (st.zeros(be, n), st.zeros(be, n));
    be.swiglu_backward(dg.view_mut(), du.view_mut(), d.view(), g.view(), u.view());
    vec![down(be, &o), down(be, &dg), down(be, &du)]
}

#[test]
fn swiglu_forward_backward() {
    let mut rng = Lcg::new(4);
    let n = 1111;
    let (g, u, d) = (rng.values(n, 4.0), rng.values(n, 2.0), rng.values(n, 1.0));
    let (b, kb) = (cpu(), kernels(SMALL));
    let reference = |v: &[Vec<f32>]| swiglu_run(&b, St::F32, v);
    parity(
        "swiglu_f32",
        &[g.clone(), u.clone(), d.clone()],
        0,
        &[F32],
        |v| swiglu_run(&kb, St::F32, v),
        reference,
    );
    // bf16 storage: the CPU in f32 on the same bf16 values.
    let rounded: Vec<Vec<f32>> = [g, u, d].iter().map(|v| round_bf16(v)).collect();
    parity(
        "swiglu_bf16",
        &rounded,
        0,
        &[BF16],
        |v| swiglu_run(&kb, St::Bf16, v),
        reference,
    );
}

/// SwiGLU on bf16 storage throughout (the gate and up a bf16 GEMM wrote, under bf16 compute):
/// on each backend, its f32 op on the widened inputs with every output rounded once, bit for
/// bit; the kernels against the CPU within bf16's rounding. 9,001 elements: three of the CPU's
/// element-wise chunks and pieces of 256, the last of neither a multiple of 8.
#[test]
fn bf16_swiglu_is_the_f32_op_on_widened_inputs_rounded_once() {
    let mut rng = Lcg::new(41);
    let n = 9001;
    let v: Vec<Vec<f32>> = [4.0, 2.0, 1.0]
        .iter()
        .map(|&s| round_bf16(&rng.values(n, s)))
        .collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (b, kb) = (cpu(), kernels(SMALL));
    for (name, be) in [("cpu", &b as &dyn Backend), ("kernels", &kb)] {
        let (h, f) = (swiglu_run(be, St::Bf16, &v), swiglu_run(be, St::F32, &v));
        for (o, (got, f32_out)) in h.iter().zip(&f).enumerate() {
            assert_eq!(bits(got), bits(&round_bf16(f32_out)), "{name}: output {o}");
        }
    }
    parity(
        "swiglu_bf16_storage",
        &v,
        1,
        &[BF16],
        |v| swiglu_run(&kb, St::Bf16, v),
        |v| swiglu_run(&b, St::Bf16, v),
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
    fn dtype(self) -> DType {
        match self {
            St::F32 => DType::F32,
            St::Bf16 => DType::BF16,
        }
    }
    /// A tensor of this storage holding `x` (rounded to nearest even into bf16).
    fn up(self, be: &dyn Backend, x: &[f32]) -> Tensor {
        let mut t = be.zeros_of(&[x.len()], self.dtype(), Category::Activations);
        be.write(t.view_mut(), x);
        t
    }
    fn zeros(self, be: &dyn Backend, n: usize) -> Tensor {
        be.zeros_of(&[n], self.dtype(), Category::Activations)
    }
    /// The inputs as this storage holds them.
    fn inputs(self, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
        match self {
            St::F32 => x.to_vec(),
            St::Bf16 => x.iter().map(|v| round_bf16(v)).collect(),
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

/// RMSNorm forward and backward on `be` (activations and the weight in storage `st`; rstd and
/// the weight gradient f32): [out, rstd, dx (+= onto v[3]), dw (+= onto dw0)].
fn rmsnorm_run(
    be: &dyn Backend,
    st: St,
    v: &[Vec<f32>],
    dw0: &[f32],
    dim: usize,
    eps: f32,
) -> Vec<Vec<f32>> {
    use ganymede_core::NormSaved;
    let rows = v[0].len() / dim;
    let (xt, wt) = (st.up(be, &v[0]), st.up(be, &v[1]));
    let mut out = st.zeros(be, rows * dim);
    let mut rstd = zeros(be, rows);
    be.rmsnorm_forward(
        out.view_mut(),
        rstd.view_mut(),
        xt.view(),
        wt.view(),
        dim,
        eps,
    );
    let (mut dx, mut dw) = (st.up(be, &v[3]), up(be, dw0));
    let saved = NormSaved {
        x: xt.view(),
        w: wt.view(),
        rstd: rstd.view(),
    };
    let dout = st.up(be, &v[2]);
    be.rmsnorm_backward(dx.view_mut(), dw.view_mut(), dout.view(), saved, dim);
    vec![
        down(be, &out),
        down(be, &rstd),
        down(be, &dx),
        down(be, &dw),
    ]
}

#[test]
fn rmsnorm_forward_backward() {
    on_both_row_paths(&[(100, true), (102, false)], rmsnorm_case);
}

fn rmsnorm_case(dim: usize) {
    let (rows, eps) = (150usize, 1e-6f32);
    let mut rng = Lcg::new(5);
    let x = rng.values(rows * dim, 2.0);
    let w: Vec<f32> = rng.values(dim, 0.5).iter().map(|v| 1.0 + v).collect();
    let dout = rng.values(rows * dim, 1.0);
    let dx0 = rng.values(rows * dim, 0.3);
    let dw0 = rng.values(dim, 0.3);
    let (b, kb) = (cpu(), kernels(SMALL));
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[x.clone(), w.clone(), dout.clone(), dx0.clone()]);
        parity(
            &st.name("rmsnorm"),
            &inputs,
            0,
            &st.tols_with_reduction(),
            |v| rmsnorm_run(&kb, st, v, &dw0, dim, eps),
            |v| rmsnorm_run(&b, St::F32, v, &dw0, dim, eps),
        );
    }
}

/// Head norm + RoPE forward and backward, as `rmsnorm_run`: [out, rstd, dx, dw (+= onto dw0)];
/// with `docs`, positions restarting at each row's document start.
fn head_norm_rope_run(
    be: &dyn Backend,
    st: St,
    v: &[Vec<f32>],
    dw0: &[f32],
    (d, docs): (ganymede_core::HeadRope, Option<&[u32]>),
) -> Vec<Vec<f32>> {
    use ganymede_core::NormSaved;
    let n = v[0].len();
    let rows = n / (d.heads * d.head_dim);
    let (xt, wt) = (st.up(be, &v[0]), st.up(be, &v[1]));
    let mut out = st.zeros(be, n);
    let mut rstd = zeros(be, rows * d.heads);
    let docs = docs.map(|x| be.upload_u32(x, &[x.len()], Category::Activations));
    let (ov, rv, xv, wv) = (out.view_mut(), rstd.view_mut(), xt.view(), wt.view());
    match &docs {
        Some(t) => be.head_norm_rope_forward_docs(ov, rv, xv, wv, t.view(), d),
        None => be.head_norm_rope_forward(ov, rv, xv, wv, d),
    }
    let mut dx = st.up(be, &vec![f32::NAN; n]);
    let mut dw = up(be, dw0);
    let saved = NormSaved {
        x: xt.view(),
        w: wt.view(),
        rstd: rstd.view(),
    };
    let dout = st.up(be, &v[2]);
    let (dxv, dwv) = (dx.view_mut(), dw.view_mut());
    match &docs {
        Some(t) => be.head_norm_rope_backward_docs(dxv, dwv, dout.view(), saved, t.view(), d),
        None => be.head_norm_rope_backward(dxv, dwv, dout.view(), saved, d),
    }
    vec![
        down(be, &out),
        down(be, &rstd),
        down(be, &dx),
        down(be, &dw),
    ]
}

#[test]
fn head_norm_rope_forward_backward() {
    head_norm_rope_case(false);
}

#[test]
fn head_norm_rope_restarting_at_documents() {
    head_norm_rope_case(true);
}

/// Each row's document start in its sequence of `seq`: documents of 1 to `max` rows, at random.
fn row_doc_starts(rows: usize, seq: usize, max: usize, seed: u64) -> Vec<u32> {
    let mut rng = Lcg::new(seed);
    let mut out = Vec::with_capacity(rows);
    let (mut start, mut left) = (0, 0);
    for r in 0..rows {
        if r % seq == 0 || left == 0 {
            start = r % seq;
            left = 1 + rng.below(max) as usize;
        }
        out.push(start as u32);
        left -= 1;
    }
    out
}

/// `docs`: positions restart at random document starts (the `_doc_` kernels).
fn head_norm_rope_case(docs: bool) {
    let d = ganymede_core::HeadRope {
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
    let mut rng = Lcg::new(6);
    let x = rng.values(n, 2.0);
    let w: Vec<f32> = rng
        .values(d.head_dim, 0.5)
        .iter()
        .map(|v| 1.0 + v)
        .collect();
    let dout = rng.values(n, 1.0);
    let dw0 = rng.values(d.head_dim, 0.3);
    let starts = docs.then(|| row_doc_starts(rows, d.seq, 5, 16));
    let dd = (d, starts.as_deref());
    // A warp per head row: one a block, and four (450 head rows: the last block part-filled).
    let four = Tuning {
        row_block_max: 128,
        ..SMALL
    };
    for (st, tuning) in [(St::F32, SMALL), (St::Bf16, SMALL), (St::F32, four)] {
        let (b, kb) = (cpu(), kernels(tuning));
        let inputs = st.inputs(&[x.clone(), w.clone(), dout.clone()]);
        parity(
            &st.name("head_norm_rope"),
            &inputs,
            0,
            &st.tols_with_reduction(),
            |v| head_norm_rope_run(&kb, st, v, &dw0, dd),
            |v| head_norm_rope_run(&b, St::F32, v, &dw0, dd),
        );
    }
}

/// The head norm with a bf16 side on f32 rows, as bf16 attention meets it: the forward
/// writing bf16 equals the f32 forward cast, and the backward reading a bf16 gradient equals
/// it reading that gradient widened, bit for bit, on the CPU and through the kernels (the
/// `_f32_bf16` ones), with and without document starts.
#[test]
fn head_norm_rope_with_bf16_attention_rows_equals_the_casts() {
    use ganymede_core::{HeadRope, NormSaved, View, ViewMut};
    let d = HeadRope {
        heads: 3,
        head_dim: 70,
        seq: 13,
        pos0: 0,
        theta: 10_000.0,
        eps: 1e-6,
    };
    let rows = 52usize;
    let n = rows * d.heads * d.head_dim;
    let mut rng = Lcg::new(61);
    let (x, dout) = (rng.values(n, 2.0), rng.values(n, 1.0));
    let w: Vec<f32> = rng
        .values(d.head_dim, 0.5)
        .iter()
        .map(|v| 1.0 + v)
        .collect();
    let starts = row_doc_starts(rows, d.seq, 5, 17);
    let kb = kernels(SMALL);
    for be in [&cpu() as &dyn Backend, &kb] {
        for docs in [None, Some(&starts)] {
            let docs = docs.map(|s| be.upload_u32(s, &[rows], Category::Activations));
            let (xt, wt) = (up(be, &x), up(be, &w));
            let bf = |len| be.zeros_of(&[len], DType::BF16, Category::Activations);
            let fwd = |out: ViewMut, rstd: ViewMut| match &docs {
                Some(t) => {
                    be.head_norm_rope_forward_docs(out, rstd, xt.view(), wt.view(), t.view(), d)
                }
                None => be.head_norm_rope_forward(out, rstd, xt.view(), wt.view(), d),
            };
            let (mut o32, mut o16, mut cast) = (zeros(be, n), bf(n), bf(n));
            let (mut r1, mut r2) = (zeros(be, rows * d.heads), zeros(be, rows * d.heads));
            fwd(o32.view_mut(), r1.view_mut());
            fwd(o16.view_mut(), r2.view_mut());
            be.cast(cast.view_mut(), o32.view());
            let what = format!("{:?}, docs {}", be.device(), docs.is_some());
            assert_eq!(
                be.download(o16.view()),
                be.download(cast.view()),
                "forward, {what}"
            );
            assert_eq!(down(be, &r1), down(be, &r2), "rstd, {what}");
            // The gradient as bf16, and the same values widened.
            let mut g16 = bf(n);
            be.cast(g16.view_mut(), up(be, &dout).view());
            let mut g32 = zeros(be, n);
            be.cast(g32.view_mut(), g16.view());
            let bwd = |g: View| {
                let (mut dx, mut dw) = (zeros(be, n), up(be, &vec![0.25; d.head_dim]));
                let saved = NormSaved {
                    x: xt.view(),
                    w: wt.view(),
                    rstd: r1.view(),
                };
                match &docs {
                    Some(t) => be.head_norm_rope_backward_docs(
                        dx.view_mut(),
                        dw.view_mut(),
                        g,
                        saved,
                        t.view(),
                        d,
                    ),
                    None => be.head_norm_rope_backward(dx.view_mut(), dw.view_mut(), g, saved, d),
                }
                (down(be, &dx), down(be, &dw))
            };
            let want = bwd(g32.view());
            assert_eq!(bwd(g16.view()), want, "backward, {what}");
            assert_ne!(
                bwd(up(be, &dout).view()),
                want,
                "{what}: the widening made no difference"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding

/// Ids and their grouping uploaded as the batch builder does; `e(&t)` views them.
struct Grouped {
    ids: Tensor,
    order: Tensor,
    seg_start: Tensor,
    seg_id: Tensor,
    segments: usize,
}

impl Grouped {
    fn up(be: &dyn Backend, ids: &[u32]) -> Self {
        let (order, seg_start, seg_id) = ganymede_core::embedding_segments(ids);
        let u = |x: &[u32]| be.upload_u32(x, &[x.len()], Category::Activations);
        Grouped {
            ids: u(ids),
            order: u(&order),
            seg_start: u(&seg_start),
            seg_id: u(&seg_id),
            segments: seg_id.len(),
        }
    }
    fn e(&self) -> EmbedIds<'_> {
        EmbedIds {
            ids: self.ids.view(),
            order: self.order.view(),
            seg_start: self.seg_start.view(),
            seg_id: self.seg_id.view(),
            segments: self.segments,
        }
    }
}

#[test]
fn embedding_forward_backward() {
    let (rows, vocab, dim) = (57usize, 23usize, 70usize);
    let mut rng = Lcg::new(7);
    // Ids 1..vocab-2 only: 0 and the last two never occur (their rows must stay as they were).
    let ids: Vec<u32> = (0..rows).map(|_| 1 + rng.below(vocab - 3)).collect();
    let (_, _, seg_id) = ganymede_core::embedding_segments(&ids);
    assert!(seg_id.len() < rows, "the test wants repeated ids");
    assert!(seg_id.len() < vocab - 3 + 1 && !seg_id.contains(&0));
    let wte = rng.values(vocab * dim, 1.0);
    let dout = rng.values(rows * dim, 1.0);
    let dwte0 = rng.values(vocab * dim, 0.3);
    let (b, kb) = (cpu(), kernels(SMALL));
    // wte and dout in storage st, dwte f32.
    let run = |be: &dyn Backend, st: St, v: &[Vec<f32>]| {
        let mut out = st.up(be, &vec![f32::NAN; rows * dim]);
        let g = Grouped::up(be, &ids);
        be.embedding_forward(out.view_mut(), st.up(be, &v[0]).view(), g.ids.view(), dim);
        let mut dwte = up(be, &dwte0);
        be.embedding_backward(dwte.view_mut(), st.up(be, &v[1]).view(), g.e(), dim);
        let dwte = down(be, &dwte);
        for id in [0, vocab - 2, vocab - 1] {
            let r = id * dim..(id + 1) * dim;
            assert_eq!(dwte[r.clone()], dwte0[r], "row {id} has no token");
        }
        vec![down(be, &out), dwte]
    };
    // A bf16 table widened into f32 rows (a bf16 weight under bf16 compute): exactly the
    // table's values.
    let wte16 = bf16::from_f32_slice(&wte);
    let kd: &dyn Backend = &kb;
    let mut t = kd.zeros_of(&[vocab * dim], DType::BF16, Category::Params);
    kd.write(t.view_mut(), &wte);
    let mut out = kd.zeros(&[rows * dim], Category::Activations);
    let g = Grouped::up(kd, &ids);
    kd.embedding_forward(out.view_mut(), t.view(), g.ids.view(), dim);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            let r = id as usize * dim..(id as usize + 1) * dim;
            wte16[r].iter().map(|&h| bf16::to_f32(h))
        })
        .collect();
    assert_eq!(down(kd, &out), want, "embedding from a bf16 table");
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[wte.clone(), dout.clone()]);
        parity(
            &st.name("embedding"),
            &inputs,
            0,
            &[st.tols_with_reduction()[0], F32],
            |v| run(&kb, st, v),
            |v| run(&b, St::F32, v),
        );
    }
}

#[test]
fn embedding_backward_long_segments_add_in_token_order() {
    // Byte ids give a few ids thousands of rows: the kernel reads 8 rows at a time before adding
    // them. Segments of 29 rows (three groups of 8 and a tail of 5), 8 (three of them: one
    // group, no tail), 7 (a tail only) and 1, interleaved, over columns that are not a
    // multiple of the block: the CPU backend's sum, bit for bit.
    let (vocab, dim) = (6usize, 70usize);
    let mut ids: Vec<u32> = (0..48).map(|t| [3, 1, 3, 5, 3, 0][t % 6]).collect();
    ids.extend([3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 4, 4, 2]);
    let count = |id| ids.iter().filter(|&&x| x == id).count();
    assert_eq!((0..5).map(count).collect::<Vec<_>>(), [8, 8, 1, 29, 7]);
    let mut rng = Lcg::new(11);
    let dout = rng.values(ids.len() * dim, 1.0);
    let kb = kernels(SMALL);
    let g = Grouped::up(&kb, &ids);
    let mut dwte = up(&kb, &rng.values(vocab * dim, 0.5));
    let start = down(&kb, &dwte);
    let dout_t = up(&kb, &dout);
    be_embedding_backward(&kb, &mut dwte, &dout_t, &g, dim);
    // The CPU backend on the same start.
    let b = cpu();
    let gb = Grouped::up(&b, &ids);
    let mut want = up(&b, &start);
    be_embedding_backward(&b, &mut want, &up(&b, &dout), &gb, dim);
    assert_eq!(down(&kb, &dwte), down(&b, &want));
    // And that sum is the token-order one (not merely the same on both sides).
    let col = 69;
    let mut acc = start[3 * dim + col];
    for (t, _) in ids.iter().enumerate().filter(|(_, &x)| x == 3) {
        acc += dout[t * dim + col];
    }
    assert_eq!(down(&kb, &dwte)[3 * dim + col].to_bits(), acc.to_bits());
}

/// The host launcher, counting the op layer's transfers between host and device memory.
#[derive(Clone)]
struct CountingLauncher {
    inner: HostLauncher,
    downloads: Arc<AtomicUsize>,
    uploads: Arc<AtomicUsize>,
}

impl Launcher for CountingLauncher {
    fn addr(&self, v: ganymede_core::View) -> *mut c_void {
        self.inner.addr(v)
    }
    fn addr_mut(&self, v: ganymede_core::ViewMut) -> *mut c_void {
        self.inner.addr_mut(v)
    }
    unsafe fn launch(&self, k: ganymede_cuda::kernel::Kernel, cfg: LaunchConfig, args: &[Arg]) {
        self.inner.launch(k, cfg, args)
    }
    fn alloc_scratch(&self, bytes: usize) -> Tensor {
        self.inner.alloc_scratch(bytes)
    }
    unsafe fn upload(&self, dst: *mut c_void, src: &[u8]) {
        self.uploads.fetch_add(1, Ordering::SeqCst);
        self.inner.upload(dst, src)
    }
    unsafe fn download(&self, dst: &mut [u8], src: *mut c_void) {
        self.downloads.fetch_add(1, Ordering::SeqCst);
        self.inner.download(dst, src)
    }
    unsafe fn mark(&self, addr: *mut c_void, bytes: usize) {
        self.inner.mark(addr, bytes)
    }
}

#[test]
fn embedding_backward_moves_nothing_between_host_and_device() {
    // Reading the ids back would stall the GPU's pipeline every step; the grouping comes with
    // the batch instead. Counted where the op layer moves data (the launcher).
    let cpu = cpu();
    set_bounds(Bounds::Guarded);
    let l = CountingLauncher {
        inner: HostLauncher::new(cpu.clone()),
        downloads: Arc::default(),
        uploads: Arc::default(),
    };
    let kb = KernelBackend::new(KernelOps::with_tuning(l.clone(), SMALL), cpu);
    let (rows, vocab, dim) = (40usize, 9usize, 16usize);
    let mut rng = Lcg::new(3);
    let ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab)).collect();
    let g = Grouped::up(&kb, &ids);
    let dout = up(&kb, &rng.values(rows * dim, 1.0));
    let mut dwte = zeros(&kb, vocab * dim);
    be_embedding_backward(&kb, &mut dwte, &dout, &g, dim);
    assert_eq!(
        l.downloads.load(Ordering::SeqCst),
        0,
        "device-to-host reads"
    );
    assert_eq!(l.uploads.load(Ordering::SeqCst), 0, "host-to-device writes");
    // And it did the work: the CPU backend's result.
    let b = cpu_backend_result(&ids, &down(&kb, &dout), vocab, dim);
    assert_eq!(down(&kb, &dwte), b);
}

fn be_embedding_backward(
    be: &dyn Backend,
    dwte: &mut Tensor,
    dout: &Tensor,
    g: &Grouped,
    dim: usize,
) {
    be.embedding_backward(dwte.view_mut(), dout.view(), g.e(), dim);
}

fn cpu_backend_result(ids: &[u32], dout: &[f32], vocab: usize, dim: usize) -> Vec<f32> {
    let b = cpu();
    let g = Grouped::up(&b, ids);
    let mut dwte = zeros(&b, vocab * dim);
    let dout = up(&b, dout);
    be_embedding_backward(&b, &mut dwte, &dout, &g, dim);
    down(&b, &dwte)
}

// ---------------------------------------------------------------------------------------------
// Optimizers

#[test]
fn optimizer_updates() {
    use ganymede_core::AdamWStep;
    let n = 1001usize;
    let mut rng = Lcg::new(8);
    let p = rng.values(n, 1.0);
    let m = rng.values(n, 0.1);
    let v: Vec<f32> = rng.values(n, 0.01).iter().map(|x| x.abs()).collect();
    let g = rng.values(n, 0.5);
    let (b, kb) = (cpu(), kernels(SMALL));
    let h = AdamWStep::at_step(1e-2, (0.9, 0.95), 1e-8, 0.1, 3);
    // Unscaled, and with a clip coefficient folded in; the factor given by the host, and read
    // by the kernels from device memory.
    for gs in [1.0f32, 0.37] {
        for on_device in [false, true] {
            optimizer_updates_at(&b, &kb, [&p, &m, &v, &g], h, (gs, on_device));
        }
    }
}

/// The step's scale worked out on the device (`step_scale_f64`): clipping's coefficient, bit
/// for bit the host's [`step_scale_value`] and the CPU backend's, 1 where the norm is within
/// bounds or clipping is off, NaN where any figure is not finite.
#[test]
fn step_scale_matches_the_host() {
    use ganymede_core::step_scale_value;
    let (b, kb) = (cpu(), kernels(SMALL));
    let cases: [(&[f64], f64); 8] = [
        (&[4.0], 1.0),
        (&[0.25], 1.0),
        (&[1234.5678, 3.0, 7.0], 1.0),
        (&[1234.5678], 0.0),
        (&[0.0, 0.0], 1.0),
        (&[f64::INFINITY, 1.0], 1.0),
        (&[4.0, f64::NAN], 1.0),
        (&[4.0, 1.0, f64::NEG_INFINITY], 0.0),
    ];
    for (sums, max_norm) in cases {
        let want = step_scale_value(sums, max_norm);
        for be in [&b as &dyn Backend, &kb] {
            let mut t = be.zeros_of(&[sums.len()], DType::F64, Category::Activations);
            be.write_f64(t.view_mut(), sums);
            let mut s = be.zeros_of(&[1], DType::F64, Category::Activations);
            be.step_scale(s.view_mut(), t.view(), max_norm);
            let got = be.download_f64(s.view())[0];
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{sums:?}, max {max_norm}: {got} against {want}"
            );
        }
    }
    // The closed form where it clips: 1 / (2 + 1e-6) in f32.
    assert_eq!(
        step_scale_value(&[4.0], 1.0),
        f64::from((1.0 / 2.000001f64) as f32)
    );
    assert_eq!(step_scale_value(&[0.25], 1.0), 1.0);
}

/// The kernels work out the step's constants from the learning rate and bias corrections in
/// device memory (`DeviceRate`) to the bits the host passes without it, over learning rates,
/// step counts, weight decays and update scales (taking bc1 for bc2, or wd for the update
/// scale, fails it); and the CPU backend refuses a device rate that is not its host values.
#[test]
fn a_device_rate_gives_the_hosts_constants_bit_for_bit() {
    use ganymede_core::{AdamWStep, DecayStep, DeviceRate, GradScale};
    let n = 257usize;
    let mut rng = Lcg::new(31);
    let x: Vec<Vec<f32>> = (0..4).map(|_| rng.values(n, 0.5)).collect();
    let v: Vec<f32> = x[2].iter().map(|x| x.abs()).collect();
    let kb = kernels(SMALL);
    let be: &dyn Backend = &kb;
    let mut cases = 0;
    for (i, t) in [1, 2, 3, 7, 50, 999, 12345].into_iter().enumerate() {
        for (lr, wd, scale) in [(3e-4, 0.1, 1.3), (1.7e-2, 0.013, 0.2 * 45f64.sqrt())] {
            let lr = lr * (1.0 + i as f64 / 7.0);
            let h = AdamWStep::at_step(lr, (0.9, 0.95), 1e-8, wd, t);
            let mut rt = be.zeros_of(&[3], DType::F64, Category::Activations);
            be.write_f64(rt.view_mut(), &h.rate_values());
            let run = |rate: Option<DeviceRate>| {
                let (mut p, mut m, mut vt) = (up(be, &x[0]), up(be, &x[1]), up(be, &v));
                let h = AdamWStep { rate, ..h };
                let (pv, mv, vv) = (p.view_mut(), m.view_mut(), vt.view_mut());
                be.adamw_step(pv, mv, vv, up(be, &x[3]).view(), &h, None);
                let mut q = up(be, &x[0]);
                let d = DecayStep {
                    lr,
                    scale,
                    weight_decay: wd,
                    rate,
                    gate: GradScale::Host(1.0),
                };
                be.decay_update(q.view_mut(), up(be, &x[1]).view(), &d, None);
                [down(be, &p), down(be, &m), down(be, &vt), down(be, &q)]
            };
            let (host, dev) = (run(None), run(Some(DeviceRate::new(rt.view()))));
            for (k, (a, b)) in host.iter().zip(&dev).enumerate() {
                let differ = a.iter().zip(b).filter(|(a, b)| a.to_bits() != b.to_bits());
                let differ = differ.count();
                assert_eq!(
                    differ, 0,
                    "output {k}, lr {lr}, t {t}, wd {wd}, scale {scale}"
                );
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 14);
    // The CPU reads its host values and holds the device's to them.
    let b = cpu();
    let h = AdamWStep::at_step(1e-3, (0.9, 0.95), 1e-8, 0.1, 4);
    let mut rt = b.zeros_of(&[3], DType::F64, Category::Activations);
    b.write_f64(rt.view_mut(), &[1e-3, 0.5, 0.5]);
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (mut p, mut m, mut vt) = (up(&b, &x[0]), up(&b, &x[1]), up(&b, &v));
        let h = AdamWStep {
            rate: Some(DeviceRate::new(rt.view())),
            ..h
        };
        let (pv, mv, vv) = (p.view_mut(), m.view_mut(), vt.view_mut());
        b.adamw_step(pv, mv, vv, up(&b, &x[3]).view(), &h, None);
    }));
    assert!(
        e.is_err(),
        "the CPU took a device rate other than its host values"
    );
}

/// AdamW over many tensors in one launch (`adamw_step_many`, a step's AdamW parameters): the
/// bits of `adamw_step` on each, over lengths below one block, ragged ones and ones that fill
/// the grid, views one element off alignment, weight decay 0 and not, a compute copy on some,
/// with the constants from the host and from device memory (the rate and the gradient scale).
/// The table of tensors is uploaded once: the next step launches with the same arguments.
#[test]
fn adamw_over_many_tensors_in_one_launch() {
    use ganymede_core::{AdamWStep, AdamWTensor, DeviceRate, GradScale};
    use ganymede_cuda::launch::Recording;
    let mut rng = Lcg::new(23);
    let lens = [3usize, 64, 1237, 0, 4099, 190, 2];
    let xs: Vec<[Vec<f32>; 4]> = lens
        .iter()
        .map(|&n| {
            let v: Vec<f32> = rng.values(n + 1, 0.01).iter().map(|x| x.abs()).collect();
            [
                rng.values(n + 1, 1.0),
                rng.values(n + 1, 0.1),
                v,
                rng.values(n + 1, 0.5),
            ]
        })
        .collect();
    set_bounds(Bounds::Guarded);
    let c = cpu();
    let (launcher, log) = Recording::new(HostLauncher::new(c.clone()));
    let kb = KernelBackend::new(KernelOps::with_tuning(launcher, SMALL), c);
    let be: &dyn Backend = &kb;
    for on_device in [false, true] {
        // Two steps, so that the second's launch can be held to the first's.
        let mut state: Vec<[Tensor; 5]> = xs
            .iter()
            .map(|x| {
                let r = be.zeros_of(&[x[0].len()], DType::BF16, Category::Activations);
                [
                    up(be, &x[0]),
                    up(be, &x[1]),
                    up(be, &x[2]),
                    up(be, &x[3]),
                    r,
                ]
            })
            .collect();
        let mut each = state
            .iter()
            .map(|t| t.iter().map(|t| down_any(be, t)).collect::<Vec<_>>())
            .collect::<Vec<_>>();
        let mut launches = vec![];
        // The step's scalars in device memory, at one address for both steps (as a trainer's).
        let mut rt = be.zeros_of(&[3], DType::F64, Category::Activations);
        let mut gs = be.zeros_of(&[1], DType::F64, Category::Activations);
        for t in [3, 4] {
            let h = AdamWStep::at_step(1e-2 + t as f64 * 1e-4, (0.9, 0.95), 1e-8, 0.0, t);
            be.write_f64(rt.view_mut(), &h.rate_values());
            be.write_f64(gs.view_mut(), &[0.75]);
            let h = match on_device {
                true => AdamWStep {
                    grad_scale: GradScale::Device(gs.view()),
                    rate: Some(DeviceRate::new(rt.view())),
                    ..h
                },
                false => AdamWStep {
                    grad_scale: GradScale::Host(0.75),
                    ..h
                },
            };
            let wd = |i: usize| if i % 3 == 1 { 0.0 } else { 0.1 };
            // Every other tensor one element off its start; a compute copy on every third.
            let ts = state
                .iter_mut()
                .zip(&lens)
                .enumerate()
                .map(|(i, ([p, m, v, g, r], &n))| {
                    let o = i % 2;
                    AdamWTensor {
                        param: p.view_mut().slice(o, n),
                        m: m.view_mut().slice(o, n),
                        v: v.view_mut().slice(o, n),
                        grad: g.view().slice(o, n),
                        rounded: (i % 3 == 0).then(|| r.view_mut().slice(o, n)),
                        weight_decay: wd(i),
                    }
                })
                .collect();
            log.take();
            be.adamw_step_many(ts, &h);
            launches.push(log.take());
            // The same, tensor by tensor, on copies of the state before this step.
            let mut one: Vec<[Tensor; 5]> = each
                .iter()
                .map(|x| {
                    let mut r = be.zeros_of(&[x[0].len()], DType::BF16, Category::Activations);
                    be.write(r.view_mut(), &x[4]);
                    [
                        up(be, &x[0]),
                        up(be, &x[1]),
                        up(be, &x[2]),
                        up(be, &x[3]),
                        r,
                    ]
                })
                .collect();
            for (i, ([p, m, v, g, r], &n)) in one.iter_mut().zip(&lens).enumerate() {
                let o = i % 2;
                let h = AdamWStep {
                    weight_decay: wd(i),
                    ..h
                };
                let r = (i % 3 == 0).then(|| r.view_mut().slice(o, n));
                let (pv, mv, vv) = (p.view_mut(), m.view_mut(), v.view_mut());
                let (pv, mv, vv) = (pv.slice(o, n), mv.slice(o, n), vv.slice(o, n));
                be.adamw_step(pv, mv, vv, g.view().slice(o, n), &h, r);
            }
            let now: Vec<Vec<Vec<f32>>> = state
                .iter()
                .map(|t| t.iter().map(|t| down_any(be, t)).collect())
                .collect();
            let want: Vec<Vec<Vec<f32>>> = one
                .iter()
                .map(|t| t.iter().map(|t| down_any(be, t)).collect())
                .collect();
            for (i, (a, b)) in now.iter().zip(&want).enumerate() {
                for (k, (a, b)) in a.iter().zip(b).enumerate() {
                    let differ = a.iter().zip(b).filter(|(a, b)| a.to_bits() != b.to_bits());
                    let differ = differ.count();
                    assert_eq!(
                        differ, 0,
                        "step {t}, device {on_device}: tensor {i}, array {k}"
                    );
                }
            }
            each = now;
        }
        let names: Vec<&str> = launches.iter().flatten().map(|l| l.kernel).collect();
        assert_eq!(names, ["adamw_step_multi_f32"; 2], "one launch a step");
        assert_eq!(
            launches[0] == launches[1],
            on_device,
            "the same launch at each step exactly when the constants are in device memory"
        );
    }
}

/// A NaN device scale (a gradient norm that is not finite) stops every update kernel: the
/// weights, their state and their rounded copies are left as they were, on the kernels and on
/// the CPU backend alike.
#[test]
fn a_nan_device_scale_writes_nothing() {
    use ganymede_core::{AdamWStep, DecayStep, GradScale};
    let n = 300usize;
    let mut rng = Lcg::new(9);
    let x: Vec<Vec<f32>> = (0..4).map(|_| rng.values(n, 0.5)).collect();
    let v: Vec<f32> = x[2].iter().map(|x| x.abs()).collect();
    for be in [&cpu() as &dyn Backend, &kernels(SMALL)] {
        let mut s = be.zeros_of(&[1], DType::F64, Category::Activations);
        be.write_f64(s.view_mut(), &[f64::NAN]);
        let stop = GradScale::Device(s.view());
        let (mut p, mut m, mut vt) = (up(be, &x[0]), up(be, &x[1]), up(be, &v));
        let mut g = up(be, &x[3]);
        let mut r = be.zeros_of(&[n], DType::BF16, Category::Activations);
        let r0 = r.view().host_bf16().to_vec();
        let h = AdamWStep {
            grad_scale: stop,
            ..AdamWStep::at_step(1e-2, (0.9, 0.95), 1e-8, 0.1, 3)
        };
        let (pv, mv, vv) = (p.view_mut(), m.view_mut(), vt.view_mut());
        be.adamw_step(pv, mv, vv, g.view(), &h, Some(r.view_mut()));
        be.nesterov_momentum(m.view_mut(), g.view_mut(), 0.95, stop);
        let u = up(be, &x[1]);
        let d = DecayStep {
            lr: 0.02,
            scale: 1.0,
            weight_decay: 0.05,
            rate: None,
            gate: stop,
        };
        be.decay_update(p.view_mut(), u.view(), &d, Some(r.view_mut()));
        assert_eq!(down(be, &p), x[0], "the weights");
        assert_eq!(down(be, &m), x[1], "the first moment / momentum");
        assert_eq!(down(be, &vt), v, "the second moment");
        assert_eq!(down(be, &g), x[3], "the gradient");
        assert_eq!(r.view().host_bf16(), &r0[..], "the rounded copy");
    }
}

/// Newton–Schulz of a stack normalises each matrix by its own norm in three launches: the bits
/// of normalising the matrices one by one with the kernels, and the CPU backend's values; a zero
/// matrix stays zero and its neighbours are untouched by it.
#[test]
fn frobenius_normalisation_of_a_stack() {
    let (b, kb) = (cpu(), kernels(SMALL));
    let mut rng = Lcg::new(21);
    for (count, n) in [(1usize, 1001usize), (5, 63), (3, 96 * 160), (7, 4)] {
        let mut x = rng.values(count * n, 0.8);
        // A zero matrix among the others.
        if count > 2 {
            x[n..2 * n].fill(0.0);
        }
        let strided = |be: &dyn Backend| {
            let mut t = up(be, &x);
            be.normalize_frobenius_strided(t.view_mut(), count, 1e-7);
            down(be, &t)
        };
        let one_by_one = |be: &dyn Backend| {
            let mut t = up(be, &x);
            for i in 0..count {
                be.normalize_frobenius(t.view_mut().slice(i * n, n), 1e-7);
            }
            down(be, &t)
        };
        let got = strided(&kb);
        assert_eq!(
            got,
            one_by_one(&kb),
            "{count} x {n}: the per-matrix kernels' bits"
        );
        let want = one_by_one(&b);
        let (a, r) = compare(&got, &want, F32).unwrap_or_else(|e| panic!("{count} x {n}: {e}"));
        println!("normalize_frobenius_strided {count} x {n}: max abs err {a:.3e}, rel {r:.3e}");
        if count > 2 {
            assert!(
                got[n..2 * n].iter().all(|&v| v == 0.0),
                "the zero matrix stays zero"
            );
        }
        // Each matrix has unit norm (the zero one aside).
        for i in (0..count).filter(|&i| count <= 2 || i != 1) {
            let ss: f64 = got[i * n..(i + 1) * n]
                .iter()
                .map(|&v| (v as f64).powi(2))
                .sum();
            assert!(
                (ss.sqrt() - 1.0).abs() < 1e-5,
                "matrix {i}: norm {}",
                ss.sqrt()
            );
        }
    }
}

/// Newton–Schulz in bf16 takes its first operand from the normalisation's own pass
/// (`scale_by_inv_norm_strided_f32_to_bf16`, issue 32; `OptimOps::normalizes_into_bf16` says
/// so): bit for bit the kernels' f32
/// normalisation of the stack followed by their cast, and within bf16's rounding of the CPU
/// backend's normalisation and cast; x is left as it was, at aligned and unaligned matrix sizes
/// and at an unaligned bf16 copy.
#[test]
fn frobenius_normalisation_of_a_stack_into_bf16() {
    let (b, kb) = (cpu(), kernels(SMALL));
    assert!(kb.normalizes_into_bf16() && !b.normalizes_into_bf16());
    let mut rng = Lcg::new(22);
    for (count, n, at) in [
        (1usize, 1001usize, 0usize),
        (5, 63, 0),
        (3, 96 * 160, 0),
        (4, 64, 1),
    ] {
        let mut x = rng.values(count * n, 0.8);
        if count > 2 {
            x[n..2 * n].fill(0.0);
        }
        let a = Category::Activations;
        // The old path: normalise in place, then cast (on the kernels, and on the CPU).
        let two_passes = |be: &dyn Backend| {
            let mut t = up(be, &x);
            be.normalize_frobenius_strided(t.view_mut(), count, 1e-7);
            let mut r = be.zeros_of(&[count * n], DType::BF16, a);
            be.cast(r.view_mut(), t.view());
            r.view().host_bf16().to_vec()
        };
        let want = two_passes(&kb);
        let t = up(&kb, &x);
        // The copy `at` elements into its buffer (one: no wide access is aligned).
        let mut r = kb.zeros_of(&[count * n + at], DType::BF16, a);
        kb.normalize_frobenius_strided_bf16(
            t.view(),
            r.view_mut().slice(at, count * n),
            count,
            1e-7,
        );
        let got = r.view().host_bf16()[at..].to_vec();
        assert_eq!(
            got, want,
            "{count} x {n} at {at}: the bits of normalising then casting"
        );
        assert_eq!(down(&kb, &t), x, "{count} x {n}: x is left as it was");
        let (e, rel) = compare(&from_bf16(&got), &from_bf16(&two_passes(&b)), BF16)
            .unwrap_or_else(|e| panic!("{count} x {n}: {e}"));
        println!(
            "normalize_frobenius_strided_bf16 {count} x {n}: max abs err {e:.3e}, rel {rel:.3e}"
        );
        if count > 2 {
            assert!(
                got[n..2 * n].iter().all(|&v| v == 0),
                "the zero matrix stays zero"
            );
        }
    }
    // An f32 copy, or one of another length, is refused.
    let t = up(&kb, &[1.0; 8]);
    for (dt, len) in [(DType::F32, 8), (DType::BF16, 7)] {
        let mut r = kb.zeros_of(&[len], dt, Category::Activations);
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            kb.normalize_frobenius_strided_bf16(t.view(), r.view_mut(), 2, 1e-7)
        }));
        assert!(e.is_err(), "{dt:?} x {len} accepted");
    }
}

fn optimizer_updates_at(
    b: &CpuBackend,
    kb: &HostKernelBackend,
    [p, m, v, g]: [&Vec<f32>; 4],
    h: ganymede_core::AdamWStep,
    (gs, on_device): (f32, bool),
) {
    use ganymede_core::{DecayStep, DeviceRate, GradScale};
    // The factor as the backend's own device memory holds it, or as the host gives it; with it
    // on the device, the learning rate and bias corrections too.
    let scale = |be: &dyn Backend| {
        let mut t = be.zeros_of(&[1], DType::F64, Category::Activations);
        be.write_f64(t.view_mut(), &[f64::from(gs)]);
        t
    };
    let rate = |be: &dyn Backend| {
        let mut t = be.zeros_of(&[3], DType::F64, Category::Activations);
        be.write_f64(t.view_mut(), &h.rate_values());
        t
    };
    fn pick_rate(t: &Tensor, on_device: bool) -> Option<DeviceRate<'_>> {
        on_device.then(|| DeviceRate::new(t.view()))
    }
    fn pick(t: &Tensor, gs: f32, on_device: bool) -> GradScale<'_> {
        match on_device {
            true => GradScale::Device(t.view()),
            false => GradScale::Host(gs),
        }
    }
    let label = format!("grad_scale {gs}, on the device {on_device}");
    // And the update rounded into a bf16 copy, as the compute copy is written.
    let adamw = |be: &dyn Backend, x: &[Vec<f32>]| {
        let (mut p, mut m, mut v) = (up(be, &x[0]), up(be, &x[1]), up(be, &x[2]));
        let (mut p2, mut m2, mut v2) = (up(be, &x[0]), up(be, &x[1]), up(be, &x[2]));
        let g = up(be, &x[3]);
        let (t, r) = (scale(be), rate(be));
        let h = ganymede_core::AdamWStep {
            grad_scale: pick(&t, gs, on_device),
            rate: pick_rate(&r, on_device),
            ..h
        };
        be.adamw_step(p.view_mut(), m.view_mut(), v.view_mut(), g.view(), &h, None);
        let mut r = be.zeros_of(&[x[0].len()], DType::BF16, Category::Activations);
        let (pv, mv, vv) = (p2.view_mut(), m2.view_mut(), v2.view_mut());
        be.adamw_step(pv, mv, vv, g.view(), &h, Some(r.view_mut()));
        // The fused variant's master and state are the plain one's, bit for bit.
        assert_eq!(down(be, &p2), down(be, &p));
        assert_eq!(down(be, &m2), down(be, &m));
        let rounded = from_bf16(r.view().host_bf16());
        vec![down(be, &p), down(be, &m), down(be, &v), rounded]
    };
    parity(
        &format!("adamw_step_f32, {label}"),
        &[p.clone(), m.clone(), v.clone(), g.clone()],
        3,
        &[F32],
        |x| adamw(kb, x),
        |x| adamw(b, x),
    );
    let mu = 0.95;
    let nesterov = |be: &dyn Backend, x: &[Vec<f32>]| {
        let (mut buf, mut g) = (up(be, &x[0]), up(be, &x[1]));
        let t = scale(be);
        be.nesterov_momentum(buf.view_mut(), g.view_mut(), mu, pick(&t, gs, on_device));
        vec![down(be, &buf), down(be, &g)]
    };
    parity(
        &format!("nesterov_f32, {label}"),
        &[m.clone(), g.clone()],
        1,
        &[F32],
        |x| nesterov(kb, x),
        |x| nesterov(b, x),
    );
    let eps = 1e-7;
    let normalize = |be: &dyn Backend, x: &[Vec<f32>]| {
        let mut t = up(be, &x[0]);
        be.normalize_frobenius(t.view_mut(), eps);
        vec![down(be, &t)]
    };
    parity(
        "normalize_frobenius (sumsq_partial_f32, sum_acc_f64, scale_by_inv_norm_f32)",
        std::slice::from_ref(g),
        0,
        &[F32],
        |x| normalize(kb, x),
        |x| normalize(b, x),
    );
    let decay_update = |be: &dyn Backend, x: &[Vec<f32>]| {
        let (mut p, mut p2) = (up(be, &x[0]), up(be, &x[0]));
        // Only the gate's stop counts here: a finite factor leaves the update as it is.
        let (t, rt) = (scale(be), rate(be));
        let d = DecayStep {
            lr: h.lr,
            scale: 2.0,
            weight_decay: 0.1,
            rate: pick_rate(&rt, on_device),
            gate: pick(&t, gs, on_device),
        };
        be.decay_update(p.view_mut(), up(be, &x[1]).view(), &d, None);
        let mut r = be.zeros_of(&[x[0].len()], DType::BF16, Category::Activations);
        let u = up(be, &x[1]);
        be.decay_update(p2.view_mut(), u.view(), &d, Some(r.view_mut()));
        assert_eq!(down(be, &p2), down(be, &p));
        vec![down(be, &p), from_bf16(r.view().host_bf16())]
    };
    parity(
        &format!("decay_update_f32, {label}"),
        &[p.clone(), g.clone()],
        1,
        &[F32],
        |x| decay_update(kb, x),
        |x| decay_update(b, x),
    );
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

#[test]
fn cross_entropy_forward_backward() {
    on_both_row_paths(&[(1000, true), (1001, false)], cross_entropy_case);
}

fn cross_entropy_case(vocab: usize) {
    let rows = 13usize;
    let mut rng = Lcg::new(9);
    let logits = rng.values(rows * vocab, 4.0);
    let targets: Vec<u32> = (0..rows).map(|_| rng.below(vocab)).collect();
    let (scale, loss0) = (1.0f32 / 13.0, 0.5f64);
    let (b, kb) = (cpu(), kernels(SMALL));
    // Outputs: lse, the loss added to loss0, the logits' gradient (in place, storage st).
    let run = |be: &dyn Backend, st: St, v: &[Vec<f32>]| {
        let mut x = st.up(be, &v[0]);
        let mut lse = up(be, &vec![f32::NAN; rows]);
        let mut loss = be.zeros_of(&[1], DType::F64, Category::Activations);
        set_f64(&mut loss, loss0);
        let t = be.upload_u32(&targets, &[targets.len()], Category::Activations);
        be.cross_entropy_forward(lse.view_mut(), x.view(), t.view(), vocab, loss.view_mut());
        let l = be.download_f64(loss.view())[0];
        be.cross_entropy_backward(x.view_mut(), lse.view(), t.view(), vocab, scale);
        vec![down(be, &lse), vec![(l - loss0) as f32], down(be, &x)]
    };
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(std::slice::from_ref(&logits));
        parity(
            &st.name("cross_entropy"),
            &inputs,
            0,
            &[F32, F32, st.tols_with_reduction()[0]],
            |v| run(&kb, st, v),
            |v| run(&b, St::F32, v),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Router

#[test]
fn router_forward_backward() {
    use ganymede_core::{RouterDims, RouterOut};
    let (rows, experts, k) = (150usize, 40usize, 3usize);
    let mut rng = Lcg::new(10);
    let mut logits = rng.values(rows * experts, 3.0);
    // Ties, which must go to the lower index: a uniform row, and a row whose two best are equal.
    logits[5 * experts..6 * experts].fill(0.7);
    logits[6 * experts + 3] = 9.0;
    logits[6 * experts + 7] = 9.0;
    let bias = rng.values(experts, 0.05);
    let dweights = rng.values(rows * k, 1.0);
    let dconst: Vec<f64> = rng.values(experts, 0.1).iter().map(|&v| v as f64).collect();
    let (b, kb) = (cpu(), kernels(SMALL));
    for (renorm, with_bias) in [(true, true), (false, false), (true, false)] {
        let d = RouterDims { experts, k, renorm };
        let name = format!("router_f32 (renorm {renorm}, bias {with_bias})");
        // Outputs: probs, weights, idx (as f32: exact), psum, dlogits.
        let run = |be: &dyn Backend, v: &[Vec<f32>]| {
            let mut probs = up(be, &vec![f32::NAN; rows * experts]);
            let mut weights = up(be, &vec![f32::NAN; rows * k]);
            let mut idx_t = be.zeros_of(&[rows * k], DType::U32, Category::Activations);
            let mut psum_t = be.zeros_of(&[experts], DType::F64, Category::Activations);
            be.write_f64(psum_t.view_mut(), &vec![f64::NAN; experts]);
            let bias_t = up(be, &v[1]);
            be.router_forward(
                RouterOut {
                    probs: probs.view_mut(),
                    weights: weights.view_mut(),
                    idx: idx_t.view_mut(),
                    psum: psum_t.view_mut(),
                },
                up(be, &v[0]).view(),
                with_bias.then(|| bias_t.view()),
                d,
            );
            let mut dl = up(be, &vec![f32::NAN; rows * experts]);
            let mut dconst_t = be.zeros_of(&[experts], DType::F64, Category::Activations);
            be.write_f64(dconst_t.view_mut(), &dconst);
            be.router_backward(
                dl.view_mut(),
                up(be, &v[2]).view(),
                probs.view(),
                idx_t.view(),
                // Not one: the f64 formula itself, on both sides.
                AuxGrad {
                    counts: dconst_t.view(),
                    coef: 3.0,
                    tokens: 7.0,
                },
                d,
            );
            let idx = be.download_u32(idx_t.view());
            let idx: Vec<f32> = idx.iter().map(|&i| i as f32).collect();
            let psum = be.download_f64(psum_t.view());
            let psum: Vec<f32> = psum.iter().map(|&s| s as f32).collect();
            vec![
                down(be, &probs),
                down(be, &weights),
                idx,
                psum,
                down(be, &dl),
            ]
        };
        parity(
            &name,
            &[logits.clone(), bias.clone(), dweights.clone()],
            0,
            &[F32, F32, F32, F32, F32],
            |v| run(&kb, v),
            |v| run(&b, v),
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
/// A routing drawn from `rng` and its dispatch orders `(src, pos)` (see [`dispatch_reference`]).
fn routed_rows(rng: &mut Lcg, tokens: usize, experts: usize, k: usize) -> (Vec<u32>, Vec<u32>) {
    let idx = routing(rng, tokens, experts, k);
    let (_, src, pos) = dispatch_reference(&idx, experts, k);
    (src, pos)
}

fn routing(rng: &mut Lcg, tokens: usize, experts: usize, k: usize) -> Vec<u32> {
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

/// The counting sort's kernels launched one by one, with tiles of `tile` choices taken in
/// chunks of `block`: offsets, src and pos (the counts checked against the offsets).
fn dispatch_kernels(
    idx: &[u32],
    experts: usize,
    k: usize,
    (tile, block): (usize, u32),
) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let n = idx.len();
    let tiles = n.div_ceil(tile);
    let mut counts = vec![u32::MAX; experts];
    let mut offsets = vec![u32::MAX; experts + 1];
    let mut per_tile = vec![u32::MAX; tiles * experts];
    let (mut src, mut pos) = (vec![u32::MAX; n], vec![u32::MAX; n]);
    let (n32, e32, t32) = (n as i32, experts as i32, tile as i32);
    unsafe {
        let blocks = cfg([tiles as u32, 1, 1], block);
        launch(
            "dispatch_tile_counts",
            blocks,
            &[
                ptr(&mut per_tile),
                cptr(idx),
                n32.into(),
                e32.into(),
                t32.into(),
            ],
        );
        launch(
            "dispatch_tile_scan",
            cfg([1, 1, 1], experts.next_multiple_of(32) as u32),
            &[
                ptr(&mut per_tile),
                ptr(&mut counts),
                ptr(&mut offsets),
                // No totals.
                Arg::Ptr(std::ptr::null_mut()),
                (tiles as i32).into(),
                e32.into(),
            ],
        );
        launch(
            "dispatch_place",
            blocks,
            &[
                ptr(&mut src),
                ptr(&mut pos),
                cptr(&per_tile),
                cptr(idx),
                n32.into(),
                (k as i32).into(),
                e32.into(),
                t32.into(),
            ],
        );
    }
    let diffs: Vec<u32> = offsets
        .windows(2)
        .map(|w| w[1].wrapping_sub(w[0]))
        .collect();
    assert_eq!(counts, diffs, "counts against offsets");
    (offsets, src, pos)
}

#[test]
fn dispatch_counting_sort() {
    let (tokens, experts, k) = (301usize, 13usize, 4usize);
    let mut rng = Lcg::new(11);
    let idx = routing(&mut rng, tokens, experts, k);
    let n = idx.len();
    let want = dispatch_reference(&idx, experts, k);
    // One tile and one chunk; many tiles of several chunks, the last ones partial; chunks
    // larger than a tile.
    for shape in [(n, 1024), (96, 32), (100, 32), (37, 64), (1, 32)] {
        let got = dispatch_kernels(&idx, experts, k, shape);
        assert_eq!(got.0, want.0, "offsets, tiles {shape:?}");
        assert_eq!(got.1, want.1, "src, tiles {shape:?}");
        assert_eq!(got.2, want.2, "pos, tiles {shape:?}");
    }
    println!("dispatch: {n} choices over {experts} experts: offsets, src, pos equal");
    // Swapping two choices of different experts must show.
    let mut bad = idx.clone();
    let j = (0..n).find(|&j| bad[j] != bad[n / 2]).unwrap();
    bad.swap(j, n / 2);
    assert_ne!(dispatch_kernels(&bad, experts, k, (96, 32)).2, want.2);
}

#[test]
fn moe_dispatch_through_the_ops_equals_the_cpu() {
    use ganymede_core::DispatchOut;
    // 2,133 choices: three of the ops' placement tiles, the last partial.
    let (tokens, experts, k) = (711usize, 9usize, 3usize);
    assert!(tokens * k > 2 * ganymede_cuda::ops::DISPATCH_TILE);
    let mut rng = Lcg::new(21);
    let idx = routing(&mut rng, tokens, experts, k);
    let n = idx.len();
    // Counts and offsets start as 7s: every one must be written.
    let run = |be: &dyn Backend, idx: &[u32]| {
        let n = idx.len();
        let u = |len| be.zeros_of(&[len], DType::U32, Category::Activations);
        let (mut c, mut o, mut s, mut p) = (u(experts), u(experts + 1), u(n), u(n));
        be.write_u32(c.view_mut(), &vec![7; experts]);
        be.write_u32(o.view_mut(), &vec![7; experts + 1]);
        let idx = be.upload_u32(idx, &[n], Category::Activations);
        // The layer's totals, added to.
        let mut t = be.zeros_of(&[experts], DType::F64, Category::Buffers);
        be.write_f64(t.view_mut(), &vec![0.25; experts]);
        let out = DispatchOut {
            counts: c.view_mut(),
            offsets: o.view_mut(),
            src: s.view_mut(),
            pos: p.view_mut(),
            totals: Some(t.view_mut()),
        };
        be.moe_dispatch(out, idx.view(), experts, k);
        let totals = be.download_f64(t.view());
        let got = [c, o, s, p].map(|t| be.download_u32(t.view()));
        let want: Vec<f64> = got[0].iter().map(|&c| c as f64 + 0.25).collect();
        assert_eq!(totals, want, "totals: counts added");
        got
    };
    let (b, kb) = (cpu(), kernels(SMALL));
    let want = run(&b, &idx);
    assert_eq!(run(&kb, &idx), want, "counts, offsets, src, pos");
    // A changed choice must show.
    let mut bad = idx.clone();
    bad[n / 2] = (bad[n / 2] + 1) % experts as u32;
    assert_ne!(run(&kb, &bad), want);
    // No choices at all (a chunk with no tokens): zero counts and offsets, by the tile scan
    // over no tiles.
    let none = [vec![0; experts], vec![0; experts + 1], vec![], vec![]];
    assert_eq!(run(&b, &[]), none);
    assert_eq!(run(&kb, &[]), none);
}

#[test]
fn moe_gather_combine_forward_backward() {
    // 70 columns take the rows' scalar path, 136 the 4-wide one (rows of a warp's 128 and more).
    on_both_row_paths(&[(70, false), (136, true)], moe_gather_combine_case);
}

/// Runs `case(dim)` at each (dim, wide) and checks that the row kernels took 4-wide accesses
/// exactly where `wide` says (rows of a multiple of 4 elements).
fn on_both_row_paths(dims: &[(usize, bool)], case: impl Fn(usize)) {
    for &(dim, wide) in dims {
        let before = ganymede_cuda::host::wide_accesses();
        case(dim);
        let took = ganymede_cuda::host::wide_accesses() > before;
        assert_eq!(took, wide, "rows of {dim}: wide accesses");
    }
}

fn moe_gather_combine_case(dim: usize) {
    use ganymede_core::Dispatched;
    let (tokens, experts, k) = (37usize, 7usize, 3usize);
    let mut rng = Lcg::new(12);
    let (src, pos) = routed_rows(&mut rng, tokens, experts, k);
    let n = tokens * k;
    let x = rng.values(tokens * dim, 1.0);
    let ye = rng.values(n * dim, 1.0);
    let dout = rng.values(tokens * dim, 1.0);
    let dxe = rng.values(n * dim, 1.0);
    let acc0 = rng.values(tokens * dim, 0.3);
    let w = rng.values(n, 1.0);
    let (b, kb) = (cpu(), kernels(SMALL));
    // Outputs: xe, dx (+=), out (+=), dye, dw (w and dw f32, the rest storage st).
    let run = |be: &dyn Backend, st: St, v: &[Vec<f32>]| {
        let pos_t = be.upload_u32(&pos, &[pos.len()], Category::Activations);
        let src_t = be.upload_u32(&src, &[src.len()], Category::Activations);
        let d = Dispatched {
            pos: pos_t.view(),
            k,
            dim,
        };
        let mut xe = st.up(be, &vec![f32::NAN; n * dim]);
        be.moe_gather(xe.view_mut(), st.up(be, &v[1]).view(), src_t.view(), dim);
        let mut dx = st.up(be, &v[4]);
        be.moe_gather_backward(dx.view_mut(), st.up(be, &v[3]).view(), d);
        let mut out = st.up(be, &v[4]);
        let (yt, wt) = (st.up(be, &v[0]), up(be, &v[5]));
        be.moe_combine(out.view_mut(), yt.view(), wt.view(), d);
        let mut dye = st.up(be, &vec![f32::NAN; n * dim]);
        let mut dw = up(be, &vec![f32::NAN; n]);
        be.moe_combine_backward(
            dye.view_mut(),
            dw.view_mut(),
            st.up(be, &v[2]).view(),
            yt.view(),
            wt.view(),
            d,
        );
        vec![
            down(be, &xe),
            down(be, &dx),
            down(be, &out),
            down(be, &dye),
            down(be, &dw),
        ]
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
        // dw is a dot over dim: the reduction's floor.
        parity(
            &st.name("moe_gather_combine"),
            &inputs,
            0,
            &[t, t, t, t, st.tols_with_reduction()[3]],
            |v| run(&kb, st, v),
            |v| run(&b, St::F32, v),
        );
    }
}

/// The rows bf16-input GEMMs read, made in bf16 where they are written (`*_f32_to_bf16`, and
/// the CPU backend's bf16 outputs): bit for bit the f32 op's output rounded once, on both
/// backends, so the GEMMs read exactly what casting f32 rows gave them. bf16 rows gathered
/// again (expert parallelism's reorder) are copied as they are.
#[test]
fn bf16_rows_are_the_f32_ops_rounded_once() {
    use ganymede_core::Dispatched;
    let (tokens, experts, k, dim) = (37usize, 7usize, 3usize, 70usize);
    let mut rng = Lcg::new(31);
    let (src, pos) = routed_rows(&mut rng, tokens, experts, k);
    let n = tokens * k;
    // 7,770 elements: two of the CPU's element-wise chunks, the last not a multiple of 8.
    let (g, u, d) = (
        rng.values(n * dim, 4.0),
        rng.values(n * dim, 2.0),
        rng.values(n * dim, 1.0),
    );
    let (x, ye) = (rng.values(tokens * dim, 1.0), rng.values(n * dim, 1.0));
    let (dout, w) = (rng.values(tokens * dim, 1.0), rng.values(n, 1.0));
    let reverse: Vec<u32> = (0..n as u32).rev().collect();
    // [SwiGLU out, dgate, dup, xe, dye, dw, xe's rows reversed] with the rows in `rows`.
    let run = |be: &dyn Backend, rows: St| {
        let u32s = |v: &[u32]| be.upload_u32(v, &[v.len()], Category::Activations);
        let (pos_t, src_t, rev_t) = (u32s(&pos), u32s(&src), u32s(&reverse));
        let disp = Dispatched {
            pos: pos_t.view(),
            k,
            dim,
        };
        let (gt, ut, dt) = (up(be, &g), up(be, &u), up(be, &d));
        let mut o = rows.zeros(be, n * dim);
        be.swiglu_forward(o.view_mut(), gt.view(), ut.view());
        let (mut dg, mut du) = (rows.zeros(be, n * dim), rows.zeros(be, n * dim));
        be.swiglu_backward(
            dg.view_mut(),
            du.view_mut(),
            dt.view(),
            gt.view(),
            ut.view(),
        );
        let mut xe = rows.zeros(be, n * dim);
        be.moe_gather(xe.view_mut(), up(be, &x).view(), src_t.view(), dim);
        let (mut dye, mut dw) = (rows.zeros(be, n * dim), zeros(be, n));
        let (dot, yt, wt) = (up(be, &dout), up(be, &ye), up(be, &w));
        be.moe_combine_backward(
            dye.view_mut(),
            dw.view_mut(),
            dot.view(),
            yt.view(),
            wt.view(),
            disp,
        );
        let mut again = rows.zeros(be, n * dim);
        be.moe_gather(again.view_mut(), xe.view(), rev_t.view(), dim);
        [o, dg, du, xe, dye, dw, again].map(|t| down(be, &t))
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (b, kb) = (cpu(), kernels(SMALL));
    let on_cpu = run(&b, St::Bf16);
    for (name, be) in [("cpu", &b as &dyn Backend), ("kernels", &kb)] {
        let (f, h) = (run(be, St::F32), run(be, St::Bf16));
        // The kernels against the CPU too (the f32 work may differ in its last bits, so a
        // value can round the other way).
        for (o, (got, want)) in h.iter().zip(&on_cpu).enumerate() {
            // dw: a dot over a row, the reduction's floor.
            let tol = if o == 5 {
                St::F32.tols_with_reduction()[3]
            } else {
                BF16
            };
            compare(got, want, tol).unwrap_or_else(|e| panic!("{name}: output {o}: {e}"));
        }
        for (o, (got, f32_out)) in h.iter().zip(&f).enumerate() {
            // dw stays f32, the same either way.
            let want = if o == 5 {
                f32_out.clone()
            } else {
                round_bf16(f32_out)
            };
            assert_eq!(bits(got), bits(&want), "{name}: output {o}");
        }
        let rows: Vec<&[f32]> = h[3].chunks(dim).rev().collect();
        assert_eq!(
            bits(&h[6]),
            bits(&rows.concat()),
            "{name}: bf16 rows regathered"
        );
        println!("{name}: bf16 rows equal the f32 ops' outputs rounded once");
    }
}

/// The experts' outputs a bf16 GEMM wrote (bf16 GEMM outputs) are combined into f32 tokens,
/// and read for the weights' gradient, as their widened values: on each backend the bits of
/// the f32 ops on an f32 copy of them (the backward's `dye` bf16 either way); the kernels
/// against the CPU within the f32 ops' tolerances.
#[test]
fn bf16_expert_outputs_are_combined_as_their_widened_values() {
    use ganymede_core::Dispatched;
    let (tokens, experts, k, dim) = (37usize, 7usize, 3usize, 300usize);
    let mut rng = Lcg::new(43);
    let (_, pos) = routed_rows(&mut rng, tokens, experts, k);
    let n = tokens * k;
    let ye = round_bf16(&rng.values(n * dim, 1.0));
    let (x, dout, w) = (
        rng.values(tokens * dim, 1.0),
        rng.values(tokens * dim, 1.0),
        rng.values(n, 1.0),
    );
    // [out, dye, dw] with ye stored as `ys`.
    let run = |be: &dyn Backend, ys: St| {
        let pos_t = be.upload_u32(&pos, &[pos.len()], Category::Activations);
        let disp = Dispatched {
            pos: pos_t.view(),
            k,
            dim,
        };
        let (yt, wt) = (ys.up(be, &ye), up(be, &w));
        let mut out = up(be, &x);
        be.moe_combine(out.view_mut(), yt.view(), wt.view(), disp);
        let (mut dye, mut dw) = (St::Bf16.zeros(be, n * dim), zeros(be, n));
        let dot = up(be, &dout);
        be.moe_combine_backward(
            dye.view_mut(),
            dw.view_mut(),
            dot.view(),
            yt.view(),
            wt.view(),
            disp,
        );
        [out, dye, dw].map(|t| down(be, &t))
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (b, kb) = (cpu(), kernels(SMALL));
    let on_cpu = run(&b, St::Bf16);
    for (name, be) in [("cpu", &b as &dyn Backend), ("kernels", &kb)] {
        let (h, f) = (run(be, St::Bf16), run(be, St::F32));
        for (o, (got, want)) in h.iter().zip(&f).enumerate() {
            assert_eq!(bits(got), bits(want), "{name}: output {o}");
        }
        let tols = [F32, BF16, St::F32.tols_with_reduction()[3]];
        for (o, ((got, want), tol)) in h.iter().zip(&on_cpu).zip(tols).enumerate() {
            compare(got, want, tol).unwrap_or_else(|e| panic!("{name}: output {o}: {e}"));
        }
    }
}

/// bf16 rows gathered again (expert parallelism's reorder) are copied as bits: a signalling
/// NaN keeps its payload, which a round trip through f32 would quiet.
#[test]
fn bf16_rows_are_regathered_as_bits() {
    let dim = 5;
    let rows: [[u16; 5]; 3] = [
        [0x7f81, 0xff81, 0x7fc1, 0x8000, 0x0001],
        [0x7f80, 0xff80, 0x3f80, 0x0080, 0x7fff],
        [0x1234, 0xabcd, 0xffff, 0x7f81, 0x0000],
    ];
    let src = [2u32, 0, 1, 0];
    let want: Vec<u16> = src.iter().flat_map(|&r| rows[r as usize]).collect();
    let (b, kb) = (cpu(), kernels(SMALL));
    for (name, be) in [("cpu", &b as &dyn Backend), ("kernels", &kb)] {
        let mut x = St::Bf16.zeros(be, rows.len() * dim);
        x.view_mut().host_bf16().copy_from_slice(&rows.concat());
        let s = be.upload_u32(&src, &[src.len()], Category::Activations);
        let mut xe = St::Bf16.zeros(be, src.len() * dim);
        be.moe_gather(xe.view_mut(), x.view(), s.view(), dim);
        assert_eq!(xe.view().host_bf16(), &want[..], "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

/// Forward and backward on `be` in storage `st`, the saved output rounded as `round` stores it
/// (the CPU reference in f32 reads the bf16-rounded output, as the device's backward does):
/// [out, lse, dq, dk, dv].
fn attention_run(be: &dyn Backend, st: St, round: St, x: &[Vec<f32>], d: Attn) -> Vec<Vec<f32>> {
    attention_run_at(be, st, round, x, d, 0)
}

/// Attention's sizes, and each query's document start under document masking.
type Attn<'a> = (ganymede_core::AttnDims, Option<&'a [u32]>);

/// [`attention_run`] with q, k, v and dout as views that start `at` elements into their
/// tensors.
fn attention_run_at(
    be: &dyn Backend,
    st: St,
    round: St,
    x: &[Vec<f32>],
    (d, docs): Attn,
    at: usize,
) -> Vec<Vec<f32>> {
    use ganymede_core::{AttnGrads, AttnSaved};
    let docs = docs.map(|x| be.upload_u32(x, &[x.len()], Category::Activations));
    let (nq, nk) = (x[0].len(), x[1].len());
    let nl = d.batch * d.heads * d.tq;
    let input = |x: &[f32]| st.up(be, &[vec![0.0; at], x.to_vec()].concat());
    let (qt, kt, vt, dt) = (input(&x[0]), input(&x[1]), input(&x[2]), input(&x[3]));
    let (qv, kv, vv) = (qt.slice(at, nq), kt.slice(at, nk), vt.slice(at, nk));
    let mut out = st.up(be, &vec![f32::NAN; nq]);
    let mut lse = up(be, &vec![f32::NAN; nl]);
    match &docs {
        Some(t) => {
            be.attention_forward_docs(out.view_mut(), lse.view_mut(), qv, kv, vv, t.view(), d)
        }
        None => be.attention_forward(out.view_mut(), lse.view_mut(), qv, kv, vv, d),
    }
    let (mut dq, mut dk, mut dv) = (
        st.up(be, &vec![f32::NAN; nq]),
        st.up(be, &vec![f32::NAN; nk]),
        st.up(be, &vec![f32::NAN; nk]),
    );
    let saved_out = st.up(be, &round.inputs(&[down(be, &out)])[0]);
    let g = AttnGrads {
        dq: dq.view_mut(),
        dk: dk.view_mut(),
        dv: dv.view_mut(),
    };
    let s = AttnSaved {
        out: saved_out.view(),
        q: qv,
        k: kv,
        v: vv,
        lse: lse.view(),
    };
    match &docs {
        Some(t) => be.attention_backward_docs(g, dt.slice(at, nq), s, t.view(), d),
        None => be.attention_backward(g, dt.slice(at, nq), s, d),
    }
    vec![
        down(be, &out),
        down(be, &lse),
        down(be, &dq),
        down(be, &dk),
        down(be, &dv),
    ]
}

/// Document starts for `d`'s queries: each sequence's keys cut into documents of 1 to `max`
/// keys at random, each query starting at the last cut at or before its key position.
fn query_doc_starts(d: &ganymede_core::AttnDims, max: usize, seed: u64) -> Vec<u32> {
    let mut rng = Lcg::new(seed);
    let off = d.tk - d.tq;
    let mut out = Vec::new();
    for _ in 0..d.batch {
        let mut cuts = vec![0usize];
        loop {
            let next = cuts.last().unwrap() + 1 + rng.below(max) as usize;
            if next >= d.tk {
                break;
            }
            cuts.push(next);
        }
        for i in 0..d.tq {
            let c = cuts.iter().rev().find(|&&c| c <= off + i).unwrap();
            out.push(*c as u32);
        }
    }
    out
}

/// `warps`: query rows per forward block.
fn attention_case(d: ganymede_core::AttnDims, warps: usize, seed: u64) {
    attention_case_docs((d, None), warps, seed)
}

/// [`attention_case`] with document starts (the `_doc_` kernels), or without.
fn attention_case_docs(dd: Attn, warps: usize, seed: u64) {
    let d = dd.0;
    // A key may be in no query's document: the check's change goes into a query then.
    let perturb = if dd.1.is_some() { 0 } else { 1 };
    let (nq, nk) = (
        d.batch * d.tq * d.heads * d.head_dim,
        d.batch * d.tk * d.kv_heads * d.head_dim,
    );
    let mut rng = Lcg::new(seed);
    let (q, k, v, dout) = (
        rng.values(nq, 1.5),
        rng.values(nk, 1.5),
        rng.values(nk, 1.0),
        rng.values(nq, 1.0),
    );
    let b = cpu();
    let kb = kernels(Tuning {
        attn_rows: warps as u32,
        ..SMALL
    });
    for st in [St::F32, St::Bf16] {
        let inputs = st.inputs(&[q.clone(), k.clone(), v.clone(), dout.clone()]);
        // Outputs: out, lse, dq, dk, dv. The gradients sum over keys or queries: in f32 the
        // reduction floor; in bf16 they are bf16.
        let g = match st {
            St::F32 => st.tols_with_reduction()[3],
            St::Bf16 => BF16,
        };
        parity(
            &format!("{} {d:?} docs {}", st.name("attention"), dd.1.is_some()),
            &inputs,
            perturb,
            &[st.tols_with_reduction()[0], F32, g, g, g],
            |x| attention_run(&kb, st, st, x, dd),
            |x| attention_run(&b, St::F32, st, x, dd),
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

// Tensor-core attention (`attention_*_tc{head_dim}_bf16`, mma.sync through the shim's emulation of its
// register layout) against the CPU backend in f32 on the same bf16 inputs. Besides the output's
// bf16 rounding, the kernels round the probabilities (forward, dk/dv) and dS (dq, dk) to bf16 as
// operands, so an output element that sums many such terms is off by up to a few 2^-9 of the
// largest term: each output o is held to |got - want| <= TC_RTOL |want| + TC_ATOL max|want_o|
// (lse, from f32 scores of exact bf16 products, to the f32 tolerance).
const TC_RTOL: f64 = 1.0 / 64.0;
const TC_ATOL: f64 = 1.0 / 128.0;

/// `at`: the inputs' views start this many elements into their tensors (1: not 16-byte aligned,
/// the kernels' element-by-element loads; 0: aligned, their 16-byte loads).
fn attention_tc_case(d: ganymede_core::AttnDims, seed: u64, at: usize) {
    attention_tc_case_docs((d, None), seed, at)
}

/// [`attention_tc_case`] with document starts (the `_doc_` kernels), or without.
fn attention_tc_case_docs(dd: Attn, seed: u64, at: usize) {
    let d = dd.0;
    let perturb = if dd.1.is_some() { 0 } else { 1 };
    let (nq, nk) = (
        d.batch * d.tq * d.heads * d.head_dim,
        d.batch * d.tk * d.kv_heads * d.head_dim,
    );
    let mut rng = Lcg::new(seed);
    let inputs = St::Bf16.inputs(&[
        rng.values(nq, 1.5),
        rng.values(nk, 1.5),
        rng.values(nk, 1.0),
        rng.values(nq, 1.0),
    ]);
    let b = cpu();
    let reference = |x: &[Vec<f32>]| attention_run(&b, St::F32, St::Bf16, x, dd);
    let tols: Vec<Tol> = reference(&inputs)
        .iter()
        .enumerate()
        .map(|(o, w)| match o {
            1 => F32,
            _ => Tol {
                rtol: TC_RTOL,
                atol: TC_ATOL * w.iter().fold(0.0f64, |a, x| a.max(x.abs() as f64)),
            },
        })
        .collect();
    // Both backwards: dq in a second pass, and dq added from the dk/dv pass (fused); then the
    // forward with two m-tiles a warp.
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut runs = Vec::new();
    for (fused, wide) in [(false, false), (true, false), (true, true)] {
        let kb = kernels(Tuning {
            attn_tc: true,
            attn_fused_dq: fused,
            attn_wide_fwd: wide,
            // The last with three warps a block in the warp-per-row delta kernel.
            row_block_max: if wide { 96 } else { 32 },
            ..SMALL
        });
        let run = |x: &[Vec<f32>]| attention_run_at(&kb, St::Bf16, St::Bf16, x, dd, at);
        let name = format!(
            "attention_tc_bf16 (fused dq: {fused}, wide forward: {wide}, docs: {}) {d:?}",
            dd.1.is_some()
        );
        parity(&name, &inputs, perturb, &tols, run, reference);
        let at_issue = run(&inputs);
        // The tiles' asynchronous copies landing only at the waits that cover them: every
        // output bit for bit, so no tile is read before its wait.
        set_copy_timing(CopyTiming::AtWait);
        let at_wait = run(&inputs);
        set_copy_timing(CopyTiming::AtIssue);
        for (o, (a, b)) in at_issue.iter().zip(&at_wait).enumerate() {
            assert!(
                bits(a) == bits(b),
                "{name}: output {o} differs with copies landing at their waits"
            );
        }
        runs.push(at_issue);
    }
    // The wide forward computes each row as the narrow one does, product by product: every
    // output bit for bit (past head_dim 64 it does not apply).
    for (o, (a, b)) in runs[1].iter().zip(&runs[2]).enumerate() {
        assert!(
            bits(a) == bits(b),
            "{d:?}: output {o} differs with the wide forward"
        );
    }
    // The fused pass leaves out, lse, dk and dv bit for bit as they were; dq's f32 sums only
    // run in another order (past head_dim 64 it does not apply, and dq is the same too).
    let names = ["out", "lse", "dq", "dk", "dv"];
    for (o, name) in names.iter().enumerate() {
        let same = bits(&runs[0][o]) == bits(&runs[1][o]);
        if o != 2 || d.head_dim > 64 {
            assert!(
                same,
                "{d:?}: {name} differs between the fused and two-pass backwards"
            );
        } else {
            println!("{d:?}: dq bitwise equal between the backwards: {same}");
        }
    }
}

fn dims(
    batch: usize,
    tq: usize,
    tk: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> ganymede_core::AttnDims {
    ganymede_core::AttnDims {
        batch,
        tq,
        tk,
        heads,
        kv_heads,
        head_dim,
    }
}

#[test]
fn attention_over_documents() {
    // Documents of 1 to 9 keys: starts inside a tile, tiles wholly before a row's document,
    // key blocks that no later query sees; tq < tk with starts inside the prefix, and square.
    for (d, warps, seed) in [
        (dims(2, 13, 37, 4, 2, 40), 4, 31),
        (dims(1, 45, 45, 3, 1, 16), 16, 32),
        (dims(1, 21, 40, 2, 2, 128), 8, 33),
    ] {
        let docs = query_doc_starts(&d, 9, seed);
        attention_case_docs((d, Some(&docs)), warps, seed);
    }
    // Long documents: whole key tiles before a row's start are skipped.
    let d = dims(1, 90, 90, 2, 1, 16);
    let docs = query_doc_starts(&d, 40, 34);
    attention_case_docs((d, Some(&docs)), 4, 34);
}

#[test]
fn attention_tc_over_documents() {
    // The tensor-core kernels (both backwards, both forwards) with document starts: short
    // documents (every tile masked inside), long ones (tiles and key blocks skipped whole, and
    // tiles unmasked within a document), a key prefix, head_dim 16 to 128, unaligned views.
    for (d, max, seed, at) in [
        (dims(2, 13, 37, 4, 2, 32), 9, 41, 0),
        (dims(1, 150, 150, 4, 1, 64), 9, 42, 0),
        (dims(2, 150, 150, 2, 1, 64), 100, 43, 0),
        (dims(1, 70, 133, 3, 1, 16), 70, 44, 0),
        (dims(1, 130, 130, 2, 2, 128), 80, 45, 0),
        (dims(1, 70, 90, 2, 1, 32), 30, 46, 1),
    ] {
        let docs = query_doc_starts(&d, max, seed);
        attention_tc_case_docs((d, Some(&docs)), seed, at);
    }
}

#[test]
fn attention_tc_gqa_with_a_key_prefix() {
    // tq < tk inside one tile, two query heads per kv head, head_dim 32 (small's).
    attention_tc_case(dims(2, 13, 37, 4, 2, 32), 21, 0);
}

#[test]
fn attention_tc_across_tiles() {
    // Two 64-row tiles either way, the second partial; head_dim 64 (medium's).
    attention_tc_case(dims(1, 100, 100, 2, 1, 64), 22, 0);
}

#[test]
fn attention_tc_four_query_heads_per_kv_head_at_head_dim_64() {
    // medium's grouping (4 query heads a kv head) and head_dim, three tiles with a partial one:
    // the fused backward walks every head's tiles from one key block, two batches apart.
    attention_tc_case(dims(2, 150, 150, 4, 1, 64), 27, 0);
}

#[test]
fn attention_tc_key_prefix_across_tiles_head_dim_16() {
    // tq < tk with the causal offset (63) crossing tile edges, three heads per kv head.
    attention_tc_case(dims(1, 70, 133, 3, 1, 16), 23, 0);
}

#[test]
fn attention_tc_at_the_largest_head_dim() {
    attention_tc_case(dims(1, 21, 40, 2, 2, 128), 24, 0);
}

#[test]
fn attention_tc_unaligned_views() {
    // Views one element into their tensors: the loads that do not assume 16-byte rows.
    attention_tc_case(dims(1, 70, 90, 2, 1, 32), 26, 1);
    // Four elements in: 8-byte aligned, which a 16-byte load (or cp.async) may not take.
    attention_tc_case(dims(1, 70, 90, 2, 1, 32), 27, 4);
}

#[test]
fn attention_tc_views_choose_the_load() {
    // The cases above take each load path: whole tensors are 16-byte aligned, one element in
    // is not (so both paths are what those tests check).
    let be = kernels(SMALL);
    let t = St::Bf16.up(&be, &[0.0; 64]);
    let addr = |v: ganymede_core::View| be.ops().launcher().addr(v) as usize;
    assert_eq!(addr(t.view()) % 16, 0);
    assert_ne!(addr(t.slice(1, 32)) % 16, 0);
}

#[test]
fn attention_tc_falls_back_where_it_does_not_apply() {
    // head_dim 40 (not a multiple of 16) and f32 take the SIMT kernels even with attn_tc on:
    // bitwise the results of a backend without it.
    let tc = kernels(Tuning {
        attn_tc: true,
        ..SMALL
    });
    let simt = kernels(SMALL);
    for (st, hd) in [(St::Bf16, 40), (St::F32, 32)] {
        let d = dims(1, 9, 17, 2, 1, hd);
        let mut rng = Lcg::new(25);
        let x = st.inputs(&[
            rng.values(9 * 2 * hd, 1.0),
            rng.values(17 * hd, 1.0),
            rng.values(17 * hd, 1.0),
            rng.values(9 * 2 * hd, 1.0),
        ]);
        let (a, b) = (
            attention_run(&tc, st, st, &x, (d, None)),
            attention_run(&simt, st, st, &x, (d, None)),
        );
        for (o, (a, b)) in a.iter().zip(&b).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{st:?} head_dim {hd}: output {o} differs");
        }
    }
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

/// One grouped GEMM's group: shape, then A's, B's and C's offsets.
type Group = (Gemm, usize, usize, usize);

/// The experts' three kinds of grouped product, as the MoE layer makes them: forward
/// `y_e = x_e W_eᵀ` (B transposed), the input gradient `dx_e = dy_e W_e`, and the weight
/// gradient `dW_e += dy_eᵀ x_e` (A transposed, accumulated: beta 1), over experts of 0, 1, 17,
/// 64, 100 and 3 rows. `k` of 40 and `n` of 20 leave partial tiles everywhere.
fn expert_groups(counts: &[usize], n: usize, k: usize) -> Vec<(&'static str, Vec<Group>)> {
    let mut fwd = Vec::new();
    let mut dx = Vec::new();
    let mut dw = Vec::new();
    let mut row = 0;
    for (e, &rows) in counts.iter().enumerate() {
        let g = |m, nn, kk, ta, tb, lda, ldb, ldc| {
            Gemm {
                trans_a: ta,
                trans_b: tb,
                lda,
                ldb,
                ldc,
                ..Gemm::new(m, nn, kk, ta, tb)
            }
            .bf16_inputs(true)
        };
        // x: [rows, k] at row; W_e: [n, k] at e·n·k; y: [rows, n].
        fwd.push((
            g(rows, n, k, false, true, k, k, n),
            row * k,
            e * n * k,
            row * n,
        ));
        // dy: [rows, n]; W_e as [n, k]; dx: [rows, k].
        dx.push((
            g(rows, k, n, false, false, n, k, k),
            row * n,
            e * n * k,
            row * k,
        ));
        // dyᵀ: [n, rows] from dy stored [rows, n]; x: [rows, k]; dW_e: [n, k], accumulated.
        let mut w = g(n, k, rows, true, false, n, k, k);
        w.beta = 1.0;
        w.alpha = 0.5;
        dw.push((w, row * n, row * k, e * n * k));
        row += rows;
    }
    vec![
        ("forward", fwd),
        ("input gradient", dx),
        ("weight gradient", dw),
    ]
}

/// The grouped GEMM kernel (`gemm_grouped_*`, mma.sync) against the CPU backend's grouped GEMM
/// with bf16 inputs: every operand dtype pair, f32 results (beta 0 and 1) and bf16 results
/// (beta 0, the f32 result rounded once), threads and blocks in both orders, under the bounds
/// check. Changing one group's alpha must change its block of C.
#[test]
fn grouped_gemm_on_the_tensor_cores_equals_the_cpu() {
    let (b, kb) = (cpu(), kernels(SMALL));
    let (n, k) = (20, 40);
    let counts = [0usize, 1, 17, 64, 100, 3];
    let rows: usize = counts.iter().sum();
    let mut rng = Lcg::new(41);
    // The largest operands any of the three products reads.
    let big = rows * n.max(k);
    let (xa, xb, c0) = (
        rng.values(big, 1.0),
        rng.values(counts.len() * n * k.max(rows), 1.0),
        rng.values(big.max(counts.len() * n * k), 1.0),
    );
    let as_dtype = |be: &dyn Backend, x: &[f32], dt: DType| -> Tensor {
        let f = up(be, x);
        match dt {
            DType::F32 => f,
            _ => {
                let mut h = be.zeros_of(&[x.len()], dt, Category::Activations);
                be.cast(h.view_mut(), f.view());
                h
            }
        }
    };
    let widened = |be: &dyn Backend, t: &Tensor| -> Vec<f32> {
        match t.dtype() {
            DType::F32 => down(be, t),
            _ => {
                let mut f = be.zeros(&[t.len()], Category::Activations);
                be.cast(f.view_mut(), t.view());
                down(be, &f)
            }
        }
    };
    for (what, groups) in expert_groups(&counts, n, k) {
        let len_c = groups
            .iter()
            .map(|(g, _, _, co)| co + g.extents()[2])
            .max()
            .unwrap();
        // The CPU's f32 result from bf16-rounded operands (an f32 C, as given).
        let mut want = up(&b, &c0[..len_c]);
        b.gemm_grouped(
            want.view_mut(),
            up(&b, &xa).view(),
            up(&b, &xb).view(),
            &groups,
        );
        let want = down(&b, &want);
        for (da, db) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::F32),
            (DType::F32, DType::BF16),
            (DType::BF16, DType::BF16),
        ] {
            // bf16 operands hold the rounded values the CPU multiplied.
            let (a, bm) = (as_dtype(&kb, &xa, da), as_dtype(&kb, &xb, db));
            for dc in [DType::F32, DType::BF16] {
                if dc == DType::BF16 && groups[0].0.beta != 0.0 {
                    continue; // a bf16 C is written, never accumulated into
                }
                for s in [Schedule::FirstToLast, Schedule::LastToFirst] {
                    set_schedule(s);
                    let mut c = as_dtype(&kb, &c0[..len_c], dc);
                    kb.ops()
                        .gemm_grouped_tc(c.view_mut(), a.view(), bm.view(), &groups);
                    set_schedule(Schedule::FirstToLast);
                    let got = widened(&kb, &c);
                    let (tol, want) = match dc {
                        DType::F32 => (
                            Tol {
                                rtol: 1e-5,
                                atol: 2e-5,
                            },
                            want.clone(),
                        ),
                        _ => (BF16, round_bf16(&want)),
                    };
                    let (ae, re) = compare(&got, &want, tol).unwrap_or_else(|e| {
                        panic!("{what}, {da:?} x {db:?} -> {dc:?}, {s:?}: {e}")
                    });
                    println!(
                        "grouped tc {what} {da:?} x {db:?} -> {dc:?}: abs {ae:.2e} rel {re:.2e}"
                    );
                }
            }
        }
        // One group's alpha changed: only its block of C moves.
        let mut other = groups.clone();
        other[4].0.alpha *= 2.0;
        let (a, bm) = (up(&kb, &xa), up(&kb, &xb));
        let mut c1 = up(&kb, &c0[..len_c]);
        let mut c2 = up(&kb, &c0[..len_c]);
        kb.ops()
            .gemm_grouped_tc(c1.view_mut(), a.view(), bm.view(), &groups);
        kb.ops()
            .gemm_grouped_tc(c2.view_mut(), a.view(), bm.view(), &other);
        let (c1, c2) = (down(&kb, &c1), down(&kb, &c2));
        let (g, _, _, co) = other[4];
        let moved: Vec<usize> = (0..len_c).filter(|&i| c1[i] != c2[i]).collect();
        assert!(!moved.is_empty(), "{what}: a changed alpha changed nothing");
        assert!(
            moved.iter().all(|&i| i >= co && i < co + g.extents()[2]),
            "{what}: a changed alpha moved elements outside its group"
        );
    }
}

/// The experts' GEMMs with their rows read from device offsets (`gemm_experts_*`): bitwise
/// what the grouped kernel computes from the same groups given by the host (one tile's
/// arithmetic for both), for the forward, input-gradient and weight-gradient products (the
/// last at beta 1 and at beta 0, where an expert without rows must leave zeros), in both block
/// orders, under the bounds check; and through `NnOps::gemm_experts`, whose host-sized
/// fallback (read back, then the library's GEMMs) and tensor-core form agree with the CPU's.
/// A changed offset must change the result.
#[test]
fn expert_gemms_read_their_rows_from_device_offsets() {
    use ganymede_core::{ExpertGemm, ExpertRows, Routed};
    let (b, kb) = (cpu(), kernels(SMALL));
    let tc = kernels(Tuning {
        grouped_tc: true,
        ..SMALL
    });
    let (n, k) = (20, 40);
    let counts = [0usize, 1, 17, 64, 100, 0, 3];
    let e = counts.len();
    let mut offsets = vec![0usize];
    for c in counts {
        offsets.push(offsets.last().unwrap() + c);
    }
    let rows = *offsets.last().unwrap();
    let mut rng = Lcg::new(43);
    let (xa, xb) = (
        rng.values(rows * n.max(k), 1.0),
        rng.values(e * n * k.max(rows), 1.0),
    );
    let c0 = rng.values(rows * n.max(k) + e * n * k, 1.0);
    let spec = |gemm: Gemm, routed, a, b, c| ExpertGemm {
        gemm: gemm.bf16_inputs(true),
        routed,
        a,
        b,
        c,
    };
    let mut dw = Gemm::new(n, k, 0, true, false);
    dw.alpha = 0.5;
    let cases = [
        (
            "forward",
            spec(
                Gemm::new(0, n, k, false, true),
                Routed::M,
                [k, 0],
                [0, n * k],
                [n, 0],
            ),
        ),
        (
            "input gradient",
            spec(
                Gemm::new(0, k, n, false, false),
                Routed::M,
                [n, 0],
                [0, n * k],
                [k, 0],
            ),
        ),
        (
            "weight gradient, beta 1",
            spec(dw.beta(1.0), Routed::K, [n, 0], [k, 0], [0, n * k]),
        ),
        (
            "weight gradient, beta 0",
            spec(dw, Routed::K, [n, 0], [k, 0], [0, n * k]),
        ),
    ];
    let offs_u32: Vec<u32> = offsets.iter().map(|&x| x as u32).collect();
    for (what, s) in cases {
        let len_c = (rows * n.max(k)).max(e * n * k);
        let run_tc = |o: &[u32], sched| {
            let (a, bm) = (up(&kb, &xa), up(&kb, &xb));
            let off = kb.upload_u32(o, &[e + 1], Category::Activations);
            let mut c = up(&kb, &c0[..len_c]);
            set_schedule(sched);
            kb.ops()
                .gemm_experts_tc(c.view_mut(), a.view(), bm.view(), (off.view(), rows), &s);
            set_schedule(Schedule::FirstToLast);
            down(&kb, &c)
        };
        // The grouped kernel over the host's groups: the same tiles' arithmetic.
        let want = {
            let (a, bm) = (up(&kb, &xa), up(&kb, &xb));
            let mut c = up(&kb, &c0[..len_c]);
            kb.ops()
                .gemm_grouped_tc(c.view_mut(), a.view(), bm.view(), &s.groups(&offsets));
            down(&kb, &c)
        };
        for sched in [Schedule::FirstToLast, Schedule::LastToFirst] {
            let before = ganymede_cuda::host::wide_accesses();
            assert_eq!(run_tc(&offs_u32, sched), want, "{what}, {sched:?}");
            // Aligned operands: runs of four elements load as one access.
            assert!(
                ganymede_cuda::host::wide_accesses() > before,
                "{what}: no wide loads"
            );
        }
        if s.routed == Routed::K && s.gemm.beta == 0.0 {
            // Expert 0 has no rows: its block is beta · C = 0.
            let (g, _, _, co) = s.at(0, 0, 0);
            assert!(
                want[co..co + g.extents()[2]].iter().all(|&x| x == 0.0),
                "{what}"
            );
        }
        // One row moved from expert 3 to expert 4: the result must move.
        let mut moved = offs_u32.clone();
        moved[4] -= 1;
        assert_ne!(
            run_tc(&moved, Schedule::FirstToLast),
            want,
            "{what}: offsets unread"
        );
        // Through the seam: the CPU's, the kernel backend's fallback and its tensor cores.
        let seam = |be: &dyn Backend| {
            let (a, bm) = (up(be, &xa), up(be, &xb));
            let off = be.upload_u32(&offs_u32, &[e + 1], Category::Activations);
            let mut c = up(be, &c0[..len_c]);
            let r = ExpertRows::Device {
                offsets: off.view(),
                rows,
            };
            be.gemm_experts(c.view_mut(), a.view(), bm.view(), r, &s);
            down(be, &c)
        };
        let cpu_host = {
            let (a, bm) = (up(&b, &xa), up(&b, &xb));
            let mut c = up(&b, &c0[..len_c]);
            b.gemm_experts(
                c.view_mut(),
                a.view(),
                bm.view(),
                ExpertRows::Host(&offsets),
                &s,
            );
            down(&b, &c)
        };
        assert_eq!(
            seam(&b),
            cpu_host,
            "{what}: the CPU's device and host offsets"
        );
        assert!(!kb.experts_on_device(true) && tc.experts_on_device(true));
        assert!(!tc.experts_on_device(false), "f32 GEMMs are the library's");
        for (name, got) in [("fallback", seam(&kb)), ("tensor cores", seam(&tc))] {
            let tol = Tol {
                rtol: 1e-5,
                atol: 2e-5,
            };
            compare(&got, &cpu_host, tol).unwrap_or_else(|err| panic!("{what}, {name}: {err}"));
        }
    }
}

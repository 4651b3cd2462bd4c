//! Learning-rate schedules at known points, and global gradient-norm clipping.

use ganymede_config::{OptimizerConfig, Schedule};
use ganymede_core::{Backend, Category, CpuBackend, Memory, ParamKind, ParamSpec, ParamStore};
use ganymede_optim::{clip_grad_norm, global_norm, lr_at};

fn cfg(schedule: Schedule) -> OptimizerConfig {
    OptimizerConfig {
        lr: 1.0,
        schedule,
        warmup_steps: 10,
        min_lr_ratio: 0.1,
        decay_fraction: 0.2,
        ..Default::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn warmup_is_linear_from_the_first_step() {
    for s in [Schedule::Constant, Schedule::Cosine, Schedule::Wsd] {
        let c = cfg(s);
        assert!(close(lr_at(&c, 0, 110), 0.1));
        assert!(close(lr_at(&c, 4, 110), 0.5));
        assert!(close(lr_at(&c, 9, 110), 1.0));
    }
}

#[test]
fn cosine_known_points() {
    let c = cfg(Schedule::Cosine);
    // 111 steps: warmup 0..=9, cosine over steps 10..=110 (span 100).
    assert!(close(lr_at(&c, 10, 111), 1.0));
    // A quarter of the way: 0.1 + 0.45·(1 + cos(π/4)); halfway: (1 + 0.1)/2.
    let quarter = 0.1 + 0.45 * (1.0 + std::f64::consts::FRAC_1_SQRT_2);
    assert!(close(lr_at(&c, 35, 111), quarter));
    assert!(close(lr_at(&c, 60, 111), 0.55));
    assert!(close(lr_at(&c, 110, 111), 0.1));
    assert!(close(lr_at(&c, 500, 111), 0.1));
    // Monotone after warmup.
    let v: Vec<f64> = (10..111).map(|s| lr_at(&c, s, 111)).collect();
    assert!(v.windows(2).all(|w| w[1] <= w[0]));
}

#[test]
fn wsd_known_points() {
    let c = cfg(Schedule::Wsd);
    // 100 steps, decay over the last 20 (80..=99), stable before.
    assert!(close(lr_at(&c, 10, 100), 1.0));
    assert!(close(lr_at(&c, 79, 100), 1.0));
    assert!(close(lr_at(&c, 80, 100), 1.0 - 0.9 / 20.0));
    assert!(close(lr_at(&c, 89, 100), 1.0 - 0.9 * 10.0 / 20.0));
    assert!(close(lr_at(&c, 99, 100), 0.1));
    assert!(close(lr_at(&c, 150, 100), 0.1));
}

#[test]
fn constant_and_no_warmup() {
    let mut c = cfg(Schedule::Constant);
    assert!(close(lr_at(&c, 50, 100), 1.0));
    assert!(close(lr_at(&c, 99, 100), 1.0));
    c.warmup_steps = 0;
    c.schedule = Schedule::Cosine;
    assert!(close(lr_at(&c, 0, 100), 1.0));
    assert!(close(lr_at(&c, 99, 100), 0.1));
    // Degenerate runs do not divide by zero.
    assert!(lr_at(&c, 0, 1).is_finite() && lr_at(&c, 0, 0).is_finite());
}

fn grads(be: &CpuBackend, values: &[&[f32]], kinds: &[ParamKind]) -> ParamStore {
    let specs: Vec<ParamSpec> = values
        .iter()
        .zip(kinds)
        .enumerate()
        .map(|(i, (v, &k))| ParamSpec::new(format!("p{i}"), &[v.len()], k))
        .collect();
    let t = values
        .iter()
        .map(|v| be.upload(v, &[v.len()], Category::Grads))
        .collect();
    ParamStore::from_tensors(specs, t)
}

#[test]
fn clipping_scales_to_max_norm_and_reports_the_norm_before() {
    let be = CpuBackend::default();
    // Norm sqrt(3² + 4² + 12²) = 13 over two tensors; the buffer's gradient is not counted.
    let kinds = [ParamKind::Matrix, ParamKind::Vector, ParamKind::Buffer];
    let mut g = grads(&be, &[&[3.0, 4.0], &[12.0], &[100.0]], &kinds);
    let norm = clip_grad_norm(&be as &dyn Backend, &mut g, 1.0);
    assert!((norm - 13.0).abs() < 1e-9);
    let after = global_norm(&be, &g);
    assert!((after - 1.0).abs() < 1e-6, "after clipping: {after}");
    let v = be.download(g.get(0).view());
    assert!((v[0] - 3.0 / 13.0).abs() < 1e-6 && (v[1] - 4.0 / 13.0).abs() < 1e-6);
    assert_eq!(be.download(g.get(2).view()), vec![100.0]);

    // Below the threshold, or disabled: untouched, norm still reported.
    let mut g = grads(&be, &[&[3.0, 4.0]], &kinds[..1]);
    assert!((clip_grad_norm(&be, &mut g, 10.0) - 5.0).abs() < 1e-9);
    assert!((clip_grad_norm(&be, &mut g, 0.0) - 5.0).abs() < 1e-9);
    assert_eq!(be.download(g.get(0).view()), vec![3.0, 4.0]);

    // Non-finite: reported, gradients left alone.
    let mut g = grads(&be, &[&[f32::NAN, 1.0]], &kinds[..1]);
    assert!(clip_grad_norm(&be, &mut g, 1.0).is_nan());
    assert_eq!(be.download(g.get(0).view())[1], 1.0);
}

/// Large tensors take the threaded path of `sumsq`/`scale`; the norm is still exact in f64.
#[test]
fn clipping_large_tensors() {
    let be = CpuBackend::default();
    let n = 1 << 18;
    let v = vec![0.5f32; n];
    let mut g = grads(&be, &[&v, &v], &[ParamKind::Experts, ParamKind::Embedding]);
    let norm = clip_grad_norm(&be, &mut g, 2.0);
    assert!((norm - (2.0 * n as f64 * 0.25).sqrt()).abs() < 1e-9);
    assert!((global_norm(&be, &g) - 2.0).abs() < 1e-5);
}

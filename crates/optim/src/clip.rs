//! Global gradient-norm clipping.

use ganymede_core::{Backend, Category, DType, ParamStore};

/// Scale all gradients by `max_norm/(‖g‖ + 1e-6)` when the global L2 norm `‖g‖` (over every
/// trainable parameter, accumulated in f64) exceeds `max_norm`, as PyTorch's `clip_grad_norm_`.
/// Returns the norm before clipping. `max_norm <= 0` disables clipping. A non-finite norm leaves
/// the gradients untouched (scaling would only spread the NaN); the caller sees it and decides
/// (the trainer stops before the update, `ganymede_parallel::driver::check_finite`).
/// The trainer instead works the coefficient out on the device
/// ([`ganymede_core::OptimOps::step_scale`], [`clip_coef`]'s value) and passes it to
/// `Optimizer::step_scaled`, whose update kernels read it there and scale each gradient as
/// they read it: the same bits without this pass, and no read before the update.
pub fn clip_grad_norm(be: &dyn Backend, grads: &mut ParamStore, max_norm: f64) -> f64 {
    let norm = global_norm(be, grads);
    if let Some(coef) = clip_coef(norm, max_norm) {
        for (spec, g) in grads.iter_mut() {
            if spec.kind.is_trainable() {
                be.scale(g.view_mut(), coef);
            }
        }
    }
    norm
}

/// The global L2 norm of the trainable entries of `grads`: summed on the device, read once.
pub fn global_norm(be: &dyn Backend, grads: &ParamStore) -> f64 {
    let mut acc = be.zeros_of(&[1], DType::F64, Category::Buffers);
    for (_, g) in grads.iter().filter(|(s, _)| s.kind.is_trainable()) {
        be.sumsq_acc(acc.view_mut(), g.view());
    }
    be.download_f64(acc.view())[0].sqrt()
}

/// The factor gradients of global norm `norm` are scaled by, if clipping applies: `None` when
/// `max_norm <= 0` (disabled), the norm is within it, or the norm is not finite. Shared by every
/// world size, so one process and N ranks clip alike.
pub fn clip_coef(norm: f64, max_norm: f64) -> Option<f32> {
    (max_norm > 0.0 && norm.is_finite() && norm > max_norm)
        .then(|| (max_norm / (norm + 1e-6)) as f32)
}

#[cfg(test)]
mod tests {
    use super::clip_coef;
    use ganymede_core::step_scale_value;

    /// The host's coefficient and the one the step works out on the device agree bit for bit
    /// where clipping applies and where it does not; only a norm that is not finite differs on
    /// purpose (no clipping here, a stop there).
    #[test]
    fn the_device_coefficient_is_clip_coefs() {
        for (sumsq, max) in [(16.0, 1.0), (1e6, 0.5), (0.81, 1.0), (9.0, 3.0), (9.0, 0.0)] {
            let want = clip_coef(f64::sqrt(sumsq), max).unwrap_or(1.0);
            assert_eq!(
                step_scale_value(&[sumsq], max),
                f64::from(want),
                "{sumsq}, {max}"
            );
        }
        assert_eq!(step_scale_value(&[16.0], 1.0), f64::from(1.0 / 4.000001f32));
        assert_eq!(clip_coef(f64::NAN, 1.0), None);
        assert!(step_scale_value(&[f64::NAN], 1.0).is_nan());
    }
}

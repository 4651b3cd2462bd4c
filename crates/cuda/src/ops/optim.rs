//! The optimizers' fused updates: `optim.cu` (f32 master state). Hyperparameters are rounded to
//! f32 once on the host, as the CPU backend rounds them.

use super::*;
use ganymede_core::{AdamWStep, OptimOps};

fn f(x: f64) -> Arg {
    Arg::F32(x as f32)
}

fn check_f32(op: &str, views: &[(DType, usize)], n: usize) {
    for &(dt, len) in views {
        assert_eq!((dt, len), (DType::F32, n), "{op}: f32 views of one length");
    }
}

impl<L: Launcher> OptimOps for KernelOps<L> {
    /// `adamw_step_f32`, or with `rounded` (a bf16 view) `adamw_step_f32_rounded`.
    fn adamw_step(
        &self,
        param: ViewMut,
        m: ViewMut,
        v: ViewMut,
        grad: View,
        h: &AdamWStep,
        rounded: Option<ViewMut>,
    ) {
        let n = param.len();
        let views = [
            (param.dtype(), n),
            (m.dtype(), m.len()),
            (v.dtype(), v.len()),
            (grad.dtype(), grad.len()),
        ];
        check_f32("adamw_step", &views, n);
        check_rounded("adamw_step", rounded.as_ref(), n);
        if n == 0 {
            return;
        }
        let mut args = Args::from([
            self.arg_mut(param),
            self.arg_mut(m),
            self.arg_mut(v),
            self.arg(grad),
        ]);
        let k = match rounded {
            Some(r) => {
                args.push(self.arg_mut(r));
                kernel!("adamw_step_f32_rounded")
            }
            None => kernel!("adamw_step_f32"),
        };
        args.extend([
            i64_of(n),
            Arg::F32(h.grad_scale),
            f(h.beta1),
            f(h.beta2),
            f(1.0 - h.beta1),
            f(1.0 - h.beta2),
            f(1.0 - h.lr * h.weight_decay),
            f(h.lr / h.bias_correction1),
            f(1.0 / h.bias_correction2.sqrt()),
            f(h.eps),
        ]);
        self.launch(k, self.ew(n), &args);
    }

    /// `decay_update_f32`, or with `rounded` `decay_update_f32_rounded`.
    fn decay_update(
        &self,
        param: ViewMut,
        update: View,
        alpha: f64,
        decay: f64,
        rounded: Option<ViewMut>,
    ) {
        let n = param.len();
        check_f32(
            "decay_update",
            &[(param.dtype(), n), (update.dtype(), update.len())],
            n,
        );
        check_rounded("decay_update", rounded.as_ref(), n);
        if n == 0 {
            return;
        }
        let mut args = Args::from([self.arg_mut(param), self.arg(update)]);
        let k = match rounded {
            Some(r) => {
                args.push(self.arg_mut(r));
                kernel!("decay_update_f32_rounded")
            }
            None => kernel!("decay_update_f32"),
        };
        args.extend([i64_of(n), f(alpha), f(1.0 - decay)]);
        self.launch(k, self.ew(n), &args);
    }

    fn nesterov_momentum(&self, buf: ViewMut, grad: ViewMut, momentum: f64, grad_scale: f32) {
        let n = buf.len();
        let views = [(buf.dtype(), n), (grad.dtype(), grad.len())];
        check_f32("nesterov_momentum", &views, n);
        if n == 0 {
            return;
        }
        let args = [
            self.arg_mut(buf),
            self.arg_mut(grad),
            i64_of(n),
            f(momentum),
            Arg::F32(grad_scale),
        ];
        self.launch(kernel!("nesterov_f32"), self.ew(n), &args);
    }

    fn normalize_frobenius(&self, x: ViewMut, eps: f64) {
        let n = x.len();
        check_f32("normalize_frobenius", &[(x.dtype(), n)], n);
        if n == 0 {
            return;
        }
        // The norm stays on the device: partial sums, their total, then the scaling.
        let blocks = self.sumsq_blocks(n);
        let (_s, [partial, sumsq]) = self.scratch([blocks * 8, 8]);
        self.zero(sumsq, 8);
        self.sumsq_into(sumsq.into(), x.as_view(), partial, blocks);
        let args = [self.arg_mut(x), sumsq.into(), Arg::F64(eps), i64_of(n)];
        self.launch(kernel!("scale_by_inv_norm_f32"), self.ew(n), &args);
    }

    /// Three launches for the whole stack (`sumsq_partial_strided_f32`, `sum_rows_f64`,
    /// `scale_by_inv_norm_strided_f32`), each matrix's partials and sum as
    /// [`Self::normalize_frobenius`] makes them alone: the same bits.
    fn normalize_frobenius_strided(&self, x: ViewMut, count: usize, eps: f64) {
        let len = x.len();
        check_f32("normalize_frobenius_strided", &[(x.dtype(), len)], len);
        if len == 0 {
            return;
        }
        let n = len / count.max(1);
        assert_eq!(
            n * count,
            len,
            "normalize_frobenius_strided: {count} matrices"
        );
        let blocks = self.sumsq_blocks(n);
        let (_s, [partial, sums]) = self.scratch([count * blocks * 8, count * 8]);
        let per_matrix = cfg(grid(blocks, count, 1), self.tuning.ew_block);
        let x = self.arg_mut(x);
        let pass1 = [partial.into(), x, i64_of(n)];
        self.launch(kernel!("sumsq_partial_strided_f32"), per_matrix, &pass1);
        let pass2 = [sums.into(), partial.into(), i32_of(blocks)];
        let sums_shape = cfg(grid(count, 1, 1), 256);
        self.launch(kernel!("sum_rows_f64"), sums_shape, &pass2);
        let pass3 = [x, sums.into(), Arg::F64(eps), i64_of(n)];
        self.launch(kernel!("scale_by_inv_norm_strided_f32"), per_matrix, &pass3);
    }
}

/// The compute copy a fused update writes: bf16, as long as the parameter.
fn check_rounded(op: &str, rounded: Option<&ViewMut>, n: usize) {
    if let Some(r) = rounded {
        assert_eq!(
            (r.dtype(), r.len()),
            (DType::BF16, n),
            "{op}: the rounded copy must be bf16 of the parameter's length"
        );
    }
}

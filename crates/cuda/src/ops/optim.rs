//! The optimizers' fused updates: `optim.cu` (f32 master state). Hyperparameters are rounded to
//! f32 once on the host, as the CPU backend rounds them.

use super::*;
use ganymede_core::{AdamWStep, AdamWTensor, DecayStep, DeviceRate, GradScale, OptimOps};

fn f(x: f64) -> Arg {
    Arg::F32(x as f32)
}

/// A step constant from the host, or 0 where the kernel works it out from the device rate:
/// then no argument changes from step to step.
fn host(h: &AdamWStep, x: f64) -> f64 {
    if h.rate.is_some() {
        0.0
    } else {
        x
    }
}

/// AdamW's constants as its kernels take them, past the gradient scale: β1, β2, 1 − β1, 1 − β2,
/// lr / bc1 and 1 / sqrt(bc2) (each [`host`]), ε.
fn adamw_args(h: &AdamWStep) -> [Arg; 7] {
    [
        f(h.beta1),
        f(h.beta2),
        f(1.0 - h.beta1),
        f(1.0 - h.beta2),
        f(host(h, h.lr / h.bias_correction1)),
        f(host(h, 1.0 / h.bias_correction2.sqrt())),
        f(h.eps),
    ]
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
        let n = check_adamw("adamw_step", [&param, &m, &v], &grad, rounded.as_ref());
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
        let [gs, gsp] = self.grad_scale_args(h.grad_scale);
        let [b1, b2, omb1, omb2, step, inv_sqrt_bc2, eps] = adamw_args(h);
        let keep = f(host(h, 1.0 - h.lr * h.weight_decay));
        args.extend([
            i64_of(n),
            gs,
            gsp,
            b1,
            b2,
            omb1,
            omb2,
            keep,
            step,
            inv_sqrt_bc2,
            eps,
        ]);
        args.extend([self.rate_arg(h.rate), Arg::F64(h.weight_decay)]);
        self.launch(k, self.ew(n), &args);
    }

    /// `adamw_step_multi_f32`: every tensor in one launch over a table of them, uploaded once
    /// (the same tensors every step then launch with the same arguments), bit for bit
    /// `adamw_step_f32` on each.
    fn adamw_step_many(&self, ts: Vec<AdamWTensor>, h: &AdamWStep) {
        let mut table = Vec::with_capacity(8 * ts.len());
        let mut most = 0;
        for t in ts {
            let (pmv, rounded) = ([&t.param, &t.m, &t.v], t.rounded.as_ref());
            let n = check_adamw("adamw_step_many", pmv, &t.grad, rounded);
            if n == 0 {
                continue;
            }
            let blocks = self.ew(n).grid[0] as usize;
            most = most.max(blocks);
            let p16 = t
                .rounded
                .map_or(std::ptr::null_mut(), |r| self.launcher.addr_mut(r));
            table.extend([
                self.launcher.addr_mut(t.param) as i64,
                self.launcher.addr_mut(t.m) as i64,
                self.launcher.addr_mut(t.v) as i64,
                self.launcher.addr(t.grad) as i64,
                p16 as i64,
                n as i64,
                blocks as i64,
                t.weight_decay.to_bits() as i64,
            ]);
        }
        let count = table.len() / 8;
        if count == 0 {
            return;
        }
        assert!(
            count <= u16::MAX as usize,
            "adamw_step_many: {count} tensors"
        );
        let table = self.table(table);
        let [gs, gsp] = self.grad_scale_args(h.grad_scale);
        let [b1, b2, omb1, omb2, step, inv_sqrt_bc2, eps] = adamw_args(h);
        let args = [
            table.into(),
            gs,
            gsp,
            b1,
            b2,
            omb1,
            omb2,
            step,
            inv_sqrt_bc2,
            eps,
            self.rate_arg(h.rate),
            Arg::F64(host(h, h.lr)),
        ];
        let k = kernel!("adamw_step_multi_f32");
        self.launch(k, cfg(grid(most, count, 1), self.tuning.ew_block), &args);
    }

    /// `decay_update_f32`, or with `rounded` `decay_update_f32_rounded`.
    fn decay_update(&self, param: ViewMut, update: View, h: &DecayStep, rounded: Option<ViewMut>) {
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
        let [_, gate] = self.grad_scale_args(h.gate);
        // As in adamw_step: the host's alpha and keep, or the device rate's.
        let host = |x: f64| f(if h.rate.is_some() { 0.0 } else { x });
        args.extend([
            i64_of(n),
            host(h.alpha()),
            host(1.0 - h.decay()),
            gate,
            self.rate_arg(h.rate),
            Arg::F64(h.scale),
            Arg::F64(h.weight_decay),
        ]);
        self.launch(k, self.ew(n), &args);
    }

    fn nesterov_momentum(&self, buf: ViewMut, grad: ViewMut, momentum: f64, scale: GradScale) {
        let n = buf.len();
        let views = [(buf.dtype(), n), (grad.dtype(), grad.len())];
        check_f32("nesterov_momentum", &views, n);
        if n == 0 {
            return;
        }
        let [gs, gsp] = self.grad_scale_args(scale);
        let args = [
            self.arg_mut(buf),
            self.arg_mut(grad),
            i64_of(n),
            f(momentum),
            gs,
            gsp,
        ];
        self.launch(kernel!("nesterov_f32"), self.ew(n), &args);
    }

    /// `step_scale_f64`, one thread: the norm stays on the device.
    fn step_scale(&self, scale: ViewMut, sums: View, max_norm: f64) {
        assert_eq!(
            (scale.dtype(), scale.len()),
            (DType::F64, 1),
            "step_scale: one f64"
        );
        assert!(
            sums.dtype() == DType::F64 && !sums.is_empty(),
            "step_scale: the squared norm and the figures to check, f64"
        );
        let n = sums.len();
        let args = [
            self.arg_mut(scale),
            self.arg(sums),
            i64_of(n),
            Arg::F64(max_norm),
        ];
        self.launch(kernel!("step_scale_f64"), cfg(grid(1, 1, 1), 32), &args);
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
        let op = "normalize_frobenius_strided";
        let Some((n, blocks)) = stack_shape(self, op, (x.dtype(), x.len()), count) else {
            return;
        };
        let (_s, [partial, sums]) = self.scratch([count * blocks * 8, count * 8]);
        let x = self.arg_mut(x);
        let per_matrix = self.matrix_norms(x, n, count, blocks, [partial, sums]);
        let pass3 = [x, sums.into(), Arg::F64(eps), i64_of(n)];
        self.launch(kernel!("scale_by_inv_norm_strided_f32"), per_matrix, &pass3);
    }

    fn normalizes_into_bf16(&self) -> bool {
        true
    }

    /// [`OptimOps::normalize_frobenius_strided`] of `x` (f32, `count` matrices) into `xb`
    /// (bf16, as long), `x` left as it is: each matrix divided by its norm plus `eps` and
    /// rounded to bf16, the operand Newton–Schulz in bf16 multiplies first. The first two
    /// launches as there, the last (`scale_by_inv_norm_strided_f32_to_bf16`) writing the bf16
    /// copy instead of scaling in place: bitwise the normalisation followed by a cast.
    fn normalize_frobenius_strided_bf16(&self, x: View, xb: ViewMut, count: usize, eps: f64) {
        let op = "normalize_frobenius_strided_bf16";
        assert_eq!(
            (xb.dtype(), xb.len()),
            (DType::BF16, x.len()),
            "{op}: the copy is bf16 of x's length"
        );
        let Some((n, blocks)) = stack_shape(self, op, (x.dtype(), x.len()), count) else {
            return;
        };
        let (_s, [partial, sums]) = self.scratch([count * blocks * 8, count * 8]);
        let (x, xb) = (self.arg(x), self.arg_mut(xb));
        let per_matrix = self.matrix_norms(x, n, count, blocks, [partial, sums]);
        let pass3 = [xb, x, sums.into(), Arg::F64(eps), i64_of(n)];
        let k = kernel!("scale_by_inv_norm_strided_f32_to_bf16");
        self.launch(k, per_matrix, &pass3);
    }
}

impl<L: Launcher> KernelOps<L> {
    /// The device rate's address, or null (the host's constants).
    fn rate_arg(&self, r: Option<DeviceRate>) -> Arg {
        r.map_or(Arg::Ptr(std::ptr::null_mut()), |r| self.arg(r.view()))
    }

    /// A gradient scale as the update kernels take it: the value (`gs`, 1 where the device holds
    /// it) and the device scalar's address or null (`gsp`).
    fn grad_scale_args(&self, s: GradScale) -> [Arg; 2] {
        let (v, d) = s.parts();
        let ptr = d.map_or(Arg::Ptr(std::ptr::null_mut()), |d| self.arg(d));
        [Arg::F32(v), ptr]
    }

    /// The squared Frobenius norms of `count` matrices of `n` f32 at `x` into `sums` (f64, one
    /// a matrix), through `blocks` partials each at `partial`; returns the per-matrix grid
    /// (`blocks` × `count`) that a pass over the stack takes.
    fn matrix_norms(
        &self,
        x: Arg,
        n: usize,
        count: usize,
        blocks: usize,
        [partial, sums]: [*mut c_void; 2],
    ) -> LaunchConfig {
        let per_matrix = cfg(grid(blocks, count, 1), self.tuning.ew_block);
        let pass1 = [partial.into(), x, i64_of(n)];
        self.launch(kernel!("sumsq_partial_strided_f32"), per_matrix, &pass1);
        let pass2 = [sums.into(), partial.into(), i32_of(blocks)];
        let sums_shape = cfg(grid(count, 1, 1), 256);
        self.launch(kernel!("sum_rows_f64"), sums_shape, &pass2);
        per_matrix
    }
}

/// A stack of `count` f32 matrices, `x` = (dtype, length): each matrix's length and the
/// blocks of a pass over one; None when it is empty (nothing to launch).
fn stack_shape<L: Launcher>(
    ops: &KernelOps<L>,
    op: &str,
    x: (DType, usize),
    count: usize,
) -> Option<(usize, usize)> {
    let len = x.1;
    check_f32(op, &[x], len);
    if len == 0 {
        return None;
    }
    let n = len / count.max(1);
    assert_eq!(n * count, len, "{op}: {count} matrices");
    Some((n, ops.sumsq_blocks(n)))
}

/// An AdamW tensor's views: f32 parameter, moments and gradient of one length (returned), and
/// a compute copy as [`check_rounded`] wants it.
fn check_adamw(op: &str, [p, m, v]: [&ViewMut; 3], g: &View, rounded: Option<&ViewMut>) -> usize {
    let n = p.len();
    let views = [
        (p.dtype(), n),
        (m.dtype(), m.len()),
        (v.dtype(), v.len()),
        (g.dtype(), g.len()),
    ];
    check_f32(op, &views, n);
    check_rounded(op, rounded, n);
    n
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

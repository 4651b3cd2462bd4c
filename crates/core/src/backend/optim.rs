//! Kernels of the optimizers: fused elementwise updates, one pass over memory each. The
//! matrix work of Muon (Newton–Schulz) is plain [`crate::Blas::gemm`]; what remains elementwise
//! lives here so a GPU backend runs the whole optimizer step on the device.
//!
//! Hyperparameters are f64 so that an f64 backend reproduces a reference exactly; f32 kernels
//! round them once.

use crate::tensor::{DType, View, ViewMut};

/// The factor every update kernel applies to a gradient as it reads it (global-norm clipping's
/// coefficient, or 1), so that clipping costs no pass of its own.
///
/// `Host` is a value the caller knows. `Device` is an f64 `[1]` in device memory that
/// [`OptimOps::step_scale`] wrote, which the kernels read themselves: the step then reads
/// nothing back before its update (issue 32). A device factor that is NaN, a gradient norm
/// that is not finite, stops the update: the kernels write nothing, so the weights and the
/// optimizer state stay as they were for the caller to find when it reads the norm.
#[derive(Clone, Copy)]
pub enum GradScale<'a> {
    Host(f32),
    Device(View<'a>),
}

impl std::fmt::Debug for GradScale<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GradScale::Host(v) => write!(f, "Host({v})"),
            GradScale::Device(v) => write!(f, "Device({:?}[{}])", v.dtype(), v.len()),
        }
    }
}

impl<'a> GradScale<'a> {
    /// As a kernel takes it: the host's factor (1 where the device holds it) and the device
    /// scalar, checked to be the f64 `[1]` the kernels read.
    pub fn parts(&self) -> (f32, Option<View<'a>>) {
        match *self {
            GradScale::Host(v) => (v, None),
            GradScale::Device(v) => {
                assert_eq!(
                    (v.dtype(), v.len()),
                    (DType::F64, 1),
                    "a device gradient scale is one f64"
                );
                (1.0, Some(v))
            }
        }
    }

    /// The factor, or `None` where the update stops, for a backend whose device memory the
    /// host reads directly (the CPU's).
    pub fn on_host(&self) -> Option<f32> {
        match self.parts() {
            (v, None) => Some(v),
            // The factor was an f32 before it was stored: exact.
            (_, Some(d)) => Some(d.host::<f64>()[0])
                .filter(|s| !s.is_nan())
                .map(|s| s as f32),
        }
    }
}

/// [`OptimOps::step_scale`]'s value from the global squared gradient norm, as the host
/// computes it: clipping's coefficient `max_norm / (‖g‖ + 1e-6)` rounded to f32 where the norm
/// exceeds `max_norm > 0`, else 1; NaN where any of `sums` (the squared norm first) is not
/// finite.
pub fn step_scale_value(sums: &[f64], max_norm: f64) -> f64 {
    if sums.iter().any(|s| !s.is_finite()) {
        return f64::NAN;
    }
    let norm = sums[0].sqrt();
    match max_norm > 0.0 && norm > max_norm {
        true => f64::from((max_norm / (norm + 1e-6)) as f32),
        false => 1.0,
    }
}

/// The step's rate in device memory: `[lr, 1 − β1^t, 1 − β2^t]` (f64 `[3]`), written by the
/// host before the update, equal to the host values beside it ([`AdamWStep`], [`DecayStep`]).
/// A backend that launches kernels reads them there, so that its update launches are the same
/// from step to step (what a CUDA graph replays, issue 32); the CPU reads the host's, and checks
/// that they are equal.
#[derive(Clone, Copy)]
pub struct DeviceRate<'a>(View<'a>);

impl std::fmt::Debug for DeviceRate<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceRate({:?}[{}])", self.0.dtype(), self.0.len())
    }
}

impl<'a> DeviceRate<'a> {
    /// `v`: f64 `[3]`, `[lr, bias_correction1, bias_correction2]`.
    pub fn new(v: View<'a>) -> Self {
        assert_eq!(
            (v.dtype(), v.len()),
            (DType::F64, 3),
            "a device rate is [lr, bias_correction1, bias_correction2] in f64"
        );
        DeviceRate(v)
    }
    pub fn view(&self) -> View<'a> {
        self.0
    }
    /// For a backend whose device memory the host reads (the CPU's): panics unless the device
    /// holds `host`, the values the caller passed beside it (the first of them: `[lr]` for a
    /// caller that has no bias corrections).
    pub fn check(&self, host: &[f64]) {
        let d = &self.0.host::<f64>()[..host.len()];
        assert!(
            d.iter().zip(host).all(|(d, h)| d.to_bits() == h.to_bits()),
            "the device rate {d:?} is not the host's {host:?}"
        );
    }
}

/// One AdamW step's constants. The caller computes the bias corrections from the step count.
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep<'a> {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay: θ ← θ·(1 − lr·weight_decay) before the Adam update.
    pub weight_decay: f64,
    /// 1 − beta1^t
    pub bias_correction1: f64,
    /// 1 − beta2^t
    pub bias_correction2: f64,
    /// Each gradient element is multiplied by this first (in the kernel's precision), so that
    /// global-norm clipping costs no pass of its own: the clip coefficient, or 1.
    pub grad_scale: GradScale<'a>,
    /// `lr` and the bias corrections also in device memory, if the caller keeps them there.
    pub rate: Option<DeviceRate<'a>>,
}

impl AdamWStep<'_> {
    /// Step `t` (counted from 1) of AdamW with these hyperparameters: the bias corrections
    /// `1 − β^t`, the gradient unscaled.
    pub fn at_step(
        lr: f64,
        (beta1, beta2): (f64, f64),
        eps: f64,
        weight_decay: f64,
        t: i32,
    ) -> Self {
        AdamWStep {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            bias_correction1: 1.0 - beta1.powi(t),
            bias_correction2: 1.0 - beta2.powi(t),
            grad_scale: GradScale::Host(1.0),
            rate: None,
        }
    }

    /// `[lr, bias_correction1, bias_correction2]`, as a [`DeviceRate`] holds them.
    pub fn rate_values(&self) -> [f64; 3] {
        [self.lr, self.bias_correction1, self.bias_correction2]
    }
}

/// One tensor of [`OptimOps::adamw_step_many`]: a parameter (f32), its moments and gradient,
/// its bf16 compute copy if it has one, and its weight decay.
pub struct AdamWTensor<'a> {
    pub param: ViewMut<'a>,
    pub m: ViewMut<'a>,
    pub v: ViewMut<'a>,
    pub grad: View<'a>,
    pub rounded: Option<ViewMut<'a>>,
    pub weight_decay: f64,
}

/// Muon's decayed update of one parameter (see [`OptimOps::decay_update`]):
/// `θ = θ·(1 − lr·weight_decay) − lr·scale·update`.
#[derive(Clone, Copy, Debug)]
pub struct DecayStep<'a> {
    pub lr: f64,
    /// The parameter's update scale (Muon's shape factor).
    pub scale: f64,
    pub weight_decay: f64,
    /// `lr` also in device memory (its first value), if the caller keeps it there.
    pub rate: Option<DeviceRate<'a>>,
    /// The step's gradient scale, which the momentum already applied; here only its stop
    /// counts (a NaN device scale writes nothing).
    pub gate: GradScale<'a>,
}

impl DecayStep<'_> {
    /// The update's factor, `lr·scale`, in f64.
    pub fn alpha(&self) -> f64 {
        self.lr * self.scale
    }
    /// The decay, `lr·weight_decay`, in f64.
    pub fn decay(&self) -> f64 {
        self.lr * self.weight_decay
    }
}

pub trait OptimOps: Send + Sync {
    /// AdamW (PyTorch's formulation), all four views the same length, with
    /// `g = grad·grad_scale` (the gradient is not written):
    /// `m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²;`
    /// `θ = θ·(1 − lr·wd) − (lr/bc1) · m / (sqrt(v)/sqrt(bc2) + eps)`.
    /// With `rounded` (bf16, the same length) the new θ is also written there rounded: the
    /// bf16 compute copy made by the update instead of by a cast pass of its own, the same bits
    /// as the update followed by [`crate::Blas::cast`].
    fn adamw_step(
        &self,
        param: ViewMut,
        m: ViewMut,
        v: ViewMut,
        grad: View,
        h: &AdamWStep,
        rounded: Option<ViewMut>,
    );

    /// [`Self::adamw_step`] of each of `ts` with `h`'s constants and the tensor's own weight
    /// decay (`h.weight_decay` is not read): a GPU backend updates them all in one launch.
    fn adamw_step_many(&self, ts: Vec<AdamWTensor>, h: &AdamWStep) {
        for t in ts {
            let h = AdamWStep {
                weight_decay: t.weight_decay,
                ..*h
            };
            self.adamw_step(t.param, t.m, t.v, t.grad, &h, t.rounded);
        }
    }

    /// Nesterov momentum, in place on the gradient, which becomes the update:
    /// `g = g·grad_scale; buf = μ·buf + g; g = g + μ·buf` (with the new `buf`); `grad_scale` is
    /// the clip coefficient or 1, as [`AdamWStep::grad_scale`] (a stopped update writes
    /// neither). Sharded Muon keeps no update buffer of its own: the gradient shard is not read
    /// again in the step.
    fn nesterov_momentum(&self, buf: ViewMut, grad: ViewMut, momentum: f64, grad_scale: GradScale);

    /// `scale` (f64 `[1]`) = [`step_scale_value`] of `sums` (f64: the global squared gradient
    /// norm, then any other figures that must be finite for the update to go ahead): clipping's
    /// coefficient, worked out on the device for [`GradScale::Device`] so that the host need
    /// not read the norm before the update.
    fn step_scale(&self, scale: ViewMut, sums: View, max_norm: f64);

    /// `x = x / (‖x‖_F + eps)` with the norm accumulated in f64: Newton–Schulz's normalisation,
    /// on the device so a GPU backend needs no host round trip per matrix.
    fn normalize_frobenius(&self, x: ViewMut, eps: f64);

    /// [`Self::normalize_frobenius`] of each of `count` equal matrices stored one after another
    /// in `x`, each by its own norm: Newton–Schulz of an expert stack. A GPU backend does them
    /// all in a few launches instead of a few per matrix.
    fn normalize_frobenius_strided(&self, mut x: ViewMut, count: usize, eps: f64) {
        let n = x.len().checked_div(count).unwrap_or(0);
        assert_eq!(
            n * count,
            x.len(),
            "normalize_frobenius_strided: {count} matrices"
        );
        for i in 0..count {
            self.normalize_frobenius(x.reborrow().slice(i * n, n), eps);
        }
    }

    /// Whether [`Self::normalize_frobenius_strided_bf16`] is a pass of this backend's: then
    /// Newton–Schulz in bf16 takes its first operand from the normalisation instead of
    /// normalising in place and having its first products cast (issue 32). False by default.
    fn normalizes_into_bf16(&self) -> bool {
        false
    }

    /// `xb` (bf16, as long as `x`) = each of the `count` equal f32 matrices of `x` divided by
    /// (its Frobenius norm + `eps`) and rounded to bf16, `x` left as it is: the same bits as
    /// [`Self::normalize_frobenius_strided`] followed by [`crate::Blas::cast`], in one pass.
    /// Only where [`Self::normalizes_into_bf16`]; the default refuses.
    fn normalize_frobenius_strided_bf16(&self, x: View, xb: ViewMut, count: usize, eps: f64) {
        let _ = (x, xb, count, eps);
        panic!(
            "normalize_frobenius_strided_bf16: not a pass of this backend (normalizes_into_bf16 \
             is false)"
        )
    }

    /// Decay and update: `θ = θ·(1 − decay) − alpha·update` with `alpha = lr·scale` and
    /// `decay = lr·weight_decay` ([`DecayStep`], each product in f64). `rounded` as in
    /// [`Self::adamw_step`].
    fn decay_update(&self, param: ViewMut, update: View, h: &DecayStep, rounded: Option<ViewMut>);
}

/// [`OptimOps`] methods that forward to a field, as [`crate::forward_nn_ops`] does for
/// [`crate::NnOps`]: `forward_optim_ops!(ops: adamw_step, …)` inside an `impl OptimOps` writes
/// each named method as `self.ops.method(args)`.
#[macro_export]
macro_rules! forward_optim_ops {
    ($t:ident: $($m:ident),+ $(,)?) => { $( $crate::forward_optim_ops!(@ $t $m); )+ };
    (@ $t:ident adamw_step) => { $crate::forward_optim_ops!(@fn $t adamw_step(
        param: $crate::ViewMut, m: $crate::ViewMut, v: $crate::ViewMut, grad: $crate::View,
        h: &$crate::AdamWStep, rounded: Option<$crate::ViewMut>)); };
    (@ $t:ident adamw_step_many) => { $crate::forward_optim_ops!(@fn $t adamw_step_many(
        ts: Vec<$crate::AdamWTensor>, h: &$crate::AdamWStep)); };
    (@ $t:ident nesterov_momentum) => { $crate::forward_optim_ops!(@fn $t nesterov_momentum(
        buf: $crate::ViewMut, grad: $crate::ViewMut, momentum: f64,
        grad_scale: $crate::GradScale)); };
    (@ $t:ident step_scale) => { $crate::forward_optim_ops!(@fn $t step_scale(
        scale: $crate::ViewMut, sums: $crate::View, max_norm: f64)); };
    (@ $t:ident normalize_frobenius) => { $crate::forward_optim_ops!(@fn $t normalize_frobenius(
        x: $crate::ViewMut, eps: f64)); };
    (@ $t:ident normalize_frobenius_strided) => { $crate::forward_optim_ops!(@fn $t
        normalize_frobenius_strided(x: $crate::ViewMut, count: usize, eps: f64)); };
    (@ $t:ident normalizes_into_bf16) => {
        fn normalizes_into_bf16(&self) -> bool {
            self.$t.normalizes_into_bf16()
        }
    };
    (@ $t:ident normalize_frobenius_strided_bf16) => { $crate::forward_optim_ops!(@fn $t
        normalize_frobenius_strided_bf16(x: $crate::View, xb: $crate::ViewMut, count: usize,
        eps: f64)); };
    (@ $t:ident decay_update) => { $crate::forward_optim_ops!(@fn $t decay_update(
        param: $crate::ViewMut, update: $crate::View, h: &$crate::DecayStep,
        rounded: Option<$crate::ViewMut>)); };
    (@fn $t:ident $m:ident($($a:ident: $ty:ty),* $(,)?)) => {
        fn $m(&self, $($a: $ty),*) {
            self.$t.$m($($a),*)
        }
    };
}

/// All of [`OptimOps`] forwarded to a field with [`crate::forward_optim_ops`].
#[macro_export]
macro_rules! forward_all_optim_ops {
    ($t:ident) => {
        $crate::forward_optim_ops!($t:
            adamw_step, adamw_step_many, nesterov_momentum, normalize_frobenius,
            normalize_frobenius_strided, normalizes_into_bf16, normalize_frobenius_strided_bf16,
            decay_update, step_scale,
        );
    };
}

//! CPU kernels of the optimizers. Each is one pass over its arrays, split across rayon's threads
//! in fixed chunks above [`PAR_MIN`] elements (results do not depend on the thread count: every
//! element's update is independent).

use super::{CpuBackend, PAR_MIN};
use crate::backend::{step_scale_value, AdamWStep, Blas, DecayStep, GradScale, OptimOps};
use crate::tensor::{Scalar, View, ViewMut};
use rayon::prelude::*;

fn adamw<S: Scalar>(p: ViewMut, m: ViewMut, v: ViewMut, g: View, h: &AdamWStep, gs: f32) {
    let (p, m, v, g): (&mut [S], &mut [S], &mut [S], &[S]) =
        (p.host(), m.host(), v.host(), g.host());
    let n = p.len();
    assert!(
        m.len() == n && v.len() == n && g.len() == n,
        "adamw lengths"
    );
    let c = S::of_f64;
    let (b1, b2, omb1, omb2) = (c(h.beta1), c(h.beta2), c(1.0 - h.beta1), c(1.0 - h.beta2));
    let keep = c(1.0 - h.lr * h.weight_decay);
    let step = c(h.lr / h.bias_correction1);
    let inv_sqrt_bc2 = c(1.0 / h.bias_correction2.sqrt());
    let eps = c(h.eps);
    let gs = c(f64::from(gs));
    let kernel = |p: &mut [S], m: &mut [S], v: &mut [S], g: &[S]| {
        for i in 0..p.len() {
            let gi = g[i] * gs;
            let mi = b1 * m[i] + omb1 * gi;
            let vi = b2 * v[i] + omb2 * gi * gi;
            m[i] = mi;
            v[i] = vi;
            p[i] = p[i] * keep - step * mi / (vi.sqrt() * inv_sqrt_bc2 + eps);
        }
    };
    if n < PAR_MIN {
        kernel(p, m, v, g);
    } else {
        p.par_chunks_mut(PAR_MIN)
            .zip(m.par_chunks_mut(PAR_MIN))
            .zip(v.par_chunks_mut(PAR_MIN))
            .zip(g.par_chunks(PAR_MIN))
            .for_each(|(((p, m), v), g)| kernel(p, m, v, g));
    }
}

fn nesterov<S: Scalar>(buf: ViewMut, g: ViewMut, mu: f64, grad_scale: f32) {
    let (buf, g): (&mut [S], &mut [S]) = (buf.host(), g.host());
    let n = buf.len();
    assert!(g.len() == n, "nesterov lengths");
    let (mu, gs) = (S::of_f64(mu), S::of_f64(f64::from(grad_scale)));
    let kernel = |b: &mut [S], g: &mut [S]| {
        for i in 0..b.len() {
            let gi = g[i] * gs;
            let bi = mu * b[i] + gi;
            b[i] = bi;
            g[i] = gi + mu * bi;
        }
    };
    if n < PAR_MIN {
        kernel(buf, g);
    } else {
        buf.par_chunks_mut(PAR_MIN)
            .zip(g.par_chunks_mut(PAR_MIN))
            .for_each(|(b, g)| kernel(b, g));
    }
}

fn normalize<S: Scalar>(x: ViewMut, eps: f64) {
    let x: &mut [S] = x.host();
    let sq = |c: &[S]| c.iter().map(|&v| v.as_f64() * v.as_f64()).sum::<f64>();
    // Fixed chunks: the sum's rounding does not depend on the thread count.
    let sumsq: f64 = if x.len() < PAR_MIN {
        sq(x)
    } else {
        let parts: Vec<f64> = x.par_chunks(PAR_MIN).map(sq).collect();
        parts.iter().sum()
    };
    let f = S::of_f64(1.0 / (sumsq.sqrt() + eps));
    if x.len() < PAR_MIN {
        x.iter_mut().for_each(|v| *v *= f);
    } else {
        x.par_chunks_mut(PAR_MIN)
            .for_each(|c| c.iter_mut().for_each(|v| *v *= f));
    }
}

fn decay_update<S: Scalar>(p: ViewMut, u: View, alpha: f64, decay: f64) {
    let (p, u): (&mut [S], &[S]) = (p.host(), u.host());
    assert_eq!(p.len(), u.len(), "decay_update lengths");
    let (alpha, keep) = (S::of_f64(alpha), S::of_f64(1.0 - decay));
    let kernel = |p: &mut [S], u: &[S]| {
        p.iter_mut()
            .zip(u)
            .for_each(|(p, &u)| *p = *p * keep - alpha * u)
    };
    if p.len() < PAR_MIN {
        kernel(p, u);
    } else {
        p.par_chunks_mut(PAR_MIN)
            .zip(u.par_chunks(PAR_MIN))
            .for_each(|(p, u)| kernel(p, u));
    }
}

impl OptimOps for CpuBackend {
    // The CPU has no traffic to save: a rounded copy is the update's cast.
    fn adamw_step(
        &self,
        mut param: ViewMut,
        m: ViewMut,
        v: ViewMut,
        grad: View,
        h: &AdamWStep,
        rounded: Option<ViewMut>,
    ) {
        // A stopped update (see GradScale) writes nothing.
        let Some(gs) = h.grad_scale.on_host() else {
            return;
        };
        if let Some(r) = h.rate {
            r.check(&h.rate_values());
        }
        crate::by_dtype!(param.dtype(), adamw(param.reborrow(), m, v, grad, h, gs));
        if let Some(r) = rounded {
            self.cast(r, param.as_view());
        }
    }
    fn nesterov_momentum(&self, buf: ViewMut, grad: ViewMut, momentum: f64, scale: GradScale) {
        if let Some(gs) = scale.on_host() {
            crate::by_dtype!(buf.dtype(), nesterov(buf, grad, momentum, gs))
        }
    }
    fn step_scale(&self, scale: ViewMut, sums: View, max_norm: f64) {
        assert_eq!(
            (scale.dtype(), scale.len()),
            (crate::DType::F64, 1),
            "step_scale: one f64"
        );
        let s = step_scale_value(sums.host::<f64>(), max_norm);
        scale.host::<f64>()[0] = s;
    }
    fn normalize_frobenius(&self, x: ViewMut, eps: f64) {
        crate::by_dtype!(x.dtype(), normalize(x, eps))
    }
    fn decay_update(
        &self,
        mut param: ViewMut,
        update: View,
        h: &DecayStep,
        rounded: Option<ViewMut>,
    ) {
        if h.gate.on_host().is_none() {
            return;
        }
        if let Some(r) = h.rate {
            r.check(&[h.lr]);
        }
        let (alpha, decay) = (h.alpha(), h.decay());
        let dt = param.dtype();
        crate::by_dtype!(dt, decay_update(param.reborrow(), update, alpha, decay));
        if let Some(r) = rounded {
            self.cast(r, param.as_view());
        }
    }
}

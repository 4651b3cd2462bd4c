//! Causal grouped-query attention, one rayon task per (sequence, kv head): the task runs every
//! query head of its group, so the key/value gradients it accumulates are its own. Scores are
//! formed a block of query rows at a time with GEMMs (only the columns the causal mask keeps),
//! so memory is one `block × tk` tile per task, never `T × T` per head. Backward recomputes the
//! probabilities from the saved log-sum-exp (as FlashAttention does) instead of storing them.

use super::fastmath::{exp_sub_scale, exp_sub_sum};
use super::Ptr;
use crate::backend::{AttnDims as Dims, AttnGrads, AttnSaved};
use crate::cpu::blas::GemmScalar;
use crate::tensor::{View, ViewMut};
use rayon::prelude::*;

/// Query rows per score tile.
const BLK: usize = 64;

#[derive(Clone, Copy)]
struct CPtr<S>(*const S);
unsafe impl<S> Send for CPtr<S> {}
unsafe impl<S> Sync for CPtr<S> {}

/// Single-threaded `C = alpha · A·B + beta · C` with explicit (row, column) strides; callers
/// guarantee the extents.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn mm<S: GemmScalar>(
    m: usize,
    n: usize,
    k: usize,
    alpha: S,
    a: *const S,
    (rsa, csa): (usize, usize),
    b: *const S,
    (rsb, csb): (usize, usize),
    beta: S,
    c: *mut S,
    rsc: usize,
) {
    S::serial(m, k, n, alpha, a, (rsa, csa), b, (rsb, csb), beta, c, rsc)
}

fn check(d: &Dims, q: usize, k: usize, v: usize, out: usize, lse: usize) {
    assert!(d.tk >= d.tq && d.heads.is_multiple_of(d.kv_heads));
    assert_eq!(
        q,
        d.batch * d.tq * d.heads * d.head_dim,
        "attention: q size"
    );
    assert_eq!(out, q, "attention: out size");
    assert_eq!(
        k,
        d.batch * d.tk * d.kv_heads * d.head_dim,
        "attention: k size"
    );
    assert_eq!(v, k, "attention: v size");
    assert_eq!(lse, d.batch * d.heads * d.tq, "attention: lse size");
}

pub fn forward<S: GemmScalar>(out: ViewMut, lse: ViewMut, q: View, k: View, v: View, d: Dims) {
    let out: &mut [S] = out.host();
    let lse: &mut [S] = lse.host();
    let q: &[S] = q.host();
    let k: &[S] = k.host();
    let v: &[S] = v.host();
    check(&d, q.len(), k.len(), v.len(), out.len(), lse.len());
    let Dims {
        batch,
        tq,
        tk,
        heads,
        kv_heads,
        head_dim: hd,
    } = d;
    let (rep, qd, kd) = (heads / kv_heads, heads * hd, kv_heads * hd);
    let off = tk - tq;
    let scale = S::of_f64(1.0 / (hd as f64).sqrt());
    let (op, lp) = (Ptr(out.as_mut_ptr()), Ptr(lse.as_mut_ptr()));
    let (qp, kp, vp) = (CPtr(q.as_ptr()), CPtr(k.as_ptr()), CPtr(v.as_ptr()));
    (0..batch * kv_heads).into_par_iter().for_each_init(
        || vec![S::zero(); BLK.min(tq) * tk],
        |sc, task| {
            let (op, lp, qp, kp, vp) = (op, lp, qp, kp, vp);
            let (b, g) = (task / kv_heads, task % kv_heads);
            // Safety: sizes were checked; this task writes only its own heads' columns of `out`
            // and rows of `lse`.
            unsafe {
                let kb = kp.0.add(b * tk * kd + g * hd);
                let vb = vp.0.add(b * tk * kd + g * hd);
                for h in g * rep..(g + 1) * rep {
                    let qb = qp.0.add(b * tq * qd + h * hd);
                    let ob = op.0.add(b * tq * qd + h * hd);
                    let lb = lp.0.add((b * heads + h) * tq);
                    for r0 in (0..tq).step_by(BLK) {
                        let r1 = (r0 + BLK).min(tq);
                        let rb = r1 - r0;
                        let nc = off + r1;
                        let s = sc.as_mut_ptr();
                        mm(
                            rb,
                            nc,
                            hd,
                            scale,
                            qb.add(r0 * qd),
                            (qd, 1),
                            kb,
                            (1, kd),
                            S::zero(),
                            s,
                            nc,
                        );
                        for i in 0..rb {
                            let valid = off + r0 + i + 1;
                            let row = &mut sc[i * nc..(i + 1) * nc];
                            let m = row[..valid]
                                .iter()
                                .fold(S::neg_infinity(), |a, &x| a.max(x));
                            let sum = exp_sub_sum(&mut row[..valid], m);
                            *lb.add(r0 + i) = m + sum.ln();
                            let inv = S::one() / sum;
                            row[..valid].iter_mut().for_each(|x| *x *= inv);
                            row[valid..].fill(S::zero());
                        }
                        mm(
                            rb,
                            hd,
                            nc,
                            S::one(),
                            sc.as_ptr(),
                            (nc, 1),
                            vb,
                            (kd, 1),
                            S::zero(),
                            ob.add(r0 * qd),
                            qd,
                        );
                    }
                }
            }
        },
    );
}

pub fn backward<S: GemmScalar>(g: AttnGrads, dout: View, saved: AttnSaved, d: Dims) {
    let AttnSaved { out, q, k, v, lse } = saved;
    let (dq, dk, dv): (&mut [S], &mut [S], &mut [S]) = (g.dq.host(), g.dk.host(), g.dv.host());
    let dout: &[S] = dout.host();
    let out: &[S] = out.host();
    let q: &[S] = q.host();
    let k: &[S] = k.host();
    let v: &[S] = v.host();
    let lse: &[S] = lse.host();
    check(&d, q.len(), k.len(), v.len(), out.len(), lse.len());
    assert!(
        dq.len() == q.len() && dout.len() == q.len() && dk.len() == k.len() && dv.len() == k.len()
    );
    let Dims {
        batch,
        tq,
        tk,
        heads,
        kv_heads,
        head_dim: hd,
    } = d;
    let (rep, qd, kd) = (heads / kv_heads, heads * hd, kv_heads * hd);
    let off = tk - tq;
    let scale = S::of_f64(1.0 / (hd as f64).sqrt());
    let (dqp, dkp, dvp) = (
        Ptr(dq.as_mut_ptr()),
        Ptr(dk.as_mut_ptr()),
        Ptr(dv.as_mut_ptr()),
    );
    let (qp, kp, vp) = (CPtr(q.as_ptr()), CPtr(k.as_ptr()), CPtr(v.as_ptr()));
    (0..batch * kv_heads).into_par_iter().for_each_init(
        || {
            let n = BLK.min(tq) * tk;
            (vec![S::zero(); n], vec![S::zero(); n])
        },
        |(pt, dpt), task| {
            let (dqp, dkp, dvp, qp, kp, vp) = (dqp, dkp, dvp, qp, kp, vp);
            let (b, g) = (task / kv_heads, task % kv_heads);
            // Safety: sizes were checked; this task owns the columns of its heads in `dq` and of
            // its kv head (rows of sequence `b`) in `dk` and `dv`.
            unsafe {
                let kb = kp.0.add(b * tk * kd + g * hd);
                let vb = vp.0.add(b * tk * kd + g * hd);
                let dkb = dkp.0.add(b * tk * kd + g * hd);
                let dvb = dvp.0.add(b * tk * kd + g * hd);
                for j in 0..tk {
                    std::slice::from_raw_parts_mut(dkb.add(j * kd), hd).fill(S::zero());
                    std::slice::from_raw_parts_mut(dvb.add(j * kd), hd).fill(S::zero());
                }
                for h in g * rep..(g + 1) * rep {
                    let base = b * tq * qd + h * hd;
                    let qb = qp.0.add(base);
                    let dqb = dqp.0.add(base);
                    let lrow = &lse[(b * heads + h) * tq..(b * heads + h + 1) * tq];
                    for r0 in (0..tq).step_by(BLK) {
                        let r1 = (r0 + BLK).min(tq);
                        let rb = r1 - r0;
                        let nc = off + r1;
                        let dob = dout.as_ptr().add(base + r0 * qd);
                        // P, recomputed.
                        mm(
                            rb,
                            nc,
                            hd,
                            scale,
                            qb.add(r0 * qd),
                            (qd, 1),
                            kb,
                            (1, kd),
                            S::zero(),
                            pt.as_mut_ptr(),
                            nc,
                        );
                        // dP = dO · Vᵀ
                        mm(
                            rb,
                            nc,
                            hd,
                            S::one(),
                            dob,
                            (qd, 1),
                            vb,
                            (1, kd),
                            S::zero(),
                            dpt.as_mut_ptr(),
                            nc,
                        );
                        for i in 0..rb {
                            let valid = off + r0 + i + 1;
                            let row = &mut pt[i * nc..(i + 1) * nc];
                            let l = lrow[r0 + i];
                            exp_sub_scale(&mut row[..valid], l, S::one());
                            row[valid..].fill(S::zero());
                            let o = base + (r0 + i) * qd;
                            let dd: S = dout[o..o + hd]
                                .iter()
                                .zip(&out[o..o + hd])
                                .map(|(&a, &b)| a * b)
                                .sum();
                            let drow = &mut dpt[i * nc..(i + 1) * nc];
                            for (ds, &p) in drow.iter_mut().zip(row.iter()) {
                                *ds = p * (*ds - dd);
                            }
                        }
                        // dQ = scale · dS · K;  dK += scale · dSᵀ · Q;  dV += Pᵀ · dO
                        mm(
                            rb,
                            hd,
                            nc,
                            scale,
                            dpt.as_ptr(),
                            (nc, 1),
                            kb,
                            (kd, 1),
                            S::zero(),
                            dqb.add(r0 * qd),
                            qd,
                        );
                        mm(
                            nc,
                            hd,
                            rb,
                            scale,
                            dpt.as_ptr(),
                            (1, nc),
                            qb.add(r0 * qd),
                            (qd, 1),
                            S::one(),
                            dkb,
                            kd,
                        );
                        mm(
                            nc,
                            hd,
                            rb,
                            S::one(),
                            pt.as_ptr(),
                            (1, nc),
                            dob,
                            (qd, 1),
                            S::one(),
                            dvb,
                            kd,
                        );
                    }
                }
            }
        },
    );
}

//! Causal grouped-query attention, one rayon task per (sequence, kv head): the task runs every
//! query head of its group, so the key/value gradients it accumulates are its own. Scores are
//! formed a block of query rows at a time with GEMMs (only the columns the causal mask keeps),
//! so memory is one `block × tk` tile per task, never `T × T` per head. Backward recomputes the
//! probabilities from the saved log-sum-exp (as FlashAttention does) instead of storing them.
//!
//! With document starts (`data.document_mask`) each query row keeps only the keys from its
//! document's start to itself: the same GEMMs, the columns before the start masked like those
//! after the diagonal.

use super::fastmath::{dot, exp_sub_scale, exp_sub_sum, max_of};
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

/// Each query's document start, checked: `[batch, tq]` key positions, query `i`'s at most its
/// own key position `tk - tq + i` (a row with no key would have no softmax) and never below
/// the query before it (the seam's contract, which the device kernels rely on).
fn check_docs<'a>(d: &Dims, docs: Option<View<'a>>) -> Option<&'a [u32]> {
    let docs = docs?.host_u32();
    assert_eq!(docs.len(), d.batch * d.tq, "attention: docs size");
    for (r, &s) in docs.iter().enumerate() {
        let i = r % d.tq;
        assert!(
            s as usize <= d.tk - d.tq + i,
            "attention: query {i} of sequence {} starts its document at key {s}, after itself",
            r / d.tq
        );
        assert!(
            i == 0 || s >= docs[r - 1],
            "attention: query {i} of sequence {} starts its document before the query before it",
            r / d.tq
        );
    }
    Some(docs)
}

/// The keys query row `i` of a sequence sees: `lo .. off + i + 1`.
#[inline]
fn span(docs: Option<&[u32]>, off: usize, i: usize) -> (usize, usize) {
    (docs.map_or(0, |d| d[i] as usize), off + i + 1)
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

/// A row-major matrix through a raw pointer: its first element and row stride.
#[derive(Clone, Copy)]
struct Mat<S>(*const S, usize);
#[derive(Clone, Copy)]
struct MatMut<S>(*mut S, usize);

/// One query head's forward: its `tq` query rows against the first `tk` rows of `k`, `v`
/// (query `i` at key position `tk - tq + i`, from key `docs[i]` if given), into `o` and `lse`
/// (`tq` contiguous values).
///
/// # Safety
/// The matrices hold the rows and `hd` columns read or written; `sc` holds `BLK.min(tq) × tk`.
#[allow(clippy::too_many_arguments)]
unsafe fn head_forward<S: GemmScalar>(
    sc: &mut [S],
    Mat(qb, qd): Mat<S>,
    Mat(kb, kd): Mat<S>,
    Mat(vb, vd): Mat<S>,
    MatMut(ob, od): MatMut<S>,
    lb: *mut S,
    docs: Option<&[u32]>,
    (tq, tk, hd): (usize, usize, usize),
    scale: S,
) {
    let off = tk - tq;
    for r0 in (0..tq).step_by(BLK) {
        let r1 = (r0 + BLK).min(tq);
        let rb = r1 - r0;
        // The tile's columns: keys c0 .. off + r1, c0 the block's first document start (the
        // smallest: starts do not decrease), so no product is formed for keys no row sees.
        let c0 = span(docs, off, r0).0;
        let nc = off + r1 - c0;
        let s = sc.as_mut_ptr();
        mm(
            rb,
            nc,
            hd,
            scale,
            qb.add(r0 * qd),
            (qd, 1),
            kb.add(c0 * kd),
            (1, kd),
            S::zero(),
            s,
            nc,
        );
        for i in 0..rb {
            let (lo, valid) = span(docs, off, r0 + i);
            let (lo, valid) = (lo - c0, valid - c0);
            let row = &mut sc[i * nc..(i + 1) * nc];
            let m = max_of(&row[lo..valid]);
            let sum = exp_sub_sum(&mut row[lo..valid], m);
            *lb.add(r0 + i) = m + sum.ln();
            let inv = S::one() / sum;
            row[lo..valid].iter_mut().for_each(|x| *x *= inv);
            row[..lo].fill(S::zero());
            row[valid..].fill(S::zero());
        }
        mm(
            rb,
            hd,
            nc,
            S::one(),
            sc.as_ptr(),
            (nc, 1),
            vb.add(c0 * vd),
            (vd, 1),
            S::zero(),
            ob.add(r0 * od),
            od,
        );
    }
}

/// What one query head's backward reads: its queries, its kv head's keys and values, the
/// output's gradient and the output, and the head's log-sum-exp row (`tq`).
struct HeadIn<'a, S> {
    q: Mat<S>,
    k: Mat<S>,
    v: Mat<S>,
    dout: Mat<S>,
    out: Mat<S>,
    lse: &'a [S],
    /// Each query's document start, if masked by documents.
    docs: Option<&'a [u32]>,
}

/// One query head's backward: `dq` overwritten, `dk`, `dv` accumulated (`+=`).
///
/// # Safety
/// As [`head_forward`]; `pt`, `dpt` hold `BLK.min(tq) × tk` each, `dd` holds `tq`.
unsafe fn head_backward<S: GemmScalar>(
    (pt, dpt, dd): (&mut [S], &mut [S], &mut [S]),
    x: HeadIn<S>,
    (MatMut(dqb, dqd), MatMut(dkb, dkd), MatMut(dvb, dvd)): (MatMut<S>, MatMut<S>, MatMut<S>),
    (tq, tk, hd): (usize, usize, usize),
    scale: S,
) {
    let (Mat(qb, qd), Mat(kb, kd), Mat(vb, vd)) = (x.q, x.k, x.v);
    let (Mat(dob, dod), Mat(outb, outd)) = (x.dout, x.out);
    let off = tk - tq;
    // Every row's dO·O up front, in one pass: the rows of O are read nowhere else, and reading
    // them between the block GEMMs stalled on each row's cache misses in turn.
    for (i, d) in dd[..tq].iter_mut().enumerate() {
        let dorow = std::slice::from_raw_parts(dob.add(i * dod), hd);
        let orow = std::slice::from_raw_parts(outb.add(i * outd), hd);
        *d = dot(dorow, orow);
    }
    for r0 in (0..tq).step_by(BLK) {
        let r1 = (r0 + BLK).min(tq);
        let rb = r1 - r0;
        // Keys c0 .. off + r1, as in the forward.
        let c0 = span(x.docs, off, r0).0;
        let nc = off + r1 - c0;
        let (kc, vc) = (kb.add(c0 * kd), vb.add(c0 * vd));
        let dor = dob.add(r0 * dod);
        // P, recomputed.
        mm(
            rb,
            nc,
            hd,
            scale,
            qb.add(r0 * qd),
            (qd, 1),
            kc,
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
            dor,
            (dod, 1),
            vc,
            (1, vd),
            S::zero(),
            dpt.as_mut_ptr(),
            nc,
        );
        for i in 0..rb {
            let (lo, valid) = span(x.docs, off, r0 + i);
            let (lo, valid) = (lo - c0, valid - c0);
            let row = &mut pt[i * nc..(i + 1) * nc];
            exp_sub_scale(&mut row[lo..valid], x.lse[r0 + i], S::one());
            row[..lo].fill(S::zero());
            row[valid..].fill(S::zero());
            let dd = dd[r0 + i];
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
            kc,
            (kd, 1),
            S::zero(),
            dqb.add(r0 * dqd),
            dqd,
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
            dkb.add(c0 * dkd),
            dkd,
        );
        mm(
            nc,
            hd,
            rb,
            S::one(),
            pt.as_ptr(),
            (1, nc),
            dor,
            (dod, 1),
            S::one(),
            dvb.add(c0 * dvd),
            dvd,
        );
    }
}

/// `dst = rows × hd` of the bf16 matrix at `src` (row stride `rs`), widened (exactly).
unsafe fn widen(dst: &mut [f32], src: *const u16, rs: usize, hd: usize) {
    for (r, d) in dst.chunks_exact_mut(hd).enumerate() {
        let s = std::slice::from_raw_parts(src.add(r * rs), hd);
        d.iter_mut()
            .zip(s)
            .for_each(|(d, &h)| *d = crate::bf16::to_f32(h));
    }
}

/// The bf16 matrix at `dst` (row stride `rs`) = `src` (`rows × hd`) rounded to nearest even.
unsafe fn narrow(dst: *mut u16, rs: usize, src: &[f32], hd: usize) {
    for (r, s) in src.chunks_exact(hd).enumerate() {
        let d = std::slice::from_raw_parts_mut(dst.add(r * rs), hd);
        d.iter_mut()
            .zip(s)
            .for_each(|(d, &x)| *d = crate::bf16::from_f32(x));
    }
}

/// Forward over f32 or f64 tensors; `docs`: each query's document start (`[batch, tq]` u32).
pub fn forward<S: GemmScalar>(
    out: ViewMut,
    lse: ViewMut,
    (q, k, v): (View, View, View),
    docs: Option<View>,
    d: Dims,
) {
    let docs = check_docs(&d, docs);
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
                let k = Mat(kp.0.add(b * tk * kd + g * hd), kd);
                let v = Mat(vp.0.add(b * tk * kd + g * hd), kd);
                for h in g * rep..(g + 1) * rep {
                    let q = Mat(qp.0.add(b * tq * qd + h * hd), qd);
                    let o = MatMut(op.0.add(b * tq * qd + h * hd), qd);
                    let lb = lp.0.add((b * heads + h) * tq);
                    let ds = docs.map(|d| &d[b * tq..(b + 1) * tq]);
                    head_forward(sc, q, k, v, o, lb, ds, (tq, tk, hd), scale);
                }
            }
        },
    );
}

/// A task's f32 copies of its bf16 operands (`tk × hd` keys and values, `tq × hd` per query
/// head), made once per rayon job like the score tiles.
struct Widened {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    dout: Vec<f32>,
    out: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

impl Widened {
    fn new(d: &Dims, backward: bool) -> Self {
        let (nk, nq) = (d.tk * d.head_dim, d.tq * d.head_dim);
        let bw = |n: usize| vec![0f32; if backward { n } else { 0 }];
        Widened {
            k: vec![0.0; nk],
            v: vec![0.0; nk],
            q: vec![0.0; nq],
            out: vec![0.0; nq],
            dout: bw(nq),
            dq: bw(nq),
            dk: bw(nk),
            dv: bw(nk),
        }
    }
}

/// Forward over bf16 `q`, `k`, `v` and `out` (f32 `lse`), as a bf16 attention kernel with f32
/// arithmetic computes it: the inputs widened exactly, the f32 kernel's math, the output
/// rounded to bf16 once.
pub fn forward_bf16(
    out: ViewMut,
    lse: ViewMut,
    (q, k, v): (View, View, View),
    docs: Option<View>,
    d: Dims,
) {
    let docs = check_docs(&d, docs);
    let out = out.host_bf16();
    let lse: &mut [f32] = lse.host();
    let (q, k, v) = (q.host_bf16(), k.host_bf16(), v.host_bf16());
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
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let (op, lp) = (Ptr(out.as_mut_ptr()), Ptr(lse.as_mut_ptr()));
    let (qp, kp, vp) = (CPtr(q.as_ptr()), CPtr(k.as_ptr()), CPtr(v.as_ptr()));
    (0..batch * kv_heads).into_par_iter().for_each_init(
        || (vec![0f32; BLK.min(tq) * tk], Widened::new(&d, false)),
        |(sc, w), task| {
            let (op, lp, qp, kp, vp) = (op, lp, qp, kp, vp);
            let (b, g) = (task / kv_heads, task % kv_heads);
            // Safety: as in `forward`; the widened copies are this task's own.
            unsafe {
                widen(&mut w.k, kp.0.add(b * tk * kd + g * hd), kd, hd);
                widen(&mut w.v, vp.0.add(b * tk * kd + g * hd), kd, hd);
                let (k, v) = (Mat(w.k.as_ptr(), hd), Mat(w.v.as_ptr(), hd));
                for h in g * rep..(g + 1) * rep {
                    let base = b * tq * qd + h * hd;
                    widen(&mut w.q, qp.0.add(base), qd, hd);
                    let q = Mat(w.q.as_ptr(), hd);
                    let o = MatMut(w.out.as_mut_ptr(), hd);
                    let lb = lp.0.add((b * heads + h) * tq);
                    let ds = docs.map(|d| &d[b * tq..(b + 1) * tq]);
                    head_forward(sc, q, k, v, o, lb, ds, (tq, tk, hd), scale);
                    narrow(op.0.add(base), qd, &w.out, hd);
                }
            }
        },
    );
}

/// Backward over f32 or f64 tensors; `docs` as in [`forward`].
pub fn backward<S: GemmScalar>(
    g: AttnGrads,
    dout: View,
    saved: AttnSaved,
    docs: Option<View>,
    d: Dims,
) {
    let docs = check_docs(&d, docs);
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
    let scale = S::of_f64(1.0 / (hd as f64).sqrt());
    let (dqp, dkp, dvp) = (
        Ptr(dq.as_mut_ptr()),
        Ptr(dk.as_mut_ptr()),
        Ptr(dv.as_mut_ptr()),
    );
    let (qp, kp, vp) = (CPtr(q.as_ptr()), CPtr(k.as_ptr()), CPtr(v.as_ptr()));
    let (dop, outp) = (CPtr(dout.as_ptr()), CPtr(out.as_ptr()));
    (0..batch * kv_heads).into_par_iter().for_each_init(
        || {
            let n = BLK.min(tq) * tk;
            (vec![S::zero(); n], vec![S::zero(); n], vec![S::zero(); tq])
        },
        |(pt, dpt, dd), task| {
            let (dqp, dkp, dvp, qp, kp, vp, dop, outp) = (dqp, dkp, dvp, qp, kp, vp, dop, outp);
            let (b, g) = (task / kv_heads, task % kv_heads);
            // Safety: sizes were checked; this task owns the columns of its heads in `dq` and of
            // its kv head (rows of sequence `b`) in `dk` and `dv`.
            unsafe {
                let kv0 = b * tk * kd + g * hd;
                let dkb = dkp.0.add(kv0);
                let dvb = dvp.0.add(kv0);
                for j in 0..tk {
                    std::slice::from_raw_parts_mut(dkb.add(j * kd), hd).fill(S::zero());
                    std::slice::from_raw_parts_mut(dvb.add(j * kd), hd).fill(S::zero());
                }
                for h in g * rep..(g + 1) * rep {
                    let base = b * tq * qd + h * hd;
                    let l0 = (b * heads + h) * tq;
                    let x = HeadIn {
                        q: Mat(qp.0.add(base), qd),
                        k: Mat(kp.0.add(kv0), kd),
                        v: Mat(vp.0.add(kv0), kd),
                        dout: Mat(dop.0.add(base), qd),
                        out: Mat(outp.0.add(base), qd),
                        lse: &lse[l0..l0 + tq],
                        docs: docs.map(|d| &d[b * tq..(b + 1) * tq]),
                    };
                    let gr = (
                        MatMut(dqp.0.add(base), qd),
                        MatMut(dkb, kd),
                        MatMut(dvb, kd),
                    );
                    head_backward((pt, dpt, dd), x, gr, (tq, tk, hd), scale);
                }
            }
        },
    );
}

/// Backward over bf16 `q`, `k`, `v`, `out`, `dout` and gradients (f32 `lse`): the inputs
/// widened, the f32 math (`dk`, `dv` summed over the group's query heads in f32), each gradient
/// rounded to bf16 once.
pub fn backward_bf16(g: AttnGrads, dout: View, saved: AttnSaved, docs: Option<View>, d: Dims) {
    let docs = check_docs(&d, docs);
    let AttnSaved { out, q, k, v, lse } = saved;
    let (dq, dk, dv) = (g.dq.host_bf16(), g.dk.host_bf16(), g.dv.host_bf16());
    let (dout, out) = (dout.host_bf16(), out.host_bf16());
    let (q, k, v) = (q.host_bf16(), k.host_bf16(), v.host_bf16());
    let lse: &[f32] = lse.host();
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
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let (dqp, dkp, dvp) = (
        Ptr(dq.as_mut_ptr()),
        Ptr(dk.as_mut_ptr()),
        Ptr(dv.as_mut_ptr()),
    );
    let (qp, kp, vp) = (CPtr(q.as_ptr()), CPtr(k.as_ptr()), CPtr(v.as_ptr()));
    let (dop, outp) = (CPtr(dout.as_ptr()), CPtr(out.as_ptr()));
    (0..batch * kv_heads).into_par_iter().for_each_init(
        || {
            let n = BLK.min(tq) * tk;
            (
                vec![0f32; n],
                vec![0f32; n],
                vec![0f32; tq],
                Widened::new(&d, true),
            )
        },
        |(pt, dpt, dd, w), task| {
            let (dqp, dkp, dvp, qp, kp, vp, dop, outp) = (dqp, dkp, dvp, qp, kp, vp, dop, outp);
            let (b, g) = (task / kv_heads, task % kv_heads);
            // Safety: as in `backward`; the widened copies are this task's own.
            unsafe {
                let kv0 = b * tk * kd + g * hd;
                widen(&mut w.k, kp.0.add(kv0), kd, hd);
                widen(&mut w.v, vp.0.add(kv0), kd, hd);
                w.dk.fill(0.0);
                w.dv.fill(0.0);
                for h in g * rep..(g + 1) * rep {
                    let base = b * tq * qd + h * hd;
                    let l0 = (b * heads + h) * tq;
                    widen(&mut w.q, qp.0.add(base), qd, hd);
                    widen(&mut w.dout, dop.0.add(base), qd, hd);
                    widen(&mut w.out, outp.0.add(base), qd, hd);
                    let x = HeadIn {
                        q: Mat(w.q.as_ptr(), hd),
                        k: Mat(w.k.as_ptr(), hd),
                        v: Mat(w.v.as_ptr(), hd),
                        dout: Mat(w.dout.as_ptr(), hd),
                        out: Mat(w.out.as_ptr(), hd),
                        lse: &lse[l0..l0 + tq],
                        docs: docs.map(|d| &d[b * tq..(b + 1) * tq]),
                    };
                    let gr = (
                        MatMut(w.dq.as_mut_ptr(), hd),
                        MatMut(w.dk.as_mut_ptr(), hd),
                        MatMut(w.dv.as_mut_ptr(), hd),
                    );
                    head_backward((pt, dpt, dd), x, gr, (tq, tk, hd), scale);
                    narrow(dqp.0.add(base), qd, &w.dq, hd);
                }
                narrow(dkp.0.add(kv0), kd, &w.dk, hd);
                narrow(dvp.0.add(kv0), kd, &w.dv, hd);
            }
        },
    );
}

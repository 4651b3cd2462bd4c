//! CPU kernels of the model's operations: loops over host slices, generic over [`Scalar`] so the
//! same code runs in f32 (training) and f64 (gradient checks). Work is split over rows (or over
//! (batch, kv head) in attention) with rayon; every output element is written by one task and
//! every reduction runs in a fixed order, so results do not depend on the thread count.

use super::blas::Region;
use super::CpuBackend;
use crate::backend::{
    AttnDims, AttnGrads, AttnSaved, AuxGrad, DispatchOut, Dispatched, EmbedIds, ExpertGemm,
    ExpertRows, Gemm, HeadRope, NnOps, NormSaved, RouterDims, RouterOut,
};
use crate::by_dtype;
use crate::tensor::{DType, Scalar, View, ViewMut};
use rayon::prelude::*;

mod attention;
mod fastmath;
mod grouped;
#[cfg(test)]
mod tests;

use fastmath::{
    dot, dot3, exp_sub_scale, exp_sub_sum, max_of, sum_exp_sub, swiglu_bwd, swiglu_fwd,
};

/// Rows per task for row-wise kernels: enough work to pay for a task.
fn min_rows(dim: usize) -> usize {
    (4096 / dim.max(1)).max(1)
}

/// Rows per partial sum in kernels that reduce weight gradients over rows. Fixed (not derived
/// from the thread count) so the reduction order, and hence the rounding, never changes.
const RED_ROWS: usize = 64;

#[derive(Clone, Copy)]
pub(crate) struct Ptr<S>(pub(crate) *mut S);
unsafe impl<S> Send for Ptr<S> {}
unsafe impl<S> Sync for Ptr<S> {}
impl<S> Ptr<S> {
    /// Through a method, so closures capture the whole (Send) wrapper, not the raw field.
    pub(crate) fn get(self) -> *mut S {
        self.0
    }
}

fn s<S: Scalar>(x: f64) -> S {
    S::of_f64(x)
}

// ---------------------------------------------------------------------------------------------
// Embedding

fn embedding_forward<S: Scalar>(out: ViewMut, wte: View, ids: View, dim: usize) {
    let (out, wte): (&mut [S], &[S]) = (out.host(), wte.host());
    embedding_rows(out, wte, ids, dim, |o, w| o.copy_from_slice(w));
}

/// [`embedding_forward`] from a bf16 table (a bf16 weight under bf16 compute), widened.
fn embedding_forward_bf16(out: ViewMut, wte: View, ids: View, dim: usize) {
    let (out, wte): (&mut [f32], &[u16]) = (out.host(), wte.host_bf16());
    embedding_rows(out, wte, ids, dim, |o, w| {
        o.iter_mut()
            .zip(w)
            .for_each(|(o, &w)| *o = crate::bf16::to_f32(w))
    });
}

/// `row(out[t], wte[ids[t]])` for every token t, rows of `dim`, in parallel.
fn embedding_rows<O: Send, W: Sync>(
    out: &mut [O],
    wte: &[W],
    ids: View,
    dim: usize,
    row: impl Fn(&mut [O], &[W]) + Sync,
) {
    let ids = ids.host_u32();
    assert_eq!(out.len(), ids.len() * dim);
    out.par_chunks_mut(dim)
        .zip(ids.par_iter())
        .with_min_len(min_rows(dim))
        .for_each(|(o, &id)| row(o, &wte[id as usize * dim..(id as usize + 1) * dim]));
}

fn embedding_backward<S: Scalar>(dwte: ViewMut, dout: View, ids: View, dim: usize) {
    let (dwte, dout): (&mut [S], &[S]) = (dwte.host(), dout.host());
    let ids = ids.host_u32();
    // Serial: repeated ids would race, and this is a tiny share of the step.
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        let d = &mut dwte[id * dim..(id + 1) * dim];
        d.iter_mut()
            .zip(&dout[t * dim..(t + 1) * dim])
            .for_each(|(a, &b)| *a += b);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

fn rmsnorm_forward<S: Scalar>(out: ViewMut, rstd: ViewMut, x: View, w: View, dim: usize, eps: f32) {
    let (out, rstd, x, w): (&mut [S], &mut [S], &[S], &[S]) =
        (out.host(), rstd.host(), x.host(), w.host());
    let eps = s::<S>(eps as f64);
    let inv_dim = S::one() / s::<S>(dim as f64);
    out.par_chunks_mut(dim)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(dim))
        .with_min_len(min_rows(dim))
        .for_each(|((o, r), x)| {
            let ss = dot(x, x);
            let rs = S::one() / (ss * inv_dim + eps).sqrt();
            *r = rs;
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = w * (x * rs);
            }
        });
}

/// Backward of `y = w * x * r` for one row: adds into `dx` and `dw`.
#[inline]
fn rms_row_backward<S: Scalar>(dx: &mut [S], dw: &mut [S], dy: &[S], x: &[S], w: &[S], r: S) {
    let len = x.len();
    // Equal lengths up front, so the loop below runs without bounds checks and vectorises.
    let (dx, dw, dy, w) = (&mut dx[..len], &mut dw[..len], &dy[..len], &w[..len]);
    let n = s::<S>(len as f64);
    let c = dot3(dy, w, x) * r * r / n;
    for i in 0..len {
        let xh = x[i] * r;
        dw[i] += dy[i] * xh;
        dx[i] += r * (dy[i] * w[i] - x[i] * c);
    }
}

fn rmsnorm_backward<S: Scalar>(dx: ViewMut, dw: ViewMut, dout: View, saved: NormSaved, dim: usize) {
    let NormSaved { x, w, rstd } = saved;
    let dx: &mut [S] = dx.host();
    let dw: &mut [S] = dw.host();
    let dout: &[S] = dout.host();
    let x: &[S] = x.host();
    let w: &[S] = w.host();
    let rstd: &[S] = rstd.host();
    let partials: Vec<Vec<S>> = dx
        .par_chunks_mut(RED_ROWS * dim)
        .enumerate()
        .map(|(c, dxc)| {
            let mut pdw = vec![S::zero(); dim];
            let r0 = c * RED_ROWS;
            for (i, dxr) in dxc.chunks_mut(dim).enumerate() {
                let r = r0 + i;
                let sl = r * dim..(r + 1) * dim;
                rms_row_backward(dxr, &mut pdw, &dout[sl.clone()], &x[sl], w, rstd[r]);
            }
            pdw
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(a, &b)| *a += b);
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head RMSNorm + RoPE

/// cos and sin tables `[seq, head_dim / 2]` of `pos * inv_freq_i` for positions
/// `pos0 .. pos0 + seq`, `inv_freq_i = theta^(-2i/d)`, computed in `S` the way transformers
/// computes them in f32 (power, reciprocal, product, then cos/sin).
fn rope_table<S: Scalar>(seq: usize, pos0: usize, head_dim: usize, theta: f64) -> (Vec<S>, Vec<S>) {
    let half = head_dim / 2;
    let base = s::<S>(theta);
    let d = s::<S>(head_dim as f64);
    let inv: Vec<S> = (0..half)
        .map(|i| S::one() / base.powf(s::<S>((2 * i) as f64) / d))
        .collect();
    let (mut cs, mut sn) = (vec![S::zero(); seq * half], vec![S::zero(); seq * half]);
    for t in 0..seq {
        let p = s::<S>((pos0 + t) as f64);
        for i in 0..half {
            let a = inv[i] * p;
            cs[t * half + i] = a.cos();
            sn[t * half + i] = a.sin();
        }
    }
    (cs, sn)
}

/// Each row's document start, checked against its position in its sequence.
fn rope_docs<'a>(docs: Option<View<'a>>, rows: usize, seq: usize) -> Option<&'a [u32]> {
    let docs = docs?.host_u32();
    assert_eq!(
        docs.len(),
        rows,
        "head_norm_rope: one document start per row"
    );
    for (r, &s) in docs.iter().enumerate() {
        assert!(
            s as usize <= r % seq,
            "head_norm_rope: row {r} starts its document at {s}, after itself"
        );
    }
    Some(docs)
}

/// Row `t`'s RoPE position within the table: its place in its sequence, from its document's
/// start under document masking.
#[inline]
fn rope_pos(docs: Option<&[u32]>, t: usize, seq: usize) -> usize {
    t % seq - docs.map_or(0, |d| d[t] as usize)
}

fn head_norm_rope_forward<S: Scalar>(
    out: ViewMut,
    rstd: ViewMut,
    (x, w): (View, View),
    docs: Option<View>,
    d: HeadRope,
) {
    let HeadRope {
        heads,
        head_dim: hd,
        seq,
        pos0,
        theta,
        eps,
    } = d;
    let (out, rstd, x, w): (&mut [S], &mut [S], &[S], &[S]) =
        (out.host(), rstd.host(), x.host(), w.host());
    let row = heads * hd;
    let docs = rope_docs(docs, x.len() / row, seq);
    let half = hd / 2;
    let eps = s::<S>(eps as f64);
    let inv_hd = S::one() / s::<S>(hd as f64);
    let (cos, sin) = rope_table::<S>(seq, pos0, hd, theta);
    out.par_chunks_mut(row)
        .zip(rstd.par_chunks_mut(heads))
        .zip(x.par_chunks(row))
        .enumerate()
        .with_min_len(min_rows(row))
        .for_each_init(
            || vec![S::zero(); hd],
            |n, (t, ((o, r), x))| {
                let p = rope_pos(docs, t, seq);
                let (cs, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
                for h in 0..heads {
                    let xh = &x[h * hd..(h + 1) * hd];
                    let rs = S::one() / (dot(xh, xh) * inv_hd + eps).sqrt();
                    r[h] = rs;
                    let (n, w) = (&mut n[..hd], &w[..hd]);
                    for i in 0..hd {
                        n[i] = w[i] * (xh[i] * rs);
                    }
                    let oh = &mut o[h * hd..(h + 1) * hd];
                    for i in 0..half {
                        oh[i] = n[i] * cs[i] - n[i + half] * sn[i];
                        oh[i + half] = n[i + half] * cs[i] + n[i] * sn[i];
                    }
                }
            },
        );
}

fn head_norm_rope_backward<S: Scalar>(
    dx: ViewMut,
    dw: ViewMut,
    dout: View,
    saved: NormSaved,
    docs: Option<View>,
    d: HeadRope,
) {
    let NormSaved { x, w, rstd } = saved;
    let HeadRope {
        heads,
        head_dim: hd,
        seq,
        pos0,
        theta,
        ..
    } = d;
    let dx: &mut [S] = dx.host();
    let dw: &mut [S] = dw.host();
    let dout: &[S] = dout.host();
    let x: &[S] = x.host();
    let w: &[S] = w.host();
    let rstd: &[S] = rstd.host();
    let row = heads * hd;
    let half = hd / 2;
    let docs = rope_docs(docs, x.len() / row, seq);
    let (cos, sin) = rope_table::<S>(seq, pos0, hd, theta);
    let partials: Vec<Vec<S>> = dx
        .par_chunks_mut(RED_ROWS * row)
        .enumerate()
        .map(|(c, dxc)| {
            let mut pdw = vec![S::zero(); hd];
            let mut g = vec![S::zero(); hd];
            for (i, dxr) in dxc.chunks_mut(row).enumerate() {
                let t = c * RED_ROWS + i;
                let p = rope_pos(docs, t, seq);
                let (cs, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
                dxr.fill(S::zero());
                for h in 0..heads {
                    let off = t * row + h * hd;
                    let d = &dout[off..off + hd];
                    // The rotation's transpose takes the gradient back to the normed vector.
                    for i in 0..half {
                        g[i] = d[i] * cs[i] + d[i + half] * sn[i];
                        g[i + half] = d[i + half] * cs[i] - d[i] * sn[i];
                    }
                    rms_row_backward(
                        &mut dxr[h * hd..(h + 1) * hd],
                        &mut pdw,
                        &g,
                        &x[off..off + hd],
                        w,
                        rstd[t * heads + h],
                    );
                }
            }
            pdw
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(a, &b)| *a += b);
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

const EW_CHUNK: usize = 4096;

/// Pieces of a bf16 output computed in f32 on the stack: a multiple of 8 elements, so that a
/// vectorised f32 kernel run piece by piece leaves to its scalar tail the elements it leaves
/// there when run over the whole chunk, and the bits are those of the f32 op then a cast.
const PIECE: usize = 256;

fn round_piece(o: &mut [u16], t: &[f32]) {
    o.iter_mut()
        .zip(t)
        .for_each(|(d, &x)| *d = crate::bf16::from_f32(x));
}

/// Rows of an op computed in `S`: used in place when they are `S` themselves, or, when they
/// are bf16 (`u16`), widened into (inputs) or computed in and rounded once from (outputs) an
/// f32 piece on the stack, so one body serves both and the f32 path makes no extra copy.
trait Rows<S>: Send + Sync + Sized {
    /// The longest slice [`Rows::write`] and [`Rows::read`] take at once.
    const PIECE: usize;
    /// Runs `f` on an `S` slice as long as `o`, then leaves its values in `o`.
    fn write(o: &mut [Self], f: impl FnOnce(&mut [S]));
    /// Runs `f` on `i`'s values as an `S` slice.
    fn read(i: &[Self], f: impl FnOnce(&[S]));
    /// `i`'s values as an `S` slice of any length: `i` itself, or widened into `buf`.
    fn widen<'a>(i: &'a [Self], buf: &'a mut Vec<S>) -> &'a [S];
}

impl<S: Scalar> Rows<S> for S {
    const PIECE: usize = usize::MAX;
    fn write(o: &mut [S], f: impl FnOnce(&mut [S])) {
        f(o)
    }
    fn read(i: &[S], f: impl FnOnce(&[S])) {
        f(i)
    }
    fn widen<'a>(i: &'a [S], _: &'a mut Vec<S>) -> &'a [S] {
        i
    }
}

impl Rows<f32> for u16 {
    const PIECE: usize = PIECE;
    fn write(o: &mut [u16], f: impl FnOnce(&mut [f32])) {
        let mut t = [0f32; PIECE];
        let t = &mut t[..o.len()];
        f(t);
        round_piece(o, t);
    }
    fn read(i: &[u16], f: impl FnOnce(&[f32])) {
        let mut t = [0f32; PIECE];
        let t = &mut t[..i.len()];
        t.iter_mut()
            .zip(i)
            .for_each(|(t, &h)| *t = crate::bf16::to_f32(h));
        f(t)
    }
    fn widen<'a>(i: &'a [u16], buf: &'a mut Vec<f32>) -> &'a [f32] {
        buf.clear();
        buf.extend(i.iter().map(|&h| crate::bf16::to_f32(h)));
        buf
    }
}

fn swiglu_forward<S: Scalar>(out: ViewMut, gate: View, up: View) {
    swiglu_forward_rows::<S, S, S>(out.host(), gate.host(), up.host())
}

/// SwiGLU with inputs stored as `I` and outputs as `O`, computed in `S`.
fn swiglu_forward_rows<S: Scalar, I: Rows<S>, O: Rows<S>>(out: &mut [O], gate: &[I], up: &[I]) {
    out.par_chunks_mut(EW_CHUNK)
        .zip(gate.par_chunks(EW_CHUNK))
        .zip(up.par_chunks(EW_CHUNK))
        .for_each(|((o, g), u)| {
            let n = O::PIECE.min(I::PIECE).min(o.len());
            for ((o, g), u) in o.chunks_mut(n).zip(g.chunks(n)).zip(u.chunks(n)) {
                I::read(g, |g| I::read(u, |u| O::write(o, |t| swiglu_fwd(t, g, u))));
            }
        });
}

fn swiglu_backward<S: Scalar>(dgate: ViewMut, dup: ViewMut, dout: View, gate: View, up: View) {
    let (dg, du) = (dgate.host::<S>(), dup.host::<S>());
    swiglu_backward_rows::<S, S, S>(dg, du, dout.host(), gate.host(), up.host())
}

/// [`swiglu_forward_rows`]'s backward: `dout`, `gate` and `up` stored as `I`, the gradients
/// as `O`.
fn swiglu_backward_rows<S: Scalar, I: Rows<S>, O: Rows<S>>(
    dg: &mut [O],
    du: &mut [O],
    dout: &[I],
    gate: &[I],
    up: &[I],
) {
    dg.par_chunks_mut(EW_CHUNK)
        .zip(du.par_chunks_mut(EW_CHUNK))
        .zip(dout.par_chunks(EW_CHUNK))
        .zip(gate.par_chunks(EW_CHUNK))
        .zip(up.par_chunks(EW_CHUNK))
        .for_each(|((((dg, du), d), g), u)| {
            let n = O::PIECE.min(I::PIECE).min(dg.len());
            let pieces = dg.chunks_mut(n).zip(du.chunks_mut(n));
            let inputs = d.chunks(n).zip(g.chunks(n)).zip(u.chunks(n));
            for ((dg, du), ((d, g), u)) in pieces.zip(inputs) {
                I::read(d, |d| {
                    I::read(g, |g| {
                        I::read(u, |u| {
                            O::write(dg, |tg| O::write(du, |tu| swiglu_bwd(tg, tu, d, g, u)))
                        })
                    })
                });
            }
        });
}

// ---------------------------------------------------------------------------------------------
// Router

fn router_forward<S: Scalar>(out: RouterOut, logits: View, bias: Option<View>, d: RouterDims) {
    let RouterOut {
        probs,
        weights,
        idx,
        psum,
    } = out;
    let RouterDims {
        experts: e,
        k,
        renorm,
    } = d;
    let (probs, weights, logits): (&mut [S], &mut [S], &[S]) =
        (probs.host(), weights.host(), logits.host());
    let (idx, psum) = (idx.host_u32(), psum.host::<f64>());
    assert_eq!(psum.len(), e, "psum holds one sum per expert");
    let bias: Option<&[S]> = bias.map(|b| b.host());
    probs
        .par_chunks_mut(e)
        .zip(weights.par_chunks_mut(k))
        .zip(idx.par_chunks_mut(k))
        .zip(logits.par_chunks(e))
        .with_min_len(min_rows(e * 4))
        .for_each(|(((p, w), ix), l)| {
            let m = max_of(l);
            p.copy_from_slice(l);
            let sum = exp_sub_sum(p, m);
            let inv = S::one() / sum;
            p.iter_mut().for_each(|v| *v *= inv);
            for j in 0..k {
                let mut best = usize::MAX;
                let mut bv = S::neg_infinity();
                for (i, &pv) in p.iter().enumerate() {
                    let sc = match bias {
                        Some(b) => pv + b[i],
                        None => pv,
                    };
                    // Strict `>` keeps the lower index on ties.
                    if (best == usize::MAX || sc > bv) && !ix[..j].contains(&(i as u32)) {
                        best = i;
                        bv = sc;
                    }
                }
                ix[j] = best as u32;
                w[j] = p[best];
            }
            if renorm {
                let s: S = w.iter().copied().sum();
                w.iter_mut().for_each(|v| *v /= s);
            }
        });
    psum.fill(0.0);
    let rows = probs.len() / e;
    let parts: Vec<Vec<f64>> = (0..rows.div_ceil(RED_ROWS))
        .into_par_iter()
        .map(|c| {
            let mut acc = vec![0.0f64; e];
            for r in c * RED_ROWS..((c + 1) * RED_ROWS).min(rows) {
                for (a, &p) in acc.iter_mut().zip(&probs[r * e..(r + 1) * e]) {
                    *a += p.as_f64();
                }
            }
            acc
        })
        .collect();
    for p in &parts {
        psum.iter_mut().zip(p).for_each(|(a, &b)| *a += b);
    }
}

fn router_backward<S: Scalar>(
    dlogits: ViewMut,
    dweights: View,
    probs: View,
    idx: View,
    aux: AuxGrad,
    d: RouterDims,
) {
    let RouterDims {
        experts: e,
        k,
        renorm,
    } = d;
    let (dl, dw, probs): (&mut [S], &[S], &[S]) = (dlogits.host(), dweights.host(), probs.host());
    let (idx, counts) = (idx.host_u32(), aux.counts.host::<f64>());
    assert_eq!(counts.len(), e, "router_backward: counts are [experts]");
    let c: Vec<S> = counts.iter().map(|&n| s::<S>(aux.at(n))).collect();
    dl.par_chunks_mut(e)
        .zip(dw.par_chunks(k))
        .zip(probs.par_chunks(e))
        .zip(idx.par_chunks(k))
        .with_min_len(min_rows(e * 4))
        .for_each(|(((dp, dw), p), ix)| {
            dp.copy_from_slice(&c);
            if renorm {
                // w_j = p_j / Σ p_sel: ∂/∂p_j = (dw_j - Σ_m dw_m w_m) / Σ p_sel.
                let sum: S = ix.iter().map(|&i| p[i as usize]).sum();
                let dot: S = ix
                    .iter()
                    .zip(dw)
                    .map(|(&i, &d)| d * p[i as usize] / sum)
                    .sum();
                for (&i, &d) in ix.iter().zip(dw) {
                    dp[i as usize] += (d - dot) / sum;
                }
            } else {
                for (&i, &d) in ix.iter().zip(dw) {
                    dp[i as usize] += d;
                }
            }
            let dot: S = dp.iter().zip(p).map(|(&d, &p)| d * p).sum();
            for (d, &p) in dp.iter_mut().zip(p) {
                *d = p * (*d - dot);
            }
        });
}

// ---------------------------------------------------------------------------------------------
// Expert dispatch and combine

/// A stable counting sort of the (token, choice) pairs by expert, the order the grouped GEMMs
/// read: serial, as it is O(n·k) integer work next to GEMMs of O(n·k·h·f).
fn moe_dispatch(out: DispatchOut, idx: View, experts: usize, k: usize) {
    let DispatchOut {
        counts,
        offsets,
        src,
        pos,
        totals,
    } = out;
    let (counts, offsets) = (counts.host_u32(), offsets.host_u32());
    let (src, pos, idx) = (src.host_u32(), pos.host_u32(), idx.host_u32());
    assert_eq!(counts.len(), experts);
    assert_eq!(offsets.len(), experts + 1);
    assert!(src.len() == idx.len() && pos.len() == idx.len());
    counts.fill(0);
    for &i in idx.iter() {
        let c = counts
            .get_mut(i as usize)
            .unwrap_or_else(|| panic!("moe_dispatch: expert {i} of {experts}"));
        *c += 1;
    }
    offsets[0] = 0;
    for x in 0..experts {
        offsets[x + 1] = offsets[x] + counts[x];
    }
    if let Some(t) = totals {
        let t = t.host::<f64>();
        assert_eq!(t.len(), experts, "moe_dispatch: totals are [experts]");
        t.iter_mut()
            .zip(counts.iter())
            .for_each(|(t, &c)| *t += c as f64);
    }
    let mut next = offsets[..experts].to_vec();
    for (tj, &i) in idx.iter().enumerate() {
        let p = next[i as usize] as usize;
        next[i as usize] += 1;
        src[p] = (tj / k) as u32;
        pos[tj] = p as u32;
    }
}

fn moe_gather<S: Scalar>(xe: ViewMut, x: View, src: View, dim: usize) {
    let (xe, x): (&mut [S], &[S]) = (xe.host(), x.host());
    gather_rows(xe, x, src, dim, |o, r| o.copy_from_slice(r));
}

/// `xe[r] = put(x[src[r]])` row by row: a copy in one dtype, or f32 rows rounded to bf16
/// (the experts' rows under bf16 compute), or bf16 rows copied.
fn gather_rows<I: Sync, O: Send>(
    xe: &mut [O],
    x: &[I],
    src: View,
    dim: usize,
    put: impl Fn(&mut [O], &[I]) + Sync,
) {
    let src = src.host_u32();
    xe.par_chunks_mut(dim)
        .zip(src.par_iter())
        .with_min_len(min_rows(dim))
        .for_each(|(o, &t)| {
            let t = t as usize;
            put(o, &x[t * dim..(t + 1) * dim])
        });
}

fn moe_gather_backward<S: Scalar>(dx: ViewMut, dxe: View, d: Dispatched) {
    let Dispatched { pos, k, dim } = d;
    let pos = pos.host_u32();
    let (dx, dxe): (&mut [S], &[S]) = (dx.host(), dxe.host());
    dx.par_chunks_mut(dim)
        .zip(pos.par_chunks(k))
        .with_min_len(min_rows(dim * k))
        .for_each(|(d, ps)| {
            for &p in ps {
                let p = p as usize;
                d.iter_mut()
                    .zip(&dxe[p * dim..(p + 1) * dim])
                    .for_each(|(a, &b)| *a += b);
            }
        });
}

fn moe_combine<S: Scalar>(out: ViewMut, ye: View, w: View, d: Dispatched) {
    combine_rows::<S, S>(out.host(), ye.host(), w.host(), d)
}

/// [`moe_combine`] with `ye` stored as `Y` (bf16 GEMM outputs beside f32 tokens): each row
/// widened in pieces, the same sums as on the widened values.
fn combine_rows<S: Scalar, Y: Rows<S>>(out: &mut [S], ye: &[Y], w: &[S], d: Dispatched) {
    let Dispatched { pos, k, dim } = d;
    let pos = pos.host_u32();
    out.par_chunks_mut(dim)
        .zip(pos.par_chunks(k))
        .zip(w.par_chunks(k))
        .with_min_len(min_rows(dim * k))
        .for_each(|((o, ps), ws)| {
            let n = Y::PIECE.min(dim);
            for (&p, &wj) in ps.iter().zip(ws) {
                let p = p as usize;
                for (o, y) in o.chunks_mut(n).zip(ye[p * dim..(p + 1) * dim].chunks(n)) {
                    Y::read(y, |y| o.iter_mut().zip(y).for_each(|(a, &b)| *a += wj * b));
                }
            }
        });
}

fn moe_combine_backward<S: Scalar>(
    dye: ViewMut,
    dw: ViewMut,
    dout: View,
    ye: View,
    w: View,
    d: Dispatched,
) {
    // bf16 rows are written from f32 inputs only (the seam's rule for this op), and bf16
    // expert outputs come with bf16 rows.
    match (dye.dtype(), ye.dtype(), S::DTYPE) {
        (DType::BF16, DType::BF16, DType::F32) => {
            let (dout, w) = (dout.host::<f32>(), w.host::<f32>());
            let (dye, ye) = (dye.host_bf16(), ye.host_bf16());
            combine_backward_rows::<f32, _, _>(dye, dw.host::<f32>(), dout, ye, w, d)
        }
        (DType::BF16, _, DType::F32) => {
            let (dout, ye, w) = (dout.host::<f32>(), ye.host::<f32>(), w.host::<f32>());
            let dye = dye.host_bf16();
            combine_backward_rows::<f32, _, f32>(dye, dw.host::<f32>(), dout, ye, w, d)
        }
        _ => {
            let (dout, ye, w) = (dout.host(), ye.host(), w.host());
            combine_backward_rows::<S, S, S>(dye.host(), dw.host(), dout, ye, w, d)
        }
    }
}

/// [`moe_combine_backward`] into rows of `dye` of either storage, from `ye` of either storage
/// (see [`Rows`]; a bf16 `ye` row is widened whole, so its dot is the widened values' dot).
fn combine_backward_rows<S: Scalar, O: Rows<S>, Y: Rows<S>>(
    dye: &mut [O],
    dw: &mut [S],
    dout: &[S],
    ye: &[Y],
    w: &[S],
    d: Dispatched,
) {
    let Dispatched { pos, k, dim } = d;
    let pos = pos.host_u32();
    assert_eq!(dye.len(), pos.len() * dim);
    assert!(ye.len() == dye.len() && dw.len() == pos.len() && w.len() == pos.len());
    // Each dispatched row holds exactly one (token, choice): invert `pos`, checking that it is a
    // permutation, so every row of `dye` is written by one task and no unsafe code is needed.
    let mut inv = vec![u32::MAX; pos.len()];
    for (i, &p) in pos.iter().enumerate() {
        let slot = inv.get_mut(p as usize).unwrap_or_else(|| {
            panic!(
                "moe_combine_backward: row {p} out of range ({} rows)",
                pos.len()
            )
        });
        assert!(
            *slot == u32::MAX,
            "moe_combine_backward: row {p} dispatched twice (pos is not a permutation)"
        );
        *slot = i as u32;
    }
    // One pass over the dispatched rows in their order: `ye`, the largest operand, is streamed
    // (token order reached its rows at random), and each row's `dout` serves both products.
    let mut dwp = Vec::with_capacity(pos.len());
    dye.par_chunks_mut(dim)
        .zip(ye.par_chunks(dim))
        .zip(inv.par_iter())
        .with_min_len(min_rows(dim))
        .map_init(Vec::new, |buf, ((dy, y), &i)| {
            let y = Y::widen(y, buf);
            let (i, t) = (i as usize, i as usize / k);
            let d = &dout[t * dim..(t + 1) * dim];
            let n = O::PIECE.min(dim);
            for (dy, d) in dy.chunks_mut(n).zip(d.chunks(n)) {
                O::write(dy, |r| {
                    r.iter_mut().zip(d).for_each(|(a, &b)| *a = w[i] * b)
                });
            }
            dot(d, y)
        })
        .collect_into_vec(&mut dwp);
    for (&i, &v) in inv.iter().zip(&dwp) {
        dw[i as usize] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

fn cross_entropy_forward<S: Scalar>(
    lse: ViewMut,
    logits: View,
    targets: View,
    v: usize,
    loss: ViewMut,
) {
    let (lse, logits): (&mut [S], &[S]) = (lse.host(), logits.host());
    let targets = targets.host_u32();
    lse.par_iter_mut()
        .zip(logits.par_chunks(v))
        .with_min_len(min_rows(v))
        .for_each(|(l, x)| {
            let m = max_of(x);
            *l = m + sum_exp_sub(x, m).ln();
        });
    let mut total = 0.0f64;
    for (r, &t) in targets.iter().enumerate() {
        total += (lse[r] - logits[r * v + t as usize]).as_f64();
    }
    loss.host::<f64>()[0] += total;
}

fn cross_entropy_backward<S: Scalar>(
    logits: ViewMut,
    lse: View,
    targets: View,
    v: usize,
    scale: f32,
) {
    let (logits, lse): (&mut [S], &[S]) = (logits.host(), lse.host());
    let targets = targets.host_u32();
    let scale = s::<S>(scale as f64);
    logits
        .par_chunks_mut(v)
        .zip(lse.par_iter())
        .zip(targets.par_iter())
        .with_min_len(min_rows(v))
        .for_each(|((x, &l), &t)| {
            exp_sub_scale(x, l, scale);
            x[t as usize] -= scale;
        });
}

/// bf16 logits (the head GEMM's bf16 output under bf16 compute): each row widened to f32 and
/// taken through the f32 kernel's arithmetic; the gradient rounded back into the row.
fn cross_entropy_forward_bf16(lse: ViewMut, logits: View, targets: View, v: usize, loss: ViewMut) {
    let (lse, logits): (&mut [f32], &[u16]) = (lse.host(), logits.host_bf16());
    let targets = targets.host_u32();
    lse.par_iter_mut()
        .zip(logits.par_chunks(v))
        .with_min_len(min_rows(v))
        .for_each_init(Vec::new, |buf, (l, x)| {
            let x = <u16 as Rows<f32>>::widen(x, buf);
            let m = max_of(x);
            *l = m + sum_exp_sub(x, m).ln();
        });
    let mut total = 0.0f64;
    for (r, &t) in targets.iter().enumerate() {
        total += f64::from(lse[r] - crate::bf16::to_f32(logits[r * v + t as usize]));
    }
    loss.host::<f64>()[0] += total;
}

fn cross_entropy_backward_bf16(logits: ViewMut, lse: View, targets: View, v: usize, scale: f32) {
    let (logits, lse): (&mut [u16], &[f32]) = (logits.host_bf16(), lse.host());
    let targets = targets.host_u32();
    logits
        .par_chunks_mut(v)
        .zip(lse.par_iter())
        .zip(targets.par_iter())
        .with_min_len(min_rows(v))
        .for_each_init(Vec::new, |buf: &mut Vec<f32>, ((x, &l), &t)| {
            <u16 as Rows<f32>>::widen(x, buf);
            exp_sub_scale(buf, l, scale);
            buf[t as usize] -= scale;
            round_piece(x, buf);
        });
}

// ---------------------------------------------------------------------------------------------

fn dt(v: &View) -> DType {
    v.dtype()
}

/// An op on f32 rows whose output is bf16 (attention's rows under bf16 compute): `f` writes
/// f32, rounded once into `out` after, as a cast would. Otherwise `f` writes `out` itself.
fn rounded_into(out: ViewMut, rows: DType, f: impl FnOnce(ViewMut)) {
    if out.dtype() == DType::BF16 && rows == DType::F32 {
        let o = out.host_bf16();
        let mut t = vec![0.0f32; o.len()];
        f(ViewMut::Host(&mut t));
        round_piece(o, &t);
    } else {
        f(out)
    }
}

/// An op on f32 rows that reads a bf16 input (attention's gradients under bf16 compute):
/// widened first (exactly), as a cast would. Otherwise `f` reads `x` itself.
fn widened(x: View, rows: DType, f: impl FnOnce(View)) {
    if x.dtype() == DType::BF16 && rows == DType::F32 {
        let t: Vec<f32> = x
            .host_bf16()
            .iter()
            .map(|&h| crate::bf16::to_f32(h))
            .collect();
        f(View::Host(&t))
    } else {
        f(x)
    }
}

fn attention_fwd(
    out: ViewMut,
    lse: ViewMut,
    qkv: (View, View, View),
    docs: Option<View>,
    d: AttnDims,
) {
    match dt(&qkv.0) {
        DType::F32 => attention::forward::<f32>(out, lse, qkv, docs, d),
        DType::F64 => attention::forward::<f64>(out, lse, qkv, docs, d),
        DType::BF16 => attention::forward_bf16(out, lse, qkv, docs, d),
        DType::U32 => panic!("a u32 tensor where a float one is expected"),
    }
}

fn attention_bwd(g: AttnGrads, dout: View, s: AttnSaved, docs: Option<View>, d: AttnDims) {
    match dt(&s.q) {
        DType::F32 => attention::backward::<f32>(g, dout, s, docs, d),
        DType::F64 => attention::backward::<f64>(g, dout, s, docs, d),
        DType::BF16 => attention::backward_bf16(g, dout, s, docs, d),
        DType::U32 => panic!("a u32 tensor where a float one is expected"),
    }
}

impl NnOps for CpuBackend {
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]) {
        // Nothing to write (an expert-parallel rank that received no rows): the operands' and
        // C's dtypes need no kernel.
        if groups.iter().all(|(g, ..)| g.m == 0 || g.n == 0) {
            return;
        }
        let (bf16, unchanged) = crate::backend::grouped_casts(groups);
        if bf16 {
            // Whole views: which rows the groups read changes with the routing.
            let n = (a.len(), b.len());
            let regions: Vec<_> = groups
                .iter()
                .map(|(g, _, _, at)| (Region::of(g, *at), g.beta))
                .collect();
            return self.with_bf16_operands(a, b, n, unchanged, |a, b| {
                self.with_f32_output(c, &regions, |c| {
                    grouped::gemm_grouped::<f32>(c, a, b, groups)
                })
            });
        }
        match c.dtype() {
            DType::F32 => grouped::gemm_grouped::<f32>(c, a, b, groups),
            DType::F64 => grouped::gemm_grouped::<f64>(c, a, b, groups),
            DType::BF16 => panic!("the CPU backend has no bf16 kernels"),
            DType::U32 => panic!("a u32 tensor where a float one is expected"),
        }
    }
    fn gemm_experts(&self, c: ViewMut, a: View, b: View, rows: ExpertRows, g: &ExpertGemm) {
        // This backend's memory is the host's: offsets "on the device" are read where they are.
        let offsets: Vec<usize> = match rows {
            ExpertRows::Host(o) => o.to_vec(),
            ExpertRows::Device { offsets, .. } => {
                offsets.host_u32().iter().map(|&x| x as usize).collect()
            }
        };
        self.gemm_grouped(c, a, b, &g.groups(&offsets))
    }
    fn experts_on_device(&self, _bf16_inputs: bool) -> bool {
        true
    }
    fn embedding_forward(&self, out: ViewMut, wte: View, ids: View, dim: usize) {
        match (out.dtype(), wte.dtype()) {
            (DType::F32, DType::BF16) => embedding_forward_bf16(out, wte, ids, dim),
            (o, w) => {
                assert_eq!(o, w, "embedding_forward: a {} table", w.name());
                by_dtype!(o, embedding_forward(out, wte, ids, dim))
            }
        }
    }
    fn embedding_backward(&self, dwte: ViewMut, dout: View, ids: EmbedIds, dim: usize) {
        // Row by row in token order, the ids read in place: the grouping is not needed.
        by_dtype!(dt(&dout), embedding_backward(dwte, dout, ids.ids, dim))
    }
    fn rmsnorm_forward(&self, out: ViewMut, rstd: ViewMut, x: View, w: View, dim: usize, eps: f32) {
        by_dtype!(dt(&x), rmsnorm_forward(out, rstd, x, w, dim, eps))
    }
    fn rmsnorm_backward(&self, dx: ViewMut, dw: ViewMut, dout: View, s: NormSaved, dim: usize) {
        by_dtype!(dt(&s.x), rmsnorm_backward(dx, dw, dout, s, dim))
    }
    fn head_norm_rope_forward(&self, out: ViewMut, rstd: ViewMut, x: View, w: View, d: HeadRope) {
        rounded_into(out, dt(&x), |out| {
            by_dtype!(dt(&x), head_norm_rope_forward(out, rstd, (x, w), None, d))
        })
    }
    fn head_norm_rope_backward(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        d: HeadRope,
    ) {
        widened(dout, dt(&s.x), |dout| {
            by_dtype!(dt(&s.x), head_norm_rope_backward(dx, dw, dout, s, None, d))
        })
    }
    fn head_norm_rope_forward_docs(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        x: View,
        w: View,
        docs: View,
        d: HeadRope,
    ) {
        rounded_into(out, dt(&x), |out| {
            by_dtype!(
                dt(&x),
                head_norm_rope_forward(out, rstd, (x, w), Some(docs), d)
            )
        })
    }
    fn head_norm_rope_backward_docs(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        docs: View,
        d: HeadRope,
    ) {
        widened(dout, dt(&s.x), |dout| {
            by_dtype!(
                dt(&s.x),
                head_norm_rope_backward(dx, dw, dout, s, Some(docs), d)
            )
        })
    }
    fn attention_forward(
        &self,
        out: ViewMut,
        lse: ViewMut,
        q: View,
        k: View,
        v: View,
        d: AttnDims,
    ) {
        attention_fwd(out, lse, (q, k, v), None, d)
    }
    fn attention_backward(&self, g: AttnGrads, dout: View, s: AttnSaved, d: AttnDims) {
        attention_bwd(g, dout, s, None, d)
    }
    fn attention_forward_docs(
        &self,
        out: ViewMut,
        lse: ViewMut,
        q: View,
        k: View,
        v: View,
        docs: View,
        d: AttnDims,
    ) {
        attention_fwd(out, lse, (q, k, v), Some(docs), d)
    }
    fn attention_backward_docs(
        &self,
        g: AttnGrads,
        dout: View,
        s: AttnSaved,
        docs: View,
        d: AttnDims,
    ) {
        attention_bwd(g, dout, s, Some(docs), d)
    }
    fn swiglu_forward(&self, out: ViewMut, gate: View, up: View) {
        match (out.dtype(), dt(&gate)) {
            (DType::BF16, DType::F32) => {
                swiglu_forward_rows::<f32, _, _>(out.host_bf16(), gate.host::<f32>(), up.host())
            }
            (DType::BF16, DType::BF16) => {
                swiglu_forward_rows::<f32, _, _>(out.host_bf16(), gate.host_bf16(), up.host_bf16())
            }
            (_, g) => by_dtype!(g, swiglu_forward(out, gate, up)),
        }
    }
    fn swiglu_backward(&self, dgate: ViewMut, dup: ViewMut, dout: View, gate: View, up: View) {
        let (dg16, du16) = (dgate.dtype() == DType::BF16, dup.dtype() == DType::BF16);
        assert_eq!(
            dg16, du16,
            "swiglu_backward: dgate and dup in different dtypes"
        );
        match (dgate.dtype(), dt(&gate)) {
            (DType::BF16, DType::F32) => {
                let (dg, du) = (dgate.host_bf16(), dup.host_bf16());
                let (d, g, u) = (dout.host::<f32>(), gate.host::<f32>(), up.host::<f32>());
                swiglu_backward_rows::<f32, _, _>(dg, du, d, g, u)
            }
            (DType::BF16, DType::BF16) => {
                let (dg, du) = (dgate.host_bf16(), dup.host_bf16());
                let (d, g, u) = (dout.host_bf16(), gate.host_bf16(), up.host_bf16());
                swiglu_backward_rows::<f32, _, _>(dg, du, d, g, u)
            }
            (_, g) => by_dtype!(g, swiglu_backward(dgate, dup, dout, gate, up)),
        }
    }
    fn router_forward(&self, out: RouterOut, logits: View, bias: Option<View>, d: RouterDims) {
        by_dtype!(dt(&logits), router_forward(out, logits, bias, d))
    }
    fn router_backward(
        &self,
        dlogits: ViewMut,
        dweights: View,
        probs: View,
        idx: View,
        aux: AuxGrad,
        d: RouterDims,
    ) {
        by_dtype!(
            dt(&probs),
            router_backward(dlogits, dweights, probs, idx, aux, d)
        )
    }
    fn moe_dispatch(&self, out: DispatchOut, idx: View, experts: usize, k: usize) {
        moe_dispatch(out, idx, experts, k)
    }
    fn moe_gather(&self, xe: ViewMut, x: View, src: View, dim: usize) {
        match (xe.dtype(), dt(&x)) {
            (DType::BF16, DType::F32) => {
                gather_rows(xe.host_bf16(), x.host::<f32>(), src, dim, round_piece)
            }
            (DType::BF16, DType::BF16) => gather_rows(
                xe.host_bf16(),
                x.host_bf16(),
                src,
                dim,
                <[u16]>::copy_from_slice,
            ),
            (_, d) => by_dtype!(d, moe_gather(xe, x, src, dim)),
        }
    }
    fn moe_gather_backward(&self, dx: ViewMut, dxe: View, d: Dispatched) {
        by_dtype!(dt(&dxe), moe_gather_backward(dx, dxe, d))
    }
    fn moe_combine(&self, out: ViewMut, ye: View, w: View, d: Dispatched) {
        match (out.dtype(), dt(&ye)) {
            (DType::F32, DType::BF16) => {
                combine_rows::<f32, _>(out.host(), ye.host_bf16(), w.host(), d)
            }
            (o, _) => by_dtype!(o, moe_combine(out, ye, w, d)),
        }
    }
    fn moe_combine_backward(
        &self,
        dye: ViewMut,
        dw: ViewMut,
        dout: View,
        ye: View,
        w: View,
        d: Dispatched,
    ) {
        by_dtype!(dt(&dout), moe_combine_backward(dye, dw, dout, ye, w, d))
    }
    fn cross_entropy_forward(
        &self,
        lse: ViewMut,
        logits: View,
        targets: View,
        vocab: usize,
        loss: ViewMut,
    ) {
        match dt(&logits) {
            DType::BF16 => cross_entropy_forward_bf16(lse, logits, targets, vocab, loss),
            d => by_dtype!(d, cross_entropy_forward(lse, logits, targets, vocab, loss)),
        }
    }
    fn cross_entropy_backward(
        &self,
        logits: ViewMut,
        lse: View,
        targets: View,
        vocab: usize,
        scale: f32,
    ) {
        match logits.dtype() {
            DType::BF16 => cross_entropy_backward_bf16(logits, lse, targets, vocab, scale),
            _ => by_dtype!(
                dt(&lse),
                cross_entropy_backward(logits, lse, targets, vocab, scale)
            ),
        }
    }
}

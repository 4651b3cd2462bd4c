//! One transformer block, forward and backward, as explicit kernel calls:
//!
//! ```text
//! xn1 = rmsnorm(x)            q,k,v = xn1·Wqᵀ, xn1·Wkᵀ, xn1·Wvᵀ
//! qr,kr = rope(headnorm(q,k))  att = attention(qr, kr, v)
//! xmid = x + att·Woᵀ          xn2 = rmsnorm(xmid)
//! y = xmid + mlp(xn2)         mlp = Σ_topk w·expert(xn2) [+ shared(xn2)]  or a dense SwiGLU
//! ```
//!
//! Routed experts run as one GEMM per expert over the tokens routed to it (rows grouped by
//! expert); the every-token SwiGLU (dense layer or stacked shared experts) is one GEMM for gate
//! and up across all its experts.

use crate::experts::{ExpertExecutor, ExpertsBwdBufs, ExpertsFwdBufs, ExpertsIo};
use crate::workspace::{BlockActs, FfnActs, GradScratch};
use crate::{LayerIdx, MlpIdx, Model};
use ganymede_core::{Backend, Gemm, ParamStore, Tensor, View, ViewMut};

/// Where attention's keys and values live.
pub(crate) enum Kv<'a> {
    /// The block's own buffers (training, evaluation).
    Own,
    /// A cache holding `pos0` earlier positions of one sequence; the call appends its tokens.
    Cache {
        k: &'a mut Tensor,
        v: &'a mut Tensor,
        pos0: usize,
    },
}

/// Forward through one block. `y` receives the output; `None` recomputes the internals only
/// (activation checkpointing: the output is already known).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    li: &LayerIdx,
    a: &mut BlockActs,
    g: &mut GradScratch,
    x: View,
    mut y: Option<ViewMut>,
    batch: usize,
    seq: usize,
    kv: Kv,
    (layer, ex): (usize, &mut dyn ExpertExecutor),
) {
    let cfg = model.config();
    let n = batch * seq;
    let (h, qd, kd, nh, nkv, hd) = (
        cfg.hidden,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
    );
    let (eps, theta) = (cfg.norm_eps as f32, cfg.rope_theta);
    let w = |i: usize| params.get(i).view();

    be.rmsnorm_forward(
        a.xn1.view_mut(),
        a.rstd1.view_mut(),
        x,
        w(li.in_norm),
        h,
        eps,
    );
    be.gemm(
        a.q.view_mut(),
        a.xn1.view(),
        w(li.q),
        Gemm::new(n, qd, h, false, true),
    );
    be.gemm(
        a.k.view_mut(),
        a.xn1.view(),
        w(li.k),
        Gemm::new(n, kd, h, false, true),
    );
    be.gemm(
        a.v.view_mut(),
        a.xn1.view(),
        w(li.v),
        Gemm::new(n, kd, h, false, true),
    );
    let pos0 = match &kv {
        Kv::Own => 0,
        Kv::Cache { pos0, .. } => *pos0,
    };
    #[rustfmt::skip]
    be.head_norm_rope_forward(a.qr.view_mut(), a.rstdq.view_mut(), a.q.view(), w(li.q_norm), nh, hd, seq, pos0, theta, eps);
    match kv {
        Kv::Own => {
            #[rustfmt::skip]
            be.head_norm_rope_forward(a.kr.view_mut(), a.rstdk.view_mut(), a.k.view(), w(li.k_norm), nkv, hd, seq, 0, theta, eps);
            #[rustfmt::skip]
            be.attention_forward(a.att.view_mut(), a.lse.view_mut(), a.qr.view(), a.kr.view(), a.v.view(), batch, seq, seq, nh, nkv, hd);
        }
        Kv::Cache { k, v, pos0 } => {
            assert_eq!(batch, 1, "a KV cache holds one sequence");
            let tk = pos0 + seq;
            #[rustfmt::skip]
            be.head_norm_rope_forward(k.slice_mut(pos0 * kd, n * kd), a.rstdk.view_mut(), a.k.view(), w(li.k_norm), nkv, hd, seq, pos0, theta, eps);
            be.copy(v.slice_mut(pos0 * kd, n * kd), a.v.view());
            #[rustfmt::skip]
            be.attention_forward(a.att.view_mut(), a.lse.view_mut(), a.qr.view(), k.slice(0, tk * kd), v.slice(0, tk * kd), 1, seq, tk, nh, nkv, hd);
        }
    }
    be.gemm(
        a.xmid.view_mut(),
        a.att.view(),
        w(li.o),
        Gemm::new(n, h, qd, false, true),
    );
    be.add(a.xmid.view_mut(), x);
    #[rustfmt::skip]
    be.rmsnorm_forward(a.xn2.view_mut(), a.rstd2.view_mut(), a.xmid.view(), w(li.post_norm), h, eps);
    if let Some(y) = y.as_mut() {
        be.copy(y.reborrow(), a.xmid.view());
    }

    match li.mlp {
        MlpIdx::Dense { gate, up, down } => {
            let f = a.ffn.as_mut().expect("dense activations");
            #[rustfmt::skip]
            ffn_forward(be, f, a.xn2.view(), params, (gate, up, down), 1, cfg.dense_hidden, y, n, h);
        }
        MlpIdx::Moe {
            router,
            gate,
            up,
            down,
            shared,
            bias,
        } => {
            let (e, k, f) = (cfg.experts, cfg.top_k, cfg.expert_hidden);
            let m = a.moe.as_mut().expect("MoE activations");
            let rl = g.drl.as_mut().expect("router scratch");
            be.gemm(
                rl.view_mut(),
                a.xn2.view(),
                w(router),
                Gemm::new(n, e, h, false, true),
            );
            be.router_forward(
                m.probs.view_mut(),
                m.rw.view_mut(),
                &mut m.r.idx[..n * k],
                &mut m.r.psum,
                rl.slice(0, n * e),
                bias.map(w),
                e,
                k,
                cfg.norm_topk_prob,
            );
            m.r.dispatch(k);
            be.moe_gather(m.xe.view_mut(), a.xn2.view(), &m.r.src, h);
            let io = ExpertsIo {
                layer,
                counts: &m.r.counts,
                offsets: &m.r.offsets,
                f,
                h,
                params,
                gate,
                up,
                down,
            };
            let bufs = ExpertsFwdBufs {
                xe: m.xe.view(),
                g: m.g.view_mut(),
                u: m.u.view_mut(),
                a: m.a.view_mut(),
                ye: m.ye.view_mut(),
            };
            ex.forward(be, &io, bufs);
            if let Some(y) = y.as_mut() {
                be.moe_combine(y.reborrow(), m.ye.view(), m.rw.view(), &m.r.pos, k, h);
            }
            if let Some(sh) = shared {
                let f = a.ffn.as_mut().expect("shared-expert activations");
                #[rustfmt::skip]
                ffn_forward(be, f, a.xn2.view(), params, sh, cfg.shared_experts, cfg.shared_hidden(), y, n, h);
            }
        }
    }
}

/// Every-token SwiGLU of `parts` stacked experts of hidden `fs`; adds its output into `y`.
#[allow(clippy::too_many_arguments)]
fn ffn_forward(
    be: &dyn Backend,
    f: &mut FfnActs,
    xn: View,
    params: &ParamStore,
    (gate, up, down): (usize, usize, usize),
    parts: usize,
    fs: usize,
    y: Option<ViewMut>,
    n: usize,
    h: usize,
) {
    let width = parts * fs;
    let nw = n * width;
    let gm = Gemm::new(n, width, h, false, true);
    be.gemm(f.g.slice_mut(0, nw), xn, params.get(gate).view(), gm);
    be.gemm(f.u.slice_mut(0, nw), xn, params.get(up).view(), gm);
    be.swiglu_forward(f.a.slice_mut(0, nw), f.g.slice(0, nw), f.u.slice(0, nw));
    if let Some(mut y) = y {
        let wd = params.get(down);
        for s in 0..parts {
            be.gemm(
                y.reborrow(),
                f.a.slice(s * fs, (n - 1) * width + fs),
                wd.slice(s * h * fs, h * fs),
                Gemm::new(n, h, fs, false, true).ld(width, fs, h).beta(1.0),
            );
        }
    }
}

/// Backward through one block whose internals are in `a`. On entry `g.dres` holds the gradient
/// of the block's output; on return, of its input `x`. Weight gradients are added to `grads`.
/// `dprob_const` is the auxiliary loss's gradient with respect to each router probability.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_backward(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    grads: &mut ParamStore,
    li: &LayerIdx,
    a: &BlockActs,
    g: &mut GradScratch,
    x: View,
    batch: usize,
    seq: usize,
    dprob_const: &[f64],
    (layer, ex): (usize, &mut dyn ExpertExecutor),
) {
    let cfg = model.config();
    let n = batch * seq;
    let (h, qd, kd, nh, nkv, hd) = (
        cfg.hidden,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
    );
    let theta = cfg.rope_theta;
    let w = |i: usize| params.get(i).view();

    // MLP: its gradient into g.dxn (the gradient of xn2).
    match li.mlp {
        MlpIdx::Dense { gate, up, down } => {
            let f = a.ffn.as_ref().expect("dense activations");
            #[rustfmt::skip]
            ffn_backward(be, f, a.xn2.view(), params, grads, (gate, up, down), 1, cfg.dense_hidden, g, 0.0, n, h);
        }
        MlpIdx::Moe {
            router,
            gate,
            up,
            down,
            shared,
            ..
        } => {
            let (e, k, f) = (cfg.experts, cfg.top_k, cfg.expert_hidden);
            let m = a.moe.as_ref().expect("MoE activations");
            let GradScratch {
                dres,
                dxn,
                drl,
                drw,
                dye,
                da,
                dg,
                du,
                dxe,
                ..
            } = &mut *g;
            let (drl, drw, dye, da) = (
                drl.as_mut().unwrap(),
                drw.as_mut().unwrap(),
                dye.as_mut().unwrap(),
                da.as_mut().unwrap(),
            );
            let (dg, du, dxe) = (
                dg.as_mut().unwrap(),
                du.as_mut().unwrap(),
                dxe.as_mut().unwrap(),
            );
            #[rustfmt::skip]
            be.moe_combine_backward(dye.view_mut(), drw.view_mut(), dres.view(), m.ye.view(), m.rw.view(), &m.r.pos, k, h);
            let io = ExpertsIo {
                layer,
                counts: &m.r.counts,
                offsets: &m.r.offsets,
                f,
                h,
                params,
                gate,
                up,
                down,
            };
            let bufs = ExpertsBwdBufs {
                xe: m.xe.view(),
                g: m.g.view(),
                u: m.u.view(),
                a: m.a.view(),
                dye: dye.view(),
                da: da.view_mut(),
                dg: dg.view_mut(),
                du: du.view_mut(),
                dxe: dxe.view_mut(),
            };
            ex.backward(be, &io, grads, bufs);
            #[rustfmt::skip]
            be.router_backward(drl.view_mut(), drw.view(), m.probs.view(), &m.r.idx, dprob_const, e, k, cfg.norm_topk_prob);
            be.gemm(
                dxn.view_mut(),
                drl.view(),
                w(router),
                Gemm::new(n, h, e, false, false),
            );
            #[rustfmt::skip]
            be.gemm(grads.get_mut(router).view_mut(), drl.view(), a.xn2.view(), Gemm::new(e, h, n, true, false).beta(1.0));
            be.moe_gather_backward(dxn.view_mut(), dxe.view(), &m.r.pos, k, h);
            if let Some(sh) = shared {
                let f = a.ffn.as_ref().expect("shared-expert activations");
                #[rustfmt::skip]
                ffn_backward(be, f, a.xn2.view(), params, grads, sh, cfg.shared_experts, cfg.shared_hidden(), g, 1.0, n, h);
            }
        }
    }
    #[rustfmt::skip]
    be.rmsnorm_backward(g.dres.view_mut(), grads.get_mut(li.post_norm).view_mut(), g.dxn.view(), a.xmid.view(), w(li.post_norm), a.rstd2.view(), h);

    // Attention: the residual passes g.dres through unchanged; add the branch's gradient.
    be.gemm(
        g.datt.view_mut(),
        g.dres.view(),
        w(li.o),
        Gemm::new(n, qd, h, false, false),
    );
    #[rustfmt::skip]
    be.gemm(grads.get_mut(li.o).view_mut(), g.dres.view(), a.att.view(), Gemm::new(h, qd, n, true, false).beta(1.0));
    #[rustfmt::skip]
    be.attention_backward(g.dqr.view_mut(), g.dkr.view_mut(), g.dv.view_mut(), g.datt.view(), a.att.view(), a.qr.view(), a.kr.view(), a.v.view(), a.lse.view(), batch, seq, seq, nh, nkv, hd);
    #[rustfmt::skip]
    be.head_norm_rope_backward(g.dq.view_mut(), grads.get_mut(li.q_norm).view_mut(), g.dqr.view(), a.q.view(), w(li.q_norm), a.rstdq.view(), nh, hd, seq, 0, theta);
    #[rustfmt::skip]
    be.head_norm_rope_backward(g.dk.view_mut(), grads.get_mut(li.k_norm).view_mut(), g.dkr.view(), a.k.view(), w(li.k_norm), a.rstdk.view(), nkv, hd, seq, 0, theta);
    be.gemm(
        g.dxn.view_mut(),
        g.dq.view(),
        w(li.q),
        Gemm::new(n, h, qd, false, false),
    );
    #[rustfmt::skip]
    be.gemm(g.dxn.view_mut(), g.dk.view(), w(li.k), Gemm::new(n, h, kd, false, false).beta(1.0));
    #[rustfmt::skip]
    be.gemm(g.dxn.view_mut(), g.dv.view(), w(li.v), Gemm::new(n, h, kd, false, false).beta(1.0));
    let gq = Gemm::new(qd, h, n, true, false).beta(1.0);
    let gk = Gemm::new(kd, h, n, true, false).beta(1.0);
    be.gemm(
        grads.get_mut(li.q).view_mut(),
        g.dq.view(),
        a.xn1.view(),
        gq,
    );
    be.gemm(
        grads.get_mut(li.k).view_mut(),
        g.dk.view(),
        a.xn1.view(),
        gk,
    );
    be.gemm(
        grads.get_mut(li.v).view_mut(),
        g.dv.view(),
        a.xn1.view(),
        gk,
    );
    #[rustfmt::skip]
    be.rmsnorm_backward(g.dres.view_mut(), grads.get_mut(li.in_norm).view_mut(), g.dxn.view(), x, w(li.in_norm), a.rstd1.view(), h);
}

/// Backward of [`ffn_forward`]: reads the output gradient from `g.dres`, writes
/// `g.dxn = beta·g.dxn + ∂/∂xn`, adds weight gradients.
#[allow(clippy::too_many_arguments)]
fn ffn_backward(
    be: &dyn Backend,
    f: &FfnActs,
    xn: View,
    params: &ParamStore,
    grads: &mut ParamStore,
    (gate, up, down): (usize, usize, usize),
    parts: usize,
    fs: usize,
    g: &mut GradScratch,
    beta: f32,
    n: usize,
    h: usize,
) {
    let width = parts * fs;
    let nw = n * width;
    let ext = (n - 1) * width + fs;
    let (dfa, dfg, dfu) = (
        g.dfa.as_mut().unwrap(),
        g.dfg.as_mut().unwrap(),
        g.dfu.as_mut().unwrap(),
    );
    let wd = params.get(down);
    for s in 0..parts {
        be.gemm(
            dfa.slice_mut(s * fs, ext),
            g.dres.view(),
            wd.slice(s * h * fs, h * fs),
            Gemm::new(n, fs, h, false, false).ld(h, fs, width),
        );
        be.gemm(
            grads.get_mut(down).slice_mut(s * h * fs, h * fs),
            g.dres.view(),
            f.a.slice(s * fs, ext),
            Gemm::new(h, fs, n, true, false).ld(h, width, fs).beta(1.0),
        );
    }
    #[rustfmt::skip]
    be.swiglu_backward(dfg.slice_mut(0, nw), dfu.slice_mut(0, nw), dfa.slice(0, nw), f.g.slice(0, nw), f.u.slice(0, nw));
    let gx = Gemm::new(n, h, width, false, false);
    be.gemm(
        g.dxn.view_mut(),
        dfg.slice(0, nw),
        params.get(gate).view(),
        gx.beta(beta),
    );
    be.gemm(
        g.dxn.view_mut(),
        dfu.slice(0, nw),
        params.get(up).view(),
        gx.beta(1.0),
    );
    let gw = Gemm::new(width, h, n, true, false).beta(1.0);
    be.gemm(grads.get_mut(gate).view_mut(), dfg.slice(0, nw), xn, gw);
    be.gemm(grads.get_mut(up).view_mut(), dfu.slice(0, nw), xn, gw);
}

//! Autoregressive sampling with a KV cache: the prompt runs through the model once, filling
//! each layer's cache of normed, rotated keys and of values; every new token then runs alone,
//! attending to the cache. Past `seq_len` tokens the context is the most recent `seq_len`
//! (see [`decode`]).

use crate::block::{block_forward, Ctx, Kv, LayerRoute};
use crate::experts::LocalExperts;
use crate::step::local;
use crate::workspace::{moe_slot, Workspace};
use crate::{Model, Rng};
use ganymede_config::AcMode;
use ganymede_core::{Backend, Category, Gemm, ParamStore, Tensor};

/// Per-layer key and value caches `[capacity, kv_heads * head_dim]`.
struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

/// Run `ids` (positions `pos0..`) through the model, appending to the cache; returns the
/// logits of the last position.
fn step_logits(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    ws: &mut Workspace,
    cache: &mut KvCache,
    ids: &[u32],
    pos0: usize,
) -> Vec<f64> {
    let cfg = model.config();
    let (h, v) = (cfg.hidden, cfg.vocab_size);
    let n = ids.len();
    assert_eq!(n, ws.seq);
    let Workspace {
        res,
        blocks,
        grads,
        head,
        route,
        ..
    } = ws;
    be.write_u32(head.ids.view_mut(), ids);
    let wte = params.get(model.embed).view();
    be.embedding_forward(res.out(0, &mut head.xf), wte, head.ids.view(), h);
    res.store(be, 0, &head.xf);
    for l in 0..model.layers.len() {
        let (x, y) = res.pair(be, l, &mut head.xf);
        let kv = Kv::Cache {
            k: &mut cache.k[l],
            v: &mut cache.v[l],
            pos0,
        };
        let cx = Ctx {
            be,
            model,
            params,
            batch: 1,
            seq: n,
            docs: None,
        };
        // Routing sums go unread here, but the router writes them.
        let e = cfg.experts;
        let psum = (route.as_mut().zip(moe_slot(cfg, l))).map(|(r, s)| LayerRoute {
            psum: r.psum.slice_mut(s * e, e),
            counts: None,
        });
        local(block_forward(
            &cx,
            &mut blocks[0],
            grads,
            x,
            Some(y),
            kv,
            (l, psum, &mut LocalExperts),
        ));
        res.store(be, l + 1, &head.xf);
    }
    res.widen(be, cfg.layers);
    let eps = cfg.norm_eps as f32;
    let (xf, rstd) = (head.xf.view_mut(), head.rstd.view_mut());
    let norm = params.get(model.norm).view();
    be.rmsnorm_forward(xf, rstd, res.get(cfg.layers), norm, h, eps);
    // Only the last position's logits are needed.
    be.gemm(
        head.logits.slice_mut(0, v),
        head.xf.slice((n - 1) * h, h),
        params.get(model.lm_head).view(),
        Gemm::new(1, v, h, false, true).bf16_inputs(model.bf16),
    );
    be.download_f64(head.logits.slice(0, v))
}

/// Greedy (`temperature == 0`, ties to the lower id) or temperature sampling among the
/// `top_k` most likely ids (`top_k == 0`: all).
fn sample(logits: &[f64], temperature: f32, top_k: usize, rng: &mut Rng) -> u32 {
    let argmax = || {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        best as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let t = temperature as f64;
    let m = logits[order[0]];
    let w: Vec<f64> = order.iter().map(|&i| ((logits[i] - m) / t).exp()).collect();
    let mut u = rng.uniform() * w.iter().sum::<f64>();
    for (&i, &wi) in order.iter().zip(&w) {
        if u < wi {
            return i as u32;
        }
        u -= wi;
    }
    order[order.len() - 1] as u32
}

/// Feed `prompt`, then `n` tokens one at a time, each picked by `pick(i, logits)` from the
/// logits the model gives after what came before. Nothing is kept here: callers keep what they
/// need (a long generation holds no logits).
///
/// The context is the most recent `seq_len` tokens: positions past the training length were
/// never trained. While the sequence fits, each token runs alone against the KV cache. Past
/// that, the window of the last `seq_len` tokens is encoded afresh at positions `0..seq_len`
/// for every token. A sliding KV cache with re-rotated keys would be cheaper, but its deeper
/// layers' keys and values would still carry attention to tokens that have left the window, a
/// state training never produced; re-encoding gives exactly the computation of a training
/// window, at `seq_len` tokens of forward per token.
fn decode(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    n: usize,
    pick: &mut dyn FnMut(usize, &[f64]) -> u32,
) {
    assert!(!prompt.is_empty(), "generate needs a non-empty prompt");
    let v = model.config().vocab_size as u32;
    assert!(
        prompt.iter().all(|&t| t < v),
        "prompt token out of the vocabulary ({v})"
    );
    if n == 0 {
        return;
    }
    let cfg = model.config();
    let window = cfg.seq_len.max(1);
    // The last picked token is never fed back.
    let cap = (prompt.len() + n - 1).min(window);
    let mk = || -> Vec<Tensor> {
        (0..cfg.layers)
            .map(|_| be.zeros(&[cap * cfg.kv_dim()], Category::Activations))
            .collect()
    };
    let mut cache = KvCache { k: mk(), v: mk() };
    let mut ctx: Vec<u32> = prompt[prompt.len().saturating_sub(window)..].to_vec();
    let mut ws = Workspace::new(be, model, 1, ctx.len(), AcMode::Full);
    let mut logits = step_logits(be, model, params, &mut ws, &mut cache, &ctx, 0);
    // Tokens in the cache, at positions 0..cached.
    let mut cached = ctx.len();
    let mut ws1 = None;
    let mut ws_window = (ctx.len() == window).then_some(ws);
    let mut produced = 0;
    loop {
        let next = pick(produced, &logits);
        produced += 1;
        if produced == n {
            return;
        }
        ctx.push(next);
        if cached < window {
            let ws1 = ws1.get_or_insert_with(|| Workspace::new(be, model, 1, 1, AcMode::Full));
            logits = step_logits(be, model, params, ws1, &mut cache, &[next], cached);
            cached += 1;
        } else {
            ctx.drain(..ctx.len() - window);
            let ws =
                ws_window.get_or_insert_with(|| Workspace::new(be, model, 1, window, AcMode::Full));
            logits = step_logits(be, model, params, ws, &mut cache, &ctx, 0);
        }
    }
}

/// The generated ids and, for each, the logits it was drawn from.
#[cfg(test)]
pub(crate) fn generate_with_logits(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    s: Sampling,
) -> (Vec<u32>, Vec<Vec<f64>>) {
    let mut rng = Rng::new(s.seed);
    let (mut out, mut all) = (vec![], vec![]);
    let mut pick = |_: usize, logits: &[f64]| {
        let t = sample(logits, s.temperature, s.top_k, &mut rng);
        out.push(t);
        all.push(logits.to_vec());
        t
    };
    decode(be, model, params, prompt, s.max_new_tokens, &mut pick);
    (out, all)
}

/// The cross-entropy (nats) of each token of `continuation` after `prompt` and the tokens of
/// `continuation` before it, with the context [`generate`] would use (the last `seq_len`
/// tokens): how well generation can continue a known text, past the training length too.
pub fn continuation_losses(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    continuation: &[u32],
) -> Vec<f64> {
    let v = model.config().vocab_size as u32;
    assert!(
        continuation.iter().all(|&t| t < v),
        "continuation token out of the vocabulary ({v})"
    );
    let mut losses = Vec::with_capacity(continuation.len());
    let mut pick = |i: usize, l: &[f64]| {
        let t = continuation[i];
        let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        losses.push(lse - l[t as usize]);
        t
    };
    decode(be, model, params, prompt, continuation.len(), &mut pick);
    losses
}

/// How new tokens are drawn: up to `max_new_tokens` of them, greedily at `temperature` 0 (ties
/// to the lower id), else sampled at `temperature` among the `top_k` most likely ids (0: all)
/// from a generator seeded with `seed`.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
}

/// Autoregressive sampling with a KV cache; returns the generated ids (not the prompt).
pub fn generate(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    s: Sampling,
) -> Vec<u32> {
    let mut out = Vec::new();
    generate_streaming(be, model, params, prompt, s, &mut |t| out.push(t));
    out
}

/// [`generate`], handing each id to `on_token` as it is drawn (and keeping none).
pub fn generate_streaming(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    s: Sampling,
    on_token: &mut dyn FnMut(u32),
) {
    let mut rng = Rng::new(s.seed);
    let mut pick = |_: usize, logits: &[f64]| {
        let t = sample(logits, s.temperature, s.top_k, &mut rng);
        on_token(t);
        t
    };
    decode(be, model, params, prompt, s.max_new_tokens, &mut pick);
}

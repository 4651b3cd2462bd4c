//! Autoregressive sampling with a KV cache: the prompt runs through the model once, filling
//! each layer's cache of normed, rotated keys and of values; every new token then runs alone,
//! attending to the cache.

use crate::block::{block_forward, Kv};
use crate::experts::LocalExperts;
use crate::workspace::Workspace;
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
        ..
    } = ws;
    be.embedding_forward(res[0].vm(), params.get(model.embed).v(), ids, h);
    for (l, li) in model.layers.iter().enumerate() {
        let (lo, hi) = res.split_at_mut(l + 1);
        let kv = Kv::Cache {
            k: &mut cache.k[l],
            v: &mut cache.v[l],
            pos0,
        };
        #[rustfmt::skip]
        block_forward(be, model, params, li, &mut blocks[0], grads, lo[l].v(), Some(hi[0].vm()), 1, n, kv, (l, &mut LocalExperts));
    }
    let eps = cfg.norm_eps as f32;
    #[rustfmt::skip]
    be.rmsnorm_forward(head.xf.vm(), head.rstd.vm(), res[cfg.layers].v(), params.get(model.norm).v(), h, eps);
    // Only the last position's logits are needed.
    be.gemm(
        head.logits.slice_mut(0, v),
        head.xf.slice((n - 1) * h, h),
        params.get(model.lm_head).v(),
        Gemm::new(1, v, h, false, true),
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

/// The generated ids and, for each, the logits it was drawn from.
#[allow(clippy::too_many_arguments)]
pub(crate) fn generate_with_logits(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    max_new_tokens: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> (Vec<u32>, Vec<Vec<f64>>) {
    assert!(!prompt.is_empty(), "generate needs a non-empty prompt");
    let v = model.config().vocab_size as u32;
    assert!(
        prompt.iter().all(|&t| t < v),
        "prompt token out of the vocabulary ({v})"
    );
    if max_new_tokens == 0 {
        return (vec![], vec![]);
    }
    let cfg = model.config();
    // The last generated token is never fed back.
    let cap = prompt.len() + max_new_tokens - 1;
    let mk = || -> Vec<Tensor> {
        (0..cfg.layers)
            .map(|_| be.zeros(&[cap * cfg.kv_dim()], Category::Activations))
            .collect()
    };
    let mut cache = KvCache { k: mk(), v: mk() };
    let mut rng = Rng::new(seed);
    let mut ws = Workspace::new(be, model, 1, prompt.len(), AcMode::Full);
    let mut logits = step_logits(be, model, params, &mut ws, &mut cache, prompt, 0);
    let mut ws1 = (max_new_tokens > 1).then(|| Workspace::new(be, model, 1, 1, AcMode::Full));
    let (mut out, mut all) = (vec![], vec![]);
    loop {
        let next = sample(&logits, temperature, top_k, &mut rng);
        out.push(next);
        all.push(std::mem::take(&mut logits));
        if out.len() == max_new_tokens {
            return (out, all);
        }
        let pos = prompt.len() + out.len() - 1;
        let ws1 = ws1.as_mut().expect("single-token workspace");
        logits = step_logits(be, model, params, ws1, &mut cache, &[next], pos);
    }
}

/// Autoregressive sampling with a KV cache (temperature, top-k; temperature 0 = greedy);
/// returns the generated ids (not the prompt).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    max_new_tokens: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> Vec<u32> {
    #[rustfmt::skip]
    let (ids, _) = generate_with_logits(be, model, params, prompt, max_new_tokens, temperature, top_k, seed);
    ids
}

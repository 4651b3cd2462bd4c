//! What a single-process CPU run's memory ledger should report, per category.
//!
//! World size 1, f32 everywhere, no sharding, no offload; one forward and backward over the whole
//! batch (`training.batch_size` sequences of `model.seq_len` tokens) per step. `params`, `grads`
//! and `optimizer` are exact; `activations` and `buffers` rest on the assumptions spelled out on
//! [`ActivationTerms`], which the trainer should match term by term (or a test should skip them).

use crate::params::{self, Handler};
use ganymede_config::{AcMode, JobConfig, OptimizerName};
use serde::Serialize;

/// The saved-for-backward tensors the prediction assumes, in bytes (f32), for N = batch × seq
/// tokens, B sequences of T tokens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActivationTerms {
    /// Layer inputs `[N, H]`, one per layer (the checkpoint boundaries under full AC).
    pub layer_inputs: f64,
    /// One layer's internals, kept for every layer under `none`, for one layer (the one being
    /// recomputed) under `full`:
    ///   attention: norm output `[N,H]` + its rms `[N]`; q, k, v projections `[N, q+2kv]`;
    ///   q and k after per-head norm and RoPE `[N, q+kv]` + their rms `[N, heads+kv_heads]`;
    ///   softmax probabilities `[B, heads, T, T]`; attention context `[N, q]`; residual
    ///   `[N,H]`; FFN norm output `[N,H]` + rms `[N]`;
    ///   MoE layer: router logits and probabilities `[N, E]` x2; per routed (token, expert)
    ///   pair the expert input `[N·k, H]`, gate, up and SwiGLU product `[N·k, F]` x3, expert
    ///   output `[N·k, H]`; each shared expert gate, up, product `[N, Fs]` x3 and output `[N,H]`;
    ///   dense layer: gate, up, product `[N, D]` x3.
    /// This is the largest layer kind's set (MoE or dense).
    pub layer_internals: f64,
    /// Final norm output `[N,H]` + rms `[N]`, logits `[N,V]` and their gradient `[N,V]`.
    pub head: f64,
}

/// Predicted peak bytes per ledger category.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpuLedger {
    pub params: f64,
    pub grads: f64,
    /// Muon: one f32 momentum per Muon-handled parameter; AdamW: two per parameter (including
    /// the AdamW-handled rest under Muon).
    pub optimizer: f64,
    /// `layer_inputs + layer_internals × (layers under none, 1 under full) + head`.
    pub activations: f64,
    pub activation_terms: ActivationTerms,
    /// RoPE cos and sin tables `[T, head_dim/2]` each.
    pub buffers: f64,
}

pub fn predict_cpu_ledger(job: &JobConfig) -> CpuLedger {
    let m = &job.model;
    let ts = params::tensors(m);
    let total: u64 = ts.iter().map(|t| t.total()).sum();
    let muon: u64 = ts
        .iter()
        .filter(|t| t.handler() == Handler::Muon)
        .map(|t| t.total())
        .sum();
    let f = 4.0;
    let optimizer = match job.optimizer.name {
        OptimizerName::Muon => f * muon as f64 + 2.0 * f * (total - muon) as f64,
        OptimizerName::Adamw => 2.0 * f * total as f64,
    };
    let b = job.training.batch_size as f64;
    let t = m.seq_len as f64;
    let n = b * t;
    let (h, q, kv) = (m.hidden as f64, m.q_dim() as f64, m.kv_dim() as f64);
    let (heads, kvh) = (m.heads as f64, m.kv_heads as f64);
    let (e, k, ff) = (m.experts as f64, m.top_k as f64, m.expert_hidden as f64);
    let l = m.layers as f64;
    let attn = n * (h + 1.0)
        + n * (q + 2.0 * kv)
        + n * (q + kv)
        + n * (heads + kvh)
        + b * heads * t * t
        + n * q
        + n * h
        + n * (h + 1.0);
    let moe = 2.0 * n * e
        + n * k * h
        + 3.0 * n * k * ff
        + n * k * h
        + m.shared_experts as f64 * (3.0 * n * m.shared_hidden() as f64 + n * h);
    let dense = 3.0 * n * m.dense_hidden as f64;
    let ffn = match (m.dense_layers > 0, m.dense_layers < m.layers) {
        (true, true) => moe.max(dense),
        (true, false) => dense,
        _ => moe,
    };
    let internals = f * (attn + ffn);
    let inputs = f * l * n * h;
    let head = f * (n * (h + 1.0) + 2.0 * n * m.vocab_size as f64);
    let layers_kept = match job.activation_checkpoint.mode {
        AcMode::Full => 1.0,
        AcMode::None => l,
    };
    CpuLedger {
        params: f * total as f64,
        grads: f * total as f64,
        optimizer,
        activations: inputs + layers_kept * internals + head,
        activation_terms: ActivationTerms {
            layer_inputs: inputs,
            layer_internals: internals,
            head,
        },
        buffers: f * 2.0 * t * (m.head_dim as f64 / 2.0),
    }
}

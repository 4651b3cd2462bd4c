//! Work per token: the model's matmuls and attention, and what checkpointing recomputes;
//! Newton–Schulz's work per step.

use super::Dims;
use crate::params::Handler;
use crate::plan::{ns_flops, Flops, MemoryPolicy, OptimizerSetup};
use ganymede_config::AcMode;

pub(super) fn flops(d: &Dims, policy: &MemoryPolicy, tokens_per_step: u64) -> Flops {
    let (seq, span, q_dim, l) = (d.seq, d.span, d.q_dim, d.l);
    let matmul = 6.0 * d.p.active_matmul as f64;
    // Keys a token attends, on average: half its window, or half its document's length when
    // attention stops at document boundaries (documents shorter than the window).
    let attn = 12.0 * span * q_dim * l;
    let attn_nc = 12.0 * seq * q_dim * l;
    let recompute = match policy.ac {
        AcMode::Full => l * (2.0 * d.layer_matmul + 4.0 * span * q_dim),
        AcMode::None => 0.0,
    };
    Flops {
        attention_span_per_token: span,
        matmul_per_token: matmul,
        attention_per_token: attn,
        attention_per_token_noncausal: attn_nc,
        model_per_token: matmul + attn,
        recompute_per_token: recompute,
        hardware_per_token: matmul + attn + recompute,
        model_per_step: (matmul + attn) * tokens_per_step as f64,
    }
}

/// Newton–Schulz FLOPs per step over every Muon matrix, and over the dense ones alone (what
/// FlexShard gathers to an owner); both zero under AdamW.
pub(super) fn newton_schulz(d: &Dims, opt: &OptimizerSetup) -> (f64, f64) {
    if !d.muon {
        return (0.0, 0.0);
    }
    let sum = |dense_only: bool| -> f64 {
        d.ts.iter()
            .filter(|t| t.handler() == Handler::Muon && !(dense_only && t.expert))
            .map(|t| t.count as f64 * ns_flops(t.rows, t.cols, opt.ns_steps))
            .sum()
    };
    (sum(false), sum(true))
}

//! Bytes by category on one GPU and its share of host memory, and the smallest offload
//! fraction that fits.

use super::Dims;
use crate::cluster::Cluster;
use crate::params::Handler;
use crate::plan::{Memory, MemoryCategories, MemoryPolicy, NsOn, OptimizerSetup};
use ganymede_config::{AcMode, DeviceKind, JobConfig};

pub(super) struct MemoryModel {
    pub memory: Memory,
    /// The whole model's optimizer state under the chosen optimizer, and under AdamW.
    pub opt_state: f64,
    pub adamw_state: f64,
}

/// ganymede's own trainer on a device (`device.kind` = `cuda` or `cpu-two-memory`): the
/// activation workspace its ledger measures, [`crate::ledger::ActivationTerms`] at one rank's
/// micro-batch. The bf16 model below is the write-up's (a PyTorch model saving bf16 tensors);
/// the trainer keeps most of a layer's set in f32 and a gradient scratch besides, which is why
/// that model read 13.5 GiB for `medium` where the H200's ledger read 17.8 (issue 37).
fn trainer_terms(job: &JobConfig, d: &Dims) -> Option<crate::ledger::ActivationTerms> {
    if !matches!(job.device.kind, DeviceKind::Cuda | DeviceKind::CpuTwoMemory) {
        return None;
    }
    let mut one = job.clone();
    one.model.seq_len = d.seq as usize;
    one.training.batch_size = (d.n_tok / d.seq).round().max(1.0) as usize;
    Some(crate::ledger::predict_cpu_ledger(&one, 1).activation_terms)
}

/// One layer's saved tensors at the micro-batch's tokens: the largest layer's set (what full
/// checkpointing keeps, one layer at a time) and the mean over layers (what `none` keeps).
fn saved_layer_sets(d: &Dims) -> (f64, f64) {
    let (m, shape) = (d.m, &d.shape);
    let (h, l, n_tok, k) = (d.h, d.l, d.n_tok, d.k);
    // One layer's saved tensors (bf16 unless noted), N tokens:
    //   norm outputs 2·H, q/k/v 2·kv+q, q/k after norm+RoPE q+kv, attention output q,
    //   residual H, attention log-sum-exp heads·4 B, router logits+probs 2·E·4 B; MoE: dispatched
    //   input k·H, gate/up/act 3·k·F, expert output k·H, shared 3·Fs per shared expert + H;
    //   dense FFN 3·D.
    let (q_dim, kvd) = (d.q_dim, m.kv_dim() as f64);
    let attn_saved =
        (2.0 * h + 2.0 * kvd + q_dim + q_dim + kvd + q_dim + h) * 2.0 + m.heads as f64 * 4.0;
    let moe_saved = 2.0 * m.experts as f64 * 4.0
        + (k * h + 3.0 * k * m.expert_hidden as f64 + k * h) * 2.0
        + if m.shared_experts > 0 {
            (3.0 * (m.shared_experts * m.shared_hidden()) as f64 + h) * 2.0
        } else {
            0.0
        };
    let dense_saved = 3.0 * m.dense_hidden as f64 * 2.0;
    let ffn_saved = if d.has_moe {
        moe_saved.max(if shape.dense_layers > 0 {
            dense_saved
        } else {
            0.0
        })
    } else {
        dense_saved
    };
    let layer_set = n_tok * (attn_saved + ffn_saved);
    let layer_set_avg = n_tok
        * (attn_saved
            + (shape.moe_layers as f64 * moe_saved + shape.dense_layers as f64 * dense_saved) / l);
    (layer_set, layer_set_avg)
}

pub(super) fn memory(
    job: &JobConfig,
    d: &Dims,
    cluster: &Cluster,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
) -> MemoryModel {
    let (m, p, shape) = (d.m, &d.p, &d.shape);
    let (h, l, n_tok, k) = (d.h, d.l, d.n_tok, d.k);
    let pb = policy.param_bytes;
    let gb = policy.gather_bytes;
    let opt_state = if d.muon {
        4.0 * p.muon as f64 + 8.0 * p.adamw as f64
    } else {
        8.0 * p.total as f64
    };
    let adamw_state = 8.0 * p.total as f64;
    let local_layer = shape.max_local_layer(d.ep as u64) as f64;
    let head = (p.by_group.embedding.max(p.by_group.lm_head)) as f64;
    let unsharded = gb * local_layer * (1 + policy.prefetch) as f64 + pb * head;
    // Gradients are computed in bf16 whatever the gather precision.
    let unsharded_grads = (2.0 + policy.reduce_bytes) * local_layer;
    let boundary_layer = d.boundary_layer;
    let boundary_all = boundary_layer * l;
    let (layer_set, layer_set_avg) = saved_layer_sets(d);
    let dispatch = if d.has_moe {
        2.0 * n_tok * k * h * pb
    } else {
        0.0
    };
    let chunk = (policy.loss_chunk_tokens as f64).min(n_tok);
    let logits = 2.0 * chunk * d.v * 4.0;
    let largest_muon =
        d.ts.iter()
            .filter(|t| t.handler() == Handler::Muon)
            .map(|t| t.numel())
            .max()
            .unwrap_or(0) as f64;
    let ns_ws = if d.muon {
        4.0 * 4.0 * largest_muon
    } else {
        0.0
    };

    let trainer = trainer_terms(job, d);
    let memory_for = |offload_fraction: f64| -> (MemoryCategories, MemoryCategories, usize) {
        let mut g = MemoryCategories::default();
        let mut hst = MemoryCategories::default();
        let state_side = if policy.param_offload {
            &mut hst
        } else {
            &mut g
        };
        state_side.master_params = 4.0 * d.shard;
        state_side.grads = 4.0 * d.shard;
        state_side.optimizer_states = opt_state / d.wf;
        g.unsharded_params = unsharded;
        g.unsharded_grads = unsharded_grads;
        let mut offloaded = 0;
        match policy.ac {
            AcMode::Full => {
                offloaded = ganymede_config::offloaded_layers(offload_fraction, m.layers);
                let kept = (m.layers - offloaded) as f64;
                g.boundary_activations = kept * boundary_layer;
                hst.boundary_activations = offloaded as f64 * boundary_layer;
                g.layer_activations = layer_set;
            }
            AcMode::None => {
                // Every layer keeps its input and all its saved tensors.
                g.layer_activations = l * boundary_layer + l * layer_set_avg;
            }
        }
        g.dispatch_buffers = dispatch;
        g.logits = logits;
        if let Some(t) = &trainer {
            // The ledger's terms: every boundary (less those offloaded) with its f32 working
            // copy, one layer set (every layer's under `none`) and the gradient scratch, the
            // head's logits and rows; the dispatched rows are inside the layer set, so only
            // expert parallelism's exchange buffers stay.
            g.boundary_activations = t.boundaries - hst.boundary_activations;
            g.layer_activations = t.layer_sets + t.grad_scratch;
            g.logits = t.head;
            if d.ep <= 1 {
                g.dispatch_buffers = 0.0;
            }
        }
        if !policy.unshard_async_op {
            g.allocator_slack = gb * local_layer * (1 + policy.prefetch) as f64;
        }
        if opt.ns_on == NsOn::Cpu {
            hst.ns_workspace = ns_ws;
        } else {
            g.ns_workspace = ns_ws;
        }
        g.reserved = cluster.gpu.reserved_bytes;
        (g, hst, offloaded)
    };
    let gpu_cap = cluster.gpu.memory_bytes;
    let host_cap = cluster.host.usable_bytes_per_gpu;
    let (gmem, hmem, offloaded_layers) = memory_for(policy.offload_fraction);
    let min_offload = match policy.ac {
        AcMode::None => None,
        AcMode::Full => (0..=m.layers).find_map(|n| {
            let f = n as f64 / l;
            let (g, hs, _) = memory_for(f);
            (g.total() <= gpu_cap && hs.total() <= host_cap).then_some(f)
        }),
    };
    MemoryModel {
        memory: Memory {
            gpu_total: gmem.total(),
            host_total: hmem.total(),
            gpu: gmem,
            host: hmem,
            gpu_capacity: gpu_cap,
            host_capacity: host_cap,
            boundary_activation_bytes: boundary_all,
            offloaded_layers,
            min_offload_fraction: min_offload,
        },
        opt_state,
        adamw_state,
    }
}

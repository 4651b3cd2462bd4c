//! What a single-process CPU run's memory ledger should report, per category.
//!
//! World size 1, f32 everywhere, no sharding, no offload; one forward and backward over the whole
//! batch (`training.batch_size` sequences of `model.seq_len` tokens, N = batch × seq) per step,
//! with one activation workspace allocated up front (llm.c style).
//!
//! - `params`, `grads`: every parameter table entry, 4 bytes each (including the DeepSeek
//!   selection bias `[E]` per MoE layer when `model.router_bias_update > 0`: it is a stored,
//!   untrained buffer with a gradient slot).
//! - `optimizer`: Muon one f32 momentum per Muon-handled parameter, AdamW two per parameter it
//!   handles; the selection bias has none.
//! - `activations`: the workspace, see [`ActivationTerms`] (f32, but under
//!   `training.compute_dtype = "bf16"` attention's q, k, v, output and gradients in bf16, and
//!   with bf16 boundaries, `activation_checkpoint.boundary_dtype`, the residual stream's).
//! - `buffers`: Muon's scratch, see [`CpuLedger::buffers`], the step's two f64 scalars
//!   (the loss sum and the squared gradient norm, summed on the device and read at its end),
//!   and under `training.compute_dtype = "bf16"` the GEMM operands' cast scratch
//!   ([`bf16_gemm_scratch`]) and the bf16 compute copy of the GEMM weights
//!   ([`bf16_weight_copy`]).

use crate::params::{self, Handler};
use ganymede_config::{AcMode, JobConfig, OptimizerName};
use serde::Serialize;

/// Newton–Schulz problems at most this many FLOPs run one per thread in parallel (each thread
/// then has its own scratch); larger ones run alone. Mirrors the optimizer's constant.
pub const PAR_MATRIX_MAX_FLOPS: f64 = 1.4e9;

/// The activation workspace, in bytes (f32), with N tokens, H hidden, Q = heads·head_dim,
/// K = kv_heads·head_dim, E experts, k top-k, F expert hidden, W a layer's every-token SwiGLU
/// width (dense hidden in a dense layer, shared experts × shared hidden in an MoE layer), V vocab.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActivationTerms {
    /// The residual stream at the L + 1 block boundaries: 4·N·(L+1)·H; with bf16 boundaries
    /// (`activation_checkpoint.boundary_dtype`, `auto` under bf16 compute) 2·N·(L+1)·H plus
    /// their f32 working copy, 4·N·H.
    pub boundaries: f64,
    /// One layer's internals, 4·N·(3H + 3Q + 3K + 2·heads + kv_heads + 2 + M + 3k + 3W) +
    /// 4·(C·R + 2E + 1): norm outputs and rms, q/k/v, q/k after norm and RoPE with their rms,
    /// attention output and log-sum-exp, residual; in an MoE layer (else 0) M = E + k (router
    /// probabilities and weights), R = 2kH + 3kF per token of one MoE chunk of C tokens
    /// (`training.moe_chunk_tokens`, C = N by default: dispatched input, gate, up, SwiGLU
    /// product, expert output), and its u32 routing (chosen experts, dispatch order both
    /// ways: 3k per token; per-expert counts and offsets: 2E + 1). No `[T, T]` attention matrix
    /// is kept. Under `none` there is one such set per layer (each its own kind); under `full`
    /// one set, sized MoE if any layer is MoE and with the widest W. Under bf16 compute the
    /// set's v, normed-and-rotated q and k, and attention output are bf16: 2·N·(2Q + 2K) less;
    /// and so are the rows only bf16-input GEMMs read, the dispatched input and SwiGLU product
    /// (2·C·k·(H + F) less) and an FFN's product (2·N·W less), and the GEMM outputs only
    /// element-wise ops read, gate, up and expert output (2·C·k·(H + 2F) less) and an FFN's
    /// gate and up (4·N·W less).
    pub layer_sets: f64,
    /// Gradient scratch shared by all layers: 4·N·(2H + 2Q + 3K + M + 3·max W) + 4·C·R, with
    /// M, C and R as above if any layer is MoE; under bf16 compute 2·N·(2Q + 2K) more
    /// (attention's bf16 output and input gradients), and the bf16 rows of the experts' output,
    /// gate and up gradients (2·C·k·(H + 2F) less) and of an FFN's gate and up gradients
    /// (4·N·max W less), and the bf16 SwiGLU product gradients a GEMM writes (2·C·k·F and
    /// 2·N·max W less).
    pub grad_scratch: f64,
    /// Final norm output and rms, logits and their log-sum-exp, the u32 token ids and
    /// targets, the ids' grouping by id (`3N + 1`: order, segment starts, segment ids):
    /// 4·N·(H + V + 7) + 4, with V·C in place of V·N where `training.loss_chunk_tokens` = C
    /// is below N (the head holds one chunk's logits); under bf16 compute the logits are a
    /// bf16 GEMM output, 2·V·C less.
    pub head: f64,
}

/// Predicted peak bytes per ledger category.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpuLedger {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    /// Sum of [`ActivationTerms`].
    pub activations: f64,
    pub activation_terms: ActivationTerms,
    /// Muon scratch: one slot sized for every Muon matrix (the Nesterov output max r·c, two
    /// max s² and one max s·l for Newton–Schulz, s ≤ l the sides), plus, when `threads` > 1,
    /// min(threads, number of small matrices) − 1 more slots sized for the small ones
    /// (NS FLOPs ≤ [`PAR_MATRIX_MAX_FLOPS`]); on a GPU (`device.kind = "cuda"`) also the
    /// batched Newton–Schulz's stack slot ([`ns_stack_elems`]). 0 under AdamW.
    pub buffers: f64,
}

/// Predict the ledger of a CPU run of `job` with `threads` worker threads.
pub fn predict_cpu_ledger(job: &JobConfig, threads: usize) -> CpuLedger {
    let m = &job.model;
    let ts = params::tensors(m);
    let total: u64 = ts.iter().map(|t| t.total()).sum();
    let muon_on = job.optimizer.name == OptimizerName::Muon;
    let muon: u64 = if muon_on {
        ts.iter()
            .filter(|t| t.handler() == Handler::Muon)
            .map(|t| t.total())
            .sum()
    } else {
        0
    };
    let moe_layers = m.layers - m.dense_layers.min(m.layers);
    let bias = if m.router_bias_update > 0.0 {
        (moe_layers * m.experts) as f64
    } else {
        0.0
    };
    let f = 4.0;
    let optimizer = f * muon as f64 + 2.0 * f * (total - muon) as f64;

    // Activation workspace.
    let n = (job.training.batch_size * m.seq_len) as f64;
    let (h, q, kv) = (m.hidden as f64, m.q_dim() as f64, m.kv_dim() as f64);
    let (heads, kvh) = (m.heads as f64, m.kv_heads as f64);
    let (e, k, ff) = (m.experts as f64, m.top_k as f64, m.expert_hidden as f64);
    let width = |l: usize| -> f64 {
        if m.is_moe_layer(l) {
            (m.shared_experts * m.shared_hidden()) as f64
        } else {
            m.dense_hidden as f64
        }
    };
    let max_w = (0..m.layers).map(width).fold(0.0, f64::max);
    let any_moe = moe_layers > 0;
    // bf16 attention tensors (q, k after RoPE, v, output; their gradients), in f32 elements,
    // and the half of an f32 element each bf16 row saves (`ganymede_model::Precision`).
    let bf16 = job.training.compute_dtype == ganymede_config::ComputeDtype::Bf16;
    let attn16 = if bf16 {
        0.5 * (2.0 * q + 2.0 * kv)
    } else {
        0.0
    };
    let half = if bf16 { 0.5 } else { 0.0 };
    let attn = 3.0 * h + 3.0 * q + 3.0 * kv + 2.0 * heads + kvh + 2.0 - attn16;
    // Per token: router probabilities and weights; per token of a MoE chunk (C of the N
    // tokens, `training.moe_chunk_tokens`): the expert rows and their internals, of which the
    // dispatched inputs and SwiGLU products are bf16 rows and the gate, up and expert outputs
    // bf16 GEMM outputs (in the scratch: the output, gate and up gradients bf16 rows, the
    // SwiGLU product's gradient a bf16 GEMM output).
    let moe = e + k;
    let c = moe_rows(job, n);
    let rows = 2.0 * k * h + 3.0 * k * ff - half * (2.0 * k * h + 3.0 * k * ff);
    let scratch_rows = 2.0 * k * h + 3.0 * k * ff - half * (k * h + 3.0 * k * ff);
    let routing = 3.0 * k;
    // An FFN's gate, up and product are bf16 (in the scratch all three gradients too).
    let set = |is_moe: bool, w: f64| {
        attn + if is_moe { moe + routing } else { 0.0 } + (3.0 - 3.0 * half) * w
    };
    let (sets, moe_sets): (f64, f64) = match job.activation_checkpoint.mode {
        AcMode::None => (
            (0..m.layers)
                .map(|l| set(m.is_moe_layer(l), width(l)))
                .sum(),
            moe_layers as f64,
        ),
        AcMode::Full => (set(any_moe, max_w), any_moe as u8 as f64),
    };
    // q's gradient reuses the output gradient's buffer: 2Q, not 3Q.
    let scratch = 2.0 * h
        + 2.0 * q
        + 3.0 * kv
        + if any_moe { moe } else { 0.0 }
        + (3.0 - 3.0 * half) * max_w
        + attn16;
    let boundaries = match bf16_boundaries(job) {
        true => 2.0 * n * (m.layers as f64 + 1.0) * h + f * n * h,
        false => f * n * (m.layers as f64 + 1.0) * h,
    };
    let terms = ActivationTerms {
        boundaries,
        layer_sets: f * n * sets + f * moe_sets * (c * rows + 2.0 * e + 1.0),
        grad_scratch: f * n * scratch + if any_moe { f * c * scratch_rows } else { 0.0 },
        // The logits are a bf16 GEMM output under bf16 compute.
        head: f * (n * (h + 7.0) + (1.0 - half) * head_rows(job, n) * m.vocab_size as f64) + f,
    };

    // Muon scratch: f32 A, B and a copy of X; on a GPU in bf16 the f32 A, bf16 A and B and two
    // bf16 copies of X, the same bytes (`ganymede_optim::NsScratch`).
    let slot = |shapes: &[(u64, u64)]| -> f64 {
        let rc = shapes.iter().map(|&(r, c)| r * c).max().unwrap_or(0);
        let ss = shapes
            .iter()
            .map(|&(r, c)| r.min(c).pow(2))
            .max()
            .unwrap_or(0);
        let sl = shapes.iter().map(|&(r, c)| r * c).max().unwrap_or(0);
        f * (rc + 2 * ss + sl) as f64
    };
    let buffers = if muon_on && muon > 0 {
        let mats: Vec<_> = ts.iter().filter(|t| t.handler() == Handler::Muon).collect();
        let all: Vec<(u64, u64)> = mats.iter().map(|t| (t.rows, t.cols)).collect();
        let small_mats: Vec<_> = mats
            .iter()
            .filter(|t| {
                crate::plan::ns_flops(t.rows, t.cols, job.optimizer.ns_steps)
                    <= PAR_MATRIX_MAX_FLOPS
            })
            .collect();
        let small: Vec<(u64, u64)> = small_mats.iter().map(|t| (t.rows, t.cols)).collect();
        let n_small: u64 = small_mats.iter().map(|t| t.count).sum();
        let cuda = job.device.kind == ganymede_config::DeviceKind::Cuda;
        // No parallel lanes on a GPU (`ganymede_optim`: one stream).
        let extra = match cuda {
            true => 0,
            false => (threads.max(1) as u64).min(n_small.max(1)) - 1,
        };
        let stacks = if job.optimizer.ns_batch.on(cuda) {
            let (u, ss, sl) = ns_stack_elems(job);
            f * (u + 2 * ss + sl) as f64
        } else {
            0.0
        };
        slot(&all) + extra as f64 * slot(&small) + stacks
    } else {
        0.0
    };
    CpuLedger {
        params: f * (total as f64 + bias),
        grads: f * (total as f64 + bias),
        optimizer,
        activations: terms.boundaries + terms.layer_sets + terms.grad_scratch + terms.head,
        activation_terms: terms,
        buffers: buffers
            + step_scalars(m, job.training.microbatches(1))
            + bf16_gemm_scratch(job)
            + bf16_weight_copy(job),
    }
}

/// Muon's Newton–Schulz matrices of `job`: `(rows, cols, stack)` per kind of Muon tensor, the
/// stack being the matrices one parameter holds (a layer's routed or shared experts, else 1).
fn muon_stacks(job: &JobConfig) -> Vec<(usize, usize, usize)> {
    let m = &job.model;
    params::tensors(m)
        .iter()
        .filter(|t| t.handler() == Handler::Muon)
        .map(|t| {
            let stack = match t.group {
                _ if t.expert => m.experts,
                params::Group::SharedExperts => m.shared_experts,
                _ => 1,
            };
            (t.rows as usize, t.cols as usize, stack)
        })
        .collect()
}

/// What a GPU's optimizer batches (`ganymede_optim`'s stack slot, `Blas::batches_matrices`):
/// every stack, and each shape several single matrices share, with their number (the tensor
/// table's count of each such kind, summed over the kinds of one shape).
fn batched_stacks(job: &JobConfig) -> Vec<(usize, usize, usize)> {
    let m = &job.model;
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    let mut singles: Vec<(usize, usize, usize)> = Vec::new();
    let kinds = params::tensors(m);
    for (t, (r, c, stack)) in kinds
        .iter()
        .filter(|t| t.handler() == Handler::Muon)
        .zip(muon_stacks(job))
    {
        if stack > 1 {
            out.push((r, c, stack));
            continue;
        }
        match singles.iter_mut().find(|s| (s.0, s.1) == (r, c)) {
            Some(s) => s.2 += t.count as usize,
            None => singles.push((r, c, t.count as usize)),
        }
    }
    out.extend(singles.into_iter().filter(|s| s.2 > 1));
    out
}

/// Elements of the batched Newton–Schulz working memory a GPU's optimizer holds for
/// [`batched_stacks`]: the largest batch's Nesterov outputs, `s²` (each of A and B) and `s·l`,
/// batches of [`ganymede_config::ns_stack_batch`]. Zeros without a batch.
fn ns_stack_elems(job: &JobConfig) -> (u64, u64, u64) {
    ns_batch_elems(&batched_stacks(job))
}

/// [`ganymede_config::ns_batch_elems`] in training's budget, as `u64`s.
pub(crate) fn ns_batch_elems(stacks: &[(usize, usize, usize)]) -> (u64, u64, u64) {
    let (u, ss, sl) = ganymede_config::ns_batch_elems(stacks, ganymede_config::NS_STACK_BYTES);
    (u as u64, ss as u64, sl as u64)
}

/// Whether the run stores its block boundaries in bf16 (`activation_checkpoint.boundary_dtype`
/// under `training.compute_dtype`).
pub fn bf16_boundaries(job: &JobConfig) -> bool {
    job.activation_checkpoint
        .boundary_dtype
        .bf16_under(job.training.compute_dtype)
}

/// Bytes of the bf16 compute copy a single process keeps of the weights handed to the model in
/// bf16 (`training.compute_dtype = "bf16"`, else 0): 2 per element of the attention, SwiGLU
/// and expert matrices, the LM head and the embedding, cast from the f32 masters once per step.
pub fn bf16_weight_copy(job: &JobConfig) -> f64 {
    if job.training.compute_dtype != ganymede_config::ComputeDtype::Bf16 {
        return 0.0;
    }
    let ts = params::tensors(&job.model);
    2.0 * ts
        .iter()
        .filter(|t| t.bf16_weight())
        .map(|t| t.total())
        .sum::<u64>() as f64
}

/// Bytes of the bf16-input GEMMs' operand scratch (`training.compute_dtype = "bf16"`, else 0):
/// the backend keeps one slot per operand position, each grown to the longest view it has seen
/// there, bf16 on a GPU, bf16 values held in f32 on the CPU. With N this rank's tokens, slot A
/// holds at most the logits `N·V` (`C·V` under a loss chunk of C tokens; the LM head's weight
/// gradient) or a routed-expert buffer
/// (`N·k·max(H, F)`; under expert parallelism its capacity's rows, if more), slot B a weight
/// (LM head `V·H`, stacked experts `E·F·H`, `E/ep` of them under expert parallelism) or the
/// experts' rows; the other GEMMs' operands are smaller. The weights reach the GEMMs
/// in bf16 already, and so do the rows the model makes in bf16 (the routed experts' inputs,
/// SwiGLU products and output, gate and up gradients; an FFN's product and gate and up
/// gradients; attention's output; the logits and their gradient), which a GPU takes as they
/// are: there slot A holds an f32 activation (`N·H`, a query gradient `N·Q`) and slot B only
/// the normed rows the weight gradients read (`N·H`). The CPU widens bf16 operands into its
/// f32 scratch like any operand, and keeps an f32 output slot for the GEMMs that write bf16
/// (gate, up, the SwiGLU product's gradient, the experts' outputs, the logits, v and the
/// gradient of attention's output: `max(N·k, capacity)·max(F, H)`, an FFN's `N·W`, the head's
/// `C·V`, `N·KV` or `N·Q`), which it rounds from.
///
/// Muon's bf16 products on a GPU take their operands in bf16 already (`NsScratch` keeps its
/// iterates in bf16), so nothing of theirs is cast here.
pub fn bf16_gemm_scratch(job: &JobConfig) -> f64 {
    if job.training.compute_dtype != ganymede_config::ComputeDtype::Bf16 {
        return 0.0;
    }
    let m = &job.model;
    let size = match job.device.kind {
        ganymede_config::DeviceKind::Cuda => 2.0,
        _ => 4.0,
    };
    let n = (job.training.batch_size * m.seq_len) as f64;
    let (h, v) = (m.hidden as f64, m.vocab_size as f64);
    let (q, kv) = (m.q_dim() as f64, m.kv_dim() as f64);
    let moe = m.layers > m.dense_layers.min(m.layers);
    let (e, k, ff) = if moe {
        (m.experts as f64, m.top_k as f64, m.expert_hidden as f64)
    } else {
        (0.0, 0.0, 0.0)
    };
    let width = (0..m.layers)
        .map(|l| match m.is_moe_layer(l) {
            true => (m.shared_experts * m.shared_hidden()) as f64,
            false => m.dense_hidden as f64,
        })
        .fold(0.0, f64::max);
    // Expert parallelism hands the GEMMs views of its capacity, and a rank its ep slice of
    // the stacked experts.
    let nk = moe_rows(job, n) * k;
    let rows = crate::fit::ep_capacity_rows(job).map_or(nk, |c| (c as f64).max(nk));
    let e = e / job.parallelism.ep.max(1) as f64;
    // The CPU's f32 output slot for the GEMMs that write bf16 (gate, up, the SwiGLU product's
    // gradient and the experts' outputs: an expert buffer of F or H, an FFN's `N·W`, the head's
    // logits, v `N·KV` and the gradient of attention's output `N·Q`); a GPU writes bf16
    // directly.
    let logits = head_rows(job, n) * v;
    let out = match job.device.kind {
        ganymede_config::DeviceKind::Cuda => 0.0,
        _ => {
            4.0 * (rows * ff.max(h))
                .max(n * width)
                .max(logits)
                .max(n * q.max(kv))
        }
    };
    let rows = rows * h.max(ff);
    let (a, b) = match job.device.kind {
        // The rows the model makes in bf16 (the experts', the SwiGLUs' products and gradients,
        // the logits' gradient) reach a GPU's GEMMs as they are, and so do the weights.
        ganymede_config::DeviceKind::Cuda => (vec![n * h, n * q], vec![n * h]),
        _ => (
            vec![logits, rows, n * width, n * h, n * q],
            vec![v * h, e * ff * h, width * h, q * h, kv * h, rows, n * h],
        ),
    };
    let a = a.into_iter().fold(0.0, f64::max);
    let b = b.into_iter().fold(0.0, f64::max);
    size * (a + b) + out
}

/// The step's scalars besides the routing figures: the loss sum (in the workspace), in the step
/// driver the squared gradient norm and clipping's coefficient, one f64 each, and the
/// optimizer's learning rate and bias corrections in device memory (`RateBuffer`, three f64).
pub const STEP_SCALARS: f64 = 48.0;

/// Bytes of the step's f64 scalars in a step of `k` microbatches: [`STEP_SCALARS`]; with MoE
/// layers, each MoE layer's per-expert router probability sums and counts of routed rows (in
/// the workspace); and the step driver's copy of each microbatch's loss sum and routing
/// figures, read once after the update, and the one place every microbatch's pass writes them
/// first (`ganymede_parallel`'s `StepScalars`).
pub fn step_scalars(m: &ganymede_config::ModelConfig, k: usize) -> f64 {
    let moe_layers = m.layers - m.dense_layers.min(m.layers);
    let route = 2 * m.experts * moe_layers;
    STEP_SCALARS + (8 * route + 8 * (k + 1) * (1 + route)) as f64
}

/// [`ganymede_config::moe_rows`] for `n` of a rank's tokens, as f64.
pub(crate) fn moe_rows(job: &JobConfig, n: f64) -> f64 {
    ganymede_config::moe_rows(n as usize, job.training.moe_chunk_tokens) as f64
}

/// [`ganymede_config::head_rows`] for `n` of a rank's tokens, as f64.
fn head_rows(job: &JobConfig, n: f64) -> f64 {
    ganymede_config::head_rows(n as usize, job.training.loss_chunk_tokens) as f64
}

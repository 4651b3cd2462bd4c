//! Step time on CPU cores (a cluster with a calibrated `[cpu]` section).
//!
//! The GPU model counts FLOPs at one rate. On the CPU that misses most of a small model's time:
//! small GEMMs run far below peak, the element-wise kernels (norms, RoPE, softmax, routing,
//! SwiGLU, residuals, cross-entropy) stream activations through memory, every parallel kernel
//! pays a fork/join, and ranks as threads share the cores. So here each rank's step is the sum
//! over the GEMMs it calls (each at the calibrated rate for its size), its element-wise bytes at
//! the streaming rate, a fixed cost per kernel, and its collectives (copies at the streaming
//! rate plus a barrier each), all multiplied by how many ranks share the cores.
//!
//! The CPU trainer runs a rank's whole local batch as one pass (no gradient accumulation), so
//! GEMM sizes use the rank's tokens per step.

use crate::cluster::CpuSpec;
use crate::params::{self, Handler, LayerShape};
use ganymede_config::{AcMode, ModelConfig};
use serde::Serialize;

/// f32 activations on the CPU.
const F32: f64 = 4.0;
/// Kernels per layer of one forward, excluding GEMMs: two norms, head norm + RoPE, attention,
/// two residual adds; MoE: router, dispatch, gather, SwiGLU, combine (dense: SwiGLU). Backward
/// calls about twice as many (each op's backward and the gradient adds).
const FWD_KERNELS_MOE: f64 = 11.0;
const FWD_KERNELS_DENSE: f64 = 7.0;
const BWD_KERNELS_PER_FWD: f64 = 2.0;
/// Backward element-wise traffic per forward byte: each op's backward reads its saved inputs
/// and the output gradient and writes the input gradient (and adds into the residual stream).
const BWD_BYTES_PER_FWD: f64 = 2.0;
/// Bytes per parameter of the step's passes over the gradients (see `cpu_step`).
pub const GRAD_PASS_BYTES: f64 = 8.0;

/// One kind of GEMM call: `count` calls of m×n×k, `spread` when the calls go whole to separate
/// threads (grouped expert GEMMs, attention heads, Newton–Schulz stacks) rather than each being
/// split over the pool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCall {
    pub m: f64,
    pub n: f64,
    pub k: f64,
    pub count: f64,
    pub spread: bool,
    /// Calls the backward makes per forward call (input and weight gradients: 2).
    pub bwd: f64,
}

impl GemmCall {
    fn one(m: f64, n: f64, k: f64) -> Self {
        GemmCall {
            m,
            n,
            k,
            count: 1.0,
            spread: false,
            bwd: 2.0,
        }
    }
    fn stack(m: f64, n: f64, k: f64, count: f64) -> Self {
        GemmCall {
            m,
            n,
            k,
            count,
            spread: true,
            bwd: 2.0,
        }
    }
    pub fn flops(&self) -> f64 {
        2.0 * self.m * self.n * self.k * self.count
    }
    /// Seconds on the calibrated cores: a stack of at least `threads` calls runs them whole on
    /// every thread at the one-thread rate; anything else one call at a time on the pool.
    pub fn seconds(&self, cpu: &CpuSpec) -> f64 {
        if self.count <= 0.0 || self.m * self.n * self.k <= 0.0 {
            return 0.0;
        }
        let each = 2.0 * self.m * self.n * self.k;
        let t = cpu.threads as f64;
        let rate = if self.spread && self.count >= t {
            // The threads' parallel speedup as measured on the largest GEMM (below `threads`
            // when neighbours hold cores), times the one-thread rate at this size.
            let big = |c: &[[f64; 2]]| c[c.len() - 1][1];
            let speedup = (big(&cpu.gemm) / big(&cpu.gemm_one_thread)).clamp(1.0, t);
            CpuSpec::rate(&cpu.gemm_one_thread, each) * speedup
        } else {
            CpuSpec::rate(&cpu.gemm, each)
        };
        self.flops() / rate
    }
}

/// One layer's forward as the CPU model sees it, for `n` tokens in sequences of `s`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWork {
    pub gemms: Vec<GemmCall>,
    /// Causal attention, per (sequence, head) the QKᵀ and AV products as a stack; the fused
    /// kernel's own calibrated rate when the cluster has one, else as GEMMs.
    pub attention: GemmCall,
    pub head_dim: f64,
    pub backward: bool,
    /// Element-wise bytes read + written (f32).
    pub elementwise_bytes: f64,
    /// Kernel launches besides the GEMMs.
    pub kernels: f64,
}

impl LayerWork {
    /// Work with GEMMs but no attention (the LM head, a recompute of the experts).
    fn without_attention(gemms: Vec<GemmCall>, backward: bool, bytes: f64, kernels: f64) -> Self {
        LayerWork {
            gemms,
            attention: GemmCall {
                count: 0.0,
                ..GemmCall::one(0.0, 0.0, 0.0)
            },
            head_dim: 0.0,
            backward,
            elementwise_bytes: bytes,
            kernels,
        }
    }
    pub fn seconds(&self, cpu: &CpuSpec) -> f64 {
        self.gemm_seconds(cpu)
            + self.attention_seconds(cpu)
            + self.elementwise_bytes / cpu.elementwise_bytes_per_s
            + (self.kernels + self.gemms.len() as f64) * cpu.op_overhead_s
    }
    pub fn gemm_seconds(&self, cpu: &CpuSpec) -> f64 {
        self.gemms.iter().map(|g| g.seconds(cpu)).sum()
    }
    pub fn attention_seconds(&self, cpu: &CpuSpec) -> f64 {
        match cpu.attention_rate(self.head_dim, self.backward) {
            Some(r) => self.attention.flops() / r,
            None => self.attention.seconds(cpu),
        }
    }
    /// GEMM and attention FLOPs.
    pub fn flops(&self) -> f64 {
        self.gemms.iter().map(|g| g.flops()).sum::<f64>() + self.attention.flops()
    }
}

/// The forward of one attention + MoE (or dense) layer over `n` tokens in sequences of `s`.
pub fn layer_forward(m: &ModelConfig, n: f64, s: f64, moe: bool) -> LayerWork {
    layer_forward_chunked(m, n, s, moe, n)
}

/// The routed experts' GEMMs of `chunks` MoE chunks of `rows` tokens each (balanced routing):
/// gate and up, then down, per expert.
fn expert_gemms(m: &ModelConfig, rows: f64, chunks: f64) -> [GemmCall; 2] {
    let (e, k, f, h) = (
        m.experts as f64,
        m.top_k as f64,
        m.expert_hidden as f64,
        m.hidden as f64,
    );
    let c = rows * k / e; // tokens per expert, balanced
    [
        GemmCall::stack(c, f, h, 2.0 * e * chunks),
        GemmCall::stack(c, h, f, e * chunks),
    ]
}

/// [`layer_forward`] with the routed experts run a chunk of `chunk` tokens at a time
/// (`training.moe_chunk_tokens`): the same FLOPs in smaller GEMMs.
pub fn layer_forward_chunked(m: &ModelConfig, n: f64, s: f64, moe: bool, chunk: f64) -> LayerWork {
    let h = m.hidden as f64;
    let (qd, kd, hd) = (m.q_dim() as f64, m.kv_dim() as f64, m.head_dim as f64);
    let seqs = (n / s).max(1.0);
    let mut g = vec![
        GemmCall::one(n, qd, h),
        GemmCall::one(n, kd, h),
        GemmCall::one(n, kd, h),
        GemmCall::one(n, h, qd),
    ];
    // Attention per (sequence, head): QKᵀ and AV, causal (half the square), spread over heads.
    // Backward: scores recomputed from the saved log-sum-exp, then dV, dP, dQ, dK.
    let attention = GemmCall {
        bwd: 2.5,
        ..GemmCall::stack(s, s / 2.0, hd, 2.0 * seqs * m.heads as f64)
    };
    // norm (read x, write xn), head norm + RoPE on q and k (read, write), attention reads q, k,
    // v and writes its output, residual add (read 2, write 1), second norm.
    let mut bytes = n * (2.0 * h + 2.0 * (qd + kd) + (2.0 * qd + 2.0 * kd) + 3.0 * h + 2.0 * h);
    let kernels = if moe {
        let (e, k, f) = (m.experts as f64, m.top_k as f64, m.expert_hidden as f64);
        g.push(GemmCall::one(n, e, h));
        let chunk = chunk.clamp(1.0, n.max(1.0));
        g.extend(expert_gemms(m, chunk, n / chunk));
        // router softmax/top-k (read logits, write probs, read again), gather (read, write
        // k·H per token), SwiGLU (read 2, write 1), combine (read k·H, write H), residual add.
        bytes += n * (3.0 * e + 2.0 * k * h + 3.0 * k * f + (k + 1.0) * h + 3.0 * h);
        if m.shared_experts > 0 {
            let fs = (m.shared_experts * m.shared_hidden()) as f64;
            g.push(GemmCall::one(n, fs, h));
            g.push(GemmCall::one(n, fs, h));
            g.push(GemmCall::one(n, h, fs));
            bytes += n * (3.0 * fs + 3.0 * h);
        }
        FWD_KERNELS_MOE
    } else {
        let d = m.dense_hidden as f64;
        g.push(GemmCall::one(n, d, h));
        g.push(GemmCall::one(n, d, h));
        g.push(GemmCall::one(n, h, d));
        bytes += n * (3.0 * d + 3.0 * h);
        FWD_KERNELS_DENSE
    };
    LayerWork {
        gemms: g,
        attention,
        head_dim: hd,
        backward: false,
        elementwise_bytes: bytes * F32,
        kernels,
    }
}

/// The backward of a layer whose forward is `f`: every GEMM twice (input and weight gradient,
/// same size), attention's five products (scores recomputed from the saved log-sum-exp, then
/// dV, dP, dQ, dK: 2.5x its forward), element-wise traffic and kernels doubled.
pub fn layer_backward(f: &LayerWork) -> LayerWork {
    let mut g = vec![];
    for c in &f.gemms {
        let mut b = *c;
        b.count *= c.bwd;
        g.push(b);
    }
    let mut attention = f.attention;
    attention.count *= f.attention.bwd;
    LayerWork {
        gemms: g,
        attention,
        head_dim: f.head_dim,
        backward: true,
        elementwise_bytes: f.elementwise_bytes * BWD_BYTES_PER_FWD,
        kernels: f.kernels * BWD_KERNELS_PER_FWD,
    }
}

/// Multiply-adds of the CPU backend's symmetric product of an n×k operand (`syrk_host`): row
/// strips of `t` rows, strip r computing columns up to the end of its diagonal block.
pub fn syrk_madds(n: u64, k: u64) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let t = (n / 16).next_multiple_of(8).clamp(64, 512);
    let strips = n.div_ceil(t);
    (0..strips)
        .map(|r| {
            let (i0, i1) = (r * t, (r * t + t).min(n));
            ((i1 - i0) * k * i1) as f64
        })
        .sum()
}

/// One Newton–Schulz call on an s×l matrix (s ≤ l) as the implementation issues it, per step:
/// `syrk(X)` (s×l), `syrk(A)` (s×s), the GEMM `B·X` (s×s by s×l); as GEMM-equivalent calls
/// whose FLOPs are the multiply-adds really done.
pub fn ns_gemms(rows: u64, cols: u64, steps: usize, count: f64) -> Vec<GemmCall> {
    let (s, l) = (rows.min(cols), rows.max(cols));
    let st = steps as f64;
    let (sf, lf) = (s as f64, l as f64);
    // A syrk is timed as a GEMM of its own multiply-adds: s×(madds/(s·k))×k.
    let x = syrk_madds(s, l) / (sf * lf);
    let a = syrk_madds(s, s) / (sf * sf);
    vec![
        GemmCall::stack(sf, x, lf, st * count),
        GemmCall::stack(sf, a, sf, st * count),
        GemmCall::stack(sf, lf, sf, st * count),
    ]
}

/// FLOPs Newton–Schulz really does on one s×l matrix on the CPU (symmetric products as
/// `syrk_host` computes them): per step 2·syrk(s, l) + 2·syrk(s, s) + 2·s²·l.
pub fn ns_flops_cpu(rows: u64, cols: u64, steps: usize) -> f64 {
    ns_gemms(rows, cols, steps, 1.0)
        .iter()
        .map(|g| g.flops())
        .sum()
}

/// What the CPU model predicts for one step, seconds, after sharing the cores.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpuTime {
    /// How many times the cores are oversubscribed: ranks per node x pool threads / cores
    /// (at least 1). Every figure below is one rank's work times this.
    pub share: f64,
    pub forward_s: f64,
    /// Backward, recompute under full checkpointing, LM head and loss.
    pub backward_s: f64,
    /// Of forward + backward: GEMMs and attention, element-wise bytes, kernel overheads.
    pub gemm_s: f64,
    pub elementwise_s: f64,
    pub overhead_s: f64,
    /// Collectives among ranks: their bytes copied at the streaming rate plus a barrier each.
    pub comm_s: f64,
    pub newton_schulz_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
}

/// Inputs of [`cpu_step`] beyond the model.
pub struct CpuStepInputs {
    /// Ranks in the job and per node.
    pub ranks: usize,
    pub ranks_per_node: usize,
    pub tokens_per_rank: f64,
    pub seq: f64,
    /// Keys a token attends on average (`plan::attention_span`): `seq / 2`, or less under
    /// document masking, where the kernels skip keys before a document's start.
    pub attn_span: f64,
    pub ac: AcMode,
    pub muon: bool,
    pub ns_steps: usize,
    /// Bytes one rank sends per step (all collectives) and the collectives it joins.
    pub comm_bytes: f64,
    pub collectives: f64,
    /// Optimizer element-wise bytes of one rank (the planner's 20/28 B per parameter).
    pub optimizer_bytes: f64,
    /// `training.moe_chunk_tokens` and `training.loss_chunk_tokens` (0 = all the rank's).
    pub moe_chunk_tokens: usize,
    pub loss_chunk_tokens: usize,
}

pub fn cpu_step(m: &ModelConfig, cpu: &CpuSpec, x: &CpuStepInputs) -> CpuTime {
    let shape = LayerShape::new(m);
    let n = x.tokens_per_rank;
    let (h, v) = (m.hidden as f64, m.vocab_size as f64);
    let mut gemm_s = 0.0;
    let mut elem_s = 0.0;
    let mut over_s = 0.0;
    let mut add = |w: &LayerWork, times: f64| {
        gemm_s += times * (w.gemm_seconds(cpu) + w.attention_seconds(cpu));
        elem_s += times * w.elementwise_bytes / cpu.elementwise_bytes_per_s;
        over_s += times * (w.kernels + w.gemms.len() as f64) * cpu.op_overhead_s;
        times * w.seconds(cpu)
    };
    let recompute = if x.ac == AcMode::Full { 1.0 } else { 0.0 };
    let mut forward_s = 0.0;
    let mut backward_s = 0.0;
    let tokens = n.round() as usize;
    let chunk = ganymede_config::moe_rows(tokens, x.moe_chunk_tokens) as f64;
    let chunks = (n / chunk).ceil();
    for (layers, moe) in [(shape.moe_layers, true), (shape.dense_layers, false)] {
        if layers == 0 {
            continue;
        }
        let mut f = layer_forward_chunked(m, n, x.seq, moe, chunk);
        f.attention.n = x.attn_span;
        let b = layer_backward(&f);
        let l = layers as f64;
        forward_s += add(&f, l);
        backward_s += add(&f, l * recompute) + add(&b, l);
        if moe && x.ac == AcMode::None && chunks > 1.0 {
            // Without checkpointing the backward recomputes every chunk's experts but the
            // last's (under full checkpointing the recompute runs only the last's: no more).
            let gemms = expert_gemms(m, chunk, chunks - 1.0).to_vec();
            let again = LayerWork::without_attention(gemms, true, 0.0, 0.0);
            backward_s += add(&again, l);
        }
    }
    // Outside the layers: embedding (write n·H; backward reads and scatters it), final norm,
    // LM head (one GEMM forward, two backward), cross-entropy (reads the logits twice and
    // writes their gradient), each once.
    // With the loss in chunks of `c` tokens, the logits' GEMMs are one per chunk, and the
    // backward recomputes every chunk's logits but the last's.
    let c = ganymede_config::head_rows(tokens, x.loss_chunk_tokens) as f64;
    let head_chunks = (n / c).ceil();
    let per_chunk = |m: f64, n: f64, k: f64, count: f64| GemmCall {
        count,
        ..GemmCall::one(m, n, k)
    };
    let head_f = LayerWork::without_attention(
        vec![per_chunk(c, v, h, n / c)],
        false,
        F32 * n * (h + 2.0 * h),
        2.0,
    );
    let mut head_gemms = vec![per_chunk(c, h, v, n / c), per_chunk(v, h, c, n / c)];
    if head_chunks > 1.0 {
        head_gemms.push(per_chunk(c, v, h, head_chunks - 1.0));
    }
    let head_b = LayerWork::without_attention(
        head_gemms,
        true,
        F32 * n * (3.0 * v + 2.0 * h + 4.0 * h),
        4.0,
    );
    forward_s += add(&head_f, 1.0);
    backward_s += add(&head_b, 1.0);

    // Collectives: the bytes are copied once out and once in (read + write each).
    let comm_s = if x.ranks > 1 {
        2.0 * x.comm_bytes / cpu.elementwise_bytes_per_s + x.collectives * cpu.sync_s
    } else {
        0.0
    };

    // Optimizer: element-wise update, one kernel per tensor, and Newton–Schulz. Owners are
    // balanced, so each rank orthogonalises 1/ranks of every stack.
    let ts = params::tensors(m);
    let w = x.ranks.max(1) as f64;
    let mut ns_s = 0.0;
    if x.muon {
        for t in ts.iter().filter(|t| t.handler() == Handler::Muon) {
            let mats = t.count as f64 / w;
            for g in ns_gemms(t.rows, t.cols, x.ns_steps, mats) {
                ns_s += g.seconds(cpu);
            }
            // Per matrix: the normalisation (read + write) and, after an odd number of steps,
            // the copy of the result back from scratch (read + write).
            let (s, l) = (t.rows.min(t.cols) as f64, t.rows.max(t.cols) as f64);
            let passes = 1.0 + (x.ns_steps % 2) as f64;
            ns_s += mats * passes * 2.0 * F32 * s * l / cpu.elementwise_bytes_per_s;
        }
    }
    let tensors: f64 = ts.iter().map(|t| t.count as f64).sum::<f64>() / w;
    // Besides the update, each step passes over the gradients twice: zeroing them (write) and
    // their norm (read), 8 bytes per parameter; clipping's coefficient is applied by the update
    // kernels as they read the gradients.
    let grad_bytes = GRAD_PASS_BYTES * params::count(m).total as f64 / w;
    let optimizer_s = ns_s
        + (x.optimizer_bytes + grad_bytes) / cpu.optimizer_rate()
        + tensors * cpu.op_overhead_s;

    let share = (x.ranks_per_node as f64 * cpu.threads as f64 / cpu.cores).max(1.0);
    let step = forward_s + backward_s + comm_s + optimizer_s;
    CpuTime {
        share,
        forward_s: share * forward_s,
        backward_s: share * backward_s,
        gemm_s: share * gemm_s,
        elementwise_s: share * elem_s,
        overhead_s: share * over_s,
        comm_s: share * comm_s,
        newton_schulz_s: share * ns_s,
        optimizer_s: share * optimizer_s,
        step_s: share * step,
    }
}

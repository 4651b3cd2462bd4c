//! The step's time: each layer a pipeline stage over compute, the link and the host copies;
//! the LM head; the optimizer (Newton–Schulz, its traffic, the element-wise update); HSDP's
//! all-reduce. A cluster with a measured `[cpu]` section is priced by [`crate::cpu_time`]
//! instead; one with a measured `[gpu_measured]` section prices GEMMs by call size and dtype,
//! attention by sequence and head dim, Newton–Schulz by matrix, the element-wise update and the
//! host copies from it ([`Measured`]).

use super::comm::Traffic;
use super::flops::newton_schulz;
use super::Dims;
use crate::cluster::{Cluster, GpuMeasured};
use crate::params::Handler;
use crate::plan::{Layout, MemoryPolicy, NsOn, OptimizerSetup, Placement, StepTime};
use ganymede_config::{AcMode, ComputeDtype, JobConfig};

/// The cluster's effective rates.
struct Rates<'a> {
    gemm: f64,
    attn: f64,
    ib: f64,
    nv: f64,
    lat: f64,
    /// The measured section and whether the model's GEMMs take bf16 operands.
    measured: Option<(&'a GpuMeasured, bool)>,
}

impl<'a> Rates<'a> {
    fn new(cluster: &'a Cluster, job: &JobConfig) -> Self {
        let bf16 = job.training.compute_dtype == ComputeDtype::Bf16;
        let measured = cluster.gpu_measured.as_ref().map(|g| (g, bf16));
        Rates {
            // Measured: the largest call's rate, for what is not priced by size.
            gemm: match measured {
                Some((g, bf16)) => g.gemm_rate(f64::INFINITY, bf16),
                None => cluster.gpu.peak_flops * cluster.gpu.gemm_efficiency,
            },
            attn: cluster.gpu.peak_flops * cluster.gpu.attention_efficiency,
            ib: cluster.links.ib_bytes_per_s * cluster.links.ib_efficiency,
            nv: cluster.links.nvlink_bytes_per_s * cluster.links.nvlink_efficiency,
            lat: cluster.links.collective_latency_s,
            measured,
        }
    }
    /// A collective's time: the slower of its two links, plus latency when it leaves the node.
    fn link_time(&self, ib: f64, nv: f64) -> f64 {
        let t = (ib / self.ib).max(nv / self.nv);
        if ib > 0.0 {
            t + self.lat
        } else {
            t
        }
    }
}

/// Forward and backward over all microbatches.
struct Passes {
    forward_s: f64,
    backward_s: f64,
    /// Exposed per microbatch: the pipeline's fill and drain, the embedding and head's traffic.
    exposed: f64,
    compute_s: f64,
    all_to_all_s: f64,
    fsdp_comm_s: f64,
    bound: &'static str,
}

fn passes(
    d: &Dims,
    cluster: &Cluster,
    policy: &MemoryPolicy,
    offloaded_layers: usize,
    t: &Traffic,
    r: &Rates,
) -> Passes {
    let (l, mf, n_tok) = (d.l, d.mf, d.n_tok);
    // Per layer, per microbatch.
    let lc = layer_compute(d, r);
    let c_fwd = lc.matmul_s + lc.attn_fwd_s;
    let c_bwd = 2.0 * lc.matmul_s
        + lc.attn_bwd_s
        + match policy.ac {
            AcMode::Full => c_fwd,
            AcMode::None => 0.0,
        };
    // Off-node peers over InfiniBand, node mates over NVLink, concurrently.
    let a2a_ib_share = t.a2a_ib_share;
    let a2a_time = |b: f64| (b * a2a_ib_share / r.ib).max(b * (1.0 - a2a_ib_share) / r.nv);
    let a2a_fwd_t = t.moe_frac * a2a_time(t.a2a_per_layer_fwd);
    let a2a_bwd_t = t.moe_frac * a2a_time(t.a2a_per_layer_bwd);
    let ag_t = r.link_time(t.ag_layer.0, t.ag_layer.1);
    let rs_t = r.link_time(t.rs_layer.0, t.rs_layer.1);
    let (boundary_layer, shard) = (d.boundary_layer, d.shard);
    let links = &cluster.links;
    let copy_fwd = (offloaded_layers as f64 / l) * boundary_layer / links.d2h_bytes_per_s
        + if policy.param_offload {
            4.0 * shard / l / links.h2d_bytes_per_s
        } else {
            0.0
        };
    let copy_bwd = (offloaded_layers as f64 / l) * boundary_layer / links.h2d_bytes_per_s
        + if policy.param_offload {
            4.0 * shard / l / links.h2d_bytes_per_s + 4.0 * shard / l / links.d2h_bytes_per_s
        } else {
            0.0
        };
    let overlap = policy.prefetch > 0;
    // One microbatch's forward or backward: a pipeline of layers over compute, the link and
    // the host copies. With overlap, each layer holds the pipeline for its longest stage, and
    // filling and draining it costs one more of the shorter of compute and communication (the
    // first gather before any compute when compute-bound, the last layer's compute when
    // communication-bound). Adding the whole first gather and last reduce-scatter on top, as
    // this once did, counted them twice: the per-layer maximum already holds every gather.
    // Without overlap the stages add up and nothing is left over.
    let layers = |n: f64, compute: f64, comm: f64, copy: f64| {
        if overlap {
            n * compute.max(comm).max(copy)
        } else {
            n * (compute + comm + copy)
        }
    };
    let fill = |compute: f64, comm: f64| if overlap { compute.min(comm) } else { 0.0 };
    let fwd_compute = c_fwd + a2a_fwd_t;
    let bwd_compute = c_bwd + a2a_bwd_t;
    let fwd_layers = layers(l, fwd_compute, ag_t, copy_fwd);
    let fill_fwd = fill(fwd_compute, ag_t);
    let (bwd_layers, fill_bwd) = if policy.keep_last_block {
        // The last block needs no gather: it only reduce-scatters.
        (
            layers(l - 1.0, bwd_compute, ag_t + rs_t, copy_bwd)
                + layers(1.0, bwd_compute, rs_t, copy_bwd),
            fill(bwd_compute, rs_t),
        )
    } else {
        (
            layers(l, bwd_compute, ag_t + rs_t, copy_bwd),
            fill(bwd_compute, ag_t + rs_t),
        )
    };
    // LM head + loss: 6·V·H per token (2 forward, 4 backward), no recompute; measured, at
    // the rate of one loss chunk's product.
    let head_flops = 6.0 * d.v * d.h * n_tok;
    let head_t = match r.measured {
        Some((g, bf16)) => {
            let chunk = (policy.loss_chunk_tokens as f64).min(n_tok).max(1.0);
            head_flops / g.gemm_rate(2.0 * chunk * d.v * d.h, bf16)
        }
        None => head_flops / r.gemm,
    };
    // Embedding and LM head: gathered for forward and again for backward, reduced once; nothing
    // computes while they travel.
    let ag_out_t = r.link_time(t.ag_outside.0, t.ag_outside.1);
    let rs_out_t = r.link_time(t.rs_outside.0, t.rs_outside.1);
    let outside_t = 2.0 * ag_out_t + rs_out_t;
    let l_bwd_gathers = t.l_bwd_gathers;
    // The label weighs the same two paths the time model overlaps: per layer, one gather in
    // forward; a gather (none for a kept last block) and a reduce-scatter in backward.
    let compute_path = l * (fwd_compute + bwd_compute);
    let comm_path = (l + l_bwd_gathers) * ag_t + l * rs_t;
    Passes {
        forward_s: mf * fwd_layers,
        backward_s: mf * (bwd_layers + head_t),
        exposed: fill_fwd + fill_bwd + outside_t,
        compute_s: mf * (l * (c_fwd + c_bwd) + head_t),
        all_to_all_s: mf * l * (a2a_fwd_t + a2a_bwd_t),
        fsdp_comm_s: mf * ((l + l_bwd_gathers) * ag_t + l * rs_t + outside_t),
        bound: if comm_path > compute_path {
            "communication"
        } else {
            "compute"
        },
    }
}

/// One average layer's forward matmuls and attention, per microbatch, seconds.
struct LayerCompute {
    matmul_s: f64,
    attn_fwd_s: f64,
    attn_bwd_s: f64,
}

fn layer_compute(d: &Dims, r: &Rates) -> LayerCompute {
    // A token's keys: half its window, or under document masking half its document's.
    let attn_flops = 4.0 * d.span * d.q_dim * d.n_tok;
    let Some((g, bf16)) = r.measured else {
        return LayerCompute {
            matmul_s: 2.0 * d.layer_matmul * d.n_tok / r.gemm,
            attn_fwd_s: attn_flops / r.attn,
            attn_bwd_s: 2.0 * attn_flops / r.attn,
        };
    };
    let n = d.n_tok;
    let sh = &d.shape;
    // `params` of matmul weights used by every token, in `calls` GEMMs of equal size.
    let gemms = |params: u64, calls: f64| {
        if params == 0 {
            return 0.0;
        }
        let f = 2.0 * n * params as f64;
        f / g.gemm_rate(f / calls, bf16)
    };
    // Routed experts: a rank's N·k rows over its local experts (as many arrive as leave under
    // expert parallelism), gate, up and down each one grouped call; without a measured grouped
    // GEMM, each expert's GEMM alone at its size.
    let experts = if sh.experts == 0 || sh.top_k == 0 {
        0.0
    } else {
        let f = 2.0 * n * (sh.top_k * sh.expert) as f64;
        let rate = g.grouped_rate(f / 3.0).unwrap_or_else(|| {
            let local = (sh.experts as f64 / d.ep as f64).max(1.0);
            g.gemm_rate(f / 3.0 / local, bf16)
        });
        f / rate
    };
    let moe = gemms(sh.attention, 4.0) + gemms(sh.router, 1.0) + experts + gemms(sh.shared, 3.0);
    let dense = gemms(sh.attention, 4.0) + gemms(sh.dense_ffn, 3.0);
    let matmul_s = (sh.moe_layers as f64 * moe + sh.dense_layers as f64 * dense) / d.l;
    let hd = d.m.head_dim as f64;
    let rate = |bwd: bool| g.attention_rate(d.seq, hd, bwd);
    LayerCompute {
        matmul_s,
        attn_fwd_s: attn_flops / rate(false).unwrap_or(r.attn),
        // The calibration counts backward as 2.5x forward's FLOPs (the kernel recomputes the
        // scores); the efficiency model, as twice.
        attn_bwd_s: match rate(true) {
            Some(b) => 2.5 * attn_flops / b,
            None => 2.0 * attn_flops / r.attn,
        },
    }
}

/// The optimizer step.
struct OptimizerTime {
    newton_schulz_s: f64,
    comm_s: f64,
    total_s: f64,
    /// Bytes the element-wise update reads and writes on one GPU.
    elem_bytes: f64,
}

fn optimizer_time(
    d: &Dims,
    job: &JobConfig,
    cluster: &Cluster,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
    t: &Traffic,
    r: &Rates,
) -> OptimizerTime {
    let (p, wf) = (&d.p, d.wf);
    let (ns_total, ns_dense) = newton_schulz(d, opt);
    // On a GPU at the bf16 GEMM rate unless `optimizer.ns_dtype = "f32"` (auto is bf16 there).
    let ns_bf16 = job.optimizer.ns_dtype.bf16_on(true);
    let gpu_f32_rate = match r.measured {
        Some((g, _)) => g.gemm_rate(f64::INFINITY, false),
        None => {
            cluster.gpu.peak_f32_flops.unwrap_or(cluster.gpu.peak_flops)
                * cluster.gpu.gemm_efficiency
        }
    };
    let ns_rate = match opt.ns_on {
        NsOn::Gpu if ns_bf16 => r.gemm,
        NsOn::Gpu => gpu_f32_rate,
        NsOn::Cpu => cluster.host.peak_f32_flops_per_gpu * cluster.host.gemm_efficiency,
    };
    // Owners balanced: each GPU orthogonalises 1/W of the work.
    let (ns_t, ns_dense_t) = match (r.measured, opt.ns_on) {
        (Some((g, _)), NsOn::Gpu) if d.muon && !g.newton_schulz.is_empty() => {
            // Measured per matrix: each Muon tensor at its own shape's time.
            let sum = |dense_only: bool| -> f64 {
                d.ts.iter()
                    .filter(|t| t.handler() == Handler::Muon && !(dense_only && t.expert))
                    .map(|t| {
                        let s = g.newton_schulz_s(
                            t.rows as usize,
                            t.cols as usize,
                            opt.ns_steps,
                            ns_bf16,
                        );
                        t.count as f64 * s.expect("measured")
                    })
                    .sum()
            };
            (sum(false) / wf, sum(true) / wf)
        }
        _ => (ns_total / wf / ns_rate, ns_dense / wf / ns_rate),
    };
    let opt_rate = if t.opt_on_ib { r.ib } else { r.nv };
    let opt_comm_t = t.opt_bytes / opt_rate + t.opt_colls as f64 * r.lat;
    let ns_and_comm = match (d.muon, opt.placement) {
        (false, _) => 0.0,
        // Gather, orthogonalise, scatter: in sequence.
        (true, Placement::Naive) => opt_comm_t + ns_t,
        // Dense matrices travel while each rank works through its own experts.
        (true, Placement::Flexshard) => opt_comm_t.max(ns_t - ns_dense_t) + ns_dense_t,
    };
    let copy_t =
        t.ns_copy / cluster.links.h2d_bytes_per_s + t.ns_copy / cluster.links.d2h_bytes_per_s;
    // Element-wise update: Muon reads p, g, m and writes p, m (20 B); AdamW p, g, m, v and
    // writes p, m, v (28 B).
    let elem_bytes = if d.muon {
        20.0 * p.muon as f64 + 28.0 * p.adamw as f64
    } else {
        28.0 * p.total as f64
    } / wf;
    let elem_rate = if policy.param_offload {
        cluster.host.memory_bytes_per_s
    } else {
        cluster.gpu.memory_bytes_per_s
    };
    OptimizerTime {
        newton_schulz_s: ns_t,
        comm_s: opt_comm_t,
        total_s: ns_and_comm + copy_t + elem_bytes / elem_rate,
        elem_bytes,
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn step_time(
    d: &Dims,
    job: &JobConfig,
    cluster: &Cluster,
    layout: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
    offloaded_layers: usize,
    t: &mut Traffic,
) -> StepTime {
    // Measured copies and element-wise rates stand in for the hand-written ones.
    let replaced;
    let cluster = match &cluster.gpu_measured {
        Some(g) => {
            replaced = with_measured(cluster, g);
            &replaced
        }
        None => cluster,
    };
    let r = Rates::new(cluster, job);
    let pass = passes(d, cluster, policy, offloaded_layers, t, &r);
    let o = optimizer_time(d, job, cluster, policy, opt, t, &r);

    // HSDP: the cross-replica gradient all-reduce (crate::hsdp), once per step.
    let hsdp = crate::hsdp::all_reduce(
        t.grad_shard_bytes,
        layout.dp_replicate,
        d.w,
        d.gpn,
        |ib, nv| r.link_time(ib, nv),
    );
    t.communication.hsdp_all_reduce = hsdp.bytes;
    t.communication.ib_bytes += hsdp.ib_bytes;
    t.communication.nvlink_bytes += hsdp.nvlink_bytes;
    let (ib_step, nv_step) = (t.ib_step + hsdp.ib_bytes, t.nv_step + hsdp.nvlink_bytes);

    let mut time = StepTime {
        compute_s: pass.compute_s,
        all_to_all_s: pass.all_to_all_s,
        fsdp_comm_s: pass.fsdp_comm_s,
        ib_s: ib_step / r.ib,
        nvlink_s: nv_step / r.nv,
        d2h_s: t.d2h / cluster.links.d2h_bytes_per_s,
        h2d_s: t.h2d / cluster.links.h2d_bytes_per_s,
        forward_s: pass.forward_s,
        backward_s: pass.backward_s,
        exposed_s: d.mf * pass.exposed,
        optimizer_s: o.total_s,
        newton_schulz_s: o.newton_schulz_s,
        optimizer_comm_s: o.comm_s,
        hsdp_all_reduce_s: hsdp.time_s,
        step_s: pass.forward_s + pass.backward_s + d.mf * pass.exposed + o.total_s + hsdp.time_s,
        bound: pass.bound.into(),
        cpu: None,
        measured: cluster.gpu_measured.as_ref().map(|g| g.device.clone()),
    };
    if let Some(spec) = &cluster.cpu {
        cpu_override(
            &mut time,
            d,
            job,
            layout,
            policy,
            opt,
            t,
            ib_step + nv_step,
            o.elem_bytes,
            spec,
        );
    }
    time
}

/// The cluster with `[gpu_measured]`'s optimizer bandwidth as the device's memory bandwidth
/// and its copy rates, where measured, as the links'.
fn with_measured(cluster: &Cluster, g: &GpuMeasured) -> Cluster {
    let mut c = cluster.clone();
    c.gpu.memory_bytes_per_s = g.optimizer_bytes_per_s;
    if g.d2h_bytes_per_s > 0.0 {
        c.links.d2h_bytes_per_s = g.d2h_bytes_per_s;
    }
    if g.h2d_bytes_per_s > 0.0 {
        c.links.h2d_bytes_per_s = g.h2d_bytes_per_s;
    }
    c
}

/// A cluster with a measured `[cpu]` section: [`crate::cpu_time`] prices the step instead.
#[allow(clippy::too_many_arguments)]
fn cpu_override(
    time: &mut StepTime,
    d: &Dims,
    job: &JobConfig,
    layout: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
    t: &Traffic,
    comm_bytes: f64,
    elem_bytes: f64,
    spec: &crate::cluster::CpuSpec,
) {
    let l = d.l;
    // Collectives a rank joins per step: gathers forward and backward, reduce-scatters,
    // the embedding/head's three, the all-to-all's per MoE layer, the optimizer's.
    let a2a_calls = if d.has_moe && d.ep > 1 {
        d.shape.moe_layers as f64 * if policy.ac == AcMode::Full { 6.0 } else { 4.0 }
    } else {
        0.0
    };
    let collectives = d.mf * ((l + t.l_bwd_gathers) + l + 3.0 + a2a_calls) + t.opt_colls as f64;
    let c = crate::cpu_time::cpu_step(
        d.m,
        spec,
        &crate::cpu_time::CpuStepInputs {
            ranks: d.w,
            ranks_per_node: d.gpn,
            tokens_per_rank: (layout.tokens_per_step() as f64 / layout.world() as f64).max(1.0),
            seq: d.seq,
            attn_span: d.span,
            ac: policy.ac,
            muon: d.muon,
            ns_steps: opt.ns_steps,
            comm_bytes,
            collectives,
            optimizer_bytes: elem_bytes,
            moe_chunk_tokens: job.training.moe_chunk_tokens,
            loss_chunk_tokens: job.training.loss_chunk_tokens,
        },
    );
    time.forward_s = c.forward_s;
    time.backward_s = c.backward_s;
    time.exposed_s = c.comm_s;
    time.compute_s = c.forward_s + c.backward_s;
    time.newton_schulz_s = c.newton_schulz_s;
    time.fsdp_comm_s = c.comm_s;
    time.optimizer_comm_s = 0.0;
    time.optimizer_s = c.optimizer_s;
    time.step_s = c.step_s;
    time.cpu = Some(c);
}

//! The arithmetic of one layout, in four sections that each read the layout's [`Dims`]:
//! [`flops`] (work per token), [`memory`] (bytes by category on the GPU and the host),
//! [`comm`] (bytes on each link) and [`time`] (the step, from the three and the cluster's
//! rates). Callers run [`crate::plan::check`] first; nothing here refuses a layout.

mod comm;
mod flops;
mod memory;
mod time;

use crate::cluster::Cluster;
use crate::params::{self, LayerShape, ParamCounts, TensorKind};
use crate::plan::{Layout, MemoryPolicy, OptimizerReport, OptimizerSetup, Plan};
use ganymede_config::{JobConfig, ModelConfig, OptimizerName};

/// The model's and the layout's sizes every section reads, as the formulas name them.
struct Dims<'a> {
    m: &'a ModelConfig,
    p: ParamCounts,
    shape: LayerShape,
    ts: Vec<TensorKind>,
    /// FSDP degree (as a count and as a float), expert parallelism, the expert-FSDP group,
    /// GPUs per node.
    w: usize,
    wf: f64,
    ep: usize,
    efsdp: usize,
    gpn: usize,
    /// Layers, hidden size, vocabulary, sequence, tokens per GPU per microbatch.
    l: f64,
    h: f64,
    v: f64,
    seq: f64,
    /// Keys a token attends on average ([`crate::plan::attention_span`]).
    span: f64,
    n_tok: f64,
    /// Microbatches per step.
    mf: f64,
    k: f64,
    q_dim: f64,
    /// Matmul parameters one token uses in an average layer.
    layer_matmul: f64,
    has_moe: bool,
    muon: bool,
    /// Bytes of one parameter shard's elements: a GPU's 1/W of the model.
    shard: f64,
    /// One layer's boundary activation (its input), N tokens.
    boundary_layer: f64,
}

impl<'a> Dims<'a> {
    fn new(
        job: &'a JobConfig,
        layout: &Layout,
        policy: &MemoryPolicy,
        opt: &OptimizerSetup,
    ) -> Self {
        let m = &job.model;
        let p = params::count(m);
        let shape = LayerShape::new(m);
        let w = layout.dp_shard;
        let wf = w as f64;
        let n_tok = (layout.micro_batch * layout.seq_len) as f64;
        let h = m.hidden as f64;
        Dims {
            m,
            ts: params::tensors(m),
            w,
            wf,
            ep: layout.ep,
            efsdp: w / layout.ep,
            gpn: layout.gpus_per_node,
            l: m.layers as f64,
            h,
            v: m.vocab_size as f64,
            seq: layout.seq_len as f64,
            span: crate::plan::attention_span(job, layout.seq_len),
            n_tok,
            mf: layout.microbatches() as f64,
            k: m.top_k as f64,
            q_dim: m.q_dim() as f64,
            layer_matmul: shape.avg_active_matmul(),
            has_moe: shape.moe_layers > 0,
            muon: opt.name == OptimizerName::Muon,
            shard: p.total as f64 / wf,
            // Block boundaries in `boundary_bytes` (bf16 by default, as a bf16 PyTorch
            // model's hidden states between layers).
            boundary_layer: n_tok * h * policy.boundary_bytes,
            p,
            shape,
        }
    }
}

/// Predict everything for one layout.
pub(crate) fn evaluate(
    job: &JobConfig,
    cluster: &Cluster,
    layout: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
) -> Plan {
    let d = Dims::new(job, layout, policy, opt);
    let flops = flops::flops(&d, policy, layout.tokens_per_step());
    let mem = memory::memory(job, &d, cluster, policy, opt);
    let mut traffic = comm::traffic(&d, layout, policy, opt, mem.memory.offloaded_layers);
    let offloaded = mem.memory.offloaded_layers;
    let time = time::step_time(
        &d,
        job,
        cluster,
        layout,
        policy,
        opt,
        offloaded,
        &mut traffic,
    );
    let step_s = time.step_s;
    let m = d.m;

    // The batch is split over every replica's ranks.
    let tokens_per_gpu = (layout.tokens_per_step() as f64 / layout.world() as f64).round() as u64;
    let tps = tokens_per_gpu as f64 / step_s;
    let peak = cluster.gpu.peak_flops;
    let memory = mem.memory;
    let fits = memory.gpu_total <= memory.gpu_capacity && memory.host_total <= memory.host_capacity;
    let verdict = crate::plan::verdict_text(
        fits,
        memory.gpu_total,
        memory.gpu_capacity,
        memory.host_total,
        memory.host_capacity,
        policy,
        memory.min_offload_fraction,
    );
    let wf = d.wf;
    Plan {
        model: format!(
            "{} layers, hidden {}, {} experts top-{}",
            m.layers, m.hidden, m.experts, m.top_k
        ),
        cluster: cluster.name.clone(),
        layout: layout.clone(),
        policy: policy.clone(),
        tokens_per_step: layout.tokens_per_step(),
        tokens_per_gpu_per_step: tokens_per_gpu,
        microbatches: layout.microbatches(),
        flops: flops.clone(),
        optimizer: OptimizerReport {
            name: opt.name,
            placement: opt.placement,
            ns_on: opt.ns_on,
            state_bytes: mem.opt_state,
            adamw_state_bytes: mem.adamw_state,
            muon_saving_bytes: mem.adamw_state - mem.opt_state,
            muon_saving_per_gpu: (mem.adamw_state - mem.opt_state) / wf,
            ns_flops: flops::newton_schulz(&d, opt).0,
        },
        communication: traffic.communication,
        time,
        step_time_s: step_s,
        tokens_per_s_per_gpu: tps,
        mfu: tps * flops.model_per_token / peak,
        mfu_torchtitan: tps * (flops.matmul_per_token + flops.attention_per_token_noncausal) / peak,
        hfu: tps * flops.hardware_per_token / peak,
        fits,
        gpu_headroom: memory.gpu_capacity - memory.gpu_total,
        host_headroom: memory.host_capacity - memory.host_total,
        memory,
        verdict,
        fit_fix: None,
        inputs: cluster.provenance(),
        params: d.p,
    }
}

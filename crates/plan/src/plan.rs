//! The plan: parameters, FLOPs, memory, communication and step time of one layout.
//!
//! Units: bytes, seconds, FLOPs; everything per GPU and per step unless a name says otherwise.
//! Every modelling assumption is written next to the line that makes it.

use crate::cluster::Cluster;
use crate::evaluate::evaluate;
use crate::params::ParamCounts;
use ganymede_config::{AcMode, JobConfig, OptimizerName};
use serde::{Deserialize, Serialize};

/// How the model is laid out over the cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub nodes: usize,
    pub gpus_per_node: usize,
    /// HSDP replicas of the FSDP group (1: plain FSDP); GPUs = dp_replicate × dp_shard.
    #[serde(default = "one")]
    pub dp_replicate: usize,
    /// FSDP degree: every rank holds a 1/dp_shard shard of every parameter.
    pub dp_shard: usize,
    /// Expert-parallel degree, carved out of `dp_shard` (experts are FSDP-sharded over
    /// `dp_shard / ep` ranks).
    pub ep: usize,
    pub seq_len: usize,
    /// Sequences per GPU per forward/backward.
    pub micro_batch: usize,
    /// Sequences per optimizer step, over all GPUs.
    pub global_batch: usize,
}

impl Layout {
    /// The job config's own layout: `[parallelism]`, `[training] batch_size`, `model.seq_len`,
    /// one sequence per microbatch; nodes follow from `dp_shard` and the cluster's node size.
    pub fn from_job(job: &JobConfig, cluster: &Cluster) -> Layout {
        let replicas = job.parallelism.dp_replicate.max(1);
        let dp = job.parallelism.dp_shard.max(1) * replicas;
        let gpn = cluster.gpus_per_node;
        let (nodes, gpus_per_node) = if dp.is_multiple_of(gpn) {
            (dp / gpn, gpn)
        } else if dp < gpn {
            (1, dp)
        } else {
            (dp.div_ceil(gpn), gpn)
        };
        Layout {
            nodes,
            gpus_per_node,
            dp_replicate: replicas,
            dp_shard: dp / replicas,
            ep: job.parallelism.ep.max(1),
            seq_len: job.model.seq_len,
            // What the trainer runs: `training.micro_batch_size`, else a rank's whole share.
            micro_batch: job.training.micro_batch(dp).max(1),
            global_batch: job.training.batch_size,
        }
    }
    pub fn gpus(&self) -> usize {
        self.nodes * self.gpus_per_node
    }
    /// Data-parallel ranks: every replica's FSDP group (the batch is split over all of them).
    pub fn world(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }
    /// Forward/backward passes per GPU per step (gradient accumulation).
    pub fn microbatches(&self) -> usize {
        self.global_batch / (self.world() * self.micro_batch).max(1)
    }
    pub fn tokens_per_step(&self) -> u64 {
        self.global_batch as u64 * self.seq_len as u64
    }
}

/// Where memory goes: checkpointing, offload, buffers, precisions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryPolicy {
    pub ac: AcMode,
    /// Share of layers whose boundary activation is copied to host memory (full AC only).
    pub offload_fraction: f64,
    /// FSDP CPU offload: parameter shards, gradients and optimizer state live on the host and
    /// the optimizer's element-wise update runs there.
    pub param_offload: bool,
    /// Layers gathered ahead of the one computing.
    pub prefetch: usize,
    /// All-gather buffers allocated on the compute stream (FSDP's `unshard_async_op`). Without
    /// it the caching allocator keeps the gather stream's blocks apart from the compute
    /// stream's, which the planner counts as one more set of unsharded layer buffers.
    pub unshard_async_op: bool,
    /// Bytes per element of activations in flight (expert all-to-all; 2: bf16).
    pub param_bytes: f64,
    /// Bytes per element of the all-gathered layer weights, on the wire and in the unsharded
    /// buffers (2: bf16; 1: fp8, TorchTitan's float8 all-gather). The embedding and LM head
    /// always travel in `param_bytes`.
    #[serde(default = "bf16_bytes")]
    pub gather_bytes: f64,
    /// Bytes per element of the gradient reduce-scatter (4: fp32, TorchTitan's default).
    pub reduce_bytes: f64,
    /// Bytes per element of the residual stream at block boundaries, kept and offloaded
    /// (`activation_checkpoint.boundary_dtype`): 2 (bf16; `auto` under the planner's bf16
    /// compute), or 4 (f32).
    #[serde(default = "bf16_bytes")]
    pub boundary_bytes: f64,
    /// Keep the last block unsharded from the end of forward into backward (TorchTitan does:
    /// backward needs it first), which saves one layer's gather per microbatch. Off by default
    /// because ganymede's sharded trainer gathers it again (its byte counts are tested against
    /// the planner's).
    #[serde(default)]
    pub keep_last_block: bool,
    /// Tokens per chunk of the LM head + cross-entropy (logits are never materialised for more):
    /// the job's `training.loss_chunk_tokens` where set, else 4,096 (the write-up's system
    /// chunks its loss).
    pub loss_chunk_tokens: usize,
}

impl MemoryPolicy {
    pub fn from_job(job: &JobConfig) -> Self {
        MemoryPolicy {
            ac: job.activation_checkpoint.mode,
            offload_fraction: job.activation_checkpoint.offload_fraction,
            param_offload: false,
            prefetch: 1,
            unshard_async_op: true,
            param_bytes: 2.0,
            gather_bytes: 2.0,
            reduce_bytes: 4.0,
            // The planner computes in bf16 (`param_bytes`), so `auto` is bf16 here whatever
            // `training.compute_dtype` says (the CPU run's own dtype is the ledger's business).
            boundary_bytes: match job.activation_checkpoint.boundary_dtype {
                ganymede_config::BoundaryDtype::F32 => 4.0,
                ganymede_config::BoundaryDtype::Auto | ganymede_config::BoundaryDtype::Bf16 => 2.0,
            },
            keep_last_block: false,
            loss_chunk_tokens: match job.training.loss_chunk_tokens {
                0 => 4096,
                c => c,
            },
        }
    }
}

fn bf16_bytes() -> f64 {
    2.0
}

fn one() -> usize {
    1
}

/// How Muon's whole-matrix Newton–Schulz meets FSDP's shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Every Muon matrix gathered to one owner rank (owners balanced) and scattered back.
    Naive,
    /// Routed experts owned whole (no traffic); dense matrices gathered on owners while the
    /// experts' Newton–Schulz runs.
    Flexshard,
}

/// Where Newton–Schulz runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NsOn {
    Gpu,
    Cpu,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSetup {
    pub name: OptimizerName,
    pub placement: Placement,
    pub ns_on: NsOn,
    pub ns_steps: usize,
}

impl OptimizerSetup {
    pub fn from_job(job: &JobConfig) -> Self {
        OptimizerSetup {
            name: job.optimizer.name,
            placement: Placement::Flexshard,
            ns_on: NsOn::Gpu,
            ns_steps: job.optimizer.ns_steps,
        }
    }
}

/// A layout that cannot run at all, naming the value and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid job config: {0}")]
    Config(String),
    #[error("FSDP degree dp_shard = {dp_shard} times dp_replicate = {dp_replicate} replicas must equal the GPU count nodes x gpus_per_node = {nodes} x {gpus_per_node} = {gpus} (no other parallelism is modelled)")]
    GpuCount {
        dp_replicate: usize,
        dp_shard: usize,
        nodes: usize,
        gpus_per_node: usize,
        gpus: usize,
    },
    #[error("expert parallelism ep = {ep} must divide model.experts = {experts}")]
    EpExperts { ep: usize, experts: usize },
    #[error("expert parallelism ep = {ep} must divide the FSDP degree dp_shard = {dp_shard}")]
    EpShard { ep: usize, dp_shard: usize },
    #[error("expert-parallel groups must tile nodes: ep = {ep} must divide gpus_per_node = {gpus_per_node} or be a multiple of it")]
    EpNode { ep: usize, gpus_per_node: usize },
    #[error("global batch {global_batch} sequences is not a multiple of dp_replicate x dp_shard x micro_batch = {dp_replicate} x {dp_shard} x {micro_batch}")]
    Batch {
        global_batch: usize,
        dp_replicate: usize,
        dp_shard: usize,
        micro_batch: usize,
    },
    #[error("{key} = {value}: {reason}")]
    Value {
        key: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("a sequence of {seq_len} tokens (x {micro_batch} per microbatch) cannot be held on {cluster}: even with full checkpointing, every boundary activation and all parameter state offloaded, one GPU needs {need_gib:.1} GiB of {have_gib:.1} GiB")]
    SequenceTooLong {
        cluster: String,
        seq_len: usize,
        micro_batch: usize,
        need_gib: f64,
        have_gib: f64,
    },
}

/// FLOPs per token and per step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Flops {
    /// 6 · active matmul parameters (embedding lookup excluded, LM head included).
    pub matmul_per_token: f64,
    /// Keys a token attends on average: s/2 for causal attention over windows of s, min(s, D)/2
    /// under `data.document_mask` with documents of `data.mean_document_tokens` = D.
    pub attention_span_per_token: f64,
    /// Causal attention, forward + backward: 12 · span · heads · head_dim · layers (QKᵀ and
    /// AV, each 2·span·q_dim per token forward, x3 for backward; 6 · s · q_dim · layers
    /// without document masking).
    pub attention_per_token: f64,
    /// The same without causal halving or document masking (TorchTitan's 12 · L · H · Q · T
    /// convention).
    pub attention_per_token_noncausal: f64,
    /// Model FLOPs per token: matmul + causal attention (no recompute).
    pub model_per_token: f64,
    /// The extra forward full checkpointing recomputes (layers only, not the LM head).
    pub recompute_per_token: f64,
    /// Hardware FLOPs per token: model + recompute.
    pub hardware_per_token: f64,
    /// Model FLOPs per step, all GPUs.
    pub model_per_step: f64,
}

impl Flops {
    /// Model FLOPs utilisation at `tokens_per_s` per GPU on a GPU of `peak` FLOP/s, with causal
    /// attention halved (ours) and not halved (TorchTitan's convention).
    pub fn mfu_at(&self, tokens_per_s: f64, peak: f64) -> (f64, f64) {
        (
            tokens_per_s * self.model_per_token / peak,
            tokens_per_s * (self.matmul_per_token + self.attention_per_token_noncausal) / peak,
        )
    }
}

/// Bytes by category; the same categories serve the GPU and the host.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemoryCategories {
    /// fp32 master parameter shards.
    pub master_params: f64,
    /// fp32 gradient shards.
    pub grads: f64,
    /// Optimizer state shards (Muon one fp32 per parameter, AdamW two).
    pub optimizer_states: f64,
    /// bf16 compute copies: unsharded layer parameters, (1 + prefetch) layers, plus the larger
    /// of embedding and LM head.
    pub unsharded_params: f64,
    /// One layer's unsharded gradients (bf16 as computed plus the reduce-dtype copy).
    pub unsharded_grads: f64,
    /// Boundary activations kept here (layers × tokens × hidden × 2 bytes, less what is
    /// offloaded).
    pub boundary_activations: f64,
    /// Activations inside layers: one layer's recompute working set under full AC; every
    /// layer's under no AC.
    pub layer_activations: f64,
    /// Expert-dispatch all-to-all send and receive buffers.
    pub dispatch_buffers: f64,
    /// One chunk of fp32 logits and their gradient.
    pub logits: f64,
    /// Gather-stream blocks the allocator cannot reuse (without `unshard_async_op`).
    pub allocator_slack: f64,
    /// Newton–Schulz workspace for the largest Muon matrix (four fp32 copies).
    pub ns_workspace: f64,
    /// Runtime reserve (GPU only).
    pub reserved: f64,
}

impl MemoryCategories {
    pub fn total(&self) -> f64 {
        self.master_params
            + self.grads
            + self.optimizer_states
            + self.unsharded_params
            + self.unsharded_grads
            + self.boundary_activations
            + self.layer_activations
            + self.dispatch_buffers
            + self.logits
            + self.allocator_slack
            + self.ns_workspace
            + self.reserved
    }
    /// (name, bytes) in a fixed order, for tables.
    pub fn rows(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("master params (fp32)", self.master_params),
            ("grads (fp32)", self.grads),
            ("optimizer states", self.optimizer_states),
            ("unsharded params (bf16)", self.unsharded_params),
            ("unsharded grads", self.unsharded_grads),
            ("boundary activations", self.boundary_activations),
            ("layer activations", self.layer_activations),
            ("dispatch buffers", self.dispatch_buffers),
            ("logits chunk", self.logits),
            ("allocator slack", self.allocator_slack),
            ("NS workspace", self.ns_workspace),
            ("runtime reserve", self.reserved),
        ]
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Memory {
    pub gpu: MemoryCategories,
    pub host: MemoryCategories,
    pub gpu_total: f64,
    pub host_total: f64,
    pub gpu_capacity: f64,
    pub host_capacity: f64,
    /// All boundary activations of one microbatch, before offload.
    pub boundary_activation_bytes: f64,
    pub offloaded_layers: usize,
    /// Smallest offload fraction (whole layers) with which GPU and host both fit; `None` when
    /// none does (or checkpointing is off).
    pub min_offload_fraction: Option<f64>,
}

/// Bytes one GPU sends per step, by kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Communication {
    /// FSDP all-gathers: forward, and again in backward (which also feeds the recompute).
    pub fsdp_all_gather_fwd: f64,
    pub fsdp_all_gather_bwd: f64,
    pub fsdp_reduce_scatter: f64,
    /// HSDP: the gradient shards' all-reduce across replicas (0 without replicas).
    pub hsdp_all_reduce: f64,
    /// Expert-dispatch all-to-all (dispatch + combine, forward, backward and recompute).
    pub ep_all_to_all: f64,
    /// Optimizer traffic of the chosen optimizer and placement.
    pub optimizer: f64,
    /// Optimizer traffic under each alternative, for comparison.
    pub optimizer_naive_muon: f64,
    pub optimizer_flexshard: f64,
    pub optimizer_adamw: f64,
    /// Collectives the optimizer issues per step (naive / FlexShard).
    pub optimizer_collectives_naive: u64,
    pub optimizer_collectives_flexshard: u64,
    /// The chosen step's bytes by link.
    pub ib_bytes: f64,
    pub nvlink_bytes: f64,
    /// Host–device copies (activation offload, offloaded parameters and gradients).
    pub d2h_bytes: f64,
    pub h2d_bytes: f64,
    /// Whether the expert all-to-all stays inside a node.
    pub ep_on_nvlink: bool,
}

/// Seconds per step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTime {
    /// Compute alone (GPU, all microbatches), and the exposed all-to-all.
    pub compute_s: f64,
    pub all_to_all_s: f64,
    /// FSDP traffic alone, on its bottleneck link.
    pub fsdp_comm_s: f64,
    /// Each link's bytes at its achieved rate, as if nothing else ran.
    pub ib_s: f64,
    pub nvlink_s: f64,
    pub d2h_s: f64,
    pub h2d_s: f64,
    /// Forward and backward with overlap (each layer takes the longer of its compute path and
    /// its communication path), all microbatches.
    pub forward_s: f64,
    pub backward_s: f64,
    /// What the per-layer overlap leaves exposed, all microbatches: filling and draining the
    /// forward and backward layer pipelines (the shorter of a layer's compute and its
    /// communication, each) and the embedding/LM-head gathers and reduce-scatter.
    pub exposed_s: f64,
    /// Optimizer step: Newton–Schulz, its traffic, copies, element-wise update.
    pub optimizer_s: f64,
    pub newton_schulz_s: f64,
    pub optimizer_comm_s: f64,
    /// HSDP's cross-replica gradient all-reduce, exposed after backward (see [`crate::hsdp`]).
    pub hsdp_all_reduce_s: f64,
    pub step_s: f64,
    /// What bounds forward and backward: "compute" or "communication".
    pub bound: String,
    /// The CPU model's breakdown, on a cluster with a calibrated `[cpu]` section (which then
    /// sets every figure above that it covers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<crate::cpu_time::CpuTime>,
    /// The device whose measured rates (`[gpu_measured]`) priced the step, when the cluster has
    /// them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OptimizerReport {
    pub name: OptimizerName,
    pub placement: Placement,
    pub ns_on: NsOn,
    /// Optimizer state bytes, whole model.
    pub state_bytes: f64,
    /// The same under AdamW everywhere, and Muon's saving.
    pub adamw_state_bytes: f64,
    pub muon_saving_bytes: f64,
    pub muon_saving_per_gpu: f64,
    /// Newton–Schulz FLOPs per step, whole model (5 quintic steps: 5·(4s²l + 2s³) per s×l).
    pub ns_flops: f64,
}

/// Everything the planner predicts for one layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub model: String,
    pub cluster: String,
    pub layout: Layout,
    pub policy: MemoryPolicy,
    pub params: ParamCounts,
    pub tokens_per_step: u64,
    pub tokens_per_gpu_per_step: u64,
    pub microbatches: usize,
    pub flops: Flops,
    pub memory: Memory,
    pub optimizer: OptimizerReport,
    pub communication: Communication,
    pub time: StepTime,
    pub step_time_s: f64,
    pub tokens_per_s_per_gpu: f64,
    /// Model FLOPs (causal attention, no recompute) / peak.
    pub mfu: f64,
    /// MFU under TorchTitan's convention (attention not halved).
    pub mfu_torchtitan: f64,
    /// Hardware FLOPs (with recompute) / peak.
    pub hfu: f64,
    pub fits: bool,
    /// Free GPU and host bytes (negative when over).
    pub gpu_headroom: f64,
    pub host_headroom: f64,
    pub verdict: String,
    /// When the layout does not fit: the smallest change of policy that makes it fit.
    pub fit_fix: Option<FitFix>,
    /// The cluster's inputs and where each comes from (measured, spec, assumed).
    pub inputs: Vec<crate::cluster::InputSource>,
}

/// A change of memory policy that makes a layout fit, as `ganymede plan` flags.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FitFix {
    /// Flags to add, e.g. `--param-offload --offload-fraction 0.730`.
    pub flags: String,
    pub policy: MemoryPolicy,
    /// The fixed layout's prediction.
    pub tokens_per_s_per_gpu: f64,
    pub step_time_s: f64,
}

/// Check that a layout can exist on a cluster for a job.
pub fn check(job: &JobConfig, layout: &Layout, policy: &MemoryPolicy) -> Result<(), PlanError> {
    job.model
        .validate()
        .map_err(|e| PlanError::Config(e.to_string()))?;
    for (key, v) in [
        ("nodes", layout.nodes),
        ("gpus_per_node", layout.gpus_per_node),
        ("dp_replicate", layout.dp_replicate),
        ("dp_shard", layout.dp_shard),
        ("ep", layout.ep),
        ("seq_len", layout.seq_len),
        ("micro_batch", layout.micro_batch),
        ("global_batch", layout.global_batch),
    ] {
        if v == 0 {
            return Err(PlanError::Value {
                key,
                value: "0".into(),
                reason: "must be at least 1",
            });
        }
    }
    if layout.world() != layout.gpus() {
        return Err(PlanError::GpuCount {
            dp_replicate: layout.dp_replicate,
            dp_shard: layout.dp_shard,
            nodes: layout.nodes,
            gpus_per_node: layout.gpus_per_node,
            gpus: layout.gpus(),
        });
    }
    if !job.model.experts.is_multiple_of(layout.ep) {
        return Err(PlanError::EpExperts {
            ep: layout.ep,
            experts: job.model.experts,
        });
    }
    if !layout.dp_shard.is_multiple_of(layout.ep) {
        return Err(PlanError::EpShard {
            ep: layout.ep,
            dp_shard: layout.dp_shard,
        });
    }
    if !layout.gpus_per_node.is_multiple_of(layout.ep)
        && !layout.ep.is_multiple_of(layout.gpus_per_node)
    {
        return Err(PlanError::EpNode {
            ep: layout.ep,
            gpus_per_node: layout.gpus_per_node,
        });
    }
    if !layout
        .global_batch
        .is_multiple_of(layout.world() * layout.micro_batch)
    {
        return Err(PlanError::Batch {
            global_batch: layout.global_batch,
            dp_replicate: layout.dp_replicate,
            dp_shard: layout.dp_shard,
            micro_batch: layout.micro_batch,
        });
    }
    if !(0.0..=1.0).contains(&policy.offload_fraction) {
        return Err(PlanError::Value {
            key: "offload_fraction",
            value: policy.offload_fraction.to_string(),
            reason: "must be in [0, 1]",
        });
    }
    for (key, v) in [
        ("gather_bytes", policy.gather_bytes),
        ("reduce_bytes", policy.reduce_bytes),
        ("param_bytes", policy.param_bytes),
    ] {
        if !(v > 0.0 && v.is_finite()) {
            return Err(PlanError::Value {
                key,
                value: v.to_string(),
                reason: "must be a positive number of bytes",
            });
        }
    }
    if policy.loss_chunk_tokens == 0 {
        return Err(PlanError::Value {
            key: "loss_chunk_tokens",
            value: "0".into(),
            reason: "must be at least 1",
        });
    }
    Ok(())
}

/// Bytes one GPU receives (= sends) over InfiniBand and NVLink in a ring-style all-gather or
/// reduce-scatter of a `full`-byte tensor over a group of `n` ranks with `q` of them per node.
///
/// A node needs the `(N-1)/N` of the tensor held on the other `N = n/q` nodes once; its `q`
/// members bring it in through their own adapters (`/q` each) and spread it over NVLink.
pub(crate) fn group_traffic(full: f64, n: usize, q: usize) -> (f64, f64) {
    if n <= 1 {
        return (0.0, 0.0);
    }
    let q = q.clamp(1, n);
    let nodes = (n / q) as f64;
    let ib = full * (nodes - 1.0) / nodes / q as f64;
    let nv = full * (q as f64 - 1.0) / q as f64;
    (ib, nv)
}

/// Newton–Schulz FLOPs for one s×l matrix (s ≤ l): steps · (4·s²·l + 2·s³).
pub fn ns_flops(rows: u64, cols: u64, steps: usize) -> f64 {
    let (s, l) = (rows.min(cols) as f64, rows.max(cols) as f64);
    steps as f64 * (4.0 * s * s * l + 2.0 * s * s * s)
}

const GIB: f64 = (1u64 << 30) as f64;

/// Predict everything for one layout.
pub fn plan(
    job: &JobConfig,
    cluster: &Cluster,
    layout: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
) -> Result<Plan, PlanError> {
    check(job, layout, policy)?;
    let mut core = evaluate(job, cluster, layout, policy, opt);
    if !core.fits {
        core.fit_fix = smallest_fix(job, cluster, layout, policy, opt);
        match &core.fit_fix {
            Some(f) => core.verdict.push_str(&format!(
                "; smallest change that fits: {} ({:.0} tokens/s per GPU)",
                f.flags, f.tokens_per_s_per_gpu
            )),
            None => core
                .verdict
                .push_str("; no change of checkpointing or offload makes it fit"),
        }
    }
    // A sequence the model cannot hold: the most frugal policy still overflows the GPU.
    let frugal = MemoryPolicy {
        ac: AcMode::Full,
        offload_fraction: 1.0,
        param_offload: true,
        unshard_async_op: true,
        ..policy.clone()
    };
    let lean = evaluate(job, cluster, layout, &frugal, opt);
    if lean.memory.gpu_total > lean.memory.gpu_capacity {
        return Err(PlanError::SequenceTooLong {
            cluster: cluster.name.clone(),
            seq_len: layout.seq_len,
            micro_batch: layout.micro_batch,
            need_gib: lean.memory.gpu_total / GIB,
            have_gib: lean.memory.gpu_capacity / GIB,
        });
    }
    Ok(core)
}

/// Candidate policy changes, least intrusive first: more activation offload; the state on the
/// host; both; checkpointing (then with offloads). The first that fits wins, each at its
/// smallest fitting offload fraction.
fn smallest_fix(
    job: &JobConfig,
    cluster: &Cluster,
    layout: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
) -> Option<FitFix> {
    let mut candidates: Vec<(Vec<String>, MemoryPolicy)> = vec![];
    for ac in [policy.ac, AcMode::Full] {
        for param_offload in [policy.param_offload, true] {
            let mut flags = vec![];
            if ac != policy.ac {
                flags.push("--ac full".to_string());
            }
            if param_offload != policy.param_offload {
                flags.push("--param-offload".to_string());
            }
            let changed = MemoryPolicy {
                ac,
                param_offload,
                ..policy.clone()
            };
            candidates.push((flags, changed));
        }
    }
    for (mut flags, mut pol) in candidates {
        let p = evaluate(job, cluster, layout, &pol, opt);
        if !p.fits {
            // Under full checkpointing, the smallest fraction of layers offloaded that fits.
            let Some(f) = p.memory.min_offload_fraction else {
                continue;
            };
            let layers = ganymede_config::offloaded_layers(f, job.model.layers);
            // Printed with three decimals, which maps back to the same whole layers.
            let printed = format!("{f:.3}");
            pol.offload_fraction = printed.parse().expect("a formatted float parses");
            debug_assert_eq!(
                ganymede_config::offloaded_layers(pol.offload_fraction, job.model.layers),
                layers
            );
            flags.push(format!("--offload-fraction {printed}"));
        }
        let p = evaluate(job, cluster, layout, &pol, opt);
        if p.fits && !flags.is_empty() {
            return Some(FitFix {
                flags: flags.join(" "),
                policy: pol,
                tokens_per_s_per_gpu: p.tokens_per_s_per_gpu,
                step_time_s: p.step_time_s,
            });
        }
    }
    None
}

/// Keys a token attends on average in windows of `seq` tokens: `seq / 2` (causal), or with
/// `data.document_mask` `min(seq, data.mean_document_tokens) / 2` (attention stops at each
/// document's start; documents assumed of the mean length).
pub fn attention_span(job: &JobConfig, seq: usize) -> f64 {
    let d = &job.data;
    let keys = if d.document_mask {
        seq.min(d.mean_document_tokens)
    } else {
        seq
    };
    keys as f64 / 2.0
}

pub(crate) fn verdict_text(
    fits: bool,
    gpu: f64,
    gpu_cap: f64,
    host: f64,
    host_cap: f64,
    policy: &MemoryPolicy,
    min_offload: Option<f64>,
) -> String {
    let mut s = if fits {
        format!(
            "fits: {:.1} GiB free on the GPU, {:.1} GiB free on the host",
            (gpu_cap - gpu) / GIB,
            (host_cap - host) / GIB
        )
    } else {
        let mut parts = vec![];
        if gpu > gpu_cap {
            parts.push(format!(
                "GPU over by {:.1} GiB ({:.1} of {:.1})",
                (gpu - gpu_cap) / GIB,
                gpu / GIB,
                gpu_cap / GIB
            ));
        }
        if host > host_cap {
            parts.push(format!(
                "host over by {:.1} GiB ({:.1} of {:.1})",
                (host - host_cap) / GIB,
                host / GIB,
                host_cap / GIB
            ));
        }
        format!("does not fit: {}", parts.join("; "))
    };
    // A layout that does not fit gets its smallest fix from `plan` instead.
    match (policy.ac, min_offload) {
        _ if !fits => {}
        (AcMode::Full, Some(f)) => {
            s.push_str(&format!("; smallest offload fraction that fits: {f:.3}"))
        }
        (AcMode::Full, None) => s.push_str("; no offload fraction fits"),
        (AcMode::None, _) => {}
    }
    s
}

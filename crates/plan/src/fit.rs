//! Where a CPU run's bytes live, per memory and ledger category, and the fit check before launch.
//!
//! [`predict_memory`] places the terms of [`predict_cpu_ledger`] on the two memories of the
//! CPU backend's two-memory mode (the emulated device, ledger device `gpu0`, and pinned host
//! memory, `host`); [`fit_check`] holds the device's share against `device.memory_gib` and, when
//! it does not fit, finds the smallest change of `[activation_checkpoint]` / `[optimizer]` (then
//! token chunks, microbatches and gradient sets) that does. `ganymede train` runs the check
//! before it builds anything; `ganymede plan` prints it.
//!
//! # Layout rules
//!
//! All in [`place`]; change them there when the runtime moves bytes. On several ranks they
//! apply to one rank's state and workspace.
//!
//! 1. `device.kind = "cpu"`: one memory; every category on `host`.
//! 2. `device.kind = "cpu-two-memory"`: every category on the device, except:
//!    - activation offload (`activation_checkpoint.offload_fraction` f, only under
//!      `mode = "full"`): with n = `offloaded_layers(f, L)` > 0, the block inputs (residual
//!      boundaries) 0..n are in pinned host memory (`activations` on `host`, n·N·H elements,
//!      N the rank's tokens, in the boundaries' dtype: f32, or bf16 under
//!      `activation_checkpoint.boundary_dtype = "bf16"` and its default `auto` at bf16
//!      compute); the device keeps the other L + 1 − n boundaries plus min(n, 2) pool slots
//!      of N·H elements of that dtype (prefetch and write-back), and with bf16 boundaries
//!      their f32 working copy. Offloading one or two layers therefore saves nothing.
//!    - optimizer offload (`optimizer.offload = true`): the optimizer state (the rank's
//!      shards) is on `host`; gradients and Muon's scratch stay on the device, which gains two
//!      staging slots (`buffers`), each sized for the largest single tensor's (shard's) state:
//!      numel under Muon, 2·numel under AdamW (3·numel on several ranks, where the master
//!      shard travels with its moments), f32; a layer's routed and shared experts are one
//!      stacked tensor each. On one rank the parameters stay on the device (they are what the
//!      model computes with); on several, the f32 master shards are on `host` too, and the
//!      device gains one f32 copy of a block's shards per gather slot and of the root's (the
//!      gathers' source), while initialisation briefly holds the largest whole tensor.
//!
//! 3. `device.kind = "cuda"`: as 2, and the host also holds the staging ring's pinned slots
//!    (`buffers`, see [`staging_bytes`]) through which the step's u32 and f64 writes reach the
//!    device without a host wait; the device also holds the fused attention backward's dq
//!    sums ([`attention_dq_sums_bytes`]).
//!
//! # Sharded layouts (`ranks` = W > 1)
//!
//! One rank's memory, from the FSDP layout of `crates/parallel` (see [`sharded`]): f32 shards
//! of every tensor (dim-0 rows split in W, padded; under FlexShard a layer's routed experts
//! split by whole experts), its gradient and optimizer-state shards, the activation workspace
//! of batch/W sequences, and the buffers: the root unit (embedding, final norm, LM head) whole,
//! `prefetch + 1` gather slots of one block's parameters (f32, but bf16 for the GEMM weights
//! under `training.compute_dtype = "bf16"`), `parallelism.gradient_sets` (default two) sets of
//! one block's full gradients (`grads`; a reduce-scatter sends from one while the next block
//! writes the other; Muon's update is made in the gradient shards, so it adds none), the
//! whole matrices the rank gathers as a Newton–Schulz root (rank 0's, see
//! [`root_elems`]), one Newton–Schulz scratch (and one per further thread for the small
//! shapes), and the gather staging of every slot and of the root (f32 receive buffers for
//! what is not gathered in the dtype the model reads, or bf16 send buffers and such receive
//! buffers), all made once and on the device. Unsharded parameters gathered in the dtype the
//! model reads, and every full gradient, are held in buffers with room for their padded rows
//! (the shard times the group), which the gathers write and the reduce-scatters send. Each tensor is drawn whole before its shard is
//! kept, so the `params` peak is the shards before the largest such moment plus that whole
//! tensor, a moment before anything else exists. Under expert parallelism (ep > 1) a rank
//! gathers its ep slice of each layer's routed experts (E/ep), sharded over the W/ep ranks that
//! hold it, and holds the expert-parallel row buffers for [`ep_capacity_rows`] rows (see
//! `sharded`); a step whose routing outgrows them grows them past this prediction.
//! Blocks of different shapes (`model.dense_layers` > 0) make
//! the runtime reshape its slots and gradient pool as it walks the schedule, briefly holding
//! both shapes; the largest block stands for all here, which measured 16% low on `grads` and
//! 10% high on `buffers` for `tiny` with one dense layer on 2 ranks (the presets' blocks are
//! uniform and match to the byte).

use crate::ledger::{predict_cpu_ledger, CpuLedger};
use ganymede_config::{offloaded_layers, AcMode, DeviceKind, JobConfig, OptimizerName};
use serde::Serialize;

/// Bytes per ledger category.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Categories {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub buffers: f64,
}

impl Categories {
    /// (ledger name, bytes), in the order the trainer allocates them at world size 1 (params,
    /// gradients, optimizer state and its scratch, then the activation workspace), which is
    /// the order [`FitCheck::overflow`] fills the device in.
    pub fn entries(&self) -> [(&'static str, f64); 5] {
        [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("buffers", self.buffers),
            ("activations", self.activations),
        ]
    }
    fn get_mut(&mut self, name: &str) -> &mut f64 {
        match name {
            "params" => &mut self.params,
            "grads" => &mut self.grads,
            "optimizer" => &mut self.optimizer,
            "activations" => &mut self.activations,
            "buffers" => &mut self.buffers,
            _ => panic!("no ledger category {name}"),
        }
    }
    pub fn get(&self, name: &str) -> Option<f64> {
        self.entries()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| b)
    }
    /// The sum over categories: at world size 1 the predicted peak of the memory, since every
    /// category is allocated up front and held for the whole run (see
    /// [`MemoryPrediction::device_peak`] for sharded runs).
    pub fn total(&self) -> f64 {
        self.entries().iter().map(|(_, b)| b).sum()
    }
}

/// Predicted peak bytes of a run per memory and category.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPrediction {
    /// The emulated device (ledger device `gpu0`); all zero in one-memory mode.
    pub device: Categories,
    /// Host memory (ledger device `host`): everything in one-memory mode, what is offloaded in
    /// two-memory mode.
    pub host: Categories,
    /// Peak of the device's total: the sum of its categories, except that a sharded run's
    /// whole-tensor moments at initialisation (the `params` peak) come before anything else.
    pub device_peak: f64,
    /// Peak of the host's total, likewise.
    pub host_peak: f64,
    /// Layers whose block input is in host memory (activation offload).
    pub offloaded_layers: usize,
}

/// The predicted peak bytes per memory and category of `job` run with `threads` worker threads
/// on `ranks` ranks (one rank's).
pub fn predict_memory(job: &JobConfig, threads: usize, ranks: usize) -> MemoryPrediction {
    if ranks > 1 {
        let w = shard_degree(job, ranks);
        let mut sh = sharded(job, w, ranks, threads);
        let mut host = Categories::default();
        if job.optimizer.offload {
            sh.device.buffers += sh.stage;
            // With two memories the master shards are in pinned host memory (with one, `place`
            // puts everything on the host anyway).
            if job.device.kind != DeviceKind::Cpu {
                host.params = sh.params_steady;
                sh.device.params = sh.init_whole;
                sh.params_steady = 0.0;
            }
        }
        // Initialisation's peak is params alone, before anything else exists.
        let excess = sh.device.params - sh.params_steady;
        let mut p = place(job, sh.device, host, ranks, largest_shard_state(job, w));
        let (total, params) = match job.device.kind {
            DeviceKind::Cpu => (&mut p.host_peak, p.host.params),
            DeviceKind::CpuTwoMemory | DeviceKind::Cuda => (&mut p.device_peak, p.device.params),
        };
        *total = (*total - excess).max(params);
        return p;
    }
    let one: CpuLedger = predict_cpu_ledger(&one_microbatch(job, 1), threads);
    // The step driver keeps each microbatch's figures until the step's end: the whole step's
    // copies, not one microbatch's.
    let (m, k) = (&job.model, job.training.microbatches(1));
    let stash = crate::ledger::step_scalars(m, k) - crate::ledger::step_scalars(m, 1);
    let all = Categories {
        params: one.params,
        grads: one.grads,
        optimizer: one.optimizer,
        activations: one.activations,
        buffers: one.buffers + stash,
    };
    place(
        job,
        all,
        Categories::default(),
        1,
        largest_shard_state(job, 1),
    )
}

/// The layout rules of the module documentation, applied to what a rank holds: `device`
/// (everything that would be on the device without offload) and `host` (what is on the host
/// regardless); `state` is the largest single tensor's optimizer state, in elements.
fn place(
    job: &JobConfig,
    mut device: Categories,
    mut host: Categories,
    ranks: usize,
    state: u64,
) -> MemoryPrediction {
    if job.device.kind == DeviceKind::Cpu {
        // One memory: the host holds both.
        for (name, b) in device.entries() {
            *host.get_mut(name) += b;
        }
        return MemoryPrediction {
            device: Categories::default(),
            device_peak: 0.0,
            host_peak: host.total(),
            host,
            offloaded_layers: 0,
        };
    }
    let m = &job.model;
    let n_off = match job.activation_checkpoint.mode {
        AcMode::Full => offloaded_layers(job.activation_checkpoint.offload_fraction, m.layers),
        AcMode::None => 0,
    };
    if n_off > 0 {
        let tokens = job.training.micro_batch(ranks) * m.seq_len;
        // In the boundaries' dtype, as the model stores and offloads them
        // (`ganymede_model::activation_bytes_offloaded`).
        let size = match crate::ledger::bf16_boundaries(job) {
            true => 2.0,
            false => 4.0,
        };
        let boundary = size * (tokens * m.hidden) as f64;
        host.activations += n_off as f64 * boundary;
        device.activations += (n_off.min(2) as f64 - n_off as f64) * boundary;
    }
    if job.optimizer.offload {
        host.optimizer += device.optimizer;
        device.optimizer = 0.0;
        device.buffers += 2.0 * 4.0 * state as f64;
    }
    if job.device.kind == DeviceKind::Cuda {
        host.buffers += staging_bytes(job, ranks);
        device.buffers += attention_dq_sums_bytes(job, ranks);
    }
    MemoryPrediction {
        device_peak: device.total(),
        host_peak: host.total(),
        device,
        host,
        offloaded_layers: n_off,
    }
}

/// Device bytes of the fused attention backward's f32 dq sums on one of `ranks` ranks (the
/// CUDA backend's default under bf16 compute at head_dim 16, 32 or 64, on sm_80 and later;
/// `GANYMEDE_CUDA_ATTENTION=deterministic` or `simt` does without them): 4 per element of q,
/// one slot of the rank's whole batch, at least 256 bytes. Other kernels' scratch (partial
/// sums, a few MiB) is not counted.
pub fn attention_dq_sums_bytes(job: &JobConfig, ranks: usize) -> f64 {
    let m = &job.model;
    let bf16 = job.training.compute_dtype == ganymede_config::ComputeDtype::Bf16;
    if !bf16 || !matches!(m.head_dim, 16 | 32 | 64) {
        return 0.0;
    }
    let n = job.training.micro_batch(ranks) * m.seq_len;
    (4 * n * m.heads * m.head_dim).max(256) as f64
}

/// `job` as one forward and backward of one of `ranks` ranks sees it: a batch of one
/// microbatch of the rank's share (what the ledger terms of [`predict_cpu_ledger`] size).
fn one_microbatch(job: &JobConfig, ranks: usize) -> JobConfig {
    let mut local = job.clone();
    local.training.batch_size = job.training.micro_batch(ranks);
    local.training.micro_batch_size = 0;
    local
}

/// Pinned host bytes of the CUDA backend's staging ring on one of `ranks` ranks: every one of
/// [`ganymede_core::staging::STAGING_SLOTS`] slots at the slot size of the step's largest staged write
/// (all slots take it within the first steps, since a step stages more writes than there are
/// slots or the ring turns over within a few). The writes, with N the rank's tokens and E the
/// experts: the token ids and targets (4N bytes each) and their grouping by id (4(3N + 1));
/// per MoE layer the aux-loss constants (8E) and each grouped GEMM's pointer arrays (24 bytes
/// per expert with rows, at most E/ep); under expert parallelism the received rows' two
/// orders (4 bytes a row, up to [`ep_capacity_rows`]: beyond it the rows grow, as do the
/// row buffers).
pub fn staging_bytes(job: &JobConfig, ranks: usize) -> f64 {
    let m = &job.model;
    let n = job.training.micro_batch(ranks) * m.seq_len;
    let mut writes = vec![4 * (3 * n + 1)];
    if (0..m.layers).any(|l| m.is_moe_layer(l)) {
        writes.push(8 * m.experts);
        writes.push(24 * m.experts.div_ceil(job.parallelism.ep.max(1)));
        writes.extend(ep_capacity_rows(job).map(|rows| 4 * rows));
    }
    // Larger writes are not staged (they block).
    let largest = writes
        .into_iter()
        .filter(|&b| b <= ganymede_core::staging::STAGING_MAX_BYTES)
        .max()
        .unwrap_or(0);
    if largest == 0 {
        return 0.0;
    }
    (ganymede_core::staging::STAGING_SLOTS * ganymede_core::staging::staging_slot_bytes(largest))
        as f64
}

/// How a runtime tensor is updated and sharded.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Muon under `optimizer.name = "muon"` (2-D matrices other than embedding, LM head,
    /// router), else AdamW.
    Matrix,
    /// A layer's experts stacked `[E, rows, cols]`; `routed` ones split by expert under
    /// FlexShard.
    Experts { routed: bool },
    /// AdamW always: embedding, LM head, router, norms.
    AdamW,
    /// Stored, never updated: the selection bias.
    Frozen,
}

/// One tensor of the model as the runtime holds it (`ganymede_model::param_specs`): its block
/// (`None`: the root unit), shape and kind.
struct Rt {
    block: Option<usize>,
    shape: Vec<u64>,
    kind: Kind,
    /// Handed to the model in bf16 under bf16 compute (`ganymede_model::Model::bf16_weight`:
    /// the GEMM weights and the embedding).
    bf16_weight: bool,
}

fn runtime_tensors(m: &ganymede_config::ModelConfig) -> Vec<Rt> {
    use ganymede_config::Role;
    ganymede_config::model_tensors(m)
        .into_iter()
        .map(|t| {
            let kind = match t.role {
                Role::Attention | Role::DenseFfn => Kind::Matrix,
                Role::RoutedExperts => Kind::Experts { routed: true },
                Role::SharedExperts => Kind::Experts { routed: false },
                Role::RouterBias => Kind::Frozen,
                Role::Embedding | Role::LmHead | Role::Norm | Role::Router => Kind::AdamW,
            };
            // The GEMMs' weights and the embedding reach the model in bf16; norms, the router
            // and the bias do not.
            let bf16_weight = matches!(kind, Kind::Matrix | Kind::Experts { .. })
                || matches!(t.role, Role::Embedding | Role::LmHead);
            Rt {
                block: t.layer,
                shape: t.shape.iter().map(|&d| d as u64).collect(),
                kind,
                bf16_weight,
            }
        })
        .collect()
}

/// How a rank's shards are cut: FSDP over `w` ranks, routed experts split over `ep` first (a
/// rank gathers its slice of `E/ep` over the `w/ep` ranks holding that slice), FlexShard or not.
#[derive(Clone, Copy)]
struct Cut {
    w: u64,
    ep: u64,
    flex: bool,
}

impl Rt {
    fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    fn routed(&self) -> bool {
        matches!(self.kind, Kind::Experts { routed: true })
    }
    /// Elements a rank gathers and computes with: its ep slice of routed experts, else all.
    fn local(&self, c: Cut) -> u64 {
        if self.routed() {
            self.numel() / c.ep
        } else {
            self.numel()
        }
    }
    /// Ranks the tensor is sharded over (the placement plan's group).
    fn group(&self, c: Cut) -> u64 {
        if self.routed() {
            c.w / c.ep
        } else {
            c.w
        }
    }
    /// Elements of this rank's shard, padding included (the placement plan's `shard_elems`):
    /// dim-0 rows (a stacked tensor's first two dims) split evenly over [`Self::group`], or, for
    /// routed experts under FlexShard, whole experts of the rank's ep slice.
    fn shard(&self, c: Cut) -> u64 {
        let s = &self.shape;
        let g = self.group(c);
        match self.kind {
            Kind::Experts { routed: true } if c.flex => (s[0] / c.ep).div_ceil(g) * s[1] * s[2],
            Kind::Experts { routed: true } => (s[0] / c.ep * s[1]).div_ceil(g) * s[2],
            Kind::Experts { .. } => (s[0] * s[1]).div_ceil(g) * s[2],
            _ => s[0].div_ceil(g) * (self.numel() / s[0]),
        }
    }
    /// The gathered array with its padding: the shard times the group. The runtime's gradient
    /// tensors, and the unsharded parameters a gather writes, have buffers this long.
    fn padded(&self, c: Cut) -> u64 {
        self.shard(c) * self.group(c)
    }
    /// Muon's `(rows, cols)` under `muon`, else `None`.
    fn muon(&self, muon: bool) -> Option<(u64, u64)> {
        match (muon, self.kind) {
            (true, Kind::Matrix) => Some((self.shape[0], self.shape[1])),
            (true, Kind::Experts { .. }) => Some((self.shape[1], self.shape[2])),
            _ => None,
        }
    }
}

/// The matrix sets one rank of several orthogonalises, as `(rows, cols, count)`: a routed
/// stack's owned experts under FlexShard (`ceil(E/ep / efsdp)`, the most a rank owns), under
/// naive placement its ep slice whole (on its root), a shared-expert stack whole, a dense
/// matrix alone. `ganymede_parallel::optim` sizes its batched Newton–Schulz scratch by the
/// same counts, on every rank.
fn sharded_stacks(ts: &[Rt], c: Cut) -> Vec<(usize, usize, usize)> {
    ts.iter()
        .filter_map(|t| {
            let (r, cols) = t.muon(true)?;
            let count = match t.kind {
                Kind::Experts { routed: true } => {
                    let local = t.shape[0] / c.ep;
                    if c.flex {
                        local.div_ceil(t.group(c)).min(local)
                    } else {
                        local
                    }
                }
                Kind::Experts { routed: false } => t.shape[0],
                _ => 1,
            };
            Some((r as usize, cols as usize, count as usize))
        })
        .collect()
}

/// One rank's bytes under FSDP, before offload.
struct Sharded {
    /// Everything, gather staging included, as if on the device.
    device: Categories,
    /// `params` once initialisation is over (the shards).
    params_steady: f64,
    /// The largest whole tensor, drawn during initialisation.
    init_whole: f64,
    /// With host-resident master shards: their device copies per gather slot and the root's.
    stage: f64,
}

/// HSDP: the FSDP degree on `ranks` ranks. A rank holds the state of FSDP over its replica's
/// `dp_shard` ranks (the cross-replica all-reduce is in place on the gradient shards, so it
/// adds no bytes), while the batch is split over all `ranks`.
pub fn shard_degree(job: &JobConfig, ranks: usize) -> usize {
    let p = &job.parallelism;
    if p.dp_replicate > 1 && p.world() == ranks {
        p.dp_shard
    } else {
        ranks
    }
}

/// One rank's bytes under FSDP over `w` ranks, the batch split over `ranks` (`w` but for HSDP's
/// replicas), expert parallelism included.
fn sharded(job: &JobConfig, w: usize, ranks: usize, threads: usize) -> Sharded {
    let p = &job.parallelism;
    let m = &job.model;
    let ts = runtime_tensors(m);
    let flex = p.muon_placement == ganymede_config::MuonPlacement::Flexshard;
    let cut = Cut {
        w: w as u64,
        ep: p.ep as u64,
        flex,
    };
    let muon = job.optimizer.name == OptimizerName::Muon;
    let f = 4.0;
    let sum = |it: &mut dyn Iterator<Item = u64>| it.sum::<u64>() as f64;
    let shards = sum(&mut ts.iter().map(|t| t.shard(cut)));
    // Gradients are held with their padded rows, which the reduce-scatters send as they are.
    let root_full = sum(&mut ts
        .iter()
        .filter(|t| t.block.is_none())
        .map(|t| t.padded(cut)));
    // The root's gradients: the embedding's shares the LM head's tensor, one shape [V, H]; the
    // head's are reduce-scattered before the embedding's backward.
    let embedding = ts
        .iter()
        .find(|t| t.block.is_none())
        .expect("the embedding");
    let root_grads = root_full - embedding.padded(cut) as f64;
    // Blocks of one shape are reused; the largest block stands for all.
    let block = |g: &dyn Fn(&Rt) -> u64| {
        (0..m.layers)
            .map(|l| sum(&mut ts.iter().filter(|t| t.block == Some(l)).map(g)))
            .fold(0.0, f64::max)
    };
    let block_full = block(&|t| t.padded(cut));
    // What the model reads: bf16 weights under bf16 compute, the rest f32. A tensor
    // gathered in that dtype is gathered straight into it (its buffer holds the padded rows);
    // the others (f32 gathers of bf16 weights) through a padded receive buffer and a cast.
    let bf16_compute = job.training.compute_dtype == ganymede_config::ComputeDtype::Bf16;
    let bf16 = p.gather_dtype == ganymede_config::GatherDtype::Bf16;
    let half = |t: &Rt| bf16_compute && t.bf16_weight;
    let direct = |t: &Rt| bf16 == half(t);
    let unsharded = |t: &Rt| {
        let elems = match direct(t) {
            true => t.padded(cut),
            false => t.local(cut),
        };
        if half(t) {
            2 * elems
        } else {
            4 * elems
        }
    };
    // The embedding and the LM head (same shape and dtype) take turns in one tensor: the
    // embedding's while the step begins, the LM head's from the final norm on.
    let lm_head = ts.iter().rfind(|t| t.block.is_none()).expect("the LM head");
    let root_bytes = sum(&mut ts.iter().filter(|t| t.block.is_none()).map(unsharded))
        - unsharded(lm_head) as f64;
    let block_bytes = block(&unsharded);
    let block_shard = block(&|t| t.shard(cut));
    let state = sum(&mut ts.iter().map(|t| match (t.kind, t.muon(muon)) {
        (Kind::Frozen, _) => 0,
        (_, Some(_)) => t.shard(cut),
        _ => 2 * t.shard(cut),
    }));
    let stacks = sharded_stacks(&ts, cut);
    let ns_scratch = ns_scratch_elems(job, &ts, &stacks, muon, threads);
    let root_shard = sum(&mut ts
        .iter()
        .filter(|t| t.block.is_none())
        .map(|t| t.shard(cut)));
    let slots = (p.prefetch + 1) as f64;
    // Receive buffers of the gathers: none for a tensor gathered straight into what the model
    // reads, else padded.
    let recv = |t: &Rt| match direct(t) {
        true => 0,
        false => t.padded(cut),
    };
    let block_recv = block(&recv);
    // The root's gathers run one after another through one receive buffer and (bf16) one send
    // buffer, each sized for the largest root tensor.
    let root_max = |g: &dyn Fn(&Rt) -> u64| {
        let root = ts.iter().filter(|t| t.block.is_none());
        root.map(g).max().unwrap_or(0) as f64
    };
    let root_recv = root_max(&recv);
    let root_send16 = root_max(&|t| t.shard(cut));
    let local = one_microbatch(job, ranks);
    // Accumulating, a microbatch after the first reduce-scatters into landing shards
    // (`ganymede_parallel::fsdp`) added into the shards: one block's per gradient set, and the
    // root's.
    let landing = match local.training.batch_size < job.training.batch_size / ranks {
        true => p.gradient_sets as f64 * block_shard + root_shard,
        false => 0.0,
    };
    // Each tensor is drawn whole before its shard is kept, in table order.
    let mut before = 0;
    let mut init_peak = 0;
    for t in &ts {
        init_peak = init_peak.max(before + t.numel());
        before += t.shard(cut);
    }
    // The gather staging, made once: f32 receive buffers per slot and for the root, or bf16
    // send and receive buffers per slot and for the root.
    let gather_staging = if bf16 {
        2.0 * (slots * (block_shard + block_recv) + root_send16 + root_recv)
    } else {
        f * (slots * block_recv + root_recv)
    };
    let (ep_kept, ep_scratch) = ep_buffers(job, &local);
    let device = Categories {
        params: f * shards.max(init_peak as f64),
        grads: f * (shards + landing + root_grads + p.gradient_sets as f64 * block_full),
        optimizer: f * state,
        activations: predict_cpu_ledger(&local, 1).activations + ep_kept,
        buffers: root_bytes
            + slots * block_bytes
            + f * (root_elems(&ts, cut, muon) as f64 + ns_scratch)
            + gather_staging
            + ep_scratch
            + crate::ledger::step_scalars(m, job.training.microbatches(ranks))
            + crate::ledger::bf16_gemm_scratch(&local),
    };
    let init_whole = ts.iter().map(Rt::numel).max().unwrap_or(0) as f64;
    Sharded {
        device,
        params_steady: f * shards,
        init_whole: f * init_whole,
        stage: f * (slots * block_shard + root_shard),
    }
}

/// Newton–Schulz scratch elements: one for every shape, and one per further thread for the
/// small shapes, whose stacks (experts) spread across threads whole; with `optimizer.ns_batch`
/// batching (a GPU's default), A, B and the ping-pong copy of the largest batch too (in place
/// on the gradient shards: no Nesterov copy).
fn ns_scratch_elems(
    job: &JobConfig,
    ts: &[Rt],
    stacks: &[(usize, usize, usize)],
    muon: bool,
    threads: usize,
) -> f64 {
    let scratch = |small_only: bool| {
        let (ss, sl) = ts
            .iter()
            .filter_map(|t| t.muon(muon))
            .filter(|&(r, c)| {
                !small_only
                    || crate::plan::ns_flops(r, c, job.optimizer.ns_steps)
                        <= crate::ledger::PAR_MATRIX_MAX_FLOPS
            })
            .fold((0, 0), |(ss, sl), (r, c)| {
                let (s, l) = (r.min(c), r.max(c));
                (ss.max(s * s), sl.max(s * l))
            });
        (2 * ss + sl) as f64
    };
    let small = scratch(true);
    let cuda = job.device.kind == ganymede_config::DeviceKind::Cuda;
    let batched = muon && job.optimizer.ns_batch.on(cuda);
    let ns_batch = if batched {
        let (_, ss, sl) = crate::ledger::ns_batch_elems(stacks);
        (2 * ss + sl) as f64
    } else {
        0.0
    };
    scratch(false)
        + ns_batch
        + if small > 0.0 {
            (threads.max(1) - 1) as f64 * small
        } else {
            0.0
        }
}

/// Expert parallelism's own row buffers (`ganymede_parallel::ep`), f32: per set of a layer's
/// kept rows, input and gate/up/SwiGLU (H + 3F; one set under full checkpointing, one per
/// MoE layer without) and the two u32 row orders, and the all-to-all and gradient scratch
/// (3H + 3F). Under bf16 compute the rows only GEMMs read are bf16: the kept input and
/// SwiGLU product, the gate and up gradients, and two more buffers of H for the bf16 rows
/// as they travel and the output gradients expert-major; and so are the GEMM outputs only
/// element-wise ops read: the kept gate and up, the SwiGLU product's gradient, and the
/// expert outputs, which then pass through those two bf16 buffers instead of two f32 ones
/// of H.
///
/// Returns the kept rows' bytes and the scratch bytes; zero without expert parallelism.
fn ep_buffers(job: &JobConfig, local: &JobConfig) -> (f64, f64) {
    let m = &job.model;
    let bf16_compute = job.training.compute_dtype == ganymede_config::ComputeDtype::Bf16;
    match ep_capacity_rows(local) {
        Some(cap) => {
            let (h, ff) = (m.hidden as f64, m.expert_hidden as f64);
            let f = 4.0;
            let sets = match job.activation_checkpoint.mode {
                AcMode::Full => 1,
                AcMode::None => (0..m.layers).filter(|&l| m.is_moe_layer(l)).count(),
            };
            let cap = cap as f64;
            let (kept, scratch) = match bf16_compute {
                true => (2.0 * h + 6.0 * ff, 12.0 * h + 6.0 * ff),
                false => (f * (h + 3.0 * ff), f * 3.0 * (h + ff)),
            };
            ((kept + 8.0) * cap * sets as f64, scratch * cap)
        }
        None => (0.0, 0.0),
    }
}

/// Expert parallelism (`parallelism.ep` > 1): the rows a rank's expert buffers are sized for,
/// `job`'s batch being one rank's (`ganymede_parallel::ep`): `ep_capacity_factor` times an
/// even routing's rows (the rank's tokens × top_k), at most the most it can receive (ep × tokens
/// × min(top_k, local experts)). `None` without expert parallelism or MoE layers.
pub fn ep_capacity_rows(job: &JobConfig) -> Option<usize> {
    let (m, p) = (&job.model, &job.parallelism);
    if p.ep <= 1 || !(0..m.layers).any(|l| m.is_moe_layer(l)) {
        return None;
    }
    let tokens = job.training.batch_size * m.seq_len;
    let sent = ganymede_config::moe_rows(tokens, job.training.moe_chunk_tokens) * m.top_k;
    let (cap, _) =
        ganymede_config::ep_capacity_rows(p.ep, m.experts, m.top_k, sent, p.ep_capacity_factor);
    Some(cap)
}

/// Elements of the whole matrices rank 0 (whose ledger `memory.json` holds) gathers as a
/// Newton–Schulz root, as `ganymede_parallel::flexshard::plan` assigns them under ep = 1:
/// round-robin over the Muon tensors (naive), or, under FlexShard, each rank's whole routed
/// experts first, then the other Muon tensors heaviest first, each to the least-loaded rank
/// (lowest on ties).
fn root_elems(ts: &[Rt], c: Cut, muon: bool) -> u64 {
    if !muon {
        return 0;
    }
    let ns = |a: u64, b: u64| {
        let (s, l) = (a.min(b), a.max(b));
        s * s * (2 * l + s)
    };
    let mut muon_ts = ts
        .iter()
        .enumerate()
        .filter(|(_, t)| t.muon(true).is_some());
    if !c.flex {
        // Round-robin within each tensor's group; rank 0 is group rank 0 of both.
        return muon_ts
            .enumerate()
            .filter(|(m, (_, t))| (*m as u64).is_multiple_of(t.group(c)))
            .map(|(_, (_, t))| t.padded(c))
            .sum();
    }
    // Newton–Schulz load per rank from the routed experts it owns whole: rank r holds slice
    // r mod ep and is number r / ep among the ranks sharing it.
    let mut load = vec![0u64; c.w as usize];
    for t in ts.iter().filter(|t| t.routed()) {
        let (el, g) = (t.shape[0] / c.ep, t.group(c));
        let per = el.div_ceil(g);
        for (r, l) in (0u64..).zip(load.iter_mut()) {
            let f = r / c.ep;
            *l += el.min((f + 1) * per).saturating_sub(f * per) * ns(t.shape[1], t.shape[2]);
        }
    }
    let mut items: Vec<(u64, usize)> = muon_ts
        .by_ref()
        .filter(|(_, t)| !t.routed())
        .map(|(i, t)| match t.kind {
            Kind::Experts { .. } => (t.shape[0] * ns(t.shape[1], t.shape[2]), i),
            _ => (ns(t.shape[0], t.shape[1]), i),
        })
        .collect();
    items.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut elems = 0;
    for (cost, i) in items {
        let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap();
        load[r] += cost;
        if r == 0 {
            elems += ts[i].padded(c);
        }
    }
    elems
}

/// Elements of optimizer state of the largest single shard a rank holds over `w` ranks (the
/// whole tensor at `w` = 1), what an offload staging slot holds: on several ranks AdamW's
/// master shard travels with its moments.
fn largest_shard_state(job: &JobConfig, w: usize) -> u64 {
    let adam = if w > 1 { 3 } else { 2 };
    let cut = Cut {
        w: w as u64,
        ep: job.parallelism.ep.min(w) as u64,
        flex: job.parallelism.muon_placement == ganymede_config::MuonPlacement::Flexshard,
    };
    let muon = job.optimizer.name == OptimizerName::Muon;
    runtime_tensors(&job.model)
        .iter()
        .map(|t| match (t.kind, t.muon(muon)) {
            (Kind::Frozen, _) => 0,
            (_, Some(_)) => t.shard(cut),
            _ => adam * t.shard(cut),
        })
        .max()
        .unwrap_or(0)
}

/// Bytes of `device.memory_gib` (GiB = 2³⁰ bytes, as the backend counts it).
pub fn capacity_bytes(job: &JobConfig) -> Option<f64> {
    let d = &job.device;
    (d.kind == DeviceKind::CpuTwoMemory && d.memory_gib > 0.0)
        .then(|| (d.memory_gib * (1u64 << 30) as f64).floor())
}

/// The verdict of [`fit_check`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FitCheck {
    /// Device capacity in bytes.
    pub capacity: f64,
    /// Where the capacity comes from, as the verdict names it (`device.memory_gib = …`).
    pub limit: String,
    pub prediction: MemoryPrediction,
    pub fits: bool,
    /// When it does not fit: the categories past the capacity when the device is filled in
    /// allocation order ([`Categories::entries`]), with their predicted bytes; the first is
    /// the one whose allocation would fail.
    pub overflow: Vec<(&'static str, f64)>,
    /// When it does not fit: the smallest change that does, if any.
    pub fix: Option<Fix>,
}

/// A change of the job configuration that makes it fit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fix {
    /// `section.key=value` overrides, as `--set` takes them.
    pub sets: Vec<String>,
    /// The predicted device peak with them.
    pub device_peak: f64,
}

impl Fix {
    /// The overrides as command-line flags to paste.
    pub fn flags(&self) -> String {
        self.sets
            .iter()
            .map(|s| format!("--set {s}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Hold `job`'s predicted device peak against its `device.memory_gib`; `None` when there is no
/// capacity (one memory, or `memory_gib = 0`).
pub fn fit_check(job: &JobConfig, threads: usize, ranks: usize) -> Option<FitCheck> {
    let capacity = capacity_bytes(job)?;
    let limit = format!("device.memory_gib = {}", gib(capacity));
    Some(fit_check_at(job, threads, ranks, capacity, limit))
}

/// [`fit_check`] against `capacity` bytes, which `limit` names (a GPU's usable memory for a
/// CUDA job, which has no `device.memory_gib`).
pub fn fit_check_at(
    job: &JobConfig,
    threads: usize,
    ranks: usize,
    capacity: f64,
    limit: String,
) -> FitCheck {
    let prediction = predict_memory(job, threads, ranks);
    let fits = prediction.device_peak <= capacity;
    let (overflow, fix) = if fits {
        (vec![], None)
    } else {
        let mut used = 0.0;
        let over = prediction
            .device
            .entries()
            .into_iter()
            .filter(|&(_, b)| {
                used += b;
                b > 0.0 && used > capacity
            })
            .collect();
        (over, smallest_fix(job, threads, ranks, capacity))
    };
    FitCheck {
        capacity,
        limit,
        prediction,
        fits,
        overflow,
        fix,
    }
}

/// Candidate changes, least intrusive first, as the GPU planner orders them: more activation
/// offload (whole layers, the fewest that fit); optimizer offload; both; then full
/// checkpointing (when off) with the same three. The first that fits wins. When none does, the
/// same again with the token chunks of [`chunk_variants`], which trade recompute or smaller
/// GEMMs for memory; then all of that in smaller microbatches (gradient accumulation, largest
/// first: the first change here that alters the numbers, through the auxiliary loss); and last,
/// on several ranks, all of that with one gradient set, which leaves each block's
/// reduce-scatter in the open (on the write-up's network the costliest).
fn smallest_fix(job: &JobConfig, threads: usize, ranks: usize, capacity: f64) -> Option<Fix> {
    let mut variants = chunk_variants(job, ranks);
    let t = &job.training;
    let share = t.batch_size / ranks.max(1);
    for m in (1..t.micro_batch(ranks))
        .rev()
        .filter(|&m| share.is_multiple_of(m))
    {
        let mut j = job.clone();
        j.training.micro_batch_size = m;
        let set = format!("training.micro_batch_size={m}");
        variants.extend(chunk_variants(&j, ranks).into_iter().map(|(mut sets, j)| {
            sets.insert(0, set.clone());
            (sets, j)
        }));
    }
    if ranks > 1 && job.parallelism.gradient_sets > 1 {
        let one: Vec<_> = variants
            .iter()
            .map(|(sets, j)| {
                let (mut sets, mut j) = (sets.clone(), j.clone());
                j.parallelism.gradient_sets = 1;
                sets.push("parallelism.gradient_sets=1".to_string());
                (sets, j)
            })
            .collect();
        variants.extend(one);
    }
    variants
        .into_iter()
        .find_map(|(sets, j)| offload_fix(&j, sets, threads, ranks, capacity))
}

/// Tokens a chunked head holds at a time when the fit check proposes one (the GPU planner's
/// `loss_chunk_tokens` default), the largest of the loss chunks it tries.
pub const FIT_LOSS_CHUNK: usize = 4096;
/// The fewest tokens a loss chunk the fit check proposes holds.
pub const FIT_LOSS_CHUNK_MIN: usize = 1024;
/// The fewest tokens a MoE chunk the fit check proposes holds.
pub const FIT_MOE_CHUNK_MIN: usize = 1024;

/// `job` as it is, then with the head's loss in chunks halving from [`FIT_LOSS_CHUNK`] to
/// [`FIT_LOSS_CHUNK_MIN`] tokens (smaller than the rank's tokens and any chunk set), then each
/// MoE layer's experts in chunks halving from half a rank's tokens down to
/// [`FIT_MOE_CHUNK_MIN`] (largest first; smaller than any chunk set), each with those loss
/// chunks: each with the `--set`s that make it. A smaller loss chunk costs next to nothing (the
/// LM head's GEMMs stay large; the recompute is one head forward either way), a smaller MoE
/// chunk makes the experts' GEMMs smaller, so the loss chunks come first.
fn chunk_variants(job: &JobConfig, ranks: usize) -> Vec<(Vec<String>, JobConfig)> {
    let t = &job.training;
    let n = t.micro_batch(ranks) * job.model.seq_len;
    let held = ganymede_config::head_rows(n, t.loss_chunk_tokens);
    let mut losses = vec![(vec![], job.clone())];
    let mut c = FIT_LOSS_CHUNK;
    while c >= FIT_LOSS_CHUNK_MIN {
        if c < held {
            let mut j = job.clone();
            j.training.loss_chunk_tokens = c;
            losses.push((vec![format!("training.loss_chunk_tokens={c}")], j));
        }
        c /= 2;
    }
    let mut out = losses.clone();
    if (0..job.model.layers).any(|l| job.model.is_moe_layer(l)) {
        let held = ganymede_config::moe_rows(n, t.moe_chunk_tokens);
        let mut c = n / 2;
        while c >= FIT_MOE_CHUNK_MIN {
            if c < held {
                for (sets, j) in &losses {
                    let mut k = j.clone();
                    k.training.moe_chunk_tokens = c;
                    let mut s = sets.clone();
                    s.push(format!("training.moe_chunk_tokens={c}"));
                    out.push((s, k));
                }
            }
            c /= 2;
        }
    }
    out
}

/// [`smallest_fix`]'s offload and checkpointing candidates for `job`, which `base` (`--set`s
/// already applied to it) made.
fn offload_fix(
    job: &JobConfig,
    base: Vec<String>,
    threads: usize,
    ranks: usize,
    capacity: f64,
) -> Option<Fix> {
    let layers = job.model.layers;
    let ac = &job.activation_checkpoint;
    let mut modes = vec![ac.mode];
    if ac.mode == AcMode::None {
        modes.push(AcMode::Full);
    }
    let peak = |j: &JobConfig| predict_memory(j, threads, ranks).device_peak;
    for mode in modes {
        for opt_offload in [job.optimizer.offload, true] {
            let mut j = job.clone();
            let mut sets = base.clone();
            if mode != ac.mode {
                j.activation_checkpoint.mode = mode;
                sets.push("activation_checkpoint.mode=full".to_string());
            }
            if opt_offload != job.optimizer.offload {
                j.optimizer.offload = true;
                sets.push("optimizer.offload=true".to_string());
            }
            let fits = |j: &JobConfig| peak(j) <= capacity;
            if !fits(&j) && mode == AcMode::Full {
                let current = offloaded_layers(ac.offload_fraction, layers);
                let Some(n) = (current + 1..=layers).find(|&n| {
                    let mut k = j.clone();
                    k.activation_checkpoint.offload_fraction = n as f64 / layers as f64;
                    fits(&k)
                }) else {
                    continue;
                };
                // Three decimals map back to the same whole layers (`offloaded_layers`).
                let printed = format!("{:.3}", n as f64 / layers as f64);
                j.activation_checkpoint.offload_fraction =
                    printed.parse().expect("a formatted float parses");
                debug_assert_eq!(
                    offloaded_layers(j.activation_checkpoint.offload_fraction, layers),
                    n
                );
                sets.push(format!("activation_checkpoint.offload_fraction={printed}"));
            }
            if !sets.is_empty() && fits(&j) {
                return Some(Fix {
                    sets,
                    device_peak: peak(&j),
                });
            }
        }
    }
    None
}

/// Bytes in GiB with four significant digits at least (tiny runs are a few MiB).
pub fn gib(bytes: f64) -> String {
    let x = bytes / (1u64 << 30) as f64;
    let decimals = if x >= 1.0 {
        3
    } else if x > 0.0 {
        (3 - x.log10().floor() as i32).clamp(3, 9) as usize
    } else {
        0
    };
    format!("{x:.decimals$} GiB")
}

impl FitCheck {
    /// One line: the verdict, and when it does not fit the overflowing categories and the
    /// smallest change that fits (or that nothing does).
    pub fn message(&self) -> String {
        let d = &self.prediction.device;
        let head = format!(
            "predicted device peak {} {} {}",
            gib(self.prediction.device_peak),
            if self.fits { "fits in" } else { "exceeds" },
            self.limit
        );
        if self.fits {
            return head;
        }
        let over = self
            .overflow
            .iter()
            .map(|(c, b)| format!("{c} {}", gib(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let on_device = d
            .entries()
            .iter()
            .filter(|(_, b)| *b > 0.0)
            .map(|(c, b)| format!("{c} {}", gib(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let fix = match &self.fix {
            Some(f) => format!(
                "smallest change that fits (predicted device peak {}): {}",
                gib(f.device_peak),
                f.flags()
            ),
            None => "nothing fits: no activation offload, optimizer offload, checkpointing, \
                     token chunk, smaller microbatch or single gradient set brings it under the \
                     capacity (raise device.memory_gib or shrink the model or the sequence)"
                .to_string(),
        };
        format!(
            "{head} by {}; overflowing categories (filling the device in allocation order): \
             {over}; on the device: {on_device}; {fix}",
            gib(self.prediction.device_peak - self.capacity)
        )
    }
}

/// Worker threads a run of `job` gets: `training.threads`, or every core (0), as rayon sizes
/// the trainer's pool.
pub fn run_threads(job: &JobConfig) -> usize {
    match job.training.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// `ganymede plan`'s section for a two-memory CPU job: the prediction per memory and
/// category, and the fit check against the job's own `device.memory_gib`.
pub fn render(job: &JobConfig, threads: usize, ranks: usize) -> String {
    let mut s = format!(
        "\nThis job on its own device (device.kind = cpu-two-memory, device.memory_gib = {}, \
         {threads} thread{}, {ranks} rank{})\n",
        job.device.memory_gib,
        if threads == 1 { "" } else { "s" },
        if ranks == 1 { "" } else { "s" }
    );
    s.push_str(&render_prediction(job, threads, ranks));
    match fit_check(job, threads, ranks) {
        Some(c) => s.push_str(&c.verdict_line()),
        None => s.push_str("  verdict: no capacity set (device.memory_gib = 0)\n"),
    }
    s
}

/// What this binary holds running `job` on the CUDA backend, one rank's (the plan's tables are
/// the write-up's system): [`predict_memory`] with GPU sizing, held against the usable memory
/// of the GPU `(name, bytes)`.
pub fn render_cuda(job: &JobConfig, threads: usize, ranks: usize, gpu: (&str, f64)) -> String {
    let mut s = format!(
        "\nThis job on ganymede's CUDA backend (device.kind = cuda, {ranks} rank{}), per GPU\n",
        if ranks == 1 { "" } else { "s" }
    );
    s.push_str(&render_prediction(job, threads, ranks));
    s.push_str(&cuda_fit(job, threads, ranks, gpu).verdict_line());
    s
}

/// [`fit_check_at`] for a CUDA job against the usable memory of the GPU `(name, bytes)`.
pub fn cuda_fit(job: &JobConfig, threads: usize, ranks: usize, gpu: (&str, f64)) -> FitCheck {
    let limit = format!("the {}'s usable {}", gpu.0, gib(gpu.1));
    fit_check_at(job, threads, ranks, gpu.1, limit)
}

/// The per-category table of [`predict_memory`].
fn render_prediction(job: &JobConfig, threads: usize, ranks: usize) -> String {
    let mut s = String::new();
    let p = predict_memory(job, threads, ranks);
    s.push_str(&format!("  {:<14}{:>18}{:>18}\n", "", "gpu0", "host"));
    let row = |name: &str, d: f64, h: f64| format!("  {name:<14}{:>18}{:>18}\n", gib(d), gib(h));
    for ((name, d), (_, h)) in p.device.entries().into_iter().zip(p.host.entries()) {
        s.push_str(&row(name, d, h));
    }
    s.push_str(&row("sum", p.device.total(), p.host.total()));
    s.push_str(&row("peak", p.device_peak, p.host_peak));
    s
}

impl FitCheck {
    fn verdict_line(&self) -> String {
        let v = if self.fits { "fits" } else { "does not fit" };
        format!("  verdict: {v}: {}\n", self.message())
    }
}

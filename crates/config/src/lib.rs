//! Job configuration for ganymede, shaped like TorchTitan's job config: one TOML document with
//! sections (`[model]`, `[training]`, `[optimizer]`, `[data]`, `[checkpoint]`, `[metrics]`,
//! `[activation_checkpoint]`, `[parallelism]`), named presets, and `section.key=value` overrides.
//!
//! Every consumer (trainer, planner, exporter) reads the same [`JobConfig`]; [`JobConfig::validate`]
//! is the one place that rejects impossible values, with the key and the reason.

// `!(x >= 0.0)` is deliberate below: NaN must fail every range check.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

use serde::{Deserialize, Serialize};
use std::path::Path;

mod presets;
pub mod sizing;
pub mod tensors;
pub use presets::{preset, PRESETS};
pub use sizing::{
    ep_capacity_rows, head_rows, moe_rows, ns_batch_elems, ns_stack_batch, offloaded_layers,
    NS_STACK_BYTES,
};
pub use tensors::{model_tensors, Role, TensorSpec};

/// A configuration problem, always naming where it came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("unknown preset '{0}' (known: {known})", known = PRESETS.join(", "))]
    UnknownPreset(String),
    #[error("bad override '{0}': expected section.key=value")]
    BadOverride(String),
    #[error("invalid value for {key} = {value}: {reason}")]
    Invalid {
        key: String,
        value: String,
        reason: String,
    },
}

fn invalid(key: &str, value: impl ToString, reason: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// Shape of the decoder-only MoE transformer (Qwen3-MoE semantics).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); must divide `heads`.
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    pub top_k: usize,
    /// Hidden size of each routed expert's SwiGLU.
    pub expert_hidden: usize,
    /// Shared experts every token uses, added to the routed output (0 = none).
    #[serde(default)]
    pub shared_experts: usize,
    /// Hidden size of each shared expert (0 = same as `expert_hidden`).
    #[serde(default)]
    pub shared_expert_hidden: usize,
    /// The first `dense_layers` layers use a dense SwiGLU instead of experts.
    #[serde(default)]
    pub dense_layers: usize,
    /// Hidden size of the dense SwiGLU in dense layers.
    #[serde(default)]
    pub dense_hidden: usize,
    /// Training sequence length (tokens per sequence).
    pub seq_len: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Renormalise the top-k routing weights to sum to one (Qwen3's `norm_topk_prob`).
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    /// Switch-style load-balancing auxiliary loss coefficient (0 = off).
    #[serde(default = "default_aux")]
    pub aux_loss_coef: f64,
    /// DeepSeek-V3 auxiliary-loss-free balancing: per-expert selection bias updated by
    /// `coeff * sign(mean_load - load)` after each step (0 = off).
    #[serde(default)]
    pub router_bias_update: f64,
    /// Standard deviation of the normal initialisation of weight matrices.
    #[serde(default = "default_init_std")]
    pub init_std: f64,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}
fn default_norm_eps() -> f64 {
    1e-6
}
fn default_true() -> bool {
    true
}
fn default_aux() -> f64 {
    0.001
}
fn default_init_std() -> f64 {
    0.02
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    pub fn shared_hidden(&self) -> usize {
        if self.shared_expert_hidden == 0 {
            self.expert_hidden
        } else {
            self.shared_expert_hidden
        }
    }
    /// Whether layer `l` is an MoE layer (the first `dense_layers` are dense).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        l >= self.dense_layers
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("model.vocab_size", self.vocab_size),
            ("model.hidden", self.hidden),
            ("model.layers", self.layers),
            ("model.heads", self.heads),
            ("model.kv_heads", self.kv_heads),
            ("model.head_dim", self.head_dim),
            ("model.experts", self.experts),
            ("model.top_k", self.top_k),
            ("model.expert_hidden", self.expert_hidden),
            ("model.seq_len", self.seq_len),
        ];
        for (k, v) in positive {
            if v == 0 {
                return Err(invalid(k, v, "must be at least 1"));
            }
        }
        if self.top_k > self.experts {
            return Err(invalid(
                "model.top_k",
                self.top_k,
                format!("larger than model.experts = {}", self.experts),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(
                "model.kv_heads",
                self.kv_heads,
                format!("must divide model.heads = {}", self.heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "model.head_dim",
                self.head_dim,
                "RoPE needs an even head dimension",
            ));
        }
        if self.dense_layers > self.layers {
            return Err(invalid(
                "model.dense_layers",
                self.dense_layers,
                format!("more than model.layers = {}", self.layers),
            ));
        }
        if self.dense_layers > 0 && self.dense_hidden == 0 {
            return Err(invalid(
                "model.dense_hidden",
                0,
                "dense layers need a hidden size",
            ));
        }
        if self.rope_theta.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(invalid(
                "model.rope_theta",
                self.rope_theta,
                "must be positive",
            ));
        }
        if self.norm_eps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(invalid("model.norm_eps", self.norm_eps, "must be positive"));
        }
        // A negative or zero spread gives a model with no signal to learn from (or NaNs).
        if !(self.init_std > 0.0 && self.init_std.is_finite()) {
            return Err(invalid(
                "model.init_std",
                self.init_std,
                "must be a positive number",
            ));
        }
        if !(self.aux_loss_coef >= 0.0) {
            return Err(invalid(
                "model.aux_loss_coef",
                self.aux_loss_coef,
                "must be >= 0",
            ));
        }
        if !(self.router_bias_update >= 0.0) {
            return Err(invalid(
                "model.router_bias_update",
                self.router_bias_update,
                "must be >= 0",
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    pub steps: usize,
    /// Sequences per optimizer step (the global batch).
    pub batch_size: usize,
    pub seed: u64,
    /// Global gradient-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// Worker threads for the CPU backend (0 = all cores).
    pub threads: usize,
    /// Operand precision of the model's GEMMs (TorchTitan's `mixed_precision_param`): `f32`,
    /// or `bf16` (inputs rounded to bf16, f32 accumulation and output; the weights only GEMMs
    /// read reach the model in bf16, cast once per step or gather; attention runs on bf16 q, k,
    /// v, as autocast's SDPA). Master weights, gradient reduction and optimizer state stay f32
    /// either way.
    pub compute_dtype: ComputeDtype,
    /// Operand precision of the router's GEMMs under bf16 compute: `auto` (bf16 where the
    /// backend multiplies bf16 natively, a GPU; f32 on the CPU, which only emulates it), `f32`
    /// (as Megatron's `--moe-router-dtype fp32`), or `bf16` (inputs rounded, f32 accumulation
    /// and logits, as TorchTitan's router under FSDP's mixed precision). Under f32 compute the
    /// router is f32 whatever this says.
    pub router_dtype: RouterDtype,
    /// Tokens whose logits the head holds at once (0 = every token of the rank's batch): the
    /// loss and its gradients go a chunk at a time, so the head keeps `chunk × vocab` logits
    /// instead of `tokens × vocab` (64 GiB at 65,536 tokens and a 256k vocabulary), at the
    /// price of recomputing every chunk's logits but the last in backward.
    pub loss_chunk_tokens: usize,
    /// Tokens a MoE layer's routed experts take at once (0 = every token of the rank's batch):
    /// each chunk is dispatched, run and combined in turn, so the expert rows, their f32
    /// internals and gradient scratch, and the expert-parallel buffers hold `chunk × top_k`
    /// rows instead of `tokens × top_k` (524,288 at 65,536 tokens and top-8), at the price of
    /// recomputing every chunk's experts but the last in backward (no extra compute under full
    /// checkpointing, which recomputes them anyway).
    pub moe_chunk_tokens: usize,
    /// Sequences each rank runs through one forward and backward (0 = its whole share of the
    /// batch, `batch_size / ranks`): a smaller value divides the share into that many-sequence
    /// microbatches whose gradients are accumulated before the one optimizer step (gradient
    /// accumulation, as TorchTitan's local batch under a global one), so activations are a
    /// microbatch's. Each microbatch's loss, auxiliary loss included, is its own global batch's
    /// mean (as Megatron's), and the step's is their mean.
    pub micro_batch_size: usize,
    /// Replay each step's work as CUDA graphs (one GPU only): after a first eager step, the
    /// gradients' zeroing, a microbatch's forward and backward, and the update are each
    /// captured once and replayed, the batch's tokens and the learning rate written to the
    /// device before them. Off: every kernel is launched from the host each step. No effect on
    /// a backend without graphs (the CPU).
    pub cuda_graphs: bool,
}

impl TrainingConfig {
    /// Whether the router's GEMMs take bf16 operands on a backend that does (`native_bf16`)
    /// or does not multiply bf16 natively (`training.router_dtype`; only under bf16 compute).
    pub fn router_bf16(&self, native_bf16: bool) -> bool {
        self.compute_dtype == ComputeDtype::Bf16 && self.router_dtype.bf16_on(native_bf16)
    }

    /// Sequences per forward and backward on each of `ranks` ranks.
    pub fn micro_batch(&self, ranks: usize) -> usize {
        match self.micro_batch_size {
            0 => self.batch_size / ranks.max(1),
            m => m,
        }
    }

    /// Forward and backward passes per optimizer step on each of `ranks` ranks (at least one).
    pub fn microbatches(&self, ranks: usize) -> usize {
        (self.batch_size / ranks.max(1) / self.micro_batch(ranks).max(1)).max(1)
    }
}

/// Operand precision of the model's GEMMs (`training.compute_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    /// Exact f32 GEMMs (the default: every exactness test compares against these).
    #[default]
    F32,
    /// bf16 × bf16 → f32 GEMMs and bf16 attention (tensor cores on a GPU).
    Bf16,
}

// By hand so that a bad value names its key (serde's "unknown variant" does not).
impl<'de> Deserialize<'de> for ComputeDtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let choices = [("f32", Self::F32), ("bf16", Self::Bf16)];
        one_of(d, "training.compute_dtype", &choices)
    }
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            steps: 300,
            batch_size: 8,
            seed: 42,
            grad_clip: 1.0,
            threads: 0,
            compute_dtype: ComputeDtype::F32,
            router_dtype: RouterDtype::Auto,
            loss_chunk_tokens: 0,
            moe_chunk_tokens: 0,
            micro_batch_size: 0,
            cuda_graphs: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    /// Muon for hidden weight matrices, AdamW for the rest.
    Muon,
    /// AdamW everywhere (baseline).
    Adamw,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MuonScale {
    /// Moonlight: 0.2 * sqrt(max(rows, cols)), matching AdamW's update RMS.
    MatchRmsAdamw,
    /// Keller Jordan's original: max(1, rows/cols)^0.5.
    Original,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    Cosine,
    /// Warmup-stable-decay: flat after warmup, linear decay over the last `decay_fraction`.
    Wsd,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub name: OptimizerName,
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Muon's Nesterov momentum.
    pub momentum: f64,
    pub ns_steps: usize,
    pub muon_scale: MuonScale,
    pub schedule: Schedule,
    pub warmup_steps: usize,
    /// Final learning rate as a fraction of `lr` (cosine and wsd).
    pub min_lr_ratio: f64,
    /// Share of steps spent decaying under `wsd`.
    pub decay_fraction: f64,
    /// Keep the optimizer's state (momentum, AdamW moments; under FSDP also the fp32 master
    /// shards) in host memory and stream it through the device for each update (the write-up's
    /// "optimizer state in Grace memory, Newton–Schulz on the GPU").
    pub offload: bool,
    /// Operand precision of Newton–Schulz's products (see [`NsDtype`]).
    pub ns_dtype: NsDtype,
    /// Whether expert stacks' Newton–Schulz runs as strided batches (see [`NsBatch`]).
    pub ns_batch: NsBatch,
    /// Newton–Schulz's polynomial at each iteration (see [`NsCoefficients`]).
    pub ns_coefficients: NsCoefficients,
}

/// The odd quintic each Newton–Schulz iteration applies to the singular values
/// (`optimizer.ns_coefficients`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NsCoefficients {
    /// One quintic every iteration, Keller Jordan's (3.4445, −4.7750, 2.0315): fast growth of
    /// small singular values, which end in roughly [0.7, 1.2].
    #[default]
    Muon,
    /// Polar Express (Amsel et al., arXiv 2505.16932): each iteration's quintic the best one
    /// for the interval the singular values are in by then, from [0.001, 1], so they converge
    /// to 1 (within 0.12 after five iterations, 0.001 after six).
    PolarExpress,
}

impl<'de> Deserialize<'de> for NsCoefficients {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let choices = [("muon", Self::Muon), ("polar_express", Self::PolarExpress)];
        one_of(d, "optimizer.ns_coefficients", &choices)
    }
}

/// Whether Muon orthogonalises an expert stack (on several ranks, the experts a rank owns of
/// one) in strided batches of [`ns_stack_batch`] matrices, each product one call for the batch,
/// or matrix by matrix (`optimizer.ns_batch`). The same arithmetic per matrix; a GPU saves a
/// few dozen launches a matrix, at up to [`NS_STACK_BYTES`] of working memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NsBatch {
    /// Batched where the backend prefers it (a GPU), matrix by matrix elsewhere (the CPU
    /// spreads whole matrices over its threads instead).
    #[default]
    Auto,
    On,
    Off,
}

impl NsBatch {
    /// Whether stacks are batched on a backend that does (`prefers`) or does not prefer it.
    pub fn on(self, prefers: bool) -> bool {
        match self {
            NsBatch::Auto => prefers,
            NsBatch::On => true,
            NsBatch::Off => false,
        }
    }
}

// By hand so that a bad value names its key, as `ComputeDtype`.
impl<'de> Deserialize<'de> for NsBatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let choices = [("auto", Self::Auto), ("on", Self::On), ("off", Self::Off)];
        one_of(d, "optimizer.ns_batch", &choices)
    }
}

/// A key whose value is one of `choices`' names, read into its value; any other value is an
/// error naming `key` and the choices (serde's "unknown variant" names neither).
fn one_of<'de, D: serde::Deserializer<'de>, T: Copy>(
    d: D,
    key: &str,
    choices: &[(&str, T)],
) -> Result<T, D::Error> {
    let s = String::deserialize(d)?;
    if let Some(&(_, v)) = choices.iter().find(|(name, _)| *name == s) {
        return Ok(v);
    }
    let names: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
    let expected = match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(serde::de::Error::custom(format!(
        "invalid value for {key} = '{s}': expected {expected}"
    )))
}

/// `auto`, `f32` or `bf16` ([`one_of`]).
fn auto_f32_bf16<'de, D: serde::Deserializer<'de>, T: Copy>(
    d: D,
    key: &str,
    [auto, f32, bf16]: [T; 3],
) -> Result<T, D::Error> {
    one_of(d, key, &[("auto", auto), ("f32", f32), ("bf16", bf16)])
}

/// Operand precision of Newton–Schulz's matrix products (`optimizer.ns_dtype`). Accumulation
/// and the iterate stay f32 either way; bf16 rounds each product's inputs, as PyTorch's and
/// Keller Jordan's Muon run the iteration in bf16 on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NsDtype {
    /// bf16 where the backend multiplies bf16 natively (a CUDA device's tensor cores), f32
    /// elsewhere (the CPU backend only emulates bf16, more slowly than f32).
    #[default]
    Auto,
    F32,
    Bf16,
}

impl NsDtype {
    /// Whether the products take bf16 operands on a backend that does (`native_bf16`) or does
    /// not multiply bf16 natively.
    pub fn bf16_on(self, native_bf16: bool) -> bool {
        match self {
            NsDtype::Auto => native_bf16,
            NsDtype::F32 => false,
            NsDtype::Bf16 => true,
        }
    }
}

// By hand so that a bad value names its key, as `ComputeDtype`.
impl<'de> Deserialize<'de> for NsDtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        auto_f32_bf16(d, "optimizer.ns_dtype", [Self::Auto, Self::F32, Self::Bf16])
    }
}

/// Operand precision of the router's GEMMs under bf16 compute (`training.router_dtype`): the
/// choices of [`NsDtype`], `auto` being bf16 on a backend that multiplies bf16 natively.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterDtype {
    #[default]
    Auto,
    F32,
    Bf16,
}

impl RouterDtype {
    /// As [`NsDtype::bf16_on`].
    pub fn bf16_on(self, native_bf16: bool) -> bool {
        let ns = match self {
            RouterDtype::Auto => NsDtype::Auto,
            RouterDtype::F32 => NsDtype::F32,
            RouterDtype::Bf16 => NsDtype::Bf16,
        };
        ns.bf16_on(native_bf16)
    }
}

impl<'de> Deserialize<'de> for RouterDtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        auto_f32_bf16(
            d,
            "training.router_dtype",
            [Self::Auto, Self::F32, Self::Bf16],
        )
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            name: OptimizerName::Muon,
            lr: 0.01,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            momentum: 0.95,
            ns_steps: 5,
            muon_scale: MuonScale::MatchRmsAdamw,
            schedule: Schedule::Cosine,
            warmup_steps: 20,
            min_lr_ratio: 0.1,
            decay_fraction: 0.2,
            offload: false,
            ns_dtype: NsDtype::Auto,
            ns_batch: NsBatch::Auto,
            ns_coefficients: NsCoefficients::Muon,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Training text: a file or folder of `.txt`/`.jsonl` files, or a `.bin` file of
    /// little-endian u32 tokens. Empty: the built-in generated corpus.
    pub path: String,
    /// `byte` (built in), `bpe` (train a BPE tokenizer of `model.vocab_size` on the corpus), or a
    /// path to a Hugging Face `tokenizer.json`.
    pub tokenizer: String,
    /// Share of the corpus held out for validation (taken from its end).
    pub val_fraction: f64,
    /// Size in bytes of the built-in generated corpus.
    pub builtin_bytes: usize,
    /// Weighted sources (`[[data.sources]]`), each a prepared folder (`ganymede data prepare`),
    /// one source of it (`DIR/NAME`), a Megatron `.bin`/`.idx` pair or an llm.c shard. Empty:
    /// `data.path` alone. On the command line: `--set data.sources=PATH:WEIGHT,PATH:WEIGHT`
    /// (`:WEIGHT` optional).
    #[serde(deserialize_with = "sources_from_table_or_string")]
    pub sources: Vec<SourceConfig>,
    /// Sampling temperature T over sources without a weight: source i is drawn with probability
    /// proportional to its tokens^(1/T) (1: by size; larger flattens toward uniform).
    pub temperature: f64,
    /// Refuse text that is not valid UTF-8 instead of reading its bad bytes as U+FFFD (text
    /// tokenizers; bytes tokenise anything).
    pub refuse_invalid_utf8: bool,
    /// Block-causal attention: a token attends only to earlier tokens of its own document, and
    /// RoPE positions restart at each document (Megatron's `reset_attention_mask` and
    /// `reset_position_ids`, TorchTitan's `block_causal`). Needs data with document boundaries:
    /// prepared folders, Megatron or llm.c files.
    pub document_mask: bool,
    /// Mean tokens per document, for the planner's attention FLOPs under `document_mask`
    /// (training reads the real boundaries).
    pub mean_document_tokens: usize,
}

/// One entry of `[[data.sources]]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// A prepared folder, one source of it (`DIR/NAME`), a Megatron `.bin` (with its `.idx`) or
    /// an llm.c `.bin` shard (or a folder of them).
    pub path: String,
    /// Share of the sequences drawn from it (normalised over all sources); none: by
    /// `data.temperature`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// `[[data.sources]]` as tables, or as one string `PATH[:WEIGHT],...` (what `--set` can give).
fn sources_from_table_or_string<'de, D>(d: D) -> Result<Vec<SourceConfig>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Tables(Vec<SourceConfig>),
        Text(String),
    }
    match Form::deserialize(d)? {
        Form::Tables(v) => Ok(v),
        Form::Text(t) => t
            .split(',')
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let e = e.trim();
                match e.rsplit_once(':') {
                    Some((p, w)) => match w.parse::<f64>() {
                        Ok(w) => Ok(SourceConfig {
                            path: p.to_string(),
                            weight: Some(w),
                        }),
                        Err(_) => Err(serde::de::Error::custom(format!(
                            "data.sources: {e:?}: the weight after ':' is not a number"
                        ))),
                    },
                    None => Ok(SourceConfig {
                        path: e.to_string(),
                        weight: None,
                    }),
                }
            })
            .collect(),
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            tokenizer: "byte".into(),
            val_fraction: 0.05,
            builtin_bytes: 4 << 20,
            sources: Vec::new(),
            temperature: 1.0,
            refuse_invalid_utf8: false,
            document_mask: false,
            mean_document_tokens: 1024,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every `interval` steps (0 = only at the end).
    pub interval: usize,
    /// Whether to save at all.
    pub enable: bool,
    /// Newest checkpoints kept (the one just saved among them); older ones are deleted.
    pub keep_last: usize,
    /// Also keep every checkpoint whose step is a multiple of this, whatever its age (0: none),
    /// so that rotation never takes every good checkpoint.
    pub keep_every: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            interval: 0,
            enable: true,
            keep_last: 3,
            keep_every: 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Print a log line every `log_every` steps (without a terminal).
    pub log_every: usize,
    /// Validation loss every `val_every` steps (0 = only at the end).
    pub val_every: usize,
    /// Batches of `training.batch_size` sequences per validation.
    pub val_batches: usize,
    /// Also write the scalars of every metrics line as TensorBoard event files under `RUN/tb/`.
    pub tensorboard: bool,
    /// What to do about a dead run (loss pinned at ln(vocab_size) with a vanishing gradient
    /// norm): stop it before it writes another checkpoint, warn, or nothing.
    pub dead_check: DeadCheck,
    /// Warn when a step's loss exceeds this many times the median of the previous steps' (up
    /// to 50, from the 11th step on); 0 = never.
    pub spike_factor: f64,
    /// Time each step by phase (attention, dense GEMMs, router, experts, element-wise, head,
    /// optimizer, communication) and write it as `phase_ms` (wall clock on the CPU, events on
    /// the compute stream on a GPU).
    pub phase_times: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            log_every: 10,
            val_every: 50,
            val_batches: 4,
            tensorboard: false,
            dead_check: DeadCheck::Stop,
            spike_factor: 3.0,
            phase_times: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadCheck {
    Stop,
    Warn,
    Off,
}

impl<'de> Deserialize<'de> for DeadCheck {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let choices = [
            ("stop", Self::Stop),
            ("warn", Self::Warn),
            ("off", Self::Off),
        ];
        one_of(d, "metrics.dead_check", &choices)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AcMode {
    /// Keep each block's input only; recompute its internals in backward.
    Full,
    /// Keep every activation.
    None,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointConfig {
    pub mode: AcMode,
    /// Share of layers whose boundary activation (block input) lives in host memory between
    /// forward and backward (`mode = "full"` only; see `ganymede_model::offload`). Useful where
    /// device memory is separate (`device.kind = "cpu-two-memory"`, GPUs); on the plain CPU it
    /// only adds copies.
    pub offload_fraction: f64,
    /// Storage precision of the residual stream at block boundaries, what a step keeps of its
    /// forward under `mode = "full"` and what activation offload moves (see [`BoundaryDtype`]).
    pub boundary_dtype: BoundaryDtype,
}

/// Storage precision of the block boundaries (`activation_checkpoint.boundary_dtype`). Inside a
/// block the residual stream is summed in f32 either way; with bf16 boundaries each block's
/// output is rounded to bf16 when stored and widened again by its readers (the next block, the
/// recompute, the final norm), as a PyTorch model trained in bf16 passes bf16 hidden states
/// between its layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BoundaryDtype {
    /// The compute dtype (`training.compute_dtype`): f32 boundaries at f32 compute, bf16 at
    /// bf16.
    #[default]
    Auto,
    F32,
    Bf16,
}

impl BoundaryDtype {
    /// Whether the boundaries are stored in bf16 under `compute`.
    pub fn bf16_under(self, compute: ComputeDtype) -> bool {
        match self {
            BoundaryDtype::Auto => compute == ComputeDtype::Bf16,
            BoundaryDtype::F32 => false,
            BoundaryDtype::Bf16 => true,
        }
    }
}

// By hand so that a bad value names its key, as `ComputeDtype`.
impl<'de> Deserialize<'de> for BoundaryDtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        auto_f32_bf16(
            d,
            "activation_checkpoint.boundary_dtype",
            [Self::Auto, Self::F32, Self::Bf16],
        )
    }
}

impl Default for ActivationCheckpointConfig {
    fn default() -> Self {
        Self {
            mode: AcMode::Full,
            offload_fraction: 0.0,
            boundary_dtype: BoundaryDtype::Auto,
        }
    }
}

/// Which backend memory a rank computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceKind {
    /// The CPU: one memory.
    Cpu,
    /// The CPU with an emulated device memory beside host memory: tensors live in "device"
    /// memory (capped at `device.memory_gib`), host and pinned memory are separate, copies
    /// between them run on copy threads ordered by events. How GPU memory behaviour (offload,
    /// capacity, stream ordering) is tested without a GPU.
    CpuTwoMemory,
    /// An NVIDIA GPU through the CUDA backend (a binary built with `--features cuda`, and a
    /// driver). Until that backend implements every op, `train` refuses it and
    /// `ganymede device-check` exercises what exists.
    Cuda,
}

impl DeviceKind {
    /// The name as written in a config (`device.kind = "…"`).
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::CpuTwoMemory => "cpu-two-memory",
            DeviceKind::Cuda => "cuda",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceConfig {
    pub kind: DeviceKind,
    /// Capacity of device memory in GiB (0 = no limit). An allocation past it ends the run with
    /// an out-of-memory error naming the category and the bytes asked for.
    pub memory_gib: f64,
    /// `cpu-two-memory`: panic at any access not ordered after the copies it depends on (a
    /// missing event wait), instead of waiting for them.
    pub check_streams: bool,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            kind: DeviceKind::Cpu,
            memory_gib: 0.0,
            check_streams: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelismConfig {
    /// HSDP: replicas of the FSDP group. The world is `dp_replicate × dp_shard` ranks, rank
    /// `replica·dp_shard + shard rank`; gradients are all-reduced across replicas.
    pub dp_replicate: usize,
    /// FSDP degree (data-parallel shards within one replica).
    pub dp_shard: usize,
    /// Expert-parallel degree; divides `dp_shard` and `model.experts`.
    pub ep: usize,
    /// Expert parallelism: the rows a rank's experts are sized for, in units of an even
    /// routing's (a rank receives as many rows as it sends when every expert is equally
    /// loaded), capped at the most it can receive. The buffers are made in the first step; a
    /// step that routes a rank more rows grows them (counted and reported), so a factor that
    /// covers the routing keeps later steps from allocating.
    pub ep_capacity_factor: f64,
    /// Element type of FSDP's parameter all-gathers (`f32` for exactness tests).
    pub gather_dtype: GatherDtype,
    /// Blocks whose gathers are in flight ahead of the one computing (0 = no prefetch).
    pub prefetch: usize,
    /// Sets of one block's full gradients FSDP holds: 2 lets a block's reduce-scatter travel
    /// while the next block's backward writes the other set; 1 saves a set's memory and waits
    /// for each reduce-scatter before the next block's backward.
    pub gradient_sets: usize,
    /// How distributed Muon places its Newton–Schulz work: `flexshard` (experts whole per rank,
    /// dense matrices on LPT owners) or `naive` (every matrix gathered on a round-robin root).
    pub muon_placement: MuonPlacement,
    /// Seconds a collective may wait for its peers before the job ends with an error.
    pub timeout_s: f64,
    /// Sharded runs: each rank writes its own shards plus a layout manifest, instead of
    /// gathering every tensor into the single-process checkpoint files.
    pub sharded_checkpoints: bool,
}

impl ParallelismConfig {
    /// Ranks in the job: `dp_replicate × dp_shard`.
    pub fn world(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }
}

/// Element type of FSDP's parameter gathers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GatherDtype {
    Bf16,
    F32,
}

/// Distributed Muon's placement policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MuonPlacement {
    Flexshard,
    Naive,
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        Self {
            dp_replicate: 1,
            dp_shard: 1,
            ep: 1,
            ep_capacity_factor: 2.0,
            gather_dtype: GatherDtype::Bf16,
            prefetch: 1,
            gradient_sets: 2,
            muon_placement: MuonPlacement::Flexshard,
            timeout_s: 120.0,
            sharded_checkpoints: false,
        }
    }
}

/// The whole job: what `ganymede train` runs and the planner reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    pub model: ModelConfig,
    #[serde(default)]
    pub training: TrainingConfig,
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub activation_checkpoint: ActivationCheckpointConfig,
    #[serde(default)]
    pub parallelism: ParallelismConfig,
    #[serde(default)]
    pub device: DeviceConfig,
}

impl JobConfig {
    /// Parse a TOML document; `origin` names it in errors (a file path, "preset tiny", ...).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let value: toml::Value = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.into(),
            message: e.to_string(),
        })?;
        // A value of the wrong type: parsed from the text again, whose error knows where it is,
        // so the message names the line and the key (the Value's error knows neither).
        Self::from_value(value, origin).map_err(|err| {
            match toml::from_str::<JobConfig>(text)
                .err()
                .and_then(|e| e.span())
            {
                Some(span) => {
                    let line_no = text[..span.start.min(text.len())].matches('\n').count() + 1;
                    let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
                    match err {
                        ConfigError::Parse { message, .. } => ConfigError::Parse {
                            origin: format!("{origin}, line {line_no} ({line})"),
                            message,
                        },
                        other => other,
                    }
                }
                None => err,
            }
        })
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    fn from_value(value: toml::Value, origin: &str) -> Result<Self, ConfigError> {
        value
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin: origin.into(),
                message: e.message().to_string(),
            })
    }

    /// Build a config from an optional preset or file, then apply `section.key=value` overrides.
    /// With neither preset nor file, the `tiny` preset is used.
    pub fn load(
        preset_name: Option<&str>,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let base = match (preset_name, file) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Parse {
                    origin: "command line".into(),
                    message: "give either --preset or --config, not both".into(),
                })
            }
            (_, Some(f)) => Self::from_file(f)?,
            (p, None) => preset(p.unwrap_or("tiny"))?,
        };
        base.with_overrides(overrides)
    }

    /// Apply `section.key=value` overrides. Values are parsed as TOML (numbers, booleans);
    /// anything that does not parse is taken as a string.
    pub fn with_overrides(&self, overrides: &[String]) -> Result<Self, ConfigError> {
        if overrides.is_empty() {
            return Ok(self.clone());
        }
        let mut root = toml::Value::try_from(self).expect("config serialises");
        for o in overrides {
            let (path, raw) = o
                .split_once('=')
                .ok_or_else(|| ConfigError::BadOverride(o.clone()))?;
            let path = path.trim();
            let parts: Vec<&str> = path.split('.').collect();
            if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
                return Err(ConfigError::BadOverride(o.clone()));
            }
            let value = parse_scalar(raw.trim());
            let table = root.as_table_mut().expect("root is a table");
            let section = table
                .entry(parts[0].to_string())
                .or_insert_with(|| toml::Value::Table(Default::default()));
            let Some(section) = section.as_table_mut() else {
                return Err(ConfigError::BadOverride(o.clone()));
            };
            section.insert(parts[1].to_string(), value);
            // Checked one override at a time, so a value of the wrong type names its key.
            if let Err(ConfigError::Parse { message, .. }) = Self::from_value(root.clone(), "") {
                return Err(ConfigError::Parse {
                    origin: format!("--set {}", o.trim()),
                    message,
                });
            }
        }
        Self::from_value(root, "--set overrides")
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }

    /// Check every cross-field constraint; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        let t = &self.training;
        if t.steps == 0 {
            return Err(invalid("training.steps", 0, "must be at least 1"));
        }
        if t.batch_size == 0 {
            return Err(invalid("training.batch_size", 0, "must be at least 1"));
        }
        if !(t.grad_clip >= 0.0) {
            return Err(invalid("training.grad_clip", t.grad_clip, "must be >= 0"));
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return Err(invalid("optimizer.lr", o.lr, "must be a positive number"));
        }
        // AdamW divides by sqrt(v) + eps: zero lets an untouched parameter's update be 0/0.
        if !(o.eps > 0.0 && o.eps.is_finite()) {
            return Err(invalid("optimizer.eps", o.eps, "must be a positive number"));
        }
        let f = self.metrics.spike_factor;
        if !(f == 0.0 || (f > 1.0 && f.is_finite())) {
            return Err(invalid(
                "metrics.spike_factor",
                f,
                "must be 0 (off) or a number above 1",
            ));
        }
        if self.checkpoint.keep_last == 0 {
            return Err(invalid(
                "checkpoint.keep_last",
                0,
                "must be at least 1 (the checkpoint just saved)",
            ));
        }
        if !(o.weight_decay >= 0.0) {
            return Err(invalid(
                "optimizer.weight_decay",
                o.weight_decay,
                "must be >= 0",
            ));
        }
        for (k, v) in [
            ("optimizer.beta1", o.beta1),
            ("optimizer.beta2", o.beta2),
            ("optimizer.momentum", o.momentum),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid(k, v, "must be in [0, 1)"));
            }
        }
        if o.ns_steps == 0 {
            return Err(invalid("optimizer.ns_steps", 0, "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&o.min_lr_ratio) {
            return Err(invalid(
                "optimizer.min_lr_ratio",
                o.min_lr_ratio,
                "must be in [0, 1]",
            ));
        }
        if !(0.0..=1.0).contains(&o.decay_fraction) {
            return Err(invalid(
                "optimizer.decay_fraction",
                o.decay_fraction,
                "must be in [0, 1]",
            ));
        }
        let d = &self.data;
        if !(d.val_fraction > 0.0 && d.val_fraction < 0.5) {
            return Err(invalid(
                "data.val_fraction",
                d.val_fraction,
                "must be in (0, 0.5)",
            ));
        }
        if d.tokenizer.is_empty() {
            return Err(invalid(
                "data.tokenizer",
                "\"\"",
                "use byte, bpe, or a tokenizer.json path",
            ));
        }
        if d.tokenizer == "byte" && self.model.vocab_size < 256 {
            return Err(invalid(
                "model.vocab_size",
                self.model.vocab_size,
                "the byte tokenizer needs at least 256",
            ));
        }
        if !d.path.is_empty() && !Path::new(&d.path).exists() {
            return Err(invalid("data.path", &d.path, "no such file or directory"));
        }
        if !(d.temperature > 0.0 && d.temperature.is_finite()) {
            return Err(invalid(
                "data.temperature",
                d.temperature,
                "must be a positive number",
            ));
        }
        if !d.sources.is_empty() && !d.path.is_empty() {
            return Err(invalid(
                "data.path",
                &d.path,
                "give data.path or [[data.sources]], not both",
            ));
        }
        if d.document_mask && d.path.is_empty() && d.sources.is_empty() {
            return Err(invalid(
                "data.document_mask",
                true,
                "the built-in corpus has no document boundaries; train on prepared data \
                 (`ganymede data prepare`), Megatron or llm.c files",
            ));
        }
        if d.mean_document_tokens == 0 {
            return Err(invalid(
                "data.mean_document_tokens",
                0,
                "must be at least 1",
            ));
        }
        let weighted = d.sources.iter().filter(|s| s.weight.is_some()).count();
        if weighted != 0 && weighted != d.sources.len() {
            return Err(invalid(
                "data.sources",
                format!("{weighted} of {} with a weight", d.sources.len()),
                "give every source a weight, or none (then data.temperature decides)",
            ));
        }
        for (i, s) in d.sources.iter().enumerate() {
            if !Path::new(&s.path).exists() {
                return Err(invalid(
                    &format!("data.sources[{i}].path"),
                    &s.path,
                    "no such file or directory",
                ));
            }
            if let Some(w) = s.weight {
                if !(w > 0.0 && w.is_finite()) {
                    return Err(invalid(
                        &format!("data.sources[{i}].weight"),
                        w,
                        "must be a positive number",
                    ));
                }
            }
        }
        let a = &self.activation_checkpoint;
        if !(0.0..=1.0).contains(&a.offload_fraction) {
            return Err(invalid(
                "activation_checkpoint.offload_fraction",
                a.offload_fraction,
                "must be in [0, 1]",
            ));
        }
        if a.offload_fraction > 0.0 && a.mode != AcMode::Full {
            return Err(invalid(
                "activation_checkpoint.offload_fraction",
                a.offload_fraction,
                "needs activation_checkpoint.mode = \"full\" (only block boundaries are offloaded)",
            ));
        }
        let dv = &self.device;
        if !(dv.memory_gib >= 0.0 && dv.memory_gib.is_finite()) {
            return Err(invalid(
                "device.memory_gib",
                dv.memory_gib,
                "must be a number >= 0 (0 = no limit)",
            ));
        }
        if dv.kind == DeviceKind::Cpu && (dv.memory_gib > 0.0 || dv.check_streams) {
            return Err(invalid(
                "device.kind",
                "cpu",
                "device.memory_gib and device.check_streams need kind = \"cpu-two-memory\"",
            ));
        }
        // The GPU's capacity is its own and the CUDA backend orders its streams with events, so
        // neither knob means anything there; refuse rather than ignore them.
        if dv.kind == DeviceKind::Cuda && (dv.memory_gib > 0.0 || dv.check_streams) {
            return Err(invalid(
                "device.kind",
                "cuda",
                "device.memory_gib and device.check_streams apply to kind = \"cpu-two-memory\" only",
            ));
        }
        let p = &self.parallelism;
        if p.dp_replicate == 0 {
            return Err(invalid("parallelism.dp_replicate", 0, "must be at least 1"));
        }
        if p.dp_shard == 0 {
            return Err(invalid("parallelism.dp_shard", 0, "must be at least 1"));
        }
        // Replicas of a one-rank FSDP group would be plain DDP, whose unsharded path does not
        // all-reduce: refuse rather than train replicas that silently drift apart.
        if p.dp_replicate > 1 && p.dp_shard == 1 {
            return Err(invalid(
                "parallelism.dp_replicate",
                p.dp_replicate,
                "needs parallelism.dp_shard > 1 (HSDP replicates FSDP groups; plain DDP is not implemented)",
            ));
        }
        if p.ep == 0 {
            return Err(invalid("parallelism.ep", 0, "must be at least 1"));
        }
        if !self.model.experts.is_multiple_of(p.ep) {
            return Err(invalid(
                "parallelism.ep",
                p.ep,
                format!("must divide model.experts = {}", self.model.experts),
            ));
        }
        if !p.dp_shard.is_multiple_of(p.ep) {
            return Err(invalid(
                "parallelism.ep",
                p.ep,
                format!("must divide parallelism.dp_shard = {}", p.dp_shard),
            ));
        }
        if !(p.ep_capacity_factor >= 1.0 && p.ep_capacity_factor.is_finite()) {
            return Err(invalid(
                "parallelism.ep_capacity_factor",
                p.ep_capacity_factor,
                "must be a finite number of at least 1 (rows per rank over an even routing's)",
            ));
        }
        if !(p.timeout_s > 0.0 && p.timeout_s.is_finite()) {
            return Err(invalid(
                "parallelism.timeout_s",
                p.timeout_s,
                "must be a positive number of seconds",
            ));
        }
        if !(1..=2).contains(&p.gradient_sets) {
            return Err(invalid(
                "parallelism.gradient_sets",
                p.gradient_sets,
                "must be 1 (least memory) or 2 (reduce-scatters overlap the next block's backward)",
            ));
        }
        if p.prefetch > 8 {
            return Err(invalid(
                "parallelism.prefetch",
                p.prefetch,
                "must be at most 8 (each level holds one more block's gathered parameters)",
            ));
        }
        Ok(())
    }
}

fn parse_scalar(raw: &str) -> toml::Value {
    // Parse as the value of a one-key TOML document so integers, floats, booleans and quoted
    // strings keep their types; bare words become strings.
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("key v"),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests;

//! The Qwen3-MoE decoder: parameter layout ([`Model`]), activation memory ([`Workspace`]) and
//! the explicit forward and backward passes ([`forward_backward`], [`forward_loss`]), plus the
//! DeepSeek-V3 router-bias update and KV-cached sampling ([`generate`]).
//!
//! - Semantics are transformers' `Qwen3MoeForCausalLM` (checked in f32 by `examples/hf_dump.rs`
//!   with `scripts/hf_check.py`: same loss and gradients), plus options it lacks: shared experts
//!   and the DeepSeek-V3 selection bias.
//! - Parameters use Hugging Face names; routed and shared experts are stacked `[E, out, in]`
//!   (export splits them). Weights are `[out, in]`: `y = x·Wᵀ`.
//! - Each operation is a forward and a backward kernel of the backend ([`ganymede_core::NnOps`]);
//!   model code only calls backend operations on tensor views, so a GPU backend needs no change
//!   here, and the same code runs on the f64 CPU backend for finite-difference checks.
//! - Loss: mean cross-entropy over all B·T targets plus `aux_loss_coef` times the Switch
//!   auxiliary loss, computed per MoE layer (`E · Σ_i f_i · P_i`) and averaged over MoE layers.
//!   transformers' `load_balancing_loss_func` instead pools all layers' router outputs into one
//!   `f·P`; we keep it per layer on purpose. Expert `i` of one layer and expert `i` of another
//!   share only an index, and the pooled loss is at its minimum when the layers' imbalances
//!   cancel (layer 0 using experts 0–3 only, layer 1 experts 4–7 only scores as perfectly
//!   balanced), so it cannot see a per-layer collapse that the per-layer loss does. The
//!   coefficient, not the pooling, is what the export carries (`router_aux_loss_coef`), and the
//!   cross-entropy it is checked on is unaffected.
//! - The model knows nothing of ranks. [`forward_backward_with`] reads parameters from a
//!   [`ParamSource`] (told before and after each block runs), adds gradients into a [`GradSink`]
//!   (told when a block's gradients are complete) and runs the routed experts through an
//!   [`ExpertExecutor`]; FSDP and expert parallelism (crate `ganymede-parallel`) implement them.
//!   [`forward_backward`] is the same code with every parameter resident and the experts local.
//!   The hooks that communicate return a `Result`, and a failed collective ends the pass as an
//!   error the caller receives; the single-process hooks cannot fail, so [`forward_backward`]
//!   and [`forward_loss`] return their output directly.

use ganymede_config::ModelConfig;
use ganymede_core::{Backend, Category, ParamKind, ParamSpec, ParamStore, Tensor};

mod block;
mod experts;
mod generate;
mod offload;
mod step;
#[cfg(test)]
mod tests;
mod workspace;

pub use experts::{
    ExpertExecutor, ExpertsBwdBufs, ExpertsFwdBufs, ExpertsIo, LocalExperts, RowBufferUse,
};
pub use generate::{continuation_losses, generate, generate_streaming, Sampling};
pub use offload::OffloadFault;
pub use step::{
    forward_backward, forward_backward_into, forward_backward_with, forward_loss,
    forward_loss_with, read_output, route_len, router_bias_step, update_router_bias, upload_tokens,
    Batch, GradSink, Hooks, LocalParams, ParamSource, Pass, Tokens, Uploaded,
};
pub use workspace::{
    activation_bytes, activation_bytes_at, activation_bytes_bf16, activation_bytes_offloaded,
    Precision, Workspace,
};

/// The parameter table, in a fixed order: embedding, layers, final norm, LM head
/// ([`ganymede_config::model_tensors`], which the planner reads too).
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    use ganymede_config::Role;
    ganymede_config::model_tensors(cfg)
        .into_iter()
        .map(|t| {
            let kind = match t.role {
                Role::Embedding => ParamKind::Embedding,
                Role::LmHead => ParamKind::LmHead,
                Role::Router => ParamKind::Router,
                Role::Norm => ParamKind::Vector,
                Role::Attention | Role::DenseFfn => ParamKind::Matrix,
                Role::RoutedExperts | Role::SharedExperts => ParamKind::Experts,
                Role::RouterBias => ParamKind::Buffer,
            };
            ParamSpec {
                name: t.name,
                shape: t.shape,
                kind,
            }
        })
        .collect()
}

/// splitmix64 with Box–Muller normals: deterministic and dependency-free.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub(crate) fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub(crate) fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
    /// The generator from `seed` after `draws` draws: splitmix64's state is the seed plus a
    /// multiple of its increment, so any point of a stream is reached without drawing what
    /// comes before it.
    pub(crate) fn after(seed: u64, draws: u64) -> Self {
        Rng(seed.wrapping_add(draws.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }
}

/// `out[j] = std ·` the j-th normal of the stream from `seed`, filled in parallel chunks: the
/// same values as drawing them one after another (a normal takes two draws, so the chunk that
/// starts at normal j starts at draw 2j). `large`'s 5.1B parameters took about 100 s drawn on
/// one thread (20–30 ns a normal), before a GPU run's first step.
pub(crate) fn fill_normals(out: &mut [f64], seed: u64, std: f64) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, xs)| {
        let mut rng = Rng::after(seed, 2 * (c * CHUNK) as u64);
        for x in xs {
            *x = std * rng.normal();
        }
    });
}

/// The model's shape and parameter table (names follow Hugging Face Qwen3-MoE).
pub struct Model {
    cfg: ModelConfig,
    specs: Vec<ParamSpec>,
    pub(crate) embed: usize,
    pub(crate) norm: usize,
    pub(crate) lm_head: usize,
    pub(crate) layers: Vec<LayerIdx>,
    /// bf16 × bf16 → f32 GEMMs (`training.compute_dtype = "bf16"`) for every linear layer but
    /// the router's, whose top-k choice is discrete (as Megatron's fp32 router), unless
    /// [`Model::with_router_bf16`] says otherwise. Master parameters, gradients and optimizer state stay f32; the weights the
    /// GEMMs and the embedding read may be handed over in bf16 ([`Model::bf16_weight`]).
    /// Attention then runs on bf16 q, k, v with a bf16 output and bf16 gradients (see
    /// `block.rs`).
    pub(crate) bf16: bool,
    /// Under bf16 compute, keep the rows that only bf16-input GEMMs read in f32 and let each
    /// GEMM cast them (the reference of [`Model::with_f32_rows`]); by default they are made in
    /// bf16 where they are written.
    f32_rows: bool,
    /// Under bf16 compute, have the GEMMs whose outputs only element-wise ops read write them
    /// in f32 ([`Model::with_f32_outputs`]); by default they write bf16.
    f32_outputs: bool,
    /// Under bf16 compute, bf16 operands for the router's GEMMs too ([`Model::with_router_bf16`]).
    router_bf16: bool,
    /// Storage precision of the residual stream at block boundaries
    /// (`activation_checkpoint.boundary_dtype`; see [`Model::bf16_boundaries`]).
    boundary: ganymede_config::BoundaryDtype,
    /// Tokens whose logits the head holds at once (0 = all; [`Model::head_rows`]).
    loss_chunk: usize,
    /// Tokens a MoE layer's routed experts take at once (0 = all; [`Model::moe_rows`]).
    moe_chunk: usize,
}

/// Positions of one layer's parameters in the parameter table.
pub(crate) struct LayerIdx {
    pub in_norm: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub q_norm: usize,
    pub k_norm: usize,
    pub post_norm: usize,
    pub mlp: MlpIdx,
}

pub(crate) enum MlpIdx {
    Dense {
        gate: usize,
        up: usize,
        down: usize,
    },
    Moe {
        router: usize,
        gate: usize,
        up: usize,
        down: usize,
        /// Stacked shared experts' (gate, up, down).
        shared: Option<(usize, usize, usize)>,
        /// DeepSeek-V3 selection bias.
        bias: Option<usize>,
    },
}

impl Model {
    /// The model with its GEMMs' operand precision set (see `training.compute_dtype`).
    pub fn with_compute_dtype(mut self, dtype: ganymede_config::ComputeDtype) -> Model {
        self.bf16 = dtype == ganymede_config::ComputeDtype::Bf16;
        self
    }

    /// Under bf16 compute, the router's GEMMs (its logits, and in backward the input's and the
    /// weight's gradients) with bf16 operands and f32 accumulation and output, as the other
    /// linear layers (`training.router_dtype`). The router's weight stays f32 and is rounded by
    /// the GEMM. No effect under f32 compute.
    pub fn with_router_bf16(mut self, on: bool) -> Model {
        self.router_bf16 = on;
        self
    }

    /// Under bf16 compute, the rows that only bf16-input GEMMs read (the routed experts'
    /// dispatched inputs, SwiGLU products and output gradients, and the gate and up gradients;
    /// the dense and shared SwiGLUs' products and gate and up gradients) kept in f32 and cast
    /// by each GEMM, as before they were made in bf16. The same values reach every GEMM
    /// either way, so this gives the same gradients bit for bit, with twice those rows' bytes
    /// and a cast per read: it is the reference the bf16 rows are tested against.
    pub fn with_f32_rows(mut self, on: bool) -> Model {
        self.f32_rows = on;
        self
    }

    /// Under bf16 compute, the GEMM outputs that only element-wise ops read (the routed
    /// experts' and the dense and shared SwiGLUs' gate and up, and the gradient of their SwiGLU
    /// product, which SwiGLU reads; the routed experts' outputs, which the combine reads; the
    /// head's logits, which the cross-entropy reads and turns into their gradient in place)
    /// written in f32, as before they were written in bf16 (the f32 product rounded once, as
    /// autocast's GEMMs write bf16). Unlike [`Model::with_f32_rows`] this changes values:
    /// SwiGLU and the combine then read unrounded inputs. It is the layout the bf16 rows are tested in bit
    /// for bit, and the reference the bf16 outputs are compared with. [`Model::with_f32_rows`]
    /// implies it.
    pub fn with_f32_outputs(mut self, on: bool) -> Model {
        self.f32_outputs = on;
        self
    }

    /// The model with its boundaries' storage precision set (`auto`, the default, follows the
    /// compute dtype whenever that is set).
    pub fn with_boundary_dtype(mut self, dtype: ganymede_config::BoundaryDtype) -> Model {
        self.boundary = dtype;
        self
    }

    /// The model with its head's loss chunk set (`training.loss_chunk_tokens`; 0 = all tokens).
    pub fn with_loss_chunk(mut self, tokens: usize) -> Model {
        self.loss_chunk = tokens;
        self
    }

    /// The model with its MoE layers' token chunk set (`training.moe_chunk_tokens`; 0 = all).
    pub fn with_moe_chunk(mut self, tokens: usize) -> Model {
        self.moe_chunk = tokens;
        self
    }

    /// Tokens a MoE layer's routed experts take at once out of `n`: the MoE chunk, or all.
    pub fn moe_rows(&self, n: usize) -> usize {
        ganymede_config::moe_rows(n, self.moe_chunk)
    }

    /// Rows of logits the head holds for `n` tokens: the loss chunk, or all of them.
    pub fn head_rows(&self, n: usize) -> usize {
        ganymede_config::head_rows(n, self.loss_chunk)
    }

    /// Whether the residual stream between blocks is stored in bf16: each block's output is
    /// rounded into its boundary, and every reader (the next block, its recompute and backward,
    /// the final norm) widens the boundary into an f32 working copy (see `offload.rs`). The
    /// rounding's backward is the identity, as PyTorch's casts'.
    pub fn bf16_boundaries(&self) -> bool {
        let compute = match self.bf16 {
            true => ganymede_config::ComputeDtype::Bf16,
            false => ganymede_config::ComputeDtype::F32,
        };
        self.boundary.bf16_under(compute)
    }

    pub fn new(cfg: &ModelConfig) -> Model {
        let specs = param_specs(cfg);
        let at = |name: &str| {
            specs
                .iter()
                .position(|s| s.name == name)
                .unwrap_or_else(|| panic!("no parameter {name}"))
        };
        let has = |name: &str| specs.iter().any(|s| s.name == name);
        let layers = (0..cfg.layers)
            .map(|l| {
                let p = |n: &str| at(&format!("model.layers.{l}.{n}"));
                let mlp = if cfg.is_moe_layer(l) {
                    MlpIdx::Moe {
                        router: p("mlp.gate.weight"),
                        gate: p("mlp.experts.gate_proj"),
                        up: p("mlp.experts.up_proj"),
                        down: p("mlp.experts.down_proj"),
                        shared: (cfg.shared_experts > 0).then(|| {
                            (
                                p("mlp.shared_experts.gate_proj"),
                                p("mlp.shared_experts.up_proj"),
                                p("mlp.shared_experts.down_proj"),
                            )
                        }),
                        bias: has(&format!("model.layers.{l}.mlp.e_score_correction_bias"))
                            .then(|| p("mlp.e_score_correction_bias")),
                    }
                } else {
                    MlpIdx::Dense {
                        gate: p("mlp.gate_proj.weight"),
                        up: p("mlp.up_proj.weight"),
                        down: p("mlp.down_proj.weight"),
                    }
                };
                LayerIdx {
                    in_norm: p("input_layernorm.weight"),
                    q: p("self_attn.q_proj.weight"),
                    k: p("self_attn.k_proj.weight"),
                    v: p("self_attn.v_proj.weight"),
                    o: p("self_attn.o_proj.weight"),
                    q_norm: p("self_attn.q_norm.weight"),
                    k_norm: p("self_attn.k_norm.weight"),
                    post_norm: p("post_attention_layernorm.weight"),
                    mlp,
                }
            })
            .collect();
        Model {
            cfg: cfg.clone(),
            embed: at("model.embed_tokens.weight"),
            norm: at("model.norm.weight"),
            lm_head: at("lm_head.weight"),
            layers,
            specs,
            bf16: false,
            f32_rows: false,
            f32_outputs: false,
            router_bf16: false,
            boundary: ganymede_config::BoundaryDtype::Auto,
            loss_chunk: 0,
            moe_chunk: 0,
        }
    }
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// Indices of the routers' selection biases (`e_score_correction_bias`), one per MoE layer
    /// in layer order; empty unless `router_bias_update > 0`.
    pub fn router_biases(&self) -> Vec<usize> {
        self.layers
            .iter()
            .filter_map(|li| match li.mlp {
                MlpIdx::Moe { bias, .. } => bias,
                MlpIdx::Dense { .. } => None,
            })
            .collect()
    }

    pub fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Whether parameter `i` may be handed to the model in bf16: under bf16 compute, the
    /// weights that only bf16-input GEMMs read (attention, dense and expert SwiGLU matrices,
    /// the LM head) and the embedding, whose lookup widens its rows into the f32 residual
    /// stream, as FSDP2's `param_dtype`. The router (an f32 GEMM), norm gains and the selection
    /// bias stay f32. The model reads either dtype; the GEMM casts only what is not bf16 yet.
    pub fn bf16_weight(&self, i: usize) -> bool {
        self.bf16
            && matches!(
                self.specs[i].kind,
                ParamKind::Matrix | ParamKind::Experts | ParamKind::LmHead | ParamKind::Embedding
            )
    }
    /// Parameters initialised deterministically from `seed` (Category::Params).
    pub fn init_params(&self, be: &dyn Backend, seed: u64) -> ParamStore {
        let tensors = (0..self.specs.len())
            .map(|i| self.init_param(be, i, seed))
            .collect();
        ParamStore::from_tensors(self.specs.clone(), tensors)
    }

    /// Parameter `i` of [`Model::init_params`] alone, so a sharded trainer can keep its shard of
    /// each tensor without ever holding the whole table.
    pub fn init_param(&self, be: &dyn Backend, i: usize, seed: u64) -> Tensor {
        let std = self.cfg.init_std;
        let s = &self.specs[i];
        let n = s.numel();
        let data: Vec<f64> = match s.kind {
            // Norm gains start at one, the selection bias at zero.
            ParamKind::Vector => vec![1.0; n],
            ParamKind::Buffer => vec![0.0; n],
            _ => {
                // One stream per tensor, so adding a tensor leaves the others unchanged.
                let mut data = vec![0.0; n];
                fill_normals(
                    &mut data,
                    seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    std,
                );
                data
            }
        };
        be.upload_f64(&data, &s.shape, Category::Params)
    }
}

/// What a step reports.
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// Mean cross-entropy over the batch's B*T targets.
    pub loss: f64,
    /// Unscaled Switch aux loss (mean over MoE layers); 0 if no MoE layer.
    pub aux_loss: f64,
    pub tokens: usize,
    /// Per MoE layer: fraction of the batch's top-k assignments per expert (sums to 1).
    pub expert_load: Vec<Vec<f32>>,
}

//! The Qwen3-MoE decoder: parameter layout ([`Model`]), activation memory ([`Workspace`]) and
//! the explicit forward and backward passes ([`forward_backward`], [`forward_loss`]), plus the
//! DeepSeek-V3 router-bias update and KV-cached sampling ([`generate`]).
//!
//! Model code only calls backend operations on tensor views, so a GPU backend needs no change
//! here. Skeleton: bodies are being filled in.

use ganymede_config::{AcMode, ModelConfig};
use ganymede_core::{Backend, Category, ParamKind, ParamSpec, ParamStore};

/// The parameter table, in a fixed order: embedding, layers, final norm, LM head.
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    let (h, v, hd, e) = (cfg.hidden, cfg.vocab_size, cfg.head_dim, cfg.experts);
    let mut s = vec![ParamSpec::new(
        "model.embed_tokens.weight",
        &[v, h],
        ParamKind::Embedding,
    )];
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        s.push(ParamSpec::new(
            format!("{p}.input_layernorm.weight"),
            &[h],
            ParamKind::Vector,
        ));
        s.push(ParamSpec::new(
            format!("{p}.self_attn.q_proj.weight"),
            &[cfg.q_dim(), h],
            ParamKind::Matrix,
        ));
        s.push(ParamSpec::new(
            format!("{p}.self_attn.k_proj.weight"),
            &[cfg.kv_dim(), h],
            ParamKind::Matrix,
        ));
        s.push(ParamSpec::new(
            format!("{p}.self_attn.v_proj.weight"),
            &[cfg.kv_dim(), h],
            ParamKind::Matrix,
        ));
        s.push(ParamSpec::new(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, cfg.q_dim()],
            ParamKind::Matrix,
        ));
        s.push(ParamSpec::new(
            format!("{p}.self_attn.q_norm.weight"),
            &[hd],
            ParamKind::Vector,
        ));
        s.push(ParamSpec::new(
            format!("{p}.self_attn.k_norm.weight"),
            &[hd],
            ParamKind::Vector,
        ));
        s.push(ParamSpec::new(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            ParamKind::Vector,
        ));
        if cfg.is_moe_layer(l) {
            let f = cfg.expert_hidden;
            s.push(ParamSpec::new(
                format!("{p}.mlp.gate.weight"),
                &[e, h],
                ParamKind::Router,
            ));
            s.push(ParamSpec::new(
                format!("{p}.mlp.experts.gate_proj"),
                &[e, f, h],
                ParamKind::Experts,
            ));
            s.push(ParamSpec::new(
                format!("{p}.mlp.experts.up_proj"),
                &[e, f, h],
                ParamKind::Experts,
            ));
            s.push(ParamSpec::new(
                format!("{p}.mlp.experts.down_proj"),
                &[e, h, f],
                ParamKind::Experts,
            ));
            if cfg.shared_experts > 0 {
                let (ns, fs) = (cfg.shared_experts, cfg.shared_hidden());
                s.push(ParamSpec::new(
                    format!("{p}.mlp.shared_experts.gate_proj"),
                    &[ns, fs, h],
                    ParamKind::Experts,
                ));
                s.push(ParamSpec::new(
                    format!("{p}.mlp.shared_experts.up_proj"),
                    &[ns, fs, h],
                    ParamKind::Experts,
                ));
                s.push(ParamSpec::new(
                    format!("{p}.mlp.shared_experts.down_proj"),
                    &[ns, h, fs],
                    ParamKind::Experts,
                ));
            }
            if cfg.router_bias_update > 0.0 {
                s.push(ParamSpec::new(
                    format!("{p}.mlp.e_score_correction_bias"),
                    &[e],
                    ParamKind::Buffer,
                ));
            }
        } else {
            let f = cfg.dense_hidden;
            s.push(ParamSpec::new(
                format!("{p}.mlp.gate_proj.weight"),
                &[f, h],
                ParamKind::Matrix,
            ));
            s.push(ParamSpec::new(
                format!("{p}.mlp.up_proj.weight"),
                &[f, h],
                ParamKind::Matrix,
            ));
            s.push(ParamSpec::new(
                format!("{p}.mlp.down_proj.weight"),
                &[h, f],
                ParamKind::Matrix,
            ));
        }
    }
    s.push(ParamSpec::new("model.norm.weight", &[h], ParamKind::Vector));
    s.push(ParamSpec::new("lm_head.weight", &[v, h], ParamKind::LmHead));
    s
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
}

/// The model's shape and parameter table (names follow Hugging Face Qwen3-MoE).
pub struct Model {
    cfg: ModelConfig,
    specs: Vec<ParamSpec>,
}

impl Model {
    pub fn new(cfg: &ModelConfig) -> Model {
        Model {
            cfg: cfg.clone(),
            specs: param_specs(cfg),
        }
    }
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }
    /// Parameters initialised deterministically from `seed` (Category::Params).
    pub fn init_params(&self, be: &dyn Backend, seed: u64) -> ParamStore {
        let std = self.cfg.init_std;
        let tensors = self
            .specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.numel();
                let data: Vec<f64> = match s.kind {
                    // Norm gains start at one, the selection bias at zero.
                    ParamKind::Vector => vec![1.0; n],
                    ParamKind::Buffer => vec![0.0; n],
                    _ => {
                        // One stream per tensor, so adding a tensor leaves the others unchanged.
                        let mut rng =
                            Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                        (0..n).map(|_| std * rng.normal()).collect()
                    }
                };
                be.upload_f64(&data, &s.shape, Category::Params)
            })
            .collect();
        ParamStore::from_tensors(self.specs.clone(), tensors)
    }
}

/// All activation memory of a step, allocated once for (model, batch, seq, mode).
pub struct Workspace {
    _private: (),
}

impl Workspace {
    pub fn new(
        be: &dyn Backend,
        model: &Model,
        batch: usize,
        seq: usize,
        mode: AcMode,
    ) -> Workspace {
        let _ = (be, model, batch, seq, mode);
        todo!()
    }
}

/// Bytes of `Category::Activations` a [`Workspace`] allocates.
pub fn activation_bytes(cfg: &ModelConfig, batch: usize, seq: usize, mode: AcMode) -> u64 {
    let _ = (cfg, batch, seq, mode);
    todo!()
}

pub struct StepOutput {
    /// Mean cross-entropy over the batch's B*T targets.
    pub loss: f64,
    /// Unscaled Switch aux loss (mean over MoE layers); 0 if no MoE layer.
    pub aux_loss: f64,
    pub tokens: usize,
    /// Per MoE layer: fraction of the batch's top-k assignments per expert (sums to 1).
    pub expert_load: Vec<Vec<f32>>,
}

/// Forward + backward on one batch; ADDS grad_scale * d(loss_total)/dθ into `grads`.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    grads: &mut ParamStore,
    ws: &mut Workspace,
    inputs: &[u32],
    targets: &[u32],
    grad_scale: f32,
) -> StepOutput {
    let _ = (be, model, params, grads, ws, inputs, targets, grad_scale);
    todo!()
}

/// Forward only (eval).
pub fn forward_loss(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    ws: &mut Workspace,
    inputs: &[u32],
    targets: &[u32],
) -> StepOutput {
    let _ = (be, model, params, ws, inputs, targets);
    todo!()
}

/// DeepSeek-V3 bias update: b_i += coeff * sign(mean_load - load_i) per MoE layer.
pub fn update_router_bias(
    be: &dyn Backend,
    model: &Model,
    params: &mut ParamStore,
    out: &StepOutput,
) {
    let _ = (be, model, params, out);
    todo!()
}

/// Autoregressive sampling with a KV cache; returns the generated ids (not the prompt).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    max_new_tokens: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> Vec<u32> {
    let _ = (
        be,
        model,
        params,
        prompt,
        max_new_tokens,
        temperature,
        top_k,
        seed,
    );
    todo!()
}

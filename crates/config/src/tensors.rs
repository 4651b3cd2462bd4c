//! The model's tensor table, written once: the model builds its parameters from it
//! (`ganymede_model::param_specs`) and the planner counts, shards and times them from it
//! (`ganymede_plan::params`, `ganymede_plan::fit`). Names follow Hugging Face Qwen3-MoE.

use crate::ModelConfig;

/// What a tensor is, which decides how it is updated, sharded and cast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Token embedding `[V, H]`.
    Embedding,
    /// Output projection `[V, H]` (untied).
    LmHead,
    /// RMSNorm gains: per layer (input, post-attention, q, k) and the final one.
    Norm,
    /// q, k, v and o projections.
    Attention,
    /// The router `[E, H]`.
    Router,
    /// DeepSeek-V3's selection bias `[E]`: stored, never updated by gradients.
    RouterBias,
    /// A stack of routed experts' matrices `[E, out, in]`.
    RoutedExperts,
    /// A stack of shared experts' matrices `[S, out, in]`.
    SharedExperts,
    /// A dense layer's SwiGLU matrices.
    DenseFfn,
}

/// One tensor of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The checkpoint name (Hugging Face Qwen3-MoE's).
    pub name: String,
    /// The name without its layer: the same for every layer's copy (`q_proj`,
    /// `experts.gate_proj`, `norm` for the final norm).
    pub kind: &'static str,
    /// The decoder layer holding it; `None` outside the layers.
    pub layer: Option<usize>,
    pub shape: Vec<usize>,
    pub role: Role,
}

/// Every tensor, in the model's fixed order: embedding, each layer's, final norm, LM head.
pub fn model_tensors(m: &ModelConfig) -> Vec<TensorSpec> {
    let (h, v, hd, e) = (m.hidden, m.vocab_size, m.head_dim, m.experts);
    let root = |name: &str, kind, shape: &[usize], role| TensorSpec {
        name: name.to_string(),
        kind,
        layer: None,
        shape: shape.to_vec(),
        role,
    };
    let mut out = vec![root(
        "model.embed_tokens.weight",
        "embed_tokens",
        &[v, h],
        Role::Embedding,
    )];
    for l in 0..m.layers {
        let t = |suffix: &str, kind, shape: &[usize], role| TensorSpec {
            name: format!("model.layers.{l}.{suffix}"),
            kind,
            layer: Some(l),
            shape: shape.to_vec(),
            role,
        };
        use Role::*;
        out.extend([
            t("input_layernorm.weight", "input_layernorm", &[h], Norm),
            t(
                "self_attn.q_proj.weight",
                "q_proj",
                &[m.q_dim(), h],
                Attention,
            ),
            t(
                "self_attn.k_proj.weight",
                "k_proj",
                &[m.kv_dim(), h],
                Attention,
            ),
            t(
                "self_attn.v_proj.weight",
                "v_proj",
                &[m.kv_dim(), h],
                Attention,
            ),
            t(
                "self_attn.o_proj.weight",
                "o_proj",
                &[h, m.q_dim()],
                Attention,
            ),
            t("self_attn.q_norm.weight", "q_norm", &[hd], Norm),
            t("self_attn.k_norm.weight", "k_norm", &[hd], Norm),
            t(
                "post_attention_layernorm.weight",
                "post_attention_layernorm",
                &[h],
                Norm,
            ),
        ]);
        if m.is_moe_layer(l) {
            let f = m.expert_hidden;
            out.extend([
                t("mlp.gate.weight", "router", &[e, h], Router),
                t(
                    "mlp.experts.gate_proj",
                    "experts.gate_proj",
                    &[e, f, h],
                    RoutedExperts,
                ),
                t(
                    "mlp.experts.up_proj",
                    "experts.up_proj",
                    &[e, f, h],
                    RoutedExperts,
                ),
                t(
                    "mlp.experts.down_proj",
                    "experts.down_proj",
                    &[e, h, f],
                    RoutedExperts,
                ),
            ]);
            if m.shared_experts > 0 {
                let (ns, fs) = (m.shared_experts, m.shared_hidden());
                out.extend([
                    t(
                        "mlp.shared_experts.gate_proj",
                        "shared.gate_proj",
                        &[ns, fs, h],
                        SharedExperts,
                    ),
                    t(
                        "mlp.shared_experts.up_proj",
                        "shared.up_proj",
                        &[ns, fs, h],
                        SharedExperts,
                    ),
                    t(
                        "mlp.shared_experts.down_proj",
                        "shared.down_proj",
                        &[ns, h, fs],
                        SharedExperts,
                    ),
                ]);
            }
            if m.router_bias_update > 0.0 {
                out.push(t(
                    "mlp.e_score_correction_bias",
                    "router_bias",
                    &[e],
                    RouterBias,
                ));
            }
        } else {
            let f = m.dense_hidden;
            out.extend([
                t("mlp.gate_proj.weight", "mlp.gate_proj", &[f, h], DenseFfn),
                t("mlp.up_proj.weight", "mlp.up_proj", &[f, h], DenseFfn),
                t("mlp.down_proj.weight", "mlp.down_proj", &[h, f], DenseFfn),
            ]);
        }
    }
    out.push(root("model.norm.weight", "norm", &[h], Role::Norm));
    out.push(root("lm_head.weight", "lm_head", &[v, h], Role::LmHead));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layer_holds_the_same_kinds_and_the_counts_add_up() {
        let mut m = crate::preset("tiny").unwrap().model;
        m.layers = 3;
        m.dense_layers = 1;
        m.dense_hidden = 96;
        m.shared_experts = 1;
        m.router_bias_update = 1e-3;
        let ts = model_tensors(&m);
        let (h, v, e, f) = (m.hidden, m.vocab_size, m.experts, m.expert_hidden);
        let per_layer = |l| ts.iter().filter(|t| t.layer == Some(l)).count();
        // Dense: 8 attention/norm tensors and 3 FFN; MoE: 8, router, 3 routed, 3 shared, bias.
        assert_eq!([per_layer(0), per_layer(1), per_layer(2)], [11, 16, 16]);
        let total: usize = ts.iter().map(|t| t.shape.iter().product::<usize>()).sum();
        let attn = 2 * m.q_dim() * h + 2 * m.kv_dim() * h;
        let norms = 2 * h + 2 * m.head_dim;
        let moe = e * h + 3 * e * f * h + 3 * m.shared_hidden() * h + e;
        let expect = 2 * v * h + h + 3 * (attn + norms) + 3 * 96 * h + 2 * moe;
        assert_eq!(total, expect);
        let mut names: Vec<&str> = ts.iter().map(|t| t.name.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ts.len(), "names are unique");
    }
}

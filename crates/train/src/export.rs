//! Export a checkpoint as a Hugging Face Qwen3-MoE model directory: `config.json` plus
//! `model.safetensors` with `transformers`' tensor names and layout, loadable by
//! `Qwen3MoeForCausalLM`.
//!
//! Our names are already Qwen3-MoE's, except that routed experts are stored stacked
//! (`mlp.experts.gate_proj` `[E, F, H]`); the export splits them into
//! `mlp.experts.{j}.gate_proj.weight` `[F, H]` and so on. Features Qwen3-MoE has no field for
//! (shared experts, a nonzero DeepSeek selection bias) are refused rather than silently dropped.

use crate::checkpoint::{self, HostTensors, NamedTensors};
use anyhow::{bail, Context, Result};
use ganymede_config::JobConfig;
use ganymede_data::ByteTokenizer;
use serde_json::json;
use std::collections::HashMap;
use std::fs;
use std::path::Path;

/// The `config.json` of the Hugging Face model equivalent to `cfg`.
pub fn hf_config(cfg: &JobConfig) -> serde_json::Value {
    let m = &cfg.model;
    let mlp_only_layers: Vec<usize> = (0..m.layers).filter(|&l| !m.is_moe_layer(l)).collect();
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
        // Only dense layers use it; any positive value is fine when there are none.
        "intermediate_size": if m.dense_hidden > 0 { m.dense_hidden } else { m.expert_hidden },
        "moe_intermediate_size": m.expert_hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "num_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": mlp_only_layers,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        // Both spellings: `rope_parameters` for current transformers, `rope_theta` for older.
        "rope_parameters": { "rope_type": "default", "rope_theta": m.rope_theta },
        "rope_theta": m.rope_theta,
        "max_position_embeddings": m.seq_len.max(2048),
        "tie_word_embeddings": false,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": false,
        "initializer_range": m.init_std,
        "use_cache": true,
        "torch_dtype": "float32",
        "dtype": "float32",
    })
}

/// Map our parameter tensors to Qwen3-MoE's, splitting stacked experts. Errors on features
/// Qwen3-MoE cannot express and on any tensor it does not know.
pub fn hf_tensors(cfg: &JobConfig, mut params: HostTensors) -> Result<NamedTensors> {
    let m = &cfg.model;
    if m.shared_experts > 0 {
        bail!(
            "cannot export to Qwen3-MoE: the model has shared experts (model.shared_experts = {}), which Qwen3-MoE has no place for",
            m.shared_experts
        );
    }
    let mut out = Vec::new();
    for (name, (shape, data)) in std::mem::take(&mut params) {
        if name.ends_with(".mlp.e_score_correction_bias") {
            if let Some(x) = data.iter().find(|x| **x != 0.0) {
                bail!(
                    "cannot export to Qwen3-MoE: {name} is nonzero (e.g. {x}); Qwen3-MoE has no expert-selection bias (model.router_bias_update = {})",
                    m.router_bias_update
                );
            }
            continue; // an all-zero bias changes nothing
        }
        if name.contains(".mlp.shared_experts.") {
            bail!("cannot export to Qwen3-MoE: shared expert tensor {name}");
        }
        let stacked = ["gate_proj", "up_proj", "down_proj"]
            .iter()
            .find(|p| name.ends_with(&format!(".mlp.experts.{p}")));
        if let Some(proj) = stacked {
            let prefix = name.trim_end_matches(proj);
            if shape.len() != 3 {
                bail!("{name}: expected a stacked [experts, out, in] tensor, got shape {shape:?}");
            }
            let per = shape[1] * shape[2];
            for (j, chunk) in data.chunks_exact(per).enumerate() {
                out.push((
                    format!("{prefix}{j}.{proj}.weight"),
                    vec![shape[1], shape[2]],
                    chunk.to_vec(),
                ));
            }
            continue;
        }
        out.push((name, shape, data));
    }
    check_complete(cfg, &out)?;
    Ok(out)
}

/// Every tensor `Qwen3MoeForCausalLM` expects is present with its shape, and nothing else.
fn check_complete(cfg: &JobConfig, tensors: &NamedTensors) -> Result<()> {
    let m = &cfg.model;
    let (h, v, q, kv, d) = (m.hidden, m.vocab_size, m.q_dim(), m.kv_dim(), m.head_dim);
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![v, h]),
    ];
    for l in 0..m.layers {
        let p = format!("model.layers.{l}");
        want.push((format!("{p}.input_layernorm.weight"), vec![h]));
        want.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        want.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
        want.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        want.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        want.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        want.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
        want.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
        if m.is_moe_layer(l) {
            let f = m.expert_hidden;
            want.push((format!("{p}.mlp.gate.weight"), vec![m.experts, h]));
            for j in 0..m.experts {
                want.push((format!("{p}.mlp.experts.{j}.gate_proj.weight"), vec![f, h]));
                want.push((format!("{p}.mlp.experts.{j}.up_proj.weight"), vec![f, h]));
                want.push((format!("{p}.mlp.experts.{j}.down_proj.weight"), vec![h, f]));
            }
        } else {
            let f = m.dense_hidden;
            want.push((format!("{p}.mlp.gate_proj.weight"), vec![f, h]));
            want.push((format!("{p}.mlp.up_proj.weight"), vec![f, h]));
            want.push((format!("{p}.mlp.down_proj.weight"), vec![h, f]));
        }
    }
    let have: HashMap<&str, &Vec<usize>> =
        tensors.iter().map(|(n, s, _)| (n.as_str(), s)).collect();
    for (name, shape) in &want {
        match have.get(name.as_str()) {
            None => bail!("export: the checkpoint has no tensor for {name}"),
            Some(s) if *s != shape => {
                bail!("export: {name} has shape {s:?}, Qwen3-MoE expects {shape:?}")
            }
            _ => {}
        }
    }
    if have.len() != want.len() {
        let known: std::collections::HashSet<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
        let extra = have.keys().find(|n| !known.contains(**n)).unwrap();
        bail!("export: tensor {extra} has no Qwen3-MoE counterpart");
    }
    Ok(())
}

/// Export the checkpoint at `ckpt` (a checkpoint or run directory) into `out`.
pub fn export_hf(ckpt: &Path, out: &Path) -> Result<()> {
    let dir = checkpoint::resolve(ckpt)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let cfg = manifest.job_config()?;
    let params = checkpoint::read_params(&dir)?;
    let tensors = hf_tensors(&cfg, params)?;
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = checkpoint::to_safetensors_bytes(&tensors, Some(meta))?;
    checkpoint::write_atomic(&out.join("model.safetensors"), &bytes)?;
    let config = serde_json::to_string_pretty(&hf_config(&cfg))?;
    checkpoint::write_atomic(&out.join("config.json"), config.as_bytes())?;
    // The tokenizer: a trained BPE or Hugging Face one travels with the checkpoint; the byte
    // tokenizer is written as the equivalent tokenizer.json. The tokenizer_config.json makes
    // `AutoTokenizer` use that file as it is.
    let tok_out = out.join(checkpoint::TOKENIZER_FILE);
    let saved = dir.join(checkpoint::TOKENIZER_FILE);
    match cfg.data.tokenizer.as_str() {
        _ if saved.is_file() => {
            fs::copy(&saved, &tok_out)
                .with_context(|| format!("cannot copy {}", saved.display()))?;
        }
        "byte" => ByteTokenizer.to_hf().save(&tok_out)?,
        "bpe" => bail!(
            "export: checkpoint {} has no {} (its run trained a BPE tokenizer)",
            dir.display(),
            checkpoint::TOKENIZER_FILE
        ),
        path => {
            fs::copy(path, &tok_out).with_context(|| format!("data.tokenizer = {path}"))?;
        }
    }
    let tok_cfg = json!({ "tokenizer_class": "PreTrainedTokenizerFast" });
    checkpoint::write_atomic(
        &out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_cfg)?.as_bytes(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ganymede_core::{CpuBackend, Memory};
    use ganymede_model::Model;

    fn host_params(cfg: &JobConfig) -> HostTensors {
        let be = CpuBackend::default();
        let p = Model::new(&cfg.model).init_params(&be, 7);
        p.iter()
            .map(|(s, t)| (s.name.clone(), (s.shape.clone(), be.download(t.view()))))
            .collect()
    }

    #[test]
    fn splits_experts_into_qwen3_names() {
        let cfg = ganymede_config::preset("tiny")
            .unwrap()
            .with_overrides(&[
                "model.dense_layers=1".into(),
                "model.dense_hidden=96".into(),
            ])
            .unwrap();
        let params = host_params(&cfg);
        let stacked = params["model.layers.1.mlp.experts.down_proj"].clone();
        let out = hf_tensors(&cfg, params).unwrap();
        let find = |n: &str| {
            out.iter()
                .find(|t| t.0 == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        // Expert 3 of the stacked [E, H, F] down projection is its own [H, F] matrix.
        let (h, f) = (cfg.model.hidden, cfg.model.expert_hidden);
        let e3 = find("model.layers.1.mlp.experts.3.down_proj.weight");
        assert_eq!(e3.1, vec![h, f]);
        assert_eq!(e3.2, stacked.1[3 * h * f..4 * h * f]);
        assert_eq!(find("model.layers.0.mlp.gate_proj.weight").1, vec![96, h]);
        let c = hf_config(&cfg);
        assert_eq!(c["mlp_only_layers"], serde_json::json!([0]));
        assert_eq!(c["intermediate_size"], 96);
    }

    #[test]
    fn refuses_what_qwen3_cannot_express() {
        let cfg = ganymede_config::preset("tiny")
            .unwrap()
            .with_overrides(&["model.shared_experts=1".into()])
            .unwrap();
        let msg = format!("{:#}", hf_tensors(&cfg, host_params(&cfg)).unwrap_err());
        assert!(msg.contains("shared experts"), "{msg}");

        let cfg = ganymede_config::preset("tiny")
            .unwrap()
            .with_overrides(&["model.router_bias_update=0.001".into()])
            .unwrap();
        // An untouched (zero) bias exports; a trained one does not.
        assert!(hf_tensors(&cfg, host_params(&cfg)).is_ok());
        let mut params = host_params(&cfg);
        params
            .get_mut("model.layers.0.mlp.e_score_correction_bias")
            .unwrap()
            .1[2] = 0.5;
        let msg = format!("{:#}", hf_tensors(&cfg, params).unwrap_err());
        assert!(
            msg.contains("e_score_correction_bias") && msg.contains("nonzero"),
            "{msg}"
        );
    }
}

//! Export a checkpoint as a Hugging Face model directory: `config.json`, safetensors files with
//! `transformers`' tensor names and layout (one `model.safetensors`, or shards of a chosen size
//! with `model.safetensors.index.json`), `generation_config.json` and the tokenizer files,
//! loadable by `Qwen3MoeForCausalLM` (or `Qwen3ForCausalLM` for a model without routed layers).
//!
//! The export is written tensor by tensor, each read by range from the checkpoint (gathered or
//! per-rank shards), so its memory is about one tensor's, not the model's.
//!
//! Our names are already Qwen3-MoE's, except that routed experts are stored stacked
//! (`mlp.experts.gate_proj` `[E, F, H]`); the export splits them into
//! `mlp.experts.{j}.gate_proj.weight` `[F, H]` and so on. Features Qwen3-MoE has no field for
//! (shared experts, a nonzero DeepSeek selection bias) are refused rather than silently dropped.

use crate::checkpoint::{self, ShardsManifest};
use crate::st_file::{StFile, StWriter};
use anyhow::{bail, Context, Result};
use ganymede_config::JobConfig;
use ganymede_data::ByteTokenizer;
use serde_json::json;
use std::fs;
use std::path::Path;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
/// Elements read and written at once (16 MiB of f32).
const CHUNK: usize = 1 << 22;

/// The `config.json` of the Hugging Face model equivalent to `cfg`: `Qwen3ForCausalLM` when
/// no layer is routed (a dense Qwen3, imported or not), else `Qwen3MoeForCausalLM`.
pub fn hf_config(cfg: &JobConfig) -> serde_json::Value {
    let m = &cfg.model;
    if !(0..m.layers).any(|l| m.is_moe_layer(l)) {
        return json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": m.vocab_size,
            "hidden_size": m.hidden,
            "intermediate_size": m.dense_hidden,
            "num_hidden_layers": m.layers,
            "num_attention_heads": m.heads,
            "num_key_value_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": m.norm_eps,
            "rope_parameters": { "rope_type": "default", "rope_theta": m.rope_theta },
            "rope_theta": m.rope_theta,
            "max_position_embeddings": m.seq_len.max(2048),
            "tie_word_embeddings": false,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "use_sliding_window": false,
            "sliding_window": null,
            "initializer_range": m.init_std,
            "use_cache": true,
            "torch_dtype": "float32",
            "dtype": "float32",
        });
    }
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

/// One tensor of the export: its Hugging Face name and shape, and where its elements are in
/// the checkpoint (elements `lo..lo + numel` of parameter `param`).
#[derive(Clone, Debug)]
pub struct OutTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub param: String,
    pub lo: usize,
}

impl OutTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The export's tensors in order: our parameters under `transformers`' names, stacked experts
/// split into one tensor per expert. Refuses what Qwen3-MoE cannot express (shared experts);
/// DeepSeek selection biases are left out here and checked to be zero by [`export_hf`].
pub fn hf_plan(cfg: &JobConfig) -> Result<Vec<OutTensor>> {
    let m = &cfg.model;
    if m.shared_experts > 0 {
        bail!(
            "cannot export to Qwen3-MoE: the model has shared experts (model.shared_experts = {}), which Qwen3-MoE has no place for",
            m.shared_experts
        );
    }
    let mut out = Vec::new();
    for s in ganymede_model::param_specs(m) {
        let name = s.name.clone();
        if name.ends_with(".mlp.e_score_correction_bias") {
            continue;
        }
        let stacked = ["gate_proj", "up_proj", "down_proj"]
            .iter()
            .find(|p| name.ends_with(&format!(".mlp.experts.{p}")));
        if let Some(proj) = stacked {
            let prefix = name.trim_end_matches(proj);
            let per = s.shape[1] * s.shape[2];
            for j in 0..s.shape[0] {
                out.push(OutTensor {
                    name: format!("{prefix}{j}.{proj}.weight"),
                    shape: vec![s.shape[1], s.shape[2]],
                    param: name.clone(),
                    lo: j * per,
                });
            }
            continue;
        }
        out.push(OutTensor {
            name: name.clone(),
            shape: s.shape.clone(),
            param: name,
            lo: 0,
        });
    }
    Ok(out)
}

/// A checkpoint's parameters read by range, from the gathered `model.safetensors` or from the
/// per-rank shard files, without assembling any tensor beyond the range asked for.
enum ParamReader {
    Gathered(StFile),
    Sharded {
        sm: ShardsManifest,
        files: Vec<StFile>,
    },
}

impl ParamReader {
    fn open(dir: &Path, cfg: &JobConfig) -> Result<Self> {
        let specs = ganymede_model::param_specs(&cfg.model);
        if dir.join(checkpoint::SHARDS_FILE).is_file() {
            let sm = checkpoint::sharded::read_manifest(dir)?;
            let files = (0..sm.dp_shard)
                .map(|r| StFile::open(&dir.join(checkpoint::sharded::rank_file(r))))
                .collect::<Result<Vec<_>>>()?;
            for s in &specs {
                let Some(p) = sm.params.iter().find(|p| p.name == s.name) else {
                    bail!(
                        "{}: no parameter {}",
                        dir.join(checkpoint::SHARDS_FILE).display(),
                        s.name
                    );
                };
                let slices = if p.efsdp { sm.ep } else { 1 };
                if p.shape != s.shape || p.slice_elems * slices != s.numel() {
                    bail!(
                        "{}: {} is laid out as shape {:?} in {slices} slice(s) of {}, the model has {:?}",
                        dir.join(checkpoint::SHARDS_FILE).display(),
                        s.name,
                        p.shape,
                        p.slice_elems,
                        s.shape
                    );
                }
                for (r, f) in files.iter().enumerate() {
                    match f.tensors.get(&s.name) {
                        Some(e) if e.numel() == p.shard_elems => {}
                        _ => bail!(
                            "{}: {} is missing or not {} elements",
                            f.path.display(),
                            s.name,
                            p.shard_elems
                        ),
                    }
                    let _ = r;
                }
            }
            Ok(ParamReader::Sharded { sm, files })
        } else {
            let f = StFile::open(&dir.join(checkpoint::MODEL_FILE))?;
            for s in &specs {
                match f.tensors.get(&s.name) {
                    Some(e) if e.shape == s.shape => {}
                    Some(e) => bail!(
                        "{}: tensor {} has shape {:?}, the model expects {:?}",
                        f.path.display(),
                        s.name,
                        e.shape,
                        s.shape
                    ),
                    None => bail!("{}: tensor {} is missing", f.path.display(), s.name),
                }
            }
            Ok(ParamReader::Gathered(f))
        }
    }

    /// Elements `lo..hi` of parameter `name`, flattened.
    fn read(&self, name: &str, lo: usize, hi: usize) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(hi - lo);
        match self {
            ParamReader::Gathered(f) => f.read_into(&f.tensors[name], lo, hi, &mut out)?,
            ParamReader::Sharded { sm, files } => {
                let p = sm.params.iter().find(|p| p.name == name).expect("checked");
                let mut x = lo;
                while x < hi {
                    // Routed experts: slice `e` of the ep group, piece `g` of the expert-FSDP
                    // group, held by rank g·ep + e; other parameters: piece `g` on rank g.
                    let (e, y) = (x / p.slice_elems, x % p.slice_elems);
                    let (g, o) = (y / p.shard_elems, y % p.shard_elems);
                    let r = if p.efsdp { g * sm.ep + e } else { g };
                    let n = (hi - x).min(p.shard_elems - o).min(p.slice_elems - y);
                    let f = &files[r];
                    f.read_into(&f.tensors[name], o, o + n, &mut out)?;
                    x += n;
                }
            }
        }
        Ok(out)
    }
}

/// How to write an export.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Largest safetensors file in bytes (a larger tensor gets a file of its own), as
    /// `transformers`' `max_shard_size`.
    pub max_shard_bytes: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        // transformers' default max_shard_size, "5GB".
        Self {
            max_shard_bytes: 5_000_000_000,
        }
    }
}

/// Parse a shard size: bytes, or with a decimal (KB, MB, GB) or binary (KiB, MiB, GiB) unit.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        _ => bail!("shard size {s}: unknown unit (use B, KB, MB, GB, KiB, MiB or GiB)"),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("shard size {s}: not a number"))?;
    let bytes = (v * mult as f64) as u64;
    if bytes == 0 {
        bail!("shard size {s}: must be positive");
    }
    Ok(bytes)
}

/// Group tensors into files as `transformers` does: in order, a new file when the next tensor
/// would take the current one past `max` bytes.
fn shard_groups(plan: &[OutTensor], max: u64) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = vec![];
    let mut size = 0u64;
    for (i, t) in plan.iter().enumerate() {
        let b = t.numel() as u64 * 4;
        match groups.last_mut() {
            Some(g) if size + b <= max => {
                g.push(i);
                size += b;
            }
            _ => {
                groups.push(vec![i]);
                size = b;
            }
        }
    }
    groups
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub files: usize,
    pub tensors: usize,
    pub bytes: u64,
    pub architecture: &'static str,
}

/// Export the checkpoint at `ckpt` (a checkpoint or run directory, gathered or per-rank shards)
/// into `out`: safetensors files of at most `opts.max_shard_bytes` (one `model.safetensors`, or
/// `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`), written tensor by
/// tensor in pieces of at most 16 MiB, plus `config.json`, `generation_config.json` and the tokenizer files.
pub fn export_hf(ckpt: &Path, out: &Path, opts: &ExportOptions) -> Result<ExportSummary> {
    let dir = checkpoint::resolve(ckpt)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let cfg = manifest.job_config()?;
    // Every file the export reads by range, checked whole against the manifest's digests first
    // (streamed: a large checkpoint is never held).
    let digests = checkpoint::file_digests(&dir)?;
    for name in digests
        .keys()
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with("optimizer"))
    {
        checkpoint::verify_file(&dir, name, &digests)?;
    }
    let plan = hf_plan(&cfg)?;
    let reader = ParamReader::open(&dir, &cfg)?;
    let m = &cfg.model;
    if m.router_bias_update > 0.0 {
        for l in (0..m.layers).filter(|&l| m.is_moe_layer(l)) {
            let name = format!("model.layers.{l}.mlp.e_score_correction_bias");
            let b = reader.read(&name, 0, m.experts)?;
            if let Some(x) = b.iter().find(|x| **x != 0.0) {
                bail!(
                    "cannot export to Qwen3-MoE: {name} is nonzero (e.g. {x}); Qwen3-MoE has no expert-selection bias (model.router_bias_update = {})",
                    m.router_bias_update
                );
            }
        }
    }
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    // An earlier export's shards would be mixed with these: transformers reads what the index
    // names, but a stale model.safetensors beside an index (or the reverse) is ambiguous.
    for e in fs::read_dir(out)?.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        let ours = (n.starts_with("model-") && n.ends_with(".safetensors"))
            || n == SINGLE_FILE
            || n == INDEX_FILE;
        if ours {
            fs::remove_file(e.path())
                .with_context(|| format!("cannot remove {}", e.path().display()))?;
        }
    }
    let groups = shard_groups(&plan, opts.max_shard_bytes);
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (k, g) in groups.iter().enumerate() {
        let fname = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
        let tensors: Vec<(String, Vec<usize>)> = g
            .iter()
            .map(|&i| (plan[i].name.clone(), plan[i].shape.clone()))
            .collect();
        let mut w = StWriter::create(&out.join(&fname), &tensors, &[("format", "pt")])?;
        for &i in g {
            let t = &plan[i];
            // In pieces of at most CHUNK elements: memory stays flat whatever the tensor size.
            let mut at = t.lo;
            while at < t.lo + t.numel() {
                let hi = (at + CHUNK).min(t.lo + t.numel());
                w.write(&reader.read(&t.param, at, hi)?)?;
                at = hi;
            }
            total += t.numel() as u64 * 4;
            weight_map.insert(t.name.clone(), json!(fname));
        }
        w.finish()?;
    }
    if n > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        checkpoint::write_atomic(
            &out.join(INDEX_FILE),
            serde_json::to_string_pretty(&index)?.as_bytes(),
        )?;
    }
    // The tokenizer: a trained BPE or Hugging Face one travels with the checkpoint; the byte
    // tokenizer is written as the equivalent tokenizer.json.
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
    let special = special_tokens(&tok_out)?;
    let mut config = hf_config(&cfg);
    for (key, id) in [
        ("bos_token_id", special.bos.as_ref()),
        ("eos_token_id", special.eos.as_ref()),
        ("pad_token_id", special.pad.as_ref()),
    ] {
        config[key] = id.map_or(serde_json::Value::Null, |(_, id)| json!(id));
    }
    checkpoint::write_atomic(
        &out.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    let mut gen = json!({ "_from_model_config": true });
    for (key, id) in [
        ("bos_token_id", special.bos.as_ref()),
        ("eos_token_id", special.eos.as_ref()),
        ("pad_token_id", special.pad.as_ref()),
    ] {
        if let Some((_, id)) = id {
            gen[key] = json!(id);
        }
    }
    checkpoint::write_atomic(
        &out.join("generation_config.json"),
        serde_json::to_string_pretty(&gen)?.as_bytes(),
    )?;
    // `PreTrainedTokenizerFast` uses tokenizer.json as it is; the special tokens are named so
    // `tokenizer.eos_token` and padding work.
    let mut tok_cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.model.seq_len,
    });
    for (key, t) in [
        ("bos_token", &special.bos),
        ("eos_token", &special.eos),
        ("pad_token", &special.pad),
    ] {
        if let Some((content, _)) = t {
            tok_cfg[key] = json!(content);
        }
    }
    checkpoint::write_atomic(
        &out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_cfg)?.as_bytes(),
    )?;
    Ok(ExportSummary {
        files: n,
        tensors: plan.len(),
        bytes: total,
        architecture: if (0..m.layers).any(|l| m.is_moe_layer(l)) {
            "Qwen3MoeForCausalLM"
        } else {
            "Qwen3ForCausalLM"
        },
    })
}

/// Beginning, end and padding tokens of a tokenizer.json: (content, id) of its special added
/// tokens with the usual names; none for a tokenizer without them (ganymede's byte and BPE).
#[derive(Default, Debug)]
pub struct SpecialTokens {
    pub bos: Option<(String, u64)>,
    pub eos: Option<(String, u64)>,
    pub pad: Option<(String, u64)>,
}

pub fn special_tokens(tokenizer_json: &Path) -> Result<SpecialTokens> {
    let text = fs::read_to_string(tokenizer_json)
        .with_context(|| format!("cannot read {}", tokenizer_json.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", tokenizer_json.display()))?;
    let added: Vec<(String, u64)> = v["added_tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|t| t["special"] == true)
                .filter_map(|t| Some((t["content"].as_str()?.to_string(), t["id"].as_u64()?)))
                .collect()
        })
        .unwrap_or_default();
    let find = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| added.iter().find(|(c, _)| c == n).cloned())
    };
    Ok(SpecialTokens {
        bos: find(&["<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>"]),
        eos: find(&[
            "<|endoftext|>",
            "</s>",
            "<eos>",
            "<|end_of_text|>",
            "<|im_end|>",
        ]),
        pad: find(&["<pad>", "<|pad|>", "[PAD]"]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_experts_into_qwen3_names() {
        let cfg = ganymede_config::preset("tiny")
            .unwrap()
            .with_overrides(&[
                "model.dense_layers=1".into(),
                "model.dense_hidden=96".into(),
            ])
            .unwrap();
        let plan = hf_plan(&cfg).unwrap();
        let find = |n: &str| {
            plan.iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        // Expert 3 of the stacked [E, H, F] down projection is its own [H, F] matrix.
        let (h, f) = (cfg.model.hidden, cfg.model.expert_hidden);
        let e3 = find("model.layers.1.mlp.experts.3.down_proj.weight");
        assert_eq!(e3.shape, vec![h, f]);
        assert_eq!(
            (e3.param.as_str(), e3.lo),
            ("model.layers.1.mlp.experts.down_proj", 3 * h * f)
        );
        assert_eq!(
            find("model.layers.0.mlp.gate_proj.weight").shape,
            vec![96, h]
        );
        let c = hf_config(&cfg);
        assert_eq!(c["mlp_only_layers"], serde_json::json!([0]));
        assert_eq!(c["intermediate_size"], 96);
        // Every layer dense: the dense architecture.
        let dense = ganymede_config::preset("tiny")
            .unwrap()
            .with_overrides(&[
                format!("model.dense_layers={}", cfg.model.layers),
                "model.dense_hidden=96".into(),
            ])
            .unwrap();
        assert_eq!(hf_config(&dense)["architectures"][0], "Qwen3ForCausalLM");
    }

    #[test]
    fn shards_group_like_transformers() {
        let t = |n: usize| OutTensor {
            name: String::new(),
            shape: vec![n],
            param: String::new(),
            lo: 0,
        };
        // 4-byte elements, 100-byte files: 10+10 fit, 30 alone (over the limit), 5+5+10.
        let plan = [t(10), t(10), t(30), t(5), t(5), t(10)];
        assert_eq!(
            shard_groups(&plan, 100),
            vec![vec![0, 1], vec![2], vec![3, 4, 5]]
        );
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("1.5KB").unwrap(), 1500);
        assert!(parse_size("5XB")
            .unwrap_err()
            .to_string()
            .contains("unknown unit"));
    }

    #[test]
    fn special_tokens_come_from_the_tokenizers_added_tokens() {
        let dir = std::env::temp_dir().join(format!("ganymede-special-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("tokenizer.json");
        // Qwen's names: <|endoftext|> ends text; <|im_end|> is special too but ranks after it;
        // a non-special added token is never taken.
        let tok = json!({ "added_tokens": [
            { "id": 5, "content": "<pad>", "special": false },
            { "id": 7, "content": "<|im_end|>", "special": true },
            { "id": 6, "content": "<|endoftext|>", "special": true },
        ]});
        fs::write(&p, tok.to_string()).unwrap();
        let s = special_tokens(&p).unwrap();
        assert_eq!(s.eos, Some(("<|endoftext|>".into(), 6)));
        assert_eq!((s.bos, s.pad), (None, None));
        fs::write(&p, json!({ "added_tokens": [] }).to_string()).unwrap();
        assert!(special_tokens(&p).unwrap().eos.is_none());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refuses_shared_experts() {
        let cfg = ganymede_config::preset("tiny")
            .unwrap()
            .with_overrides(&["model.shared_experts=1".into()])
            .unwrap();
        let msg = format!("{:#}", hf_plan(&cfg).unwrap_err());
        assert!(msg.contains("shared experts"), "{msg}");
    }
}

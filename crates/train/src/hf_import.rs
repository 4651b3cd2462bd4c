//! Start a run from a Hugging Face model folder (`train --init-from hf:DIR`): `config.json`,
//! `tokenizer.json`, and `model.safetensors` or shards named by `model.safetensors.index.json`.
//!
//! - Architectures: `Qwen3MoeForCausalLM` (experts saved per expert,
//!   `mlp.experts.{j}.gate_proj.weight`, or fused, `mlp.experts.gate_up_proj` `[E, 2F, H]` and
//!   `mlp.experts.down_proj` `[E, H, F]`) and `Qwen3ForCausalLM` (every layer dense). Anything
//!   ganymede cannot compute exactly is refused with one line naming the field and value: another
//!   architecture, sliding-window attention, RoPE scaling, attention biases, dense layers anywhere
//!   but first (ganymede's dense layers are the first `model.dense_layers`).
//! - [`HfCheckpoint::overrides`] is the model section (and `data.tokenizer`) as `--set`
//!   overrides, applied before the user's own: a preset or config file supplies the rest of the job.
//! - Streaming: [`load_into`] gives each rank its own part of every parameter, read from the files
//!   by range, one tensor at a time; no rank holds the whole model.
//! - Sparse upcycling: a target MoE layer where the checkpoint has a dense one (the user set
//!   `model.dense_layers`, `model.experts`, `model.top_k` and optionally `model.expert_hidden`)
//!   gets experts cut from the dense FFN and a zero router; see [`upcycle_scale`].
//! - Tied embeddings (`tie_word_embeddings`) start `lm_head` as a copy of the embedding; ganymede
//!   then trains the two separately (it has no tied head), and exports them untied.

use crate::st_file::{Entry, StFile};
use anyhow::{bail, Context, Result};
use ganymede_config::{JobConfig, ModelConfig};
use ganymede_core::ParamSpec;
use ganymede_parallel::RankState;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

/// Which `transformers` class the folder holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Qwen3Moe,
    Qwen3,
}

/// A Hugging Face model folder, its shape read from `config.json` and its tensors indexed.
pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub arch: Arch,
    /// The checkpoint's own model shape (before any user override).
    pub model: ModelConfig,
    /// Layers whose MLP is routed experts in the checkpoint.
    pub moe_layers: Vec<bool>,
    pub tied: bool,
    /// Tensor name → (file, entry).
    tensors: HashMap<String, (usize, Entry)>,
    files: Vec<StFile>,
}

/// Where a parameter's elements come from, in order.
#[derive(Clone, Debug)]
enum Piece {
    /// Elements `lo..hi` of a checkpoint tensor, times `scale`.
    Read {
        name: String,
        lo: usize,
        hi: usize,
        scale: f32,
    },
    Zero(usize),
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Read { lo, hi, .. } => hi - lo,
            Piece::Zero(n) => *n,
        }
    }
}

/// `train --init-from` takes `hf:DIR`; the prefix leaves room for other sources.
pub fn parse_source(s: &str) -> Result<PathBuf> {
    match s.strip_prefix("hf:") {
        Some(d) if !d.is_empty() => Ok(PathBuf::from(d)),
        _ => bail!("--init-from {s}: expected hf:DIR (a Hugging Face model folder)"),
    }
}

impl HfCheckpoint {
    /// Read `DIR/config.json`, refuse what ganymede cannot represent, and index the tensors.
    pub fn open(dir: &Path) -> Result<Self> {
        let cpath = dir.join("config.json");
        let text = std::fs::read_to_string(&cpath)
            .with_context(|| format!("cannot read {}", cpath.display()))?;
        let c: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", cpath.display()))?;
        let (arch, model, moe_layers, tied) = shape_of(&c, &cpath)?;
        let (files, tensors) = index_tensors(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            arch,
            model,
            moe_layers,
            tied,
            tensors,
            files,
        })
    }

    /// The run's settings this folder decides, as `section.key=value` overrides: the whole model
    /// section (`seq_len` aside: it is the job's) and `data.tokenizer` (the folder's
    /// `tokenizer.json`, whose vocabulary must fit `vocab_size`).
    pub fn overrides(&self) -> Result<Vec<String>> {
        let m = &self.model;
        let mut o = vec![
            format!("model.vocab_size={}", m.vocab_size),
            format!("model.hidden={}", m.hidden),
            format!("model.layers={}", m.layers),
            format!("model.heads={}", m.heads),
            format!("model.kv_heads={}", m.kv_heads),
            format!("model.head_dim={}", m.head_dim),
            format!("model.experts={}", m.experts),
            format!("model.top_k={}", m.top_k),
            format!("model.expert_hidden={}", m.expert_hidden),
            "model.shared_experts=0".into(),
            "model.shared_expert_hidden=0".into(),
            format!("model.dense_layers={}", m.dense_layers),
            format!("model.dense_hidden={}", m.dense_hidden),
            format!("model.rope_theta={:?}", m.rope_theta),
            format!("model.norm_eps={:?}", m.norm_eps),
            format!("model.norm_topk_prob={}", m.norm_topk_prob),
            format!("model.aux_loss_coef={:?}", m.aux_loss_coef),
            "model.router_bias_update=0.0".into(),
            format!("model.init_std={:?}", m.init_std),
        ];
        let tok = self.dir.join("tokenizer.json");
        if !tok.is_file() {
            bail!(
                "{}: no tokenizer.json (the run's tokenizer comes from the model folder)",
                self.dir.display()
            );
        }
        let t = ganymede_data::HfTokenizer::from_file(&tok)?;
        let n = ganymede_data::Tokenizer::vocab_size(&t);
        if n > m.vocab_size {
            bail!(
                "{}: its vocabulary has {n} ids, more than config.json's vocab_size = {}",
                tok.display(),
                m.vocab_size
            );
        }
        let abs = std::fs::canonicalize(&tok).unwrap_or(tok);
        o.push(format!("data.tokenizer={}", abs.display()));
        Ok(o)
    }

    /// Every parameter of `target` as pieces of this checkpoint, checking shapes, the upcycling
    /// rules, and that every tensor of the checkpoint is used (an unused one is something the
    /// model would silently drop).
    fn plan(&self, target: &ModelConfig) -> Result<BTreeMap<String, Vec<Piece>>> {
        let m = &self.model;
        let t = target;
        let fixed = [
            ("model.vocab_size", m.vocab_size, t.vocab_size),
            ("model.hidden", m.hidden, t.hidden),
            ("model.layers", m.layers, t.layers),
            ("model.heads", m.heads, t.heads),
            ("model.kv_heads", m.kv_heads, t.kv_heads),
            ("model.head_dim", m.head_dim, t.head_dim),
            ("model.shared_experts", 0, t.shared_experts),
        ];
        for (key, theirs, ours) in fixed {
            if theirs != ours {
                bail!(
                    "{key} = {ours}, but the checkpoint {} has {theirs}",
                    self.dir.display()
                );
            }
        }
        let mut plan = BTreeMap::new();
        let mut used = HashSet::new();
        for spec in ganymede_model::param_specs(target) {
            let pieces = self.pieces(target, &spec, &mut used)?;
            let n: usize = pieces.iter().map(Piece::len).sum();
            debug_assert_eq!(n, spec.numel(), "{}", spec.name);
            plan.insert(spec.name.clone(), pieces);
        }
        let mut unused: Vec<&String> = self
            .tensors
            .keys()
            .filter(|n| !used.contains(*n))
            .filter(|n| !(self.tied && n.as_str() == "lm_head.weight"))
            .collect();
        unused.sort();
        if let Some(n) = unused.first() {
            bail!(
                "{}: tensor {n} has no place in {:?} as config.json describes it",
                self.file_of(n).display(),
                self.arch
            );
        }
        Ok(plan)
    }

    fn file_of(&self, name: &str) -> &Path {
        &self.files[self.tensors[name].0].path
    }

    /// The checkpoint tensor `name` whole, checked to have `shape`.
    fn whole(&self, name: &str, shape: &[usize], used: &mut HashSet<String>) -> Result<Piece> {
        let Some((f, e)) = self.tensors.get(name) else {
            bail!("{}: no tensor {name}", self.dir.display());
        };
        if e.shape != shape {
            bail!(
                "{}: tensor {name} has shape {:?}, config.json implies {shape:?}",
                self.files[*f].path.display(),
                e.shape
            );
        }
        used.insert(name.to_string());
        Ok(Piece::Read {
            name: name.to_string(),
            lo: 0,
            hi: e.numel(),
            scale: 1.0,
        })
    }

    fn pieces(
        &self,
        t: &ModelConfig,
        spec: &ParamSpec,
        used: &mut HashSet<String>,
    ) -> Result<Vec<Piece>> {
        let name = spec.name.as_str();
        if name == "lm_head.weight" && self.tied {
            return Ok(vec![self.whole(
                "model.embed_tokens.weight",
                &spec.shape,
                used,
            )?]);
        }
        let Some(rest) = name.strip_prefix("model.layers.") else {
            return Ok(vec![self.whole(name, &spec.shape, used)?]);
        };
        let (l, what) = rest.split_once('.').expect("layer parameter names");
        let l: usize = l.parse().expect("layer index");
        if !what.starts_with("mlp.") {
            return Ok(vec![self.whole(name, &spec.shape, used)?]);
        }
        let p = format!("model.layers.{l}.mlp");
        let (ours, theirs) = (t.is_moe_layer(l), self.moe_layers[l]);
        match (ours, theirs) {
            (false, true) => bail!(
                "layer {l} is routed experts in {}, but model.dense_layers = {} makes it dense",
                self.dir.display(),
                t.dense_layers
            ),
            (false, false) => {
                if t.dense_hidden != self.model.dense_hidden {
                    bail!(
                        "model.dense_hidden = {}, but the checkpoint's dense layers have intermediate_size = {}",
                        t.dense_hidden,
                        self.model.dense_hidden
                    );
                }
                Ok(vec![self.whole(name, &spec.shape, used)?])
            }
            (true, true) => self.moe_pieces(t, spec, &p, used),
            (true, false) => self.upcycle_pieces(t, spec, &p, l, used),
        }
    }

    /// A routed layer from a routed layer: experts per expert or fused.
    fn moe_pieces(
        &self,
        t: &ModelConfig,
        spec: &ParamSpec,
        p: &str,
        used: &mut HashSet<String>,
    ) -> Result<Vec<Piece>> {
        let m = &self.model;
        for (key, theirs, ours) in [
            ("model.experts", m.experts, t.experts),
            ("model.expert_hidden", m.expert_hidden, t.expert_hidden),
        ] {
            if theirs != ours {
                bail!(
                    "{key} = {ours}, but the checkpoint {} has {theirs}",
                    self.dir.display()
                );
            }
        }
        let (e, f, h) = (t.experts, t.expert_hidden, t.hidden);
        let name = spec.name.as_str();
        if name.ends_with(".e_score_correction_bias") {
            return Ok(vec![Piece::Zero(e)]);
        }
        let Some(proj) = name.strip_prefix(&format!("{p}.experts.")) else {
            return Ok(vec![self.whole(name, &spec.shape, used)?]);
        };
        let fused = self
            .tensors
            .contains_key(&format!("{p}.experts.gate_up_proj"));
        if fused {
            // transformers 5: gate_up_proj [E, 2F, H] (gate rows first), down_proj [E, H, F].
            let gu = format!("{p}.experts.gate_up_proj");
            return Ok(match proj {
                "down_proj" => {
                    vec![self.whole(&format!("{p}.experts.down_proj"), &[e, h, f], used)?]
                }
                _ => {
                    let Piece::Read { name, .. } = self.whole(&gu, &[e, 2 * f, h], used)? else {
                        unreachable!()
                    };
                    let half = usize::from(proj == "up_proj");
                    (0..e)
                        .map(|j| {
                            let lo = (2 * j + half) * f * h;
                            Piece::Read {
                                name: name.clone(),
                                lo,
                                hi: lo + f * h,
                                scale: 1.0,
                            }
                        })
                        .collect()
                }
            });
        }
        let shape = if proj == "down_proj" { [h, f] } else { [f, h] };
        (0..e)
            .map(|j| self.whole(&format!("{p}.experts.{j}.{proj}.weight"), &shape, used))
            .collect()
    }

    /// A routed layer from a dense one (sparse upcycling).
    fn upcycle_pieces(
        &self,
        t: &ModelConfig,
        spec: &ParamSpec,
        p: &str,
        l: usize,
        used: &mut HashSet<String>,
    ) -> Result<Vec<Piece>> {
        let (e, f, h, fd) = (
            t.experts,
            t.expert_hidden,
            t.hidden,
            self.model.dense_hidden,
        );
        let s = upcycle_split(t, fd, l)?;
        let name = spec.name.as_str();
        if name.ends_with(".mlp.gate.weight") || name.ends_with(".e_score_correction_bias") {
            return Ok(vec![Piece::Zero(spec.numel())]);
        }
        let proj = name
            .strip_prefix(&format!("{p}.experts."))
            .expect("routed expert tensors");
        let dense = format!("{p}.{proj}.weight");
        let dshape = if proj == "down_proj" {
            [h, fd]
        } else {
            [fd, h]
        };
        self.whole(&dense, &dshape, used)?;
        let scale = upcycle_scale(t, s);
        let mut out = Vec::new();
        for j in 0..e {
            let c = j % s;
            if proj == "down_proj" {
                // Columns c·F..(c+1)·F of [H, F_d], row by row.
                for r in 0..h {
                    let lo = r * fd + c * f;
                    out.push(Piece::Read {
                        name: dense.clone(),
                        lo,
                        hi: lo + f,
                        scale,
                    });
                }
            } else {
                out.push(Piece::Read {
                    name: dense.clone(),
                    lo: c * f * h,
                    hi: (c + 1) * f * h,
                    scale: 1.0,
                });
            }
        }
        Ok(out)
    }

    /// Elements `lo..hi` of the parameter made of `pieces`.
    fn read(&self, pieces: &[Piece], lo: usize, hi: usize) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(hi - lo);
        let mut at = 0;
        for pc in pieces {
            let n = pc.len();
            let (a, b) = (lo.max(at), hi.min(at + n));
            if a < b {
                match pc {
                    Piece::Zero(_) => out.resize(out.len() + (b - a), 0.0),
                    Piece::Read {
                        name,
                        lo: plo,
                        scale,
                        ..
                    } => {
                        let (fi, e) = &self.tensors[name];
                        let start = out.len();
                        self.files[*fi].read_into(e, plo + a - at, plo + b - at, &mut out)?;
                        if *scale != 1.0 {
                            out[start..].iter_mut().for_each(|x| *x *= scale);
                        }
                    }
                }
            }
            at += n;
            if at >= hi {
                break;
            }
        }
        Ok(out)
    }
}

/// Slices per dense FFN when upcycling layer `l`: experts of `expert_hidden` cut from a dense
/// FFN of `fd`; a whole copy is 1.
fn upcycle_split(t: &ModelConfig, fd: usize, l: usize) -> Result<usize> {
    let f = t.expert_hidden;
    if f == 0 || !fd.is_multiple_of(f) {
        bail!(
            "upcycling layer {l}: model.expert_hidden = {f} does not divide the dense intermediate_size = {fd}"
        );
    }
    let s = fd / f;
    if s > 1 && !t.top_k.is_multiple_of(s) {
        bail!(
            "upcycling layer {l}: experts of {f} split each dense FFN of {fd} into {s}, so model.top_k = {} must be a multiple of {s} (each token then takes whole FFNs)",
            t.top_k
        );
    }
    if s > t.experts {
        bail!(
            "upcycling layer {l}: model.experts = {} is fewer than the {s} slices of one dense FFN",
            t.experts
        );
    }
    Ok(s)
}

/// The factor on each upcycled expert's down projection that makes the layer compute the dense
/// FFN exactly while the router is zero. A zero router gives every expert the same logit, ties
/// go to the lowest index, so every token takes experts `0..top_k`: with `s` slices per FFN
/// (expert `j` is slice `j mod s`) that is `top_k / s` whole FFNs, each expert weighted
/// `1/top_k` (`norm_topk_prob`) or `1/experts`. Whole copies under `norm_topk_prob` need no
/// factor (1, exactly); otherwise the factor is `s / (top_k · weight)`.
pub fn upcycle_scale(t: &ModelConfig, s: usize) -> f32 {
    let w = if t.norm_topk_prob {
        1.0 / t.top_k as f64
    } else {
        1.0 / t.experts as f64
    };
    let c = (t.top_k / s) as f64;
    if t.norm_topk_prob && s == 1 {
        1.0
    } else {
        (1.0 / (c * w)) as f32
    }
}

/// Put the checkpoint's weights into this rank's parameters (its shards under FSDP), one
/// tensor at a time: each rank reads only the elements it owns.
pub fn load_into(st: &mut RankState, hf: &HfCheckpoint, cfg: &JobConfig) -> Result<()> {
    let plan = hf.plan(&cfg.model)?;
    let specs = st.model.param_specs().to_vec();
    let be = st.be.clone();
    let groups = ganymede_parallel::fsdp::Groups::of(&st.mesh);
    let layout = st.shards.layout().cloned();
    for (i, s) in specs.iter().enumerate() {
        let part = match &layout {
            None => hf.read(&plan[&s.name], 0, s.numel())?,
            Some(layout) => {
                let r = layout.range(i, groups.get(layout.group[i]).rank());
                let o = layout.offset[i];
                let mut part = hf.read(&plan[&s.name], o + r.start, o + r.end)?;
                part.resize(layout.shard[i], 0.0);
                part
            }
        };
        // Whole parameters' bf16 weights are cast again from the new masters.
        be.write(st.shards.params_mut()[i].view_mut(), &part);
    }
    Ok(())
}

/// A config field as an integer.
fn int(c: &Value, key: &str, file: &Path) -> Result<usize> {
    c.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .with_context(|| {
            format!(
                "{}: {key} = {} (expected a non-negative integer)",
                file.display(),
                c.get(key).map_or("(missing)".into(), Value::to_string)
            )
        })
}

fn float_or(c: &Value, key: &str, default: f64, file: &Path) -> Result<f64> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .with_context(|| format!("{}: {key} = {v} (expected a number)", file.display())),
    }
}

/// The architecture, model shape, routed layers and embedding tying `config.json` describes,
/// refusing (one line: file, field, value) whatever ganymede cannot compute exactly.
fn shape_of(c: &Value, file: &Path) -> Result<(Arch, ModelConfig, Vec<bool>, bool)> {
    let refuse = |key: &str, v: &Value, why: &str| -> anyhow::Error {
        anyhow::anyhow!("{}: {key} = {v}: {why}", file.display())
    };
    let archs = c.get("architectures").cloned().unwrap_or(Value::Null);
    let arch = match archs.as_array().map(Vec::as_slice) {
        Some([a]) if a == "Qwen3MoeForCausalLM" => Arch::Qwen3Moe,
        Some([a]) if a == "Qwen3ForCausalLM" => Arch::Qwen3,
        _ => {
            return Err(refuse(
                "architectures",
                &archs,
                "ganymede imports Qwen3MoeForCausalLM and Qwen3ForCausalLM",
            ))
        }
    };
    // Fields whose any other value changes the computation.
    let is = |key: &str, ok: &dyn Fn(&Value) -> bool| -> Result<()> {
        match c.get(key) {
            Some(v) if !v.is_null() && !ok(v) => Err(refuse(
                key,
                v,
                "ganymede has no equivalent (it computes Qwen3 without it)",
            )),
            _ => Ok(()),
        }
    };
    is("hidden_act", &|v| v == "silu")?;
    is("attention_bias", &|v| v == false)?;
    is("mlp_bias", &|v| v == false)?;
    is("use_sliding_window", &|v| v == false)?;
    is("rope_scaling", &|_| false)?;
    is("quantization_config", &|_| false)?;
    is("attention_dropout", &|v| v.as_f64() == Some(0.0))?;
    is("layer_types", &|v| {
        v.as_array()
            .is_some_and(|a| a.iter().all(|x| x == "full_attention"))
    })?;
    is("rope_parameters", &|v| {
        v.get("rope_type").is_none_or(|t| t == "default")
            && v.as_object().is_some_and(|o| {
                o.keys().all(|k| {
                    ["rope_type", "rope_theta", "partial_rotary_factor"].contains(&k.as_str())
                })
            })
            && v.get("partial_rotary_factor")
                .is_none_or(|p| p.as_f64() == Some(1.0))
    })?;
    let layers = int(c, "num_hidden_layers", file)?;
    let hidden = int(c, "hidden_size", file)?;
    let heads = int(c, "num_attention_heads", file)?;
    let kv_heads = match c.get("num_key_value_heads") {
        None | Some(Value::Null) => heads,
        _ => int(c, "num_key_value_heads", file)?,
    };
    let head_dim = match c.get("head_dim") {
        None | Some(Value::Null) => hidden / heads.max(1),
        _ => int(c, "head_dim", file)?,
    };
    let intermediate = int(c, "intermediate_size", file)?;
    let rope_theta = match c.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .with_context(|| format!("{}: rope_parameters.rope_theta = {v}", file.display()))?,
        None => float_or(c, "rope_theta", 10_000.0, file)?,
    };
    let tied = match c.get("tie_word_embeddings") {
        None | Some(Value::Null) => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| refuse("tie_word_embeddings", v, "expected true or false"))?,
    };
    let mut m = ModelConfig {
        vocab_size: int(c, "vocab_size", file)?,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        experts: 1,
        top_k: 1,
        expert_hidden: intermediate,
        shared_experts: 0,
        shared_expert_hidden: 0,
        dense_layers: layers,
        dense_hidden: intermediate,
        // The job's, not the checkpoint's: replaced by the preset's or `--set`'s.
        seq_len: 1,
        rope_theta,
        norm_eps: float_or(c, "rms_norm_eps", 1e-6, file)?,
        norm_topk_prob: true,
        aux_loss_coef: float_or(c, "router_aux_loss_coef", 0.001, file)?,
        router_bias_update: 0.0,
        init_std: float_or(c, "initializer_range", 0.02, file)?,
    };
    let mut moe = vec![false; layers];
    if arch == Arch::Qwen3Moe {
        // transformers 5 writes num_local_experts, earlier versions num_experts.
        let experts = match c.get("num_local_experts") {
            Some(v) if !v.is_null() => int(c, "num_local_experts", file)?,
            _ => int(c, "num_experts", file)?,
        };
        let step = match c.get("decoder_sparse_step") {
            None | Some(Value::Null) => 1,
            _ => int(c, "decoder_sparse_step", file)?,
        };
        let only: Vec<usize> = match c.get("mlp_only_layers") {
            None | Some(Value::Null) => vec![],
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|_| refuse("mlp_only_layers", v, "expected a list of layer indices"))?,
        };
        // transformers' rule for a routed layer.
        for (l, x) in moe.iter_mut().enumerate() {
            *x = !only.contains(&l) && experts > 0 && step > 0 && (l + 1) % step == 0;
        }
        let dense = moe.iter().take_while(|x| !**x).count();
        if moe[dense..].iter().any(|x| !x) {
            let v = |k: &str| c.get(k).cloned().unwrap_or(Value::Null);
            bail!(
                "{}: mlp_only_layers = {}, decoder_sparse_step = {}: dense layers after routed ones; ganymede's dense layers are the first model.dense_layers only",
                file.display(),
                v("mlp_only_layers"),
                v("decoder_sparse_step")
            );
        }
        if dense < layers {
            let norm = match c.get("norm_topk_prob") {
                None | Some(Value::Null) => false,
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| refuse("norm_topk_prob", v, "expected true or false"))?,
            };
            m.experts = experts;
            m.top_k = int(c, "num_experts_per_tok", file)?;
            m.expert_hidden = int(c, "moe_intermediate_size", file)?;
            m.norm_topk_prob = norm;
            m.dense_layers = dense;
            if dense == 0 {
                m.dense_hidden = 0;
            }
        }
    }
    m.validate()
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    Ok((arch, m, moe, tied))
}

/// The folder's safetensors files (one, or the shards its index names) with their headers read,
/// and which file holds each tensor.
#[allow(clippy::type_complexity)]
fn index_tensors(dir: &Path) -> Result<(Vec<StFile>, HashMap<String, (usize, Entry)>)> {
    let index = dir.join(INDEX_FILE);
    let names: Vec<String> = if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
            bail!("{}: no weight_map", index.display());
        };
        let mut files: Vec<String> = map
            .values()
            .map(|f| f.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .with_context(|| {
                format!("{}: a weight_map entry is not a file name", index.display())
            })?;
        files.sort();
        files.dedup();
        for f in &files {
            if f.contains('/') || !dir.join(f).is_file() {
                bail!(
                    "{}: names shard {f}, which is missing from {}",
                    index.display(),
                    dir.display()
                );
            }
        }
        files
    } else if dir.join(SINGLE_FILE).is_file() {
        vec![SINGLE_FILE.to_string()]
    } else {
        bail!("{}: neither {SINGLE_FILE} nor {INDEX_FILE}", dir.display());
    };
    let mut files = Vec::new();
    let mut tensors = HashMap::new();
    for (i, n) in names.iter().enumerate() {
        let f = StFile::open(&dir.join(n))?;
        for (name, e) in &f.tensors {
            if let Some((j, _)) = tensors.insert(name.clone(), (i, e.clone())) {
                bail!(
                    "{}: tensor {name} is in both {} and {n}",
                    dir.display(),
                    names[j]
                );
            }
        }
        files.push(f);
    }
    Ok((files, tensors))
}

/// The `--set` overrides for `train --init-from hf:DIR`, first among the user's (theirs win).
pub fn init_overrides(dir: &Path, user: &[String]) -> Result<Vec<String>> {
    let hf = HfCheckpoint::open(dir)?;
    let mut o = hf.overrides()?;
    o.extend(user.iter().cloned());
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(f: &dyn Fn(&mut ModelConfig)) -> ModelConfig {
        let mut m = ganymede_config::preset("tiny").unwrap().model;
        f(&mut m);
        m
    }

    #[test]
    fn upcycle_scale_makes_the_zero_router_layer_dense() {
        // Whole copies, renormalised: exactly 1, no rounding at all.
        let t = cfg(&|m| {
            m.experts = 8;
            m.top_k = 2;
            m.norm_topk_prob = true;
        });
        assert_eq!(upcycle_scale(&t, 1), 1.0);
        // Not renormalised: 2 experts weighted 1/8 each must sum to one FFN.
        let t = cfg(&|m| m.norm_topk_prob = false);
        assert_eq!(
            upcycle_scale(&t, 1) as f64 * t.top_k as f64 / t.experts as f64,
            1.0
        );
        // Split in 2 with top-2 renormalised: one whole FFN weighted 1/2 per half.
        let t = cfg(&|m| {
            m.top_k = 2;
            m.norm_topk_prob = true;
        });
        assert_eq!(upcycle_scale(&t, 2), 2.0);
        // A split top_k cannot cover evenly is refused, naming the keys.
        let t = cfg(&|m| {
            m.top_k = 3;
            m.expert_hidden = 32;
        });
        let e = upcycle_split(&t, 64, 0).unwrap_err().to_string();
        assert!(e.contains("model.top_k = 3"), "{e}");
        let e = upcycle_split(&t, 48, 1).unwrap_err().to_string();
        assert!(e.contains("expert_hidden = 32") && e.contains("48"), "{e}");
    }
}

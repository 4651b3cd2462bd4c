//! Parameter accounting, tensor by tensor, exactly as the Qwen3-MoE model is built.
//!
//! The model: embedding `[V,H]`, untied LM head `[V,H]`, final norm `[H]`; per layer an input
//! norm and a post-attention norm `[H]`, `q [heads*head_dim, H]`, `k`/`v [kv_heads*head_dim, H]`,
//! `o [H, heads*head_dim]`, `q_norm`/`k_norm [head_dim]`; MoE layers a router `[E,H]` (no bias),
//! `E` routed experts of `gate`/`up [F,H]` and `down [H,F]`, and shared experts of the same form
//! with hidden `shared_hidden()`; the first `dense_layers` layers a dense SwiGLU instead.
//!
//! Muon handles every 2-D matrix except the router, the embedding and the LM head (each expert
//! matrix separately); AdamW handles the rest.

use ganymede_config::{model_tensors, ModelConfig, Role};
use serde::Serialize;

/// Which part of the model a tensor belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    Embedding,
    Attention,
    Norms,
    Router,
    RoutedExperts,
    SharedExperts,
    DenseFfn,
    LmHead,
}

/// Which optimizer updates a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Handler {
    Muon,
    Adamw,
}

/// One kind of tensor: `count` tensors of shape `[rows, cols]` (`cols = 1` for vectors).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorKind {
    pub name: &'static str,
    pub group: Group,
    pub rows: u64,
    pub cols: u64,
    /// How many such tensors the model holds.
    pub count: u64,
    /// How many of them one token uses (routed experts: `top_k` per MoE layer).
    pub active_count: u64,
    /// Whether it lives inside a transformer layer (gathered per layer by FSDP).
    pub in_layer: bool,
    /// Whether it is a routed-expert tensor (sharded by expert under EP).
    pub expert: bool,
}

impl TensorKind {
    pub fn numel(&self) -> u64 {
        self.rows * self.cols
    }
    pub fn total(&self) -> u64 {
        self.numel() * self.count
    }
    pub fn active(&self) -> u64 {
        self.numel() * self.active_count
    }
    pub fn is_matrix(&self) -> bool {
        self.cols > 1 && self.rows > 1
    }
    /// Handed to the model in bf16 under bf16 compute (`ganymede_model::Model::bf16_weight`):
    /// what only bf16-input GEMMs and the embedding's lookup read, everything but the norms and
    /// the router.
    pub fn bf16_weight(&self) -> bool {
        !matches!(self.group, Group::Norms | Group::Router)
    }
    /// Muon for 2-D matrices other than the router, embedding and LM head.
    pub fn handler(&self) -> Handler {
        match self.group {
            Group::Embedding | Group::LmHead | Group::Router => Handler::Adamw,
            _ if self.is_matrix() => Handler::Muon,
            _ => Handler::Adamw,
        }
    }
}

/// Every tensor of the model, grouped by kind: the model's one table
/// ([`ganymede_config::model_tensors`]) with each layer's copies counted together. The router's
/// selection bias, a buffer no optimizer updates, is left out.
pub fn tensors(m: &ModelConfig) -> Vec<TensorKind> {
    let mut out: Vec<TensorKind> = Vec::new();
    for t in model_tensors(m) {
        let group = match t.role {
            Role::Embedding => Group::Embedding,
            Role::LmHead => Group::LmHead,
            Role::Norm => Group::Norms,
            Role::Attention => Group::Attention,
            Role::Router => Group::Router,
            Role::RoutedExperts => Group::RoutedExperts,
            Role::SharedExperts => Group::SharedExperts,
            Role::DenseFfn => Group::DenseFfn,
            Role::RouterBias => continue,
        };
        // A stack `[n, rows, cols]` is n matrices; a vector is one column.
        let s: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
        let (n, rows, cols) = match s[..] {
            [r] => (1, r, 1),
            [r, c] => (1, r, c),
            [n, r, c] => (n, r, c),
            _ => unreachable!("{}: rank-{} tensor", t.name, s.len()),
        };
        // One token uses `top_k` of a layer's routed experts, every other tensor whole.
        let active = if t.role == Role::RoutedExperts {
            m.top_k as u64
        } else {
            n
        };
        match out.iter_mut().find(|k| k.name == t.kind) {
            Some(k) => {
                k.count += n;
                k.active_count += active;
            }
            None => out.push(TensorKind {
                name: t.kind,
                group,
                rows,
                cols,
                count: n,
                active_count: active,
                in_layer: t.layer.is_some(),
                expert: t.role == Role::RoutedExperts,
            }),
        }
    }
    out
}

/// Parameter counts by group (elements, not bytes).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GroupCounts {
    pub embedding: u64,
    pub attention: u64,
    pub norms: u64,
    pub router: u64,
    pub routed_experts: u64,
    pub shared_experts: u64,
    pub dense_ffn: u64,
    pub lm_head: u64,
}

impl GroupCounts {
    fn add(&mut self, g: Group, n: u64) {
        let slot = match g {
            Group::Embedding => &mut self.embedding,
            Group::Attention => &mut self.attention,
            Group::Norms => &mut self.norms,
            Group::Router => &mut self.router,
            Group::RoutedExperts => &mut self.routed_experts,
            Group::SharedExperts => &mut self.shared_experts,
            Group::DenseFfn => &mut self.dense_ffn,
            Group::LmHead => &mut self.lm_head,
        };
        *slot += n;
    }
}

/// The model's parameters, counted every way the planner needs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamCounts {
    pub total: u64,
    /// Parameters one token touches: routed experts count `top_k` of `experts`; the embedding
    /// counts whole (the write-up's 32.8B includes it).
    pub active: u64,
    /// Active parameters that take part in matrix multiplies: `active` less the embedding
    /// (a lookup). This is the N of the 6·N FLOPs per token.
    pub active_matmul: u64,
    pub by_group: GroupCounts,
    pub active_by_group: GroupCounts,
    /// Parameters Muon updates, and the share of the total.
    pub muon: u64,
    pub adamw: u64,
    pub muon_share: f64,
    /// Number of 2-D matrices Muon orthogonalises (each expert matrix separately).
    pub muon_matrices: u64,
    /// Parameters inside one layer, averaged over layers: dense part (gathered over all ranks)
    /// and routed experts (sharded by expert under EP).
    pub layer_dense_avg: f64,
    pub layer_experts_avg: f64,
    /// Parameters outside the layers (embedding, LM head, final norm).
    pub outside_layers: u64,
}

pub fn count(m: &ModelConfig) -> ParamCounts {
    let ts = tensors(m);
    let mut by_group = GroupCounts::default();
    let mut active_by_group = GroupCounts::default();
    let (mut total, mut active, mut muon, mut muon_matrices) = (0, 0, 0, 0);
    let (mut layer_dense, mut layer_experts, mut outside) = (0u64, 0u64, 0u64);
    for t in &ts {
        total += t.total();
        active += t.active();
        by_group.add(t.group, t.total());
        active_by_group.add(t.group, t.active());
        if t.handler() == Handler::Muon {
            muon += t.total();
            muon_matrices += t.count;
        }
        match (t.in_layer, t.expert) {
            (false, _) => outside += t.total(),
            (true, true) => layer_experts += t.total(),
            (true, false) => layer_dense += t.total(),
        }
    }
    let l = m.layers.max(1) as f64;
    ParamCounts {
        total,
        active,
        active_matmul: active - by_group.embedding,
        by_group,
        active_by_group,
        muon,
        adamw: total - muon,
        muon_share: muon as f64 / total as f64,
        muon_matrices,
        layer_dense_avg: layer_dense as f64 / l,
        layer_experts_avg: layer_experts as f64 / l,
        outside_layers: outside,
    }
}

/// Parameters of one layer, by part, for each kind of layer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerShape {
    pub attention: u64,
    /// Input, post-attention, q and k norms.
    pub norms: u64,
    pub router: u64,
    /// One routed expert (gate, up, down).
    pub expert: u64,
    pub experts: u64,
    pub top_k: u64,
    pub shared: u64,
    pub dense_ffn: u64,
    pub moe_layers: u64,
    pub dense_layers: u64,
}

impl LayerShape {
    pub fn new(m: &ModelConfig) -> Self {
        let h = m.hidden as u64;
        let moe_layers = (m.layers - m.dense_layers.min(m.layers)) as u64;
        LayerShape {
            attention: 2 * m.q_dim() as u64 * h + 2 * m.kv_dim() as u64 * h,
            norms: 2 * h + 2 * m.head_dim as u64,
            router: m.experts as u64 * h,
            expert: 3 * m.expert_hidden as u64 * h,
            experts: m.experts as u64,
            top_k: m.top_k as u64,
            shared: m.shared_experts as u64 * 3 * m.shared_hidden() as u64 * h,
            dense_ffn: 3 * m.dense_hidden as u64 * h,
            moe_layers,
            dense_layers: m.layers as u64 - moe_layers,
        }
    }
    /// Parameters of an MoE layer gathered over every rank (all but the routed experts).
    pub fn moe_dense_part(&self) -> u64 {
        self.attention + self.norms + self.router + self.shared
    }
    pub fn moe_experts_part(&self) -> u64 {
        self.experts * self.expert
    }
    pub fn dense_layer(&self) -> u64 {
        self.attention + self.norms + self.dense_ffn
    }
    /// Parameters one rank holds unsharded while computing a layer, with `ep`-way expert
    /// parallelism (the largest layer kind).
    pub fn max_local_layer(&self, ep: u64) -> u64 {
        let moe = if self.moe_layers > 0 {
            self.moe_dense_part() + self.moe_experts_part() / ep
        } else {
            0
        };
        let dense = if self.dense_layers > 0 {
            self.dense_layer()
        } else {
            0
        };
        moe.max(dense)
    }
    fn layers(&self) -> f64 {
        (self.moe_layers + self.dense_layers).max(1) as f64
    }
    /// Averages over layers: dense part gathered over all ranks, expert part over the
    /// expert-FSDP group, and the matmul parameters one token uses.
    pub fn avg_dense_part(&self) -> f64 {
        (self.moe_layers * self.moe_dense_part() + self.dense_layers * self.dense_layer()) as f64
            / self.layers()
    }
    pub fn avg_experts_part(&self) -> f64 {
        (self.moe_layers * self.moe_experts_part()) as f64 / self.layers()
    }
    pub fn avg_active_matmul(&self) -> f64 {
        let moe = self.attention + self.router + self.top_k * self.expert + self.shared;
        let dense = self.attention + self.dense_ffn;
        (self.moe_layers * moe + self.dense_layers * dense) as f64 / self.layers()
    }
}

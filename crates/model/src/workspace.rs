//! The activation memory of a step, allocated once through the backend (llm.c's single
//! activation plan): the residual stream at every block boundary, the internals of one block
//! (`AcMode::Full`: recomputed in backward) or of every block (`AcMode::None`), one set of
//! gradient scratch, and the head (final norm, logits). [`activation_bytes`] states the sizes.
//!
//! Under bf16 compute (`Model::bf16`) attention runs on bf16 tensors, as autocast's SDPA does:
//! the saved `v`, `qr`, `kr` and `att` are bf16 (half the bytes), the f32 results of v's GEMM
//! and the q/k norms pass through the gradient scratch's `dv`, `dqr`, `dkr` on their way there,
//! and [`AttnBf16Grads`] holds attention's bf16 output gradient and input gradients.
//!
//! With bf16 boundaries (`activation_checkpoint.boundary_dtype`, by default the compute dtype)
//! the residual stream between blocks, its offload pool slots and host copies are bf16, and
//! one f32 working copy `res_f32` is added (see [`crate::offload`]).

use crate::offload::Boundaries;
use crate::step::Uploaded;
use crate::{MlpIdx, Model};
use ganymede_config::{AcMode, ModelConfig};
use ganymede_core::{Backend, Category, DType, Tensor};

/// Routing of one MoE layer: u32 tensors the router and `moe_dispatch` write on the device,
/// and the one thing the host reads back, the per-expert counts (they size the expert GEMMs
/// and the expert-parallel all-to-all).
pub(crate) struct Routing {
    /// `[N, k]` chosen experts, best first.
    pub idx: Tensor,
    /// `[N*k]` token of each dispatched row (rows grouped by expert, tokens in order).
    pub src: Tensor,
    /// `[N, k]` dispatched row of each (token, choice).
    pub pos: Tensor,
    /// `[E]` rows per expert.
    pub counts: Tensor,
    /// `[E+1]` first dispatched row of each expert.
    pub offsets: Tensor,
    /// Each token chunk's per-expert counts and the offsets derived from them, where they are
    /// read back after its dispatch (`training.moe_chunk_tokens`; one chunk by default).
    pub chunks: Vec<ChunkRoute>,
}

/// The host's copy of one token chunk's dispatch: rows per expert and each expert's first row.
#[derive(Clone, Debug, Default)]
pub(crate) struct ChunkRoute {
    pub counts: Vec<usize>,
    pub offsets: Vec<usize>,
}

/// Routed-expert internals: `[N, E]` probabilities, `[N, k]` weights, and per dispatched row
/// of one token chunk (`C·k` rows, C = [`Model::moe_rows`]) the gathered input, gate, up,
/// SwiGLU output and expert output.
pub(crate) struct MoeActs {
    pub probs: Tensor,
    pub rw: Tensor,
    pub xe: Tensor,
    pub g: Tensor,
    pub u: Tensor,
    pub a: Tensor,
    pub ye: Tensor,
    pub r: Routing,
}

/// Which row of the step's per-layer routing sums a MoE layer writes.
pub(crate) fn moe_slot(cfg: &ModelConfig, layer: usize) -> Option<usize> {
    cfg.is_moe_layer(layer)
        .then(|| (0..layer).filter(|&l| cfg.is_moe_layer(l)).count())
}

/// A SwiGLU every token runs (dense layer, or the stacked shared experts): `[N, width]`.
pub(crate) struct FfnActs {
    pub g: Tensor,
    pub u: Tensor,
    pub a: Tensor,
}

/// What one block keeps for its backward.
pub(crate) struct BlockActs {
    pub xn1: Tensor,
    pub rstd1: Tensor,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub qr: Tensor,
    pub kr: Tensor,
    pub rstdq: Tensor,
    pub rstdk: Tensor,
    pub att: Tensor,
    pub lse: Tensor,
    pub xmid: Tensor,
    pub xn2: Tensor,
    pub rstd2: Tensor,
    pub moe: Option<MoeActs>,
    pub ffn: Option<FfnActs>,
}

/// Attention's bf16 gradients under bf16 compute: the output's (`[N, Q]`, rounded from the
/// o-projection's f32 GEMM) and the inputs' (`[N, Q]`, `[N, K]`, `[N, K]`, written by the
/// attention backward in bf16, as its bf16 kernels do).
pub(crate) struct AttnBf16Grads {
    pub datt: Tensor,
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
}

/// Gradient scratch, one set shared by all blocks.
pub(crate) struct GradScratch {
    /// Gradient of the residual stream at the current block boundary.
    pub dres: Tensor,
    /// Gradient of a norm's output.
    pub dxn: Tensor,
    /// The attention output's gradient, then (once attention's backward has read it) q's, before
    /// its norm and RoPE: one `[N, Q]` buffer for both.
    pub datt: Tensor,
    pub dqr: Tensor,
    pub dkr: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    /// Under bf16 compute only.
    pub attn16: Option<AttnBf16Grads>,
    /// `[N, E]` router logits (forward) and their gradient (backward).
    pub drl: Option<Tensor>,
    pub drw: Option<Tensor>,
    pub dye: Option<Tensor>,
    pub da: Option<Tensor>,
    pub dg: Option<Tensor>,
    pub du: Option<Tensor>,
    pub dxe: Option<Tensor>,
    pub dfa: Option<Tensor>,
    pub dfg: Option<Tensor>,
    pub dfu: Option<Tensor>,
}

pub(crate) struct HeadActs {
    pub xf: Tensor,
    pub rstd: Tensor,
    pub logits: Tensor,
    pub lse: Tensor,
    /// The loss sum, one f64 (`Category::Buffers`, outside the activation plan): the kernels
    /// add into it and the step reads it once, at its end.
    pub loss: Tensor,
    /// The batch's input and target token ids (u32), written once at the step's start.
    pub ids: Tensor,
    pub targets: Tensor,
    /// The input ids grouped by id (`ganymede_core::embedding_segments`), u32 `[3N + 1]`: order
    /// at `0..N`, segment starts at `N..2N + 1`, segment ids at `2N + 1..3N + 1`, the first
    /// `segments` (+1) of each used. Written with the ids, in one upload, by a step that runs
    /// backward: the embedding's backward then needs no read of the ids.
    pub id_groups: Tensor,
    pub segments: usize,
    /// What the last upload ([`crate::step::upload_tokens`]) put in `ids`, `targets`,
    /// `id_groups` and `docs`: none before the first.
    pub uploaded: Option<Uploaded>,
    /// Each input's document start under document masking (u32 `[N]`, `Category::Buffers`,
    /// outside the activation plan): made by the first step that brings them.
    pub docs: Option<Tensor>,
}

/// The step's routing statistics (f64, `Category::Buffers`, outside the activation plan, like
/// the loss), per MoE layer and expert: the sum over tokens of the router probability, and the
/// routed rows, which the dispatches add up on the device. The counts are summed over the
/// global batch after the forward (the auxiliary loss's gradient reads them there); both are
/// read once, at the step's end.
pub(crate) struct RouteStats {
    /// `[moe layers, E]`.
    pub psum: Tensor,
    /// `[moe layers, E]`.
    pub counts: Tensor,
}

/// All activation memory of a step, allocated once for (model, batch, seq, mode).
pub struct Workspace {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) mode: AcMode,
    /// Residual stream at block boundaries: boundary 0 the embeddings, `l + 1` block `l`'s
    /// output; some of them in host memory (see [`crate::offload`]).
    pub(crate) res: Boundaries,
    /// One set per layer (`None`) or one shared set (`Full`).
    pub(crate) blocks: Vec<BlockActs>,
    pub(crate) grads: GradScratch,
    pub(crate) head: HeadActs,
    /// `None` without MoE layers.
    pub(crate) route: Option<RouteStats>,
}

/// Width of the every-token SwiGLU of layer `l` (0 if none).
fn ffn_width(cfg: &ModelConfig, l: usize) -> usize {
    if !cfg.is_moe_layer(l) {
        cfg.dense_hidden
    } else {
        cfg.shared_experts * cfg.shared_hidden()
    }
}

/// The precisions a workspace is planned at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Precision {
    /// bf16 compute (`training.compute_dtype = "bf16"`): attention's bf16 tensors.
    pub bf16: bool,
    /// bf16 boundaries ([`Model::bf16_boundaries`]).
    pub bf16_boundaries: bool,
    /// Under bf16 compute, the rows only bf16-input GEMMs read are bf16 (`xe`, `a`, `dye`,
    /// `dg`, `du` of the routed experts; `fa`, `dfg`, `dfu` of the SwiGLU FFNs), unless
    /// [`Model::with_f32_rows`].
    pub bf16_rows: bool,
    /// Under bf16 compute, the GEMM outputs only element-wise ops read are bf16 (`g`, `u`,
    /// `ye`, `da` of the routed experts; `fg`, `fu`, `dfa` of the SwiGLU FFNs; the head's
    /// `logits`, which the cross-entropy reads in f32 and overwrites with their gradient, the
    /// A operand of the head's two backward GEMMs), unless [`Model::with_f32_rows`] or
    /// [`Model::with_f32_outputs`].
    pub bf16_outputs: bool,
}

impl Precision {
    /// f32 compute, f32 boundaries.
    pub const F32: Precision = Precision {
        bf16: false,
        bf16_boundaries: false,
        bf16_rows: false,
        bf16_outputs: false,
    };
    /// bf16 compute with its default (`auto`) boundaries, bf16, and bf16 rows and outputs.
    pub const BF16: Precision = Precision {
        bf16: true,
        bf16_boundaries: true,
        bf16_rows: true,
        bf16_outputs: true,
    };
    /// The model's.
    pub fn of(model: &Model) -> Precision {
        Precision {
            bf16: model.bf16,
            bf16_boundaries: model.bf16_boundaries(),
            bf16_rows: model.bf16 && !model.f32_rows,
            bf16_outputs: model.bf16 && !model.f32_rows && !model.f32_outputs,
        }
    }
}

/// Element counts of the workspace's tensors, in allocation order: (what, elements). The one
/// place sizes are decided; [`Workspace::new`] allocates exactly these. The boundaries come
/// first: `res` on the device, `res_slot` the device slots offloaded ones rotate through,
/// `res_f32` the f32 working copy of bf16 boundaries, `res_host` the offloaded ones' pinned
/// host copies (`n_off` of them, see [`crate::offload`]). The head holds `head_rows` rows of
/// logits ([`Model::head_rows`]), and a MoE layer's expert rows are those of `moe_rows` tokens
/// ([`Model::moe_rows`]; the byte counts below hold all `n`, no chunks).
fn plan(
    cfg: &ModelConfig,
    n: usize,
    mode: AcMode,
    n_off: usize,
    prec: Precision,
    (head_rows, moe_rows): (usize, usize),
) -> Vec<(&'static str, usize)> {
    let bf16 = prec.bf16;
    let (h, qd, kd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim());
    let (e, k, f) = (cfg.experts, cfg.top_k, cfg.expert_hidden);
    let c = moe_rows;
    let any_moe = cfg.layers > cfg.dense_layers;
    let max_ffn = (0..cfg.layers)
        .map(|l| ffn_width(cfg, l))
        .max()
        .unwrap_or(0);
    let mut p = vec![];
    let n_off = n_off.min(cfg.layers);
    for _ in n_off..=cfg.layers {
        p.push(("res", n * h));
    }
    for _ in 0..n_off.min(2) {
        p.push(("res_slot", n * h));
    }
    if prec.bf16_boundaries {
        p.push(("res_f32", n * h));
    }
    for _ in 0..n_off {
        p.push(("res_host", n * h));
    }
    // A set per layer, or one set sized for every layer kind.
    let sets: Vec<(bool, usize)> = match mode {
        AcMode::None => (0..cfg.layers)
            .map(|l| (cfg.is_moe_layer(l), ffn_width(cfg, l)))
            .collect(),
        AcMode::Full => vec![(any_moe, max_ffn)],
    };
    for (moe, fw) in sets {
        p.extend([
            ("xn1", n * h),
            ("rstd1", n),
            ("q", n * qd),
            ("k", n * kd),
            ("v", n * kd),
            ("qr", n * qd),
            ("kr", n * kd),
            ("rstdq", n * cfg.heads),
            ("rstdk", n * cfg.kv_heads),
            ("att", n * qd),
            ("lse", n * cfg.heads),
            ("xmid", n * h),
            ("xn2", n * h),
            ("rstd2", n),
        ]);
        if moe {
            p.extend([
                ("probs", n * e),
                ("rw", n * k),
                ("xe", c * k * h),
                ("g", c * k * f),
                ("u", c * k * f),
                ("a", c * k * f),
                ("ye", c * k * h),
                ("idx", n * k),
                ("src", n * k),
                ("pos", n * k),
                ("counts", e),
                ("offsets", e + 1),
            ]);
        }
        if fw > 0 {
            p.extend([("fg", n * fw), ("fu", n * fw), ("fa", n * fw)]);
        }
    }
    p.extend([
        ("dres", n * h),
        ("dxn", n * h),
        ("datt", n * qd),
        ("dqr", n * qd),
        ("dkr", n * kd),
        ("dk", n * kd),
        ("dv", n * kd),
    ]);
    if bf16 {
        p.extend([
            ("datt16", n * qd),
            ("dqr16", n * qd),
            ("dkr16", n * kd),
            ("dv16", n * kd),
        ]);
    }
    if any_moe {
        p.extend([
            ("drl", n * e),
            ("drw", n * k),
            ("dye", c * k * h),
            ("da", c * k * f),
            ("dg", c * k * f),
            ("du", c * k * f),
            ("dxe", c * k * h),
        ]);
    }
    if max_ffn > 0 {
        p.extend([
            ("dfa", n * max_ffn),
            ("dfg", n * max_ffn),
            ("dfu", n * max_ffn),
        ]);
    }
    p.extend([
        ("xf", n * h),
        ("rstdf", n),
        ("logits", head_rows * cfg.vocab_size),
        ("lse_ce", n),
        ("ids", n),
        ("targets", n),
        ("id_groups", 3 * n + 1),
    ]);
    p
}

/// The dtype of a plan entry: u32 for index tensors (routing, token ids; 4 bytes an element
/// like f32), bf16 for attention's inputs, output and gradients under bf16 compute, for bf16
/// boundaries and for bf16 rows, else f32.
fn dtype_of(what: &str, prec: Precision) -> DType {
    match what {
        "idx" | "src" | "pos" | "counts" | "offsets" | "ids" | "targets" | "id_groups" => {
            DType::U32
        }
        "v" | "qr" | "kr" | "att" | "datt16" | "dqr16" | "dkr16" | "dv16" if prec.bf16 => {
            DType::BF16
        }
        "res" | "res_slot" | "res_host" if prec.bf16_boundaries => DType::BF16,
        "xe" | "a" | "dye" | "dg" | "du" | "fa" | "dfg" | "dfu" if prec.bf16_rows => DType::BF16,
        "g" | "u" | "ye" | "da" | "fg" | "fu" | "dfa" | "logits" if prec.bf16_outputs => {
            DType::BF16
        }
        _ => DType::F32,
    }
}

/// Bytes of the plan's entries (f32 and u32: 4 an element, bf16: 2).
fn plan_bytes<'a>(p: impl Iterator<Item = &'a (&'static str, usize)>, prec: Precision) -> u64 {
    p.map(|(w, n)| {
        *n as u64
            * if dtype_of(w, prec) == DType::BF16 {
                2
            } else {
                4
            }
    })
    .sum()
}

/// Bytes of `Category::Activations` a [`Workspace`] allocates in f32 (its float tensors take
/// twice that on the f64 checking backend; its u32 index tensors do not). With N = batch·seq
/// tokens, H hidden, Q = heads·head_dim, K = kv_heads·head_dim, E experts, k top-k, F expert
/// hidden, W_l the width of layer l's every-token SwiGLU (dense hidden, or shared experts ×
/// shared hidden; 0 if none), V vocab:
///
/// ```text
/// 4 · N · [ (L+1)·H                   residual stream at block boundaries (f32 boundaries)
///         + Σ_sets (3H + 3Q + 3K + 2·heads + kv_heads + 2)        attention-side internals
///                  + [moe] (E + 4k + 2kH + 3kF) + 3·W_set   MLP internals, routing indices
///         + 2H + 2Q + 3K + [any MoE](E + k + 2kH + 3kF) + 3·max W  gradient scratch
///         + H + V + 7 ]               final norm, logits, token ids/targets, ids' grouping
/// + 4 · (2E + 1) per MoE set                        per-expert counts and offsets
/// + 4                                               the grouping's last segment end
/// ```
///
/// where the sets are every layer (`AcMode::None`, each with its own kind) or one set sized
/// for all layers (`AcMode::Full`: an MoE set if any layer is MoE, `W_set = max W`).
/// [`activation_bytes_at`] states the other precisions'.
pub fn activation_bytes(cfg: &ModelConfig, batch: usize, seq: usize, mode: AcMode) -> u64 {
    activation_bytes_at(cfg, batch, seq, mode, Precision::F32)
}

/// [`activation_bytes`] under bf16 compute with its default bf16 boundaries
/// ([`Precision::BF16`]).
pub fn activation_bytes_bf16(cfg: &ModelConfig, batch: usize, seq: usize, mode: AcMode) -> u64 {
    activation_bytes_at(cfg, batch, seq, mode, Precision::BF16)
}

/// [`activation_bytes`] at `prec`. bf16 compute: each set's `v`, `qr`, `kr` and `att` in bf16
/// (`2·N·(2Q + 2K)` bytes less per set), and the gradient scratch's bf16 attention gradients
/// (`2·N·(2Q + 2K)` more, once). bf16 rows: each MoE set's `xe` and `a` (`2·C·k·(H + F)` less,
/// C the MoE chunk's tokens) and each FFN set's `fa` (`2·N·W` less); in the gradient scratch
/// `dye`, `dg`, `du` (`2·C·k·(H + 2F)` less) and `dfg`, `dfu` (`4·N·max W` less). bf16
/// outputs: each MoE set's `g`, `u`, `ye` (`2·C·k·(H + 2F)` less) and FFN set's `fg`, `fu`
/// (`4·N·W` less); in the scratch `da` (`2·C·k·F` less) and `dfa` (`2·N·max W` less). bf16 boundaries: the
/// L + 1 boundaries take `2·N·(L+1)·H`, plus `4·N·H` for their f32 working copy.
pub fn activation_bytes_at(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    mode: AcMode,
    prec: Precision,
) -> u64 {
    let n = batch * seq;
    plan_bytes(plan(cfg, n, mode, 0, prec, (n, n)).iter(), prec)
}

/// [`activation_bytes_at`] split by memory with the first `offloaded` block inputs in host
/// memory (`AcMode::Full` only): (device bytes, host bytes). The host holds `offloaded`
/// boundaries of N·H elements, 4 bytes each, or 2 with bf16 boundaries; the device the others,
/// `min(offloaded, 2)` pool slots of the same dtype and everything else.
pub fn activation_bytes_offloaded(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    offloaded: usize,
    prec: Precision,
) -> (u64, u64) {
    let n = batch * seq;
    let p = plan(cfg, n, AcMode::Full, offloaded, prec, (n, n));
    let sum = |host: bool| plan_bytes(p.iter().filter(|(w, _)| (*w == "res_host") == host), prec);
    (sum(false), sum(true))
}

impl Workspace {
    pub fn new(
        be: &dyn Backend,
        model: &Model,
        batch: usize,
        seq: usize,
        mode: AcMode,
    ) -> Workspace {
        Self::with_offload(be, model, batch, seq, mode, 0)
    }

    /// A workspace whose first `offloaded` block inputs live in host memory between their
    /// forward and backward (`AcMode::Full` only; see [`crate::offload`]).
    pub fn with_offload(
        be: &dyn Backend,
        model: &Model,
        batch: usize,
        seq: usize,
        mode: AcMode,
        offloaded: usize,
    ) -> Workspace {
        let cfg = model.config();
        let n = batch * seq;
        assert!(
            offloaded == 0 || mode == AcMode::Full,
            "activation offload needs full activation checkpointing"
        );
        let prec = Precision::of(model);
        let bf16 = prec.bf16;
        let rows = (model.head_rows(n), model.moe_rows(n));
        let sizes = plan(cfg, n, mode, offloaded, prec, rows);
        let mut it = sizes.iter().peekable();
        // The boundaries are allocated by `Boundaries` in the plan's order.
        while it.next_if(|(w, _)| w.starts_with("res")).is_some() {}
        let res = Boundaries::new(
            be,
            cfg.layers,
            n * cfg.hidden,
            offloaded,
            prec.bf16_boundaries,
        );
        let mut t = |name: &str| {
            let (what, len) = it.next().expect("workspace plan exhausted");
            assert_eq!(*what, name, "workspace plan order");
            match dtype_of(what, prec) {
                DType::F32 => be.zeros(&[*len], Category::Activations),
                dt => be.zeros_of(&[*len], dt, Category::Activations),
            }
        };
        let sets: Vec<(bool, usize)> = match mode {
            AcMode::None => (0..cfg.layers)
                .map(|l| (cfg.is_moe_layer(l), ffn_width(cfg, l)))
                .collect(),
            AcMode::Full => vec![(
                cfg.layers > cfg.dense_layers,
                (0..cfg.layers)
                    .map(|l| ffn_width(cfg, l))
                    .max()
                    .unwrap_or(0),
            )],
        };
        let mut blocks = vec![];
        for (moe, fw) in sets {
            let mut b = BlockActs {
                xn1: t("xn1"),
                rstd1: t("rstd1"),
                q: t("q"),
                k: t("k"),
                v: t("v"),
                qr: t("qr"),
                kr: t("kr"),
                rstdq: t("rstdq"),
                rstdk: t("rstdk"),
                att: t("att"),
                lse: t("lse"),
                xmid: t("xmid"),
                xn2: t("xn2"),
                rstd2: t("rstd2"),
                moe: None,
                ffn: None,
            };
            if moe {
                b.moe = Some(MoeActs {
                    probs: t("probs"),
                    rw: t("rw"),
                    xe: t("xe"),
                    g: t("g"),
                    u: t("u"),
                    a: t("a"),
                    ye: t("ye"),
                    r: Routing {
                        idx: t("idx"),
                        src: t("src"),
                        pos: t("pos"),
                        counts: t("counts"),
                        offsets: t("offsets"),
                        chunks: vec![ChunkRoute::default(); crate::step::chunks(n, rows.1).count()],
                    },
                });
            }
            if fw > 0 {
                b.ffn = Some(FfnActs {
                    g: t("fg"),
                    u: t("fu"),
                    a: t("fa"),
                });
            }
            blocks.push(b);
        }
        let any_moe = model
            .layers
            .iter()
            .any(|l| matches!(l.mlp, MlpIdx::Moe { .. }));
        let any_ffn = (0..cfg.layers).any(|l| ffn_width(cfg, l) > 0);
        let mut grads = GradScratch {
            dres: t("dres"),
            dxn: t("dxn"),
            datt: t("datt"),
            dqr: t("dqr"),
            dkr: t("dkr"),
            dk: t("dk"),
            dv: t("dv"),
            attn16: None,
            drl: None,
            drw: None,
            dye: None,
            da: None,
            dg: None,
            du: None,
            dxe: None,
            dfa: None,
            dfg: None,
            dfu: None,
        };
        if bf16 {
            grads.attn16 = Some(AttnBf16Grads {
                datt: t("datt16"),
                dq: t("dqr16"),
                dk: t("dkr16"),
                dv: t("dv16"),
            });
        }
        if any_moe {
            grads.drl = Some(t("drl"));
            grads.drw = Some(t("drw"));
            grads.dye = Some(t("dye"));
            grads.da = Some(t("da"));
            grads.dg = Some(t("dg"));
            grads.du = Some(t("du"));
            grads.dxe = Some(t("dxe"));
        }
        if any_ffn {
            grads.dfa = Some(t("dfa"));
            grads.dfg = Some(t("dfg"));
            grads.dfu = Some(t("dfu"));
        }
        let head = HeadActs {
            xf: t("xf"),
            rstd: t("rstdf"),
            logits: t("logits"),
            lse: t("lse_ce"),
            loss: be.zeros_of(&[1], DType::F64, Category::Buffers),
            ids: t("ids"),
            targets: t("targets"),
            id_groups: t("id_groups"),
            segments: 0,
            uploaded: None,
            docs: None,
        };
        assert!(it.next().is_none(), "workspace plan not fully allocated");
        let moe_layers = (0..cfg.layers).filter(|&l| cfg.is_moe_layer(l)).count();
        let route = (moe_layers > 0).then(|| RouteStats {
            psum: be.zeros_of(&[moe_layers * cfg.experts], DType::F64, Category::Buffers),
            counts: be.zeros_of(&[moe_layers * cfg.experts], DType::F64, Category::Buffers),
        });
        Workspace {
            batch,
            seq,
            mode,
            res,
            blocks,
            grads,
            head,
            route,
        }
    }

    pub fn batch(&self) -> usize {
        self.batch
    }
    pub fn seq(&self) -> usize {
        self.seq
    }
    pub fn mode(&self) -> AcMode {
        self.mode
    }
    /// Block inputs kept in host memory between forward and backward.
    pub fn offloaded(&self) -> usize {
        self.res.offloaded()
    }
    /// Leave out one of the offload's event waits (tests of the checking backend only).
    #[doc(hidden)]
    pub fn inject_offload_fault(&mut self, fault: Option<crate::offload::OffloadFault>) {
        self.res.inject_fault(fault);
    }
    /// Bytes this workspace holds, in both memories (equals [`activation_bytes_at`] at the
    /// model's [`Precision`] for an f32 backend without offload).
    pub fn bytes(&self) -> u64 {
        let mut total = 0u64;
        total += self.res.bytes();
        let mut add = |t: &Tensor| total += t.bytes() as u64;
        for b in &self.blocks {
            for t in [
                &b.xn1, &b.rstd1, &b.q, &b.k, &b.v, &b.qr, &b.kr, &b.rstdq, &b.rstdk, &b.att,
                &b.lse, &b.xmid, &b.xn2, &b.rstd2,
            ] {
                add(t);
            }
            if let Some(m) = &b.moe {
                for t in [&m.probs, &m.rw, &m.xe, &m.g, &m.u, &m.a, &m.ye] {
                    add(t);
                }
                let r = &m.r;
                for t in [&r.idx, &r.src, &r.pos, &r.counts, &r.offsets] {
                    add(t);
                }
            }
            if let Some(f) = &b.ffn {
                for t in [&f.g, &f.u, &f.a] {
                    add(t);
                }
            }
        }
        let g = &self.grads;
        for t in [&g.dres, &g.dxn, &g.datt, &g.dqr, &g.dkr, &g.dk, &g.dv] {
            add(t);
        }
        if let Some(a) = &g.attn16 {
            for t in [&a.datt, &a.dq, &a.dk, &a.dv] {
                add(t);
            }
        }
        for t in [
            &g.drl, &g.drw, &g.dye, &g.da, &g.dg, &g.du, &g.dxe, &g.dfa, &g.dfg, &g.dfu,
        ]
        .into_iter()
        .flatten()
        {
            add(t);
        }
        for t in [
            &self.head.xf,
            &self.head.rstd,
            &self.head.logits,
            &self.head.lse,
            &self.head.ids,
            &self.head.targets,
            &self.head.id_groups,
        ] {
            add(t);
        }
        total
    }
}

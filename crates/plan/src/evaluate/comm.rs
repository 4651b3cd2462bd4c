//! Bytes one GPU moves per step: FSDP's gathers and reduce-scatters, the experts' all-to-all,
//! the optimizer's gathers, and host–device copies; split between InfiniBand and NVLink.

use super::Dims;
use crate::params::Handler;
use crate::plan::{
    group_traffic, Communication, Layout, MemoryPolicy, NsOn, OptimizerSetup, Placement,
};
use ganymede_config::AcMode;

/// The step's traffic, and the per-layer pieces the time model schedules.
pub(super) struct Traffic {
    pub communication: Communication,
    /// One layer's gather and reduce-scatter, off node and on node; the embedding and head's.
    pub ag_layer: (f64, f64),
    pub rs_layer: (f64, f64),
    pub ag_outside: (f64, f64),
    pub rs_outside: (f64, f64),
    /// Layers gathered again in backward.
    pub l_bwd_gathers: f64,
    /// One MoE layer's all-to-all bytes, forward and backward; the share that leaves the node;
    /// the share of layers that are MoE.
    pub a2a_per_layer_fwd: f64,
    pub a2a_per_layer_bwd: f64,
    pub a2a_ib_share: f64,
    pub moe_frac: f64,
    /// The optimizer's bytes and collectives, and whether they cross nodes.
    pub opt_bytes: f64,
    pub opt_colls: u64,
    pub opt_on_ib: bool,
    /// Newton–Schulz's copies one way, away from where the state lives.
    pub ns_copy: f64,
    pub d2h: f64,
    pub h2d: f64,
    /// Per link, per step (HSDP's all-reduce is added by the time model, which prices it).
    pub ib_step: f64,
    pub nv_step: f64,
    /// A GPU's gradient shards, what HSDP all-reduces across replicas.
    pub grad_shard_bytes: f64,
}

pub(super) fn traffic(
    d: &Dims,
    layout: &Layout,
    policy: &MemoryPolicy,
    opt: &OptimizerSetup,
    offloaded_layers: usize,
) -> Traffic {
    let (p, shape) = (&d.p, &d.shape);
    let (w, wf, ep, efsdp, gpn, l, mf) = (d.w, d.wf, d.ep, d.efsdp, d.gpn, d.l, d.mf);
    let (pb, gb, rb) = (policy.param_bytes, policy.gather_bytes, policy.reduce_bytes);

    // FSDP: per layer, the dense part over every rank, the experts over the expert-FSDP group.
    let dense_layer_bytes = |b: f64| b * shape.avg_dense_part();
    let expert_layer_bytes = |b: f64| b * shape.avg_experts_part() / ep as f64;
    let q_dense = gpn.min(w);
    let q_exp = if ep <= gpn { gpn / ep } else { 1 }.min(efsdp).max(1);
    let (ag_d_ib, ag_d_nv) = group_traffic(dense_layer_bytes(gb), w, q_dense);
    let (ag_e_ib, ag_e_nv) = group_traffic(expert_layer_bytes(gb), efsdp, q_exp);
    let (rs_d_ib, rs_d_nv) = group_traffic(dense_layer_bytes(rb), w, q_dense);
    let (rs_e_ib, rs_e_nv) = group_traffic(expert_layer_bytes(rb), efsdp, q_exp);
    let outside = p.outside_layers as f64;
    let (ag_o_ib, ag_o_nv) = group_traffic(pb * outside, w, q_dense);
    let (rs_o_ib, rs_o_nv) = group_traffic(rb * outside, w, q_dense);
    let ag_layer_ib = ag_d_ib + ag_e_ib;
    let ag_layer_nv = ag_d_nv + ag_e_nv;
    let rs_layer_ib = rs_d_ib + rs_e_ib;
    let rs_layer_nv = rs_d_nv + rs_e_nv;
    let ag_once = l * (ag_layer_ib + ag_layer_nv) + ag_o_ib + ag_o_nv;
    // Backward gathers every layer again, but the last when it was kept from forward.
    let l_bwd_gathers = if policy.keep_last_block { l - 1.0 } else { l };
    let ag_bwd = l_bwd_gathers * (ag_layer_ib + ag_layer_nv) + ag_o_ib + ag_o_nv;
    let rs_once = l * (rs_layer_ib + rs_layer_nv) + rs_o_ib + rs_o_nv;

    // Expert parallelism's all-to-all.
    let ep_on_nvlink = ep <= gpn;
    let a2a_one = if d.has_moe {
        d.n_tok * d.k * d.h * pb * (ep as f64 - 1.0) / ep as f64
    } else {
        0.0
    };
    let a2a_per_layer_fwd = 2.0 * a2a_one; // dispatch + combine
    let a2a_per_layer_bwd = match policy.ac {
        AcMode::Full => 4.0 * a2a_one, // recompute forward + backward
        AcMode::None => 2.0 * a2a_one,
    };
    let moe_frac = shape.moe_layers as f64 / l;
    // Of the ep − 1 peers a rank sends tokens to, ep − gpus_per_node sit on other nodes.
    let a2a_ib_share = if ep_on_nvlink {
        0.0
    } else {
        (ep - gpn) as f64 / (ep - 1) as f64
    };
    let a2a_step = mf * l * moe_frac * (a2a_per_layer_fwd + a2a_per_layer_bwd);

    // Optimizer traffic, fp32 both ways, owners balanced: every GPU sends its shard of each
    // gathered matrix and, as owner, receives 1/W of them; the scatter mirrors it.
    let dense_muon = || {
        d.ts.iter()
            .filter(|t| t.handler() == Handler::Muon && !t.expert)
    };
    let muon_dense: f64 = dense_muon().map(|t| t.total() as f64).sum();
    let muon_dense_mats: u64 = dense_muon().map(|t| t.count).sum();
    let spread = if w > 1 { (wf - 1.0) / wf } else { 0.0 };
    let naive_bytes = 2.0 * 4.0 * p.muon as f64 / wf * spread;
    let flex_bytes = 2.0 * 4.0 * muon_dense / wf * spread;
    let coll_naive = if w > 1 { 2 * p.muon_matrices } else { 0 };
    let coll_flex = if w > 1 { 2 * muon_dense_mats } else { 0 };
    let (opt_bytes, opt_colls) = match (d.muon, opt.placement) {
        (false, _) => (0.0, 0),
        (true, Placement::Naive) => (naive_bytes, coll_naive),
        (true, Placement::Flexshard) => (flex_bytes, coll_flex),
    };
    let opt_on_ib = layout.nodes > 1;

    // Host–device copies.
    let shard = d.shard;
    let act_d2h = mf * offloaded_layers as f64 * d.boundary_layer;
    let state_d2h = if policy.param_offload {
        4.0 * shard * mf
    } else {
        0.0
    }; // fp32 grads out
    let state_h2d = if policy.param_offload {
        4.0 * shard
    } else {
        0.0
    }; // shards in (per gather pass: fwd+bwd)
    let ns_copy = if d.muon && (policy.param_offload == (opt.ns_on == NsOn::Gpu)) {
        // NS away from where the state lives: the Muon shard crosses the link both ways.
        4.0 * p.muon as f64 / wf
    } else {
        0.0
    };
    let d2h = act_d2h + state_d2h + ns_copy;
    let h2d = act_d2h + 2.0 * mf * state_h2d + ns_copy;

    let ib_step = mf * ((l + l_bwd_gathers) * ag_layer_ib + 2.0 * ag_o_ib)
        + mf * (l * rs_layer_ib + rs_o_ib)
        + a2a_step * a2a_ib_share
        + if opt_on_ib { opt_bytes } else { 0.0 };
    let nv_step = mf * ((l + l_bwd_gathers) * ag_layer_nv + 2.0 * ag_o_nv)
        + mf * (l * rs_layer_nv + rs_o_nv)
        + a2a_step * (1.0 - a2a_ib_share)
        + if opt_on_ib { 0.0 } else { opt_bytes };
    // HSDP's all-reduce carries a GPU's f32 (reduce_bytes) gradient shards: dense over the
    // replica's dp_shard ranks, experts over ep × efsdp (the same ranks).
    let grad_shard_bytes = l * dense_layer_bytes(rb) / wf
        + l * expert_layer_bytes(rb) / efsdp as f64
        + rb * outside / wf;
    Traffic {
        communication: Communication {
            fsdp_all_gather_fwd: mf * ag_once,
            fsdp_all_gather_bwd: mf * ag_bwd,
            fsdp_reduce_scatter: mf * rs_once,
            hsdp_all_reduce: 0.0, // priced with the step's time
            ep_all_to_all: a2a_step,
            optimizer: opt_bytes,
            optimizer_naive_muon: naive_bytes,
            optimizer_flexshard: flex_bytes,
            optimizer_adamw: 0.0,
            optimizer_collectives_naive: coll_naive,
            optimizer_collectives_flexshard: coll_flex,
            ib_bytes: ib_step,
            nvlink_bytes: nv_step,
            d2h_bytes: d2h,
            h2d_bytes: h2d,
            ep_on_nvlink,
        },
        ag_layer: (ag_layer_ib, ag_layer_nv),
        rs_layer: (rs_layer_ib, rs_layer_nv),
        ag_outside: (ag_o_ib, ag_o_nv),
        rs_outside: (rs_o_ib, rs_o_nv),
        l_bwd_gathers,
        a2a_per_layer_fwd,
        a2a_per_layer_bwd,
        a2a_ib_share,
        moe_frac,
        opt_bytes,
        opt_colls,
        opt_on_ib,
        ns_copy,
        d2h,
        h2d,
        ib_step,
        nv_step,
        grad_shard_bytes,
    }
}

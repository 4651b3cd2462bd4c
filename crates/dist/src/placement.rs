//! The Muon placement plan: which rank stores which part of each parameter, and which rank
//! runs each matrix's Newton–Schulz, as [`crate::muon_comm`] executes it. Which plan a mesh gets
//! (FlexShard or the naive baseline) is a layout policy, `ganymede_parallel::flexshard`'s; this
//! module is the format the two share and the bytes the exchange moves under it.
//!
//! - [`Placement::Shard`]: even dim-0 shards over the parameter's group, padded to a multiple of
//!   the group size (FSDP's default).
//! - [`Placement::Expert`]: routed expert stacks dealt whole to the expert-FSDP group,
//!   `per_owner` consecutive experts per rank. Muon needs no communication for them.
//! - [`Placement::Owned`]`(rank)`: stored like `Shard`, its momentum-updated gradient gathered
//!   on `rank` for Newton–Schulz and its update slices scattered back.
//!
//! [`optimizer_bytes`] gives, per rank, the bytes the optimizer's gathers and scatters move per
//! step under a plan, by the counting convention of [`crate::stats`].

use crate::mesh::MeshShape;
use ganymede_core::ParamKind;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Shard,
    Expert { per_owner: usize },
    Owned(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Every parameter `Shard`; each Muon matrix gathered whole on one rank and scattered back.
    Naive,
    /// Experts whole per owner, dense Muon matrices owned by LPT, the rest `Shard`.
    FlexShard,
}

/// The group a parameter is sharded over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardGroup {
    /// All `dp_shard` ranks.
    DpShard,
    /// The expert-FSDP group (routed experts, after the expert-parallel split).
    Efsdp,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamPlacement {
    pub name: String,
    pub kind: ParamKind,
    pub placement: Placement,
    pub group: ShardGroup,
    /// Shape held by one expert-parallel slice (routed experts: `[E/ep, out, in]`; else the
    /// full shape).
    pub local_shape: Vec<usize>,
    /// Elements each rank of the group stores, padding included.
    pub shard_elems: usize,
    /// For Muon parameters under `Shard` or `Owned`: the group rank that runs Newton–Schulz.
    pub ns_root: Option<usize>,
}

impl ParamPlacement {
    /// Whether Muon updates it (and so whether the optimizer communicates for it).
    pub fn is_muon(&self) -> bool {
        self.kind.is_muon()
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlacementError {
    #[error("{name}: {experts} experts cannot be split over ep = {ep}; ep must divide the number of routed experts")]
    ExpertsNotDivisible {
        name: String,
        experts: usize,
        ep: usize,
    },
    #[error("{name}: expected a 3-D [experts, out, in] stack, got {shape:?}")]
    BadExpertShape { name: String, shape: Vec<usize> },
}

/// The placements of every parameter, in spec order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub shape: MeshShape,
    pub policy: Policy,
    pub params: Vec<ParamPlacement>,
}

impl Plan {
    /// World rank that runs Newton–Schulz for `p` in the group containing world rank `r`.
    pub fn ns_world_root(&self, p: &ParamPlacement, r: usize) -> Option<usize> {
        let root = p.ns_root?;
        Some(match p.group {
            ShardGroup::DpShard => root,
            ShardGroup::Efsdp => root * self.shape.ep + self.shape.coords(r).1,
        })
    }

    /// Elements each world rank stores for all parameters (padding included).
    pub fn stored_elems(&self) -> usize {
        self.params.iter().map(|p| p.shard_elems).sum()
    }
}

/// Bytes `(sent, received)` per world rank that the optimizer moves in one step under `plan`:
/// for every Muon parameter with a Newton–Schulz root, a gather of the `shard_elems`-element
/// slices to the root and a scatter of the update slices back, each `elem` bytes per element;
/// whole-expert parameters move nothing. Equal to what the collectives count in
/// [`crate::stats::Phase::Optimizer`] when the optimizer issues exactly those gathers/scatters.
pub fn optimizer_bytes(plan: &Plan, elem: usize) -> Vec<(u64, u64)> {
    let dp = plan.shape.dp_shard;
    let mut out = vec![(0u64, 0u64); dp];
    for p in plan.params.iter().filter(|p| p.is_muon()) {
        let g = match p.group {
            ShardGroup::DpShard => dp,
            ShardGroup::Efsdp => plan.shape.efsdp(),
        } as u64;
        let shard = (p.shard_elems * elem) as u64;
        for (r, o) in out.iter_mut().enumerate() {
            let Some(root) = plan.ns_world_root(p, r) else {
                continue;
            };
            // Gather (non-roots send a slice, the root receives g-1) then scatter (the mirror
            // image): sent == received on every rank.
            let v = if r == root { (g - 1) * shard } else { shard };
            o.0 += v;
            o.1 += v;
        }
    }
    out
}

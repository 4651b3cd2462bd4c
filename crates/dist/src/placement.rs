//! FlexShard placement for Muon: which rank stores which part of each parameter, and which rank
//! runs each matrix's Newton–Schulz. Pure arithmetic over [`ParamSpec`]s and the mesh shape.
//!
//! - [`Placement::Shard`]: even dim-0 shards over the parameter's group, padded to a multiple of
//!   the group size (FSDP's default). An expert stack's "rows" are its experts' rows, so a
//!   sharded expert matrix is cut across ranks.
//! - [`Placement::Expert`]: routed expert stacks, `E/ep` experts per expert-parallel slice, dealt
//!   whole to the expert-FSDP group, `per_owner = ceil(E_local / efsdp)` consecutive experts per
//!   rank (the last ranks hold padding experts when it does not divide). Muon needs no
//!   communication for them.
//! - [`Placement::Owned`]`(rank)`: a dense Muon matrix (or a shared-expert stack) stored like
//!   `Shard`, whose momentum-updated gradient is gathered on `rank` for Newton–Schulz and whose
//!   update slices are scattered back. Owners are chosen by longest-processing-time on the
//!   Newton–Schulz cost `s²(2l+s)` (`s ≤ l`), starting from each rank's expert load. Unlike
//!   upstream FlexShard's `Owned` (whole parameter resident on one rank), storage stays sharded
//!   so FSDP's gathers stay uniform; only the optimizer work is owned.
//!
//! [`optimizer_bytes`] gives, per rank, the bytes the optimizer's gathers and scatters move per
//! step under a plan, by the counting convention of [`crate::stats`]; the naive baseline is the
//! plan of [`Policy::Naive`] (everything `Shard`, Newton–Schulz roots dealt round-robin).

use crate::mesh::MeshShape;
use ganymede_core::{ParamKind, ParamSpec};
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

/// Newton–Schulz cost of an `a×b` matrix in TorchTitan's balancing units: `s²(2l+s)`.
pub fn ns_cost(a: usize, b: usize) -> u64 {
    let (s, l) = (a.min(b) as u64, a.max(b) as u64);
    s * s * (2 * l + s)
}

/// Even dim-0 sharding of `rows` rows of `row_len` elements over `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub rows: usize,
    pub row_len: usize,
    pub world: usize,
    pub rows_per_rank: usize,
}

impl ShardLayout {
    pub fn new(rows: usize, row_len: usize, world: usize) -> Self {
        Self {
            rows,
            row_len,
            world,
            rows_per_rank: rows.div_ceil(world),
        }
    }
    /// Elements per rank, padding included.
    pub fn shard_elems(&self) -> usize {
        self.rows_per_rank * self.row_len
    }
    pub fn padded_elems(&self) -> usize {
        self.shard_elems() * self.world
    }
    /// Real (unpadded) element range of the full tensor that `rank` holds.
    pub fn range(&self, rank: usize) -> std::ops::Range<usize> {
        let lo = (rank * self.rows_per_rank).min(self.rows);
        let hi = ((rank + 1) * self.rows_per_rank).min(self.rows);
        lo * self.row_len..hi * self.row_len
    }
}

fn is_routed(spec: &ParamSpec) -> bool {
    // Shared experts see every token, so they are not split by expert parallelism.
    spec.kind == ParamKind::Experts && !spec.name.contains("shared_expert")
}

/// `[rows, row_len]` view of a parameter for dim-0 sharding.
fn rows_of(shape: &[usize], kind: ParamKind) -> (usize, usize) {
    let numel: usize = shape.iter().product();
    let rows = match (kind, shape.len()) {
        (_, 0) => 1,
        (ParamKind::Experts, 3) => shape[0] * shape[1],
        _ => shape[0],
    };
    (rows, numel.checked_div(rows).unwrap_or(0))
}

/// Newton–Schulz cost of a whole Muon parameter (each expert matrix separately).
fn param_ns_cost(shape: &[usize], kind: ParamKind) -> u64 {
    match (kind, shape.len()) {
        (ParamKind::Experts, 3) => shape[0] as u64 * ns_cost(shape[1], shape[2]),
        (_, 2) => ns_cost(shape[0], shape[1]),
        _ => 0,
    }
}

/// Place every parameter for a mesh.
pub fn plan(specs: &[ParamSpec], shape: MeshShape, policy: Policy) -> Result<Plan, PlacementError> {
    let (dp, ep, efsdp) = (shape.dp_shard, shape.ep, shape.efsdp());
    let mut params = Vec::with_capacity(specs.len());
    // Newton–Schulz load per world rank, from the experts each rank owns.
    let mut load = vec![0u64; dp];
    for s in specs {
        let routed = is_routed(s);
        let mut local_shape = s.shape.clone();
        if s.kind == ParamKind::Experts && s.shape.len() != 3 {
            return Err(PlacementError::BadExpertShape {
                name: s.name.clone(),
                shape: s.shape.clone(),
            });
        }
        if routed {
            if s.shape[0] % ep != 0 {
                return Err(PlacementError::ExpertsNotDivisible {
                    name: s.name.clone(),
                    experts: s.shape[0],
                    ep,
                });
            }
            local_shape[0] = s.shape[0] / ep;
        }
        let (group, gsize) = if routed {
            (ShardGroup::Efsdp, efsdp)
        } else {
            (ShardGroup::DpShard, dp)
        };
        let (rows, row_len) = rows_of(&local_shape, s.kind);
        let sharded = ShardLayout::new(rows, row_len, gsize).shard_elems();
        let p = if routed && policy == Policy::FlexShard {
            let (el, out, inn) = (local_shape[0], local_shape[1], local_shape[2]);
            let per_owner = el.div_ceil(efsdp);
            let c = ns_cost(out, inn);
            for (r, l) in load.iter_mut().enumerate() {
                let f = shape.coords(r).0;
                let owned = el.min((f + 1) * per_owner).saturating_sub(f * per_owner);
                *l += owned as u64 * c;
            }
            ParamPlacement {
                name: s.name.clone(),
                kind: s.kind,
                placement: Placement::Expert { per_owner },
                group,
                local_shape,
                shard_elems: per_owner * out * inn,
                ns_root: None,
            }
        } else {
            ParamPlacement {
                name: s.name.clone(),
                kind: s.kind,
                placement: Placement::Shard,
                group,
                local_shape,
                shard_elems: sharded,
                ns_root: None,
            }
        };
        params.push(p);
    }
    match policy {
        Policy::Naive => {
            // Round-robin roots over the Muon parameters, in spec order, within each group.
            for (m, p) in params.iter_mut().filter(|p| p.is_muon()).enumerate() {
                let g = if p.group == ShardGroup::Efsdp {
                    efsdp
                } else {
                    dp
                };
                p.ns_root = Some(m % g);
            }
        }
        Policy::FlexShard => {
            // LPT: heaviest first, each to the least-loaded rank (lowest rank on ties).
            let mut items: Vec<(u64, usize)> = params
                .iter()
                .enumerate()
                .filter(|(_, p)| p.is_muon() && p.placement == Placement::Shard)
                .map(|(i, p)| (param_ns_cost(&p.local_shape, p.kind), i))
                .collect();
            items.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for (c, i) in items {
                let r = (0..dp).min_by_key(|&r| (load[r], r)).unwrap();
                load[r] += c;
                params[i].placement = Placement::Owned(r);
                params[i].ns_root = Some(r);
            }
        }
    }
    Ok(Plan {
        shape,
        policy,
        params,
    })
}

impl Plan {
    /// Newton–Schulz work per world rank, in `s²(2l+s)` units.
    pub fn ns_load(&self) -> Vec<u64> {
        let dp = self.shape.dp_shard;
        let mut load = vec![0u64; dp];
        for p in self.params.iter().filter(|p| p.is_muon()) {
            match p.placement {
                Placement::Expert { per_owner } => {
                    let (el, out, inn) = (p.local_shape[0], p.local_shape[1], p.local_shape[2]);
                    for (r, l) in load.iter_mut().enumerate() {
                        let f = self.shape.coords(r).0;
                        let owned = el.min((f + 1) * per_owner).saturating_sub(f * per_owner);
                        *l += owned as u64 * ns_cost(out, inn);
                    }
                }
                _ => {
                    let c = param_ns_cost(&p.local_shape, p.kind);
                    for (r, l) in load.iter_mut().enumerate() {
                        if self.ns_world_root(p, r) == Some(r) {
                            *l += c;
                        }
                    }
                }
            }
        }
        load
    }

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

/// Totals over ranks of [`optimizer_bytes`] for the naive and the FlexShard plans: what one step
/// of distributed Muon sends, side by side.
pub fn optimizer_bytes_compare(
    specs: &[ParamSpec],
    shape: MeshShape,
    elem: usize,
) -> Result<(u64, u64), PlacementError> {
    let total = |policy| -> Result<u64, PlacementError> {
        let p = plan(specs, shape, policy)?;
        Ok(optimizer_bytes(&p, elem).iter().map(|x| x.0).sum())
    };
    Ok((total(Policy::Naive)?, total(Policy::FlexShard)?))
}

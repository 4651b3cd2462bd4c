//! FlexShard, the layout policy for Muon on shards, in one place: which rank stores which part
//! of each parameter and which rank runs each matrix's Newton–Schulz ([`plan`], pure arithmetic
//! over [`ParamSpec`]s and the mesh shape), the policy a config asks for ([`policy`]), and the
//! Newton–Schulz work it leaves each rank ([`ns_load`], [`batch_counts`]). The plan's format and
//! the exchange that carries it out are communication, `ganymede_dist`'s
//! ([`ganymede_dist::placement`], [`ganymede_dist::muon_exchange`]).
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
//! [`ganymede_dist::optimizer_bytes`] gives, per rank, the bytes the optimizer's gathers and scatters move per
//! step under a plan, by the counting convention of [`ganymede_dist::stats`]; the naive baseline is the
//! plan of [`Policy::Naive`] (everything `Shard`, Newton–Schulz roots dealt round-robin).

use ganymede_config::{JobConfig, MuonPlacement};
use ganymede_core::{ParamKind, ParamSpec};
use ganymede_dist::placement::{ParamPlacement, PlacementError, ShardGroup};
use ganymede_dist::{optimizer_bytes, MeshShape, Placement, Plan, Policy};

/// The placement policy a config asks for.
pub fn policy(cfg: &JobConfig) -> Policy {
    match cfg.parallelism.muon_placement {
        MuonPlacement::Flexshard => Policy::FlexShard,
        MuonPlacement::Naive => Policy::Naive,
    }
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
    assign_roots(&mut params, shape, policy, load);
    Ok(Plan {
        shape,
        policy,
        params,
    })
}

/// Each Muon parameter's Newton–Schulz root under `policy`: round-robin (naive), or by LPT on
/// top of `load`, each rank's work from the experts it owns (FlexShard, whose dense matrices
/// become `Owned` by their roots).
fn assign_roots(
    params: &mut [ParamPlacement],
    shape: MeshShape,
    policy: Policy,
    mut load: Vec<u64>,
) {
    let (dp, efsdp) = (shape.dp_shard, shape.efsdp());
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
}

/// Newton–Schulz work per world rank, in `s²(2l+s)` units.
pub fn ns_load(plan: &Plan) -> Vec<u64> {
    let dp = plan.shape.dp_shard;
    let mut load = vec![0u64; dp];
    for p in plan.params.iter().filter(|p| p.is_muon()) {
        match p.placement {
            Placement::Expert { per_owner } => {
                let (el, out, inn) = (p.local_shape[0], p.local_shape[1], p.local_shape[2]);
                for (r, l) in load.iter_mut().enumerate() {
                    let f = plan.shape.coords(r).0;
                    let owned = el.min((f + 1) * per_owner).saturating_sub(f * per_owner);
                    *l += owned as u64 * ns_cost(out, inn);
                }
            }
            _ => {
                let c = param_ns_cost(&p.local_shape, p.kind);
                for (r, l) in load.iter_mut().enumerate() {
                    if plan.ns_world_root(p, r) == Some(r) {
                        *l += c;
                    }
                }
            }
        }
    }
    load
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

/// The matrix sets a rank may orthogonalise, as `(rows, cols, count)` per Muon parameter of
/// `plan`: a routed stack's owned experts under FlexShard (`per_owner`, the most a rank owns),
/// any other stack whole (its root's), a dense matrix alone. Every rank sizes its batched
/// scratch by them alike; the planner counts the same (`ganymede_plan`'s sharded prediction).
pub fn batch_counts(plan: &Plan) -> Vec<(usize, usize, usize)> {
    plan.params
        .iter()
        .filter(|p| p.is_muon())
        .filter_map(|p| match (p.placement, p.local_shape.as_slice()) {
            (Placement::Expert { per_owner }, &[e, r, c]) => Some((r, c, per_owner.min(e))),
            (_, &[e, r, c]) => Some((r, c, e)),
            (_, &[r, c]) => Some((r, c, 1)),
            _ => None,
        })
        .collect()
}

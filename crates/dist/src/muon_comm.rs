//! The communication of one distributed Muon step under a [`Plan`]: what FlexShard and the
//! naive baseline move, issued through the counted collectives so the byte counters equal
//! [`crate::placement::optimizer_bytes`].
//!
//! Order (FlexShard): post the gathers of every owned dense matrix's momentum-updated gradient
//! slices (non-blocking), orthogonalise this rank's whole experts while they are in flight, wait
//! the gathers, then for each dense matrix orthogonalise it on its owner and post the scatter of
//! the update slices back; finally wait the scatters. The naive plan runs the same code with
//! every Muon parameter (expert stacks included) gathered on its round-robin root.
//!
//! Everything is a view of backend memory: the shards, and the whole matrices a root gathers
//! into, which the caller allocates once ([`root_buffers`] says which and how large) so that a
//! step allocates nothing and the ledger counts them.

use crate::error::{invalid, Result};
use crate::group::{wait_all, ProcessGroup, Work};
use crate::mesh::DeviceMesh;
use crate::placement::{ParamPlacement, Placement, Plan, ShardGroup};
use crate::stats::Phase;
use ganymede_core::ViewMut;
use std::sync::Arc;

/// What to orthogonalise: `data` holds `count` consecutive `[rows, cols]` matrices (one for a
/// dense matrix, the owned experts for an expert stack), to be replaced by their updates.
pub struct NsJob<'a> {
    pub param: &'a ParamPlacement,
    pub rows: usize,
    pub cols: usize,
    pub count: usize,
    pub data: ViewMut<'a>,
}

fn group<'m>(mesh: &'m DeviceMesh, p: &ParamPlacement) -> &'m Arc<dyn ProcessGroup> {
    match p.group {
        ShardGroup::DpShard => &mesh.dp_shard,
        ShardGroup::Efsdp => &mesh.efsdp,
    }
}

/// The whole matrices this rank gathers as a Newton–Schulz root: `(index into plan.params,
/// elements)`, padding included, in plan order. [`muon_exchange`] takes one buffer of each of
/// those it is given slices of.
pub fn root_buffers(plan: &Plan, mesh: &DeviceMesh) -> Vec<(usize, usize)> {
    plan.params
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let g = group(mesh, p);
            (p.ns_root == Some(g.rank())).then(|| (i, p.shard_elems * g.size()))
        })
        .collect()
}

fn matrices(p: &ParamPlacement) -> (usize, usize, usize) {
    match p.local_shape.len() {
        3 => (p.local_shape[0], p.local_shape[1], p.local_shape[2]),
        2 => (1, p.local_shape[0], p.local_shape[1]),
        _ => (0, 0, 0),
    }
}

/// Run the exchange. `slices[k] = (index into plan.params, this rank's shard)` for every Muon
/// parameter, each shard `shard_elems` long (padding included); on return each holds its slice
/// of the update. `roots` holds one buffer per entry of [`root_buffers`] among `slices`, in
/// `slices`' order (their contents are scratch). `ns` is called for every matrix set this rank
/// orthogonalises.
pub fn muon_exchange(
    plan: &Plan,
    mesh: &DeviceMesh,
    slices: &mut [(usize, ViewMut)],
    roots: &mut [ViewMut],
    ns: &mut dyn FnMut(NsJob<'_>),
) -> Result<()> {
    let group = |p: &ParamPlacement| group(mesh, p);
    let want: Vec<usize> = slices
        .iter()
        .map(|(i, _)| &plan.params[*i])
        .filter(|p| p.ns_root == Some(group(p).rank()))
        .map(|p| p.shard_elems * group(p).size())
        .collect();
    if roots.len() != want.len() || roots.iter().zip(&want).any(|(r, &w)| r.len() != w) {
        return Err(invalid(
            "muon_exchange",
            format!(
                "root buffers of {:?} elements, the plan needs {want:?}",
                roots.iter().map(|r| r.len()).collect::<Vec<_>>(),
            ),
        ));
    }
    for (i, s) in slices.iter() {
        let p = &plan.params[*i];
        if !p.is_muon() || s.len() != p.shard_elems {
            return Err(invalid(
                "muon_exchange",
                format!(
                    "{}: slice of {} elements, plan says {}",
                    p.name,
                    s.len(),
                    p.shard_elems
                ),
            ));
        }
    }
    let (mut owned, mut local): (Vec<_>, Vec<_>) = slices
        .iter_mut()
        .partition(|(i, _)| plan.params[*i].ns_root.is_some());

    // 1. Gathers of the owned matrices' slices onto their roots, all in flight at once. A
    //    rank's root buffers follow the plan's order, as `owned` does.
    let mut roots = roots.iter_mut();
    let mut fulls: Vec<Option<&mut ViewMut>> = owned
        .iter()
        .map(|(i, _)| {
            let p = &plan.params[*i];
            (group(p).rank() == p.ns_root.unwrap()).then(|| roots.next().expect("checked above"))
        })
        .collect();
    let mut gathers: Vec<Work> = Vec::with_capacity(owned.len());
    for ((i, s), full) in owned.iter().zip(fulls.iter_mut()) {
        let p = &plan.params[*i];
        let g = group(p);
        let root = p.ns_root.unwrap();
        let recv = full.as_mut().map(|f| f.reborrow());
        gathers.push(g.igather(s.as_view(), recv, root, Phase::Optimizer)?);
    }

    // 2. Whole experts on this rank, while the gathers travel.
    for (i, s) in local.iter_mut() {
        let p = &plan.params[*i];
        let Placement::Expert { per_owner } = p.placement else {
            continue;
        };
        let (e, rows, cols) = matrices(p);
        let f = group(p).rank();
        let count = e.min((f + 1) * per_owner).saturating_sub(f * per_owner);
        ns(NsJob {
            param: p,
            rows,
            cols,
            count,
            data: s.reborrow().slice(0, count * rows * cols),
        });
    }

    // 3. Each owned matrix: orthogonalise on the root and post the scatter back, so the next
    //    matrix's Newton–Schulz overlaps the previous scatter.
    wait_all(gathers)?;
    let mut scatters: Vec<Work> = Vec::with_capacity(owned.len());
    for ((i, s), full) in owned.iter_mut().zip(fulls.iter_mut()) {
        let p = &plan.params[*i];
        let g = group(p);
        let root = p.ns_root.unwrap();
        if let Some(full) = full.as_mut() {
            let (count, rows, cols) = matrices(p);
            // Slices are consecutive row blocks, so the matrix is the unpadded prefix.
            ns(NsJob {
                param: p,
                rows,
                cols,
                count,
                data: full.reborrow().slice(0, count * rows * cols),
            });
        }
        let send = full.as_ref().map(|f| f.as_view());
        scatters.push(g.iscatter(send, s.reborrow(), root, Phase::Optimizer)?);
    }
    wait_all(scatters)
}

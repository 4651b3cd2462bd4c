//! Per-rank shard checkpoints: each rank of a sharded run writes its own shards of parameters
//! and optimizer state (`shard-rank<r>.safetensors`, nothing gathered), and [`SHARDS_FILE`] says
//! how they fit: the mesh shape, and per parameter its shard group, shard size and
//! expert-parallel slice. [`read_whole`] reassembles every tensor, so `eval`, `export`, and a
//! resume at any rank count (one process included) read these like gathered checkpoints.

use crate::{HostTensors, Manifest};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Layout record of a sharded checkpoint.
pub const SHARDS_FILE: &str = "shards.json";

/// Where each saved piece of a tensor belongs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardsManifest {
    pub dp_shard: usize,
    pub ep: usize,
    pub params: Vec<ShardedParam>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardedParam {
    pub name: String,
    pub shape: Vec<usize>,
    /// Elements of one expert-parallel slice (the whole tensor unless routed under ep > 1).
    pub slice_elems: usize,
    /// Sharded over the expert-FSDP group (routed experts) rather than all ranks.
    pub efsdp: bool,
    pub shard_elems: usize,
}

/// File name of rank `r`'s shards inside a checkpoint directory.
pub fn rank_file(r: usize) -> String {
    format!("shard-rank{r}.safetensors")
}

pub fn read_manifest(dir: &Path) -> Result<ShardsManifest> {
    let p = dir.join(SHARDS_FILE);
    let bytes = std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let sm: ShardsManifest = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a valid shard layout", p.display()))?;
    if sm.ep == 0 || sm.dp_shard == 0 || !sm.dp_shard.is_multiple_of(sm.ep) {
        bail!(
            "{}: dp_shard = {} and ep = {} are not a valid mesh",
            p.display(),
            sm.dp_shard,
            sm.ep
        );
    }
    Ok(sm)
}

/// The whole tensor `name` (laid out as `p`) from every rank's piece.
fn assemble(
    dir: &Path,
    sm: &ShardsManifest,
    files: &[HostTensors],
    p: &ShardedParam,
    name: &str,
) -> Result<Vec<f32>> {
    let numel: usize = p.shape.iter().product();
    let slices = if p.efsdp { sm.ep } else { 1 };
    if p.slice_elems * slices != numel {
        bail!(
            "{}: {name}: {slices} slices of {} elements do not make shape {:?}",
            dir.join(SHARDS_FILE).display(),
            p.slice_elems,
            p.shape
        );
    }
    let mut out = vec![0f32; numel];
    for (r, f) in files.iter().enumerate() {
        let Some((_, piece)) = f.get(name) else {
            bail!(
                "{}: rank {r}'s shard lacks {name}",
                dir.join(rank_file(r)).display()
            );
        };
        if piece.len() != p.shard_elems {
            bail!(
                "{}: {name} holds {} elements, {SHARDS_FILE} says {}",
                dir.join(rank_file(r)).display(),
                piece.len(),
                p.shard_elems
            );
        }
        let (fi, e) = (r / sm.ep, r % sm.ep);
        // Routed experts: piece `fi` of ep slice `e`; the rest: piece `r` of the whole.
        let (g, off) = if p.efsdp {
            (fi, e * p.slice_elems)
        } else {
            (r, 0)
        };
        let lo = (g * p.shard_elems).min(p.slice_elems);
        let hi = ((g + 1) * p.shard_elems).min(p.slice_elems);
        out[off + lo..off + hi].copy_from_slice(&piece[..hi - lo]);
    }
    Ok(out)
}

/// Check the layout record against what the checkpoint holds: its manifest's mesh, the rank
/// files present, and every parameter's shards covering its slice. A layout that disagrees
/// would reassemble tensors wrongly rather than fail.
fn check_layout(dir: &Path, sm: &ShardsManifest, manifest: &Manifest) -> Result<()> {
    let p = dir.join(SHARDS_FILE);
    if let Ok(cfg) = manifest.job_config() {
        let (d, e) = (cfg.parallelism.dp_shard, cfg.parallelism.ep.max(1));
        if (d, e) != (sm.dp_shard, sm.ep) {
            bail!(
                "{}: dp_shard = {}, ep = {}, but the checkpoint's manifest was saved with parallelism.dp_shard = {d}, parallelism.ep = {e}",
                p.display(),
                sm.dp_shard,
                sm.ep
            );
        }
    }
    let present = (0..)
        .take_while(|&r| dir.join(rank_file(r)).is_file())
        .count();
    if present != sm.dp_shard {
        bail!(
            "{}: dp_shard = {}, but the checkpoint holds {present} rank file(s) ({})",
            p.display(),
            sm.dp_shard,
            rank_file(present.min(sm.dp_shard))
        );
    }
    for q in &sm.params {
        let group = if q.efsdp {
            sm.dp_shard / sm.ep
        } else {
            sm.dp_shard
        };
        if q.shard_elems * group < q.slice_elems {
            bail!(
                "{}: {}: {group} shards of {} elements cannot hold its {} elements",
                p.display(),
                q.name,
                q.shard_elems,
                q.slice_elems
            );
        }
    }
    Ok(())
}

/// Every parameter and optimizer-state tensor of the sharded checkpoint `dir`, whole, under the
/// names a gathered checkpoint uses: (parameters, optimizer state). Every file is checked
/// against `manifest`'s digests, and the layout against the checkpoint.
pub fn read_whole(dir: &Path, manifest: &Manifest) -> Result<(HostTensors, HostTensors)> {
    let sm = read_manifest(dir)?;
    check_layout(dir, &sm, manifest)?;
    let files: Vec<HostTensors> = (0..sm.dp_shard)
        .map(|r| crate::read_safetensors_checked(dir, &rank_file(r), &manifest.files))
        .collect::<Result<_>>()?;
    let mut model = HostTensors::new();
    for p in &sm.params {
        let t = assemble(dir, &sm, &files, p, &p.name)?;
        model.insert(p.name.clone(), (p.shape.clone(), t));
    }
    // Optimizer state is `<param>.<suffix>`, laid out as its parameter.
    let mut opt = HostTensors::new();
    for name in files[0].keys().filter(|n| !model.contains_key(*n)) {
        let p = name
            .rsplit_once('.')
            .and_then(|(param, _)| sm.params.iter().find(|p| p.name == param));
        let Some(p) = p else {
            bail!(
                "{}: tensor {name} belongs to no parameter of {SHARDS_FILE}",
                dir.join(rank_file(0)).display()
            );
        };
        let t = assemble(dir, &sm, &files, p, name)?;
        opt.insert(name.clone(), (p.shape.clone(), t));
    }
    Ok((model, opt))
}

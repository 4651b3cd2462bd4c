//! Saving and loading a rank's state, in two forms; both load at any rank count, and every
//! command (`eval`, `generate`, `export`, a one-process `train --resume`) reads both.
//!
//! - Gathered (default): every tensor is gathered whole and rank 0 writes the single-process
//!   files (`model.safetensors`, `optimizer.safetensors`). At world size 1 this is simply the
//!   process's own tensors.
//! - Sharded (`parallelism.sharded_checkpoints`, more than one rank): each rank writes its own
//!   shards (nothing gathered) and a layout record says how they fit
//!   ([`ganymede_checkpoint::sharded`]).
//!
//! Under HSDP only replica 0 writes (the replicas are identical); both forms then describe
//! one replica's `dp_shard` layout, and every replica loads them the same way.
//!
//! Loading reads either form whole ([`ganymede_checkpoint::read_tensors`]) and keeps this
//! rank's part. (Every rank reads every file: simple, and fine at the sizes one machine trains.)

use crate::driver::{RankState, Shards};
use crate::layout::Layout;
use anyhow::{bail, Result};
use ganymede_checkpoint::{
    self as checkpoint, sharded, CheckpointData, HostTensors, Manifest, NamedTensors, Position,
    ShardedParam, ShardsManifest, SHARDS_FILE,
};
use ganymede_core::{Backend, Tensor, View, ViewMut};
use ganymede_dist::DeviceMesh;
use ganymede_dist::Phase;
use std::path::{Path, PathBuf};

/// The run's `[checkpoint]` keep_last / keep_every.
fn retention(cfg: &ganymede_config::JobConfig) -> checkpoint::Retention {
    checkpoint::Retention {
        keep_last: cfg.checkpoint.keep_last,
        keep_every: cfg.checkpoint.keep_every,
    }
}

/// Collective over `mesh`: parameter `i`'s shard `shard` (laid out by `layout`) gathered whole.
fn gather_whole(mesh: &DeviceMesh, layout: &Layout, i: usize, shard: View) -> Result<Vec<f32>> {
    let g = crate::fsdp::Groups::of(mesh);
    let g = g.get(layout.group[i]);
    let mut all = vec![0f32; layout.shard[i] * g.size()];
    g.all_gather(shard, ViewMut::Host(&mut all), Phase::Other)?;
    all.truncate(layout.numel(i));
    if layout.numel(i) < layout.specs[i].numel() {
        // Routed experts under expert parallelism: the ep slices in ep-rank order.
        let mut whole = vec![0f32; layout.specs[i].numel()];
        mesh.ep
            .all_gather(View::Host(&all), ViewMut::Host(&mut whole), Phase::Other)?;
        return Ok(whole);
    }
    Ok(all)
}

/// Collective over `mesh` where `layout` shards the parameters: this rank's tensor `t` of
/// parameter `i` whole (downloaded where it is whole already).
fn whole(
    be: &dyn Backend,
    mesh: &DeviceMesh,
    layout: Option<&Layout>,
    i: usize,
    t: &Tensor,
) -> Result<Vec<f32>> {
    match layout {
        None => Ok(be.download(t.view())),
        Some(layout) => gather_whole(mesh, layout, i, t.view()),
    }
}

/// The checkpoint's operations on whole parameters or shards.
impl Shards {
    /// This rank's tensor of parameter `i` (whole at world size 1, else its shard).
    fn param(&self, i: usize) -> &Tensor {
        match self {
            Shards::Whole { params, .. } => params.get(i),
            Shards::Fsdp { params, .. } => params.shard(i),
        }
    }

    /// This rank's parameter tensors (whole at world size 1, else its master shards), to load
    /// into (a bf16 compute copy is cast again from them).
    pub fn params_mut(&mut self) -> &mut [Tensor] {
        match self {
            Shards::Whole {
                params, compute, ..
            } => {
                // Loading overwrites the masters: the bf16 copies are cast again.
                if let Some(c) = compute {
                    c.invalidate();
                }
                params.tensors_mut()
            }
            Shards::Fsdp { params, .. } => params.master_mut(),
        }
    }
}

impl RankState {
    /// Collective: every parameter whole (checks, rank-0 saves).
    pub fn full_params(&self) -> Result<Vec<Vec<f32>>> {
        let layout = self.shards.layout().map(|l| l.as_ref());
        (0..self.model.param_specs().len())
            .map(|i| {
                whole(
                    self.be.as_ref(),
                    &self.mesh,
                    layout,
                    i,
                    self.shards.param(i),
                )
            })
            .collect()
    }

    /// Optimizer state as (parameter index, checkpoint suffix, this rank's tensor).
    fn opt_state(&mut self) -> Vec<(usize, &'static str, &mut Tensor)> {
        self.shards.opt_mut().state_mut()
    }

    /// Order the host after the last step's write-back of host-resident optimizer state
    /// (`optimizer.offload`), before checkpoint code reads or overwrites it.
    fn settle_opt_state(&self) {
        self.shards.opt().synchronize_state(self.be.as_ref());
    }

    /// Optimizer steps taken so far.
    pub fn opt_step(&self) -> u64 {
        self.shards.opt().step_count()
    }

    /// Collective: save a checkpoint under `run_dir`, gathered, or per-rank shards when asked
    /// for and there is more than one rank. Rank 0 returns the checkpoint's directory.
    pub fn save(
        &mut self,
        run_dir: &Path,
        at: &Position,
        sharded: bool,
    ) -> Result<Option<PathBuf>> {
        // HSDP: every replica holds the same parameters and optimizer state, so replica 0
        // alone writes (its own collectives stay inside it); on resume every replica reads the
        // same files.
        if self.replica() != 0 {
            return Ok(None);
        }
        if sharded && self.mesh.dp_shard.size() > 1 {
            self.save_sharded_checkpoint(run_dir, at)
        } else {
            self.save_checkpoint(run_dir, at)
        }
    }

    /// Collective: save a gathered checkpoint under `run_dir` (rank 0 writes).
    pub fn save_checkpoint(&mut self, run_dir: &Path, at: &Position) -> Result<Option<PathBuf>> {
        self.settle_opt_state();
        let specs = self.model.param_specs();
        let (be, mesh) = (&self.be, &self.mesh);
        let mut params: NamedTensors = Vec::new();
        let mut optimizer: NamedTensors = Vec::new();
        let mut push = |name: String, i: usize, whole: Vec<f32>, to_opt: bool| {
            let t = (name, specs[i].shape.clone(), whole);
            if to_opt {
                optimizer.push(t)
            } else {
                params.push(t)
            }
        };
        let layout = self.shards.layout().cloned();
        let layout = layout.as_deref();
        for (i, s) in specs.iter().enumerate() {
            let t = whole(be.as_ref(), mesh, layout, i, self.shards.param(i))?;
            push(s.name.clone(), i, t, false);
        }
        for (i, suffix, t) in self.shards.opt_mut().state_mut() {
            let t = whole(be.as_ref(), mesh, layout, i, t)?;
            push(format!("{}.{suffix}", specs[i].name), i, t, true);
        }
        if self.mesh.dp_shard.rank() != 0 {
            return Ok(None);
        }
        let manifest = Manifest::at(self.config(), at, self.opt_step());
        let cd = CheckpointData {
            manifest: &manifest,
            params,
            optimizer,
            extra_files: checkpoint::run_tokenizer_file(run_dir),
        };
        Ok(Some(checkpoint::save_with(
            run_dir,
            &cd,
            &retention(self.config()),
        )?))
    }

    /// Load a checkpoint (gathered or sharded, written at any rank count and mesh shape): each
    /// rank keeps its part.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<Manifest> {
        self.settle_opt_state();
        let manifest = checkpoint::read_manifest(dir)?;
        let (mut model, mut opt) = checkpoint::read_tensors(dir)?;
        let specs = self.model.param_specs().to_vec();
        // Parameter `i`'s part on this rank, from the whole tensor `name` of `host`.
        let mine = |me: &Self, host: &mut HostTensors, name: &str, i: usize| -> Result<Vec<f32>> {
            let Some((shape, data)) = host.remove(name) else {
                bail!("{}: tensor {name} is missing", dir.display());
            };
            if shape != specs[i].shape {
                bail!(
                    "{}: tensor {name} has shape {shape:?}, the model expects {:?}",
                    dir.display(),
                    specs[i].shape
                );
            }
            let Some(layout) = me.shards.layout() else {
                return Ok(data);
            };
            let g = crate::fsdp::Groups::of(&me.mesh);
            let r = layout.range(i, g.get(layout.group[i]).rank());
            let mut shard = vec![0f32; layout.shard[i]];
            let o = layout.offset[i];
            shard[..r.len()].copy_from_slice(&data[o + r.start..o + r.end]);
            Ok(shard)
        };
        for (i, s) in specs.iter().enumerate() {
            let part = mine(self, &mut model, &s.name, i)?;
            let be = self.be.clone();
            be.write(self.shards.params_mut()[i].view_mut(), &part);
        }
        let names: Vec<(usize, &'static str)> = self
            .opt_state()
            .into_iter()
            .map(|(i, n, _)| (i, n))
            .collect();
        for (k, (i, suffix)) in names.into_iter().enumerate() {
            let part = mine(self, &mut opt, &format!("{}.{suffix}", specs[i].name), i)?;
            let be = self.be.clone();
            be.write(self.opt_state().swap_remove(k).2.view_mut(), &part);
        }
        if let Some(extra) = model.keys().chain(opt.keys()).next() {
            bail!("{}: unexpected tensor {extra}", dir.display());
        }
        self.shards
            .opt_mut()
            .set_step_count(manifest.optimizer_step);
        Ok(manifest)
    }

    /// Collective: every rank writes its shards; rank 0 then writes the layout record and makes
    /// the checkpoint directory (returned there).
    fn save_sharded_checkpoint(
        &mut self,
        run_dir: &Path,
        at: &Position,
    ) -> Result<Option<PathBuf>> {
        let layout = self.shards.layout().cloned();
        let layout = layout.expect("sharded checkpoints are written by sharded runs");
        self.settle_opt_state();
        let world = self.mesh.dp_shard.clone();
        let stage = checkpoint::checkpoints_root(run_dir)
            .join(format!(".shards-{}", checkpoint::dir_name(at.step)));
        std::fs::create_dir_all(&stage)?;
        let mut tensors: NamedTensors = Vec::new();
        for (i, s) in layout.specs.iter().enumerate() {
            let d = self.be.download(self.shards.param(i).view());
            tensors.push((s.name.clone(), vec![d.len()], d));
        }
        let be = self.be.clone();
        for (i, suffix, t) in self.opt_state() {
            let d = be.download(t.view());
            tensors.push((
                format!("{}.{suffix}", layout.specs[i].name),
                vec![d.len()],
                d,
            ));
        }
        let file = stage.join(format!("rank{}.safetensors", world.rank()));
        std::fs::write(&file, checkpoint::to_safetensors_bytes(&tensors, None)?)?;
        // Every shard is on disk before rank 0 seals the checkpoint.
        world.barrier()?;
        if world.rank() != 0 {
            world.barrier()?;
            return Ok(None);
        }
        let sm = ShardsManifest {
            dp_shard: self.mesh.shape.dp_shard,
            ep: self.mesh.shape.ep,
            params: (0..layout.specs.len())
                .map(|i| ShardedParam {
                    name: layout.specs[i].name.clone(),
                    shape: layout.specs[i].shape.clone(),
                    slice_elems: layout.numel(i),
                    efsdp: layout.group[i] == ganymede_dist::placement::ShardGroup::Efsdp,
                    shard_elems: layout.shard[i],
                })
                .collect(),
        };
        let smj = stage.join(SHARDS_FILE);
        std::fs::write(&smj, serde_json::to_vec_pretty(&sm)?)?;
        let manifest = Manifest::at(self.config(), at, self.opt_step());
        let mut extra_files = vec![(SHARDS_FILE.to_string(), smj)];
        for r in 0..world.size() {
            extra_files.push((
                sharded::rank_file(r),
                stage.join(format!("rank{r}.safetensors")),
            ));
        }
        extra_files.extend(checkpoint::run_tokenizer_file(run_dir));
        // The single-process files stay empty: this checkpoint's tensors are in the shards.
        let cd = CheckpointData {
            manifest: &manifest,
            params: vec![],
            optimizer: vec![],
            extra_files,
        };
        let dir = checkpoint::save_with(run_dir, &cd, &retention(self.config()))?;
        let _ = std::fs::remove_dir_all(&stage);
        world.barrier()?;
        Ok(Some(dir))
    }
}

//! Checkpoints of a sharded run, in two forms; both load at any rank count.
//!
//! - Gathered (default): every tensor is gathered whole and rank 0 writes the single-process
//!   files (`model.safetensors`, `optimizer.safetensors`), so the plain trainer, `eval` and
//!   `export` read them too. Loading keeps each rank's shard.
//! - Sharded ([`crate::ParOptions::sharded_checkpoints`]): each rank writes its own shards of
//!   parameters and optimizer state (`shards/rank<r>.safetensors`, nothing gathered) and
//!   `shards.json` says how they fit (mesh shape, each parameter's group, shard size and
//!   expert-parallel slice). Loading reassembles each tensor from the pieces and keeps this
//!   rank's shard of the new layout. (Every rank reads every file: simple, and fine at the
//!   sizes one machine trains.)

use crate::driver::RankState;
use anyhow::{bail, Result};
use ganymede_core::{Memory, TMut, Tensor};
use ganymede_dist::Phase;
use ganymede_train::checkpoint::{self, CheckpointData, Manifest, NamedTensors};
use std::path::{Path, PathBuf};

/// Layout record of a sharded checkpoint.
pub const SHARDS_FILE: &str = "shards.json";

pub use ganymede_train::checkpoint::Position;

impl RankState {
    /// Collective: gather a shard of parameter `i`'s layout into the whole tensor.
    pub(crate) fn gather_whole(&self, i: usize, shard: &Tensor) -> Result<Vec<f32>> {
        let g = crate::fsdp::Groups::of(&self.mesh);
        let g = g.get(self.layout.group[i]);
        let mut all = vec![0f32; self.layout.shard[i] * g.size()];
        g.all_gather(shard.v(), TMut::Host(&mut all), Phase::Other)?;
        all.truncate(self.layout.numel(i));
        if self.layout.numel(i) < self.layout.specs[i].numel() {
            // Routed experts under expert parallelism: the ep slices in ep-rank order.
            let mut whole = vec![0f32; self.layout.specs[i].numel()];
            self.mesh.ep.all_gather(
                ganymede_core::T::Host(&all),
                TMut::Host(&mut whole),
                Phase::Other,
            )?;
            return Ok(whole);
        }
        Ok(all)
    }

    /// Collective: save a checkpoint under `run_dir` (rank 0 writes; returns its directory there).
    pub fn save_checkpoint(&mut self, run_dir: &Path, at: &Position) -> Result<Option<PathBuf>> {
        let specs = self.layout.specs.clone();
        let mut params: NamedTensors = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            let whole = self.gather_whole(i, &self.params.master[i])?;
            params.push((s.name.clone(), s.shape.clone(), whole));
        }
        let mut optimizer: NamedTensors = Vec::new();
        let states: Vec<(usize, &'static str)> = self
            .opt
            .state_mut()
            .into_iter()
            .map(|(i, n, _)| (i, n))
            .collect();
        for (k, (i, suffix)) in states.into_iter().enumerate() {
            let shard = self.be.download(self.opt.state_mut()[k].2.v());
            let t = self
                .be
                .upload(&shard, &[shard.len()], ganymede_core::Category::Buffers);
            let whole = self.gather_whole(i, &t)?;
            let s = &specs[i];
            optimizer.push((format!("{}.{suffix}", s.name), s.shape.clone(), whole));
        }
        if self.mesh.dp_shard.rank() != 0 {
            return Ok(None);
        }
        let manifest = Manifest::at(self.config(), at, self.opt.step_count());
        let cd = CheckpointData {
            manifest: &manifest,
            params,
            optimizer,
            extra_files: checkpoint::run_tokenizer_file(run_dir),
        };
        Ok(Some(checkpoint::save(run_dir, &cd)?))
    }

    /// Load a checkpoint (gathered or sharded) written at any rank count: each rank keeps its
    /// shards.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<Manifest> {
        if dir.join(SHARDS_FILE).is_file() {
            return self.load_sharded(dir);
        }
        let manifest = checkpoint::read_manifest(dir)?;
        let mut model = checkpoint::read_safetensors(&dir.join(checkpoint::MODEL_FILE))?;
        let mut opt = checkpoint::read_safetensors(&dir.join(checkpoint::OPTIMIZER_FILE))?;
        let specs = self.layout.specs.clone();
        let take = |host: &mut checkpoint::HostTensors, name: &str, i: usize, me: &Self| {
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
            let g = crate::fsdp::Groups::of(&me.mesh);
            let r = me.layout.range(i, g.get(me.layout.group[i]).rank());
            let mut shard = vec![0f32; me.layout.shard[i]];
            let o = me.layout.offset[i];
            shard[..r.len()].copy_from_slice(&data[o + r.start..o + r.end]);
            Ok(shard)
        };
        for (i, s) in specs.iter().enumerate() {
            let shard = take(&mut model, &s.name, i, self)?;
            self.be.write(self.params.master[i].vm(), &shard);
        }
        let names: Vec<(usize, &'static str)> = self
            .opt
            .state_mut()
            .into_iter()
            .map(|(i, n, _)| (i, n))
            .collect();
        for (k, (i, suffix)) in names.into_iter().enumerate() {
            let shard = take(&mut opt, &format!("{}.{suffix}", specs[i].name), i, self)?;
            let be = &self.be;
            be.write(self.opt.state_mut()[k].2.vm(), &shard);
        }
        if let Some(extra) = model.keys().chain(opt.keys()).next() {
            bail!("{}: unexpected tensor {extra}", dir.display());
        }
        self.opt.set_step_count(manifest.optimizer_step);
        Ok(manifest)
    }
}

/// Where each saved piece of a tensor belongs.
#[derive(serde::Serialize, serde::Deserialize)]
struct ShardsManifest {
    dp_shard: usize,
    ep: usize,
    params: Vec<ShardedParam>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ShardedParam {
    name: String,
    shape: Vec<usize>,
    /// Elements of one expert-parallel slice (the whole tensor unless routed under ep > 1).
    slice_elems: usize,
    /// Sharded over the expert-FSDP group (routed experts) rather than all ranks.
    efsdp: bool,
    shard_elems: usize,
}

impl RankState {
    fn shard_tensors(&mut self) -> NamedTensors {
        let specs = self.layout.specs.clone();
        let mut out: NamedTensors = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            let d = self.be.download(self.params.master[i].v());
            out.push((s.name.clone(), vec![d.len()], d));
        }
        for (i, suffix, t) in self.opt.state_mut() {
            let d = t.v().host::<f32>().to_vec();
            out.push((format!("{}.{suffix}", specs[i].name), vec![d.len()], d));
        }
        out
    }

    /// Collective: every rank writes its shards; rank 0 then writes the manifest and makes the
    /// checkpoint directory (returned there).
    pub fn save_sharded_checkpoint(
        &mut self,
        run_dir: &Path,
        at: &Position,
    ) -> Result<Option<PathBuf>> {
        let world = self.mesh.dp_shard.clone();
        let stage = checkpoint::checkpoints_root(run_dir)
            .join(format!(".shards-{}", checkpoint::dir_name(at.step)));
        std::fs::create_dir_all(&stage)?;
        let tensors = self.shard_tensors();
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
            params: (0..self.layout.specs.len())
                .map(|i| ShardedParam {
                    name: self.layout.specs[i].name.clone(),
                    shape: self.layout.specs[i].shape.clone(),
                    slice_elems: self.layout.numel(i),
                    efsdp: self.layout.group[i] == ganymede_dist::placement::ShardGroup::Efsdp,
                    shard_elems: self.layout.shard[i],
                })
                .collect(),
        };
        let smj = stage.join(SHARDS_FILE);
        std::fs::write(&smj, serde_json::to_vec_pretty(&sm)?)?;
        let manifest = Manifest::at(self.config(), at, self.opt.step_count());
        let mut extra_files = vec![(SHARDS_FILE.to_string(), smj)];
        for r in 0..world.size() {
            extra_files.push((
                format!("shard-rank{r}.safetensors"),
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
        let dir = checkpoint::save(run_dir, &cd)?;
        let _ = std::fs::remove_dir_all(&stage);
        world.barrier()?;
        Ok(Some(dir))
    }

    /// Load a sharded checkpoint written at any mesh shape.
    fn load_sharded(&mut self, dir: &Path) -> Result<Manifest> {
        let manifest = checkpoint::read_manifest(dir)?;
        let sm: ShardsManifest = serde_json::from_slice(&std::fs::read(dir.join(SHARDS_FILE))?)?;
        let files: Vec<checkpoint::HostTensors> = (0..sm.dp_shard)
            .map(|r| checkpoint::read_safetensors(&dir.join(format!("shard-rank{r}.safetensors"))))
            .collect::<Result<_>>()?;
        // The whole tensor named `name` (parameter `p` of the saved layout), from its pieces.
        let whole = |p: &ShardedParam, name: &str| -> Result<Vec<f32>> {
            let mut out = vec![0f32; p.shape.iter().product()];
            for (r, f) in files.iter().enumerate() {
                let Some((_, piece)) = f.get(name) else {
                    bail!("{}: rank {r}'s shard lacks {name}", dir.display());
                };
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
        };
        let specs = self.layout.specs.clone();
        let mine = |me: &Self, i: usize, data: &[f32]| -> Vec<f32> {
            let g = crate::fsdp::Groups::of(&me.mesh);
            let r = me.layout.range(i, g.get(me.layout.group[i]).rank());
            let mut shard = vec![0f32; me.layout.shard[i]];
            let o = me.layout.offset[i];
            shard[..r.len()].copy_from_slice(&data[o + r.start..o + r.end]);
            shard
        };
        for (i, s) in specs.iter().enumerate() {
            let Some(p) = sm.params.iter().find(|p| p.name == s.name) else {
                bail!(
                    "{}: no parameter {} in {SHARDS_FILE}",
                    dir.display(),
                    s.name
                );
            };
            if p.shape != s.shape {
                bail!(
                    "{}: {} has shape {:?}, the model expects {:?}",
                    dir.display(),
                    s.name,
                    p.shape,
                    s.shape
                );
            }
            let shard = mine(self, i, &whole(p, &s.name)?);
            self.be.write(self.params.master[i].vm(), &shard);
        }
        let names: Vec<(usize, &'static str)> = self
            .opt
            .state_mut()
            .into_iter()
            .map(|(i, n, _)| (i, n))
            .collect();
        for (k, (i, suffix)) in names.into_iter().enumerate() {
            let p = sm.params.iter().find(|p| p.name == specs[i].name).unwrap();
            let w = whole(p, &format!("{}.{suffix}", specs[i].name))?;
            let shard = mine(self, i, &w);
            let be = &self.be;
            be.write(self.opt.state_mut()[k].2.vm(), &shard);
        }
        self.opt.set_step_count(manifest.optimizer_step);
        Ok(manifest)
    }
}

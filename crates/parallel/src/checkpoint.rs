//! Checkpoints of a sharded run, in the single-process format: every tensor is gathered whole
//! and rank 0 writes `model.safetensors`, `optimizer.safetensors` and the manifest. Loading
//! reads the whole files on every rank and keeps each rank's shard, so a checkpoint written at
//! N ranks loads at any rank count (and by the single-process trainer, `eval`, `export`).
//! Per-rank shard files with a manifest of how they fit are the scalable form; this gathered one
//! is what a machine-sized model needs.

use crate::driver::RankState;
use anyhow::{bail, Result};
use ganymede_core::{Memory, TMut, Tensor};
use ganymede_dist::Phase;
use ganymede_train::checkpoint::{
    self, CheckpointData, DataPosition, Manifest, NamedTensors, RngState,
};
use std::path::{Path, PathBuf};

/// Where a run stands.
pub struct Position {
    pub step: usize,
    pub tokens_seen: u64,
    pub data_seed: u64,
}

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
        let cfg = self.config();
        let manifest = Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            step: at.step,
            optimizer_step: self.opt.step_count(),
            config: cfg.to_toml(),
            data: DataPosition {
                seed: at.data_seed,
                next_step: at.step,
            },
            rng: RngState {
                seed: cfg.training.seed,
            },
            tokens_seen: at.tokens_seen,
        };
        let tok = run_dir.join("data").join(ganymede_data::TOKENIZER_FILE);
        let extra_files = if tok.is_file() {
            vec![(checkpoint::TOKENIZER_FILE.to_string(), tok)]
        } else {
            vec![]
        };
        let cd = CheckpointData {
            manifest: &manifest,
            params,
            optimizer,
            extra_files,
        };
        Ok(Some(checkpoint::save(run_dir, &cd)?))
    }

    /// Load a checkpoint written at any rank count: each rank keeps its shards.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<Manifest> {
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

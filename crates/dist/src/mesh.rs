//! The device mesh over (dp_shard × ep), as TorchTitan lays it out.
//!
//! The world is the `dp_shard` group (no replication or pipeline dimensions yet). Rank
//! `r = f·ep + e`: expert-parallel groups are `ep` consecutive ranks (one node's GPUs, so the
//! token all-to-all stays on NVLink), and the expert-FSDP group of size `dp_shard / ep` holds the
//! ranks with the same `e`, one per expert-parallel group, which shard that slice's experts.

use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use ganymede_config::ParallelismConfig;
use std::sync::Arc;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MeshError {
    #[error(
        "parallelism.ep = {ep} must be at least 1 and divide parallelism.dp_shard = {dp_shard}"
    )]
    EpDoesNotDivide { dp_shard: usize, ep: usize },
    #[error("parallelism.dp_shard = {dp_shard} but the job has {world} ranks; start as many ranks as dp_shard")]
    WorldSize { dp_shard: usize, world: usize },
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// The shape alone: coordinates and group members, no communication (the planner and tests use
/// it too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MeshShape {
    pub dp_shard: usize,
    pub ep: usize,
}

impl MeshShape {
    pub fn new(dp_shard: usize, ep: usize) -> Result<Self, MeshError> {
        if ep == 0 || dp_shard == 0 || !dp_shard.is_multiple_of(ep) {
            return Err(MeshError::EpDoesNotDivide { dp_shard, ep });
        }
        Ok(Self { dp_shard, ep })
    }
    pub fn from_config(p: &ParallelismConfig) -> Result<Self, MeshError> {
        Self::new(p.dp_shard, p.ep)
    }
    pub fn world(&self) -> usize {
        self.dp_shard
    }
    /// Size of the expert-FSDP group.
    pub fn efsdp(&self) -> usize {
        self.dp_shard / self.ep
    }
    /// `(efsdp index, ep index)` of a rank.
    pub fn coords(&self, rank: usize) -> (usize, usize) {
        (rank / self.ep, rank % self.ep)
    }
    /// World ranks of the expert-parallel group containing `rank`, in group-rank order.
    pub fn ep_members(&self, rank: usize) -> Vec<usize> {
        let f = rank / self.ep;
        (0..self.ep).map(|e| f * self.ep + e).collect()
    }
    /// World ranks of the expert-FSDP group containing `rank`, in group-rank order.
    pub fn efsdp_members(&self, rank: usize) -> Vec<usize> {
        let e = rank % self.ep;
        (0..self.efsdp()).map(|f| f * self.ep + e).collect()
    }
}

/// This rank's groups.
pub struct DeviceMesh {
    pub shape: MeshShape,
    /// All ranks: dense parameters are sharded here.
    pub dp_shard: Arc<dyn ProcessGroup>,
    /// The token all-to-all group (size `ep`).
    pub ep: Arc<dyn ProcessGroup>,
    /// The group that shards this rank's expert slice (size `dp_shard / ep`).
    pub efsdp: Arc<dyn ProcessGroup>,
}

impl DeviceMesh {
    /// Collective over `world`: checks the shape and splits the sub-groups.
    pub fn new(world: Arc<dyn ProcessGroup>, cfg: &ParallelismConfig) -> Result<Self, MeshError> {
        let shape = MeshShape::from_config(cfg)?;
        if world.size() != shape.world() {
            return Err(MeshError::WorldSize {
                dp_shard: shape.dp_shard,
                world: world.size(),
            });
        }
        let r = world.rank();
        let (f, e) = shape.coords(r);
        let ep = world
            .split(Some(f), e, "ep")?
            .expect("member of its ep group");
        let efsdp = world
            .split(Some(e), f, "efsdp")?
            .expect("member of its efsdp group");
        Ok(Self {
            shape,
            dp_shard: world,
            ep,
            efsdp,
        })
    }
}

//! The device mesh over (dp_replicate × dp_shard × ep), as TorchTitan lays it out.
//!
//! The world is `dp_replicate` replicas of the `dp_shard` group (HSDP), replicate outermost:
//! world rank `w = q·dp_shard + s` for replica `q` and shard rank `s`, so one replica's ranks
//! are consecutive. Within a replica, shard rank `s = f·ep + e`: expert-parallel groups are `ep`
//! consecutive ranks (one node's GPUs, so the token all-to-all stays on NVLink), and the
//! expert-FSDP group of size `dp_shard / ep` holds the ranks with the same `e`, one per
//! expert-parallel group, which shard that slice's experts. The replicate group holds the ranks
//! with the same `s`, one per replica: they own the same shards, so gradients are all-reduced
//! there. The coordinate methods of [`MeshShape`] below take shard ranks (within a replica).

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
    #[error("parallelism.dp_replicate × parallelism.dp_shard = {dp_replicate} × {dp_shard} = {} but the job has {world} ranks; start dp_replicate × dp_shard ranks", dp_replicate * dp_shard)]
    WorldSize {
        dp_replicate: usize,
        dp_shard: usize,
        world: usize,
    },
    #[error("parallelism.dp_replicate = {dp_replicate} must be at least 1")]
    NoReplicas { dp_replicate: usize },
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// The shape alone: coordinates and group members, no communication (the planner and tests use
/// it too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MeshShape {
    /// Replicas (HSDP); 1 is plain FSDP.
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub ep: usize,
}

impl MeshShape {
    /// One replica of (dp_shard × ep).
    pub fn new(dp_shard: usize, ep: usize) -> Result<Self, MeshError> {
        Self::hsdp(1, dp_shard, ep)
    }
    /// `dp_replicate` replicas of (dp_shard × ep).
    pub fn hsdp(dp_replicate: usize, dp_shard: usize, ep: usize) -> Result<Self, MeshError> {
        if dp_replicate == 0 {
            return Err(MeshError::NoReplicas { dp_replicate });
        }
        if ep == 0 || dp_shard == 0 || !dp_shard.is_multiple_of(ep) {
            return Err(MeshError::EpDoesNotDivide { dp_shard, ep });
        }
        Ok(Self {
            dp_replicate,
            dp_shard,
            ep,
        })
    }
    pub fn from_config(p: &ParallelismConfig) -> Result<Self, MeshError> {
        Self::hsdp(p.dp_replicate, p.dp_shard, p.ep)
    }
    /// All ranks: `dp_replicate × dp_shard`.
    pub fn world(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }
    /// `(replica, shard rank)` of a world rank.
    pub fn replica_coords(&self, world_rank: usize) -> (usize, usize) {
        (world_rank / self.dp_shard, world_rank % self.dp_shard)
    }
    /// World ranks of the replicate group containing `world_rank`, in replica order.
    pub fn replicate_members(&self, world_rank: usize) -> Vec<usize> {
        let s = world_rank % self.dp_shard;
        (0..self.dp_replicate)
            .map(|q| q * self.dp_shard + s)
            .collect()
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
    /// All ranks of the job: the data is split and the loss summed here.
    pub world: Arc<dyn ProcessGroup>,
    /// This replica's ranks: dense parameters are sharded here (the world when
    /// `dp_replicate = 1`).
    pub dp_shard: Arc<dyn ProcessGroup>,
    /// The ranks holding the same shards in every replica (size `dp_replicate`); `None` without
    /// replicas.
    pub replicate: Option<Arc<dyn ProcessGroup>>,
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
                dp_replicate: shape.dp_replicate,
                dp_shard: shape.dp_shard,
                world: world.size(),
            });
        }
        let (q, s) = shape.replica_coords(world.rank());
        // Without replicas the replica is the world itself: no split, so nothing changes for
        // plain FSDP.
        let (dp_shard, replicate) = if shape.dp_replicate == 1 {
            (world.clone(), None)
        } else {
            let dp = world
                .split(Some(q), s, "dp_shard")?
                .expect("member of its replica");
            let rep = world
                .split(Some(s), q, "replicate")?
                .expect("member of its replicate group");
            (dp, Some(rep))
        };
        let (f, e) = shape.coords(s);
        let ep = dp_shard
            .split(Some(f), e, "ep")?
            .expect("member of its ep group");
        let efsdp = dp_shard
            .split(Some(e), f, "efsdp")?
            .expect("member of its efsdp group");
        Ok(Self {
            shape,
            world,
            dp_shard,
            replicate,
            ep,
            efsdp,
        })
    }
}

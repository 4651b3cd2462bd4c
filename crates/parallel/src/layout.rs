//! Which unit each parameter belongs to and how it is cut into shards.
//!
//! Units follow FSDP2's `fully_shard` per transformer block: block `l`'s parameters are one unit,
//! gathered together; the embedding, final norm and LM head form the root unit, gathered at the
//! start of a step and kept until its end (TorchTitan wraps the root module the same way).
//! Every parameter is a flat array cut into `world` equal pieces of `shard_elems` elements
//! (the placement plan's figure, padding included): rank `j` holds elements
//! `[j·shard_elems, (j+1)·shard_elems)`, zero-padded past the end. Dim-0 shards and whole-expert
//! shards are both of this form, so one gather serves both placements.

use ganymede_core::ParamSpec;
use ganymede_dist::placement::{Plan, ShardGroup};

pub struct Layout {
    pub specs: Vec<ParamSpec>,
    /// Elements each rank stores of each parameter (padding included).
    pub shard: Vec<usize>,
    /// Group each parameter is sharded over.
    pub group: Vec<ShardGroup>,
    /// Shape of what this rank's group gathers: routed experts under expert parallelism hold
    /// `E/ep` experts (this rank's ep slice), everything else its full shape.
    pub local_shape: Vec<Vec<usize>>,
    /// Where that slice starts in the full flat tensor.
    pub offset: Vec<usize>,
    /// Parameter indices of each block unit, in table order.
    pub blocks: Vec<Vec<usize>>,
    /// Parameter indices of the root unit.
    pub root: Vec<usize>,
}

/// The block a parameter name belongs to (`model.layers.{l}.…`), if any.
fn block_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

impl Layout {
    /// `ep_rank`: this rank's index in its expert-parallel group.
    pub fn new(specs: &[ParamSpec], layers: usize, plan: &Plan, ep_rank: usize) -> Self {
        assert_eq!(
            specs.len(),
            plan.params.len(),
            "plan is for other parameters"
        );
        let mut blocks = vec![Vec::new(); layers];
        let mut root = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            match block_of(&s.name) {
                Some(l) => blocks[l].push(i),
                None => root.push(i),
            }
        }
        Layout {
            specs: specs.to_vec(),
            shard: plan.params.iter().map(|p| p.shard_elems).collect(),
            group: plan.params.iter().map(|p| p.group).collect(),
            local_shape: plan.params.iter().map(|p| p.local_shape.clone()).collect(),
            offset: plan
                .params
                .iter()
                .map(|p| {
                    let n: usize = p.local_shape.iter().product();
                    if p.group == ShardGroup::Efsdp {
                        ep_rank * n
                    } else {
                        0
                    }
                })
                .collect(),
            blocks,
            root,
        }
    }

    /// Elements of what is gathered (this rank's ep slice for routed experts).
    pub fn numel(&self, i: usize) -> usize {
        self.local_shape[i].iter().product()
    }

    /// Real (unpadded) elements of the gathered flat array held by group rank `rank`.
    pub fn range(&self, i: usize, rank: usize) -> std::ops::Range<usize> {
        let n = self.numel(i);
        let s = self.shard[i];
        (rank * s).min(n)..((rank + 1) * s).min(n)
    }
}

//! One parameter's optimizer state and one step's constants: what the whole-parameter
//! [`crate::Optimizer`] and the sharded optimizer (`ganymede_parallel::optim`) both hold. The
//! rule ([`UpdateRule`]) says how a parameter is updated ([`crate::Step::update`]); its state,
//! the checkpoint names of that state and the walk over host-resident state are written here
//! once, whether the tensors are whole parameters or a rank's shards.

use crate::{Staging, UpdateRule};
use ganymede_core::{Backend, Category, Tensor};

/// The state of one parameter (or of a rank's shard of it) under its [`UpdateRule`].
pub enum ParamState {
    Muon { momentum: Tensor },
    AdamW { m: Tensor, v: Tensor },
    Frozen,
}

impl ParamState {
    /// Zeroed state for `rule` over `shape` (the parameter's, or `[n]` for a shard of `n`
    /// elements), in pinned host memory when `host` (`optimizer.offload`).
    pub fn new(be: &dyn Backend, rule: &UpdateRule, shape: &[usize], host: bool) -> Self {
        let zeros = || match host {
            true => be.pinned_zeros(shape, Category::Optimizer),
            false => be.zeros(shape, Category::Optimizer),
        };
        match rule {
            UpdateRule::Muon { .. } => ParamState::Muon { momentum: zeros() },
            UpdateRule::AdamW { .. } => ParamState::AdamW {
                m: zeros(),
                v: zeros(),
            },
            UpdateRule::Frozen => ParamState::Frozen,
        }
    }

    /// The state tensors with their checkpoint suffixes (`muon_momentum`; `adam_m`, `adam_v`).
    pub fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            ParamState::Muon { momentum } => vec![("muon_momentum", momentum)],
            ParamState::AdamW { m, v } => vec![("adam_m", m), ("adam_v", v)],
            ParamState::Frozen => vec![],
        }
    }

    pub fn tensors_mut(&mut self) -> Vec<(&'static str, &mut Tensor)> {
        match self {
            ParamState::Muon { momentum } => vec![("muon_momentum", momentum)],
            ParamState::AdamW { m, v } => vec![("adam_m", m), ("adam_v", v)],
            ParamState::Frozen => vec![],
        }
    }

    /// Elements of all its tensors together.
    pub fn len(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Every state tensor as (parameter index, checkpoint suffix, tensor), in parameter order: the
/// form both optimizers give their checkpoints.
pub fn indexed_state_mut(states: &mut [ParamState]) -> Vec<(usize, &'static str, &mut Tensor)> {
    let mut out = Vec::new();
    for (i, s) in states.iter_mut().enumerate() {
        out.extend(s.tensors_mut().into_iter().map(|(k, t)| (i, k, t)));
    }
    out
}

/// Host-resident state (`optimizer.offload`): stream every parameter with state through the
/// staging slots, calling `update(i, slot)` with the parameter's index and the device slot that
/// holds, one after another, `extra(i)` (tensors staged before the state, such as a
/// host-resident parameter shard) and the state's tensors; written back when it returns.
pub fn stream_states<'a>(
    be: &dyn Backend,
    staging: &mut Staging,
    states: &'a mut [ParamState],
    mut extra: impl FnMut(usize) -> Vec<&'a mut Tensor>,
    mut update: impl FnMut(usize, ganymede_core::ViewMut),
) {
    let mut which = Vec::new();
    let mut staged: Vec<Vec<&mut Tensor>> = Vec::new();
    for (i, s) in states.iter_mut().enumerate() {
        if let ParamState::Frozen = s {
            continue;
        }
        let mut ts = extra(i);
        ts.extend(s.tensors_mut().into_iter().map(|(_, t)| t));
        staged.push(ts);
        which.push(i);
    }
    staging.stream(be, &mut staged, |k, slot| update(which[k], slot));
}

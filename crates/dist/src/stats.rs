//! Byte accounting: bytes sent and received on this rank, per [`Phase`] and collective [`Op`].
//!
//! The counts are the logical volume of a direct algorithm, independent of how the backend
//! routes data, so the planner and the placement formulas can predict them exactly. With `W`
//! ranks, `n` bytes per rank's piece, and `me` excluded from its own traffic:
//! all-gather `(W-1)n` each way; reduce-scatter (`n` = output chunk) `(W-1)n` each way;
//! all-reduce of `n` bytes `2(W-1)n/W` each way (integer division; the ring volume);
//! all-to-all: the bytes addressed to / received from other ranks; broadcast and scatter: the
//! root sends `(W-1)n`, the others receive `n`; reduce and gather: the others send `n`, the
//! root receives `(W-1)n`; barrier: nothing.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What a collective is for, so a step's traffic can be told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    ForwardGather,
    BackwardGather,
    GradReduceScatter,
    /// HSDP: the gradient shards all-reduced across replicas.
    GradReplicaAllReduce,
    A2aDispatch,
    A2aCombine,
    Optimizer,
    Other,
}

pub const PHASES: [Phase; 8] = [
    Phase::ForwardGather,
    Phase::BackwardGather,
    Phase::GradReduceScatter,
    Phase::GradReplicaAllReduce,
    Phase::A2aDispatch,
    Phase::A2aCombine,
    Phase::Optimizer,
    Phase::Other,
];

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::ForwardGather => "forward_gather",
            Phase::BackwardGather => "backward_gather",
            Phase::GradReduceScatter => "grad_reduce_scatter",
            Phase::GradReplicaAllReduce => "grad_replica_all_reduce",
            Phase::A2aDispatch => "a2a_dispatch",
            Phase::A2aCombine => "a2a_combine",
            Phase::Optimizer => "optimizer",
            Phase::Other => "other",
        }
    }
    fn index(self) -> usize {
        PHASES.iter().position(|&p| p == self).unwrap()
    }
}

/// The collective kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
    AllToAllV,
    Broadcast,
    Reduce,
    Gather,
    Scatter,
    Barrier,
    Split,
}

pub const OPS: [Op; 10] = [
    Op::AllGather,
    Op::ReduceScatter,
    Op::AllReduce,
    Op::AllToAllV,
    Op::Broadcast,
    Op::Reduce,
    Op::Gather,
    Op::Scatter,
    Op::Barrier,
    Op::Split,
];

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::AllToAllV => "alltoallv",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
            Op::Barrier => "barrier",
            Op::Split => "split",
        }
    }
    fn index(self) -> usize {
        OPS.iter().position(|&o| o == self).unwrap()
    }
}

/// Bytes this rank sends and receives in one collective call, by the convention above.
/// `elem` is the element size, `root` whether this rank is the root of a rooted collective.
pub fn volume(op: Op, world: usize, piece_elems: usize, elem: usize, root: bool) -> (u64, u64) {
    let w = world as u64;
    let n = (piece_elems * elem) as u64;
    let others = w.saturating_sub(1);
    match op {
        Op::AllGather | Op::ReduceScatter => (others * n, others * n),
        Op::AllReduce => (2 * others * n / w.max(1), 2 * others * n / w.max(1)),
        Op::Broadcast | Op::Scatter if root => (others * n, 0),
        Op::Broadcast | Op::Scatter => (0, n),
        Op::Reduce | Op::Gather if root => (0, others * n),
        Op::Reduce | Op::Gather => (n, 0),
        // The caller counts all-to-all from its split sizes.
        Op::AllToAllV | Op::Barrier | Op::Split => (0, 0),
    }
}

#[derive(Default)]
struct Cell {
    calls: AtomicU64,
    sent: AtomicU64,
    recv: AtomicU64,
}

/// Per-rank counters, shared by every group handle of the rank (sub-groups included).
pub struct CommStats {
    cells: Vec<Cell>, // PHASES x OPS
}

impl Default for CommStats {
    fn default() -> Self {
        Self {
            cells: (0..PHASES.len() * OPS.len())
                .map(|_| Cell::default())
                .collect(),
        }
    }
}

impl CommStats {
    pub fn record(&self, phase: Phase, op: Op, sent: u64, recv: u64) {
        let c = &self.cells[phase.index() * OPS.len() + op.index()];
        c.calls.fetch_add(1, Relaxed);
        c.sent.fetch_add(sent, Relaxed);
        c.recv.fetch_add(recv, Relaxed);
    }

    /// Zero every counter (at the start of a step).
    pub fn reset(&self) {
        for c in &self.cells {
            c.calls.store(0, Relaxed);
            c.sent.store(0, Relaxed);
            c.recv.store(0, Relaxed);
        }
    }

    pub fn snapshot(&self) -> CommSnapshot {
        let mut entries = Vec::new();
        for (pi, &phase) in PHASES.iter().enumerate() {
            for (oi, &op) in OPS.iter().enumerate() {
                let c = &self.cells[pi * OPS.len() + oi];
                let calls = c.calls.load(Relaxed);
                if calls > 0 {
                    entries.push(CommEntry {
                        phase,
                        op,
                        calls,
                        bytes_sent: c.sent.load(Relaxed),
                        bytes_recv: c.recv.load(Relaxed),
                    });
                }
            }
        }
        CommSnapshot { entries }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CommEntry {
    pub phase: Phase,
    pub op: Op,
    pub calls: u64,
    pub bytes_sent: u64,
    pub bytes_recv: u64,
}

/// A copy of the counters; only non-zero (phase, op) cells are listed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CommSnapshot {
    pub entries: Vec<CommEntry>,
}

impl CommSnapshot {
    /// (sent, received) bytes in one phase, all collectives together.
    pub fn phase(&self, phase: Phase) -> (u64, u64) {
        self.entries
            .iter()
            .filter(|e| e.phase == phase)
            .fold((0, 0), |(s, r), e| (s + e.bytes_sent, r + e.bytes_recv))
    }
    /// (sent, received) bytes over all phases.
    pub fn total(&self) -> (u64, u64) {
        self.entries
            .iter()
            .fold((0, 0), |(s, r), e| (s + e.bytes_sent, r + e.bytes_recv))
    }
    /// `{phase: {"sent": .., "recv": ..}}`, the shape logged per step in metrics.jsonl.
    pub fn by_phase_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for p in PHASES {
            let (s, r) = self.phase(p);
            if s > 0 || r > 0 {
                m.insert(p.name().into(), serde_json::json!({"sent": s, "recv": r}));
            }
        }
        serde_json::Value::Object(m)
    }
}

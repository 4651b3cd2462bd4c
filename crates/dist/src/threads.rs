//! Ranks as threads of one process (`ganymede train --ranks N`).
//!
//! A collective is a slot in a table shared by the world, keyed by (group, sequence number).
//! Posting copies this rank's contribution into the slot (the "send"); `wait` blocks on a condvar
//! until every member has posted, then reads what this rank needs out of the slot (the
//! "receive"), summing in rank order so results do not depend on thread timing. So the `i*` forms
//! return at once and the transfer overlaps whatever the caller does before `wait`; nobody spins.
//!
//! Faults: `wait` gives up after the world's timeout, naming the ranks that never arrived; a
//! rank that panics poisons the world (every waiter wakes and fails naming it); a rank whose
//! world handle is dropped normally is marked exited, so waiting for it fails at once.

use crate::error::{CommError, Result};
use crate::group::{Call, Membership, Pending, ProcessGroup, RankCtx, Transport, Work};
use crate::stats::Op;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Options of a threads world.
#[derive(Clone, Debug)]
pub struct ThreadsConfig {
    /// How long `wait` blocks before a collective is declared stalled.
    pub timeout: Duration,
    /// Record per-rank timelines.
    pub trace: bool,
}

impl Default for ThreadsConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            trace: false,
        }
    }
}

/// A rank's contribution.
enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bf16(Vec<u16>),
    Nothing,
}

/// Host element types the backend moves.
trait Elem: Copy + std::ops::AddAssign + Send + Sync + 'static {
    fn wrap(v: Vec<Self>) -> Data;
    fn get(d: &Data) -> &[Self];
}
macro_rules! elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            fn wrap(v: Vec<$t>) -> Data {
                Data::$variant(v)
            }
            fn get(d: &Data) -> &[$t] {
                match d {
                    Data::$variant(v) => v,
                    _ => &[],
                }
            }
        }
    };
}
elem!(f32, F32);
elem!(f64, F64);
elem!(u16, Bf16);

/// What each rank says it is doing; all members must agree.
#[derive(Clone, Debug, PartialEq)]
struct Sig {
    op: Op,
    root: usize,
    elem: usize,
    /// The length every rank must agree on (piece size), or 0 where lengths may differ.
    len: usize,
}

struct Slot {
    sigs: Vec<Option<Sig>>,
    data: Vec<Option<Arc<Data>>>,
    meta: Vec<Arc<Vec<usize>>>,
    arrived: usize,
    consumed: usize,
    /// For `split`: the new group id of each color, made by the first rank to collect.
    new_groups: Option<Arc<HashMap<usize, u64>>>,
}

struct State {
    slots: HashMap<(u64, u64), Slot>,
    poisoned: Option<(usize, String)>,
    exited: Vec<bool>,
    next_group: u64,
}

struct World {
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl World {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot corrupt the table (no user code runs under
        // it), so a poisoned mutex is still usable; rank panics are reported separately.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn poison(&self, rank: usize, message: String) {
        let mut st = self.lock();
        if st.poisoned.is_none() {
            st.poisoned = Some((rank, message));
        }
        drop(st);
        self.cv.notify_all();
    }
    fn mark_exited(&self, rank: usize) {
        self.lock().exited[rank] = true;
        self.cv.notify_all();
    }
}

/// One rank's handle on a group of the threads world.
pub struct ThreadGroup {
    world: Arc<World>,
    id: u64,
    m: Membership,
    seq: AtomicU64,
    /// The world-level handle of a rank: dropping it marks the rank exited (or, while
    /// panicking, poisons the world).
    guard: bool,
}

/// A world of `n` ranks; hand one handle to each thread. See [`run_threads`] for the common case.
pub fn threads_world(n: usize, cfg: &ThreadsConfig) -> Vec<ThreadGroup> {
    assert!(n > 0, "a world needs at least one rank");
    let world = Arc::new(World {
        timeout: cfg.timeout,
        state: Mutex::new(State {
            slots: HashMap::new(),
            poisoned: None,
            exited: vec![false; n],
            next_group: 1,
        }),
        cv: Condvar::new(),
    });
    (0..n)
        .map(|r| ThreadGroup {
            world: world.clone(),
            id: 0,
            m: Membership {
                rank: r,
                world_ranks: (0..n).collect(),
                name: "world".into(),
                ctx: RankCtx::new(r, cfg.trace),
            },
            seq: AtomicU64::new(0),
            guard: true,
        })
        .collect()
}

/// Run `f` on `n` ranks, one thread each, and return each rank's result (`Err` with the panic
/// payload for a rank that panicked). A panic poisons the world with its message, so the other
/// ranks' collectives fail promptly instead of hanging.
pub fn run_threads<R, F>(n: usize, cfg: &ThreadsConfig, f: F) -> Vec<std::thread::Result<R>>
where
    R: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> R + Sync,
{
    let handles = threads_world(n, cfg);
    std::thread::scope(|s| {
        let joins: Vec<_> = handles
            .into_iter()
            .map(|g| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank{}", g.m.rank))
                    .spawn_scoped(s, move || {
                        let world = g.world.clone();
                        // Reported below with the panic's own message instead.
                        let mut g = g;
                        g.guard = false;
                        let rank = g.m.rank;
                        let g: Arc<dyn ProcessGroup> = Arc::new(g);
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(g)));
                        match &r {
                            Err(p) => world.poison(rank, panic_message(p.as_ref())),
                            Ok(_) => world.mark_exited(rank),
                        }
                        r
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap_or_else(Err))
            .collect()
    })
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".into()
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        if self.guard {
            if std::thread::panicking() {
                self.world.poison(
                    self.m.ctx.world_rank,
                    "panicked (world handle dropped)".into(),
                );
            } else {
                self.world.mark_exited(self.m.ctx.world_rank);
            }
        }
    }
}

/// Everything a rank took out of a completed slot.
struct Collected {
    data: Vec<Arc<Data>>,
    meta: Vec<Arc<Vec<usize>>>,
    new_groups: Option<Arc<HashMap<usize, u64>>>,
}

type Finish<'a> = Box<dyn FnOnce(&Collected) -> Result<()> + Send + 'a>;

struct ThreadPending<'a> {
    g: &'a ThreadGroup,
    key: (u64, u64),
    call: Call,
    posted: Instant,
    finish: Finish<'a>,
}

impl Pending for ThreadPending<'_> {
    fn wait(self: Box<Self>) -> Result<()> {
        let t0 = Instant::now();
        let got = self.g.collect(self.key, self.call.op);
        let t1 = Instant::now();
        self.call.trace(&self.g.m.ctx.tracer, self.posted, t0, t1);
        (self.finish)(&got?)
    }
    fn ready(&mut self) -> bool {
        let st = self.g.world.lock();
        st.poisoned.is_some()
            || st
                .slots
                .get(&self.key)
                .is_none_or(|s| s.arrived == self.g.m.world_ranks.len())
    }
    fn abandon(self: Box<Self>) {
        // The receive buffers are only written in `wait`, so walking away is safe.
    }
}

impl ThreadGroup {
    fn size_(&self) -> usize {
        self.m.world_ranks.len()
    }

    /// Deposit this rank's contribution; returns the slot key.
    fn post(&self, sig: Sig, data: Data, meta: Vec<usize>) -> Result<(u64, u64)> {
        let mut st = self.world.lock();
        if let Some((rank, message)) = &st.poisoned {
            return Err(CommError::PeerPanicked {
                rank: *rank,
                message: message.clone(),
            });
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let key = (self.id, seq);
        let w = self.size_();
        let slot = st.slots.entry(key).or_insert_with(|| Slot {
            sigs: vec![None; w],
            data: vec![None; w],
            meta: (0..w).map(|_| Arc::new(Vec::new())).collect(),
            arrived: 0,
            consumed: 0,
            new_groups: None,
        });
        let me = self.m.rank;
        slot.sigs[me] = Some(sig);
        slot.data[me] = Some(Arc::new(data));
        slot.meta[me] = Arc::new(meta);
        slot.arrived += 1;
        let all = slot.arrived == w;
        drop(st);
        if all {
            self.world.cv.notify_all();
        }
        Ok(key)
    }

    /// Block until every member has posted to `key`, then take the contributions.
    fn collect(&self, key: (u64, u64), op: Op) -> Result<Collected> {
        let w = self.size_();
        let deadline = Instant::now() + self.world.timeout;
        let mut st = self.world.lock();
        loop {
            if let Some((rank, message)) = &st.poisoned {
                return Err(CommError::PeerPanicked {
                    rank: *rank,
                    message: message.clone(),
                });
            }
            let slot = st.slots.get(&key).expect("slot of a posted collective");
            if slot.arrived == w {
                break;
            }
            let missing: Vec<usize> = (0..w)
                .filter(|&j| slot.sigs[j].is_none())
                .map(|j| self.m.world_ranks[j])
                .collect();
            if let Some(&dead) = missing.iter().find(|&&m| st.exited[m]) {
                return Err(CommError::PeerExited {
                    op: op.name(),
                    group: self.m.name.clone(),
                    rank: dead,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: op.name(),
                    group: self.m.name.clone(),
                    rank: self.m.ctx.world_rank,
                    waited: self.world.timeout,
                    missing,
                });
            }
            st = self
                .world
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut next_group = st.next_group;
        let slot = st.slots.get_mut(&key).unwrap();
        let sig0 = slot.sigs[0].clone().unwrap();
        if let Some(j) = (1..w).find(|&j| slot.sigs[j].as_ref() != Some(&sig0)) {
            return Err(CommError::Mismatch {
                op: op.name(),
                group: self.m.name.clone(),
                message: format!(
                    "rank 0 called {:?}, rank {j} called {:?}",
                    sig0, slot.sigs[j]
                ),
            });
        }
        if op == Op::Split && slot.new_groups.is_none() {
            let mut colors: Vec<usize> = slot.meta.iter().map(|m| m[0]).collect();
            colors.sort_unstable();
            colors.dedup();
            let mut map = HashMap::new();
            for c in colors {
                map.insert(c, next_group);
                next_group += 1;
            }
            slot.new_groups = Some(Arc::new(map));
        }
        let got = Collected {
            data: slot.data.iter().map(|d| d.clone().unwrap()).collect(),
            meta: slot.meta.clone(),
            new_groups: slot.new_groups.clone(),
        };
        slot.consumed += 1;
        if slot.consumed == w {
            st.slots.remove(&key);
        }
        st.next_group = next_group;
        Ok(got)
    }

    /// Post this rank's part of `call` (`len`: the length all ranks must agree on, or 0) and
    /// return the handle that finishes it.
    fn start<'a, E>(
        &'a self,
        call: Call,
        len: usize,
        data: Data,
        meta: Vec<usize>,
        finish: Finish<'a>,
    ) -> Result<Work<'a>> {
        let posted = Instant::now();
        let sig = Sig {
            op: call.op,
            root: call.root,
            elem: std::mem::size_of::<E>(),
            len,
        };
        let key = self.post(sig, data, meta)?;
        Ok(Work::new(Box::new(ThreadPending {
            g: self,
            key,
            call,
            posted,
            finish,
        })))
    }

    // Typed bodies of the collectives (arguments checked by the layer, `crate::checks`).

    fn all_gather_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        recv: &'a mut [E],
        call: Call,
    ) -> Result<Work<'a>> {
        let n = send.len();
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            for (j, d) in c.data.iter().enumerate() {
                recv[j * n..(j + 1) * n].copy_from_slice(E::get(d));
            }
            Ok(())
        });
        self.start::<E>(call, n, E::wrap(send.to_vec()), vec![], finish)
    }

    fn reduce_scatter_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        recv: &'a mut [E],
        call: Call,
    ) -> Result<Work<'a>> {
        let (n, me) = (recv.len(), self.m.rank);
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            sum_in_order(recv, &c.data, me * n);
            Ok(())
        });
        self.start::<E>(call, n, E::wrap(send.to_vec()), vec![], finish)
    }

    fn all_reduce_t<'a, E: Elem>(&'a self, buf: &'a mut [E], call: Call) -> Result<Work<'a>> {
        let (n, data) = (buf.len(), E::wrap(buf.to_vec()));
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            sum_in_order(buf, &c.data, 0);
            Ok(())
        });
        self.start::<E>(call, n, data, vec![], finish)
    }

    fn alltoallv_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        send_counts: &[usize],
        recv: &'a mut [E],
        recv_counts: &[usize],
        call: Call,
    ) -> Result<Work<'a>> {
        let (w, me) = (self.size_(), self.m.rank);
        // Every rank posts its send and receive counts and checks the whole matrix, so a
        // disagreement fails on all ranks alike.
        let meta: Vec<usize> = send_counts.iter().chain(recv_counts).copied().collect();
        let group = self.m.name.clone();
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            for i in 0..w {
                for j in 0..w {
                    let (sent, expected) = (c.meta[i][j], c.meta[j][w + i]);
                    if sent != expected {
                        return Err(CommError::Mismatch {
                            op: "alltoallv",
                            group: group.clone(),
                            message: format!(
                                "rank {i} sends {sent} elements to rank {j}, which expects {expected}"
                            ),
                        });
                    }
                }
            }
            let mut off = 0;
            for (j, d) in c.data.iter().enumerate() {
                let counts = &c.meta[j];
                let start: usize = counts[..me].iter().sum();
                let src = &E::get(d)[start..start + counts[me]];
                recv[off..off + src.len()].copy_from_slice(src);
                off += src.len();
            }
            Ok(())
        });
        self.start::<E>(call, 0, E::wrap(send.to_vec()), meta, finish)
    }

    fn broadcast_t<'a, E: Elem>(&'a self, buf: &'a mut [E], call: Call) -> Result<Work<'a>> {
        let (n, Call { root, is_root, .. }) = (buf.len(), call);
        let data = if is_root {
            E::wrap(buf.to_vec())
        } else {
            Data::Nothing
        };
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            if !is_root {
                buf.copy_from_slice(E::get(&c.data[root]));
            }
            Ok(())
        });
        self.start::<E>(call, n, data, vec![], finish)
    }

    fn reduce_t<'a, E: Elem>(&'a self, buf: &'a mut [E], call: Call) -> Result<Work<'a>> {
        let (n, data, is_root) = (buf.len(), E::wrap(buf.to_vec()), call.is_root);
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            if is_root {
                sum_in_order(buf, &c.data, 0);
            }
            Ok(())
        });
        self.start::<E>(call, n, data, vec![], finish)
    }

    fn gather_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        recv: Option<&'a mut [E]>,
        call: Call,
    ) -> Result<Work<'a>> {
        let n = send.len();
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            if let Some(recv) = recv {
                for (j, d) in c.data.iter().enumerate() {
                    recv[j * n..(j + 1) * n].copy_from_slice(E::get(d));
                }
            }
            Ok(())
        });
        self.start::<E>(call, n, E::wrap(send.to_vec()), vec![], finish)
    }

    fn scatter_t<'a, E: Elem>(
        &'a self,
        send: Option<&[E]>,
        recv: &'a mut [E],
        call: Call,
    ) -> Result<Work<'a>> {
        let (n, me, root) = (recv.len(), self.m.rank, call.root);
        let data = send.map_or(Data::Nothing, |s| E::wrap(s.to_vec()));
        let finish: Finish<'a> = Box::new(move |c: &Collected| {
            recv.copy_from_slice(&E::get(&c.data[root])[me * n..(me + 1) * n]);
            Ok(())
        });
        self.start::<E>(call, n, data, vec![], finish)
    }
}

/// `out = Σ_j data_j[off..off+len]`, in rank order, starting from rank 0's values (so one rank
/// gives its own values bit for bit).
fn sum_in_order<E: Elem>(out: &mut [E], data: &[Arc<Data>], off: usize) {
    let n = out.len();
    out.copy_from_slice(&E::get(&data[0])[off..off + n]);
    for d in &data[1..] {
        for (o, &x) in out.iter_mut().zip(&E::get(d)[off..off + n]) {
            *o += x;
        }
    }
}

impl Transport for ThreadGroup {
    fn membership(&self) -> &Membership {
        &self.m
    }

    crate::group::host_transport!();
    fn post_barrier(&self, call: Call) -> Result<Work<'_>> {
        let finish: Finish<'_> = Box::new(|_: &Collected| Ok(()));
        self.start::<()>(call, 0, Data::Nothing, vec![], finish)
    }

    fn split_group(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let sig = Sig {
            op: Op::Split,
            root: 0,
            elem: 0,
            len: 0,
        };
        // Color 0 on the wire means "no group".
        let meta = vec![color.map_or(0, |c| c + 1), key];
        let key_ = self.post(sig, Data::Nothing, meta)?;
        let got = self.collect(key_, Op::Split)?;
        let Some(c) = color else { return Ok(None) };
        let mut mine: Vec<(usize, usize)> = (0..self.size_())
            .filter(|&j| got.meta[j][0] == c + 1)
            .map(|j| (got.meta[j][1], j))
            .collect();
        mine.sort_unstable();
        let members: Vec<usize> = mine.iter().map(|&(_, j)| self.m.world_ranks[j]).collect();
        let rank = mine.iter().position(|&(_, j)| j == self.m.rank).unwrap();
        let id = got.new_groups.as_ref().unwrap()[&(c + 1)];
        Ok(Some(Arc::new(ThreadGroup {
            world: self.world.clone(),
            id,
            m: Membership {
                rank,
                world_ranks: members,
                name: name.to_string(),
                ctx: self.m.ctx.clone(),
            },
            seq: AtomicU64::new(0),
            guard: false,
        })))
    }
}

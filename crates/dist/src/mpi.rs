//! MPI backend (feature `mpi`): one rank per process, `mpirun -n N ganymede train …`.
//!
//! Every collective is an MPI immediate collective (`MPI_Iallgather`, `MPI_Ireduce_scatter_block`,
//! `MPI_Ialltoallv`, …), so the `i*` forms return as soon as MPI has the call and the transfer
//! progresses while the caller computes. The library needs `'static` buffers for a request it
//! may outlive, so each call stages its data in buffers the handle owns (one host copy each
//! way, cheap next to the wire); `wait` polls `MPI_Test` with a short, growing sleep (no
//! spinning) until completion or the timeout, then copies the result out. On timeout (or a
//! panic) the staging buffers and the request are leaked on purpose: MPI may still write them,
//! so freeing would be unsound; the caller is expected to end the job ([`MpiGroup::abort`]).
//!
//! MPI is initialised with at least `MPI_THREAD_SERIALIZED`, and every MPI call of this module
//! runs under one process-wide lock, so group handles may be used from any thread.
//! Reductions use `MPI_SUM`: the order is the library's, so results can differ from the threads
//! backend in the last bits for inexact sums (identical for exact ones, as the check uses).

use crate::error::{invalid, CommError, Result};
use crate::group::{Call, Membership, Pending, ProcessGroup, RankCtx, Transport, Work};
use mpi::collective::SystemOperation;
use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

static MPI_LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Clone, Debug)]
pub struct MpiConfig {
    pub timeout: Duration,
    pub trace: bool,
}

impl Default for MpiConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            trace: false,
        }
    }
}

/// Keeps MPI initialised; finalises it when dropped (after every group handle is gone).
pub struct MpiWorld {
    _universe: Universe,
}

/// Initialise MPI and return the world group of this process.
pub fn init(cfg: &MpiConfig) -> Result<(MpiWorld, Arc<MpiGroup>)> {
    let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
        .ok_or_else(|| CommError::Mpi("MPI is already initialised".into()))?;
    if matches!(provided, Threading::Single | Threading::Funneled) {
        return Err(CommError::Mpi(format!(
            "the MPI library provides only {provided:?} threading; need Serialized or better"
        )));
    }
    let comm = universe.world();
    let (rank, size) = (comm.rank() as usize, comm.size() as usize);
    let g = MpiGroup {
        comm,
        m: Membership {
            rank,
            world_ranks: (0..size).collect(),
            name: "world".into(),
            ctx: RankCtx::new(rank, cfg.trace),
        },
        timeout: cfg.timeout,
    };
    Ok((
        MpiWorld {
            _universe: universe,
        },
        Arc::new(g),
    ))
}

/// A communicator and this process's place in it.
pub struct MpiGroup {
    comm: SimpleCommunicator,
    m: Membership,
    timeout: Duration,
}

// SAFETY: every MPI call made through a group happens under `MPI_LOCK`, and MPI was initialised
// with at least MPI_THREAD_SERIALIZED, so calls from different threads never overlap.
unsafe impl Send for MpiGroup {}
unsafe impl Sync for MpiGroup {}

impl MpiGroup {
    /// End every process of the job (after a timeout or a peer's failure).
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    /// Collective: a duplicate of this group with another timeout (tests, and callers that
    /// want a shorter fuse for one phase).
    pub fn with_timeout(&self, timeout: Duration, name: &str) -> Arc<MpiGroup> {
        let comm = {
            let _l = lock();
            self.comm.duplicate()
        };
        Arc::new(MpiGroup {
            comm,
            m: Membership {
                name: name.into(),
                ..self.m.clone()
            },
            timeout,
        })
    }
}

/// A posted request, whatever buffer type it was made for.
trait Req {
    /// True once complete (the request is then gone).
    fn test(&mut self) -> bool;
}

impl<D: ?Sized + 'static> Req for Option<Request<'static, D, StaticScope>> {
    fn test(&mut self) -> bool {
        match self.take() {
            None => true,
            Some(r) => match r.test() {
                Ok(_) => true,
                Err(r) => {
                    *self = Some(r);
                    false
                }
            },
        }
    }
}

/// A reference that MPI may keep until the request completes. The pointee lives in a box owned
/// by the same [`MpiPending`], which is waited on or leaked, never freed while in flight.
unsafe fn extend_to_static<X: ?Sized>(x: &X) -> &'static X {
    &*(x as *const X)
}
unsafe fn extend_to_static_mut<X: ?Sized>(x: &mut X) -> &'static mut X {
    &mut *(x as *mut X)
}

struct MpiPending<'a, E: 'static> {
    g: &'a MpiGroup,
    // Declared first: dropped before the staging it points into.
    req: Box<dyn Req>,
    _keep: Vec<Box<dyn std::any::Any>>,
    _send: Box<[E]>,
    recv: Box<[E]>,
    out: Option<&'a mut [E]>,
    call: Call,
    posted: Instant,
}

impl<E: Copy + 'static> Pending for MpiPending<'_, E> {
    fn wait(mut self: Box<Self>) -> Result<()> {
        let t0 = Instant::now();
        let deadline = t0 + self.g.timeout;
        let mut nap = Duration::from_micros(20);
        loop {
            let done = {
                let _l = lock();
                self.req.test()
            };
            if done {
                break;
            }
            if Instant::now() >= deadline {
                let e = CommError::Timeout {
                    op: self.call.op.name(),
                    group: self.g.m.name.clone(),
                    rank: self.g.m.ctx.world_rank,
                    waited: self.g.timeout,
                    missing: vec![],
                };
                // MPI may still write the staging buffers: leak them (see the module docs).
                std::mem::forget(self);
                return Err(e);
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        let t1 = Instant::now();
        if let Some(out) = self.out.take() {
            out.copy_from_slice(&self.recv);
        }
        self.call.trace(&self.g.m.ctx.tracer, self.posted, t0, t1);
        Ok(())
    }
    fn ready(&mut self) -> bool {
        let _l = lock();
        self.req.test()
    }
    fn abandon(self: Box<Self>) {
        std::mem::forget(self);
    }
}

/// Host element types MPI moves.
trait Elem: Equivalence + Copy + Default + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for f64 {}
impl Elem for u16 {}

fn boxed<E: Copy>(s: &[E]) -> Box<[E]> {
    s.to_vec().into_boxed_slice()
}
fn zeros<E: Elem>(n: usize) -> Box<[E]> {
    vec![E::default(); n].into_boxed_slice()
}
fn counts(c: &[usize]) -> Result<Vec<i32>> {
    c.iter()
        .map(|&x| i32::try_from(x).map_err(|_| invalid("alltoallv", "count exceeds i32")))
        .collect()
}
/// A posted request as `stage`'s `post` returns it, with nothing else to keep.
fn req<D: ?Sized + 'static>(
    r: Request<'static, D, StaticScope>,
) -> (Box<dyn Req>, Vec<Box<dyn std::any::Any>>) {
    (Box::new(Some(r)), vec![])
}
fn displs(c: &[i32]) -> Vec<i32> {
    c.iter()
        .scan(0, |acc, &x| {
            let d = *acc;
            *acc += x;
            Some(d)
        })
        .collect()
}

impl MpiGroup {
    /// Post with staged buffers: `post` gets `'static` views of the staging and returns the
    /// request; the result is copied into `out` by `wait`.
    fn stage<'a, E: Elem>(
        &'a self,
        call: Call,
        send: Box<[E]>,
        mut recv: Box<[E]>,
        out: Option<&'a mut [E]>,
        post: impl FnOnce(
            &SimpleCommunicator,
            &'static [E],
            &'static mut [E],
        ) -> (Box<dyn Req>, Vec<Box<dyn std::any::Any>>),
    ) -> Result<Work<'a>> {
        let posted = Instant::now();
        // SAFETY: both boxes move into the pending handle below and are only freed after the
        // request completes (or leaked).
        let (s, r) = unsafe { (extend_to_static(&*send), extend_to_static_mut(&mut *recv)) };
        let (req, keep) = {
            let _l = lock();
            post(&self.comm, s, r)
        };
        Ok(Work::new(Box::new(MpiPending {
            g: self,
            req,
            _keep: keep,
            _send: send,
            recv,
            out,
            call,
            posted,
        })))
    }

    // Typed bodies of the collectives (arguments checked by the layer, `crate::checks`).

    fn all_gather_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        out: &'a mut [E],
        call: Call,
    ) -> Result<Work<'a>> {
        let n_out = out.len();
        self.stage(call, boxed(send), zeros(n_out), Some(out), |c, s, r| {
            req(c.immediate_all_gather_into(StaticScope, s, r))
        })
    }

    fn reduce_scatter_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        out: &'a mut [E],
        call: Call,
    ) -> Result<Work<'a>> {
        let n = out.len();
        self.stage(call, boxed(send), zeros(n), Some(out), |c, s, r| {
            let sum = SystemOperation::sum();
            req(c.immediate_reduce_scatter_block_into(StaticScope, s, r, sum))
        })
    }

    fn all_reduce_t<'a, E: Elem>(&'a self, buf: &'a mut [E], call: Call) -> Result<Work<'a>> {
        let (send, n) = (boxed(buf), buf.len());
        self.stage(call, send, zeros(n), Some(buf), |c, s, r| {
            req(c.immediate_all_reduce_into(StaticScope, s, r, SystemOperation::sum()))
        })
    }

    fn alltoallv_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        send_counts: &[usize],
        out: &'a mut [E],
        recv_counts: &[usize],
        call: Call,
    ) -> Result<Work<'a>> {
        let (sc, rc) = (counts(send_counts)?, counts(recv_counts)?);
        let (sd, rd) = (displs(&sc), displs(&rc));
        let n_out = out.len();
        self.stage(
            call,
            boxed(send),
            zeros(n_out),
            Some(out),
            move |c, s, r| {
                let sp = Box::new(Partition::new(s, sc, sd));
                let mut rp = Box::new(PartitionMut::new(r, rc, rd));
                // SAFETY: the partitions are kept (boxed) in the handle with the request.
                let (sp_ref, rp_ref) =
                    unsafe { (extend_to_static(&*sp), extend_to_static_mut(&mut *rp)) };
                let q = c.immediate_all_to_all_varcount_into(StaticScope, sp_ref, rp_ref);
                let keep: Vec<Box<dyn std::any::Any>> = vec![sp, rp];
                (Box::new(Some(q)), keep)
            },
        )
    }

    fn broadcast_t<'a, E: Elem>(&'a self, buf: &'a mut [E], call: Call) -> Result<Work<'a>> {
        let Call { root, is_root, .. } = call;
        // The staging receive buffer is the broadcast buffer (root: filled with its data).
        let stage: Box<[E]> = if is_root {
            boxed(buf)
        } else {
            zeros(buf.len())
        };
        let out = (!is_root).then_some(buf);
        self.stage(call, Box::new([]), stage, out, move |c, _s, r| {
            req(c
                .process_at_rank(root as i32)
                .immediate_broadcast_into(StaticScope, r))
        })
    }

    fn reduce_t<'a, E: Elem>(&'a self, buf: &'a mut [E], call: Call) -> Result<Work<'a>> {
        let Call { root, is_root, .. } = call;
        let (send, n) = (boxed(buf), if is_root { buf.len() } else { 0 });
        self.stage(
            call,
            send,
            zeros(n),
            is_root.then_some(buf),
            move |c, s, r| {
                let (p, sum) = (c.process_at_rank(root as i32), SystemOperation::sum());
                if is_root {
                    req(p.immediate_reduce_into_root(StaticScope, s, r, sum))
                } else {
                    req(p.immediate_reduce_into(StaticScope, s, sum))
                }
            },
        )
    }

    fn gather_t<'a, E: Elem>(
        &'a self,
        send: &[E],
        out: Option<&'a mut [E]>,
        call: Call,
    ) -> Result<Work<'a>> {
        let Call { root, is_root, .. } = call;
        let n = out.as_ref().map_or(0, |o| o.len());
        self.stage(call, boxed(send), zeros(n), out, move |c, s, r| {
            let p = c.process_at_rank(root as i32);
            if is_root {
                req(p.immediate_gather_into_root(StaticScope, s, r))
            } else {
                req(p.immediate_gather_into(StaticScope, s))
            }
        })
    }

    fn scatter_t<'a, E: Elem>(
        &'a self,
        send: Option<&[E]>,
        out: &'a mut [E],
        call: Call,
    ) -> Result<Work<'a>> {
        let Call { root, is_root, .. } = call;
        let send = send.map_or_else(|| Box::new([]) as Box<[E]>, boxed);
        let n = out.len();
        self.stage(call, send, zeros(n), Some(out), move |c, s, r| {
            let p = c.process_at_rank(root as i32);
            if is_root {
                req(p.immediate_scatter_into_root(StaticScope, s, r))
            } else {
                req(p.immediate_scatter_into(StaticScope, r))
            }
        })
    }
}

impl Transport for MpiGroup {
    fn membership(&self) -> &Membership {
        &self.m
    }

    crate::group::host_transport!();
    fn post_barrier(&self, call: Call) -> Result<Work<'_>> {
        self.stage::<f32>(call, Box::new([]), Box::new([]), None, |c, _, _| {
            req(c.immediate_barrier())
        })
    }

    fn split_group(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let c = match color {
            Some(c) => Color::with_value(
                i32::try_from(c).map_err(|_| invalid("split", "color exceeds i32"))?,
            ),
            None => Color::undefined(),
        };
        let key = i32::try_from(key).map_err(|_| invalid("split", "key exceeds i32"))?;
        let sub = {
            let _l = lock();
            self.comm.split_by_color_with_key(c, key)
        };
        let Some(comm) = sub else { return Ok(None) };
        // The members' world ranks, in the new group's order.
        let me = self.m.ctx.world_rank as u64;
        let mut all = vec![0u64; comm.size() as usize];
        {
            let _l = lock();
            comm.all_gather_into(&me, &mut all[..]);
        }
        Ok(Some(Arc::new(MpiGroup {
            m: Membership {
                rank: comm.rank() as usize,
                world_ranks: all.iter().map(|&x| x as usize).collect(),
                name: name.into(),
                ctx: self.m.ctx.clone(),
            },
            comm,
            timeout: self.timeout,
        })))
    }
}

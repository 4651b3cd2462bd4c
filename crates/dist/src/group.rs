//! The process-group interface: [`ProcessGroup`] for callers, [`Transport`] for backends.
//!
//! Buffers are the core crate's views ([`View`], [`ViewMut`]). Host backends (threads, MPI) serve
//! host f32 and f64 views (and bf16 to all-gather or exchange all-to-all) and answer
//! [`CommError::Unsupported`] for anything else. The GPU backend (NCCL) serves device views: it
//! enqueues the NCCL call on its communication stream when the collective is posted and returns
//! a [`Work`] whose `wait` makes the compute stream wait on an event recorded after the call (as
//! PyTorch's `Work.wait()` does), so the buffers' borrows in `Work` keep them alive exactly as
//! long as the transfer may touch them.
//!
//! Backends implement [`Transport`], the moving of data alone: every `Transport` is a
//! `ProcessGroup` through the checked layer ([`crate::checks`]), which validates each call's
//! arguments and counts its bytes once for all of them.
//!
//! Every collective has a non-blocking form (`i*`, returning [`Work`]); the blocking form is a
//! provided method that posts and waits. A [`Work`] dropped without `wait` waits in its drop,
//! ignoring errors, so the borrowed buffers are never released while in use.

use crate::error::{CommError, Result};
use crate::stats::{CommStats, Op, Phase};
use crate::trace::{Tracer, Track};
use ganymede_core::{View, ViewMut};
use std::sync::Arc;
use std::time::Instant;

/// What a rank shares between all its group handles: its byte counters and its timeline.
#[derive(Clone)]
pub struct RankCtx {
    /// This rank in the world numbering.
    pub world_rank: usize,
    pub stats: Arc<CommStats>,
    pub tracer: Arc<Tracer>,
}

impl RankCtx {
    pub fn new(world_rank: usize, trace: bool) -> Self {
        Self {
            world_rank,
            stats: Arc::new(CommStats::default()),
            tracer: Arc::new(Tracer::new(world_rank, trace)),
        }
    }
}

/// The pending part of a non-blocking collective; backends implement it.
pub trait Pending {
    /// Block until complete; the receive buffers then hold the result.
    fn wait(self: Box<Self>) -> Result<()>;
    /// Whether `wait` would return without blocking (never blocks itself).
    fn ready(&mut self) -> bool;
    /// Called instead of `wait` when the handle is dropped during a panic: must not block on
    /// peers, and must keep the buffers safe (a backend whose transfer may still write them
    /// leaks its staging memory rather than free it).
    fn abandon(self: Box<Self>) {
        let _ = self.wait();
    }
}

/// Handle of a posted collective. Borrows its buffers until waited on.
#[must_use = "a collective completes only when waited on"]
pub struct Work<'a> {
    inner: Option<Box<dyn Pending + 'a>>,
}

impl<'a> Work<'a> {
    pub fn new(p: Box<dyn Pending + 'a>) -> Self {
        Self { inner: Some(p) }
    }
    /// An already finished collective (one rank, nothing to move).
    pub fn done() -> Self {
        Self { inner: None }
    }
    pub fn wait(mut self) -> Result<()> {
        match self.inner.take() {
            Some(p) => p.wait(),
            None => Ok(()),
        }
    }
    /// Non-blocking completion test.
    pub fn ready(&mut self) -> bool {
        self.inner.as_mut().is_none_or(|p| p.ready())
    }
    /// Walk away without waiting for peers, as a drop during a panic does
    /// ([`Pending::abandon`]): for a caller that has had a collective fail and is ending, whose
    /// other posted collectives a failed peer may never join.
    pub fn abandon(mut self) {
        if let Some(p) = self.inner.take() {
            p.abandon();
        }
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.inner.take() {
            if std::thread::panicking() {
                p.abandon();
            } else {
                let _ = p.wait();
            }
        }
    }
}

/// Wait for several handles in order; the first error wins, but every handle is waited on.
pub fn wait_all(works: Vec<Work<'_>>) -> Result<()> {
    let mut first = Ok(());
    for w in works {
        let r = w.wait();
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// A communicator: `size()` ranks that run the same collectives in the same order.
///
/// Conventions: buffers are contiguous; rank `j`'s piece of a gathered or scattered buffer is
/// `[j*n, (j+1)*n)`; sums are taken in rank order where the backend controls the order (threads;
/// MPI leaves the order to the library). `phase` only labels the bytes in the counters and the
/// trace. Collective calls must be issued in the same order on every rank of the group.
///
/// Backends do not implement it directly: see [`Transport`].
pub trait ProcessGroup: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The world ranks of this group's members, indexed by group rank.
    fn world_ranks(&self) -> &[usize];
    /// A label for errors and traces ("world", "ep", ...).
    fn name(&self) -> &str;
    fn ctx(&self) -> &RankCtx;

    /// `recv[j*n..(j+1)*n] = send of rank j`, with `n = send.len()`, `recv.len() = size*n`.
    fn iall_gather<'a>(
        &'a self,
        send: View<'a>,
        recv: ViewMut<'a>,
        phase: Phase,
    ) -> Result<Work<'a>>;
    /// `recv = Σ_j send_j[rank*n..(rank+1)*n]`, with `n = recv.len()`, `send.len() = size*n`.
    fn ireduce_scatter<'a>(
        &'a self,
        send: View<'a>,
        recv: ViewMut<'a>,
        phase: Phase,
    ) -> Result<Work<'a>>;
    /// `buf = Σ_j buf_j` on every rank.
    fn iall_reduce<'a>(&'a self, buf: ViewMut<'a>, phase: Phase) -> Result<Work<'a>>;
    /// Uneven all-to-all: this rank sends `send_counts[j]` elements (consecutive in `send`, in
    /// rank order) to rank `j` and receives `recv_counts[j]` from rank `j` (consecutive in
    /// `recv`). Counts must agree pairwise; [`ProcessGroup::exchange_counts`] computes them.
    fn ialltoallv<'a>(
        &'a self,
        send: View<'a>,
        send_counts: &[usize],
        recv: ViewMut<'a>,
        recv_counts: &[usize],
        phase: Phase,
    ) -> Result<Work<'a>>;
    /// Root's `buf` copied into every rank's `buf`.
    fn ibroadcast<'a>(&'a self, buf: ViewMut<'a>, root: usize, phase: Phase) -> Result<Work<'a>>;
    /// Root's `buf` becomes `Σ_j buf_j`; other ranks' buffers are left as they were.
    fn ireduce<'a>(&'a self, buf: ViewMut<'a>, root: usize, phase: Phase) -> Result<Work<'a>>;
    /// Root's `recv` (`size*n`, `Some` on the root only) receives every rank's `send` (`n`).
    fn igather<'a>(
        &'a self,
        send: View<'a>,
        recv: Option<ViewMut<'a>>,
        root: usize,
        phase: Phase,
    ) -> Result<Work<'a>>;
    /// Rank `j`'s `recv` (`n`) receives root's `send[j*n..(j+1)*n]` (`Some` on the root only).
    fn iscatter<'a>(
        &'a self,
        send: Option<View<'a>>,
        recv: ViewMut<'a>,
        root: usize,
        phase: Phase,
    ) -> Result<Work<'a>>;
    fn ibarrier(&self) -> Result<Work<'_>>;

    /// Collective over this group: ranks passing the same `Some(color)` form a new group,
    /// ordered by `(key, rank)`; `None` joins no group. Sub-groups share this rank's counters
    /// and timeline.
    fn split(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>>;

    // Blocking forms.
    fn all_gather(&self, send: View, recv: ViewMut, phase: Phase) -> Result<()> {
        self.iall_gather(send, recv, phase)?.wait()
    }
    fn reduce_scatter(&self, send: View, recv: ViewMut, phase: Phase) -> Result<()> {
        self.ireduce_scatter(send, recv, phase)?.wait()
    }
    fn all_reduce(&self, buf: ViewMut, phase: Phase) -> Result<()> {
        self.iall_reduce(buf, phase)?.wait()
    }
    fn alltoallv(
        &self,
        send: View,
        send_counts: &[usize],
        recv: ViewMut,
        recv_counts: &[usize],
        phase: Phase,
    ) -> Result<()> {
        self.ialltoallv(send, send_counts, recv, recv_counts, phase)?
            .wait()
    }
    fn broadcast(&self, buf: ViewMut, root: usize, phase: Phase) -> Result<()> {
        self.ibroadcast(buf, root, phase)?.wait()
    }
    fn reduce(&self, buf: ViewMut, root: usize, phase: Phase) -> Result<()> {
        self.ireduce(buf, root, phase)?.wait()
    }
    fn gather(&self, send: View, recv: Option<ViewMut>, root: usize, phase: Phase) -> Result<()> {
        self.igather(send, recv, root, phase)?.wait()
    }
    fn scatter(&self, send: Option<View>, recv: ViewMut, root: usize, phase: Phase) -> Result<()> {
        self.iscatter(send, recv, root, phase)?.wait()
    }
    fn barrier(&self) -> Result<()> {
        self.ibarrier()?.wait()
    }

    /// Collective: the group of the listed group ranks (in that order), `None` on non-members.
    fn subgroup(&self, ranks: &[usize], name: &str) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let pos = ranks.iter().position(|&r| r == self.rank());
        self.split(pos.map(|_| 0), pos.unwrap_or(0), name)
    }

    /// The receive counts matching `send_counts` for an all-to-all (one small all-to-all).
    /// Counts travel as f32, exact below 2^24 elements per peer.
    fn exchange_counts(&self, send_counts: &[usize], phase: Phase) -> Result<Vec<usize>> {
        let w = self.size();
        if send_counts.len() != w {
            return Err(crate::error::invalid(
                "exchange_counts",
                format!("{} counts for {w} ranks", send_counts.len()),
            ));
        }
        if let Some(&c) = send_counts.iter().find(|&&c| c >= 1 << 24) {
            return Err(crate::error::invalid(
                "exchange_counts",
                format!("count {c} is not exact in f32"),
            ));
        }
        let send: Vec<f32> = send_counts.iter().map(|&c| c as f32).collect();
        let mut recv = vec![0f32; w];
        let ones = vec![1; w];
        self.alltoallv(
            View::Host(&send),
            &ones,
            ViewMut::Host(&mut recv),
            &ones,
            phase,
        )?;
        Ok(recv.iter().map(|&c| c as usize).collect())
    }
}

/// A view whose memory the host can address (host views, and the emulated device memory of
/// the two-memory CPU mode) as a host view, so host collectives serve it; others unchanged.
pub fn host_view(v: View<'_>) -> View<'_> {
    match v {
        View::Device(d) if d.buffer().host_ptr(false).is_some() => match d.dtype() {
            ganymede_core::DType::F32 => View::Host(View::Device(d).host::<f32>()),
            ganymede_core::DType::F64 => View::Host64(View::Device(d).host::<f64>()),
            ganymede_core::DType::BF16 => View::HostBf16(View::Device(d).host_bf16()),
            ganymede_core::DType::U32 => View::HostU32(View::Device(d).host_u32()),
        },
        v => v,
    }
}

/// [`host_view`] for a mutable view.
pub fn host_view_mut(v: ViewMut<'_>) -> ViewMut<'_> {
    match v {
        ViewMut::Device(d) if d.buffer().host_ptr(false).is_some() => match d.dtype() {
            ganymede_core::DType::F32 => ViewMut::Host(ViewMut::Device(d).host::<f32>()),
            ganymede_core::DType::F64 => ViewMut::Host64(ViewMut::Device(d).host::<f64>()),
            ganymede_core::DType::BF16 => ViewMut::HostBf16(ViewMut::Device(d).host_bf16()),
            ganymede_core::DType::U32 => ViewMut::HostU32(ViewMut::Device(d).host_u32()),
        },
        v => v,
    }
}

/// A rank's place in a group, which every backend keeps: what [`ProcessGroup`]'s accessors
/// return, and what the checked layer ([`crate::checks`]) needs to check a call and count it.
#[derive(Clone)]
pub struct Membership {
    /// This rank in the group's numbering.
    pub rank: usize,
    /// The members' world ranks, indexed by group rank.
    pub world_ranks: Vec<usize>,
    /// A label for errors and traces ("world", "ep", ...).
    pub name: String,
    pub ctx: RankCtx,
}

/// A collective that passed the checks, as the layer hands it to the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub op: Op,
    pub phase: Phase,
    /// The root's group rank for broadcast, reduce, gather and scatter; 0 for the others.
    pub root: usize,
    /// Whether this rank is that root (false where there is none).
    pub is_root: bool,
    /// This rank's bytes, sent and received, by [`crate::stats::volume`]'s convention; the
    /// layer has counted them, the transport only labels its trace with them.
    pub sent: u64,
    pub recv: u64,
}

impl Call {
    /// Put a finished wait on the rank's timeline: the time blocked in it (from `wait_start`)
    /// and the transfer from its post to `end`, labelled with the bytes sent.
    pub fn trace(&self, tracer: &Tracer, posted: Instant, wait_start: Instant, end: Instant) {
        if tracer.enabled() {
            let name = format!("{} {}", self.op.name(), self.phase.name());
            tracer.record(name.clone(), Track::Wait, wait_start, end, None);
            tracer.record(name, Track::Comm, posted, end, Some(self.sent));
        }
    }
}

/// What a backend implements: moving the data of collectives whose arguments the checked
/// layer ([`crate::checks`]) has already validated (lengths, roots, counts, one dtype for send
/// and receive, host-addressable memory seen as host views) and whose bytes it counts.
/// Every `Transport` is a [`ProcessGroup`] through that layer, so no backend repeats either.
///
/// A transport still refuses what it cannot move (a dtype it does not serve, as
/// `Unsupported`) and what only the ranks together can see (disagreeing calls or counts, as
/// `Mismatch`). The buffers' shapes are those of the matching [`ProcessGroup`] method.
pub trait Transport: Send + Sync {
    fn membership(&self) -> &Membership;

    fn post_all_gather<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        recv: ViewMut<'a>,
    ) -> Result<Work<'a>>;
    fn post_reduce_scatter<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        recv: ViewMut<'a>,
    ) -> Result<Work<'a>>;
    fn post_all_reduce<'a>(&'a self, call: Call, buf: ViewMut<'a>) -> Result<Work<'a>>;
    fn post_alltoallv<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        send_counts: &[usize],
        recv: ViewMut<'a>,
        recv_counts: &[usize],
    ) -> Result<Work<'a>>;
    fn post_broadcast<'a>(&'a self, call: Call, buf: ViewMut<'a>) -> Result<Work<'a>>;
    fn post_reduce<'a>(&'a self, call: Call, buf: ViewMut<'a>) -> Result<Work<'a>>;
    /// `recv` is `Some` exactly on the root.
    fn post_gather<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        recv: Option<ViewMut<'a>>,
    ) -> Result<Work<'a>>;
    /// `send` is `Some` exactly on the root.
    fn post_scatter<'a>(
        &'a self,
        call: Call,
        send: Option<View<'a>>,
        recv: ViewMut<'a>,
    ) -> Result<Work<'a>>;
    fn post_barrier(&self, call: Call) -> Result<Work<'_>>;
    /// [`ProcessGroup::split`]'s communicator work.
    fn split_group(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>>;
}

/// The host element types the host backends (threads, MPI) move, and their views: the slice,
/// or the view given back when it holds another type or memory.
pub(crate) trait HostElem: Sized {
    fn slice(v: View<'_>) -> std::result::Result<&[Self], View<'_>>;
    fn slice_mut(v: ViewMut<'_>) -> std::result::Result<&mut [Self], ViewMut<'_>>;
}

macro_rules! host_elem {
    ($t:ty, $variant:ident) => {
        impl HostElem for $t {
            fn slice(v: View<'_>) -> std::result::Result<&[$t], View<'_>> {
                match v {
                    View::$variant(s) => Ok(s),
                    v => Err(v),
                }
            }
            fn slice_mut(v: ViewMut<'_>) -> std::result::Result<&mut [$t], ViewMut<'_>> {
                match v {
                    ViewMut::$variant(s) => Ok(s),
                    v => Err(v),
                }
            }
        }
    };
}
host_elem!(f32, Host);
host_elem!(f64, Host64);
// bf16, as its bits: only moved (gathered, exchanged), never summed here.
host_elem!(u16, HostBf16);

/// A view or a mutable view, read-only, for what a refusal names about it.
pub(crate) trait AsView {
    fn view(&self) -> View<'_>;
}
impl AsView for View<'_> {
    fn view(&self) -> View<'_> {
        *self
    }
}
impl AsView for ViewMut<'_> {
    fn view(&self) -> View<'_> {
        self.as_view()
    }
}

/// A host backend refusing memory or a dtype it does not move.
pub(crate) fn unserved(op: Op, v: &impl AsView) -> CommError {
    let v = v.view();
    let memory = if matches!(v, View::Device(_)) {
        "device"
    } else {
        "host"
    };
    CommError::Unsupported {
        op: op.name(),
        message: format!(
            "{memory} {} views are not served by this backend (it moves host f32 and f64, and \
             bf16 to all-gather or exchange all-to-all)",
            v.dtype().name()
        ),
    }
}

/// The host slice of `E` behind a (checked) view, or `Unsupported`.
pub(crate) fn host<'a, E: HostElem>(op: Op, v: View<'a>) -> Result<&'a [E]> {
    E::slice(v).map_err(|v| unserved(op, &v))
}

/// [`host`] for a mutable view.
pub(crate) fn host_mut<'a, E: HostElem>(op: Op, v: ViewMut<'a>) -> Result<&'a mut [E]> {
    E::slice_mut(v).map_err(|v| unserved(op, &v))
}

/// The [`Transport`] methods of a host backend: each picks the element type from the views'
/// dtype (one for both, the layer checked) and calls the backend's generic `*_t::<E>` body
/// with the host slices (the same for the threads and MPI backends, so written once).
macro_rules! host_transport {
    () => {
        fn post_all_gather<'a>(
            &'a self,
            call: $crate::group::Call,
            send: ganymede_core::View<'a>,
            recv: ganymede_core::ViewMut<'a>,
        ) -> $crate::Result<$crate::Work<'a>> {
            // FSDP's bf16 parameter gathers: half the bytes, counted as 2 per element.
            $crate::group::by_dtype!(call, send, [F32 => f32, F64 => f64, BF16 => u16], E => {
                let s = $crate::group::host::<E>(call.op, send)?;
                self.all_gather_t(s, $crate::group::host_mut::<E>(call.op, recv)?, call)
            })
        }
        fn post_reduce_scatter<'a>(
            &'a self,
            call: $crate::group::Call,
            send: ganymede_core::View<'a>,
            recv: ganymede_core::ViewMut<'a>,
        ) -> $crate::Result<$crate::Work<'a>> {
            $crate::group::by_dtype!(call, send, [F32 => f32, F64 => f64], E => {
                let s = $crate::group::host::<E>(call.op, send)?;
                self.reduce_scatter_t(s, $crate::group::host_mut::<E>(call.op, recv)?, call)
            })
        }
        fn post_all_reduce<'a>(
            &'a self,
            call: $crate::group::Call,
            buf: ganymede_core::ViewMut<'a>,
        ) -> $crate::Result<$crate::Work<'a>> {
            $crate::group::by_dtype!(call, buf, [F32 => f32, F64 => f64], E => {
                self.all_reduce_t($crate::group::host_mut::<E>(call.op, buf)?, call)
            })
        }
        fn post_alltoallv<'a>(
            &'a self,
            call: $crate::group::Call,
            send: ganymede_core::View<'a>,
            send_counts: &[usize],
            recv: ganymede_core::ViewMut<'a>,
            recv_counts: &[usize],
        ) -> $crate::Result<$crate::Work<'a>> {
            // Expert parallelism's bf16 rows: moved, never summed.
            $crate::group::by_dtype!(call, send, [F32 => f32, F64 => f64, BF16 => u16], E => {
                let s = $crate::group::host::<E>(call.op, send)?;
                let r = $crate::group::host_mut::<E>(call.op, recv)?;
                self.alltoallv_t(s, send_counts, r, recv_counts, call)
            })
        }
        fn post_broadcast<'a>(
            &'a self,
            call: $crate::group::Call,
            buf: ganymede_core::ViewMut<'a>,
        ) -> $crate::Result<$crate::Work<'a>> {
            $crate::group::by_dtype!(call, buf, [F32 => f32, F64 => f64], E => {
                self.broadcast_t($crate::group::host_mut::<E>(call.op, buf)?, call)
            })
        }
        fn post_reduce<'a>(
            &'a self,
            call: $crate::group::Call,
            buf: ganymede_core::ViewMut<'a>,
        ) -> $crate::Result<$crate::Work<'a>> {
            $crate::group::by_dtype!(call, buf, [F32 => f32, F64 => f64], E => {
                self.reduce_t($crate::group::host_mut::<E>(call.op, buf)?, call)
            })
        }
        fn post_gather<'a>(
            &'a self,
            call: $crate::group::Call,
            send: ganymede_core::View<'a>,
            recv: Option<ganymede_core::ViewMut<'a>>,
        ) -> $crate::Result<$crate::Work<'a>> {
            $crate::group::by_dtype!(call, send, [F32 => f32, F64 => f64], E => {
                let s = $crate::group::host::<E>(call.op, send)?;
                let r = recv.map(|r| $crate::group::host_mut::<E>(call.op, r)).transpose()?;
                self.gather_t(s, r, call)
            })
        }
        fn post_scatter<'a>(
            &'a self,
            call: $crate::group::Call,
            send: Option<ganymede_core::View<'a>>,
            recv: ganymede_core::ViewMut<'a>,
        ) -> $crate::Result<$crate::Work<'a>> {
            $crate::group::by_dtype!(call, recv, [F32 => f32, F64 => f64], E => {
                let s = send.map(|s| $crate::group::host::<E>(call.op, s)).transpose()?;
                self.scatter_t(s, $crate::group::host_mut::<E>(call.op, recv)?, call)
            })
        }
    };
}
pub(crate) use host_transport;

/// `$body` with the type `$e` set to the element type of `$view`'s dtype among those listed;
/// another dtype is `Unsupported` (through [`host`]'s refusal, so the words are the same).
macro_rules! by_dtype {
    ($call:expr, $view:expr, [$($d:ident => $t:ty),+], $e:ident => $body:expr) => {
        match $view.dtype() {
            $(ganymede_core::DType::$d => {
                type $e = $t;
                $body
            })+
            _ => Err($crate::group::unserved($call.op, &$view)),
        }
    };
}
pub(crate) use by_dtype;

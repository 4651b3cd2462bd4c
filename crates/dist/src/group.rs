//! The process-group interface every backend implements.
//!
//! Buffers are the core crate's views ([`View`], [`ViewMut`]). Host backends (threads, MPI) serve the
//! `Host` (f32) and `Host64` (f64) variants and answer [`CommError::Unsupported`] for anything
//! else. A GPU backend (NCCL) implements the same trait by matching the device-view variant the
//! GPU issue adds to `View`/`ViewMut`: it enqueues the NCCL call on its communication stream in the
//! `i*` method and returns a [`Work`] whose `wait` makes the compute stream wait on an event
//! recorded after the call (as PyTorch's `Work.wait()` does), so the buffers' borrows in `Work`
//! keep them alive exactly as long as the transfer may touch them.
//!
//! Every collective has a non-blocking form (`i*`, returning [`Work`]); the blocking form is a
//! provided method that posts and waits. A [`Work`] dropped without `wait` waits in its drop,
//! ignoring errors, so the borrowed buffers are never released while in use.

use crate::error::{CommError, Result};
use crate::stats::{CommStats, Phase};
use crate::trace::Tracer;
use ganymede_core::{View, ViewMut};
use std::sync::Arc;

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

/// Element size and length of a view, or `Unsupported` for non-host views.
pub(crate) fn elem_size(op: &'static str, v: &View) -> Result<usize> {
    match v {
        View::Host(_) => Ok(4),
        View::Host64(_) => Ok(8),
        // bf16 only moves (gathers): sums of bf16 are not done on bf16 here.
        View::HostBf16(_) => Ok(2),
        #[allow(unreachable_patterns)]
        _ => Err(CommError::Unsupported {
            op,
            message: "only host f32/f64 (and, to gather, bf16) views are served by this backend"
                .into(),
        }),
    }
}

/// Both host backends mismatched a send and a receive view's dtypes.
pub(crate) fn dtype_mismatch(op: &'static str) -> CommError {
    CommError::Unsupported {
        op,
        message: "send and receive views must both be host f32 or both host f64 (or, to gather or \
                  exchange all-to-all, both bf16)"
            .into(),
    }
}

/// The `ProcessGroup` collectives of a host backend, dispatched by dtype to its generic
/// `*_t::<E: Elem>` methods (the same for the threads and MPI backends, so written once).
macro_rules! host_collectives_by_dtype {
    () => {
        fn iall_gather<'a>(
            &'a self,
            send: ganymede_core::View<'a>,
            recv: ganymede_core::ViewMut<'a>,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            let send = $crate::group::host_view(send);
            $crate::group::elem_size("all_gather", &send)?;
            match (send, $crate::group::host_view_mut(recv)) {
                (ganymede_core::View::Host(s), ganymede_core::ViewMut::Host(r)) => {
                    self.all_gather_t(s, r, phase)
                }
                (ganymede_core::View::Host64(s), ganymede_core::ViewMut::Host64(r)) => {
                    self.all_gather_t(s, r, phase)
                }
                // FSDP's bf16 parameter gathers: half the bytes, counted as 2 per element.
                (ganymede_core::View::HostBf16(s), ganymede_core::ViewMut::HostBf16(r)) => {
                    self.all_gather_t(s, r, phase)
                }
                _ => Err($crate::group::dtype_mismatch("all_gather")),
            }
        }
        fn ireduce_scatter<'a>(
            &'a self,
            send: ganymede_core::View<'a>,
            recv: ganymede_core::ViewMut<'a>,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            let send = $crate::group::host_view(send);
            $crate::group::elem_size("reduce_scatter", &send)?;
            match (send, $crate::group::host_view_mut(recv)) {
                (ganymede_core::View::Host(s), ganymede_core::ViewMut::Host(r)) => {
                    self.reduce_scatter_t(s, r, phase)
                }
                (ganymede_core::View::Host64(s), ganymede_core::ViewMut::Host64(r)) => {
                    self.reduce_scatter_t(s, r, phase)
                }
                _ => Err($crate::group::dtype_mismatch("reduce_scatter")),
            }
        }
        fn iall_reduce<'a>(
            &'a self,
            buf: ganymede_core::ViewMut<'a>,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            match $crate::group::host_view_mut(buf) {
                ganymede_core::ViewMut::Host(b) => self.all_reduce_t(b, phase),
                ganymede_core::ViewMut::Host64(b) => self.all_reduce_t(b, phase),
                #[allow(unreachable_patterns)]
                _ => Err($crate::group::dtype_mismatch("all_reduce")),
            }
        }
        fn ialltoallv<'a>(
            &'a self,
            send: ganymede_core::View<'a>,
            send_counts: &[usize],
            recv: ganymede_core::ViewMut<'a>,
            recv_counts: &[usize],
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            match (
                $crate::group::host_view(send),
                $crate::group::host_view_mut(recv),
            ) {
                (ganymede_core::View::Host(s), ganymede_core::ViewMut::Host(r)) => {
                    self.alltoallv_t(s, send_counts, r, recv_counts, phase)
                }
                (ganymede_core::View::Host64(s), ganymede_core::ViewMut::Host64(r)) => {
                    self.alltoallv_t(s, send_counts, r, recv_counts, phase)
                }
                // Expert parallelism's bf16 rows: moved, never summed.
                (ganymede_core::View::HostBf16(s), ganymede_core::ViewMut::HostBf16(r)) => {
                    self.alltoallv_t(s, send_counts, r, recv_counts, phase)
                }
                _ => Err($crate::group::dtype_mismatch("alltoallv")),
            }
        }
        fn ibroadcast<'a>(
            &'a self,
            buf: ganymede_core::ViewMut<'a>,
            root: usize,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            match $crate::group::host_view_mut(buf) {
                ganymede_core::ViewMut::Host(b) => self.broadcast_t(b, root, phase),
                ganymede_core::ViewMut::Host64(b) => self.broadcast_t(b, root, phase),
                #[allow(unreachable_patterns)]
                _ => Err($crate::group::dtype_mismatch("broadcast")),
            }
        }
        fn ireduce<'a>(
            &'a self,
            buf: ganymede_core::ViewMut<'a>,
            root: usize,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            match $crate::group::host_view_mut(buf) {
                ganymede_core::ViewMut::Host(b) => self.reduce_t(b, root, phase),
                ganymede_core::ViewMut::Host64(b) => self.reduce_t(b, root, phase),
                #[allow(unreachable_patterns)]
                _ => Err($crate::group::dtype_mismatch("reduce")),
            }
        }
        fn igather<'a>(
            &'a self,
            send: ganymede_core::View<'a>,
            recv: Option<ganymede_core::ViewMut<'a>>,
            root: usize,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            match (
                $crate::group::host_view(send),
                recv.map($crate::group::host_view_mut),
            ) {
                (ganymede_core::View::Host(s), None) => self.gather_t::<f32>(s, None, root, phase),
                (ganymede_core::View::Host(s), Some(ganymede_core::ViewMut::Host(r))) => {
                    self.gather_t(s, Some(r), root, phase)
                }
                (ganymede_core::View::Host64(s), None) => {
                    self.gather_t::<f64>(s, None, root, phase)
                }
                (ganymede_core::View::Host64(s), Some(ganymede_core::ViewMut::Host64(r))) => {
                    self.gather_t(s, Some(r), root, phase)
                }
                _ => Err($crate::group::dtype_mismatch("gather")),
            }
        }
        fn iscatter<'a>(
            &'a self,
            send: Option<ganymede_core::View<'a>>,
            recv: ganymede_core::ViewMut<'a>,
            root: usize,
            phase: $crate::Phase,
        ) -> $crate::Result<$crate::Work<'a>> {
            match (
                send.map($crate::group::host_view),
                $crate::group::host_view_mut(recv),
            ) {
                (None, ganymede_core::ViewMut::Host(r)) => {
                    self.scatter_t::<f32>(None, r, root, phase)
                }
                (Some(ganymede_core::View::Host(s)), ganymede_core::ViewMut::Host(r)) => {
                    self.scatter_t(Some(s), r, root, phase)
                }
                (None, ganymede_core::ViewMut::Host64(r)) => {
                    self.scatter_t::<f64>(None, r, root, phase)
                }
                (Some(ganymede_core::View::Host64(s)), ganymede_core::ViewMut::Host64(r)) => {
                    self.scatter_t(Some(s), r, root, phase)
                }
                _ => Err($crate::group::dtype_mismatch("scatter")),
            }
        }
    };
}
pub(crate) use host_collectives_by_dtype;

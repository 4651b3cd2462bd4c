//! The checked layer: what every process group checks about a collective's arguments, and the
//! bytes it counts for it, in one place. Every [`Transport`] (threads, MPI, NCCL) is a
//! [`ProcessGroup`] through the implementation below, which for each call
//! - sees host-addressable memory as host views ([`host_view`]);
//! - refuses bad arguments before the transport sees them, with the same error and words for
//!   every backend: send and receive views of two dtypes (`Unsupported`); lengths, roots and
//!   all-to-all counts that do not fit (`Invalid`);
//! - hands the transport a [`Call`] with this rank's bytes, and counts them in the rank's
//!   [`crate::CommStats`] once the transport has posted the call (a call that fails to post is
//!   not counted).
//!
//! The functions after it hold the rules: each takes buffer lengths in elements and returns
//! this rank's (sent, received) bytes by [`volume`]'s convention.

use crate::error::{invalid, CommError, Result};
use crate::group::{host_view, host_view_mut, Call, ProcessGroup, RankCtx, Transport, Work};
use crate::stats::{volume, Op, Phase};
use ganymede_core::{DType, View, ViewMut};
use std::sync::Arc;

impl<T: Transport> ProcessGroup for T {
    fn rank(&self) -> usize {
        self.membership().rank
    }
    fn size(&self) -> usize {
        self.membership().world_ranks.len()
    }
    fn world_ranks(&self) -> &[usize] {
        &self.membership().world_ranks
    }
    fn name(&self) -> &str {
        &self.membership().name
    }
    fn ctx(&self) -> &RankCtx {
        &self.membership().ctx
    }

    fn iall_gather<'a>(
        &'a self,
        send: View<'a>,
        recv: ViewMut<'a>,
        phase: Phase,
    ) -> Result<Work<'a>> {
        let (call, send, recv) = pair(self, Op::AllGather, phase, send, recv, all_gather)?;
        counted(self, call, self.post_all_gather(call, send, recv))
    }

    fn ireduce_scatter<'a>(
        &'a self,
        send: View<'a>,
        recv: ViewMut<'a>,
        phase: Phase,
    ) -> Result<Work<'a>> {
        let (call, send, recv) = pair(self, Op::ReduceScatter, phase, send, recv, reduce_scatter)?;
        counted(self, call, self.post_reduce_scatter(call, send, recv))
    }

    fn iall_reduce<'a>(&'a self, buf: ViewMut<'a>, phase: Phase) -> Result<Work<'a>> {
        let buf = host_view_mut(buf);
        let vol = all_reduce(self.size(), buf.len(), buf.dtype().size());
        let call = unrooted(Op::AllReduce, phase, vol);
        counted(self, call, self.post_all_reduce(call, buf))
    }

    fn ialltoallv<'a>(
        &'a self,
        send: View<'a>,
        send_counts: &[usize],
        recv: ViewMut<'a>,
        recv_counts: &[usize],
        phase: Phase,
    ) -> Result<Work<'a>> {
        let (send, recv) = (host_view(send), host_view_mut(recv));
        let es = one_dtype(Op::AllToAllV, send.dtype(), recv.dtype())?;
        let (w, me, s, r) = (self.size(), self.rank(), send.len(), recv.len());
        let vol = alltoallv(w, me, es, s, send_counts, r, recv_counts)?;
        let call = unrooted(Op::AllToAllV, phase, vol);
        let posted = self.post_alltoallv(call, send, send_counts, recv, recv_counts);
        counted(self, call, posted)
    }

    fn ibroadcast<'a>(&'a self, buf: ViewMut<'a>, root: usize, phase: Phase) -> Result<Work<'a>> {
        let buf = host_view_mut(buf);
        let (w, me, es) = (self.size(), self.rank(), buf.dtype().size());
        let part = in_place(Op::Broadcast, w, me, root, buf.len(), es)?;
        let call = rooted(Op::Broadcast, phase, root, part);
        counted(self, call, self.post_broadcast(call, buf))
    }

    fn ireduce<'a>(&'a self, buf: ViewMut<'a>, root: usize, phase: Phase) -> Result<Work<'a>> {
        let buf = host_view_mut(buf);
        let (w, me, es) = (self.size(), self.rank(), buf.dtype().size());
        let part = in_place(Op::Reduce, w, me, root, buf.len(), es)?;
        let call = rooted(Op::Reduce, phase, root, part);
        counted(self, call, self.post_reduce(call, buf))
    }

    fn igather<'a>(
        &'a self,
        send: View<'a>,
        recv: Option<ViewMut<'a>>,
        root: usize,
        phase: Phase,
    ) -> Result<Work<'a>> {
        let (send, recv) = (host_view(send), recv.map(host_view_mut));
        let es = match &recv {
            Some(r) => one_dtype(Op::Gather, send.dtype(), r.dtype())?,
            None => send.dtype().size(),
        };
        let (w, me, r_len) = (self.size(), self.rank(), recv.as_ref().map(|r| r.len()));
        let part = gather(w, me, root, send.len(), r_len, es)?;
        let call = rooted(Op::Gather, phase, root, part);
        counted(self, call, self.post_gather(call, send, recv))
    }

    fn iscatter<'a>(
        &'a self,
        send: Option<View<'a>>,
        recv: ViewMut<'a>,
        root: usize,
        phase: Phase,
    ) -> Result<Work<'a>> {
        let (send, recv) = (send.map(host_view), host_view_mut(recv));
        let es = match &send {
            Some(s) => one_dtype(Op::Scatter, s.dtype(), recv.dtype())?,
            None => recv.dtype().size(),
        };
        let (w, me, s_len) = (self.size(), self.rank(), send.as_ref().map(|s| s.len()));
        let part = scatter(w, me, root, s_len, recv.len(), es)?;
        let call = rooted(Op::Scatter, phase, root, part);
        counted(self, call, self.post_scatter(call, send, recv))
    }

    fn ibarrier(&self) -> Result<Work<'_>> {
        let call = unrooted(Op::Barrier, Phase::Other, (0, 0));
        counted(self, call, self.post_barrier(call))
    }

    fn split(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let group = self.split_group(color, key, name)?;
        self.ctx().stats.record(Phase::Other, Op::Split, 0, 0);
        Ok(group)
    }
}

/// The checks of a collective from a send to a receive view: one dtype, and lengths by `rule`
/// (world, send, recv, element size → bytes).
type PairRule = fn(usize, usize, usize, usize) -> Result<(u64, u64)>;
fn pair<'a>(
    pg: &dyn ProcessGroup,
    op: Op,
    phase: Phase,
    send: View<'a>,
    recv: ViewMut<'a>,
    rule: PairRule,
) -> Result<(Call, View<'a>, ViewMut<'a>)> {
    let (send, recv) = (host_view(send), host_view_mut(recv));
    let es = one_dtype(op, send.dtype(), recv.dtype())?;
    let vol = rule(pg.size(), send.len(), recv.len(), es)?;
    Ok((unrooted(op, phase, vol), send, recv))
}

/// The transport's answer, with the call counted if it was posted.
fn counted<'a, T: Transport + ?Sized>(
    t: &T,
    call: Call,
    posted: Result<Work<'a>>,
) -> Result<Work<'a>> {
    let work = posted?;
    let stats = &t.membership().ctx.stats;
    stats.record(call.phase, call.op, call.sent, call.recv);
    Ok(work)
}

fn unrooted(op: Op, phase: Phase, (sent, recv): (u64, u64)) -> Call {
    Call {
        op,
        phase,
        root: 0,
        is_root: false,
        sent,
        recv,
    }
}

fn rooted(op: Op, phase: Phase, root: usize, part: Rooted) -> Call {
    Call {
        root,
        is_root: part.is_root,
        ..unrooted(op, phase, part.vol)
    }
}

/// Send and receive views hold one dtype; returns its element size.
pub fn one_dtype(op: Op, send: DType, recv: DType) -> Result<usize> {
    if send != recv {
        return Err(CommError::Unsupported {
            op: op.name(),
            message: format!(
                "send and receive views must have one dtype ({} and {})",
                send.name(),
                recv.name()
            ),
        });
    }
    Ok(send.size())
}

/// This rank's part in a rooted collective: whether it is the root, and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rooted {
    pub is_root: bool,
    pub vol: (u64, u64),
}

pub fn check_root(op: &'static str, root: usize, world: usize) -> Result<()> {
    if root >= world {
        return Err(invalid(
            op,
            format!("root {root} out of range for {world} ranks"),
        ));
    }
    Ok(())
}

fn check_len(op: &'static str, what: &str, got: usize, world: usize, piece: usize) -> Result<()> {
    if got != world * piece {
        return Err(invalid(
            op,
            format!("{what} has {got} elements, expected {world}×{piece}"),
        ));
    }
    Ok(())
}

/// `recv` holds every rank's `send`, in rank order.
pub fn all_gather(world: usize, send: usize, recv: usize, elem: usize) -> Result<(u64, u64)> {
    check_len("all_gather", "recv", recv, world, send)?;
    Ok(volume(Op::AllGather, world, send, elem, false))
}

/// `send` holds one `recv`-sized piece per rank.
pub fn reduce_scatter(world: usize, send: usize, recv: usize, elem: usize) -> Result<(u64, u64)> {
    check_len("reduce_scatter", "send", send, world, recv)?;
    Ok(volume(Op::ReduceScatter, world, recv, elem, false))
}

pub fn all_reduce(world: usize, len: usize, elem: usize) -> (u64, u64) {
    volume(Op::AllReduce, world, len, elem, false)
}

/// Broadcast or reduce of `len` elements in place.
pub fn in_place(
    op: Op,
    world: usize,
    rank: usize,
    root: usize,
    len: usize,
    elem: usize,
) -> Result<Rooted> {
    check_root(op.name(), root, world)?;
    let is_root = rank == root;
    Ok(Rooted {
        is_root,
        vol: volume(op, world, len, elem, is_root),
    })
}

/// Gather of `send` elements a rank into the root's `recv`, which only the root passes.
pub fn gather(
    world: usize,
    rank: usize,
    root: usize,
    send: usize,
    recv: Option<usize>,
    elem: usize,
) -> Result<Rooted> {
    rooted_pieces(Op::Gather, "recv", world, rank, root, send, recv, elem)
}

/// Scatter of the root's `send` (which only the root passes) into `recv` elements a rank.
pub fn scatter(
    world: usize,
    rank: usize,
    root: usize,
    send: Option<usize>,
    recv: usize,
    elem: usize,
) -> Result<Rooted> {
    rooted_pieces(Op::Scatter, "send", world, rank, root, recv, send, elem)
}

#[allow(clippy::too_many_arguments)]
fn rooted_pieces(
    op: Op,
    what: &str,
    world: usize,
    rank: usize,
    root: usize,
    piece: usize,
    whole: Option<usize>,
    elem: usize,
) -> Result<Rooted> {
    check_root(op.name(), root, world)?;
    let is_root = rank == root;
    match (whole, is_root) {
        (Some(n), true) => check_len(op.name(), what, n, world, piece)?,
        (None, false) => {}
        _ => {
            return Err(invalid(
                op.name(),
                format!("the root (only) passes a {what} buffer of {world}×{piece} elements"),
            ))
        }
    }
    Ok(Rooted {
        is_root,
        vol: volume(op, world, piece, elem, is_root),
    })
}

/// Variable all-to-all: one count per rank on each side, summing to the buffers' lengths. The
/// bytes are those that leave and reach this rank (its piece to itself is a copy).
pub fn alltoallv(
    world: usize,
    rank: usize,
    elem: usize,
    send: usize,
    send_counts: &[usize],
    recv: usize,
    recv_counts: &[usize],
) -> Result<(u64, u64)> {
    if send_counts.len() != world || recv_counts.len() != world {
        return Err(invalid(
            "alltoallv",
            format!("need {world} send and recv counts"),
        ));
    }
    if send_counts.iter().sum::<usize>() != send || recv_counts.iter().sum::<usize>() != recv {
        return Err(invalid(
            "alltoallv",
            "counts do not sum to the buffer lengths",
        ));
    }
    let others = |c: &[usize]| -> u64 {
        c.iter()
            .enumerate()
            .filter(|&(j, _)| j != rank)
            .map(|(_, &x)| (x * elem) as u64)
            .sum()
    };
    Ok((others(send_counts), others(recv_counts)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::Membership;
    use std::sync::Mutex;

    /// A transport that moves nothing and remembers what the layer handed it.
    struct Fake {
        m: Membership,
        seen: Mutex<Vec<Call>>,
        fail: bool,
    }

    impl Fake {
        /// Rank 1 of 4.
        fn new(fail: bool) -> Self {
            Self {
                m: Membership {
                    rank: 1,
                    world_ranks: vec![0, 1, 2, 3],
                    name: "fake".into(),
                    ctx: RankCtx::new(1, false),
                },
                seen: Mutex::new(Vec::new()),
                fail,
            }
        }
        fn post<'a>(&self, call: Call) -> Result<Work<'a>> {
            self.seen.lock().unwrap().push(call);
            if self.fail {
                Err(CommError::Mpi("the transport refused".into()))
            } else {
                Ok(Work::done())
            }
        }
        fn seen(&self) -> Vec<Call> {
            self.seen.lock().unwrap().clone()
        }
    }

    impl Transport for Fake {
        fn membership(&self) -> &Membership {
            &self.m
        }
        fn post_all_gather<'a>(&'a self, c: Call, _: View<'a>, _: ViewMut<'a>) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_reduce_scatter<'a>(
            &'a self,
            c: Call,
            _: View<'a>,
            _: ViewMut<'a>,
        ) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_all_reduce<'a>(&'a self, c: Call, _: ViewMut<'a>) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_alltoallv<'a>(
            &'a self,
            c: Call,
            _: View<'a>,
            _: &[usize],
            _: ViewMut<'a>,
            _: &[usize],
        ) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_broadcast<'a>(&'a self, c: Call, _: ViewMut<'a>) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_reduce<'a>(&'a self, c: Call, _: ViewMut<'a>) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_gather<'a>(
            &'a self,
            c: Call,
            _: View<'a>,
            _: Option<ViewMut<'a>>,
        ) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_scatter<'a>(
            &'a self,
            c: Call,
            _: Option<View<'a>>,
            _: ViewMut<'a>,
        ) -> Result<Work<'a>> {
            self.post(c)
        }
        fn post_barrier(&self, c: Call) -> Result<Work<'_>> {
            self.post(c)
        }
        fn split_group(
            &self,
            _: Option<usize>,
            _: usize,
            _: &str,
        ) -> Result<Option<Arc<dyn ProcessGroup>>> {
            Ok(None)
        }
    }

    #[test]
    fn the_layer_refuses_bad_calls_before_the_transport_sees_them() {
        fn refused(r: Result<Work<'_>>) -> CommError {
            match r {
                Err(e) => e,
                Ok(_) => panic!("a bad call was accepted"),
            }
        }
        let invalid = |e: CommError| assert!(matches!(e, CommError::Invalid { .. }), "{e}");
        let t = Fake::new(false);
        let pg: &dyn ProcessGroup = &t;
        let (a, mut b) = (vec![0f32; 3], vec![0f32; 11]);
        invalid(refused(pg.iall_gather(
            View::Host(&a),
            ViewMut::Host(&mut b),
            Phase::Other,
        )));
        let mut b64 = vec![0f64; 12];
        let e = refused(pg.iall_gather(View::Host(&a), ViewMut::Host64(&mut b64), Phase::Other));
        assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("one dtype (f32 and f64)"), "{e}");
        invalid(refused(pg.ibroadcast(
            ViewMut::Host(&mut b),
            4,
            Phase::Other,
        )));
        // The root passes the gathered buffer, a leaf (this rank, for root 0) does not.
        let r = pg.igather(View::Host(&a), Some(ViewMut::Host(&mut b)), 0, Phase::Other);
        invalid(refused(r));
        invalid(refused(pg.iscatter(
            None,
            ViewMut::Host(&mut b),
            1,
            Phase::Other,
        )));
        let mut r = vec![0f32; 4];
        let ones = [1, 1, 1, 1];
        let sent = pg.ialltoallv(
            View::Host(&a),
            &ones,
            ViewMut::Host(&mut r),
            &ones,
            Phase::Other,
        );
        invalid(refused(sent));
        assert_eq!(t.seen(), vec![]);
        assert_eq!(pg.ctx().stats.snapshot().entries, vec![]);
    }

    #[test]
    fn the_layer_counts_each_posted_call_once_and_a_refused_post_not_at_all() {
        let t = Fake::new(false);
        let pg: &dyn ProcessGroup = &t;
        let (a, mut b) = (vec![0f32; 3], vec![0f32; 12]);
        pg.all_gather(View::Host(&a), ViewMut::Host(&mut b), Phase::ForwardGather)
            .unwrap();
        let mut c = vec![0f64; 2];
        pg.broadcast(ViewMut::Host64(&mut c), 1, Phase::Other)
            .unwrap();
        pg.gather(View::Host(&a), None, 0, Phase::Optimizer)
            .unwrap();
        pg.barrier().unwrap();
        assert!(pg.split(Some(0), 0, "none").unwrap().is_none());
        let call = |op, phase, root, is_root, sent, recv| Call {
            op,
            phase,
            root,
            is_root,
            sent,
            recv,
        };
        assert_eq!(
            t.seen(),
            vec![
                // A piece of 3 f32 to and from each of the 3 others.
                call(Op::AllGather, Phase::ForwardGather, 0, false, 36, 36),
                // This rank is the root: 2 f64 to each other rank.
                call(Op::Broadcast, Phase::Other, 1, true, 48, 0),
                call(Op::Gather, Phase::Optimizer, 0, false, 12, 0),
                call(Op::Barrier, Phase::Other, 0, false, 0, 0),
            ]
        );
        let snap = pg.ctx().stats.snapshot();
        let counted: Vec<_> = snap
            .entries
            .iter()
            .map(|e| (e.phase, e.op, e.calls, e.bytes_sent, e.bytes_recv))
            .collect();
        assert_eq!(
            counted,
            vec![
                (Phase::ForwardGather, Op::AllGather, 1, 36, 36),
                (Phase::Optimizer, Op::Gather, 1, 12, 0),
                (Phase::Other, Op::Broadcast, 1, 48, 0),
                (Phase::Other, Op::Barrier, 1, 0, 0),
                (Phase::Other, Op::Split, 1, 0, 0),
            ]
        );

        let t = Fake::new(true);
        let pg: &dyn ProcessGroup = &t;
        let e = pg.all_reduce(ViewMut::Host(&mut b), Phase::Other);
        assert!(matches!(e, Err(CommError::Mpi(_))));
        assert_eq!(t.seen().len(), 1);
        assert_eq!(pg.ctx().stats.snapshot().entries, vec![]);
    }

    #[test]
    fn host_backends_refuse_what_they_do_not_move_naming_it() {
        let g = crate::threads_world(1, &Default::default()).pop().unwrap();
        let pg: &dyn ProcessGroup = &g;
        let mut h = vec![0u16; 2];
        let e = pg.all_reduce(ViewMut::HostBf16(&mut h), Phase::Other);
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("all_reduce: host bf16 views are not served"),
            "{e}"
        );
        let (u, mut v) = (vec![1u32; 2], vec![0u32; 2]);
        let e = pg.all_gather(View::HostU32(&u), ViewMut::HostU32(&mut v), Phase::Other);
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("all_gather: host u32 views are not served"),
            "{e}"
        );
        // Refused calls are not counted; bf16 gathers are served and counted.
        assert_eq!(pg.ctx().stats.snapshot().entries, vec![]);
        let mut hg = vec![0u16; 2];
        pg.all_gather(
            View::HostBf16(&[7, 9]),
            ViewMut::HostBf16(&mut hg),
            Phase::Other,
        )
        .unwrap();
        assert_eq!(hg, vec![7, 9]);
        assert_eq!(pg.ctx().stats.snapshot().entries.len(), 1);
    }

    #[test]
    fn refusals_name_the_problem() {
        let e = all_gather(4, 3, 11, 4).unwrap_err().to_string();
        assert!(e.contains("recv has 11 elements, expected 4×3"), "{e}");
        let e = reduce_scatter(2, 5, 3, 4).unwrap_err().to_string();
        assert!(e.contains("send has 5 elements, expected 2×3"), "{e}");
        let e = in_place(Op::Broadcast, 2, 0, 2, 8, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("root 2 out of range for 2 ranks"), "{e}");
        let e = gather(2, 1, 0, 3, Some(6), 4).unwrap_err().to_string();
        assert!(e.contains("the root (only) passes a recv buffer"), "{e}");
        let e = scatter(2, 0, 0, None, 3, 4).unwrap_err().to_string();
        assert!(e.contains("the root (only) passes a send buffer"), "{e}");
        let e = alltoallv(2, 0, 4, 3, &[1, 1], 2, &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts do not sum"), "{e}");
        let e = alltoallv(3, 0, 4, 2, &[1, 1], 2, &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("need 3 send and recv counts"), "{e}");
    }

    #[test]
    fn volumes_follow_the_convention() {
        // A piece of 3 f32 over 4 ranks: 3 pieces out and 3 in.
        assert_eq!(all_gather(4, 3, 12, 4).unwrap(), (36, 36));
        assert_eq!(reduce_scatter(4, 12, 3, 4).unwrap(), (36, 36));
        // The root of a gather receives the others' pieces; a leaf sends its own.
        assert_eq!(gather(4, 0, 0, 3, Some(12), 4).unwrap().vol, (0, 36));
        assert_eq!(gather(4, 2, 0, 3, None, 4).unwrap().vol, (12, 0));
        assert_eq!(scatter(4, 0, 0, Some(12), 3, 4).unwrap().vol, (36, 0));
        // The piece a rank sends itself is not counted.
        assert_eq!(
            alltoallv(3, 1, 2, 6, &[1, 2, 3], 3, &[1, 1, 1]).unwrap(),
            (8, 4)
        );
    }
}

//! A collective that fails inside the model's forward pass (an FSDP block gather, the expert
//! all-to-all) comes back from `RankState::step` as an error naming what was being done, the
//! collective, its group and the failed rank: not as a panic.
//!
//! Rank 1 talks through [`Refusing`], which refuses one kind of collective, so it leaves the
//! step there and exits; rank 0 runs on the plain threads group, whose collective then fails
//! because rank 1 exited without joining it.

mod common;

use common::tiny;
use ganymede_core::{View, ViewMut};
use ganymede_data::Dataset;
use ganymede_dist::{
    run_threads, CommError, Phase, ProcessGroup, RankCtx, Result, ThreadsConfig, Work,
};
use ganymede_parallel::RankState;
use std::sync::Arc;

/// The collective [`Refusing`] refuses.
#[derive(Clone, Copy, PartialEq)]
enum Refuse {
    /// Posted all-gathers: FSDP's block gathers (the root's are blocking and pass).
    PostedGathers,
    /// All-to-alls: expert parallelism's count exchange and row dispatch.
    AllToAll,
}

/// A process group that forwards every collective to `inner` but the `refuse` kind, which
/// fails on this rank without being posted.
struct Refusing {
    inner: Arc<dyn ProcessGroup>,
    refuse: Refuse,
}

impl Refusing {
    fn check(&self, kind: Refuse, op: &'static str) -> Result<()> {
        match kind == self.refuse {
            true => Err(CommError::Invalid {
                op,
                message: "refused by the test".into(),
            }),
            false => Ok(()),
        }
    }
}

impl ProcessGroup for Refusing {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn world_ranks(&self) -> &[usize] {
        self.inner.world_ranks()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn ctx(&self) -> &RankCtx {
        self.inner.ctx()
    }
    fn iall_gather<'a>(
        &'a self,
        send: View<'a>,
        recv: ViewMut<'a>,
        phase: Phase,
    ) -> Result<Work<'a>> {
        self.check(Refuse::PostedGathers, "all_gather")?;
        self.inner.iall_gather(send, recv, phase)
    }
    fn all_gather(&self, send: View, recv: ViewMut, phase: Phase) -> Result<()> {
        self.inner.all_gather(send, recv, phase)
    }
    fn ireduce_scatter<'a>(
        &'a self,
        send: View<'a>,
        recv: ViewMut<'a>,
        phase: Phase,
    ) -> Result<Work<'a>> {
        self.inner.ireduce_scatter(send, recv, phase)
    }
    fn iall_reduce<'a>(&'a self, buf: ViewMut<'a>, phase: Phase) -> Result<Work<'a>> {
        self.inner.iall_reduce(buf, phase)
    }
    fn ialltoallv<'a>(
        &'a self,
        send: View<'a>,
        send_counts: &[usize],
        recv: ViewMut<'a>,
        recv_counts: &[usize],
        phase: Phase,
    ) -> Result<Work<'a>> {
        self.check(Refuse::AllToAll, "alltoallv")?;
        self.inner
            .ialltoallv(send, send_counts, recv, recv_counts, phase)
    }
    fn ibroadcast<'a>(&'a self, buf: ViewMut<'a>, root: usize, phase: Phase) -> Result<Work<'a>> {
        self.inner.ibroadcast(buf, root, phase)
    }
    fn ireduce<'a>(&'a self, buf: ViewMut<'a>, root: usize, phase: Phase) -> Result<Work<'a>> {
        self.inner.ireduce(buf, root, phase)
    }
    fn igather<'a>(
        &'a self,
        send: View<'a>,
        recv: Option<ViewMut<'a>>,
        root: usize,
        phase: Phase,
    ) -> Result<Work<'a>> {
        self.inner.igather(send, recv, root, phase)
    }
    fn iscatter<'a>(
        &'a self,
        send: Option<View<'a>>,
        recv: ViewMut<'a>,
        root: usize,
        phase: Phase,
    ) -> Result<Work<'a>> {
        self.inner.iscatter(send, recv, root, phase)
    }
    fn ibarrier(&self) -> Result<Work<'_>> {
        self.inner.ibarrier()
    }
    fn split(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let sub = self.inner.split(color, key, name)?;
        Ok(sub.map(|inner| {
            let g: Arc<dyn ProcessGroup> = Arc::new(Refusing {
                inner,
                refuse: self.refuse,
            });
            g
        }))
    }
}

/// Step 0 of `tiny` on two ranks with `settings`, rank 1 refusing `refuse`: each rank's step
/// error, `{:#}`-formatted. A panic on either rank fails the test.
fn failed_step(settings: &[&str], refuse: Refuse) -> Vec<String> {
    let cfg = tiny(1, settings);
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap();
    let tc = ThreadsConfig {
        timeout: std::time::Duration::from_secs(30),
        trace: false,
    };
    run_threads(2, &tc, |world| {
        let world: Arc<dyn ProcessGroup> = match world.rank() {
            1 => Arc::new(Refusing {
                inner: world,
                refuse,
            }),
            _ => world,
        };
        let mut st = RankState::new(world, &cfg).unwrap();
        let e = st.step(&data, 0).expect_err("the step failed");
        format!("{e:#}")
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| res.unwrap_or_else(|_| panic!("rank {r} panicked")))
    .collect()
}

#[test]
fn a_failed_block_gather_in_the_forward_pass_is_an_error_naming_it() {
    let e = failed_step(&["parallelism.dp_shard=2"], Refuse::PostedGathers);
    println!("rank 0: {}\nrank 1: {}", e[0], e[1]);
    // Rank 0's gather of block 0, waited for as the block starts, fails because rank 1 left.
    assert!(
        e[0].contains("gathering block 0's parameters")
            && e[0].contains("all_gather on group ")
            && e[0].contains("rank 1 exited without joining"),
        "{}",
        e[0]
    );
    assert!(e[1].contains("refused by the test"), "{}", e[1]);
}

#[test]
fn a_failed_expert_all_to_all_in_the_forward_pass_is_an_error_naming_it() {
    let e = failed_step(
        &["parallelism.dp_shard=2", "parallelism.ep=2"],
        Refuse::AllToAll,
    );
    println!("rank 0: {}\nrank 1: {}", e[0], e[1]);
    assert!(
        e[0].contains("exchanging expert counts")
            && e[0].contains("alltoallv on group ep")
            && e[0].contains("rank 1 exited without joining"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("exchanging expert counts: alltoallv: refused by the test"),
        "{}",
        e[1]
    );
}

//! Tests of the threads backend, the mesh, accounting, traces and faults (the placement
//! policy's and the Muon exchange's are `ganymede_parallel`'s `tests/flexshard.rs`).

use crate::conformance;
use crate::*;
use ganymede_config::ParallelismConfig;
use ganymede_core::{View, ViewMut};
use std::time::{Duration, Instant};

fn cfg(timeout_ms: u64) -> ThreadsConfig {
    ThreadsConfig {
        timeout: Duration::from_millis(timeout_ms),
        trace: false,
    }
}

fn ok<R>(v: Vec<std::thread::Result<R>>) -> Vec<R> {
    v.into_iter()
        .map(|r| r.unwrap_or_else(|p| panic!("rank panicked: {}", threads::panic_message(&*p))))
        .collect()
}

#[test]
fn every_collective_matches_the_reference() {
    for w in 1..=4 {
        let got = ok(run_threads(w, &cfg(10_000), |pg| {
            conformance::run(&*pg).unwrap()
        }));
        for (r, (outs, _)) in got.iter().enumerate() {
            let exp = conformance::expected(r, w);
            assert_eq!(outs.len(), exp.len());
            for ((name, g), (ename, e)) in outs.iter().zip(&exp) {
                assert_eq!(name, ename);
                assert_eq!(g, e, "{name} on rank {r} of {w}");
            }
        }
    }
}

#[test]
fn byte_counters_follow_the_convention() {
    let w = 3;
    let got = ok(run_threads(w, &cfg(10_000), |pg| {
        conformance::run(&*pg).unwrap().1
    }));
    for (r, snap) in got.iter().enumerate() {
        // all_gather of 5 f32 per rank.
        // all_gather of 5 f32 per rank, then a bf16 all_gather of 3 (2 bytes each).
        assert_eq!(
            snap.phase(Phase::ForwardGather),
            (2 * 20 + 2 * 6, 2 * 20 + 2 * 6)
        );
        // reduce_scatter to 3 f32 per rank.
        assert_eq!(snap.phase(Phase::GradReduceScatter), (2 * 12, 2 * 12));
        // all-to-all: counts exchange (1 f32 to each peer) then the uneven payload.
        let sent: usize = (0..w)
            .filter(|&j| j != r)
            .map(|j| conformance::a2a_count(r, j))
            .sum();
        let recv: usize = (0..w)
            .filter(|&j| j != r)
            .map(|j| conformance::a2a_count(j, r))
            .sum();
        assert_eq!(
            snap.phase(Phase::A2aDispatch),
            (4 * (2 + sent) as u64, 4 * (2 + recv) as u64)
        );
        // gather of 2 f32 to root 1, scatter of 3 f32 from root 0.
        let g = if r == 1 { (0, 2 * 8) } else { (8, 0) };
        let s = if r == 0 { (2 * 12, 0) } else { (0, 12) };
        assert_eq!(snap.phase(Phase::Optimizer), (g.0 + s.0, g.1 + s.1));
        let bg = snap.phase(Phase::BackwardGather);
        // all_reduce of 4 f32: 2·(W−1)·16/W = 21 (integer), plus all_gather of 3 f32.
        assert_eq!(bg, (21 + 24, 21 + 24));
    }
}

/// Expert parallelism's bf16 rows go through the all-to-all as they are: rank r sends
/// r + j + 1 elements to rank j, each bf16 value naming its sender, receiver and place, and
/// the byte counters count 2 bytes an element.
#[test]
fn a_bf16_alltoallv_moves_the_bits() {
    let w = 3;
    let bits = |from: usize, to: usize, i: usize| (0x3f80 + 64 * from + 16 * to + i) as u16;
    // Elements from rank `from` to rank `to`: not symmetric, so what a rank sends and what it
    // receives differ in count and the byte counts tell them apart.
    let count = |from: usize, to: usize| 1 + from * from + 2 * to;
    let got = ok(run_threads(w, &cfg(5_000), |pg| {
        let r = pg.rank();
        let sc: Vec<usize> = (0..w).map(|j| count(r, j)).collect();
        let rc: Vec<usize> = (0..w).map(|j| count(j, r)).collect();
        let send: Vec<u16> = (0..w)
            .flat_map(|j| (0..sc[j]).map(move |i| bits(r, j, i)))
            .collect();
        let mut recv = vec![0u16; rc.iter().sum()];
        pg.alltoallv(
            View::HostBf16(&send),
            &sc,
            ViewMut::HostBf16(&mut recv),
            &rc,
            Phase::A2aDispatch,
        )
        .unwrap();
        (recv, pg.ctx().stats.snapshot().phase(Phase::A2aDispatch))
    }));
    for (r, (recv, bytes)) in got.into_iter().enumerate() {
        let want: Vec<u16> = (0..w)
            .flat_map(|j| (0..count(j, r)).map(move |i| bits(j, r, i)))
            .collect();
        assert_eq!(recv, want, "rank {r}");
        let peers = |f: &dyn Fn(usize) -> usize| (0..w).filter(|&j| j != r).map(f).sum::<usize>();
        let (sent, received) = (peers(&|j| count(r, j)), peers(&|j| count(j, r)));
        assert_ne!(sent, received);
        assert_eq!(bytes, (2 * sent as u64, 2 * received as u64), "rank {r}");
    }
}

#[test]
fn stats_reset_and_snapshot() {
    let got = ok(run_threads(2, &cfg(5_000), |pg| {
        let mut b = vec![1f32; 8];
        pg.all_reduce(ViewMut::Host(&mut b), Phase::Optimizer)
            .unwrap();
        let before = pg.ctx().stats.snapshot();
        pg.ctx().stats.reset();
        (before, pg.ctx().stats.snapshot(), b)
    }));
    for (before, after, b) in got {
        assert_eq!(b, vec![2f32; 8]);
        assert_eq!(before.entries.len(), 1);
        assert_eq!(before.entries[0].op, Op::AllReduce);
        assert_eq!(before.total(), (32, 32));
        assert!(after.entries.is_empty());
        assert!(before.by_phase_json()["optimizer"]["sent"] == 32);
    }
}

#[test]
fn sums_are_in_rank_order_and_one_rank_is_identity() {
    // Values whose float sum depends on the order.
    let vals = [1e8f32, 1.0, -1e8, 0.5];
    let seq = |k: usize| -> f32 {
        let mut s = vals[0].mul_add(1.0, k as f32 * 1e-3);
        for (j, v) in vals.iter().enumerate().skip(1) {
            s += v + (k * (j + 1)) as f32 * 1e-3;
        }
        s
    };
    for _ in 0..3 {
        let got = ok(run_threads(4, &cfg(5_000), |pg| {
            let r = pg.rank();
            let mut b: Vec<f32> = (0..16)
                .map(|k| vals[r] + (k * (r + 1)) as f32 * 1e-3)
                .collect();
            pg.all_reduce(ViewMut::Host(&mut b), Phase::Other).unwrap();
            b
        }));
        for b in &got {
            for (k, &x) in b.iter().enumerate() {
                assert_eq!(x.to_bits(), seq(k).to_bits());
            }
        }
    }
    let x: Vec<f32> = (0..10).map(|i| (i as f32).sin()).collect();
    let got = ok(run_threads(1, &cfg(5_000), |pg| {
        let mut b = x.clone();
        pg.all_reduce(ViewMut::Host(&mut b), Phase::Other).unwrap();
        let mut rs = vec![0f32; 10];
        pg.reduce_scatter(View::Host(&x), ViewMut::Host(&mut rs), Phase::Other)
            .unwrap();
        (b, rs)
    }));
    assert_eq!(got[0].0, x);
    assert_eq!(got[0].1, x);
}

#[test]
fn nonblocking_overlaps_with_work() {
    let got = ok(run_threads(2, &cfg(10_000), |pg| {
        let r = pg.rank();
        let mut b = vec![r as f32 + 1.0; 1000];
        if r == 1 {
            std::thread::sleep(Duration::from_millis(250));
        }
        let t0 = Instant::now();
        let mut work = pg
            .iall_reduce(ViewMut::Host(&mut b), Phase::ForwardGather)
            .unwrap();
        let post = t0.elapsed();
        let ready_early = work.ready();
        // "Compute" while the peer is late: the collective completes meanwhile.
        std::thread::sleep(Duration::from_millis(500));
        let ready_late = work.ready();
        let t1 = Instant::now();
        work.wait().unwrap();
        (r, post, ready_early, ready_late, t1.elapsed(), b)
    }));
    let (_, post, ready_early, ready_late, waited, b) = &got[0];
    assert!(
        *post < Duration::from_millis(100),
        "posting blocked: {post:?}"
    );
    assert!(!ready_early, "complete before the peer arrived");
    assert!(*ready_late);
    assert!(
        *waited < Duration::from_millis(100),
        "wait blocked {waited:?}"
    );
    assert!(b.iter().all(|&x| x == 3.0));
}

#[test]
fn timeout_fires_when_a_rank_never_joins() {
    let t0 = Instant::now();
    let got = ok(run_threads(3, &cfg(300), |pg| {
        if pg.rank() == 2 {
            // Alive but stuck: never joins within the timeout.
            std::thread::sleep(Duration::from_millis(1200));
            return None;
        }
        let mut b = vec![1f32; 4];
        let t = Instant::now();
        let e = pg
            .all_reduce(ViewMut::Host(&mut b), Phase::Other)
            .unwrap_err();
        Some((e, t.elapsed()))
    }));
    for (e, took) in got.into_iter().flatten() {
        match &e {
            CommError::Timeout { missing, op, .. } => {
                assert_eq!(missing, &vec![2]);
                assert_eq!(*op, "all_reduce");
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(took >= Duration::from_millis(300) && took < Duration::from_millis(1000));
        assert!(e.to_string().contains("not arrived: [2]"));
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_rank_that_exits_fails_its_peers_at_once() {
    let got = ok(run_threads(3, &cfg(20_000), |pg| {
        if pg.rank() == 1 {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        let e = pg.barrier().unwrap_err();
        Some((e, t.elapsed()))
    }));
    for (e, took) in got.into_iter().flatten() {
        assert!(matches!(e, CommError::PeerExited { rank: 1, .. }), "{e}");
        assert!(took < Duration::from_secs(2));
    }
}

#[test]
fn a_panicking_rank_poisons_the_group() {
    let t0 = Instant::now();
    let res = run_threads(4, &cfg(30_000), |pg| {
        let ep = pg.split(Some(pg.rank() / 2), 0, "pair").unwrap().unwrap();
        if pg.rank() == 2 {
            std::thread::sleep(Duration::from_millis(100));
            panic!("boom on purpose");
        }
        let mut b = vec![1f32; 4];
        // Rank 3 waits in a sub-group that rank 2 belongs to, the others in the world.
        let e = if pg.rank() == 3 {
            ep.all_reduce(ViewMut::Host(&mut b), Phase::Other)
                .unwrap_err()
        } else {
            pg.all_reduce(ViewMut::Host(&mut b), Phase::Other)
                .unwrap_err()
        };
        // And every later collective fails too.
        let e2 = pg.barrier().unwrap_err();
        (e, e2)
    });
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "poisoning was not prompt"
    );
    for (r, x) in res.into_iter().enumerate() {
        match x {
            Err(p) => {
                assert_eq!(r, 2);
                assert!(threads::panic_message(&*p).contains("boom"));
            }
            Ok((e, e2)) => {
                for e in [e, e2] {
                    match e {
                        CommError::PeerPanicked { rank, message } => {
                            assert_eq!(rank, 2);
                            assert!(message.contains("boom on purpose"));
                        }
                        other => panic!("rank {r}: expected poisoning, got {other}"),
                    }
                }
            }
        }
    }
}

#[test]
fn a_panic_with_own_threads_poisons_through_the_handle() {
    let handles = threads_world(2, &cfg(30_000));
    let t0 = Instant::now();
    let errs: Vec<_> = std::thread::scope(|s| {
        let js: Vec<_> = handles
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    if g.rank() == 0 {
                        let _g = g;
                        panic!("rank 0 fails");
                    }
                    g.barrier().err()
                })
            })
            .collect();
        js.into_iter().map(|j| j.join()).collect()
    });
    assert!(errs[0].is_err());
    let e = errs[1].as_ref().unwrap().clone().unwrap();
    assert!(matches!(e, CommError::PeerPanicked { rank: 0, .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn mismatched_calls_and_bad_arguments_are_errors() {
    let got = ok(run_threads(2, &cfg(5_000), |pg| {
        let mut b = vec![0f32; 4];
        let e1 = if pg.rank() == 0 {
            pg.all_reduce(ViewMut::Host(&mut b), Phase::Other)
                .unwrap_err()
        } else {
            pg.broadcast(ViewMut::Host(&mut b), 0, Phase::Other)
                .unwrap_err()
        };
        // Counts that disagree: rank 0 sends 2 to rank 1, rank 1 expects 1.
        let sc = [1, 2];
        let rc = if pg.rank() == 0 { [1, 1] } else { [1, 2] };
        let s = vec![0f32; 3];
        let mut r = vec![0f32; rc.iter().sum()];
        let e2 = pg
            .alltoallv(
                View::Host(&s),
                &sc,
                ViewMut::Host(&mut r),
                &rc,
                Phase::Other,
            )
            .unwrap_err();
        let mut small = vec![0f32; 3];
        let e3 = pg
            .all_gather(View::Host(&b), ViewMut::Host(&mut small), Phase::Other)
            .unwrap_err();
        let e4 = pg
            .broadcast(ViewMut::Host(&mut b), 5, Phase::Other)
            .unwrap_err();
        (e1, e2, e3, e4)
    }));
    for (e1, e2, e3, e4) in got {
        assert!(matches!(e1, CommError::Mismatch { .. }), "{e1}");
        assert!(matches!(e2, CommError::Mismatch { .. }), "{e2}");
        assert!(matches!(e3, CommError::Invalid { .. }), "{e3}");
        assert!(matches!(e4, CommError::Invalid { .. }), "{e4}");
    }
}

#[test]
fn mesh_groups_have_the_right_members() {
    assert_eq!(
        MeshShape::new(4, 3).unwrap_err(),
        MeshError::EpDoesNotDivide { dp_shard: 4, ep: 3 }
    );
    assert!(MeshShape::new(4, 0).is_err());
    let s = MeshShape::new(8, 4).unwrap();
    assert_eq!(s.efsdp(), 2);
    assert_eq!(s.ep_members(5), vec![4, 5, 6, 7]);
    assert_eq!(s.efsdp_members(5), vec![1, 5]);

    let p = ParallelismConfig {
        dp_shard: 4,
        ep: 2,
        ..Default::default()
    };
    let got = ok(run_threads(4, &cfg(5_000), |pg| {
        let m = DeviceMesh::new(pg.clone(), &p).unwrap();
        let mut b = vec![(1 << pg.rank()) as f32];
        m.ep.all_reduce(ViewMut::Host(&mut b), Phase::A2aDispatch)
            .unwrap();
        let mut c = vec![(1 << pg.rank()) as f32];
        m.efsdp
            .all_reduce(ViewMut::Host(&mut c), Phase::Other)
            .unwrap();
        (
            m.ep.world_ranks().to_vec(),
            m.efsdp.world_ranks().to_vec(),
            m.ep.rank(),
            b[0],
            c[0],
        )
    }));
    let want_ep = [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]];
    let want_efsdp = [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]];
    for (r, (ep, efsdp, ep_rank, b, c)) in got.into_iter().enumerate() {
        assert_eq!(ep, want_ep[r]);
        assert_eq!(efsdp, want_efsdp[r]);
        assert_eq!(ep_rank, r % 2);
        assert_eq!(b, ep.iter().map(|&j| (1 << j) as f32).sum::<f32>());
        assert_eq!(c, efsdp.iter().map(|&j| (1 << j) as f32).sum::<f32>());
    }

    // Wrong world size.
    let got = ok(run_threads(2, &cfg(5_000), |pg| {
        DeviceMesh::new(pg, &p).err().map(|e| e.to_string())
    }));
    assert!(got[0].as_ref().unwrap().contains("2 ranks"));
}

#[test]
fn hsdp_mesh_puts_replicas_outermost() {
    assert_eq!(
        MeshShape::hsdp(0, 2, 1).unwrap_err(),
        MeshError::NoReplicas { dp_replicate: 0 }
    );
    let s = MeshShape::hsdp(2, 4, 2).unwrap();
    assert_eq!(s.world(), 8);
    assert_eq!(s.replica_coords(6), (1, 2));
    assert_eq!(s.replicate_members(6), vec![2, 6]);

    // 2 replicas × (dp_shard 4, ep 2) on 8 thread ranks.
    let p = ParallelismConfig {
        dp_replicate: 2,
        dp_shard: 4,
        ep: 2,
        ..Default::default()
    };
    let got = ok(run_threads(8, &cfg(5_000), |pg| {
        let m = DeviceMesh::new(pg.clone(), &p).unwrap();
        let rep = m.replicate.as_ref().unwrap();
        let mut b = vec![(1 << pg.rank()) as f32];
        rep.all_reduce(ViewMut::Host(&mut b), Phase::GradReplicaAllReduce)
            .unwrap();
        (
            m.world.world_ranks().to_vec(),
            m.dp_shard.world_ranks().to_vec(),
            rep.world_ranks().to_vec(),
            m.ep.world_ranks().to_vec(),
            m.efsdp.world_ranks().to_vec(),
            b[0],
            m.dp_shard
                .ctx()
                .stats
                .snapshot()
                .phase(Phase::GradReplicaAllReduce),
        )
    }));
    for (r, (world, dp, rep, ep, efsdp, b, bytes)) in got.into_iter().enumerate() {
        let (q, sr) = (r / 4, r % 4);
        assert_eq!(world, (0..8).collect::<Vec<_>>());
        assert_eq!(dp, (4 * q..4 * q + 4).collect::<Vec<_>>(), "rank {r}");
        assert_eq!(rep, vec![sr, sr + 4], "rank {r}");
        // ep groups stay on consecutive ranks inside the replica.
        let f = sr / 2;
        assert_eq!(ep, vec![4 * q + 2 * f, 4 * q + 2 * f + 1], "rank {r}");
        assert_eq!(efsdp, vec![4 * q + sr % 2, 4 * q + 2 + sr % 2], "rank {r}");
        assert_eq!(b, ((1 << sr) + (1 << (sr + 4))) as f32);
        // Ring volume of one f32 over 2 ranks: 2·(2-1)·4/2 bytes each way.
        assert_eq!(bytes, (4, 4));
    }

    // The world must be dp_replicate × dp_shard.
    let got = ok(run_threads(4, &cfg(5_000), |pg| {
        DeviceMesh::new(pg, &p).err().map(|e| e.to_string())
    }));
    let e = got[0].as_ref().unwrap();
    assert!(
        e.contains("dp_replicate × parallelism.dp_shard = 2 × 4 = 8") && e.contains("4 ranks"),
        "{e}"
    );
}

#[test]
fn config_hash_mismatch_is_refused() {
    #[derive(serde::Serialize)]
    struct C {
        lr: f64,
        layers: usize,
    }
    let got = ok(run_threads(3, &cfg(5_000), |pg| {
        let same = check_config_hash(
            &*pg,
            config_hash(&C {
                lr: 0.01,
                layers: 2,
            }),
        );
        let layers = if pg.rank() == 2 { 3 } else { 2 };
        let diff = check_config_hash(&*pg, config_hash(&C { lr: 0.01, layers }));
        (same, diff)
    }));
    for (same, diff) in got {
        assert_eq!(
            same.unwrap(),
            config_hash(&C {
                lr: 0.01,
                layers: 2
            })
        );
        match diff.unwrap_err() {
            e @ CommError::ConfigMismatch { rank: 2, .. } => {
                assert!(e.to_string().contains("rank 2"))
            }
            e => panic!("{e}"),
        }
    }
}

#[test]
fn trace_has_per_rank_compute_comm_and_wait_events() {
    let tc = ThreadsConfig {
        trace: true,
        ..cfg(5_000)
    };
    let tracers = ok(run_threads(2, &tc, |pg| {
        let mut b = vec![1f32; 64];
        let w = pg
            .iall_reduce(ViewMut::Host(&mut b), Phase::ForwardGather)
            .unwrap();
        {
            let _s = pg.ctx().tracer.span("block 0 forward", Track::Compute);
            std::thread::sleep(Duration::from_millis(20));
        }
        w.wait().unwrap();
        pg.ctx().tracer.clone()
    }));
    let path =
        std::env::temp_dir().join(format!("ganymede-dist-trace-{}.json", std::process::id()));
    // As MPI ranks would: one file each, then merged.
    let parts: Vec<_> = tracers
        .iter()
        .map(|t| {
            let p = path.with_extension(format!("rank{}.json", t.rank()));
            write_chrome_trace(&p, &[&**t]).unwrap();
            p
        })
        .collect();
    trace::merge_chrome_traces(&parts, &path).unwrap();
    parts.iter().for_each(|p| drop(std::fs::remove_file(p)));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    let evs = doc["traceEvents"].as_array().unwrap();
    for pid in 0..2u64 {
        let mine: Vec<_> = evs
            .iter()
            .filter(|e| e["pid"] == pid && e["ph"] == "X")
            .collect();
        for cat in ["compute", "comm", "wait"] {
            assert!(
                mine.iter().any(|e| e["cat"] == cat),
                "rank {pid} lacks {cat}"
            );
        }
        let comm = mine.iter().find(|e| e["cat"] == "comm").unwrap();
        assert_eq!(comm["name"], "all_reduce forward_gather");
        assert_eq!(comm["args"]["bytes_sent"], 256);
        let compute = mine.iter().find(|e| e["cat"] == "compute").unwrap();
        assert!(compute["dur"].as_f64().unwrap() >= 20_000.0);
        // The collective was in flight across the compute span.
        assert!(comm["ts"].as_f64().unwrap() <= compute["ts"].as_f64().unwrap());
        assert!(evs.iter().any(|e| e["ph"] == "M" && e["pid"] == pid));
    }
}

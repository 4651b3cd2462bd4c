//! `mpirun -n N mpi_check`: runs every collective on the MPI backend and compares each rank's
//! results and byte counters with the threads backend running the same N ranks in this process,
//! then checks the mesh groups, the optimizer exchange's byte counts against the placement
//! formulas, overlap of a non-blocking collective, the timeout and the config-hash check.
//! Exits non-zero (and says what differed) on any failure.

use ganymede_core::{ParamKind, ParamSpec, ViewMut};
use ganymede_dist::mpi::{init, MpiConfig};
use ganymede_dist::*;
use ganymede_parallel::flexshard::plan;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fail(rank: usize, what: String) -> ! {
    eprintln!("mpi_check: rank {rank}: FAILED: {what}");
    std::process::exit(1);
}

fn check(rank: usize, ok: bool, what: impl FnOnce() -> String, n: &mut usize) {
    if !ok {
        fail(rank, what());
    }
    *n += 1;
}

fn specs() -> Vec<ParamSpec> {
    // Two tiny-preset layers' Muon matrices and experts, plus AdamW tensors.
    let mut s = vec![ParamSpec::new("emb", &[256, 64], ParamKind::Embedding)];
    for l in 0..2 {
        let m = |n: &str, sh: &[usize], k| ParamSpec::new(format!("l{l}.{n}"), sh, k);
        s.push(m("norm", &[64], ParamKind::Vector));
        s.push(m("q", &[64, 64], ParamKind::Matrix));
        s.push(m("k", &[32, 64], ParamKind::Matrix));
        s.push(m("v", &[32, 64], ParamKind::Matrix));
        s.push(m("o", &[64, 64], ParamKind::Matrix));
        s.push(m("router", &[8, 64], ParamKind::Router));
        s.push(m("experts.gate", &[8, 128, 64], ParamKind::Experts));
        s.push(m("experts.up", &[8, 128, 64], ParamKind::Experts));
        s.push(m("experts.down", &[8, 64, 128], ParamKind::Experts));
    }
    s
}

fn exchange(mesh: &DeviceMesh, p: &Plan) -> (u64, u64) {
    mesh.dp_shard.ctx().stats.reset();
    let mut store: Vec<(usize, Vec<f32>)> = p
        .params
        .iter()
        .enumerate()
        .filter(|(_, pp)| pp.is_muon())
        .map(|(i, pp)| (i, vec![1f32; pp.shard_elems]))
        .collect();
    let mut slices: Vec<(usize, ViewMut)> = store
        .iter_mut()
        .map(|(i, v)| (*i, ViewMut::Host(&mut v[..])))
        .collect();
    let mut bufs: Vec<Vec<f32>> = root_buffers(p, mesh)
        .iter()
        .map(|&(_, n)| vec![0f32; n])
        .collect();
    let mut roots: Vec<ViewMut> = bufs.iter_mut().map(|b| ViewMut::Host(&mut b[..])).collect();
    muon_exchange(p, mesh, &mut slices, &mut roots, &mut |job: NsJob| {
        job.data.host::<f32>().iter_mut().for_each(|x| *x *= 3.0)
    })
    .unwrap();
    mesh.dp_shard.ctx().stats.snapshot().phase(Phase::Optimizer)
}

fn main() {
    let (_mpi, world) = init(&MpiConfig {
        timeout: Duration::from_secs(60),
        trace: false,
    })
    .unwrap_or_else(|e| fail(0, e.to_string()));
    let pg: Arc<dyn ProcessGroup> = world.clone();
    let (r, w) = (pg.rank(), pg.size());
    let mut n = 0;

    // 1. Every collective against the threads backend, bit for bit, and the counters.
    let (outs, snap) = conformance::run(&*pg).unwrap_or_else(|e| fail(r, e.to_string()));
    let reference = run_threads(w, &ThreadsConfig::default(), |g| {
        conformance::run(&*g).unwrap()
    });
    let (th_outs, th_snap) = match reference.into_iter().nth(r).unwrap() {
        Ok(x) => x,
        Err(_) => fail(r, "threads reference panicked".into()),
    };
    let expected = conformance::expected(r, w);
    for (((name, got), (_, th)), (_, exp)) in outs.iter().zip(&th_outs).zip(&expected) {
        check(
            r,
            got == th,
            || format!("{name}: MPI {got:?} vs threads {th:?}"),
            &mut n,
        );
        check(
            r,
            got == exp,
            || format!("{name}: MPI {got:?} vs reference {exp:?}"),
            &mut n,
        );
    }
    check(
        r,
        snap == th_snap,
        || format!("byte counters differ: MPI {snap:?} vs threads {th_snap:?}"),
        &mut n,
    );

    // 2. Mesh groups (ep = 2 when it divides the world).
    let ep = if w % 2 == 0 { 2 } else { 1 };
    let par = ganymede_config::ParallelismConfig {
        dp_shard: w,
        ep,
        ..Default::default()
    };
    let mesh = DeviceMesh::new(pg.clone(), &par).unwrap_or_else(|e| fail(r, e.to_string()));
    let shape = MeshShape::new(w, ep).unwrap();
    check(
        r,
        mesh.ep.world_ranks() == shape.ep_members(r),
        || "ep members".into(),
        &mut n,
    );
    check(
        r,
        mesh.efsdp.world_ranks() == shape.efsdp_members(r),
        || "efsdp members".into(),
        &mut n,
    );
    let mut b = vec![(1u32 << r) as f32];
    mesh.ep
        .all_reduce(ViewMut::Host(&mut b), Phase::A2aDispatch)
        .unwrap();
    let want: f32 = shape
        .ep_members(r)
        .iter()
        .map(|&j| (1u32 << j) as f32)
        .sum();
    check(
        r,
        b[0] == want,
        || format!("ep all_reduce {} vs {want}", b[0]),
        &mut n,
    );

    // 3. The optimizer exchange counts exactly what the placement formulas say.
    for policy in [Policy::Naive, Policy::FlexShard] {
        let p = plan(&specs(), shape, policy).unwrap();
        let got = exchange(&mesh, &p);
        let want = optimizer_bytes(&p, 4)[r];
        check(
            r,
            got == want,
            || format!("{policy:?} bytes {got:?} vs formula {want:?}"),
            &mut n,
        );
    }

    // 4. Non-blocking: rank 0 posts, the others arrive late; rank 0's compute hides the wait.
    pg.barrier().unwrap();
    let mut buf = vec![1f32; 1 << 16];
    if r != 0 {
        std::thread::sleep(Duration::from_millis(200));
    }
    let t0 = Instant::now();
    let work = pg
        .iall_reduce(ViewMut::Host(&mut buf), Phase::ForwardGather)
        .unwrap();
    let post = t0.elapsed();
    if r == 0 {
        std::thread::sleep(Duration::from_millis(400));
    }
    let t1 = Instant::now();
    work.wait().unwrap();
    let waited = t1.elapsed();
    check(
        r,
        buf.iter().all(|&x| x == w as f32),
        || "i-all_reduce result".into(),
        &mut n,
    );
    check(
        r,
        post < Duration::from_millis(100),
        || format!("posting took {post:?}"),
        &mut n,
    );
    if r == 0 && w > 1 {
        check(
            r,
            waited < Duration::from_millis(150),
            || format!("wait blocked {waited:?}"),
            &mut n,
        );
    }

    // 5. Timeout: on a duplicate with a short fuse, the last rank arrives late.
    let short = world.with_timeout(Duration::from_millis(300), "short");
    if w > 1 {
        if r == w - 1 {
            std::thread::sleep(Duration::from_millis(1000));
            short.barrier().unwrap();
        } else {
            let t = Instant::now();
            let e = short.barrier().unwrap_err();
            let took = t.elapsed();
            check(
                r,
                matches!(e, CommError::Timeout { .. }) && took < Duration::from_millis(900),
                || format!("expected a timeout within bound, got {e} after {took:?}"),
                &mut n,
            );
        }
    }
    pg.barrier().unwrap();

    // 6. Config hash: equal passes, a rank with another config is named.
    let h = check_config_hash(&*pg, fnv1a64(b"same config")).unwrap();
    check(
        r,
        h == fnv1a64(b"same config"),
        || "agreed hash".into(),
        &mut n,
    );
    if w > 1 {
        let mine: &[u8] = if r == w - 1 { b"other" } else { b"same config" };
        match check_config_hash(&*pg, fnv1a64(mine)) {
            Err(CommError::ConfigMismatch { rank, .. }) if rank == w - 1 => n += 1,
            other => fail(r, format!("config mismatch not detected: {other:?}")),
        }
    }

    pg.barrier().unwrap();
    println!("mpi_check: rank {r}/{w}: {n} checks passed");
}

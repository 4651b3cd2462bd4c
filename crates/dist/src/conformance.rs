//! One run of every collective on fixed inputs, and the answers computed directly. The unit
//! tests hold the threads backend to [`expected`]; the MPI check (`examples/mpi_check.rs`)
//! holds MPI to the threads backend, bit for bit, and compares the byte counters too.
//!
//! Inputs are small integers (and dyadic fractions for f64), so every sum is exact whatever the
//! reduction order and the comparison can be exact.

use crate::error::Result;
use crate::group::{ProcessGroup, Work};
use crate::stats::{CommSnapshot, Phase};
use ganymede_core::{View, ViewMut};

/// Named outputs of one rank.
pub type Outputs = Vec<(String, Vec<f64>)>;

fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 17) as f32 - 8.0
}
fn data(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| val(r, i)).collect()
}
fn data64(r: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| val(r, i) as f64 * 0.125 + 1.0 / 1024.0)
        .collect()
}
/// Elements rank `from` sends to rank `to` in the uneven all-to-all (zeros included).
pub fn a2a_count(from: usize, to: usize) -> usize {
    (from + 2 * to) % 4
}
fn a2a_send(r: usize, w: usize) -> Vec<f32> {
    // Element k of the block for rank j: 100·r + 10·j + k, so every element says where it went.
    (0..w)
        .flat_map(|j| (0..a2a_count(r, j)).map(move |k| (100 * r + 10 * j + k) as f32))
        .collect()
}
fn roots(w: usize) -> (usize, usize, usize, usize) {
    // broadcast, reduce, gather, scatter roots
    (w - 1, 1 % w, w / 2, 0)
}
fn f(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Run the suite on `pg` (every rank of the group calls it) and return this rank's outputs and
/// its counters (reset first).
pub fn run(pg: &dyn ProcessGroup) -> Result<(Outputs, CommSnapshot)> {
    let (r, w) = (pg.rank(), pg.size());
    let (rb, rr, rg, rs) = roots(w);
    pg.ctx().stats.reset();
    let mut out: Outputs = Vec::new();

    let mut ag = vec![0f32; 5 * w];
    pg.all_gather(
        View::Host(&data(r, 5)),
        ViewMut::Host(&mut ag),
        Phase::ForwardGather,
    )?;
    out.push(("all_gather".into(), f(&ag)));

    let mut rs_out = vec![0f32; 3];
    pg.reduce_scatter(
        View::Host(&data(r, 3 * w)),
        ViewMut::Host(&mut rs_out),
        Phase::GradReduceScatter,
    )?;
    out.push(("reduce_scatter".into(), f(&rs_out)));

    let mut ar = data(r, 7);
    pg.all_reduce(ViewMut::Host(&mut ar), Phase::Other)?;
    out.push(("all_reduce".into(), f(&ar)));

    let send_counts: Vec<usize> = (0..w).map(|j| a2a_count(r, j)).collect();
    let recv_counts = pg.exchange_counts(&send_counts, Phase::A2aDispatch)?;
    out.push((
        "exchange_counts".into(),
        recv_counts.iter().map(|&c| c as f64).collect(),
    ));
    let mut a2a = vec![0f32; recv_counts.iter().sum()];
    pg.alltoallv(
        View::Host(&a2a_send(r, w)),
        &send_counts,
        ViewMut::Host(&mut a2a),
        &recv_counts,
        Phase::A2aDispatch,
    )?;
    out.push(("alltoallv".into(), f(&a2a)));

    let mut bc = if r == rb { data(r, 4) } else { vec![-1.0; 4] };
    pg.broadcast(ViewMut::Host(&mut bc), rb, Phase::Other)?;
    out.push(("broadcast".into(), f(&bc)));

    let mut red = data(r, 6);
    pg.reduce(ViewMut::Host(&mut red), rr, Phase::Other)?;
    out.push(("reduce".into(), f(&red)));

    let mut gat = vec![0f32; 2 * w];
    let recv = (r == rg).then_some(ViewMut::Host(&mut gat));
    pg.gather(View::Host(&data(r, 2)), recv, rg, Phase::Optimizer)?;
    out.push(("gather".into(), f(&gat)));

    let src = data(100, 3 * w);
    let mut sc = vec![0f32; 3];
    let send = (r == rs).then_some(View::Host(&src[..]));
    pg.scatter(send, ViewMut::Host(&mut sc), rs, Phase::Optimizer)?;
    out.push(("scatter".into(), f(&sc)));

    pg.barrier()?;

    let mut ar64 = data64(r, 9);
    pg.all_reduce(ViewMut::Host64(&mut ar64), Phase::Other)?;
    out.push(("all_reduce_f64".into(), ar64));

    // Two collectives in flight at once, waited in reverse order.
    let mut nb1 = data(r, 4);
    let mut nb2 = vec![0f32; 3 * w];
    let s2 = data(r + 1, 3);
    {
        let w1: Work = pg.iall_reduce(ViewMut::Host(&mut nb1), Phase::BackwardGather)?;
        let w2 = pg.iall_gather(
            View::Host(&s2),
            ViewMut::Host(&mut nb2),
            Phase::BackwardGather,
        )?;
        w2.wait()?;
        w1.wait()?;
    }
    out.push(("nonblocking_all_reduce".into(), f(&nb1)));
    out.push(("nonblocking_all_gather".into(), f(&nb2)));

    let h: Vec<u16> = data(r, 3)
        .iter()
        .map(|&x| ganymede_core::bf16::from_f32(x * 0.1))
        .collect();
    let mut hg = vec![0u16; 3 * w];
    pg.all_gather(
        View::HostBf16(&h),
        ViewMut::HostBf16(&mut hg),
        Phase::ForwardGather,
    )?;
    out.push((
        "all_gather_bf16".into(),
        hg.iter().map(|&x| x as f64).collect(),
    ));

    // A sub-group: even and odd ranks, in reverse rank order (key = size - rank).
    let sub = pg
        .split(Some(r % 2), w - r, "parity")?
        .expect("every rank has a color");
    let mut sr = data(r, 3);
    sub.all_reduce(ViewMut::Host(&mut sr), Phase::Other)?;
    let mut sg = vec![0f32; sub.size()];
    sub.all_gather(
        View::Host(&[r as f32]),
        ViewMut::Host(&mut sg),
        Phase::Other,
    )?;
    out.push(("split_all_reduce".into(), f(&sr)));
    out.push(("split_all_gather".into(), f(&sg)));

    Ok((out, pg.ctx().stats.snapshot()))
}

/// What [`run`] must return on rank `r` of `w`, computed directly.
pub fn expected(r: usize, w: usize) -> Outputs {
    let (rb, rr, rg, rs) = roots(w);
    let sum = |n: usize, off: usize, g: &dyn Fn(usize, usize) -> f64, ranks: &[usize]| {
        (0..n)
            .map(|i| ranks.iter().map(|&j| g(j, off + i)).sum())
            .collect::<Vec<f64>>()
    };
    let all: Vec<usize> = (0..w).collect();
    let v = |j: usize, i: usize| val(j, i) as f64;
    let v64 = |j: usize, i: usize| val(j, i) as f64 * 0.125 + 1.0 / 1024.0;
    let mut out: Outputs = Vec::new();
    out.push((
        "all_gather".into(),
        (0..w).flat_map(|j| (0..5).map(move |i| v(j, i))).collect(),
    ));
    out.push(("reduce_scatter".into(), sum(3, 3 * r, &v, &all)));
    out.push(("all_reduce".into(), sum(7, 0, &v, &all)));
    out.push((
        "exchange_counts".into(),
        (0..w).map(|j| a2a_count(j, r) as f64).collect(),
    ));
    out.push((
        "alltoallv".into(),
        (0..w)
            .flat_map(|j| (0..a2a_count(j, r)).map(move |k| (100 * j + 10 * r + k) as f64))
            .collect(),
    ));
    out.push(("broadcast".into(), (0..4).map(|i| v(rb, i)).collect()));
    out.push((
        "reduce".into(),
        if r == rr {
            sum(6, 0, &v, &all)
        } else {
            (0..6).map(|i| v(r, i)).collect()
        },
    ));
    out.push((
        "gather".into(),
        if r == rg {
            (0..w).flat_map(|j| (0..2).map(move |i| v(j, i))).collect()
        } else {
            vec![0.0; 2 * w]
        },
    ));
    let _ = rs;
    out.push((
        "scatter".into(),
        (0..3).map(|i| v(100, 3 * r + i)).collect(),
    ));
    out.push(("all_reduce_f64".into(), sum(9, 0, &v64, &all)));
    out.push(("nonblocking_all_reduce".into(), sum(4, 0, &v, &all)));
    out.push((
        "nonblocking_all_gather".into(),
        (0..w)
            .flat_map(|j| (0..3).map(move |i| v(j + 1, i)))
            .collect(),
    ));
    out.push((
        "all_gather_bf16".into(),
        (0..w)
            .flat_map(|j| {
                (0..3).map(move |i| ganymede_core::bf16::from_f32(val(j, i) * 0.1) as f64)
            })
            .collect(),
    ));
    let mut mates: Vec<usize> = (0..w).filter(|j| j % 2 == r % 2).collect();
    mates.sort_by_key(|&j| std::cmp::Reverse(j));
    out.push(("split_all_reduce".into(), sum(3, 0, &v, &mates)));
    out.push((
        "split_all_gather".into(),
        mates.iter().map(|&j| j as f64).collect(),
    ));
    out
}

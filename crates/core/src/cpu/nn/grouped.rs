//! Grouped GEMM: many independent GEMMs (one per expert) in one parallel region. Each GEMM is
//! cut into pieces along its longer output side so that pieces are balanced across threads, and
//! every piece is one single-threaded `matrixmultiply` call; a piece writes its own block of C.

use super::Ptr;
use crate::backend::{extent, Gemm};
use crate::cpu::blas::GemmScalar;
use crate::tensor::{View, ViewMut};
use rayon::prelude::*;

/// Multiply-adds below which a piece is not split further.
const PIECE_MIN: usize = 1 << 16;

pub fn gemm_grouped<S: GemmScalar>(
    c: ViewMut,
    a: View,
    b: View,
    groups: &[(Gemm, usize, usize, usize)],
) {
    let (c, a, b): (&mut [S], &[S], &[S]) = (c.host(), a.host(), b.host());
    // Bounds of every operand, and C blocks pairwise disjoint (sorted by offset).
    let mut cspans = vec![];
    for &(g, ao, bo, co) in groups {
        if g.m == 0 || g.n == 0 {
            continue;
        }
        let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        assert!(
            ac <= g.lda && ao + extent(ar, ac, g.lda) <= a.len(),
            "grouped gemm: A {g:?}"
        );
        assert!(
            bc <= g.ldb && bo + extent(br, bc, g.ldb) <= b.len(),
            "grouped gemm: B {g:?}"
        );
        assert!(
            g.n <= g.ldc && co + extent(g.m, g.n, g.ldc) <= c.len(),
            "grouped gemm: C {g:?}"
        );
        cspans.push((co, co + extent(g.m, g.n, g.ldc)));
    }
    cspans.sort();
    assert!(
        cspans.windows(2).all(|w| w[0].1 <= w[1].0),
        "grouped gemm: output blocks overlap"
    );
    let threads = rayon::current_num_threads();
    let total: usize = groups.iter().map(|(g, ..)| g.m * g.n * g.k).sum();
    // Aim for a few pieces per thread so uneven groups still balance.
    let target = (total / (4 * threads)).max(PIECE_MIN);
    let mut pieces = vec![];
    for (gi, (g, ..)) in groups.iter().enumerate() {
        if g.m == 0 || g.n == 0 {
            continue;
        }
        let parts = (g.m * g.n * g.k).div_ceil(target).max(1);
        let split_m = g.m >= g.n;
        let len = if split_m { g.m } else { g.n };
        let step = len.div_ceil(parts).next_multiple_of(8).min(len);
        for s in (0..len).step_by(step) {
            pieces.push((gi, split_m, s, (s + step).min(len)));
        }
    }
    let cp = Ptr(c.as_mut_ptr());
    let (ap, bp) = (a.as_ptr() as usize, b.as_ptr() as usize);
    let run = |&(gi, split_m, s, e): &(usize, bool, usize, usize)| {
        let (g, ao, bo, co) = groups[gi];
        let (i0, i1, j0, j1) = if split_m {
            (s, e, 0, g.n)
        } else {
            (0, g.m, s, e)
        };
        let (rsa, csa) = if g.trans_a { (1, g.lda) } else { (g.lda, 1) };
        let (rsb, csb) = if g.trans_b { (1, g.ldb) } else { (g.ldb, 1) };
        // Safety: extents were checked above; pieces write disjoint blocks of disjoint groups.
        unsafe {
            S::serial(
                i1 - i0,
                g.k,
                j1 - j0,
                S::of_f64(g.alpha as f64),
                (ap as *const S).add(ao + i0 * rsa),
                (rsa, csa),
                (bp as *const S).add(bo + j0 * csb),
                (rsb, csb),
                S::of_f64(g.beta as f64),
                cp.get().add(co + i0 * g.ldc + j0),
                g.ldc,
            )
        }
    };
    if threads == 1 || pieces.len() == 1 {
        pieces.iter().for_each(run);
    } else {
        pieces.par_iter().for_each(run);
    }
}

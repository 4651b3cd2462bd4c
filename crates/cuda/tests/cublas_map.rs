//! The row-major → column-major mapping against the CPU backend: a naive column-major
//! interpreter of the mapped cuBLAS call, on the same memory, must give the CPU backend's
//! row-major result, over shapes, transposes, padded leading dimensions, alpha and beta. f64 so
//! that any wrong index shows as a large difference, not rounding.

use ganymede_core::{sample, Blas, Category, CpuBackend, Gemm, Ledger, Memory, Syrk};
use ganymede_cuda::cublas_map::{
    map_gemm, map_gemm_grouped, map_gemm_strided_batched, map_syrk, CublasGemm, CublasSyrk, Operand,
};
use std::sync::Arc;

/// Deterministic values in [-1, 1), as f64.
fn values(n: usize, seed: u64) -> Vec<f64> {
    sample::values(n, seed).into_iter().map(f64::from).collect()
}

/// Element (i, j) of op(X) for a column-major X with leading dimension `ld`.
fn at(x: &[f64], ld: usize, trans: bool, i: usize, j: usize) -> f64 {
    if trans {
        x[j + i * ld]
    } else {
        x[i + j * ld]
    }
}

/// What cuBLAS computes for `call`, written out: column-major, `beta = 0` does not read C.
fn interpret_gemm(call: &CublasGemm, a: &[f64], b: &[f64], c: &mut [f64]) {
    let pick = |o: Operand| match o {
        Operand::A => a,
        Operand::B => b,
    };
    let (first, second) = (pick(call.operands[0]), pick(call.operands[1]));
    let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
    let (lda, ldb, ldc) = (call.lda as usize, call.ldb as usize, call.ldc as usize);
    for j in 0..n {
        for i in 0..m {
            let s: f64 = (0..k)
                .map(|p| at(first, lda, call.transa, i, p) * at(second, ldb, call.transb, p, j))
                .sum();
            let ci = i + j * ldc;
            let old = if call.beta == 0.0 { 0.0 } else { c[ci] };
            c[ci] = call.alpha as f64 * s + call.beta as f64 * old;
        }
    }
}

/// cuBLAS's syrk on one triangle: `C = alpha · op(A)·op(A)ᵀ + beta · C`, op(A) being n×k.
fn interpret_syrk(call: &CublasSyrk, a: &[f64], c: &mut [f64]) {
    let (n, k, lda, ldc) = (
        call.n as usize,
        call.k as usize,
        call.lda as usize,
        call.ldc as usize,
    );
    for j in 0..n {
        let rows = if call.upper { 0..j + 1 } else { j..n };
        for i in rows {
            let s: f64 = (0..k)
                .map(|p| at(a, lda, call.trans, i, p) * at(a, lda, call.trans, j, p))
                .sum();
            let ci = i + j * ldc;
            let old = if call.beta == 0.0 { 0.0 } else { c[ci] };
            c[ci] = call.alpha as f64 * s + call.beta as f64 * old;
        }
    }
}

fn cpu() -> CpuBackend {
    CpuBackend::new_f64(Arc::new(Ledger::new()))
}

/// The CPU backend's row-major gemm on host copies of `a`, `b`, `c`.
fn cpu_gemm(be: &CpuBackend, g: Gemm, a: &[f64], b: &[f64], c: &[f64]) -> Vec<f64> {
    let ta = be.upload_f64(a, &[a.len()], Category::Buffers);
    let tb = be.upload_f64(b, &[b.len()], Category::Buffers);
    let mut tc = be.upload_f64(c, &[c.len()], Category::Buffers);
    be.gemm(tc.view_mut(), ta.view(), tb.view(), g);
    be.download_f64(tc.view())
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
            "{what}: element {i}: {g} against {w}"
        );
    }
}

/// Storage of a row-major `rows × cols` operand with row stride `ld` (padding included).
fn storage(rows: usize, ld: usize) -> usize {
    rows * ld
}

fn gemm_cases() -> Vec<Gemm> {
    let dims = [1usize, 2, 3, 5, 8, 13];
    let mut out = Vec::new();
    let mut i = 0u32;
    for &m in &dims {
        for &n in &dims {
            for &k in &[1usize, 4, 7] {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    i += 1;
                    let (pa, pb, pc) = ((i % 3) as usize, (i % 2) as usize * 2, (i % 4) as usize);
                    let g = Gemm::new(m, n, k, ta, tb);
                    let (alpha, beta) = [(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)][i as usize % 3];
                    out.push(
                        g.alpha(alpha)
                            .beta(beta)
                            .ld(g.lda + pa, g.ldb + pb, g.ldc + pc),
                    );
                }
            }
        }
    }
    out
}

#[test]
fn mapped_gemm_equals_cpu_row_major_gemm() {
    let be = cpu();
    let cases = gemm_cases();
    assert!(cases.len() > 400);
    for (i, g) in cases.iter().enumerate() {
        let a_rows = if g.trans_a { g.k } else { g.m };
        let b_rows = if g.trans_b { g.n } else { g.k };
        let a = values(storage(a_rows, g.lda), 3 * i as u64);
        let b = values(storage(b_rows, g.ldb), 3 * i as u64 + 1);
        let c0 = values(storage(g.m, g.ldc), 3 * i as u64 + 2);
        let want = cpu_gemm(&be, *g, &a, &b, &c0);
        let call = map_gemm(g).unwrap();
        let mut got = c0.clone();
        interpret_gemm(&call, &a, &b, &mut got);
        // Padding between rows of C is compared too: neither side may touch it.
        assert_close(&got, &want, &format!("{g:?} -> {call:?}"));
    }
}

/// The interpreter tells a wrong mapping apart: without the operand swap (the call a
/// column-major reading of the seam would naively make) the result differs.
#[test]
fn unswapped_mapping_is_caught() {
    let be = cpu();
    let g = Gemm::new(3, 5, 4, false, false);
    let a = values(storage(3, g.lda), 1);
    let b = values(storage(4, g.ldb), 2);
    let c0 = vec![0.0; storage(3, g.ldc)];
    let want = cpu_gemm(&be, g, &a, &b, &c0);
    let naive = CublasGemm {
        operands: [Operand::A, Operand::B],
        transa: false,
        transb: false,
        m: 3,
        n: 5,
        k: 4,
        lda: g.lda as i32,
        ldb: g.ldb as i32,
        ldc: g.ldc as i32,
        alpha: 1.0,
        beta: 0.0,
    };
    let mut got = c0.clone();
    // The naive call reads past the operands' extents for these shapes; pad them so the
    // difference, not a panic, is what is observed.
    let pad = |mut v: Vec<f64>| {
        v.resize(64, 0.0);
        v
    };
    got.resize(64, 0.0);
    interpret_gemm(&naive, &pad(a), &pad(b), &mut got);
    got.truncate(want.len());
    let diff: f64 = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).sum();
    assert!(diff > 1e-3, "a wrong mapping went unnoticed");
}

#[test]
fn grouped_call_equals_cpu_gemm_per_group() {
    // Groups of different shapes packed one after another in shared buffers (the routed
    // experts' tokens and weights), one without output (an expert with no tokens).
    let be = cpu();
    let cases = gemm_cases();
    for (t, chunk) in cases.chunks(9).enumerate().step_by(5) {
        let mut groups = Vec::new();
        let (mut la, mut lb, mut lc) = (0usize, 0usize, 0usize);
        for (j, g) in chunk.iter().enumerate() {
            let mut g = *g;
            if j == 3 {
                g.m = 0;
            }
            let a_rows = if g.trans_a { g.k } else { g.m };
            let b_rows = if g.trans_b { g.n } else { g.k };
            groups.push((g, la + 1, lb + 2, lc + 3));
            la += 1 + storage(a_rows.max(1), g.lda);
            lb += 2 + storage(b_rows.max(1), g.ldb);
            lc += 3 + storage(g.m.max(1), g.ldc);
        }
        let a = values(la, 7 * t as u64);
        let b = values(lb, 7 * t as u64 + 1);
        let c0 = values(lc, 7 * t as u64 + 2);
        let mut want = c0.clone();
        for &(g, ao, bo, co) in &groups {
            if g.m == 0 {
                continue;
            }
            let r = cpu_gemm(&be, g, &a[ao..], &b[bo..], &want[co..]);
            want[co..].copy_from_slice(&r);
        }
        let call = map_gemm_grouped(&groups).unwrap();
        assert_eq!(
            call.calls.len(),
            groups.len() - 1,
            "the empty GEMM is left out"
        );
        let mut got = c0.clone();
        for (c, off) in call.calls.iter().zip(&call.offsets) {
            // Back from slot order to the seam's operands for the interpreter.
            let at = |o: Operand| if c.operands[0] == o { off[0] } else { off[1] };
            let (a_g, b_g) = (&a[at(Operand::A)..], &b[at(Operand::B)..]);
            interpret_gemm(c, a_g, b_g, &mut got[off[2]..]);
        }
        assert_close(&got, &want, &format!("groups {t}"));
    }
}

#[test]
fn strided_batched_equals_cpu_gemm_per_matrix() {
    let be = cpu();
    for (i, g) in gemm_cases().iter().enumerate().step_by(7) {
        let batch = 1 + i % 4;
        let a_rows = if g.trans_a { g.k } else { g.m };
        let b_rows = if g.trans_b { g.n } else { g.k };
        // Strides with a gap after each matrix, as an expert stack's slices need not be dense.
        let (sa, sb, sc) = (
            storage(a_rows, g.lda) + 1,
            storage(b_rows, g.ldb) + 2,
            storage(g.m, g.ldc) + 3,
        );
        let a = values(sa * batch, 5 * i as u64);
        let b = values(sb * batch, 5 * i as u64 + 1);
        let c0 = values(sc * batch, 5 * i as u64 + 2);
        let mut want = c0.clone();
        for e in 0..batch {
            let r = cpu_gemm(
                &be,
                *g,
                &a[e * sa..e * sa + sa],
                &b[e * sb..e * sb + sb],
                &c0[e * sc..e * sc + sc],
            );
            want[e * sc..e * sc + sc].copy_from_slice(&r);
        }
        let (call, s) = map_gemm_strided_batched(g, batch, sa, sb, sc).unwrap();
        assert_eq!(s.batch as usize, batch);
        let mut got = c0.clone();
        // The i-th call of the batch: each slot's operand offset by its stride.
        let pick = |o: Operand| match o {
            Operand::A => &a,
            Operand::B => &b,
        };
        for e in 0..batch as i64 {
            let (first, second) = (pick(call.operands[0]), pick(call.operands[1]));
            let mut c = got[(e * s.stride_c) as usize..].to_vec();
            // Slots are A and B of the cuBLAS call; reorder so the interpreter sees the seam's.
            let (a_e, b_e) = match call.operands[0] {
                Operand::B => (
                    &second[(e * s.stride_b) as usize..],
                    &first[(e * s.stride_a) as usize..],
                ),
                Operand::A => (
                    &first[(e * s.stride_a) as usize..],
                    &second[(e * s.stride_b) as usize..],
                ),
            };
            interpret_gemm(&call, a_e, b_e, &mut c);
            let n = sc.min(c.len());
            got[(e * s.stride_c) as usize..(e * s.stride_c) as usize + n].copy_from_slice(&c[..n]);
        }
        assert_close(&got, &want, &format!("batch {batch} of {g:?}"));
    }
}

#[test]
fn mapped_syrk_equals_cpu_syrk_on_the_lower_triangle() {
    let be = cpu();
    let mut i = 0u64;
    for n in [1usize, 2, 4, 7, 12] {
        for k in [1usize, 3, 8] {
            for trans in [false, true] {
                for (pa, pc) in [(0, 0), (2, 3)] {
                    i += 1;
                    let s0 = Syrk::new(n, k, trans);
                    let (alpha, beta) = [(1.0, 0.0), (0.5, 1.0), (-1.5, -0.5)][i as usize % 3];
                    let s = s0.alpha(alpha).beta(beta).ld(s0.lda + pa, s0.ldc + pc);
                    let rows = if trans { k } else { n };
                    let a = values(storage(rows, s.lda), 2 * i);
                    // A symmetric C on entry (the seam's precondition when beta != 0).
                    let r = values(storage(n, s.ldc), 2 * i + 1);
                    let mut c0 = r.clone();
                    for x in 0..n {
                        for y in 0..n {
                            c0[x * s.ldc + y] = r[x.max(y) * s.ldc + x.min(y)];
                        }
                    }
                    let ta = be.upload_f64(&a, &[a.len()], Category::Buffers);
                    let mut tc = be.upload_f64(&c0, &[c0.len()], Category::Buffers);
                    be.syrk(tc.view_mut(), ta.view(), s);
                    let want = be.download_f64(tc.view());
                    let call = map_syrk(&s).unwrap();
                    let mut got = c0.clone();
                    interpret_syrk(&call, &a, &mut got);
                    for x in 0..n {
                        for y in 0..=x {
                            let (g, w) = (got[x * s.ldc + y], want[x * s.ldc + y]);
                            assert!(
                                (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                                "{s:?} -> {call:?}: ({x}, {y}) {g} against {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn leading_dimensions_shorter_than_a_row_are_refused() {
    let e = map_gemm(&Gemm::new(4, 6, 5, false, false).ld(5, 5, 6)).unwrap_err();
    assert!(e.to_string().contains("ldb = 5"), "{e}");
    let e = map_gemm(&Gemm::new(1 << 31, 1, 1, false, false)).unwrap_err();
    assert!(e.to_string().contains("m = 2147483648"), "{e}");
}

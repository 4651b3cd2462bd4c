//! Every kernel pair against central finite differences in f64 (the backward must be the exact
//! derivative of the forward), and each forward against a naive reference of its definition.

use crate::backend::{
    embedding_segments, AttnDims, AttnGrads, AttnSaved, Blas, DispatchOut, Dispatched, EmbedIds,
    HeadRope, Memory, NnOps, NormSaved, RouterDims, RouterOut,
};
use crate::ledger::{Category, Ledger};
use crate::sample::Lcg;
use crate::tensor::Tensor;
use crate::CpuBackend;
use std::sync::Arc;

fn be() -> CpuBackend {
    CpuBackend::new_f64(Arc::new(Ledger::new()))
}

/// The shared generator's values as f64 (multiples of 2⁻²³ in [-1, 1), exact in f64).
struct Rng(Lcg);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(Lcg::new(seed))
    }
    fn next(&mut self) -> f64 {
        self.0.uniform() as f64
    }
    fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn up(b: &CpuBackend, x: &[f64]) -> Tensor {
    b.upload_f64(x, &[x.len()], Category::Activations)
}
fn zeros(b: &CpuBackend, n: usize) -> Tensor {
    b.zeros(&[n], Category::Activations)
}
fn down(b: &CpuBackend, t: &Tensor) -> Vec<f64> {
    b.download_f64(t.view())
}
/// An index tensor (token ids, routing).
fn ix(b: &CpuBackend, x: &[u32]) -> Tensor {
    b.upload_u32(x, &[x.len()], Category::Activations)
}
fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Compare `grads[i]` with central differences of `f` in every (or a sample of) entries of
/// `inputs[i]`.
fn fd_check(name: &str, inputs: &[Vec<f64>], grads: &[Vec<f64>], f: impl Fn(&[Vec<f64>]) -> f64) {
    let h = 1e-5;
    let mut worst = 0.0f64;
    for (i, g) in grads.iter().enumerate() {
        assert_eq!(g.len(), inputs[i].len(), "{name}: grad {i} size");
        let stride = (g.len() / 60).max(1);
        for j in (0..g.len()).step_by(stride) {
            let mut x = inputs.to_vec();
            x[i][j] += h;
            let fp = f(&x);
            x[i][j] -= 2.0 * h;
            let fm = f(&x);
            let num = (fp - fm) / (2.0 * h);
            let err = (num - g[j]).abs() / (num.abs().max(g[j].abs()) + 1e-6);
            worst = worst.max(err);
            assert!(
                err < 1e-6,
                "{name}: input {i} entry {j}: numeric {num} analytic {}",
                g[j]
            );
        }
    }
    eprintln!("{name}: worst relative error {worst:.2e}");
}

fn close(name: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{name}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{name}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn embedding() {
    let b = be();
    let mut r = Rng::new(1);
    let (v, d) = (7, 5);
    let ids = ix(&b, &[3, 0, 3, 6, 1]);
    let wte = r.vec(v * d);
    let ro = r.vec(ids.len() * d);
    let f = |x: &[Vec<f64>]| {
        let mut o = zeros(&b, ids.len() * d);
        b.embedding_forward(o.view_mut(), up(&b, &x[0]).view(), ids.view(), d);
        dot(&down(&b, &o), &ro)
    };
    let mut g = zeros(&b, v * d);
    let (order, seg_start, seg_id) = embedding_segments(&[3, 0, 3, 6, 1]);
    let (o, ss, si) = (ix(&b, &order), ix(&b, &seg_start), ix(&b, &seg_id));
    let e = EmbedIds {
        ids: ids.view(),
        order: o.view(),
        seg_start: ss.view(),
        seg_id: si.view(),
        segments: seg_id.len(),
    };
    b.embedding_backward(g.view_mut(), up(&b, &ro).view(), e, d);
    fd_check("embedding", &[wte], &[down(&b, &g)], f);
}

/// A bf16 table (a bf16 weight under bf16 compute) is widened into f32 rows: the rows are the
/// table's bf16 values exactly.
#[test]
fn embedding_from_a_bf16_table() {
    let b = CpuBackend::default();
    let (v, d) = (5, 3);
    let mut rng = Rng::new(3);
    let wte: Vec<f32> = (0..v * d).map(|_| rng.next() as f32).collect();
    let bits = crate::bf16::from_f32_slice(&wte);
    let mut t16 = b.zeros_of(&[v * d], crate::DType::BF16, Category::Params);
    b.write(t16.view_mut(), &wte);
    let ids = b.upload_u32(&[4, 0, 4, 2], &[4], Category::Activations);
    let mut out = b.zeros(&[4 * d], Category::Activations);
    b.embedding_forward(out.view_mut(), t16.view(), ids.view(), d);
    let want: Vec<f32> = [4, 0, 4, 2]
        .iter()
        .flat_map(|&id| {
            bits[id * d..(id + 1) * d]
                .iter()
                .map(|&h| crate::bf16::to_f32(h))
        })
        .collect();
    assert_eq!(b.download(out.view()), want);
    assert_ne!(want[..d], wte[4 * d..5 * d], "the values were not rounded");
}

/// bf16 logits (the head's bf16 GEMM output): the log-sum-exp and loss are the f32 kernel's on
/// the widened values bit for bit, and the gradient is the f32 kernel's rounded once.
#[test]
fn cross_entropy_on_bf16_logits_is_the_f32_kernel_on_their_values() {
    use crate::DType;
    let b = CpuBackend::default();
    let (rows, v) = (5usize, 37usize);
    let mut rng = Rng::new(17);
    let x: Vec<f32> = (0..rows * v).map(|_| 4.0 * rng.next() as f32).collect();
    let widened = crate::bf16::to_f32_slice(&crate::bf16::from_f32_slice(&x));
    let targets = b.upload_u32(&[3, 36, 0, 17, 3], &[rows], Category::Activations);
    let scale = 0.3f32;
    // (lse, loss, gradient as f32 values) from logits `t`.
    let run = |mut t: Tensor| {
        let mut lse = b.zeros(&[rows], Category::Activations);
        let mut loss = b.zeros_of(&[1], DType::F64, Category::Activations);
        b.cross_entropy_forward(lse.view_mut(), t.view(), targets.view(), v, loss.view_mut());
        b.cross_entropy_backward(t.view_mut(), lse.view(), targets.view(), v, scale);
        let grad = match t.dtype() {
            DType::BF16 => crate::bf16::to_f32_slice(t.view().host_bf16()),
            _ => b.download(t.view()),
        };
        (b.download(lse.view()), b.download_f64(loss.view())[0], grad)
    };
    let mut t16 = b.zeros_of(&[rows * v], DType::BF16, Category::Activations);
    b.write(t16.view_mut(), &x);
    let (lse16, loss16, g16) = run(t16);
    let (lse, loss, g) = run(b.upload(&widened, &[rows * v], Category::Activations));
    assert_eq!(lse16, lse);
    assert_eq!(loss16.to_bits(), loss.to_bits());
    let rounded = crate::bf16::to_f32_slice(&crate::bf16::from_f32_slice(&g));
    assert_eq!(g16, rounded);
    assert_ne!(g16, g, "the gradient was not rounded");
}

#[test]
fn embedding_segments_group_tokens_by_id_stably() {
    let (order, seg_start, seg_id) = embedding_segments(&[3, 0, 3, 6, 1, 0]);
    assert_eq!(order, [1, 5, 4, 0, 2, 3]);
    // Past the four segments, empty ones up to n + 1 entries.
    assert_eq!(seg_start, [0, 2, 3, 5, 6, 6, 6]);
    assert_eq!(seg_id, [0, 1, 3, 6]);
    assert_eq!(embedding_segments(&[]), (vec![], vec![0], vec![]));
}

#[test]
fn rmsnorm() {
    let b = be();
    let mut r = Rng::new(2);
    let (n, d) = (6, 8);
    let (x, w, ro) = (r.vec(n * d), r.vec(d), r.vec(n * d));
    let run = |x: &[f64], w: &[f64]| {
        let (mut o, mut rs) = (zeros(&b, n * d), zeros(&b, n));
        b.rmsnorm_forward(
            o.view_mut(),
            rs.view_mut(),
            up(&b, x).view(),
            up(&b, w).view(),
            d,
            1e-6,
        );
        (down(&b, &o), rs)
    };
    // Reference: y = w · x / sqrt(mean(x²) + eps).
    let (o, rs) = run(&x, &w);
    let want: Vec<f64> = (0..n * d)
        .map(|i| {
            let row = &x[i / d * d..(i / d + 1) * d];
            w[i % d] * x[i] / (dot(row, row) / d as f64 + 1e-6).sqrt()
        })
        .collect();
    close("rmsnorm forward", &o, &want, 1e-12);
    let (mut dx, mut dw) = (up(&b, &vec![0.5; n * d]), zeros(&b, d));
    let (xt, wt) = (up(&b, &x), up(&b, &w));
    let saved = NormSaved {
        x: xt.view(),
        w: wt.view(),
        rstd: rs.view(),
    };
    b.rmsnorm_backward(dx.view_mut(), dw.view_mut(), up(&b, &ro).view(), saved, d);
    // dx accumulates: subtract what was there.
    let dx: Vec<f64> = down(&b, &dx).iter().map(|v| v - 0.5).collect();
    fd_check("rmsnorm", &[x, w], &[dx, down(&b, &dw)], |a| {
        dot(&run(&a[0], &a[1]).0, &ro)
    });
}

#[test]
fn head_norm_rope() {
    head_norm_rope_case(None);
}

#[test]
fn head_norm_rope_restarts_positions_at_each_document() {
    // Two sequences of 3: documents [0..1) [1..3) and [0..3).
    head_norm_rope_case(Some(vec![0, 1, 1, 0, 0, 0]));
}

/// `docs`: each row's document start in its sequence (document masking), or none.
fn head_norm_rope_case(docs: Option<Vec<u32>>) {
    let b = be();
    let mut r = Rng::new(3);
    let (rows, heads, hd, seq, pos0, theta) = (6, 3, 8, 3, 2, 100.0);
    let row = heads * hd;
    let (x, w, ro) = (r.vec(rows * row), r.vec(hd), r.vec(rows * row));
    let dims = HeadRope {
        heads,
        head_dim: hd,
        seq,
        pos0,
        theta,
        eps: 1e-6,
    };
    let run = |x: &[f64], w: &[f64]| {
        let (mut o, mut rs) = (zeros(&b, rows * row), zeros(&b, rows * heads));
        let (x, w) = (up(&b, x), up(&b, w));
        let (ov, rv) = (o.view_mut(), rs.view_mut());
        match &docs {
            Some(d) => {
                let d = ix(&b, d);
                b.head_norm_rope_forward_docs(ov, rv, x.view(), w.view(), d.view(), dims)
            }
            None => b.head_norm_rope_forward(ov, rv, x.view(), w.view(), dims),
        }
        (down(&b, &o), rs)
    };
    let (o, rs) = run(&x, &w);
    // Reference: per-head RMSNorm, then rotate-half with inv_freq = theta^(-2i/d).
    let half = hd / 2;
    let mut want = vec![0.0; rows * row];
    for t in 0..rows {
        let start = docs.as_ref().map_or(0, |d| d[t] as usize);
        let pos = (pos0 + t % seq - start) as f64;
        for h in 0..heads {
            let xs = &x[t * row + h * hd..t * row + (h + 1) * hd];
            let rstd = 1.0 / (dot(xs, xs) / hd as f64 + 1e-6).sqrt();
            let n: Vec<f64> = (0..hd).map(|i| w[i] * xs[i] * rstd).collect();
            for i in 0..half {
                let a = pos * theta.powf(-((2 * i) as f64) / hd as f64);
                want[t * row + h * hd + i] = n[i] * a.cos() - n[i + half] * a.sin();
                want[t * row + h * hd + i + half] = n[i + half] * a.cos() + n[i] * a.sin();
            }
        }
    }
    close("head_norm_rope forward", &o, &want, 1e-12);
    let (mut dx, mut dw) = (zeros(&b, rows * row), zeros(&b, hd));
    let (xt, wt) = (up(&b, &x), up(&b, &w));
    let saved = NormSaved {
        x: xt.view(),
        w: wt.view(),
        rstd: rs.view(),
    };
    let (dxv, dwv, rov) = (dx.view_mut(), dw.view_mut(), up(&b, &ro));
    match &docs {
        Some(d) => {
            let d = ix(&b, d);
            b.head_norm_rope_backward_docs(dxv, dwv, rov.view(), saved, d.view(), dims)
        }
        None => b.head_norm_rope_backward(dxv, dwv, rov.view(), saved, dims),
    }
    fd_check(
        "head_norm_rope",
        &[x, w],
        &[down(&b, &dx), down(&b, &dw)],
        |a| dot(&run(&a[0], &a[1]).0, &ro),
    );
}

/// Causal attention by its definition; `docs`: each query's first key (document masking).
fn naive_attention(
    (q, k, v): (&[f64], &[f64], &[f64]),
    docs: Option<&[u32]>,
    d: AttnDims,
) -> Vec<f64> {
    let AttnDims {
        batch,
        tq,
        tk,
        heads,
        kv_heads: kvh,
        head_dim: hd,
    } = d;
    let mut o = vec![0.0; q.len()];
    let (qd, kd) = (heads * hd, kvh * hd);
    for b in 0..batch {
        for h in 0..heads {
            let g = h / (heads / kvh);
            for i in 0..tq {
                let qi = &q[b * tq * qd + i * qd + h * hd..][..hd];
                let n = tk - tq + i + 1;
                let lo = docs.map_or(0, |d| d[b * tq + i] as usize);
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        if j < lo {
                            return f64::NEG_INFINITY;
                        }
                        dot(qi, &k[b * tk * kd + j * kd + g * hd..][..hd]) / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for j in 0..n {
                    let p = (s[j] - m).exp() / z;
                    for c in 0..hd {
                        o[b * tq * qd + i * qd + h * hd + c] +=
                            p * v[b * tk * kd + j * kd + g * hd + c];
                    }
                }
            }
        }
    }
    o
}

fn attn_dims(batch: usize, tq: usize, tk: usize, heads: usize, kvh: usize, hd: usize) -> AttnDims {
    AttnDims {
        batch,
        tq,
        tk,
        heads,
        kv_heads: kvh,
        head_dim: hd,
    }
}

/// `docs`: each query's first key (document masking), or none.
fn attention_case(dims: AttnDims, docs: Option<Vec<u32>>, seed: u64) {
    let AttnDims {
        batch,
        tq,
        tk,
        heads,
        kv_heads: kvh,
        head_dim: hd,
    } = dims;
    let b = be();
    let mut r = Rng::new(seed);
    let (nq, nk) = (batch * tq * heads * hd, batch * tk * kvh * hd);
    let (q, k, v, ro) = (r.vec(nq), r.vec(nk), r.vec(nk), r.vec(nq));
    let dt = docs.as_ref().map(|d| ix(&b, d));
    let run = |q: &[f64], k: &[f64], v: &[f64]| {
        let (mut o, mut l) = (zeros(&b, nq), zeros(&b, batch * heads * tq));
        let (q, k, v) = (up(&b, q), up(&b, k), up(&b, v));
        let (ov, lv, qv, kv, vv) = (o.view_mut(), l.view_mut(), q.view(), k.view(), v.view());
        match &dt {
            Some(d) => b.attention_forward_docs(ov, lv, qv, kv, vv, d.view(), dims),
            None => b.attention_forward(ov, lv, qv, kv, vv, dims),
        }
        (o, l)
    };
    let (o, l) = run(&q, &k, &v);
    close(
        "attention forward",
        &down(&b, &o),
        &naive_attention((&q, &k, &v), docs.as_deref(), dims),
        1e-12,
    );
    let (mut dq, mut dk, mut dv) = (zeros(&b, nq), zeros(&b, nk), zeros(&b, nk));
    let (qt, kt, vt) = (up(&b, &q), up(&b, &k), up(&b, &v));
    let grads = AttnGrads {
        dq: dq.view_mut(),
        dk: dk.view_mut(),
        dv: dv.view_mut(),
    };
    let saved = AttnSaved {
        out: o.view(),
        q: qt.view(),
        k: kt.view(),
        v: vt.view(),
        lse: l.view(),
    };
    let rov = up(&b, &ro);
    match &dt {
        Some(d) => b.attention_backward_docs(grads, rov.view(), saved, d.view(), dims),
        None => b.attention_backward(grads, rov.view(), saved, dims),
    }
    fd_check(
        &format!(
            "attention b{batch} tq{tq} tk{tk} h{heads}/{kvh} docs {}",
            dt.is_some()
        ),
        &[q, k, v],
        &[down(&b, &dq), down(&b, &dk), down(&b, &dv)],
        |a| dot(&down(&b, &run(&a[0], &a[1], &a[2]).0), &ro),
    );
}

#[test]
fn attention_gqa_causal() {
    attention_case(attn_dims(2, 5, 5, 4, 2, 4), None, 4);
}

#[test]
fn attention_with_cache_offset() {
    // Queries that continue a cached prefix (tq < tk), as in generation.
    attention_case(attn_dims(1, 3, 7, 2, 1, 4), None, 5);
}

#[test]
fn attention_several_tiles() {
    // More query rows than one score tile holds.
    attention_case(attn_dims(1, 70, 70, 2, 1, 2), None, 6);
}

/// Each token's document start in its window, for windows holding documents of `lens`.
fn doc_starts(lens: &[&[usize]]) -> Vec<u32> {
    let mut out = Vec::new();
    for seq in lens {
        let mut start = 0;
        for &n in seq.iter() {
            out.extend(std::iter::repeat_n(start as u32, n));
            start += n;
        }
    }
    out
}

#[test]
fn attention_masked_by_documents() {
    // Forward against the definition, backward against finite differences: two sequences of
    // several documents, and one spanning score tiles with a document starting inside a tile.
    let docs = doc_starts(&[&[2, 3, 1], &[6]]);
    attention_case(attn_dims(2, 6, 6, 4, 2, 4), Some(docs), 7);
    let docs = doc_starts(&[&[50, 20]]);
    attention_case(attn_dims(1, 70, 70, 2, 1, 2), Some(docs), 8);
    // Queries after a cached prefix, their document starting inside the cache.
    attention_case(attn_dims(1, 3, 7, 2, 1, 4), Some(vec![2, 2, 6]), 9);
}

#[test]
fn attention_over_documents_is_each_document_alone() {
    // In f32: a window of documents, masked, gives each document's outputs, log-sum-exps and
    // gradients as attention over that document alone does.
    let b = CpuBackend::new(Arc::new(Ledger::new()));
    let lens: [&[usize]; 2] = [&[37, 43], &[5, 60, 15]];
    let (t, heads, kvh, hd) = (80, 4, 2, 16);
    let dims = attn_dims(2, t, t, heads, kvh, hd);
    let (qd, kd) = (heads * hd, kvh * hd);
    let mut r = Rng::new(12);
    let f = |x: Vec<f64>| -> Vec<f32> { x.iter().map(|&x| x as f32).collect() };
    let (q, k, v, dout) = (
        f(r.vec(2 * t * qd)),
        f(r.vec(2 * t * kd)),
        f(r.vec(2 * t * kd)),
        f(r.vec(2 * t * qd)),
    );
    let up32 = |x: &[f32]| b.upload(x, &[x.len()], Category::Activations);
    // (out, lse, dq, dk, dv) of attention over `q`, `k`, `v` (`batch` sequences).
    let run = |(q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
               docs: Option<&[u32]>,
               d: AttnDims|
     -> [Vec<f32>; 5] {
        let (q, k, v, dout) = (up32(q), up32(k), up32(v), up32(dout));
        let z = |n: usize| b.zeros(&[n], Category::Activations);
        let (nq, nk) = (q.len(), k.len());
        let (mut o, mut l) = (z(nq), z(d.batch * d.heads * d.tq));
        let (mut dq, mut dk, mut dv) = (z(nq), z(nk), z(nk));
        let dt = docs.map(|d| ix(&b, d));
        let (ov, lv, qv, kv, vv) = (o.view_mut(), l.view_mut(), q.view(), k.view(), v.view());
        match &dt {
            Some(t) => b.attention_forward_docs(ov, lv, qv, kv, vv, t.view(), d),
            None => b.attention_forward(ov, lv, qv, kv, vv, d),
        }
        let g = AttnGrads {
            dq: dq.view_mut(),
            dk: dk.view_mut(),
            dv: dv.view_mut(),
        };
        let s = AttnSaved {
            out: o.view(),
            q: q.view(),
            k: k.view(),
            v: v.view(),
            lse: l.view(),
        };
        match &dt {
            Some(t) => b.attention_backward_docs(g, dout.view(), s, t.view(), d),
            None => b.attention_backward(g, dout.view(), s, d),
        }
        [&o, &l, &dq, &dk, &dv].map(|t| b.download(t.view()))
    };
    let docs = doc_starts(&lens);
    let whole = run((&q, &k, &v, &dout), Some(&docs), dims);
    let mut worst = 0f32;
    for (s, seq) in lens.iter().enumerate() {
        let mut a = 0;
        for &n in seq.iter() {
            let rows = |x: &[f32], w: usize| x[(s * t + a) * w..(s * t + a + n) * w].to_vec();
            let alone = run(
                (
                    &rows(&q, qd),
                    &rows(&k, kd),
                    &rows(&v, kd),
                    &rows(&dout, qd),
                ),
                None,
                attn_dims(1, n, n, heads, kvh, hd),
            );
            for (i, w) in [qd, 1, qd, kd, kd].into_iter().enumerate() {
                let got: Vec<f32> = if i == 1 {
                    // lse is [batch, heads, tq].
                    (0..heads)
                        .flat_map(|h| {
                            let r0 = (s * heads + h) * t + a;
                            whole[1][r0..r0 + n].to_vec()
                        })
                        .collect()
                } else {
                    rows(&whole[i], w)
                };
                for (x, y) in got.iter().zip(&alone[i]) {
                    worst = worst.max((x - y).abs());
                }
            }
            a += n;
        }
    }
    eprintln!("documents in one window vs alone: worst difference {worst:.2e}");
    assert!(worst <= 1e-6, "worst difference {worst}");
    // Without the mask the window's documents see each other: the check can fail.
    let open = run((&q, &k, &v, &dout), None, dims);
    let moved = open[0]
        .iter()
        .zip(&whole[0])
        .any(|(x, y)| (x - y).abs() > 1e-3);
    assert!(moved, "the mask changed nothing");
}

#[test]
fn swiglu() {
    let b = be();
    let mut r = Rng::new(7);
    let n = 40;
    let (g, u, ro) = (r.vec(n), r.vec(n), r.vec(n));
    let run = |g: &[f64], u: &[f64]| {
        let mut o = zeros(&b, n);
        b.swiglu_forward(o.view_mut(), up(&b, g).view(), up(&b, u).view());
        down(&b, &o)
    };
    let want: Vec<f64> = (0..n)
        .map(|i| g[i] / (1.0 + (-g[i]).exp()) * u[i])
        .collect();
    close("swiglu forward", &run(&g, &u), &want, 1e-14);
    let (mut dg, mut du) = (zeros(&b, n), zeros(&b, n));
    b.swiglu_backward(
        dg.view_mut(),
        du.view_mut(),
        up(&b, &ro).view(),
        up(&b, &g).view(),
        up(&b, &u).view(),
    );
    fd_check("swiglu", &[g, u], &[down(&b, &dg), down(&b, &du)], |a| {
        dot(&run(&a[0], &a[1]), &ro)
    });
}

fn router_case(renorm: bool, with_bias: bool) {
    let b = be();
    let mut r = Rng::new(8 + renorm as u64 + 2 * with_bias as u64);
    let (n, e, k) = (6, 5, 2);
    let logits: Vec<f64> = r.vec(n * e).iter().map(|x| 3.0 * x).collect();
    let bias: Vec<f64> = r.vec(e).iter().map(|x| 0.3 * x).collect();
    let (rw, c) = (r.vec(n * k), r.vec(e));
    let dims = RouterDims {
        experts: e,
        k,
        renorm,
    };
    let run = |l: &[f64]| {
        let (mut p, mut w) = (zeros(&b, n * e), zeros(&b, n * k));
        let (mut idx, mut psum) = (ix(&b, &vec![0; n * k]), zeros(&b, e));
        let (bt, lt) = (up(&b, &bias), up(&b, l));
        let out = RouterOut {
            probs: p.view_mut(),
            weights: w.view_mut(),
            idx: idx.view_mut(),
            psum: psum.view_mut(),
        };
        b.router_forward(out, lt.view(), with_bias.then(|| bt.view()), dims);
        (p, w, idx, b.download_f64(psum.view()))
    };
    let (p, w, idx_t, psum) = run(&logits);
    let idx = b.download_u32(idx_t.view());
    // Reference selection: top-k of softmax + bias.
    let pv = down(&b, &p);
    for t in 0..n {
        let mut order: Vec<usize> = (0..e).collect();
        let sc = |i: usize| pv[t * e + i] + if with_bias { bias[i] } else { 0.0 };
        order.sort_by(|&a, &c| sc(c).partial_cmp(&sc(a)).unwrap());
        assert_eq!(
            &idx[t * k..(t + 1) * k],
            &[order[0] as u32, order[1] as u32]
        );
        let s: f64 = (0..e).map(|i| pv[t * e + i]).sum();
        assert!((s - 1.0).abs() < 1e-12);
    }
    let colsum: Vec<f64> = (0..e)
        .map(|i| (0..n).map(|t| pv[t * e + i]).sum())
        .collect();
    close("router psum", &psum, &colsum, 1e-12);
    let f = |x: &[Vec<f64>]| {
        let (_, w, idx2, psum) = run(&x[0]);
        assert_eq!(
            b.download_u32(idx2.view()),
            idx,
            "perturbation changed the selection (a tie)"
        );
        dot(&down(&b, &w), &rw) + dot(&psum, &c)
    };
    let mut dl = zeros(&b, n * e);
    let rwt = up(&b, &rw);
    let ct = up(&b, &c);
    b.router_backward(
        dl.view_mut(),
        rwt.view(),
        p.view(),
        idx_t.view(),
        // coef · count / tokens with both one: the constants exactly.
        crate::AuxGrad {
            counts: ct.view(),
            coef: 1.0,
            tokens: 1.0,
        },
        dims,
    );
    let _ = w;
    fd_check(
        &format!("router renorm={renorm} bias={with_bias}"),
        &[logits],
        &[down(&b, &dl)],
        f,
    );
}

#[test]
fn router_softmax_topk() {
    for renorm in [false, true] {
        for bias in [false, true] {
            router_case(renorm, bias);
        }
    }
}

#[test]
fn router_ties_prefer_lower_index() {
    let b = be();
    let (mut p, mut w) = (zeros(&b, 4), zeros(&b, 2));
    let (mut idx, mut psum) = (ix(&b, &[0; 2]), zeros(&b, 4));
    let dims = RouterDims {
        experts: 4,
        k: 2,
        renorm: true,
    };
    for (logits, want) in [([0.0, 1.0, 0.0, 1.0], [1, 3]), ([0.5; 4], [0, 1])] {
        let out = RouterOut {
            probs: p.view_mut(),
            weights: w.view_mut(),
            idx: idx.view_mut(),
            psum: psum.view_mut(),
        };
        b.router_forward(out, up(&b, &logits).view(), None, dims);
        assert_eq!(b.download_u32(idx.view()), want);
    }
}

#[test]
fn dispatch_and_combine() {
    let b = be();
    let mut r = Rng::new(9);
    let (n, k, d) = (5, 2, 3);
    // Token t's j-th choice went to dispatched row pos[t*k+j]; src is the inverse.
    let pos: Vec<u32> = vec![3, 0, 7, 1, 9, 2, 4, 8, 6, 5];
    let mut src = vec![0u32; n * k];
    for (tj, &p) in pos.iter().enumerate() {
        src[p as usize] = (tj / k) as u32;
    }
    let (x, ye, w) = (r.vec(n * d), r.vec(n * k * d), r.vec(n * k));
    let (rg, rc) = (r.vec(n * k * d), r.vec(n * d));
    let (src_t, pos_t) = (ix(&b, &src), ix(&b, &pos));
    let gather = |x: &[f64]| {
        let mut o = zeros(&b, n * k * d);
        b.moe_gather(o.view_mut(), up(&b, x).view(), src_t.view(), d);
        down(&b, &o)
    };
    let g = gather(&x);
    for i in 0..n * k {
        assert_eq!(&g[i * d..(i + 1) * d], &x[src[i] as usize * d..][..d]);
    }
    let mut dx = zeros(&b, n * d);
    let disp = Dispatched {
        pos: pos_t.view(),
        k,
        dim: d,
    };
    b.moe_gather_backward(dx.view_mut(), up(&b, &rg).view(), disp);
    fd_check("moe_gather", &[x], &[down(&b, &dx)], |a| {
        dot(&gather(&a[0]), &rg)
    });

    let combine = |ye: &[f64], w: &[f64]| {
        let mut o = up(&b, &vec![0.25; n * d]);
        let (ye, w) = (up(&b, ye), up(&b, w));
        b.moe_combine(o.view_mut(), ye.view(), w.view(), disp);
        down(&b, &o)
    };
    let (mut dye, mut dw) = (zeros(&b, n * k * d), zeros(&b, n * k));
    let (rct, yet, wt) = (up(&b, &rc), up(&b, &ye), up(&b, &w));
    b.moe_combine_backward(
        dye.view_mut(),
        dw.view_mut(),
        rct.view(),
        yet.view(),
        wt.view(),
        disp,
    );
    fd_check(
        "moe_combine",
        &[ye, w],
        &[down(&b, &dye), down(&b, &dw)],
        |a| dot(&combine(&a[0], &a[1]), &rc),
    );
}

/// The device counting sort against the obvious reference: for each expert in turn, its
/// (token, choice) pairs in token order.
#[test]
fn moe_dispatch_matches_a_reference_sort() {
    for (seed, n, e, k) in [(1u64, 1, 1, 1), (2, 7, 4, 2), (3, 33, 8, 3), (4, 50, 16, 1)] {
        let mut r = Rng::new(seed);
        // Skewed choices so some experts get nothing.
        let idx: Vec<u32> = (0..n * k)
            .map(|_| ((r.next() + 1.0) * 0.5 * (e as f64 / 2.0).max(1.0)) as u32 % e as u32)
            .collect();
        let mut rows: Vec<(u32, usize)> = idx.iter().enumerate().map(|(tj, &x)| (x, tj)).collect();
        rows.sort(); // by expert, then by (token, choice): stable
        let want_src: Vec<u32> = rows.iter().map(|&(_, tj)| (tj / k) as u32).collect();
        let mut want_pos = vec![0u32; n * k];
        for (p, &(_, tj)) in rows.iter().enumerate() {
            want_pos[tj] = p as u32;
        }
        let want_counts: Vec<u32> = (0..e as u32)
            .map(|x| idx.iter().filter(|&&i| i == x).count() as u32)
            .collect();
        let mut want_offsets = vec![0u32];
        for c in &want_counts {
            want_offsets.push(want_offsets.last().unwrap() + c);
        }
        for b in [
            CpuBackend::default(),
            CpuBackend::two_memory(Arc::new(Ledger::new()), Default::default()),
        ] {
            let it = b.upload_u32(&idx, &[n * k], Category::Activations);
            let u = |len| b.zeros_of(&[len], crate::DType::U32, Category::Activations);
            // Stale contents must not leak into the result.
            let (mut counts, mut offsets, mut src, mut pos) = (u(e), u(e + 1), u(n * k), u(n * k));
            b.fill(counts.view_mut(), 7.0);
            b.fill(src.view_mut(), 9.0);
            // The layer's totals are added to (a chunk after others).
            let mut totals = b.zeros_of(&[e], crate::DType::F64, Category::Buffers);
            b.write_f64(totals.view_mut(), &vec![0.5; e]);
            let out = DispatchOut {
                counts: counts.view_mut(),
                offsets: offsets.view_mut(),
                src: src.view_mut(),
                pos: pos.view_mut(),
                totals: Some(totals.view_mut()),
            };
            b.moe_dispatch(out, it.view(), e, k);
            let want_totals: Vec<f64> = want_counts.iter().map(|&c| c as f64 + 0.5).collect();
            assert_eq!(b.download_f64(totals.view()), want_totals);
            assert_eq!(
                b.download_u32(counts.view()),
                want_counts,
                "n {n} e {e} k {k}"
            );
            assert_eq!(b.download_u32(offsets.view()), want_offsets);
            assert_eq!(b.download_u32(src.view()), want_src);
            assert_eq!(b.download_u32(pos.view()), want_pos);
        }
    }
}

#[test]
#[should_panic(expected = "dispatched twice")]
fn moe_combine_backward_refuses_a_pos_that_is_not_a_permutation() {
    // Two choices naming one dispatched row would be two writers of it: refused, not raced.
    let b = CpuBackend::default();
    let (n, k, d) = (2, 2, 3);
    let pos_t = ix(&b, &[0, 1, 1, 3]);
    let (mut dye, mut dw) = (
        b.zeros(&[n * k * d], Category::Buffers),
        b.zeros(&[n * k], Category::Buffers),
    );
    let dout = b.upload(&[1.0; 6], &[n * d], Category::Buffers);
    let ye = b.upload(&[1.0; 12], &[n * k * d], Category::Buffers);
    let w = b.upload(&[0.5; 4], &[n * k], Category::Buffers);
    let disp = Dispatched {
        pos: pos_t.view(),
        k,
        dim: d,
    };
    b.moe_combine_backward(
        dye.view_mut(),
        dw.view_mut(),
        dout.view(),
        ye.view(),
        w.view(),
        disp,
    );
}

#[test]
fn cross_entropy() {
    let b = be();
    let mut r = Rng::new(10);
    let (n, v) = (4, 9);
    let logits: Vec<f64> = r.vec(n * v).iter().map(|x| 2.0 * x).collect();
    let targets = [3u32, 0, 8, 3];
    let tt = ix(&b, &targets);
    let run = |l: &[f64]| {
        let mut lse = zeros(&b, n);
        // Accumulates: start from 0.5 and take it off.
        let mut loss = b.upload_f64(&[0.5], &[1], Category::Buffers);
        b.cross_entropy_forward(
            lse.view_mut(),
            up(&b, l).view(),
            tt.view(),
            v,
            loss.view_mut(),
        );
        let s = b.download_f64(loss.view())[0] - 0.5;
        (s, lse)
    };
    let (sum, lse) = run(&logits);
    let want: f64 = (0..n)
        .map(|t| {
            let row = &logits[t * v..(t + 1) * v];
            row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[targets[t] as usize]
        })
        .sum();
    assert!((sum - want).abs() < 1e-12);
    let mut d = up(&b, &logits);
    b.cross_entropy_backward(d.view_mut(), lse.view(), tt.view(), v, 0.7);
    let dl: Vec<f64> = down(&b, &d).iter().map(|x| x / 0.7).collect();
    fd_check("cross_entropy", &[logits], &[dl], |a| run(&a[0]).0);
}

#[test]
fn residual() {
    let b = be();
    let mut r = Rng::new(11);
    let (x, y, ro) = (r.vec(10), r.vec(10), r.vec(10));
    let run = |x: &[f64], y: &[f64]| {
        let mut o = up(&b, y);
        b.add(o.view_mut(), up(&b, x).view());
        down(&b, &o)
    };
    // The gradient of a residual sum is the upstream gradient, to both branches.
    fd_check("residual", &[x, y], &[ro.clone(), ro.clone()], |a| {
        dot(&run(&a[0], &a[1]), &ro)
    });
}

#[test]
fn f32_kernels_match_f64() {
    // The f32 path (fast exp, f32 accumulation) stays within float rounding of f64.
    let b64 = be();
    let b32 = CpuBackend::new(Arc::new(Ledger::new()));
    let mut r = Rng::new(12);
    let (batch, t, h, kvh, hd) = (2, 80, 4, 2, 8);
    let (nq, nk) = (batch * t * h * hd, batch * t * kvh * hd);
    let (q, k, v) = (r.vec(nq), r.vec(nk), r.vec(nk));
    let mut outs = vec![];
    for b in [&b64, &b32] {
        let (mut o, mut l) = (
            b.zeros(&[nq], Category::Activations),
            b.zeros(&[batch * h * t], Category::Activations),
        );
        let up = |x: &[f64]| b.upload_f64(x, &[x.len()], Category::Activations);
        let (qt, kt, vt) = (up(&q), up(&k), up(&v));
        let dims = AttnDims {
            batch,
            tq: t,
            tk: t,
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        };
        b.attention_forward(
            o.view_mut(),
            l.view_mut(),
            qt.view(),
            kt.view(),
            vt.view(),
            dims,
        );
        outs.push(b.download_f64(o.view()));
    }
    close("attention f32 vs f64", &outs[1], &outs[0], 1e-5);
    let logits: Vec<f64> = r.vec(6 * 300).iter().map(|x| 8.0 * x).collect();
    let targets = [1u32, 5, 299, 0, 7, 100];
    let mut sums = vec![];
    for b in [&b64, &b32] {
        let mut l = b.zeros(&[6], Category::Activations);
        let mut loss = b.zeros_of(&[1], crate::DType::F64, Category::Buffers);
        let logits = b.upload_f64(&logits, &[1800], Category::Activations);
        let tt = b.upload_u32(&targets, &[6], Category::Activations);
        b.cross_entropy_forward(l.view_mut(), logits.view(), tt.view(), 300, loss.view_mut());
        sums.push(b.download_f64(loss.view())[0]);
    }
    assert!((sums[0] - sums[1]).abs() < 1e-5 * sums[0].abs(), "{sums:?}");
}

#[test]
fn grouped_gemm_matches_one_gemm_per_group() {
    use crate::backend::Gemm;
    let b = CpuBackend::new(Arc::new(Ledger::new()));
    let mut r = Rng::new(13);
    let (f, h) = (40, 24);
    // Uneven groups (one empty) of rows, each against its own weight, like experts.
    let rows = [70usize, 0, 5, 300];
    let total: usize = rows.iter().sum();
    let x: Vec<f32> = r.vec(total * h).iter().map(|&v| v as f32).collect();
    let w: Vec<f32> = r
        .vec(rows.len() * f * h)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let (xt, wt) = (
        b.upload(&x, &[x.len()], Category::Activations),
        b.upload(&w, &[w.len()], Category::Activations),
    );
    let mut groups = vec![];
    let mut r0 = 0;
    for (e, &c) in rows.iter().enumerate() {
        groups.push((
            Gemm::new(c, f, h, false, true).alpha(0.5),
            r0 * h,
            e * f * h,
            r0 * f,
        ));
        r0 += c;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut got = b.zeros(&[total * f], Category::Activations);
    pool.install(|| b.gemm_grouped(got.view_mut(), xt.view(), wt.view(), &groups));
    let mut want = b.zeros(&[total * f], Category::Activations);
    for &(g, ao, bo, co) in &groups {
        b.gemm(
            want.slice_mut(co, g.m * f),
            xt.slice(ao, g.m * h),
            wt.slice(bo, f * h),
            g,
        );
    }
    assert_eq!(b.download(got.view()), b.download(want.view()));
}

/// f64 reference of `C = op(A)·op(B)` (row-major, dense leading dimensions).
fn gemm_ref(a: &[f64], b: &[f64], m: usize, n: usize, k: usize, ta: bool, tb: bool) -> Vec<f64> {
    let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
    let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
        }
    }
    c
}

/// An operand that is bf16 already (the weights under bf16 compute) gives a bf16-input GEMM,
/// plain and grouped, every transpose, the result of its f32 original to the bit: the backend
/// widens it exactly where it would have rounded the f32 one.
#[test]
fn bf16_input_gemm_takes_bf16_operands_as_they_are() {
    use crate::backend::{Blas, Gemm};
    use crate::tensor::DType;
    let b = CpuBackend::new(Arc::new(Ledger::new()));
    let mut r = Rng::new(31);
    let (m, n, k) = (19, 23, 70);
    let a: Vec<f32> = r.vec(m * k).iter().map(|&v| v as f32).collect();
    let w: Vec<f32> = r.vec(k * n).iter().map(|&v| v as f32).collect();
    let up = |v: &[f32]| b.upload(v, &[v.len()], Category::Activations);
    let (a32, w32) = (up(&a), up(&w));
    let half = |t: &Tensor| {
        let mut h = b.zeros_of(&[t.len()], DType::BF16, Category::Activations);
        b.cast(h.view_mut(), t.view());
        h
    };
    let (a16, w16) = (half(&a32), half(&w32));
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let g = Gemm::new(m, n, k, ta, tb).bf16_inputs(true);
        let run = |x: &Tensor, y: &Tensor, grouped: bool| {
            let mut c = b.zeros(&[m * n], Category::Activations);
            if grouped {
                b.gemm_grouped(c.view_mut(), x.view(), y.view(), &[(g, 0, 0, 0)]);
            } else {
                b.gemm(c.view_mut(), x.view(), y.view(), g);
            }
            b.download(c.view())
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        for grouped in [false, true] {
            let want = run(&a32, &w32, grouped);
            assert_eq!(run(&a32, &w16, grouped), want, "bf16 B {ta} {tb} {grouped}");
            assert_eq!(run(&a16, &w32, grouped), want, "bf16 A {ta} {tb} {grouped}");
            assert_eq!(
                run(&a16, &w16, grouped),
                want,
                "bf16 A, B {ta} {tb} {grouped}"
            );
        }
    }
}

/// A bf16-input GEMM (plain and grouped, every transpose) is the exact product of the
/// bf16-rounded operands up to f32 summation order, and not the f32 GEMM of the raw ones.
#[test]
fn bf16_input_gemm_rounds_operands() {
    use crate::backend::Gemm;
    use crate::bf16::{from_f32, to_f32};
    let ledger = Arc::new(Ledger::new());
    let b = CpuBackend::new(ledger.clone());
    let mut r = Rng::new(29);
    let (m, n, k) = (37, 29, 300);
    let a: Vec<f32> = r.vec(m * k).iter().map(|&v| v as f32).collect();
    let w: Vec<f32> = r.vec(k * n).iter().map(|&v| v as f32).collect();
    let round = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| to_f32(from_f32(x)) as f64).collect() };
    let (at, wt) = (
        b.upload(&a, &[a.len()], Category::Activations),
        b.upload(&w, &[w.len()], Category::Activations),
    );
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let want = gemm_ref(&round(&a), &round(&w), m, n, k, ta, tb);
        let run = |bf16: bool, grouped: bool| {
            let mut c = b.zeros(&[m * n], Category::Activations);
            let g = Gemm::new(m, n, k, ta, tb).bf16_inputs(bf16);
            if grouped {
                b.gemm_grouped(c.view_mut(), at.view(), wt.view(), &[(g, 0, 0, 0)]);
            } else {
                b.gemm(c.view_mut(), at.view(), wt.view(), g);
            }
            b.download(c.view())
        };
        let scale = want.iter().fold(0f64, |s, x| s.max(x.abs()));
        for grouped in [false, true] {
            let got = run(true, grouped);
            let err = got
                .iter()
                .zip(&want)
                .fold(0f64, |e, (&g, &w)| e.max((g as f64 - w).abs()));
            // Only f32 summation of k exact products differs: a few ulps of the largest term.
            assert!(
                err <= 1e-6 * scale,
                "bf16 gemm off by {err} (scale {scale})"
            );
        }
        // The f32 GEMM of unrounded inputs is far from it: rounding really happened.
        let f32_err = run(false, false)
            .iter()
            .zip(&want)
            .fold(0f64, |e, (&g, &w)| e.max((g as f64 - w).abs()));
        assert!(f32_err > 1e-3 * scale, "f32 gemm only {f32_err} from bf16");
    }
    // The scratch is charged to the ledger and reused: a second GEMM allocates nothing.
    let before = ledger.alloc_count();
    let mut c = b.zeros(&[m * n], Category::Activations);
    let after_c = ledger.alloc_count();
    b.gemm(
        c.view_mut(),
        at.view(),
        wt.view(),
        Gemm::new(m, n, k, false, false).bf16_inputs(true),
    );
    assert_eq!(ledger.alloc_count(), after_c);
    assert!(after_c == before + 1);
    assert!(
        ledger
            .report()
            .current(crate::ledger::Device::Host, Category::Buffers)
            >= ((m * k + k * n) * 4) as u64
    );
}

/// bf16 attention (`training.compute_dtype = "bf16"`) is the f32 kernel on the widened inputs
/// with each output rounded to bf16 once, to the bit; `lse` stays f32.
fn attention_bf16_case(batch: usize, tq: usize, tk: usize, heads: usize, kvh: usize, hd: usize) {
    use crate::bf16::{from_f32, to_f32};
    use crate::tensor::DType;
    let b = CpuBackend::new(Arc::new(Ledger::new()));
    let mut r = Rng::new(11);
    let (nq, nk, nl) = (
        batch * tq * heads * hd,
        batch * tk * kvh * hd,
        batch * heads * tq,
    );
    let round =
        |x: Vec<f64>| -> Vec<f32> { x.iter().map(|&x| to_f32(from_f32(x as f32))).collect() };
    let (q, k, v, dout) = (
        round(r.vec(nq)),
        round(r.vec(nk)),
        round(r.vec(nk)),
        round(r.vec(nq)),
    );
    let dims = AttnDims {
        batch,
        tq,
        tk,
        heads,
        kv_heads: kvh,
        head_dim: hd,
    };
    let f32_of = |x: &[f32]| b.upload(x, &[x.len()], Category::Activations);
    let bf16_of = |x: &[f32]| {
        let mut t = b.zeros_of(&[x.len()], DType::BF16, Category::Activations);
        b.cast(t.view_mut(), f32_of(x).view());
        t
    };
    let widened = |t: &Tensor| {
        let mut w = b.zeros(&[t.len()], Category::Activations);
        b.cast(w.view_mut(), t.view());
        b.download(w.view())
    };
    // Each precision's forward and backward: (out, lse, dq, dk, dv) as f32.
    let run = |of: &dyn Fn(&[f32]) -> Tensor, dt: DType| -> [Vec<f32>; 5] {
        let (q, k, v, dout) = (of(&q), of(&k), of(&v), of(&dout));
        let z = |n: usize| b.zeros_of(&[n], dt, Category::Activations);
        let (mut o, mut l) = (z(nq), b.zeros(&[nl], Category::Activations));
        let (qv, kv, vv) = (q.view(), k.view(), v.view());
        b.attention_forward(o.view_mut(), l.view_mut(), qv, kv, vv, dims);
        let (mut dq, mut dk, mut dv) = (z(nq), z(nk), z(nk));
        let g = AttnGrads {
            dq: dq.view_mut(),
            dk: dk.view_mut(),
            dv: dv.view_mut(),
        };
        let s = AttnSaved {
            out: o.view(),
            q: q.view(),
            k: k.view(),
            v: v.view(),
            lse: l.view(),
        };
        b.attention_backward(g, dout.view(), s, dims);
        [
            widened(&o),
            b.download(l.view()),
            widened(&dq),
            widened(&dk),
            widened(&dv),
        ]
    };
    let got = run(&bf16_of, DType::BF16);
    // The f32 reference reads the bf16 output in its backward, as the bf16 kernel does.
    let want = {
        let (qt, kt, vt) = (f32_of(&q), f32_of(&k), f32_of(&v));
        let (mut o, mut l) = (
            b.zeros(&[nq], Category::Activations),
            b.zeros(&[nl], Category::Activations),
        );
        b.attention_forward(
            o.view_mut(),
            l.view_mut(),
            qt.view(),
            kt.view(),
            vt.view(),
            dims,
        );
        let o = round(b.download_f64(o.view()));
        let ot = f32_of(&o);
        let z = |n: usize| b.zeros(&[n], Category::Activations);
        let (mut dq, mut dk, mut dv) = (z(nq), z(nk), z(nk));
        let g = AttnGrads {
            dq: dq.view_mut(),
            dk: dk.view_mut(),
            dv: dv.view_mut(),
        };
        let s = AttnSaved {
            out: ot.view(),
            q: qt.view(),
            k: kt.view(),
            v: vt.view(),
            lse: l.view(),
        };
        b.attention_backward(g, f32_of(&dout).view(), s, dims);
        let r = |t: &Tensor| round(b.download_f64(t.view()));
        [o, b.download(l.view()), r(&dq), r(&dk), r(&dv)]
    };
    for (what, (g, w)) in ["out", "lse", "dq", "dk", "dv"]
        .iter()
        .zip(got.iter().zip(&want))
    {
        assert!(g.iter().any(|&x| x != 0.0), "{what}: all zero");
        let diff = g
            .iter()
            .zip(w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            diff,
            0,
            "bf16 attention {what}, {dims:?}: {diff} of {} differ",
            g.len()
        );
    }
}

#[test]
fn attention_bf16_is_the_f32_kernel_rounded_once() {
    attention_bf16_case(2, 70, 70, 4, 2, 16);
    attention_bf16_case(1, 3, 7, 2, 1, 4);
}

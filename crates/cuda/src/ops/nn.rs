//! The model's operations (NnOps but the grouped GEMM): `embed.cu`, `norm.cu`, `attention.cu`,
//! `elementwise.cu` (SwiGLU), `router.cu`, `dispatch.cu`, `loss.cu`.

use super::*;
use crate::host::rope_inv_freq;
use ganymede_core::{
    AttnDims, AttnGrads, AttnSaved, AuxGrad, DispatchOut, Dispatched, EmbedIds, HeadRope,
    NormSaved, RouterDims, RouterOut,
};

/// Queries (forward, dq) or keys (dk, dv) per block of the tensor-core attention kernels, and
/// their block size (`TC_BQ`, `TC_BK`, `TC_W` of attention.cu).
const TC_TILE: usize = 64;
const TC_BLOCK: u32 = 128;

fn rows_of(op: &str, len: usize, width: usize) -> usize {
    assert!(
        width > 0 && len.is_multiple_of(width),
        "{op}: {len} elements are not rows of {width}"
    );
    len / width
}

/// A view's storage and length, writable or not, for the ops' argument checks.
trait Extent {
    fn extent(&self) -> (DType, usize);
}

impl Extent for View<'_> {
    fn extent(&self) -> (DType, usize) {
        (self.dtype(), self.len())
    }
}

impl Extent for ViewMut<'_> {
    fn extent(&self) -> (DType, usize) {
        (self.dtype(), self.len())
    }
}

/// Checks that `v`, argument `what` of `op`, holds `want` = (dtype, length).
fn check(op: &str, what: &str, v: &impl Extent, want: (DType, usize)) {
    assert_eq!(v.extent(), want, "{op}: {what} (dtype, length)");
}

/// `{op}_f32`, `{op}_bf16` and `{op}_f32_to_bf16`, indexed by [`to_at`].
const fn dtypes_to(op: &str) -> Family<3> {
    Family::new(&[&[op], &["_f32", "_bf16", "_f32_to_bf16"]])
}

/// The variant of an op reading `input` storage and writing `output` among [`dtypes_to`]'s:
/// one storage (`f32`, `bf16`), or f32 in and bf16 out (`f32_to_bf16`: the experts' and
/// SwiGLUs' rows that bf16-input GEMMs read, rounded once where they are made).
fn to_at(input: DType, output: DType, op: &str) -> usize {
    match (input, output) {
        (DType::F32, DType::BF16) => 2,
        (i, o) if i == o => dt_at(i, op),
        (i, o) => panic!("{op}: no kernel from {} to {}", i.name(), o.name()),
    }
}

/// `op`'s kernel from `input` storage to `output` (see [`to_at`]), resolved at compile time.
macro_rules! by_dtypes_to {
    ($op:expr, $input:expr, $output:expr) => {{
        const F: Family<3> = dtypes_to($op);
        F.get(&[to_at($input, $output, $op)])
    }};
}

/// `{prefix}{doc}{dtype}` for `doc` in (``, `doc_`) and the storage types: the norm and
/// attention kernels with and without document masking, indexed by
/// `[doc.is_some() as usize, dt_at(dt, op)]`.
const fn docs_dtypes(prefix: &str) -> Family<4> {
    Family::new(&[&[prefix], &["", "doc_"], &["f32", "bf16"]])
}

/// [`docs_dtypes`] with a third choice, `f32_bf16`: f32 rows with a bf16 side (the head norm's
/// output in forward, its incoming gradient in backward); indexed by [`mixed_at`].
const fn docs_dtypes_mixed(prefix: &str) -> Family<6> {
    Family::new(&[&[prefix], &["", "doc_"], &["f32", "bf16", "f32_bf16"]])
}

/// The choice of [`docs_dtypes_mixed`] for rows of `dt` with a side of `side`.
fn mixed_at(op: &str, what: &str, dt: DType, side: DType) -> usize {
    match (dt, side) {
        (DType::F32, DType::BF16) => 2,
        _ if dt == side => dt_at(dt, op),
        _ => panic!("{op}: {what} is {side:?} with {dt:?} rows"),
    }
}

/// The tensor-core attention kernels' head sizes, as their names spell them.
const TC_HEAD_DIMS: [&str; 4] = ["16", "32", "64", "128"];

/// Head size `d`'s index among [`TC_HEAD_DIMS`].
fn tc_at(d: usize) -> usize {
    match d {
        16 => 0,
        32 => 1,
        64 => 2,
        128 => 3,
        _ => panic!("no tensor-core attention kernel for head_dim {d}"),
    }
}

/// Whether the experts' outputs are bf16 beside f32 tokens (bf16 GEMM outputs: the
/// `*_ye_bf16` combine kernels); otherwise `ye` is in the tokens' storage.
fn ye_bf16(ye: &View, tokens: DType) -> bool {
    let mixed = (tokens, ye.dtype()) == (DType::F32, DType::BF16);
    assert!(
        mixed || ye.dtype() == tokens,
        "moe_combine: {} expert outputs beside {} tokens",
        ye.dtype().name(),
        tokens.name()
    );
    mixed
}

impl<L: Launcher> KernelOps<L> {
    // -----------------------------------------------------------------------------------------
    // Embedding

    /// `out[t] = wte[ids[t]]` (ids u32; the data loader's ids are in range, checked there). The
    /// table is in `out`'s dtype, or bf16 widened into f32 rows (a bf16 weight under bf16
    /// compute).
    pub fn embedding_forward(&self, out: ViewMut, wte: View, ids: View, dim: usize) {
        let dt = out.dtype();
        let n = ids.len();
        assert_eq!(ids.dtype(), DType::U32, "embedding_forward: ids are u32");
        check("embedding_forward", "out", &out, (dt, n * dim));
        let widen = (dt, wte.dtype()) == (DType::F32, DType::BF16);
        assert!(
            wte.dtype() == dt || widen,
            "embedding_forward: a {} table for {} rows",
            wte.dtype().name(),
            dt.name()
        );
        rows_of("embedding_forward", wte.len(), dim);
        if n == 0 {
            return;
        }
        let args = [self.arg_mut(out), self.arg(wte), self.arg(ids), i32_of(dim)];
        let k = match widen {
            true => kernel!("embedding_forward_f32_bf16"),
            false => by_dtype!("embedding_forward", dt),
        };
        self.launch(k, self.per_row(n, dim), &args);
    }

    /// `dwte[ids[t]] += dout[t]` (dwte f32), without atomics: blocks per distinct id (one per
    /// chunk of its columns) over the grouping the host uploaded with the batch (`EmbedIds`), so
    /// nothing is read back here, in a launch that is the same for every batch of `n` tokens.
    pub fn embedding_backward(&self, dwte: ViewMut, dout: View, e: EmbedIds, dim: usize) {
        let n = e.ids.len();
        for (v, what) in [
            (e.ids, "ids"),
            (e.order, "order"),
            (e.seg_start, "seg_start"),
            (e.seg_id, "seg_id"),
        ] {
            assert_eq!(v.dtype(), DType::U32, "embedding_backward: {what} is u32");
        }
        assert_eq!(dwte.dtype(), DType::F32, "embedding_backward: dwte is f32");
        rows_of("embedding_backward", dwte.len(), dim);
        assert_eq!(dout.len(), n * dim, "embedding_backward: dout");
        // Shapes only: the ids' range was checked where the host built the batch.
        assert!(
            e.segments <= n
                && e.order.len() >= n
                && e.seg_start.len() > n
                && e.seg_id.len() >= e.segments
                && (n == 0) == (e.segments == 0),
            "embedding_backward: grouping of {} segments for {n} tokens",
            e.segments
        );
        if e.segments == 0 {
            return;
        }
        let k = by_dtype!("embedding_backward_sorted", dout.dtype());
        let args = [
            self.arg_mut(dwte),
            self.arg(dout),
            self.arg(e.order),
            self.arg(e.seg_start),
            self.arg(e.seg_id),
            i32_of(dim),
            i64_of(n),
        ];
        // A thread per column of a segment: long segments (byte ids) are then as parallel as
        // the columns allow.
        // Segments in a grid-stride loop up to the empty ones, so that the launch does not
        // depend on the batch (a CUDA graph's replay).
        let block = self.row_block(dim);
        let chunks = dim.div_ceil(block as usize);
        let blocks = n.min(self.tuning.ew_max_blocks as usize);
        self.launch(k, cfg(grid(blocks, chunks, 1), block), &args);
    }

    // -----------------------------------------------------------------------------------------
    // Norms

    /// `dw += Σ_chunks partial` (`parts × cols` f32 at `partial`).
    fn col_sum_acc(&self, dw: ViewMut, partial: *mut c_void, parts: usize) {
        let cols = dw.len();
        let args = [
            self.arg_mut(dw),
            partial.into(),
            i32_of(parts),
            i32_of(cols),
        ];
        let shape = cfg(grid(cols.div_ceil(32), 1, 1), 32);
        self.launch(kernel!("col_sum_acc_f32"), shape, &args);
    }

    pub fn rmsnorm_forward(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        x: View,
        w: View,
        dim: usize,
        eps: f32,
    ) {
        let dt = x.dtype();
        let rows = rows_of("rmsnorm_forward", x.len(), dim);
        check("rmsnorm_forward", "out", &out, (dt, x.len()));
        check("rmsnorm_forward", "w", &w, (dt, dim));
        check("rmsnorm_forward", "rstd", &rstd, (DType::F32, rows));
        if rows == 0 {
            return;
        }
        let args = [
            self.arg_mut(out),
            self.arg_mut(rstd),
            self.arg(x),
            self.arg(w),
            i32_of(dim),
            eps.into(),
        ];
        let k = by_dtype!("rmsnorm_forward", dt);
        self.launch(k, self.per_row(rows, dim), &args);
    }

    pub fn rmsnorm_backward(&self, dx: ViewMut, dw: ViewMut, dout: View, s: NormSaved, dim: usize) {
        let dt = s.x.dtype();
        let rows = rows_of("rmsnorm_backward", s.x.len(), dim);
        let n = s.x.len();
        check("rmsnorm_backward", "dx", &dx, (dt, n));
        check("rmsnorm_backward", "dout", &dout, (dt, n));
        check("rmsnorm_backward", "w", &s.w, (dt, dim));
        check("rmsnorm_backward", "dw", &dw, (DType::F32, dim));
        check("rmsnorm_backward", "rstd", &s.rstd, (DType::F32, rows));
        if rows == 0 {
            return;
        }
        let (dx_kernel, dw_kernel) = (
            by_dtype!("rmsnorm_backward_dx", dt),
            by_dtype!("rmsnorm_backward_dw_partial", dt),
        );
        let args = [
            self.arg_mut(dx),
            self.arg(dout),
            self.arg(s.x),
            self.arg(s.w),
            self.arg(s.rstd),
            i32_of(dim),
        ];
        let blocks = self.per_row(rows, dim);
        self.launch(dx_kernel, blocks, &args);
        let chunks = rows.div_ceil(CHUNK_ROWS);
        let (_s, [partial]) = self.scratch([chunks * dim * 4]);
        let args = [
            partial.into(),
            self.arg(dout),
            self.arg(s.x),
            self.arg(s.rstd),
            i32_of(rows),
            i32_of(dim),
            i32_of(CHUNK_ROWS),
        ];
        let shape = cfg(grid(dim.div_ceil(32), chunks, 1), 32);
        self.launch(dw_kernel, shape, &args);
        self.col_sum_acc(dw, partial, chunks);
    }

    /// `heads, head_dim, seq, pos0, inv_freq`: the sizes every head-norm kernel takes.
    fn rope_args(&self, d: &HeadRope, inv_freq: *mut c_void) -> [Arg; 5] {
        [
            i32_of(d.heads),
            i32_of(d.head_dim),
            i32_of(d.seq),
            i32_of(d.pos0),
            inv_freq.into(),
        ]
    }

    /// RoPE's frequency table (bitwise the CPU backend's), uploaded the first time a
    /// (head_dim, theta) is asked for and kept.
    fn inv_freq(&self, d: &HeadRope) -> *mut c_void {
        let key = (d.head_dim, d.theta.to_bits());
        self.kept(&self.freqs, key, usize::MAX, |_| {
            rope_inv_freq(d.head_dim, d.theta)
        })
    }

    pub fn head_norm_rope_forward(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        x: View,
        w: View,
        d: HeadRope,
    ) {
        self.head_norm_rope_fwd(out, rstd, (x, w), None, d)
    }

    /// [`Self::head_norm_rope_forward`] with each row's document start (u32, one a row) taken
    /// off its position: the `_doc_` kernels.
    pub fn head_norm_rope_forward_docs(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        x: View,
        w: View,
        docs: View,
        d: HeadRope,
    ) {
        self.head_norm_rope_fwd(out, rstd, (x, w), Some(docs), d)
    }

    fn head_norm_rope_fwd(
        &self,
        out: ViewMut,
        rstd: ViewMut,
        (x, w): (View, View),
        docs: Option<View>,
        d: HeadRope,
    ) {
        let op = "head_norm_rope_forward";
        let dt = x.dtype();
        let rows = rows_of(op, x.len(), d.heads * d.head_dim);
        let mixed = mixed_at(op, "out", dt, out.dtype());
        check(op, "out", &out, (out.dtype(), x.len()));
        check(op, "w", &w, (dt, d.head_dim));
        check(op, "rstd", &rstd, (DType::F32, rows * d.heads));
        if rows == 0 {
            return;
        }
        let doc = self.doc_arg(op, docs, rows);
        let freq = self.inv_freq(&d);
        let mut args = Args::from([
            self.arg_mut(out),
            self.arg_mut(rstd),
            self.arg(x),
            self.arg(w),
        ]);
        args.extend(self.rope_args(&d, freq));
        args.push(d.eps.into());
        args.push(i64_of(rows * d.heads));
        args.extend(doc);
        let blocks = self.warp_per_row(rows * d.heads);
        const FWD: Family<6> = docs_dtypes_mixed("head_norm_rope_forward_");
        let k = FWD.get(&[doc.is_some() as usize, mixed]);
        self.launch(k, blocks, &args);
    }

    /// The document starts' kernel argument, their length checked (`n`: one a row or query),
    /// or none.
    fn doc_arg(&self, op: &str, docs: Option<View>, n: usize) -> Option<Arg> {
        let d = docs?;
        check(op, "docs", &d, (DType::U32, n));
        Some(self.arg(d))
    }

    pub fn head_norm_rope_backward(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        d: HeadRope,
    ) {
        self.head_norm_rope_bwd(dx, dw, dout, s, None, d)
    }

    /// The backward of [`Self::head_norm_rope_forward_docs`].
    pub fn head_norm_rope_backward_docs(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        docs: View,
        d: HeadRope,
    ) {
        self.head_norm_rope_bwd(dx, dw, dout, s, Some(docs), d)
    }

    fn head_norm_rope_bwd(
        &self,
        dx: ViewMut,
        dw: ViewMut,
        dout: View,
        s: NormSaved,
        docs: Option<View>,
        d: HeadRope,
    ) {
        let op = "head_norm_rope_backward";
        let dt = s.x.dtype();
        let n = s.x.len();
        let rows = rows_of(op, n, d.heads * d.head_dim);
        check(op, "dx", &dx, (dt, n));
        let mixed = mixed_at(op, "dout", dt, dout.dtype());
        check(op, "dout", &dout, (dout.dtype(), n));
        check(op, "w", &s.w, (dt, d.head_dim));
        check(op, "dw", &dw, (DType::F32, d.head_dim));
        check(op, "rstd", &s.rstd, (DType::F32, rows * d.heads));
        if rows == 0 {
            return;
        }
        let doc = self.doc_arg(op, docs, rows);
        const DX: Family<6> = docs_dtypes_mixed("head_norm_rope_backward_dx_");
        const DW: Family<6> = docs_dtypes_mixed("head_norm_rope_backward_dw_partial_");
        let at = [doc.is_some() as usize, mixed];
        // The weight gradient's chunks are of head rows (a position's heads one after another).
        let chunks = (rows * d.heads).div_ceil(CHUNK_ROWS);
        let freq = self.inv_freq(&d);
        let (_s, [partial]) = self.scratch([chunks * d.head_dim * 4]);
        let mut args = Args::from([
            self.arg_mut(dx),
            self.arg(dout),
            self.arg(s.x),
            self.arg(s.w),
            self.arg(s.rstd),
        ]);
        args.extend(self.rope_args(&d, freq));
        args.push(i64_of(rows * d.heads));
        args.extend(doc);
        let blocks = self.warp_per_row(rows * d.heads);
        self.launch(DX.get(&at), blocks, &args);
        let mut args = Args::from([
            partial.into(),
            self.arg(dout),
            self.arg(s.x),
            self.arg(s.rstd),
            i32_of(rows),
        ]);
        args.extend(self.rope_args(&d, freq));
        args.push(i32_of(CHUNK_ROWS));
        args.extend(doc);
        let shape = cfg(grid(d.head_dim.div_ceil(32), chunks.min(65535), 1), 32);
        self.launch(DW.get(&at), shape, &args);
        self.col_sum_acc(dw, partial, chunks);
    }

    // -----------------------------------------------------------------------------------------
    // Attention

    /// `tq, tk, heads, kv_heads, head_dim`.
    fn attn_dims(d: &AttnDims) -> [Arg; 5] {
        [
            i32_of(d.tq),
            i32_of(d.tk),
            i32_of(d.heads),
            i32_of(d.kv_heads),
            i32_of(d.head_dim),
        ]
    }

    fn attn_check(op: &str, d: &AttnDims, dt: DType, q: usize, k: usize, v: usize) -> usize {
        assert!(
            d.tk >= d.tq && d.kv_heads > 0 && d.heads.is_multiple_of(d.kv_heads),
            "{op}: {d:?}"
        );
        assert!(d.head_dim <= 128, "{op}: head_dim {} > 128", d.head_dim);
        let nq = d.batch * d.tq * d.heads * d.head_dim;
        let nk = d.batch * d.tk * d.kv_heads * d.head_dim;
        assert_eq!((q, k, v), (nq, nk, nk), "{op}: q, k, v lengths for {d:?}");
        let _ = dt_at(dt, op);
        nq
    }

    /// Whether this attention runs on the tensor-core kernels (see [`Tuning::attn_tc`]).
    fn attn_tc(&self, dt: DType, d: &AttnDims) -> bool {
        self.tuning.attn_tc && dt == DType::BF16 && matches!(d.head_dim, 16 | 32 | 64 | 128)
    }

    fn attn_scale(d: &AttnDims) -> Arg {
        Arg::F32((1.0 / (d.head_dim as f64).sqrt()) as f32)
    }

    pub fn attention_forward(
        &self,
        out: ViewMut,
        lse: ViewMut,
        q: View,
        k: View,
        v: View,
        d: AttnDims,
    ) {
        self.attention_fwd(out, lse, (q, k, v), None, d)
    }

    /// Block-causal [`Self::attention_forward`]: each query's document start (u32
    /// `[batch, tq]`, never decreasing along a sequence) its first key; the `_doc_` kernels.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_docs(
        &self,
        out: ViewMut,
        lse: ViewMut,
        q: View,
        k: View,
        v: View,
        docs: View,
        d: AttnDims,
    ) {
        self.attention_fwd(out, lse, (q, k, v), Some(docs), d)
    }

    fn attention_fwd(
        &self,
        out: ViewMut,
        lse: ViewMut,
        (q, k, v): (View, View, View),
        docs: Option<View>,
        d: AttnDims,
    ) {
        let op = "attention_forward";
        let dt = q.dtype();
        assert!(k.dtype() == dt && v.dtype() == dt, "{op}: q, k, v dtypes");
        let nq = Self::attn_check(op, &d, dt, q.len(), k.len(), v.len());
        check(op, "out", &out, (dt, nq));
        let nl = d.batch * d.heads * d.tq;
        check(op, "lse", &lse, (DType::F32, nl));
        if nl == 0 {
            return;
        }
        let doc = self.doc_arg(op, docs, d.batch * d.tq);
        let ds = doc.is_some() as usize;
        let mut args = Args::from([
            self.arg_mut(out),
            self.arg_mut(lse),
            self.arg(q),
            self.arg(k),
            self.arg(v),
        ]);
        args.extend(Self::attn_dims(&d));
        args.push(Self::attn_scale(&d));
        args.extend(doc);
        if self.attn_tc(dt, &d) {
            // Two m-tiles a warp where chosen: twice the queries a block.
            let wide = self.tuning.attn_wide_fwd && d.head_dim <= 64;
            const TC: Family<16> = Family::new(&[
                &["attention_forward_tc"],
                &TC_HEAD_DIMS,
                &["", "x2"],
                &["_"],
                &["", "doc_"],
                &["bf16"],
            ]);
            let rows = if wide { 2 * TC_TILE } else { TC_TILE };
            let shape = cfg(grid(d.tq.div_ceil(rows), d.heads, d.batch), TC_BLOCK);
            let k = TC.get(&[tc_at(d.head_dim), wide as usize, ds]);
            self.launch(k, shape, &args);
            return;
        }
        const SIMT: Family<4> = docs_dtypes("attention_forward_");
        let w = self.tuning.attn_rows as usize;
        let shape = cfg(grid(d.tq.div_ceil(w), d.heads, d.batch), 32 * w as u32);
        self.launch(SIMT.get(&[ds, dt_at(dt, op)]), shape, &args);
    }

    pub fn attention_backward(&self, g: AttnGrads, dout: View, s: AttnSaved, d: AttnDims) {
        self.attention_bwd(g, dout, s, None, d)
    }

    /// The backward of [`Self::attention_forward_docs`].
    pub fn attention_backward_docs(
        &self,
        g: AttnGrads,
        dout: View,
        s: AttnSaved,
        docs: View,
        d: AttnDims,
    ) {
        self.attention_bwd(g, dout, s, Some(docs), d)
    }

    /// The backward's first pass: each query row's `Σ dout·out` into `delta` (f32, a row each).
    fn attn_delta(&self, delta: *mut c_void, dout: View, out: View, d: &AttnDims) {
        let nl = d.batch * d.heads * d.tq;
        let args = [
            delta.into(),
            self.arg(dout),
            self.arg(out),
            i32_of(d.tq),
            i32_of(d.heads),
            i32_of(d.head_dim),
            i64_of(nl),
        ];
        let k = by_dtype!("attention_backward_delta", dout.dtype());
        self.launch(k, self.warp_per_row(nl), &args);
    }

    fn attention_bwd(
        &self,
        g: AttnGrads,
        dout: View,
        s: AttnSaved,
        docs: Option<View>,
        d: AttnDims,
    ) {
        let op = "attention_backward";
        let dt = s.q.dtype();
        assert!(
            s.k.dtype() == dt && s.v.dtype() == dt,
            "{op}: q, k, v dtypes"
        );
        let nq = Self::attn_check(op, &d, dt, s.q.len(), s.k.len(), s.v.len());
        let nk = s.k.len();
        check(op, "out", &s.out, (dt, nq));
        check(op, "dout", &dout, (dt, nq));
        check(op, "dq", &g.dq, (dt, nq));
        check(op, "dk", &g.dk, (dt, nk));
        check(op, "dv", &g.dv, (dt, nk));
        let nl = d.batch * d.heads * d.tq;
        check(op, "lse", &s.lse, (DType::F32, nl));
        if nl == 0 {
            return;
        }
        let doc = self.doc_arg(op, docs, d.batch * d.tq);
        let ds = doc.is_some() as usize;
        let tc = self.attn_tc(dt, &d);
        let fused = tc && self.tuning.attn_fused_dq && d.head_dim <= 64;
        let (_s, [delta]) = self.scratch([nl * 4]);
        // The fused backward's dq sums (f32, zeroed before the pass).
        let (_a, acc) = match fused {
            true => {
                let (g, p) = self.dq_sums(nq * 4);
                (Some(g), p)
            }
            false => (None, std::ptr::null_mut()),
        };
        self.attn_delta(delta, dout, s.out, &d);
        let AttnGrads { dq, dk, dv } = g;
        let tail = |args: &mut Args| {
            args.extend(Self::attn_dims(&d));
            args.push(Self::attn_scale(&d));
            args.extend(doc);
        };
        // The passes (`FUSED`, `DKDV`, `DQ`) on the tensor cores by head size and documents,
        // and the plain ones by documents and storage (no fused one).
        const PASSES: [&str; 3] = ["fused", "dkdv", "dq"];
        const FUSED: usize = 0;
        const DKDV: usize = 1;
        const DQ: usize = 2;
        const TC: Family<24> = Family::new(&[
            &["attention_backward_"],
            &PASSES,
            &["_tc"],
            &TC_HEAD_DIMS,
            &["_"],
            &["", "doc_"],
            &["bf16"],
        ]);
        const SIMT: Family<12> = Family::new(&[
            &["attention_backward_"],
            &PASSES,
            &["_"],
            &["", "doc_"],
            &["f32", "bf16"],
        ]);
        // A pass's grid (tiles of `len` positions, by head and sequence) and kernel: the
        // tensor-core variant in tiles of TC_TILE, the plain one in tiles of `tile`.
        let pass = |p: usize, tc: bool, len: usize, heads: usize, tile: usize| match tc {
            true => (
                cfg(grid(len.div_ceil(TC_TILE), heads, d.batch), TC_BLOCK),
                TC.get(&[p, tc_at(d.head_dim), ds]),
            ),
            false => (
                cfg(grid(len.div_ceil(tile), heads, d.batch), 128),
                SIMT.get(&[p, ds, dt_at(dt, op)]),
            ),
        };
        let mut args = Args::from([self.arg_mut(dk), self.arg_mut(dv)]);
        if fused {
            self.zero(acc, nq * 4);
            args.push(acc.into());
        }
        args.extend([
            self.arg(dout),
            self.arg(s.q),
            self.arg(s.k),
            self.arg(s.v),
            self.arg(s.lse),
            delta.into(),
        ]);
        tail(&mut args);
        if fused {
            let (shape, k) = pass(FUSED, true, d.tk, d.kv_heads, TC_TILE);
            self.launch(k, shape, &args);
            // The sums are scaled already: dq is their bf16 rounding.
            let args = [self.arg_mut(dq), acc.into(), i64_of(nq)];
            self.launch(kernel!("cast_f32_to_bf16"), self.ew(nq), &args);
            return;
        }
        let (shape, k) = pass(DKDV, tc, d.tk, d.kv_heads, 16);
        self.launch(k, shape, &args);
        let mut args = Args::from([
            self.arg_mut(dq),
            self.arg(dout),
            self.arg(s.q),
            self.arg(s.k),
            self.arg(s.v),
            self.arg(s.lse),
            delta.into(),
        ]);
        tail(&mut args);
        let (shape, k) = pass(DQ, tc, d.tq, d.heads, 8);
        self.launch(k, shape, &args);
    }

    // -----------------------------------------------------------------------------------------
    // SwiGLU

    /// `out` in the inputs' storage, or bf16 from f32 inputs.
    pub fn swiglu_forward(&self, out: ViewMut, gate: View, up: View) {
        let op = "swiglu_forward";
        let (dt, n) = (gate.dtype(), out.len());
        check(op, "gate", &gate, (dt, n));
        check(op, "up", &up, (dt, n));
        if n == 0 {
            return;
        }
        let k = by_dtypes_to!("swiglu_forward", dt, out.dtype());
        let args = [self.arg_mut(out), self.arg(gate), self.arg(up), i64_of(n)];
        self.launch(k, self.ew(n), &args);
    }

    /// `dgate`, `dup` in the inputs' storage, or bf16 from f32 inputs.
    pub fn swiglu_backward(&self, dgate: ViewMut, dup: ViewMut, dout: View, gate: View, up: View) {
        let op = "swiglu_backward";
        let (dt, n) = (dout.dtype(), dout.len());
        let out = dgate.dtype();
        check(op, "dgate", &dgate, (out, n));
        check(op, "dup", &dup, (out, n));
        check(op, "gate", &gate, (dt, n));
        check(op, "up", &up, (dt, n));
        if n == 0 {
            return;
        }
        let args = [
            self.arg_mut(dgate),
            self.arg_mut(dup),
            self.arg(dout),
            self.arg(gate),
            self.arg(up),
            i64_of(n),
        ];
        let k = by_dtypes_to!("swiglu_backward", dt, out);
        self.launch(k, self.ew(n), &args);
    }

    // -----------------------------------------------------------------------------------------
    // Router (f32)

    pub fn router_forward(&self, out: RouterOut, logits: View, bias: Option<View>, d: RouterDims) {
        let op = "router_forward";
        let RouterDims { experts, k, renorm } = d;
        assert!(
            (1..=32).contains(&k) && k <= experts && experts <= 1024,
            "{op}: {d:?}"
        );
        let rows = rows_of(op, logits.len(), experts);
        let f = DType::F32;
        check(op, "logits", &logits, (f, rows * experts));
        check(op, "probs", &out.probs, (f, rows * experts));
        check(op, "weights", &out.weights, (f, rows * k));
        check(op, "idx", &out.idx, (DType::U32, rows * k));
        check(op, "psum", &out.psum, (DType::F64, experts));
        if let Some(b) = bias {
            check(op, "bias", &b, (f, experts));
        }
        let RouterOut {
            mut probs,
            weights,
            idx,
            psum,
        } = out;
        let psum = self.launcher.addr_mut(psum);
        if rows == 0 {
            self.zero(psum, experts * 8);
            return;
        }
        let chunks = rows.div_ceil(CHUNK_ROWS);
        let (_s, [partial]) = self.scratch([chunks * experts * 8]);
        let bias = bias.map_or(Arg::Ptr(std::ptr::null_mut()), |b| self.arg(b));
        let probs_addr = self.arg_mut(probs.reborrow());
        let args = [
            probs_addr,
            self.arg_mut(weights),
            self.arg_mut(idx),
            self.arg(logits),
            bias,
            i32_of(experts),
            i32_of(k),
            Arg::I32(renorm as i32),
        ];
        let shape = cfg(grid(rows, 1, 1), 32);
        self.launch(kernel!("router_forward_f32"), shape, &args);
        let col_blocks = experts.div_ceil(32);
        let args = [
            partial.into(),
            probs_addr,
            i32_of(rows),
            i32_of(experts),
            i32_of(CHUNK_ROWS),
        ];
        let shape = cfg(grid(col_blocks, chunks, 1), 32);
        self.launch(kernel!("col_sum_partial_f64"), shape, &args);
        let args = [psum.into(), partial.into(), i32_of(chunks), i32_of(experts)];
        let shape = cfg(grid(col_blocks, 1, 1), 32);
        self.launch(kernel!("col_sum_set_f64"), shape, &args);
    }

    pub fn router_backward(
        &self,
        dlogits: ViewMut,
        dweights: View,
        probs: View,
        idx: View,
        aux: AuxGrad,
        d: RouterDims,
    ) {
        let op = "router_backward";
        let RouterDims { experts, k, renorm } = d;
        let rows = rows_of(op, probs.len(), experts);
        let f = DType::F32;
        check(op, "probs", &probs, (f, rows * experts));
        check(op, "dlogits", &dlogits, (f, rows * experts));
        check(op, "dweights", &dweights, (f, rows * k));
        check(op, "idx", &idx, (DType::U32, rows * k));
        check(op, "aux counts", &aux.counts, (DType::F64, experts));
        if rows == 0 {
            return;
        }
        let args = [
            self.arg_mut(dlogits),
            self.arg(dweights),
            self.arg(probs),
            self.arg(idx),
            self.arg(aux.counts),
            Arg::F64(aux.coef),
            Arg::F64(aux.tokens),
            i32_of(experts),
            i32_of(k),
            Arg::I32(renorm as i32),
        ];
        let shape = cfg(grid(rows, 1, 1), 32);
        self.launch(kernel!("router_backward_f32"), shape, &args);
    }

    // -----------------------------------------------------------------------------------------
    // Dispatch and combine

    /// Checks `pos` (u32, `k` per token; its entries are rows of the dispatched layout, which
    /// `moe_dispatch` wrote) and returns the tokens and its address.
    fn dispatched(&self, op: &str, d: &Dispatched, rows: usize) -> (usize, Arg) {
        assert_eq!(d.pos.dtype(), DType::U32, "{op}: pos is u32");
        assert!(d.k > 0 && d.pos.len().is_multiple_of(d.k), "{op}: pos vs k");
        assert!(
            d.pos.len() <= rows,
            "{op}: more choices than dispatched rows"
        );
        (d.pos.len() / d.k, self.arg(d.pos))
    }

    /// The stable counting sort of the router's choices by expert (see
    /// [`ganymede_core::DispatchOut`]) over tiles of [`DISPATCH_TILE`] choices: per-tile
    /// counts, then the counts, offsets and each tile's first rows in one block, then the
    /// placement in (token, choice) order (`dispatch.cu`).
    pub fn moe_dispatch(&self, out: DispatchOut, idx: View, experts: usize, k: usize) {
        let op = "moe_dispatch";
        let n = idx.len();
        assert!(k > 0 && n.is_multiple_of(k), "{op}: idx vs k");
        let u = DType::U32;
        check(op, "idx", &idx, (u, n));
        check(op, "counts", &out.counts, (u, experts));
        check(op, "offsets", &out.offsets, (u, experts + 1));
        check(op, "src", &out.src, (u, n));
        check(op, "pos", &out.pos, (u, n));
        let totals = match out.totals {
            Some(t) => {
                check(op, "totals", &t, (DType::F64, experts));
                self.arg_mut(t)
            }
            None => Arg::Ptr(std::ptr::null_mut()),
        };
        let (counts, offsets) = (
            self.launcher.addr_mut(out.counts),
            self.launcher.addr_mut(out.offsets),
        );
        assert!(experts <= 1024, "{op}: at most 1024 experts, not {experts}");
        let idx = self.arg(idx);
        let tiles = n.div_ceil(DISPATCH_TILE);
        let (_s, [t]) = self.scratch([tiles * experts * 4]);
        let block = cfg(grid(tiles, 1, 1), 256);
        let (n32, e32, tile) = (i32_of(n), i32_of(experts), i32_of(DISPATCH_TILE));
        if n > 0 {
            let args = [t.into(), idx, n32, e32, tile];
            self.launch(kernel!("dispatch_tile_counts"), block, &args);
        }
        // With no choices: zero counts and offsets.
        let shape = cfg(grid(1, 1, 1), u32_of(experts.max(1).next_multiple_of(32)));
        let args = [
            t.into(),
            counts.into(),
            offsets.into(),
            totals,
            i32_of(tiles),
            e32,
        ];
        self.launch(kernel!("dispatch_tile_scan"), shape, &args);
        if n > 0 {
            let args = [
                self.arg_mut(out.src),
                self.arg_mut(out.pos),
                t.into(),
                idx,
                n32,
                i32_of(k),
                e32,
                tile,
            ];
            self.launch(kernel!("dispatch_place"), block, &args);
        }
    }

    /// `xe` in `x`'s storage, or bf16 from f32 rows.
    pub fn moe_gather(&self, xe: ViewMut, x: View, src: View, dim: usize) {
        let op = "moe_gather";
        let dt = x.dtype();
        rows_of(op, x.len(), dim);
        assert_eq!(src.dtype(), DType::U32, "{op}: src is u32");
        let out = xe.dtype();
        check(op, "xe", &xe, (out, src.len() * dim));
        if src.is_empty() {
            return;
        }
        let n = src.len();
        let k = by_dtypes_to!("moe_gather", dt, out);
        let args = [self.arg_mut(xe), self.arg(x), self.arg(src), i32_of(dim)];
        let shape = self.per_row(n, dim);
        self.launch(k, shape, &args);
    }

    pub fn moe_gather_backward(&self, dx: ViewMut, dxe: View, d: Dispatched) {
        let op = "moe_gather_backward";
        let dt = dxe.dtype();
        let rows = rows_of(op, dxe.len(), d.dim);
        let (tokens, pos) = self.dispatched(op, &d, rows);
        check(op, "dx", &dx, (dt, tokens * d.dim));
        if tokens == 0 {
            return;
        }
        let args = [
            self.arg_mut(dx),
            self.arg(dxe),
            pos,
            i32_of(d.k),
            i32_of(d.dim),
        ];
        let shape = self.per_row(tokens, d.dim);
        self.launch(by_dtype!("moe_gather_backward", dt), shape, &args);
    }

    /// `ye` in `out`'s storage, or bf16 into f32 tokens (bf16 GEMM outputs).
    pub fn moe_combine(&self, out: ViewMut, ye: View, w: View, d: Dispatched) {
        let op = "moe_combine";
        let (dt, ye16) = (out.dtype(), ye_bf16(&ye, out.dtype()));
        let rows = rows_of(op, ye.len(), d.dim);
        let (tokens, pos) = self.dispatched(op, &d, rows);
        check(op, "out", &out, (dt, tokens * d.dim));
        check(op, "w", &w, (DType::F32, d.pos.len()));
        if tokens == 0 {
            return;
        }
        let args = [
            self.arg_mut(out),
            self.arg(ye),
            self.arg(w),
            pos,
            i32_of(d.k),
            i32_of(d.dim),
        ];
        let shape = self.per_row(tokens, d.dim);
        let k = match ye16 {
            true => kernel!("moe_combine_ye_bf16"),
            false => by_dtype!("moe_combine", dt),
        };
        self.launch(k, shape, &args);
    }

    /// `dye` in the inputs' storage, or bf16 from f32 ones (`dw` f32); `ye` may be bf16 beside
    /// an f32 `dout` (bf16 GEMM outputs), `dye` then bf16.
    pub fn moe_combine_backward(
        &self,
        dye: ViewMut,
        dw: ViewMut,
        dout: View,
        ye: View,
        w: View,
        d: Dispatched,
    ) {
        let op = "moe_combine_backward";
        let (dt, ye16) = (dout.dtype(), ye_bf16(&ye, dout.dtype()));
        let rows = rows_of(op, ye.len(), d.dim);
        let (tokens, pos) = self.dispatched(op, &d, rows);
        let out = dye.dtype();
        check(op, "dye", &dye, (out, ye.len()));
        check(op, "dout", &dout, (dt, tokens * d.dim));
        check(op, "w", &w, (DType::F32, d.pos.len()));
        check(op, "dw", &dw, (DType::F32, d.pos.len()));
        if tokens == 0 {
            return;
        }
        let args = [
            self.arg_mut(dye),
            self.arg_mut(dw),
            self.arg(dout),
            self.arg(ye),
            self.arg(w),
            pos,
            i32_of(d.k),
            i32_of(d.dim),
        ];
        let shape = self.per_row(tokens, d.dim);
        let k = match ye16 {
            true => {
                assert_eq!(out, DType::BF16, "{op}: bf16 ye writes bf16 dye");
                kernel!("moe_combine_backward_ye_bf16")
            }
            false => by_dtypes_to!("moe_combine_backward", dt, out),
        };
        self.launch(k, shape, &args);
    }

    // -----------------------------------------------------------------------------------------
    // Cross-entropy

    pub fn cross_entropy_forward(
        &self,
        lse: ViewMut,
        logits: View,
        targets: View,
        vocab: usize,
        loss: ViewMut,
    ) {
        let op = "cross_entropy_forward";
        let (dt, rows) = (logits.dtype(), targets.len());
        assert_eq!(targets.dtype(), DType::U32, "{op}: targets are u32");
        check(op, "logits", &logits, (dt, rows * vocab));
        check(op, "lse", &lse, (DType::F32, rows));
        assert!(
            loss.dtype() == DType::F64 && !loss.is_empty(),
            "{op}: loss is an f64 element"
        );
        if rows == 0 {
            return;
        }
        let (fwd, acc) = (
            by_dtype!("cross_entropy_forward", dt),
            by_dtype!("cross_entropy_loss_acc", dt),
        );
        let tg = self.arg(targets);
        let mut lse = lse;
        let lse_addr = self.arg_mut(lse.reborrow());
        let args = [lse_addr, self.arg(logits), i32_of(vocab)];
        self.launch(fwd, cfg(grid(rows, 1, 1), 128), &args);
        let args = [
            self.arg_mut(loss),
            lse_addr,
            self.arg(logits),
            tg,
            i32_of(rows),
            i32_of(vocab),
        ];
        self.launch(acc, cfg([1, 1, 1], 128), &args);
    }

    pub fn cross_entropy_backward(
        &self,
        logits: ViewMut,
        lse: View,
        targets: View,
        vocab: usize,
        scale: f32,
    ) {
        let op = "cross_entropy_backward";
        let (dt, rows) = (logits.dtype(), targets.len());
        assert_eq!(targets.dtype(), DType::U32, "{op}: targets are u32");
        check(op, "logits", &logits, (dt, rows * vocab));
        check(op, "lse", &lse, (DType::F32, rows));
        if rows == 0 {
            return;
        }
        let args = [
            self.arg_mut(logits),
            self.arg(lse),
            self.arg(targets),
            i32_of(vocab),
            scale.into(),
        ];
        let k = by_dtype!("cross_entropy_backward", dt);
        self.launch(k, cfg(grid(rows, 1, 1), 128), &args);
    }
}

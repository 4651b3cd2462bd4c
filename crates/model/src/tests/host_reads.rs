//! What a step reads back from the device: a CPU backend that counts its device-to-host reads
//! (everything else delegated), so a read slipped into the step shows up as a failing count.

use crate::*;
use ganymede_config::{preset, AcMode};
use ganymede_core::{
    embedding_segments, Blas, Category, CpuBackend, DType, Device, EmbedIds, ExpertGemm,
    ExpertRows, Gemm, Ledger, Memory, NnOps, OptimOps, ParamStore, Syrk, Tensor, View, ViewMut,
};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct CountingReads {
    be: CpuBackend,
    /// Whether its expert GEMMs read device offsets themselves (as gemm.cu's kernel does);
    /// otherwise it takes host sizes only, as cuBLAS's grouped GEMM.
    on_device: bool,
    /// (dtype, elements) of each read, in order.
    reads: Mutex<Vec<(DType, usize)>>,
    sumsq: AtomicUsize,
}

impl CountingReads {
    fn read(&self, v: &View) {
        self.reads.lock().unwrap().push((v.dtype(), v.len()));
    }
    fn take(&self) -> Vec<(DType, usize)> {
        std::mem::take(&mut self.reads.lock().unwrap())
    }
}

impl Memory for CountingReads {
    fn device(&self) -> Device {
        self.be.device()
    }
    fn ledger(&self) -> &Arc<Ledger> {
        self.be.ledger()
    }
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.be.zeros(shape, category)
    }
    fn zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        self.be.zeros_of(shape, dtype, category)
    }
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor {
        self.be.upload(data, shape, category)
    }
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor {
        self.be.upload_f64(data, shape, category)
    }
    fn download(&self, src: View) -> Vec<f32> {
        self.read(&src);
        self.be.download(src)
    }
    fn download_f64(&self, src: View) -> Vec<f64> {
        self.read(&src);
        self.be.download_f64(src)
    }
    fn write(&self, dst: ViewMut, data: &[f32]) {
        self.be.write(dst, data)
    }
    fn write_f64(&self, dst: ViewMut, data: &[f64]) {
        self.be.write_f64(dst, data)
    }
    fn upload_u32(&self, data: &[u32], shape: &[usize], category: Category) -> Tensor {
        self.be.upload_u32(data, shape, category)
    }
    fn write_u32(&self, dst: ViewMut, data: &[u32]) {
        self.be.write_u32(dst, data)
    }
    fn download_u32(&self, src: View) -> Vec<u32> {
        self.read(&src);
        self.be.download_u32(src)
    }
    fn copy(&self, dst: ViewMut, src: View) {
        self.be.copy(dst, src)
    }
    fn fill(&self, dst: ViewMut, value: f32) {
        self.be.fill(dst, value)
    }
}

impl Blas for CountingReads {
    fn gemm(&self, c: ViewMut, a: View, b: View, g: Gemm) {
        self.be.gemm(c, a, b, g)
    }
    fn syrk(&self, c: ViewMut, a: View, s: Syrk) {
        self.be.syrk(c, a, s)
    }
    fn native_bf16(&self) -> bool {
        self.be.native_bf16()
    }
    fn axpy(&self, y: ViewMut, alpha: f32, x: View) {
        self.be.axpy(y, alpha, x)
    }
    fn scale(&self, y: ViewMut, alpha: f32) {
        self.be.scale(y, alpha)
    }
    fn sumsq(&self, x: View) -> f64 {
        self.sumsq.fetch_add(1, Relaxed);
        self.be.sumsq(x)
    }
    fn sumsq_acc(&self, acc: ViewMut, x: View) {
        self.be.sumsq_acc(acc, x)
    }
    fn cast(&self, dst: ViewMut, src: View) {
        self.be.cast(dst, src)
    }
}

impl NnOps for CountingReads {
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]) {
        self.be.gemm_grouped(c, a, b, groups)
    }
    fn gemm_experts(&self, c: ViewMut, a: View, b: View, rows: ExpertRows, g: &ExpertGemm) {
        assert!(
            self.on_device || matches!(rows, ExpertRows::Host(_)),
            "device offsets to a backend that takes host sizes (a hidden read)"
        );
        self.be.gemm_experts(c, a, b, rows, g)
    }
    fn experts_on_device(&self, _bf16_inputs: bool) -> bool {
        self.on_device
    }
    fn embedding_backward(&self, dwte: ViewMut, dout: View, ids: EmbedIds, dim: usize) {
        // The CPU backend ignores the grouping the step uploaded: check it here (uncounted
        // reads, the test's own), as a kernel backend would use it.
        let got = |v: View, len: usize| self.be.download_u32(v)[..len].to_vec();
        let (order, seg_start, seg_id) = embedding_segments(&self.be.download_u32(ids.ids));
        assert_eq!(ids.segments, seg_id.len());
        assert_eq!(got(ids.order, order.len()), order);
        assert_eq!(got(ids.seg_start, seg_start.len()), seg_start);
        assert_eq!(got(ids.seg_id, seg_id.len()), seg_id);
        self.be.embedding_backward(dwte, dout, ids, dim)
    }
    ganymede_core::forward_nn_ops!(be:
        embedding_forward, rmsnorm_forward, rmsnorm_backward, head_norm_rope_forward,
        head_norm_rope_backward, attention_forward, attention_backward, swiglu_forward,
        swiglu_backward, router_forward, router_backward, moe_dispatch, moe_gather,
        moe_gather_backward, moe_combine, moe_combine_backward, cross_entropy_forward,
        cross_entropy_backward, head_norm_rope_forward_docs, head_norm_rope_backward_docs,
        attention_forward_docs, attention_backward_docs,
    );
}

impl OptimOps for CountingReads {
    ganymede_core::forward_optim_ops!(be:
        adamw_step, nesterov_momentum, normalize_frobenius, decay_update,
    );
}

/// One training step of `tiny` (two MoE layers, 8 experts) on a backend whose expert GEMMs
/// read their rows' offsets in device memory reads back nothing but, at its end, the `[2 × 8]`
/// routing sums and counts and the one loss sum, and no `sumsq`, with the MoE layers' tokens
/// in one chunk or two. On a backend that takes host sizes it reads each MoE layer's `[8]`
/// counts after each dispatch too (forward, the backward's recompute under full
/// checkpointing, and a chunk's dispatch again in backward). An evaluation step does the same
/// without the backward. Both give the same losses.
#[test]
fn a_step_reads_back_only_its_metrics_where_the_expert_gemms_read_device_offsets() {
    let c = preset("tiny").unwrap().model;
    let (batch, seq) = (2, 16);
    let inputs = (0..batch * seq).map(|i| (i * 7 % c.vocab_size) as u32);
    let inputs: Vec<u32> = inputs.collect();
    let targets: Vec<u32> = inputs
        .iter()
        .map(|&t| (t + 1) % c.vocab_size as u32)
        .collect();
    let tokens = Tokens {
        inputs: &inputs,
        targets: &targets,
        doc_starts: None,
    };
    let counts = (DType::U32, c.experts);
    let end = [
        (DType::F64, 2 * c.experts),
        (DType::F64, 2 * c.experts),
        (DType::F64, 1),
    ];
    let n = batch * seq;
    for chunk in [0, n / 2] {
        let parts = if chunk == 0 { 1 } else { 2 };
        let mut losses = vec![];
        for on_device in [false, true] {
            let be = CountingReads {
                on_device,
                ..Default::default()
            };
            let model = Model::new(&c).with_moe_chunk(chunk);
            let params = model.init_params(&be, 3);
            for (mode, recompute) in [(AcMode::Full, 1), (AcMode::None, 0)] {
                let mut ws = Workspace::new(&be, &model, batch, seq, mode);
                let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
                be.take();
                let out = forward_backward(&be, &model, &params, &mut grads, &mut ws, tokens, 1.0);
                // Per MoE layer: the forward's chunks, the recompute's, and every chunk but
                // the last again in backward.
                let reads = 2 * (parts * (1 + recompute) + parts - 1);
                let mut want = vec![counts; if on_device { 0 } else { reads }];
                want.extend(end);
                let what = format!("{mode:?}, on device {on_device}, {parts} chunk(s)");
                assert_eq!(be.take(), want, "{what}");
                let eval = forward_loss(&be, &model, &params, &mut ws, tokens);
                let want = vec![counts; if on_device { 0 } else { 2 * parts }];
                assert_eq!(be.take(), [want, end.to_vec()].concat(), "{what}");
                losses.push((out.loss, out.aux_loss, eval.loss, eval.aux_loss));
            }
            assert_eq!(be.sumsq.load(Relaxed), 0);
        }
        assert!(losses.windows(2).all(|w| w[0] == w[1]), "{losses:?}");
        assert!(losses[0].1 > 0.0, "an auxiliary loss to compare");
    }
}

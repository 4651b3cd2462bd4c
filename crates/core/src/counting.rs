//! A backend that counts what it reads back from the device and how often the host waits for
//! it, everything else delegated to the backend inside, so that a test can hold a training
//! step to the reads it should make: a read slipped into the step shows up as a failing count.
//! Over the CPU backend it checks the model; over the kernels' host build, the very launch
//! logic a GPU runs.

use crate::backend::{
    AdamWStep, AdamWTensor, Backend, Blas, DecayStep, EmbedIds, ExpertGemm, ExpertRows, Gemm,
    GradScale, Memory, NnOps, OptimOps,
};
use crate::stream::Event;
use crate::tensor::{DType, View, ViewMut};
use crate::{embedding_segments, forward_blas, forward_memory, forward_nn_ops, forward_optim_ops};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// `inner` with its reads counted: each download's (dtype, elements), in order, the host's
/// waits for the device (`synchronize`, `synchronize_event`) and the calls of `sumsq` (whose
/// result is a read); and, for each update kernel (`adamw_step`, `nesterov_momentum`,
/// `decay_update`), how many reads and `sumsq`s came before it, so that a test can hold an
/// optimizer step to reading nothing before its update.
pub struct CountingReads<B> {
    pub inner: B,
    /// Where set, what [`NnOps::experts_on_device`] answers instead of `inner` (as a backend
    /// that takes host sizes, say); device offsets given to a backend that answers no are then
    /// refused, as a hidden read.
    pub experts_on_device: Option<bool>,
    reads: Mutex<Vec<(DType, usize)>>,
    waits: AtomicUsize,
    sumsq: AtomicUsize,
    /// Per update kernel: the reads (since the last [`Self::take`]) and `sumsq`s before it.
    updates: Mutex<Vec<(usize, usize)>>,
}

impl<B: Backend> CountingReads<B> {
    pub fn new(inner: B) -> Self {
        CountingReads {
            inner,
            experts_on_device: None,
            reads: Mutex::new(vec![]),
            waits: AtomicUsize::new(0),
            sumsq: AtomicUsize::new(0),
            updates: Mutex::new(vec![]),
        }
    }
    /// The reads since the last call (which starts the update kernels' log afresh too).
    pub fn take(&self) -> Vec<(DType, usize)> {
        self.updates.lock().unwrap().clear();
        std::mem::take(&mut self.reads.lock().unwrap())
    }
    /// Each update kernel since the last [`Self::take`], in order: how many reads had come
    /// since that `take`, and how many `sumsq`s in all, when it was called.
    pub fn updates(&self) -> Vec<(usize, usize)> {
        self.updates.lock().unwrap().clone()
    }
    fn update(&self) {
        let reads = self.reads.lock().unwrap().len();
        let mut u = self.updates.lock().unwrap();
        u.push((reads, self.sumsqs()));
    }
    /// The host's waits for the device so far.
    pub fn waits(&self) -> usize {
        self.waits.load(Relaxed)
    }
    /// The `sumsq` calls so far.
    pub fn sumsqs(&self) -> usize {
        self.sumsq.load(Relaxed)
    }
    fn read(&self, v: &View) {
        self.reads.lock().unwrap().push((v.dtype(), v.len()));
    }
}

impl<B: Backend> Memory for CountingReads<B> {
    fn download(&self, src: View) -> Vec<f32> {
        self.read(&src);
        self.inner.download(src)
    }
    fn download_f64(&self, src: View) -> Vec<f64> {
        self.read(&src);
        self.inner.download_f64(src)
    }
    fn download_u32(&self, src: View) -> Vec<u32> {
        self.read(&src);
        self.inner.download_u32(src)
    }
    fn synchronize(&self) {
        self.waits.fetch_add(1, Relaxed);
        self.inner.synchronize()
    }
    fn synchronize_event(&self, event: &Event) {
        self.waits.fetch_add(1, Relaxed);
        self.inner.synchronize_event(event)
    }
    forward_memory!(inner:
        device, ledger, zeros, zeros_of, upload, upload_f64, write, write_f64, upload_u32,
        write_u32, copy, fill, try_zeros, pinned_zeros, pinned_zeros_of, copy_async,
        record_event, wait_event, query_event, elapsed, trace_copies, take_copy_spans,
        start_phases, phase, take_phase_times, graph, forget_graph,
    );
}

impl<B: Backend> Blas for CountingReads<B> {
    fn sumsq(&self, x: View) -> f64 {
        self.sumsq.fetch_add(1, Relaxed);
        self.inner.sumsq(x)
    }
    forward_blas!(inner:
        gemm, syrk, native_bf16, gemm_strided, syrk_strided, syrk_strided_into_bf16,
        batches_matrices, axpy, scale, add, sumsq_acc, sumsq_acc_many, cast,
    );
}

impl<B: Backend> NnOps for CountingReads<B> {
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]) {
        self.inner.gemm_grouped(c, a, b, groups)
    }
    fn gemm_experts(&self, c: ViewMut, a: View, b: View, rows: ExpertRows, g: &ExpertGemm) {
        let device = matches!(rows, ExpertRows::Device { .. });
        assert!(
            !device || self.experts_on_device(g.gemm.bf16_inputs),
            "device offsets to a backend that takes host sizes (a hidden read)"
        );
        self.inner.gemm_experts(c, a, b, rows, g)
    }
    fn experts_on_device(&self, bf16_inputs: bool) -> bool {
        self.experts_on_device
            .unwrap_or_else(|| self.inner.experts_on_device(bf16_inputs))
    }
    fn embedding_backward(&self, dwte: ViewMut, dout: View, ids: EmbedIds, dim: usize) {
        // The grouping the step uploaded, checked here (uncounted reads, the check's own): a
        // backend that ignores it would not notice it wrong.
        let got = |v: View, len: usize| self.inner.download_u32(v)[..len].to_vec();
        let (order, seg_start, seg_id) = embedding_segments(&self.inner.download_u32(ids.ids));
        assert_eq!(ids.segments, seg_id.len());
        assert_eq!(got(ids.order, order.len()), order);
        assert_eq!(got(ids.seg_start, seg_start.len()), seg_start);
        assert_eq!(got(ids.seg_id, seg_id.len()), seg_id);
        self.inner.embedding_backward(dwte, dout, ids, dim)
    }
    forward_nn_ops!(inner:
        embedding_forward, rmsnorm_forward, rmsnorm_backward, head_norm_rope_forward,
        head_norm_rope_backward, attention_forward, attention_backward, swiglu_forward,
        swiglu_backward, router_forward, router_backward, moe_dispatch, moe_gather,
        moe_gather_backward, moe_combine, moe_combine_backward, cross_entropy_forward,
        cross_entropy_backward, head_norm_rope_forward_docs, head_norm_rope_backward_docs,
        attention_forward_docs, attention_backward_docs,
    );
}

impl<B: Backend> OptimOps for CountingReads<B> {
    fn adamw_step(
        &self,
        param: ViewMut,
        m: ViewMut,
        v: ViewMut,
        grad: View,
        h: &AdamWStep,
        rounded: Option<ViewMut>,
    ) {
        self.update();
        self.inner.adamw_step(param, m, v, grad, h, rounded)
    }
    fn adamw_step_many(&self, ts: Vec<AdamWTensor>, h: &AdamWStep) {
        self.update();
        self.inner.adamw_step_many(ts, h)
    }
    fn nesterov_momentum(&self, buf: ViewMut, grad: ViewMut, momentum: f64, scale: GradScale) {
        self.update();
        self.inner.nesterov_momentum(buf, grad, momentum, scale)
    }
    fn decay_update(&self, param: ViewMut, update: View, h: &DecayStep, rounded: Option<ViewMut>) {
        self.update();
        self.inner.decay_update(param, update, h, rounded)
    }
    forward_optim_ops!(inner:
        normalize_frobenius, normalize_frobenius_strided, normalizes_into_bf16,
        normalize_frobenius_strided_bf16, step_scale,
    );
}

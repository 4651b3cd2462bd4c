//! The backend interface. Split by concern so each can grow on its own:
//! [`Memory`] (allocation and transfers), [`Blas`] (GEMM and vector ops),
//! [`NnOps`] (the model's kernels) and [`OptimOps`] (optimizer kernels).
//! [`Backend`] is all of them; model and optimizer code take `&dyn Backend` or `&impl Backend`.

mod nn;
mod optim;

pub use nn::{
    embedding_segments, AttnDims, AttnGrads, AttnSaved, AuxGrad, DispatchOut, Dispatched, EmbedIds,
    ExpertGemm, ExpertRows, HeadRope, NnOps, NormSaved, Routed, RouterDims, RouterOut,
};
pub use optim::{
    step_scale_value, AdamWStep, AdamWTensor, DecayStep, DeviceRate, GradScale, OptimOps,
};

use crate::ledger::{Category, Device, Ledger};
use crate::phase::{PhaseTimes, StepPhase};
use crate::stream::{CopySpan, Event, MemoryError, Stream};
use crate::tensor::{DType, Tensor, View, ViewMut};
use std::sync::Arc;
use std::time::Duration;

/// Allocation, transfers, streams and events.
///
/// The synchronous operations (`zeros`, `upload`, `download`, `write`, `copy`, `fill`) are
/// ordered on the compute stream, and the blocking ones (`upload`, `download`) return when done.
/// The stream operations have defaults for a backend whose work completes when issued (the
/// plain CPU backend), so such a backend implements only the synchronous part; code above the
/// seam must still use them as on a GPU (see [`crate::stream`]).
pub trait Memory: Send + Sync {
    fn device(&self) -> Device;
    fn ledger(&self) -> &Arc<Ledger>;
    /// A zero-filled tensor charged to `category`.
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor;
    /// A zero-filled tensor of `dtype` (the backend's own precision is `zeros`'s): f64
    /// accumulators of a step's scalars, bf16 staging.
    fn zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor;
    /// A tensor holding `data` (host to device copy).
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor;
    /// Like `upload`, from f64 data (exact on an f64 backend).
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor;
    /// Device to host copy.
    fn download(&self, src: View) -> Vec<f32>;
    /// Device to host copy in f64 (exact on an f64 backend).
    fn download_f64(&self, src: View) -> Vec<f64>;
    /// Host to device copy into an existing view.
    fn write(&self, dst: ViewMut, data: &[f32]);
    /// Like `write`, from f64 data into an f64 view, exactly (a step's small f64 constants).
    fn write_f64(&self, dst: ViewMut, data: &[f64]);
    /// A u32 tensor holding `data` (index tensors: token ids, routing).
    fn upload_u32(&self, data: &[u32], shape: &[usize], category: Category) -> Tensor;
    /// Host to device copy of indices into an existing u32 view (a step's tokens).
    fn write_u32(&self, dst: ViewMut, data: &[u32]);
    /// Device to host copy of a u32 view. A host read: inside a step only the per-expert
    /// counts of a MoE layer come back this way (they size the expert GEMMs and all-to-all).
    fn download_u32(&self, src: View) -> Vec<u32>;
    fn copy(&self, dst: ViewMut, src: View);
    fn fill(&self, dst: ViewMut, value: f32);
    /// Wait for queued work on every stream (a no-op on the CPU).
    fn synchronize(&self) {}

    /// Like `zeros`, but an allocation beyond the device's capacity is an error instead of a
    /// panic (whose message is the error's).
    fn try_zeros(&self, shape: &[usize], category: Category) -> Result<Tensor, MemoryError> {
        Ok(self.zeros(shape, category))
    }
    /// A zero-filled tensor in pinned (page-locked) host memory, charged to [`Device::Host`]:
    /// the end of asynchronous copies to and from the device. The CPU reads and writes it
    /// directly (e.g. an optimizer step on host-resident state) once its copies are waited for.
    fn pinned_zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.zeros(shape, category)
    }
    /// Like `pinned_zeros`, of `dtype` (bf16 boundaries of activation offload).
    fn pinned_zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        self.zeros_of(shape, dtype, category)
    }
    /// Copy `src` into `dst` on `stream` without waiting: device to host, host to device, or
    /// within one memory. `dst` may be used only after an event recorded on `stream` after this
    /// call has been waited on (`wait_event`, `synchronize_event`), and `src` must not be
    /// overwritten before then. Dropping either tensor meanwhile is allowed: the backend keeps
    /// the memory from reuse until the copy is done (stream-ordered free). Asynchronous only
    /// between device memory and pinned host memory; with ordinary host memory it completes
    /// before returning, as in CUDA.
    fn copy_async(&self, dst: ViewMut, src: View, stream: Stream) {
        let _ = stream;
        self.copy(dst, src)
    }
    /// Record an event on `stream`, after all work issued to it so far.
    fn record_event(&self, stream: Stream) -> Event {
        let _ = stream;
        Event::completed_now()
    }
    /// Make later work on `stream` wait until `event` has completed (without blocking the host,
    /// except for the compute stream of a backend whose kernels run on the calling thread).
    fn wait_event(&self, stream: Stream, event: &Event) {
        let _ = (stream, event);
    }
    /// Block the host until `event` has completed; the host may then use what it orders.
    fn synchronize_event(&self, event: &Event) {
        let _ = event;
    }
    /// Whether `event` has completed, without blocking.
    fn query_event(&self, event: &Event) -> bool {
        let _ = event;
        true
    }
    /// Time from `start` to `end` (waits for both to complete).
    fn elapsed(&self, start: &Event, end: &Event) -> Duration {
        Event::completed_elapsed(start, end).expect("events of another backend")
    }
    /// Start (or stop) keeping a [`CopySpan`] for each asynchronous copy, for the trace.
    fn trace_copies(&self, on: bool) {
        let _ = on;
    }
    /// The spans of copies finished since the last call (none on a backend whose copies are
    /// synchronous: they show inside the compute that issued them).
    fn take_copy_spans(&self) -> Vec<CopySpan> {
        Vec::new()
    }
    /// Start timing a step by phase ([`crate::phase`]): marks until
    /// [`Memory::take_phase_times`] are timed, others ignored. A backend without a clock
    /// ignores it.
    fn start_phases(&self) {}
    /// Work issued to the compute stream from now on is `p`'s. Returns the phase it replaces
    /// (`None` when the clock is not running or nothing was marked yet): [`in_phase`] restores
    /// it after a nested phase.
    fn phase(&self, p: StepPhase) -> Option<StepPhase> {
        let _ = p;
        None
    }
    /// End the step's clock: milliseconds per phase read so far, without waiting (`None` when
    /// the clock did not run).
    fn take_phase_times(&self) -> Option<PhaseTimes> {
        None
    }
    /// Run `body`'s work as graph `key` (a CUDA graph): the first call for a key captures
    /// what `body` issues on the compute stream and launches it; later calls launch that work
    /// again without calling `body`. So `body` must issue the same work every time: the same
    /// kernels on the same memory with the same arguments, no read and no host wait, and no
    /// host data whose bytes change from call to call (such data goes to the device before
    /// the call, into memory the body reads). A backend without graphs calls `body` every
    /// time ([`GraphRun::Eager`]); [`crate::graph_check::GraphCheck`] holds a body to these
    /// rules on such a backend.
    fn graph(&self, key: u64, body: &mut dyn FnMut()) -> GraphRun {
        let _ = key;
        body();
        GraphRun::Eager
    }
    /// Drop graph `key` (its owner is done with it): a later [`Memory::graph`] of that key
    /// captures afresh. Keys are the backend's, shared by everything that runs on it, so an
    /// owner takes keys of its own ([`graph_keys`]) and forgets them when it goes.
    fn forget_graph(&self, key: u64) {
        let _ = key;
    }
}

/// `n` graph keys no other caller of this function in the process gets (see
/// [`Memory::forget_graph`]): the first, and then the next `n - 1`.
pub fn graph_keys(n: u64) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(n, std::sync::atomic::Ordering::Relaxed)
}

/// How [`Memory::graph`] ran its body's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphRun {
    /// Issued as it came (no graphs on this backend).
    Eager,
    /// Captured into a new graph, which then ran.
    Captured,
    /// The graph captured before ran again; the body was not called.
    Replayed,
}

/// [`Memory`] methods that forward to a field, as [`crate::forward_nn_ops`] does for
/// [`NnOps`]: `forward_memory!(dev: device, ledger, …)` inside an `impl Memory` writes each named
/// method as `self.dev.method(args)`. A wrapper writes out only the methods it changes.
#[macro_export]
macro_rules! forward_memory {
    ($t:ident: $($m:ident),+ $(,)?) => { $( $crate::forward_memory!(@ $t $m); )+ };
    (@ $t:ident device) => { $crate::forward_memory!(@fn $t device() -> $crate::Device); };
    (@ $t:ident ledger) => { $crate::forward_memory!(@fn $t ledger() -> &std::sync::Arc<$crate::Ledger>); };
    (@ $t:ident zeros) => { $crate::forward_memory!(@fn $t zeros(shape: &[usize], category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident zeros_of) => { $crate::forward_memory!(@fn $t zeros_of(shape: &[usize], dtype: $crate::DType, category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident upload) => { $crate::forward_memory!(@fn $t upload(data: &[f32], shape: &[usize], category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident upload_f64) => { $crate::forward_memory!(@fn $t upload_f64(data: &[f64], shape: &[usize], category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident download) => { $crate::forward_memory!(@fn $t download(src: $crate::View) -> Vec<f32>); };
    (@ $t:ident download_f64) => { $crate::forward_memory!(@fn $t download_f64(src: $crate::View) -> Vec<f64>); };
    (@ $t:ident write) => { $crate::forward_memory!(@fn $t write(dst: $crate::ViewMut, data: &[f32]) -> ()); };
    (@ $t:ident write_f64) => { $crate::forward_memory!(@fn $t write_f64(dst: $crate::ViewMut, data: &[f64]) -> ()); };
    (@ $t:ident upload_u32) => { $crate::forward_memory!(@fn $t upload_u32(data: &[u32], shape: &[usize], category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident write_u32) => { $crate::forward_memory!(@fn $t write_u32(dst: $crate::ViewMut, data: &[u32]) -> ()); };
    (@ $t:ident download_u32) => { $crate::forward_memory!(@fn $t download_u32(src: $crate::View) -> Vec<u32>); };
    (@ $t:ident copy) => { $crate::forward_memory!(@fn $t copy(dst: $crate::ViewMut, src: $crate::View) -> ()); };
    (@ $t:ident fill) => { $crate::forward_memory!(@fn $t fill(dst: $crate::ViewMut, value: f32) -> ()); };
    (@ $t:ident synchronize) => { $crate::forward_memory!(@fn $t synchronize() -> ()); };
    (@ $t:ident try_zeros) => { $crate::forward_memory!(@fn $t try_zeros(shape: &[usize], category: $crate::Category) -> Result<$crate::Tensor, $crate::MemoryError>); };
    (@ $t:ident pinned_zeros) => { $crate::forward_memory!(@fn $t pinned_zeros(shape: &[usize], category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident pinned_zeros_of) => { $crate::forward_memory!(@fn $t pinned_zeros_of(shape: &[usize], dtype: $crate::DType, category: $crate::Category) -> $crate::Tensor); };
    (@ $t:ident copy_async) => { $crate::forward_memory!(@fn $t copy_async(dst: $crate::ViewMut, src: $crate::View, stream: $crate::Stream) -> ()); };
    (@ $t:ident record_event) => { $crate::forward_memory!(@fn $t record_event(stream: $crate::Stream) -> $crate::Event); };
    (@ $t:ident wait_event) => { $crate::forward_memory!(@fn $t wait_event(stream: $crate::Stream, event: &$crate::Event) -> ()); };
    (@ $t:ident synchronize_event) => { $crate::forward_memory!(@fn $t synchronize_event(event: &$crate::Event) -> ()); };
    (@ $t:ident query_event) => { $crate::forward_memory!(@fn $t query_event(event: &$crate::Event) -> bool); };
    (@ $t:ident elapsed) => { $crate::forward_memory!(@fn $t elapsed(start: &$crate::Event, end: &$crate::Event) -> std::time::Duration); };
    (@ $t:ident trace_copies) => { $crate::forward_memory!(@fn $t trace_copies(on: bool) -> ()); };
    (@ $t:ident take_copy_spans) => { $crate::forward_memory!(@fn $t take_copy_spans() -> Vec<$crate::CopySpan>); };
    (@ $t:ident start_phases) => { $crate::forward_memory!(@fn $t start_phases() -> ()); };
    (@ $t:ident phase) => { $crate::forward_memory!(@fn $t phase(p: $crate::StepPhase) -> Option<$crate::StepPhase>); };
    (@ $t:ident take_phase_times) => { $crate::forward_memory!(@fn $t take_phase_times() -> Option<$crate::PhaseTimes>); };
    (@ $t:ident graph) => { $crate::forward_memory!(@fn $t graph(key: u64, body: &mut dyn FnMut()) -> $crate::GraphRun); };
    (@ $t:ident forget_graph) => { $crate::forward_memory!(@fn $t forget_graph(key: u64) -> ()); };
    (@fn $t:ident $m:ident($($a:ident: $ty:ty),* $(,)?) -> $r:ty) => {
        fn $m(&self, $($a: $ty),*) -> $r {
            self.$t.$m($($a),*)
        }
    };
}

/// [`Blas`] methods that forward to a field, as [`crate::forward_memory`] does for [`Memory`]:
/// `forward_blas!(dev: gemm, syrk, …)` inside an `impl Blas` writes each named method as
/// `self.dev.method(args)` (a field's own method of that name: a BLAS library's, a kernel op's).
#[macro_export]
macro_rules! forward_blas {
    ($t:ident: $($m:ident),+ $(,)?) => { $( $crate::forward_blas!(@ $t $m); )+ };
    (@ $t:ident gemm) => { $crate::forward_blas!(@fn $t gemm(c: $crate::ViewMut, a: $crate::View, b: $crate::View, g: $crate::Gemm) -> ()); };
    (@ $t:ident syrk) => { $crate::forward_blas!(@fn $t syrk(c: $crate::ViewMut, a: $crate::View, s: $crate::Syrk) -> ()); };
    (@ $t:ident native_bf16) => { $crate::forward_blas!(@fn $t native_bf16() -> bool); };
    (@ $t:ident gemm_strided) => { $crate::forward_blas!(@fn $t gemm_strided(c: $crate::ViewMut, a: $crate::View, b: $crate::View, g: $crate::Gemm, batch: usize, strides: [usize; 3]) -> ()); };
    (@ $t:ident syrk_strided) => { $crate::forward_blas!(@fn $t syrk_strided(c: $crate::ViewMut, a: $crate::View, s: $crate::Syrk, batch: usize, strides: [usize; 2]) -> ()); };
    (@ $t:ident syrk_strided_into_bf16) => { $crate::forward_blas!(@fn $t syrk_strided_into_bf16(work: $crate::ViewMut, c16: $crate::ViewMut, a: $crate::View, s: $crate::Syrk, batch: usize, strides: [usize; 2]) -> ()); };
    (@ $t:ident batches_matrices) => { $crate::forward_blas!(@fn $t batches_matrices() -> bool); };
    (@ $t:ident axpy) => { $crate::forward_blas!(@fn $t axpy(y: $crate::ViewMut, alpha: f32, x: $crate::View) -> ()); };
    (@ $t:ident scale) => { $crate::forward_blas!(@fn $t scale(y: $crate::ViewMut, alpha: f32) -> ()); };
    (@ $t:ident add) => { $crate::forward_blas!(@fn $t add(y: $crate::ViewMut, x: $crate::View) -> ()); };
    (@ $t:ident sumsq) => { $crate::forward_blas!(@fn $t sumsq(x: $crate::View) -> f64); };
    (@ $t:ident sumsq_acc) => { $crate::forward_blas!(@fn $t sumsq_acc(acc: $crate::ViewMut, x: $crate::View) -> ()); };
    (@ $t:ident sumsq_acc_many) => { $crate::forward_blas!(@fn $t sumsq_acc_many(acc: $crate::ViewMut, xs: &[$crate::View]) -> ()); };
    (@ $t:ident cast) => { $crate::forward_blas!(@fn $t cast(dst: $crate::ViewMut, src: $crate::View) -> ()); };
    (@fn $t:ident $m:ident($($a:ident: $ty:ty),* $(,)?) -> $r:ty) => {
        #[allow(clippy::too_many_arguments)]
        fn $m(&self, $($a: $ty),*) -> $r {
            self.$t.$m($($a),*)
        }
    };
}

/// All of [`Memory`] for `forward_memory!` (a wrapper that changes nothing of it).
#[macro_export]
macro_rules! forward_all_memory {
    ($t:ident) => {
        $crate::forward_memory!($t:
            device, ledger, zeros, zeros_of, upload, upload_f64, download, download_f64, write,
            write_f64, upload_u32, write_u32, download_u32, copy, fill, synchronize, try_zeros,
            pinned_zeros, pinned_zeros_of, copy_async, record_event, wait_event,
            synchronize_event, query_event, elapsed, trace_copies, take_copy_spans,
            start_phases, phase, take_phase_times, graph, forget_graph,
        );
    };
}

/// Run `f` as phase `p`, then go back to the phase that ran before (a collective inside the
/// experts' phase, say).
pub fn in_phase<M: Memory + ?Sized, R>(be: &M, p: StepPhase, f: impl FnOnce() -> R) -> R {
    let prev = be.phase(p);
    let r = f();
    if let Some(prev) = prev {
        be.phase(prev);
    }
    r
}

/// Shape of one GEMM: `C[m,n] = alpha * op(A)[m,k] · op(B)[k,n] + beta * C`, all row-major with
/// leading dimensions (row strides) so that sub-matrices (one attention head's columns, say)
/// are views too. `op(A) = Aᵀ` when `trans_a`, where A is then stored `[k, m]`.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub alpha: f32,
    pub beta: f32,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    /// Mixed precision (`training.compute_dtype = "bf16"`): A and B enter the product rounded
    /// to bf16 (nearest even), products are accumulated in f32, and C is written in its dtype:
    /// f32, as cuBLAS's bf16 × bf16 → f32 GemmEx, or bf16, the f32 result rounded once, as its
    /// bf16 × bf16 → bf16 GemmEx (a bf16 C is written, never accumulated into: beta 0). The
    /// backend casts f32 operands into a reused scratch it owns (charged to the ledger as
    /// buffers); bf16 operands are taken as they are.
    pub bf16_inputs: bool,
    /// With `bf16_inputs`, a promise about A (`[0]`) and B (`[1]`): nothing has written the
    /// operand's view since a bf16-input GEMM on this backend last read it in the same position.
    /// A backend whose cast scratch for that position still holds that view's cast (it checks
    /// the view's place and length, see [`CastSlot`]) multiplies it instead of casting again;
    /// otherwise it casts as usual. The model promises where a GEMM reads what the GEMM before
    /// it read (the experts' `xe`, attention's normed rows, the logits' gradient; docs/cuda.md).
    pub unchanged: [bool; 2],
}

/// A grouped GEMM's [`Gemm::bf16_inputs`] and [`Gemm::unchanged`], which every group must share
/// (the operands are cast whole, once for all groups).
pub fn grouped_casts(groups: &[(Gemm, usize, usize, usize)]) -> (bool, [bool; 2]) {
    let first = groups
        .first()
        .map_or((false, [false; 2]), |(g, ..)| (g.bf16_inputs, g.unchanged));
    assert!(
        groups
            .iter()
            .all(|(g, ..)| (g.bf16_inputs, g.unchanged) == first),
        "grouped gemm: groups disagree on bf16 inputs or their promises"
    );
    first
}

/// Where a view's elements are, for [`CastSlot`]: its first element's address and its dtype.
fn view_place(v: &View) -> (usize, DType) {
    let at = match v {
        View::Host(s) => s.as_ptr() as usize,
        View::Host64(s) => s.as_ptr() as usize,
        View::HostBf16(s) => s.as_ptr() as usize,
        View::HostU32(s) => s.as_ptr() as usize,
        View::Device(d) => {
            let buf = d.buffer() as *const dyn crate::DeviceBuffer as *const u8 as usize;
            buf + d.offset() * d.dtype().size()
        }
    };
    (at, v.dtype())
}

/// A backend's cast scratch for one GEMM operand position under [`Gemm::bf16_inputs`]: the
/// tensor (grown to the longest operand seen, then reused) and what it holds, so that a call
/// promising [`Gemm::unchanged`] can use it as it is.
#[derive(Default)]
pub struct CastSlot {
    tensor: Option<Tensor>,
    /// The view the tensor's first `n` elements were cast from: (address, dtype, n).
    holds: Option<(usize, DType, usize)>,
}

impl CastSlot {
    /// The first `n` elements of `v` (at most its length) cast into the slot by `cast(tensor,
    /// n)`, the tensor first grown to `v.len()` elements by `alloc` if short (the old one freed
    /// first, so the ledger's peak holds one of them); nothing where `unchanged` is promised and
    /// the slot holds at least those elements of the same view, with room for all of `v`.
    pub fn cast_into(
        &mut self,
        v: &View,
        n: usize,
        unchanged: bool,
        alloc: impl FnOnce(usize) -> Tensor,
        cast: impl FnOnce(&mut Tensor, usize),
    ) {
        let n = n.min(v.len());
        let (at, dt) = view_place(v);
        let room = self.tensor.as_ref().is_some_and(|t| t.len() >= v.len());
        let held = matches!(self.holds, Some((a, d, m)) if a == at && d == dt && m >= n);
        if unchanged && room && held {
            return;
        }
        self.holds = None;
        if !room {
            self.tensor = None;
            self.tensor = Some(alloc(v.len()));
        }
        cast(self.tensor.as_mut().expect("cast slot"), n);
        self.holds = Some((at, dt, n));
    }
    /// The tensor's first `len` elements.
    pub fn view(&self, len: usize) -> View<'_> {
        self.tensor.as_ref().expect("cast slot").slice(0, len)
    }
}

/// Elements a row-major `rows × cols` operand with row stride `ld` spans (0 when empty).
pub fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

impl Gemm {
    /// Elements A, B and C span (row strides included; C's is 0 for an empty product).
    pub fn extents(&self) -> [usize; 3] {
        let (ar, ac) = if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (br, bc) = if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [
            extent(ar, ac, self.lda),
            extent(br, bc, self.ldb),
            extent(self.m, self.n, self.ldc),
        ]
    }
    /// Dense row-major GEMM with leading dimensions implied by the shapes, alpha 1, beta 0.
    pub fn new(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> Self {
        Gemm {
            m,
            n,
            k,
            trans_a,
            trans_b,
            alpha: 1.0,
            beta: 0.0,
            lda: if trans_a { m } else { k },
            ldb: if trans_b { k } else { n },
            ldc: n,
            bf16_inputs: false,
            unchanged: [false; 2],
        }
    }
    pub fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }
    pub fn beta(mut self, beta: f32) -> Self {
        self.beta = beta;
        self
    }
    /// bf16 operands with f32 accumulation when `on` (see [`Gemm::bf16_inputs`]).
    pub fn bf16_inputs(mut self, on: bool) -> Self {
        self.bf16_inputs = on;
        self
    }
    /// The promise of [`Gemm::unchanged`] for A and B.
    pub fn unchanged(mut self, a: bool, b: bool) -> Self {
        self.unchanged = [a, b];
        self
    }
    /// Override leading dimensions (strided sub-matrix views).
    pub fn ld(mut self, lda: usize, ldb: usize, ldc: usize) -> Self {
        self.lda = lda;
        self.ldb = ldb;
        self.ldc = ldc;
        self
    }
    pub fn flops(&self) -> u64 {
        2 * (self.m * self.n * self.k) as u64
    }
}

/// Shape of one symmetric rank-k product: `C[n,n] = alpha * op(A)·op(A)ᵀ + beta * C + diag * I`,
/// with `op(A) = A` stored `[n, k]` (`A·Aᵀ`), or `op(A) = Aᵀ` with A stored `[k, n]` (`Aᵀ·A`)
/// when `trans`. Row-major with leading dimensions, as [`Gemm`]. The result is symmetric, so a
/// backend may compute one triangle and mirror it: when `beta != 0`, C must hold a symmetric
/// matrix on entry (only its lower triangle is guaranteed to be read). On return both triangles
/// hold the result, bitwise mirrored.
#[derive(Clone, Copy, Debug)]
pub struct Syrk {
    pub n: usize,
    pub k: usize,
    pub trans: bool,
    pub alpha: f32,
    pub beta: f32,
    pub lda: usize,
    pub ldc: usize,
    /// Added to C's diagonal after the product: Newton–Schulz shifts by a multiple of the
    /// identity this way instead of copying whole matrices (`ganymede_optim::newton_schulz`).
    pub diag: f32,
    /// A enters the product rounded to bf16, with f32 accumulation and output, as
    /// [`Gemm::bf16_inputs`] (Newton–Schulz under `optimizer.ns_dtype = "bf16"`).
    pub bf16_inputs: bool,
}

impl Syrk {
    /// Dense product with leading dimensions implied by the shapes, alpha 1, beta 0.
    pub fn new(n: usize, k: usize, trans: bool) -> Self {
        Syrk {
            n,
            k,
            trans,
            alpha: 1.0,
            beta: 0.0,
            lda: if trans { n } else { k },
            ldc: n,
            diag: 0.0,
            bf16_inputs: false,
        }
    }
    pub fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }
    pub fn beta(mut self, beta: f32) -> Self {
        self.beta = beta;
        self
    }
    /// `diag · I` added to the result (see [`Syrk::diag`]).
    pub fn diag(mut self, diag: f32) -> Self {
        self.diag = diag;
        self
    }
    /// bf16 operand with f32 accumulation when `on` (see [`Syrk::bf16_inputs`]).
    pub fn bf16_inputs(mut self, on: bool) -> Self {
        self.bf16_inputs = on;
        self
    }
    /// Override leading dimensions (strided sub-matrix views).
    pub fn ld(mut self, lda: usize, ldc: usize) -> Self {
        self.lda = lda;
        self.ldc = ldc;
        self
    }
    /// Elements A spans and C spans (row strides included).
    pub fn extents(&self) -> [usize; 2] {
        let (rows, cols) = if self.trans {
            (self.k, self.n)
        } else {
            (self.n, self.k)
        };
        [
            extent(rows, cols, self.lda),
            extent(self.n, self.n, self.ldc),
        ]
    }
    /// The same product as a general GEMM (`A` passed as both operands, bf16 inputs carried
    /// over), without the diagonal term, which the caller adds.
    pub fn as_gemm(&self) -> Gemm {
        Gemm::new(self.n, self.n, self.k, self.trans, !self.trans)
            .alpha(self.alpha)
            .beta(self.beta)
            .ld(self.lda, self.lda, self.ldc)
            .bf16_inputs(self.bf16_inputs)
    }
}

pub trait Blas: Send + Sync {
    fn gemm(&self, c: ViewMut, a: View, b: View, g: Gemm);
    /// Symmetric rank-k product (see [`Syrk`]). The default is a full GEMM (bf16 inputs
    /// included, through [`Gemm::bf16_inputs`]), correct on any backend for `diag == 0`; a
    /// backend with a triangular kernel does about half the multiply-adds. Every backend here
    /// implements it, the diagonal term and bf16 inputs included.
    fn syrk(&self, c: ViewMut, a: View, s: Syrk) {
        assert!(
            s.diag == 0.0,
            "this backend's syrk has no diagonal term: {s:?}"
        );
        self.gemm(c, a, a, s.as_gemm())
    }
    /// Whether bf16 × bf16 → f32 products run natively here (a GPU's tensor cores), faster
    /// than f32 ones; `optimizer.ns_dtype = "auto"` picks bf16 where they do. The CPU backend
    /// only emulates them (rounding into f32 scratch), so the default is false.
    fn native_bf16(&self) -> bool {
        false
    }
    /// `batch` GEMMs of one shape `g`, the i-th reading A from element `i·strides[0]`, B from
    /// `i·strides[1]` and writing C from `i·strides[2]` (C blocks disjoint). The default is one
    /// [`Blas::gemm`] each, in order; a GPU makes it one call (see [`Blas::batches_matrices`]).
    fn gemm_strided(
        &self,
        mut c: ViewMut,
        a: View,
        b: View,
        g: Gemm,
        batch: usize,
        strides: [usize; 3],
    ) {
        let [la, lb, lc] = g.extents();
        for i in 0..batch {
            self.gemm(
                c.reborrow().slice(i * strides[2], lc),
                a.slice(i * strides[0], la),
                b.slice(i * strides[1], lb),
                g,
            );
        }
    }
    /// `batch` symmetric products of one shape `s` ([`Blas::syrk`]), the i-th reading A from
    /// element `i·strides[0]` and writing C from `i·strides[1]`. The default is one
    /// [`Blas::syrk`] each, in order.
    fn syrk_strided(&self, mut c: ViewMut, a: View, s: Syrk, batch: usize, strides: [usize; 2]) {
        let [la, lc] = s.extents();
        for i in 0..batch {
            self.syrk(
                c.reborrow().slice(i * strides[1], lc),
                a.slice(i * strides[0], la),
                s,
            );
        }
    }
    /// [`Blas::syrk_strided`] whose result is wanted in bf16: `c16` (bf16, laid out as the f32
    /// `work`) = each product, diagonal term included, rounded once to bf16, the bits of a
    /// strided syrk into `work` followed by [`Blas::cast`]. `work` may be left holding anything.
    /// Newton–Schulz keeps its iterates in bf16 this way (issue 32). The default is exactly
    /// those two calls; a GPU mirrors, adds the diagonal and rounds in one kernel.
    fn syrk_strided_into_bf16(
        &self,
        mut work: ViewMut,
        mut c16: ViewMut,
        a: View,
        s: Syrk,
        batch: usize,
        strides: [usize; 2],
    ) {
        if batch == 0 {
            return;
        }
        assert_eq!(
            c16.dtype(),
            DType::BF16,
            "syrk_strided_into_bf16: c16 is bf16"
        );
        let len = (batch - 1) * strides[1] + s.extents()[1];
        self.syrk_strided(work.reborrow(), a, s, batch, strides);
        self.cast(c16.reborrow().slice(0, len), work.as_view().slice(0, len));
    }
    /// Whether one call over many matrices beats a call each (a GPU, where every call costs a
    /// kernel launch and small products leave most of the chip idle): Muon then runs an expert
    /// stack's Newton–Schulz through [`Blas::gemm_strided`] and [`Blas::syrk_strided`]. False
    /// on the CPU, whose threads are better spread over whole matrices.
    fn batches_matrices(&self) -> bool {
        false
    }
    /// `y += alpha * x`
    fn axpy(&self, y: ViewMut, alpha: f32, x: View);
    /// `y *= alpha`
    fn scale(&self, y: ViewMut, alpha: f32);
    /// `y += x` elementwise (residual connections).
    fn add(&self, y: ViewMut, x: View) {
        self.axpy(y, 1.0, x)
    }
    /// Σ x², accumulated in f64. A host read: inside a step use [`Blas::sumsq_acc`].
    fn sumsq(&self, x: View) -> f64;
    /// `acc[0] += Σ x²`, with `acc` an f64 tensor, so a step sums many tensors and reads the
    /// total once at its end.
    fn sumsq_acc(&self, acc: ViewMut, x: View);
    /// [`Blas::sumsq_acc`] of each of `xs` in turn (a step's gradients): a GPU backend does them
    /// all in a few launches.
    fn sumsq_acc_many(&self, mut acc: ViewMut, xs: &[View]) {
        for &x in xs {
            self.sumsq_acc(acc.reborrow(), x);
        }
    }
    /// `dst = src` converted to `dst`'s dtype: to bf16 rounding to nearest even (NaN stays NaN),
    /// from bf16 exactly (FSDP's bf16 gathers: cast the shard, gather, cast back).
    fn cast(&self, dst: ViewMut, src: View);
}

/// Everything a training step needs from a device.
pub trait Backend: Memory + Blas + NnOps + OptimOps {}
impl<B: Memory + Blas + NnOps + OptimOps> Backend for B {}

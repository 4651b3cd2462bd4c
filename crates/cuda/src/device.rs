//! The device through cudarc: a context, one CUDA stream per seam [`Stream`], events, pinned
//! host memory, asynchronous copies, NVRTC-compiled kernels and a cuBLAS handle on the compute
//! stream. [`CudaBackend`] implements [`Memory`] fully and [`Blas`] (GEMMs through cuBLAS);
//! the model's kernels (`NnOps`, `OptimOps`) are still to come, so training refuses this device.
//!
//! Ordering is the seam's, not cudarc's: cudarc's per-slice event tracking is turned off, and
//! code above the seam orders streams with [`Memory::record_event`]/[`Memory::wait_event`].
//! The one thing the backend adds is stream-ordered free: device memory used by a copy on
//! another stream is freed on the compute stream only after that stream's work so far.

pub mod check;
pub mod nvrtc;
pub mod probe;

pub use probe::{probe, probe_nvrtc, ProbeError};

use crate::cublas_map::{map_gemm, map_gemm_strided_batched, map_syrk, CublasGemm, Operand};
use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use ganymede_core::{
    bf16, Blas, Category, CopySpan, DType, Device, DeviceBuffer, Event, Gemm, Ledger, Memory,
    MemoryError, Stream, Syrk, Tensor, View, ViewMut,
};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why the device could not be set up.
#[derive(Debug)]
pub enum DeviceError {
    Probe(ProbeError),
    Driver { what: String, error: String },
    Compile(nvrtc::CompileError),
    Cublas { what: String, error: String },
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceError::Probe(e) => e.fmt(f),
            DeviceError::Driver { what, error } => write!(f, "CUDA {what}: {error}"),
            DeviceError::Compile(e) => e.fmt(f),
            DeviceError::Cublas { what, error } => write!(f, "cuBLAS {what}: {error}"),
        }
    }
}

impl std::error::Error for DeviceError {}

impl From<ProbeError> for DeviceError {
    fn from(e: ProbeError) -> Self {
        DeviceError::Probe(e)
    }
}

fn driver(what: &str) -> impl FnOnce(DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Driver {
        what: what.to_string(),
        error: probe::driver_error(&e),
    }
}

/// Inside the seam's infallible operations a driver error is a bug or a lost device: panic
/// with what was being done.
fn ok<T>(r: Result<T, DriverError>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what}: {}", probe::driver_error(&e)))
}

/// The backend's own small kernels (casts, the f64 sum of squares, syrk's mirror), beside the model's in `sources::SOURCES`.
pub const PLUMBING: (&str, &str) = (
    "ganymede_plumbing.cu",
    r#"
// f32 to bf16 rounding to nearest even; NaN stays NaN (quieted, sign kept), as
// ganymede_core::bf16::from_f32 does bit for bit.
extern "C" __global__ void ganymede_cast_f32_to_bf16(unsigned short* dst, const float* src,
                                                     unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned int b = __float_as_uint(src[i]);
        if ((b & 0x7fffffffu) > 0x7f800000u) {
            dst[i] = (unsigned short)((b >> 16) | 0x40u);
        } else {
            dst[i] = (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
        }
    }
}

// acc[0] += sum of x[i]^2 in f64 (the gradient norm's accumulator): a grid-stride sum per
// thread, a tree in shared memory per block (blockDim.x = 256), one atomic per block.
__device__ void ganymede_block_add(double* acc, double s) {
    __shared__ double part[256];
    part[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(acc, part[0]);
}

extern "C" __global__ void ganymede_sumsq_acc_f32(double* acc, const float* x,
                                                  unsigned long long n) {
    double s = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        double v = x[i];
        s += v * v;
    }
    ganymede_block_add(acc, s);
}

extern "C" __global__ void ganymede_sumsq_acc_bf16(double* acc, const unsigned short* x,
                                                   unsigned long long n) {
    double s = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        double v = __uint_as_float(((unsigned int)x[i]) << 16);
        s += v * v;
    }
    ganymede_block_add(acc, s);
}

// Row-major C [n, n] with row stride ldc: the strictly lower triangle copied onto the upper one
// (cuBLAS's syrk writes one triangle; the seam wants both).
extern "C" __global__ void ganymede_mirror_lower_f32(float* c, unsigned long long n,
                                                     unsigned long long ldc) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n * n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long r = i / n, col = i % n;
        if (r > col) c[col * ldc + r] = c[r * ldc + col];
    }
}

extern "C" __global__ void ganymede_cast_bf16_to_f32(float* dst, const unsigned short* src,
                                                     unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = __uint_as_float(((unsigned int)src[i]) << 16);
    }
}
"#,
);

/// The four CUDA streams, indexed by [`Stream::index`].
pub struct Streams {
    streams: [Arc<CudaStream>; 4],
}

impl Streams {
    pub fn get(&self, s: Stream) -> &Arc<CudaStream> {
        &self.streams[s.index()]
    }
}

/// Which streams other than compute a buffer was used on (bit per [`Stream::index`]).
struct Uses(AtomicU8);

impl Uses {
    fn mark(&self, s: Stream) {
        self.0.fetch_or(1 << s.index(), Ordering::Relaxed);
    }
    fn others(&self) -> impl Iterator<Item = Stream> + '_ {
        let bits = self.0.load(Ordering::Relaxed);
        Stream::ALL
            .into_iter()
            .filter(move |s| *s != Stream::Compute && bits & (1 << s.index()) != 0)
    }
}

/// Device memory: `len` elements of `dtype`, allocated (and freed) on the compute stream.
pub struct DeviceMemory {
    _slice: CudaSlice<u8>,
    addr: u64,
    dtype: DType,
    len: usize,
    uses: Uses,
    streams: Arc<Streams>,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // Stream-ordered free: the slice is freed on the compute stream (cudarc's drop), so make
        // compute wait for the other streams that used it, as far as they have been issued.
        let compute = self.streams.get(Stream::Compute);
        // cudarc's free does not make the context current; a tensor may drop on any thread.
        let _ = compute.context().bind_to_thread();
        for s in self.uses.others() {
            let stream = self.streams.get(s);
            if let Ok(ev) = stream.record_event(None) {
                let _ = compute.wait(&ev);
            }
        }
    }
}

impl DeviceBuffer for DeviceMemory {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn describe(&self) -> String {
        format!(
            "CUDA device memory, {} {} elements",
            self.dtype.name(),
            self.len
        )
    }
}

/// Page-locked host memory (not write-combined: the CPU reads it), the end of asynchronous
/// copies to and from the device.
pub struct PinnedMemory {
    _slice: PinnedHostSlice<u8>,
    ptr: *mut u8,
    dtype: DType,
    len: usize,
    uses: Uses,
    streams: Arc<Streams>,
}

// SAFETY: `ptr` points into `_slice`'s allocation, which lives as long as this value; access is
// ordered by the seam's events like any other memory of the backend.
unsafe impl Send for PinnedMemory {}
unsafe impl Sync for PinnedMemory {}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        // Host memory cannot be freed in stream order: wait for the streams that copied it.
        let _ = self.streams.get(Stream::Compute).context().bind_to_thread();
        for s in Stream::ALL {
            if s == Stream::Compute || self.uses.others().any(|o| o == s) {
                let _ = self.streams.get(s).synchronize();
            }
        }
    }
}

impl DeviceBuffer for PinnedMemory {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn host_ptr(&self, _write: bool) -> Option<*mut u8> {
        Some(self.ptr)
    }
    fn describe(&self) -> String {
        format!(
            "CUDA pinned host memory, {} {} elements",
            self.dtype.name(),
            self.len
        )
    }
}

/// The seam's event: a CUDA event made with timing, so `elapsed` works on any pair.
struct SeamEvent(CudaEvent);

/// Where a view's memory is, for copies (unified addressing: one address space for both).
struct Place<'a> {
    addr: u64,
    bytes: usize,
    dtype: DType,
    len: usize,
    uses: Option<&'a Uses>,
    on_device: bool,
}

fn place_of_buffer(buf: &dyn DeviceBuffer, offset: usize, len: usize) -> Place<'_> {
    let size = buf.dtype().size();
    if let Some(d) = buf.as_any().downcast_ref::<DeviceMemory>() {
        return Place {
            addr: d.addr + (offset * size) as u64,
            bytes: len * size,
            dtype: d.dtype,
            len,
            uses: Some(&d.uses),
            on_device: true,
        };
    }
    if let Some(p) = buf.as_any().downcast_ref::<PinnedMemory>() {
        return Place {
            addr: p.ptr as u64 + (offset * size) as u64,
            bytes: len * size,
            dtype: p.dtype,
            len,
            uses: Some(&p.uses),
            on_device: false,
        };
    }
    panic!(
        "the CUDA backend was given memory of another backend: {}",
        buf.describe()
    )
}

fn place<'a>(v: &View<'a>) -> Place<'a> {
    let host = |addr: u64, len: usize, dtype: DType| Place {
        addr,
        bytes: len * dtype.size(),
        dtype,
        len,
        uses: None,
        on_device: false,
    };
    match *v {
        View::Host(s) => host(s.as_ptr() as u64, s.len(), DType::F32),
        View::Host64(s) => host(s.as_ptr() as u64, s.len(), DType::F64),
        View::HostBf16(s) => host(s.as_ptr() as u64, s.len(), DType::BF16),
        View::Device(d) => place_of_buffer(d.buffer(), d.offset(), d.len()),
    }
}

fn place_mut<'a>(v: &mut ViewMut<'a>) -> Place<'a> {
    let host = |addr: u64, len: usize, dtype: DType| Place {
        addr,
        bytes: len * dtype.size(),
        dtype,
        len,
        uses: None,
        on_device: false,
    };
    match v {
        ViewMut::Device(d) => place_of_buffer(d.buffer(), d.offset(), d.len()),
        ViewMut::Host(s) => host(s.as_mut_ptr() as u64, s.len(), DType::F32),
        ViewMut::Host64(s) => host(s.as_mut_ptr() as u64, s.len(), DType::F64),
        ViewMut::HostBf16(s) => host(s.as_mut_ptr() as u64, s.len(), DType::BF16),
    }
}

/// Kernels loaded into the context, looked up by name (cached).
struct Kernels {
    modules: Vec<Arc<CudaModule>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

/// The CUDA backend on one GPU.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    streams: Arc<Streams>,
    blas: CudaBlas,
    kernels: Kernels,
    ledger: Arc<Ledger>,
    ordinal: u16,
    arch: String,
    name: String,
    trace: Mutex<Option<CopyTrace>>,
}

/// Asynchronous copies being timed for the trace: events around each, placed on the host clock
/// through one base event whose host time is known.
struct CopyTrace {
    base: CudaEvent,
    base_at: Instant,
    pending: Vec<(Stream, CudaEvent, CudaEvent, u64)>,
}

impl CudaBackend {
    /// Probe, then set up GPU `ordinal`: context, streams, cuBLAS, and every kernel of
    /// `sources::SOURCES` (plus the backend's own) compiled by NVRTC for its architecture.
    pub fn new(ordinal: usize, ledger: Arc<Ledger>) -> Result<Self, DeviceError> {
        probe()?;
        let ctx = CudaContext::new(ordinal).map_err(driver("context"))?;
        // SAFETY: the seam orders every use across streams with its events (see module doc),
        // and this backend frees memory in stream order itself.
        unsafe { ctx.disable_event_tracking() };
        let mk = || ctx.new_stream().map_err(driver("stream"));
        let streams = Arc::new(Streams {
            streams: [mk()?, mk()?, mk()?, mk()?],
        });
        let blas = CudaBlas::new(streams.get(Stream::Compute).clone()).map_err(|e| {
            DeviceError::Cublas {
                what: "handle".into(),
                error: e.to_string(),
            }
        })?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name().unwrap_or_else(|_| "an NVIDIA GPU".into());
        let mut sources: Vec<(&str, &str)> = crate::sources::SOURCES.to_vec();
        sources.push(PLUMBING);
        let compiled = nvrtc::compile_all_once(&sources, &arch);
        let compiled = compiled
            .as_ref()
            .as_ref()
            .map_err(|e| DeviceError::Compile(e.clone()))?;
        let modules = compiled
            .iter()
            .map(|c| {
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin.clone()))
                    .map_err(driver(&format!("loading {}", c.file)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CudaBackend {
            ctx,
            streams,
            blas,
            kernels: Kernels {
                modules,
                functions: Mutex::new(HashMap::new()),
            },
            ledger,
            ordinal: ordinal as u16,
            arch,
            name,
            trace: Mutex::new(None),
        })
    }

    /// `sm_XY` of the device.
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// The device's name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self, s: Stream) -> &Arc<CudaStream> {
        self.streams.get(s)
    }
    /// Number of kernel files loaded (the model's and the backend's own).
    pub fn modules(&self) -> usize {
        self.kernels.modules.len()
    }

    /// A kernel of any loaded file, by its (`extern "C"`) name.
    pub fn function(&self, name: &str) -> Result<CudaFunction, DeviceError> {
        let mut cache = self
            .kernels
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        for m in &self.kernels.modules {
            if let Ok(f) = m.load_function(name) {
                cache.insert(name.to_string(), f.clone());
                return Ok(f);
            }
        }
        Err(DeviceError::Driver {
            what: format!("kernel {name}"),
            error: "not in any loaded source".into(),
        })
    }

    fn compute(&self) -> &Arc<CudaStream> {
        self.streams.get(Stream::Compute)
    }

    /// Make the context current on this thread before a raw driver or cuBLAS call (cudarc's own
    /// methods do this themselves); rank threads and copy helpers call in from anywhere.
    fn bind(&self) {
        ok(self.ctx.bind_to_thread(), "binding the context");
    }

    /// Device memory of `len` elements of `dtype`, zeroed on the compute stream.
    fn alloc(&self, len: usize, dtype: DType) -> Result<DeviceMemory, DriverError> {
        let bytes = len * dtype.size();
        let compute = self.compute();
        // SAFETY: zeroed below before anything reads it; cuMemAlloc rejects 0 bytes.
        let slice = unsafe { compute.alloc::<u8>(bytes.max(1)) }?;
        let (addr, _) = slice.device_ptr(compute);
        // SAFETY: `addr` is this allocation, `bytes` within it.
        unsafe { sys::cuMemsetD8Async(addr, 0, bytes, compute.cu_stream()) }.result()?;
        Ok(DeviceMemory {
            _slice: slice,
            addr,
            dtype,
            len,
            uses: Uses(AtomicU8::new(0)),
            streams: self.streams.clone(),
        })
    }

    fn try_alloc_tensor(
        &self,
        shape: &[usize],
        dtype: DType,
        category: Category,
    ) -> Result<Tensor, MemoryError> {
        let len: usize = shape.iter().product();
        match self.alloc(len, dtype) {
            Ok(m) => Ok(Tensor::from_buffer(
                ganymede_core::Buffer::Device(Box::new(m)),
                shape,
                self.device(),
                category,
                self.ledger.clone(),
            )),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
                Err(MemoryError::OutOfMemory {
                    device: self.device(),
                    category,
                    requested: (len * dtype.size()) as u64,
                    in_use: (total - free) as u64,
                    capacity: total as u64,
                })
            }
            Err(e) => panic!("CUDA allocation: {}", probe::driver_error(&e)),
        }
    }

    /// `cuMemcpyAsync` between two places on `stream` (any direction: unified addressing).
    fn memcpy(&self, dst: &Place, src: &Place, stream: Stream) {
        assert_eq!(
            (dst.dtype, dst.len),
            (src.dtype, src.len),
            "copy between views of different dtype or length"
        );
        if src.bytes == 0 {
            return;
        }
        for p in [dst, src] {
            if let Some(u) = p.uses {
                u.mark(stream);
            }
        }
        let s = self.streams.get(stream);
        self.bind();
        // SAFETY: both ranges were checked against their buffers when the views were made; the
        // seam's rules keep them alive and unaliased until the copy is ordered.
        ok(
            unsafe { sys::cuMemcpyAsync(dst.addr, src.addr, src.bytes, s.cu_stream()) }.result(),
            "copy",
        );
    }

    fn sync_compute(&self) {
        ok(self.compute().synchronize(), "synchronize");
    }

    /// Copy a view into a host vector of its own dtype (blocking, on the compute stream).
    fn read_raw<T: Default + Clone>(&self, src: &View, dtype: DType) -> Vec<T> {
        let p = place(src);
        assert_eq!(p.dtype, dtype);
        let mut out = vec![T::default(); p.len];
        let dst = Place {
            addr: out.as_mut_ptr() as u64,
            bytes: p.bytes,
            dtype,
            len: p.len,
            uses: None,
            on_device: false,
        };
        self.memcpy(&dst, &p, Stream::Compute);
        self.sync_compute();
        out
    }

    /// Copy host data of the view's dtype into it (blocking, on the compute stream).
    fn write_raw<T>(&self, dst: &mut ViewMut, data: &[T], dtype: DType) {
        let p = place_mut(dst);
        let src = Place {
            addr: data.as_ptr() as u64,
            bytes: std::mem::size_of_val(data),
            dtype,
            len: data.len(),
            uses: None,
            on_device: false,
        };
        self.memcpy(&p, &src, Stream::Compute);
        self.sync_compute();
    }

    /// Launch one of the backend's own kernels, whose arguments are three 64-bit values
    /// (pointers and counts), over `n` elements with 256-thread blocks.
    fn launch3(&self, kernel: &str, args: [u64; 3], n: usize) {
        let f = self.function(kernel).unwrap_or_else(|e| panic!("{e}"));
        let blocks = (n as u64).div_ceil(256).clamp(1, 4096) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.compute().launch_builder(&f);
        b.arg(&args[0]).arg(&args[1]).arg(&args[2]);
        // SAFETY: each of these kernels takes (pointer, pointer or count, count) as 64-bit
        // values, and the callers pass ranges that hold what the kernel touches.
        ok(unsafe { b.launch(cfg) }.map(|_| ()), kernel);
    }
}

impl CudaBackend {
    /// `batch` GEMMs of one shape, the i-th on elements `i · stride_*` on of each operand (an
    /// expert stack: experts' weights at a fixed stride, their tokens sorted into equal slots),
    /// as one `cublasGemmStridedBatchedEx` instead of `batch` launches. Dtypes as [`Blas::gemm`];
    /// f32 accumulation.
    pub fn gemm_strided_batched(
        &self,
        mut c: ViewMut,
        a: View,
        b: View,
        g: Gemm,
        batch: usize,
        strides: [usize; 3],
    ) {
        if g.m == 0 || g.n == 0 || batch == 0 {
            return;
        }
        let [sa, sb, sc] = strides;
        let (a_rows, a_cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let last = batch - 1;
        assert!(
            a.len() >= last * sa + extent(a_rows, a_cols, g.lda),
            "batched gemm: A too small"
        );
        assert!(
            b.len() >= last * sb + extent(b_rows, b_cols, g.ldb),
            "batched gemm: B too small"
        );
        assert!(
            c.len() >= last * sc + extent(g.m, g.n, g.ldc),
            "batched gemm: C too small"
        );
        assert!(
            sc >= extent(g.m, g.n, g.ldc),
            "batched gemm: the outputs overlap"
        );
        let (call, st) = map_gemm_strided_batched(&g, batch, sa, sb, sc)
            .unwrap_or_else(|e| panic!("batched gemm {g:?}: {e}"));
        let (pa, pb, pc) = (place(&a), place(&b), place_mut(&mut c));
        assert!(
            pa.on_device && pb.on_device && pc.on_device,
            "gemm on memory the device does not hold"
        );
        let addr = |o: Operand| match o {
            Operand::A => pa.addr,
            Operand::B => pb.addr,
        };
        let ty = |d: DType| match d {
            DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
            DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            DType::F64 => panic!("no CUDA gemm in f64"),
        };
        assert!(
            pa.dtype == pb.dtype && (pc.dtype == DType::F32 || pc.dtype == pa.dtype),
            "no CUDA gemm for {} × {} → {}",
            pa.dtype.name(),
            pb.dtype.name(),
            pc.dtype.name()
        );
        let (alpha, beta) = (call.alpha, call.beta);
        self.bind();
        // SAFETY: every matrix of the batch was checked against its view above; the handle is
        // bound to the compute stream.
        cublas(
            unsafe {
                cudarc::cublas::result::gemm_strided_batched_ex(
                    *self.blas.handle(),
                    op(call.transa),
                    op(call.transb),
                    call.m,
                    call.n,
                    call.k,
                    &alpha as *const f32 as *const _,
                    addr(call.operands[0]) as *const _,
                    ty(pa.dtype),
                    call.lda,
                    st.stride_a,
                    addr(call.operands[1]) as *const _,
                    ty(pb.dtype),
                    call.ldb,
                    st.stride_b,
                    &beta as *const f32 as *const _,
                    pc.addr as *mut _,
                    ty(pc.dtype),
                    call.ldc,
                    st.stride_c,
                    st.batch,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            },
            "gemmStridedBatchedEx",
        )
    }
}

fn to_f32(dtype: DType, be: &CudaBackend, src: &View) -> Vec<f32> {
    match dtype {
        DType::F32 => be.read_raw::<f32>(src, DType::F32),
        DType::BF16 => bf16::to_f32_slice(&be.read_raw::<u16>(src, DType::BF16)),
        DType::F64 => be
            .read_raw::<f64>(src, DType::F64)
            .into_iter()
            .map(|x| x as f32)
            .collect(),
    }
}

impl Memory for CudaBackend {
    fn device(&self) -> Device {
        Device::Gpu(self.ordinal)
    }
    fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.zeros_of(shape, DType::F32, category)
    }
    fn zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        self.try_alloc_tensor(shape, dtype, category)
            .unwrap_or_else(|e| panic!("{e}"))
    }
    fn try_zeros(&self, shape: &[usize], category: Category) -> Result<Tensor, MemoryError> {
        self.try_alloc_tensor(shape, DType::F32, category)
    }
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor {
        let mut t = self.zeros(shape, category);
        self.write(t.view_mut(), data);
        t
    }
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor {
        // The backend computes in f32; f64 data is rounded, as its kernels would.
        let v: Vec<f32> = data.iter().map(|&x| x as f32).collect();
        self.upload(&v, shape, category)
    }
    fn download(&self, src: View) -> Vec<f32> {
        to_f32(src.dtype(), self, &src)
    }
    fn download_f64(&self, src: View) -> Vec<f64> {
        match src.dtype() {
            DType::F64 => self.read_raw::<f64>(&src, DType::F64),
            d => to_f32(d, self, &src).into_iter().map(f64::from).collect(),
        }
    }
    fn write(&self, mut dst: ViewMut, data: &[f32]) {
        assert_eq!(dst.len(), data.len(), "write of a different length");
        match dst.dtype() {
            DType::F32 => self.write_raw(&mut dst, data, DType::F32),
            DType::BF16 => self.write_raw(&mut dst, &bf16::from_f32_slice(data), DType::BF16),
            DType::F64 => {
                let v: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
                self.write_raw(&mut dst, &v, DType::F64)
            }
        }
    }
    fn copy(&self, mut dst: ViewMut, src: View) {
        self.memcpy(&place_mut(&mut dst), &place(&src), Stream::Compute)
    }
    fn fill(&self, mut dst: ViewMut, value: f32) {
        let p = place_mut(&mut dst);
        if !p.on_device || p.len == 0 {
            // Pinned or ordinary host memory: filled by the CPU once compute is done with it.
            self.sync_compute();
            let v = vec![value; p.len];
            return self.write(dst, &v);
        }
        let s = self.compute().cu_stream();
        self.bind();
        // SAFETY: the range is the view's, inside its allocation.
        let r = unsafe {
            match p.dtype {
                DType::F32 => sys::cuMemsetD32Async(p.addr, value.to_bits(), p.len, s),
                DType::BF16 => sys::cuMemsetD16Async(p.addr, bf16::from_f32(value), p.len, s),
                DType::F64 if value == 0.0 => sys::cuMemsetD8Async(p.addr, 0, p.bytes, s),
                DType::F64 => {
                    let v = vec![f64::from(value); p.len];
                    self.write_raw(&mut dst, &v, DType::F64);
                    sys::CUresult::CUDA_SUCCESS
                }
            }
        };
        ok(r.result(), "fill");
    }
    fn synchronize(&self) {
        ok(self.ctx.synchronize(), "synchronize");
    }
    fn pinned_zeros(&self, shape: &[usize], category: Category) -> Tensor {
        let len: usize = shape.iter().product();
        let dtype = DType::F32;
        let bytes = (len * dtype.size()).max(1);
        // Flags 0: not write-combined, so CPU reads of offloaded state are cached reads.
        // SAFETY: zeroed below before anything reads it.
        let mut slice = ok(
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) },
            "pinned allocation",
        );
        let ptr = ok(slice.as_mut_ptr(), "pinned pointer");
        // SAFETY: `bytes` bytes were just allocated at `ptr`.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        let m = PinnedMemory {
            _slice: slice,
            ptr,
            dtype,
            len,
            uses: Uses(AtomicU8::new(0)),
            streams: self.streams.clone(),
        };
        Tensor::from_buffer(
            ganymede_core::Buffer::Device(Box::new(m)),
            shape,
            Device::Host,
            category,
            self.ledger.clone(),
        )
    }
    fn copy_async(&self, mut dst: ViewMut, src: View, stream: Stream) {
        let (pd, ps) = (place_mut(&mut dst), place(&src));
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = trace.as_mut() else {
            drop(trace);
            return self.memcpy(&pd, &ps, stream);
        };
        let s = self.streams.get(stream);
        let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = ok(s.record_event(timed), "trace event");
        self.memcpy(&pd, &ps, stream);
        let end = ok(s.record_event(timed), "trace event");
        t.pending.push((stream, start, end, ps.bytes as u64));
    }
    fn trace_copies(&self, on: bool) {
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        *trace = on.then(|| {
            // The base event completes when the host waits for it; its host time is then known
            // to within the wait's return, and copies are placed relative to it.
            let base = ok(
                self.compute()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
                "trace event",
            );
            ok(base.synchronize(), "trace event");
            CopyTrace {
                base,
                base_at: Instant::now(),
                pending: Vec::new(),
            }
        });
    }
    fn take_copy_spans(&self) -> Vec<CopySpan> {
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = trace.as_mut() else {
            return Vec::new();
        };
        let at = |e: &CudaEvent| {
            let ms = ok(t.base.elapsed_ms(e), "trace elapsed");
            t.base_at + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)
        };
        let mut spans = Vec::new();
        let mut still = Vec::new();
        for (stream, start, end, bytes) in std::mem::take(&mut t.pending) {
            if ok(end.try_is_complete(), "trace query") {
                spans.push(CopySpan {
                    stream,
                    start: at(&start),
                    end: at(&end),
                    bytes,
                });
            } else {
                still.push((stream, start, end, bytes));
            }
        }
        t.pending = still;
        spans
    }
    fn record_event(&self, stream: Stream) -> Event {
        let ev = ok(
            self.streams
                .get(stream)
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
            "event record",
        );
        Event::new(SeamEvent(ev))
    }
    fn wait_event(&self, stream: Stream, event: &Event) {
        ok(
            self.streams.get(stream).wait(&seam_event(event).0),
            "event wait",
        );
    }
    fn synchronize_event(&self, event: &Event) {
        ok(seam_event(event).0.synchronize(), "event synchronize");
    }
    fn query_event(&self, event: &Event) -> bool {
        ok(seam_event(event).0.try_is_complete(), "event query")
    }
    fn elapsed(&self, start: &Event, end: &Event) -> Duration {
        let ms = ok(
            seam_event(start).0.elapsed_ms(&seam_event(end).0),
            "elapsed",
        );
        Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)
    }
}

fn seam_event(e: &Event) -> &SeamEvent {
    e.downcast::<SeamEvent>()
        .expect("an event recorded by another backend")
}

/// Bytes a row-major `rows × cols` operand with row stride `ld` spans.
fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

fn cublas(r: Result<(), cudarc::cublas::result::CublasError>, what: &str) {
    r.unwrap_or_else(|e| panic!("cuBLAS {what}: {e}"))
}

fn op(t: bool) -> blas_sys::cublasOperation_t {
    if t {
        blas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

impl Blas for CudaBackend {
    /// f32 × f32 → f32 with `cublasSgemm`; bf16 × bf16 → f32 or bf16 with `cublasGemmEx`,
    /// accumulating in f32 (FSDP2's mixed precision).
    fn gemm(&self, mut c: ViewMut, a: View, b: View, g: Gemm) {
        if g.m == 0 || g.n == 0 {
            return;
        }
        let (a_rows, a_cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        assert!(
            a.len() >= extent(a_rows, a_cols, g.lda),
            "gemm: A too small {g:?}"
        );
        assert!(
            b.len() >= extent(b_rows, b_cols, g.ldb),
            "gemm: B too small {g:?}"
        );
        assert!(
            c.len() >= extent(g.m, g.n, g.ldc),
            "gemm: C too small {g:?}"
        );
        let call: CublasGemm = map_gemm(&g).unwrap_or_else(|e| panic!("gemm {g:?}: {e}"));
        let (pa, pb, pc) = (place(&a), place(&b), place_mut(&mut c));
        assert!(
            pa.on_device && pb.on_device && pc.on_device,
            "gemm on memory the device does not hold"
        );
        let addr = |o: Operand| match o {
            Operand::A => pa.addr,
            Operand::B => pb.addr,
        };
        let (first, second) = (addr(call.operands[0]), addr(call.operands[1]));
        let h = *self.blas.handle();
        self.bind();
        let (alpha, beta) = (call.alpha, call.beta);
        match (pa.dtype, pb.dtype, pc.dtype) {
            (DType::F32, DType::F32, DType::F32) => cublas(
                // SAFETY: extents checked above; the handle is bound to the compute stream.
                unsafe {
                    cudarc::cublas::result::sgemm(
                        h,
                        op(call.transa),
                        op(call.transb),
                        call.m,
                        call.n,
                        call.k,
                        &alpha,
                        first as *const f32,
                        call.lda,
                        second as *const f32,
                        call.ldb,
                        &beta,
                        pc.addr as *mut f32,
                        call.ldc,
                    )
                },
                "sgemm",
            ),
            (DType::BF16, DType::BF16, out @ (DType::F32 | DType::BF16)) => {
                let ty = |d: DType| match d {
                    DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
                    _ => blas_sys::cudaDataType::CUDA_R_32F,
                };
                cublas(
                    // SAFETY: as above; alpha and beta are f32 for the f32 compute type.
                    unsafe {
                        cudarc::cublas::result::gemm_ex(
                            h,
                            op(call.transa),
                            op(call.transb),
                            call.m,
                            call.n,
                            call.k,
                            &alpha as *const f32 as *const _,
                            first as *const _,
                            ty(DType::BF16),
                            call.lda,
                            second as *const _,
                            ty(DType::BF16),
                            call.ldb,
                            &beta as *const f32 as *const _,
                            pc.addr as *mut _,
                            ty(out),
                            call.ldc,
                            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    },
                    "gemmEx",
                )
            }
            (x, y, z) => panic!(
                "no CUDA gemm for {} × {} → {}",
                x.name(),
                y.name(),
                z.name()
            ),
        }
    }
    /// f32: `cublasSsyrk` on one triangle, then mirrored by a kernel (about half a GEMM's
    /// multiply-adds); other dtypes as a full GEMM.
    fn syrk(&self, mut c: ViewMut, a: View, s: Syrk) {
        let (pc, pa) = (place_mut(&mut c), place(&a));
        if !(pc.dtype == DType::F32 && pa.dtype == DType::F32) {
            return self.gemm(c, a, a, s.as_gemm());
        }
        if s.n == 0 {
            return;
        }
        let (rows, cols) = if s.trans { (s.k, s.n) } else { (s.n, s.k) };
        assert!(
            a.len() >= extent(rows, cols, s.lda),
            "syrk: A too small {s:?}"
        );
        assert!(
            c.len() >= extent(s.n, s.n, s.ldc),
            "syrk: C too small {s:?}"
        );
        assert!(
            pc.on_device && pa.on_device,
            "syrk on memory the device does not hold"
        );
        let call = map_syrk(&s).unwrap_or_else(|e| panic!("syrk {s:?}: {e}"));
        let (alpha, beta) = (call.alpha, call.beta);
        self.bind();
        // SAFETY: extents checked above; the handle is bound to the compute stream.
        cublas(
            unsafe {
                blas_sys::cublasSsyrk_v2(
                    *self.blas.handle(),
                    if call.upper {
                        blas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER
                    } else {
                        blas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER
                    },
                    op(call.trans),
                    call.n,
                    call.k,
                    &alpha,
                    pa.addr as *const f32,
                    call.lda,
                    &beta,
                    pc.addr as *mut f32,
                    call.ldc,
                )
            }
            .result(),
            "ssyrk",
        );
        // The mapping's column-major upper triangle is the row-major lower one.
        debug_assert!(call.upper);
        self.launch3(
            "ganymede_mirror_lower_f32",
            [pc.addr, s.n as u64, s.ldc as u64],
            s.n * s.n,
        );
    }
    fn axpy(&self, mut y: ViewMut, alpha: f32, x: View) {
        let (py, px) = (place_mut(&mut y), place(&x));
        assert_eq!(py.len, px.len, "axpy of different lengths");
        assert!(
            py.dtype == DType::F32 && px.dtype == DType::F32 && py.on_device && px.on_device,
            "CUDA axpy: f32 device memory only so far"
        );
        let n = i32::try_from(py.len).expect("axpy longer than cuBLAS's int");
        self.bind();
        // SAFETY: both ranges hold n f32 on the device; the handle is on the compute stream.
        cublas(
            unsafe {
                blas_sys::cublasSaxpy_v2(
                    *self.blas.handle(),
                    n,
                    &alpha,
                    px.addr as *const f32,
                    1,
                    py.addr as *mut f32,
                    1,
                )
            }
            .result(),
            "saxpy",
        )
    }
    fn scale(&self, mut y: ViewMut, alpha: f32) {
        let py = place_mut(&mut y);
        assert!(
            py.dtype == DType::F32 && py.on_device,
            "CUDA scale: f32 device memory only so far"
        );
        let n = i32::try_from(py.len).expect("scale longer than cuBLAS's int");
        self.bind();
        // SAFETY: as in axpy.
        cublas(
            unsafe {
                blas_sys::cublasSscal_v2(*self.blas.handle(), n, &alpha, py.addr as *mut f32, 1)
            }
            .result(),
            "sscal",
        )
    }
    fn sumsq(&self, x: View) -> f64 {
        let mut acc = self.zeros_of(&[1], DType::F64, Category::Buffers);
        self.sumsq_acc(acc.view_mut(), x);
        self.download_f64(acc.view())[0]
    }
    fn sumsq_acc(&self, mut acc: ViewMut, x: View) {
        let (pa, px) = (place_mut(&mut acc), place(&x));
        assert!(
            pa.dtype == DType::F64 && pa.len >= 1 && pa.on_device && px.on_device,
            "CUDA sumsq_acc: an f64 device accumulator and device memory"
        );
        let kernel = match px.dtype {
            DType::F32 => "ganymede_sumsq_acc_f32",
            DType::BF16 => "ganymede_sumsq_acc_bf16",
            DType::F64 => panic!("no CUDA sumsq of f64"),
        };
        if px.len > 0 {
            self.launch3(kernel, [pa.addr, px.addr, px.len as u64], px.len);
        }
    }
    fn cast(&self, mut dst: ViewMut, src: View) {
        assert_eq!(dst.len(), src.len(), "cast between different lengths");
        let (pd, ps) = (place_mut(&mut dst), place(&src));
        match (ps.dtype, pd.dtype) {
            (a, b) if a == b => self.copy(dst, src),
            (DType::F32, DType::BF16) if pd.on_device && ps.on_device => self.launch3(
                "ganymede_cast_f32_to_bf16",
                [pd.addr, ps.addr, ps.len as u64],
                ps.len,
            ),
            (DType::BF16, DType::F32) if pd.on_device && ps.on_device => self.launch3(
                "ganymede_cast_bf16_to_f32",
                [pd.addr, ps.addr, ps.len as u64],
                ps.len,
            ),
            (a, b) => panic!(
                "no CUDA cast from {} to {} (device memory, f32 and bf16 only)",
                a.name(),
                b.name()
            ),
        }
    }
}

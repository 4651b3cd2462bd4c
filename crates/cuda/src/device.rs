//! The device through cudarc: a context, one CUDA stream per seam [`Stream`], events, pinned
//! host memory, asynchronous copies, NVRTC-compiled kernels and a cuBLAS handle on the compute
//! stream. [`CudaBackend`] implements `Memory` fully (`memory.rs`) and `Blas` (`blas.rs`:
//! GEMMs through cuBLAS); [`CudaKernelBackend`] (`launcher.rs`) adds the model's and the
//! optimizers' kernels (`NnOps`, `OptimOps`), which makes the whole seam on one GPU.
//!
//! Ordering is the seam's, not cudarc's: cudarc's per-slice event tracking is turned off, and
//! code above the seam orders streams with `Memory::record_event`/`Memory::wait_event`.
//! The one thing the backend adds is stream-ordered free: device memory used by a copy on
//! another stream is freed on the compute stream only after that stream's work so far.

mod blas;
mod graphs;
mod launcher;
mod memory;
pub mod nvrtc;
mod phases;
mod plumbing;
pub mod probe;
pub mod profile;
mod staging;

pub use launcher::{kernel_backend, kernel_backend_on, CudaKernelBackend, CudaLauncher};
pub use memory::{place, place_mut, DeviceMemory, PinnedMemory, Place, Uses};
pub use plumbing::PLUMBING;
pub use probe::{probe, probe_nvrtc, ProbeError};

use memory::CopyTrace;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use ganymede_core::{Ledger, Stream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Freed device memory stays in the stream-ordered pool instead of going back to the driver at
/// each synchronisation (the pool's default), so a step's allocations are reused like
/// PyTorch's caching allocator's. Best effort: without it allocation is only slower.
fn keep_freed_memory(ctx: &Arc<CudaContext>) {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: out-parameters of the right types; the device is the context's.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS
        {
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut _,
            );
        }
    }
}

/// Why the device could not be set up.
#[derive(Debug)]
pub enum DeviceError {
    Probe(ProbeError),
    Driver {
        what: String,
        error: String,
    },
    Compile(nvrtc::CompileError),
    Cublas {
        what: String,
        error: String,
    },
    /// A setting (an environment variable) the backend does not take: the message names it.
    Setting(String),
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceError::Probe(e) => e.fmt(f),
            DeviceError::Driver { what, error } => write!(f, "CUDA {what}: {error}"),
            DeviceError::Compile(e) => e.fmt(f),
            DeviceError::Cublas { what, error } => write!(f, "cuBLAS {what}: {error}"),
            DeviceError::Setting(e) => f.write_str(e),
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

/// The four CUDA streams, indexed by [`Stream::index`].
pub struct Streams {
    streams: [Arc<CudaStream>; 4],
    /// What a graph's capture on the compute stream holds while it runs (see `graphs`).
    capture: Mutex<Option<graphs::Capture>>,
    /// Whether `capture` holds one: what every allocation, free, staged write and phase mark
    /// asks, without the lock.
    capturing: std::sync::atomic::AtomicBool,
}

impl Streams {
    pub fn get(&self, s: Stream) -> &Arc<CudaStream> {
        &self.streams[s.index()]
    }
}

/// Kernels loaded into the context, looked up by name (cached); the backend's own kernels
/// ([`plumbing::PLUMBING_KERNELS`]) also in slots of their own, which a launch reads without a
/// lock.
struct Kernels {
    modules: Vec<Arc<CudaModule>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    plumbing: [OnceLock<CudaFunction>; plumbing::PLUMBING_KERNELS.len()],
}

/// The CUDA backend on one GPU. Cloning it shares the device state (the kernel launcher holds
/// a clone beside the backend that owns the memory).
#[derive(Clone)]
pub struct CudaBackend(Arc<Inner>);

impl std::ops::Deref for CudaBackend {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// What a [`CudaBackend`] holds.
pub struct Inner {
    ctx: Arc<CudaContext>,
    streams: Arc<Streams>,
    blas: CudaBlas,
    kernels: Kernels,
    ledger: Arc<Ledger>,
    ordinal: u16,
    arch: String,
    name: String,
    trace: Mutex<Option<CopyTrace>>,
    /// Held around each cuBLAS call: rank threads and Newton–Schulz's lanes share the handle.
    blas_lock: Mutex<()>,
    /// Device pointer arrays of grouped GEMMs (see `blas::PtrArrays`).
    grouped: Mutex<blas::PtrArrays>,
    /// Pinned slots of small host-to-device writes (see `staging`).
    staging: Mutex<staging::Staging>,
    /// bf16 copies of the f32 A and B operands of bf16-input GEMMs (see
    /// `CudaBackend::with_bf16_operands`).
    bf16_scratch: Mutex<[ganymede_core::CastSlot; 2]>,
    /// The step's phase clock: events on the compute stream (see `phases`).
    phases: Mutex<ganymede_core::phase::PhaseClock<cudarc::driver::CudaEvent>>,
    /// CUDA graphs by key, with what each keeps alive (see `graphs`).
    graphs: Mutex<HashMap<u64, graphs::Captured>>,
    /// cuBLAS's workspace, set once (a graph's capture cannot let cuBLAS allocate its own).
    _blas_workspace: Option<cudarc::driver::CudaSlice<u8>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last ops' events, read while the context lives.
        if let Some(p) = profile::profile() {
            p.flush();
        }
    }
}

impl CudaBackend {
    /// Probe, then set up GPU `ordinal`: context, streams, cuBLAS, and every kernel of
    /// `sources::SOURCES` (plus the backend's own) compiled by NVRTC for its architecture.
    pub fn new(ordinal: usize, ledger: Arc<Ledger>) -> Result<Self, DeviceError> {
        Self::on_streams(ordinal, ledger, None)
    }

    /// Another backend on this one's GPU, with its own ledger (and cuBLAS handle), that issues
    /// its work on this one's streams: the NCCL group's backend and the training state's are
    /// two, and the collectives must be ordered against the training's compute stream.
    pub fn beside(&self, ledger: Arc<Ledger>) -> Result<Self, DeviceError> {
        Self::on_streams(self.ordinal as usize, ledger, Some(self.streams.clone()))
    }

    /// [`CudaBackend::new`] on `streams` (of a backend of the same GPU), or on new ones.
    fn on_streams(
        ordinal: usize,
        ledger: Arc<Ledger>,
        streams: Option<Arc<Streams>>,
    ) -> Result<Self, DeviceError> {
        probe()?;
        let ctx = CudaContext::new(ordinal).map_err(driver("context"))?;
        // SAFETY: the seam orders every use across streams with its events (see module doc),
        // and this backend frees memory in stream order itself.
        unsafe { ctx.disable_event_tracking() };
        let mk = || ctx.new_stream().map_err(driver("stream"));
        let streams = match streams {
            Some(s) => s,
            None => Arc::new(Streams {
                streams: [mk()?, mk()?, mk()?, mk()?],
                capture: Mutex::default(),
                capturing: Default::default(),
            }),
        };
        let blas = CudaBlas::new(streams.get(Stream::Compute).clone()).map_err(|e| {
            DeviceError::Cublas {
                what: "handle".into(),
                error: e.to_string(),
            }
        })?;
        keep_freed_memory(&ctx);
        let blas_workspace = graphs::set_blas_workspace(&blas, streams.get(Stream::Compute))?;
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
        Ok(CudaBackend(Arc::new(Inner {
            ctx,
            streams,
            blas,
            kernels: Kernels {
                modules,
                functions: Mutex::new(HashMap::new()),
                plumbing: Default::default(),
            },
            ledger,
            ordinal: ordinal as u16,
            arch,
            name,
            trace: Mutex::new(None),
            blas_lock: Mutex::new(()),
            grouped: Mutex::new(blas::PtrArrays::default()),
            staging: Mutex::new(staging::Staging::default()),
            bf16_scratch: Mutex::default(),
            phases: Mutex::default(),
            graphs: Mutex::default(),
            _blas_workspace: blas_workspace,
        })))
    }

    /// The major compute capability (9 on an H100/H200); 0 if the driver does not say.
    pub fn compute_major(&self) -> u32 {
        self.context()
            .compute_capability()
            .map_or(0, |(major, _)| major.max(0) as u32)
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
        // cudarc's lookup does not make the context current.
        self.bind();
        for m in &self.kernels.modules {
            match m.load_function(name) {
                Ok(f) => {
                    cache.insert(name.to_string(), f.clone());
                    return Ok(f);
                }
                Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_FOUND => {}
                // A sticky error from earlier work (an illegal address, say) shows as itself,
                // not as a kernel missing from every file.
                Err(e) => {
                    return Err(DeviceError::Driver {
                        what: format!("looking up kernel {name}"),
                        error: probe::driver_error(&e),
                    })
                }
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

    /// Make the context current on this thread before a raw driver, cuBLAS or NCCL call
    /// (cudarc's own methods do this themselves); rank threads and copy helpers call in from
    /// anywhere.
    pub fn bind(&self) {
        ok(self.ctx.bind_to_thread(), "binding the context");
    }

    /// Launch one of the backend's own kernels, whose arguments are three 64-bit values
    /// (pointers and counts), over `n` elements with 256-thread blocks.
    fn launch3(&self, kernel: &'static str, args: [u64; 3], n: usize) {
        self.launch_u64(kernel, &args, n)
    }

    /// A grid-stride kernel of [`plumbing::PLUMBING_KERNELS`] over `n` items whose parameters
    /// are all 64-bit values (pointers, counts, or a float's bits in the low half), at most 8.
    /// Its function is looked up once; the launch allocates nothing.
    fn launch_u64(&self, kernel: &'static str, args: &[u64], n: usize) {
        let slot = plumbing::PLUMBING_KERNELS
            .iter()
            .position(|k| *k == kernel)
            .unwrap_or_else(|| panic!("{kernel} is not one of the backend's own kernels"));
        let f = self.kernels.plumbing[slot]
            .get_or_init(|| self.function(kernel).unwrap_or_else(|e| panic!("{e}")));
        let blocks = (n as u64).div_ceil(256).clamp(1, 4096) as u32;
        let mut vals = [0u64; 8];
        assert!(
            args.len() <= vals.len(),
            "{kernel}: {} arguments",
            args.len()
        );
        vals[..args.len()].copy_from_slice(args);
        let mut ptrs = [std::ptr::null_mut::<std::ffi::c_void>(); 8];
        for (p, v) in ptrs.iter_mut().zip(&mut vals) {
            *p = v as *mut u64 as *mut std::ffi::c_void;
        }
        let stream = self.compute();
        // SAFETY: each of these kernels takes its parameters as 64-bit values, and the callers
        // pass ranges that hold what the kernel touches; `vals` outlives the call.
        let r = stream.context().bind_to_thread().and_then(|()| unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                (blocks, 1, 1),
                (256, 1, 1),
                0,
                stream.cu_stream(),
                &mut ptrs[..args.len()],
            )
        });
        ok(r, kernel);
    }
}

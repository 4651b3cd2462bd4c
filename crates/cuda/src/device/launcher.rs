//! The kernel ops on the GPU: [`CudaLauncher`] gives [`crate::ops::KernelOps`] device
//! addresses, launches on the compute stream and scratch from device memory, and
//! [`CudaKernelBackend`] is the whole seam on one GPU: this backend's memory, streams and
//! cuBLAS GEMMs, every other op a kernel of `kernels/*.cu` — the same ops layer, and the same
//! launches, that the host build checks against the CPU backend in CI.

use super::memory::{place, place_mut, Place};
use super::{ok, CudaBackend, DeviceError};
use crate::host::{Arg, LaunchConfig, MAX_ARGS};
use crate::kernel::{Kernel, Resolved};
use crate::kernel_backend::{Gemms, KernelBackend};
use crate::launch::Launcher;
use crate::ops::{KernelOps, Tuning};
use cudarc::driver::CudaFunction;
use ganymede_core::Stream;
use ganymede_core::{Blas, Category, DType, Gemm, Ledger, Memory, Syrk, Tensor, View, ViewMut};
use std::ffi::c_void;
use std::sync::Arc;

/// Kernel launches on a [`CudaBackend`]'s compute stream.
#[derive(Clone)]
pub struct CudaLauncher {
    be: CudaBackend,
    /// Each kernel's function, looked up in the device's modules at its first launch.
    functions: Arc<Resolved<CudaFunction>>,
}

/// The seam on one GPU: memory and GEMMs from the device layer, every other op a kernel.
pub type CudaKernelBackend = KernelBackend<CudaLauncher, CudaBackend>;

/// Probe, set up GPU `ordinal` (context, streams, cuBLAS, the kernels compiled by NVRTC) and
/// return the full backend.
pub fn kernel_backend(
    ordinal: usize,
    ledger: Arc<Ledger>,
) -> Result<CudaKernelBackend, DeviceError> {
    kernel_backend_on(CudaBackend::new(ordinal, ledger)?)
}

/// The full backend over a device layer already set up (the NCCL launch makes the training
/// state's with [`CudaBackend::beside`] its group's).
pub fn kernel_backend_on(be: CudaBackend) -> Result<CudaKernelBackend, DeviceError> {
    let tuning = Tuning::for_device(be.compute_major()).map_err(DeviceError::Setting)?;
    let ops = KernelOps::with_tuning(CudaLauncher::new(be.clone()), tuning);
    Ok(KernelBackend::new(ops, be))
}

impl CudaLauncher {
    /// Launches on `be`'s compute stream (the device check builds ops of its own tuning).
    pub fn new(be: CudaBackend) -> Self {
        CudaLauncher {
            be,
            functions: Arc::default(),
        }
    }
}

impl Launcher for CudaLauncher {
    fn addr(&self, v: View) -> *mut c_void {
        place(&v).addr as *mut c_void
    }
    fn addr_mut(&self, mut v: ViewMut) -> *mut c_void {
        place_mut(&mut v).addr as *mut c_void
    }
    unsafe fn launch(&self, k: Kernel, cfg: LaunchConfig, args: &[Arg]) {
        let f = self.functions.get(k, |name| {
            self.be.function(name).unwrap_or_else(|e| panic!("{e}"))
        });
        let name = k.name();
        assert!(
            args.len() <= MAX_ARGS,
            "kernel {name}: {} arguments",
            args.len()
        );
        // The driver takes a pointer to each argument's value: the values are copied into an
        // array on the stack (a pointer travels as its 64-bit value), and pointers to them
        // into another; nothing is allocated.
        let mut vals = [0u64; MAX_ARGS];
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for ((a, v), p) in args.iter().zip(&mut vals).zip(&mut ptrs) {
            let at = v as *mut u64 as *mut u8;
            // SAFETY: each value is at most 8 bytes, written at the start of its 8-byte slot,
            // which is where the driver reads a parameter of that size.
            unsafe {
                match *a {
                    Arg::Ptr(x) => (at as *mut u64).write(x as u64),
                    Arg::I32(x) => (at as *mut i32).write(x),
                    Arg::U32(x) => (at as *mut u32).write(x),
                    Arg::I64(x) => (at as *mut i64).write(x),
                    Arg::F32(x) => (at as *mut f32).write(x),
                    Arg::F64(x) => (at as *mut f64).write(x),
                }
            }
            *p = at as *mut c_void;
        }
        let shared = u32::try_from(cfg.shared).expect("shared memory beyond u32");
        let stream = self.be.compute();
        let mut go = || {
            // SAFETY: the caller's (see the trait): arguments match the kernel's parameters
            // and every address holds what the kernel touches; `vals` outlives the call.
            let r = stream.context().bind_to_thread().and_then(|()| unsafe {
                cudarc::driver::result::launch_kernel(
                    f.cu_function(),
                    (cfg.grid[0], cfg.grid[1], cfg.grid[2]),
                    (cfg.block[0], cfg.block[1], cfg.block[2]),
                    shared,
                    stream.cu_stream(),
                    &mut ptrs[..args.len()],
                )
            });
            ok(r, name)
        };
        match super::profile::profile() {
            Some(p) => p.op(stream, || name.to_string(), go),
            None => go(),
        }
    }
    fn resolutions(&self) -> u64 {
        self.functions.resolutions()
    }
    fn alloc_scratch(&self, bytes: usize) -> Tensor {
        // f64 elements: 8-byte alignment for the f64 partial sums carved from it. Freed in
        // stream order when replaced, like every device tensor of this backend.
        self.be
            .zeros_of(&[bytes.div_ceil(8)], DType::F64, Category::Buffers)
    }
    unsafe fn upload(&self, dst: *mut c_void, src: &[u8]) {
        if self.be.streams.capturing() {
            // A capture cannot copy from pageable memory: from pinned memory the graph keeps.
            return self.be.stage_in_capture(dst as u64, src);
        }
        self.copy_bytes(dst as u64, src.as_ptr() as u64, src.len());
    }
    unsafe fn download(&self, dst: &mut [u8], src: *mut c_void) {
        self.copy_bytes(dst.as_mut_ptr() as u64, src as u64, dst.len());
        self.be.sync_compute();
    }
}

impl CudaLauncher {
    /// `bytes` bytes by unified address on the compute stream (host memory is staged by the
    /// driver before the call returns, so the source may be reused).
    fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) {
        // Counted in bytes; the dtype only has to agree between the two sides.
        let at = |addr| Place {
            addr,
            bytes,
            dtype: DType::F32,
            len: bytes,
            uses: None,
            on_device: false,
        };
        self.be.memcpy(&at(dst), &at(src), Stream::Compute);
    }
}

impl CudaBackend {
    /// `op`, charged to `name` when profiling (see `profile`).
    fn profiled<R>(&self, name: impl FnOnce() -> String, op: impl FnOnce() -> R) -> R {
        match super::profile::profile() {
            Some(p) => p.op(self.compute(), name, op),
            None => op(),
        }
    }
}

/// A GEMM's name in the profile: its shape and operand precision.
fn gemm_name(kind: &str, m: usize, n: usize, k: usize, bf16: bool) -> String {
    format!(
        "cublas {kind} {m}x{n}x{k}{}",
        if bf16 { " bf16" } else { "" }
    )
}

impl Gemms for CudaBackend {
    fn gemm(&self, c: ViewMut, a: View, b: View, g: Gemm) {
        self.profiled(
            || gemm_name("gemm", g.m, g.n, g.k, g.bf16_inputs),
            || Blas::gemm(self, c, a, b, g),
        )
    }
    fn syrk(&self, c: ViewMut, a: View, s: Syrk) {
        self.profiled(
            || gemm_name("syrk", s.n, s.n, s.k, s.bf16_inputs),
            || Blas::syrk(self, c, a, s),
        )
    }
    fn native_bf16(&self) -> bool {
        Blas::native_bf16(self)
    }
    /// One `cublasGemmStridedBatchedEx` for the batch (bf16-input operands cast once, whole).
    fn gemm_strided(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        g: Gemm,
        batch: usize,
        strides: [usize; 3],
    ) {
        if batch == 0 || g.m == 0 || g.n == 0 {
            return;
        }
        if batch == 1 {
            return Gemms::gemm(self, c, a, b, g);
        }
        if g.bf16_inputs && (a.dtype() != DType::BF16 || b.dtype() != DType::BF16) {
            let n = (a.len(), b.len());
            return self.with_bf16_operands(a, b, n, g.unchanged, |a, b| {
                Gemms::gemm_strided(self, c, a, b, g, batch, strides)
            });
        }
        self.profiled(
            || {
                format!(
                    "{} x{batch}",
                    gemm_name("gemm strided", g.m, g.n, g.k, g.bf16_inputs)
                )
            },
            || self.gemm_strided_batched(c, a, b, g, batch, strides),
        )
    }
    /// As a strided batch of GEMMs of A with itself (both triangles), then every matrix's lower
    /// triangle mirrored with the diagonal term added (one kernel for the batch).
    fn syrk_strided(&self, mut c: ViewMut, a: View, s: Syrk, batch: usize, strides: [usize; 2]) {
        if batch == 0 || s.n == 0 {
            return;
        }
        if batch == 1 {
            // One matrix: the plain symmetric product (cuBLAS's syrk in f32, half the work).
            return Gemms::syrk(self, c, a, s);
        }
        assert_eq!(c.dtype(), DType::F32, "strided syrk writes f32");
        self.self_products(c.reborrow(), a, &s, batch, strides);
        let pc = place_mut(&mut c);
        let tail = mirror_args(&s, strides[1], batch);
        let args = [pc.addr, tail[0], tail[1], tail[2], tail[3], tail[4]];
        self.mirror("ganymede_mirror_lower_batched_f32", &args, &s, batch);
    }
    /// The strided product into `work` as [`Gemms::syrk_strided`] makes it, less the mirror;
    /// then one kernel reads every matrix's lower triangle, adds the diagonal term and writes
    /// both triangles to `c16` rounded to bf16: the bits of the mirror followed by a cast, in
    /// one pass over the batch. Newton–Schulz's products are bf16-input; others take the
    /// seam's two calls.
    fn syrk_strided_into_bf16(
        &self,
        mut work: ViewMut,
        mut c16: ViewMut,
        a: View,
        s: Syrk,
        batch: usize,
        strides: [usize; 2],
    ) {
        if !s.bf16_inputs || work.dtype() != DType::F32 {
            return Blas::syrk_strided_into_bf16(self, work, c16, a, s, batch, strides);
        }
        if batch == 0 || s.n == 0 {
            return;
        }
        assert_eq!(
            c16.dtype(),
            DType::BF16,
            "syrk_strided_into_bf16: c16 is bf16"
        );
        let [sa, sc] = strides;
        let lc = (batch - 1) * sc + s.extents()[1];
        assert!(
            work.len() >= lc && c16.len() >= lc,
            "syrk_strided_into_bf16: {batch} results of {s:?} at stride {sc}"
        );
        self.self_products(work.reborrow(), a, &s, batch, [sa, sc]);
        let (pw, pc) = (place_mut(&mut work), place_mut(&mut c16));
        let t = mirror_args(&s, sc, batch);
        let args = [pc.addr, pw.addr, t[0], t[1], t[2], t[3], t[4]];
        self.mirror(
            "ganymede_mirror_lower_batched_f32_to_bf16",
            &args,
            &s,
            batch,
        );
    }
    fn batches_matrices(&self) -> bool {
        true
    }
    /// One `cublasGemmGroupedBatchedEx` for all groups (the experts' GEMMs); with
    /// `GANYMEDE_CUDA_GROUPED=loop`, one GEMM per group instead (what the device check measures
    /// the grouped call against). Where cuBLAS refuses the grouped call for these dtypes (its
    /// table for it is shorter than `GemmEx`'s: bf16 operands with an f32 result may not be in
    /// it), the process says so once and loops for those dtypes from then on.
    fn gemm_grouped(
        &self,
        mut c: ViewMut,
        a: View,
        b: View,
        groups: &[(Gemm, usize, usize, usize)],
    ) {
        let (bf16, unchanged) = ganymede_core::backend::grouped_casts(groups);
        if bf16 && (a.dtype() != DType::BF16 || b.dtype() != DType::BF16) {
            // Whole views, cast once for every group (which rows the groups read follows the
            // routing); the per-group calls then see bf16 operands.
            let n = (a.len(), b.len());
            return self.with_bf16_operands(a, b, n, unchanged, |a, b| {
                Gemms::gemm_grouped(self, c, a, b, groups)
            });
        }
        let dtypes = [a.dtype(), b.dtype(), c.dtype()];
        let g0 = groups.first().map(|x| x.0);
        let name = |kind: &str| {
            let (n, k) = g0.map_or((0, 0), |g| (g.n, g.k));
            let rows: usize = groups.iter().map(|x| x.0.m).sum();
            format!(
                "cublas {kind} {} groups, {rows} rows, n {n} k {k}",
                groups.len()
            )
        };
        if grouped_loop() || grouped_refused(dtypes).is_some() {
            return self.profiled(
                || name("grouped as a loop"),
                || self.gemm_grouped_loop(c, a, b, groups),
            );
        }
        let tried = self.profiled(
            || name("grouped"),
            || self.try_gemm_grouped_batched(c.reborrow(), a, b, groups),
        );
        if let Err(e) = tried {
            use cudarc::cublas::sys::cublasStatus_t as St;
            if !matches!(
                e.0,
                St::CUBLAS_STATUS_NOT_SUPPORTED | St::CUBLAS_STATUS_INVALID_VALUE
            ) {
                panic!("cuBLAS gemmGroupedBatchedEx: {e}");
            }
            eprintln!(
                "note: cuBLAS refused a grouped GEMM of {:?} x {:?} -> {:?} ({e}); those run one \
                 GEMM per group from now on",
                dtypes[0], dtypes[1], dtypes[2]
            );
            refuse_grouped(dtypes, e);
            self.gemm_grouped_loop(c, a, b, groups)
        }
    }
}

/// `GANYMEDE_CUDA_GROUPED=loop`: one launch per expert (read once per process).
fn grouped_loop() -> bool {
    static LOOP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOOP.get_or_init(|| std::env::var("GANYMEDE_CUDA_GROUPED").is_ok_and(|v| v == "loop"))
}

/// Operand and result dtypes (A, B, C) whose grouped GEMM cuBLAS refused in this process, with
/// its status.
static REFUSED: std::sync::Mutex<Vec<([DType; 3], String)>> = std::sync::Mutex::new(Vec::new());

/// cuBLAS's refusal of a grouped GEMM of these dtypes in this process, if it refused one.
pub fn grouped_refused(dtypes: [DType; 3]) -> Option<String> {
    let r = REFUSED.lock().unwrap_or_else(|e| e.into_inner());
    r.iter().find(|(d, _)| *d == dtypes).map(|(_, e)| e.clone())
}

fn refuse_grouped(dtypes: [DType; 3], e: cudarc::cublas::result::CublasError) {
    let mut r = REFUSED.lock().unwrap_or_else(|e| e.into_inner());
    if !r.iter().any(|(d, _)| *d == dtypes) {
        r.push((dtypes, e.to_string()));
    }
}

impl CudaBackend {
    /// One cuBLAS GEMM per group on sub-views.
    pub fn gemm_grouped_loop(
        &self,
        mut c: ViewMut,
        a: View,
        b: View,
        groups: &[(Gemm, usize, usize, usize)],
    ) {
        for &(g, ao, bo, co) in groups {
            let [la, lb, lc] = g.extents();
            if lc == 0 {
                continue;
            }
            Blas::gemm(
                self,
                c.reborrow().slice(co, lc),
                a.slice(ao, la),
                b.slice(bo, lb),
                g,
            );
        }
    }
}

impl CudaBackend {
    /// The batch's products of each A with itself, both triangles, into the f32 `c` (one
    /// strided-batched GEMM; a bf16-input operand cast once unless it is bf16 already).
    fn self_products(&self, c: ViewMut, a: View, s: &Syrk, batch: usize, [sa, sc]: [usize; 2]) {
        let g = s.as_gemm();
        self.with_bf16_operand_if(s.bf16_inputs, a, |a| {
            Gemms::gemm_strided(self, c, a, a, g, batch, [sa, sa, sc])
        });
    }

    /// One mirror kernel over the batch's `s.n × s.n` results (see the plumbing kernels).
    fn mirror(&self, kernel: &'static str, args: &[u64], s: &Syrk, batch: usize) {
        self.profiled(
            || format!("{kernel} x{batch} ({}x{})", s.n, s.n),
            || self.launch_u64(kernel, args, batch * s.n * s.n),
        );
    }
}

/// The mirror kernels' arguments after their pointers: size, row stride, the diagonal term's
/// bits, the matrices' stride and their number.
fn mirror_args(s: &Syrk, stride: usize, batch: usize) -> [u64; 5] {
    [
        s.n as u64,
        s.ldc as u64,
        s.diag.to_bits() as u64,
        stride as u64,
        batch as u64,
    ]
}

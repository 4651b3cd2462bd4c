//! What the kernel ops ([`crate::ops::KernelOps`]) need from a device, so that one ops layer
//! runs on the host build (the shim, [`HostLauncher`]) and on a GPU (a launcher over the device
//! layer): the address of a view's first element, a kernel launch, scratch memory, and byte
//! copies between host memory and such addresses (for the integer data the seam still passes
//! on the host, and the few values that come back to it).
//!
//! Addresses are `*mut c_void`, as a kernel argument holds them ([`Arg::Ptr`]); a GPU
//! launcher returns its `CUdeviceptr` cast to one. Work is ordered as on one stream: a launch
//! or copy may be asynchronous, but `download` returns with the data.

use crate::bounds::{self, Regions};
use crate::host::{self, Arg, HostKernel, LaunchConfig};
use crate::kernel::{Kernel, Resolved};
use ganymede_core::{Category, CpuBackend, DType, Memory, Tensor, View, ViewMut};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// A device as the kernel ops see it. Object-safe.
pub trait Launcher: Send + Sync {
    /// The address of `v`'s first element (read by kernels).
    fn addr(&self, v: View) -> *mut c_void;
    /// The address of `v`'s first element (written by kernels).
    fn addr_mut(&self, v: ViewMut) -> *mut c_void;
    /// `bytes` at `addr` are a region of their own (a scratch region carved from a larger
    /// allocation) that kernels may read and write, and whose contents are not yet defined:
    /// what the host build's bounds check ([`crate::bounds`]) holds them to, filling them with
    /// NaN bytes. Nothing to do on a GPU.
    ///
    /// # Safety
    /// `addr` must be valid for `bytes` bytes of writes, with no queued work using them.
    unsafe fn mark(&self, _addr: *mut c_void, _bytes: usize) {}
    /// Launch kernel `k` on the compute stream, with at most [`host::MAX_ARGS`] arguments.
    /// Each kernel's handle is resolved at its first launch and kept ([`Resolved`]), so a
    /// launch in the steady state allocates nothing and takes no lock.
    ///
    /// # Safety
    /// As `cuLaunchKernel`: the arguments must match the kernel's parameters, and every address
    /// must be valid for what the kernel reads and writes at this configuration.
    unsafe fn launch(&self, k: Kernel, cfg: LaunchConfig, args: &[Arg]);
    /// How many kernel handles this launcher has resolved from names (see [`Resolved`]): one
    /// per kernel launched, however often.
    fn resolutions(&self) -> u64 {
        0
    }
    /// A tensor of at least `bytes` bytes, 8-byte aligned, charged to the ledger as
    /// [`Category::Buffers`]. The ops keep it as a grow-only pool, so this is called rarely;
    /// dropping the one it replaces must not free memory that queued work still uses (a GPU
    /// frees stream-ordered).
    fn alloc_scratch(&self, bytes: usize) -> Tensor;
    /// Copy `src` to the memory at `dst`, ordered with the launches (after those issued before,
    /// before those issued after: a GPU copies on the compute stream). `src` may be reused once
    /// this returns (pageable memory is staged by the driver before it does).
    ///
    /// # Safety
    /// `dst` must be valid for `src.len()` bytes.
    unsafe fn upload(&self, dst: *mut c_void, src: &[u8]);
    /// Copy the memory at `src` into `dst` once the work before it is done.
    ///
    /// # Safety
    /// `src` must be valid for `dst.len()` bytes.
    unsafe fn download(&self, dst: &mut [u8], src: *mut c_void);
}

// The trait stays object-safe (a backend may hold a `Box<dyn Launcher>`).
const _: Option<&dyn Launcher> = None;

/// The kernels' host build: launches run on the calling thread (see [`host::launch`]),
/// addresses are host pointers, scratch comes from a CPU backend's memory.
#[derive(Clone)]
pub struct HostLauncher {
    mem: CpuBackend,
    regions: Arc<Regions>,
    kernels: Arc<Resolved<HostKernel>>,
}

impl HostLauncher {
    /// Scratch is allocated (and charged) through `mem`, which should be the backend whose
    /// tensors the kernels run on (two-memory mode included: its views are host-addressable).
    pub fn new(mem: CpuBackend) -> Self {
        HostLauncher {
            mem,
            regions: Arc::default(),
            kernels: Arc::default(),
        }
    }
}

/// The host address of element `offset` of a device buffer, after its access checks.
fn device_addr(buf: &dyn ganymede_core::DeviceBuffer, offset: usize, write: bool) -> *mut c_void {
    let base = buf
        .host_ptr(write)
        .unwrap_or_else(|| panic!("{} is not host memory", buf.describe()));
    base.wrapping_add(offset * buf.dtype().size()) as *mut c_void
}

impl Launcher for HostLauncher {
    fn addr(&self, v: View) -> *mut c_void {
        let bytes = v.len() * v.dtype().size();
        let p = match v {
            View::Host(s) => s.as_ptr() as *mut c_void,
            View::Host64(s) => s.as_ptr() as *mut c_void,
            View::HostBf16(s) => s.as_ptr() as *mut c_void,
            View::HostU32(s) => s.as_ptr() as *mut c_void,
            View::Device(d) => device_addr(d.buffer(), d.offset(), false),
        };
        self.regions.note(p, bytes, false);
        p
    }
    fn addr_mut(&self, v: ViewMut) -> *mut c_void {
        let bytes = v.len() * v.dtype().size();
        let p = match v {
            ViewMut::Host(s) => s.as_mut_ptr() as *mut c_void,
            ViewMut::Host64(s) => s.as_mut_ptr() as *mut c_void,
            ViewMut::HostBf16(s) => s.as_mut_ptr() as *mut c_void,
            ViewMut::HostU32(s) => s.as_mut_ptr() as *mut c_void,
            ViewMut::Device(d) => device_addr(d.buffer(), d.offset(), true),
        };
        self.regions.note(p, bytes, true);
        p
    }
    unsafe fn mark(&self, addr: *mut c_void, bytes: usize) {
        self.regions.scratch(addr, bytes)
    }
    unsafe fn launch(&self, k: Kernel, cfg: LaunchConfig, args: &[Arg]) {
        let k = self.kernels.get(k, |name| {
            host::resolve(name).unwrap_or_else(|| panic!("kernel {name} is not in the host build"))
        });
        if bounds::guarded() {
            self.regions.launch_resolved(k, cfg, args)
        } else {
            host::launch_resolved(k, cfg, args)
        }
    }
    fn resolutions(&self) -> u64 {
        self.kernels.resolutions()
    }
    fn alloc_scratch(&self, bytes: usize) -> Tensor {
        // f64 elements: 8-byte alignment for the f64 partial sums carved from it.
        self.mem
            .zeros_of(&[bytes.div_ceil(8)], DType::F64, Category::Buffers)
    }
    unsafe fn upload(&self, dst: *mut c_void, src: &[u8]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len())
    }
    unsafe fn download(&self, dst: &mut [u8], src: *mut c_void) {
        std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len())
    }
}

/// One launch as [`Recording`] saw it: the kernel, its shape and its arguments' bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub kernel: &'static str,
    pub cfg: LaunchConfig,
    pub args: Vec<(char, u64)>,
}

impl std::fmt::Display for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (g, b) = (self.cfg.grid, self.cfg.block);
        write!(
            f,
            "{} <<<{g:?}, {b:?}, {}>>> (",
            self.kernel, self.cfg.shared
        )?;
        for (i, (kind, bits)) in self.args.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            match kind {
                'f' => write!(f, "{sep}{}", f32::from_bits(*bits as u32))?,
                'd' => write!(f, "{sep}{}", f64::from_bits(*bits))?,
                'p' => write!(f, "{sep}{bits:#x}")?,
                _ => write!(f, "{sep}{}", *bits as i64)?,
            }
        }
        write!(f, ")")
    }
}

/// The launches a [`Recording`] launcher has seen, shared with whoever reads them.
#[derive(Clone, Default)]
pub struct LaunchLog(Arc<Mutex<Vec<Launch>>>);

impl LaunchLog {
    /// The launches since the last take.
    pub fn take(&self) -> Vec<Launch> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// `L` noting every launch in a [`LaunchLog`]: what a test of a training step's launches reads
/// (a CUDA graph replays a step's launches exactly, so a step that launches the same kernels
/// with the same arguments every time is one a graph can replay). Everything else is `L`'s.
#[derive(Clone)]
pub struct Recording<L> {
    inner: L,
    log: LaunchLog,
}

impl<L: Launcher> Recording<L> {
    pub fn new(inner: L) -> (Self, LaunchLog) {
        let log = LaunchLog::default();
        (
            Recording {
                inner,
                log: log.clone(),
            },
            log,
        )
    }
}

impl<L: Launcher> Launcher for Recording<L> {
    fn addr(&self, v: View) -> *mut c_void {
        self.inner.addr(v)
    }
    fn addr_mut(&self, v: ViewMut) -> *mut c_void {
        self.inner.addr_mut(v)
    }
    unsafe fn mark(&self, addr: *mut c_void, bytes: usize) {
        self.inner.mark(addr, bytes)
    }
    unsafe fn launch(&self, k: Kernel, cfg: LaunchConfig, args: &[Arg]) {
        let launch = Launch {
            kernel: k.name(),
            cfg,
            args: args.iter().map(Arg::bits).collect(),
        };
        self.log
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(launch);
        self.inner.launch(k, cfg, args)
    }
    fn resolutions(&self) -> u64 {
        self.inner.resolutions()
    }
    fn alloc_scratch(&self, bytes: usize) -> Tensor {
        self.inner.alloc_scratch(bytes)
    }
    unsafe fn upload(&self, dst: *mut c_void, src: &[u8]) {
        self.inner.upload(dst, src)
    }
    unsafe fn download(&self, dst: &mut [u8], src: *mut c_void) {
        self.inner.download(dst, src)
    }
}

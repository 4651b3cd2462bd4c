//! The kernels' host build (the CUDA C source through the shim), for checking against the CPU backend.
//!
//! `build.rs` compiles `kernels/*.cu` with `shim/cuda_shim.h` for the CPU: a launch runs its
//! blocks in order, each block's threads as fibers that switch at `__syncthreads` and warp
//! shuffles. Arguments go as in CUDA's driver API (a pointer to each value), and each launch is
//! checked against the argument kinds the build read from the kernel's parameter list.

use std::ffi::{c_char, c_void, CStr, CString};

extern "C" {
    fn gany_host_launch_at(
        i: u32,
        grid: *const u32,
        block: *const u32,
        shared: usize,
        args: *mut *mut c_void,
    ) -> i32;
    fn gany_host_signature(name: *const c_char) -> *const c_char;
    fn gany_host_index(name: *const c_char) -> i32;
    fn gany_host_signature_at(i: u32) -> *const c_char;
    fn gany_host_kernel_count() -> u32;
    fn gany_host_set_reverse(reverse: i32);
    fn gany_host_set_defer_copies(defer: i32);
    fn gany_host_kernel_name(i: u32) -> *const c_char;
    fn gany_host_wide_accesses() -> u64;
}

/// One kernel argument, by value.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(*mut c_void),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    F64(f64),
}

impl Arg {
    /// The argument as a kernel receives it: its kind and its bits (so that two launches can
    /// be compared exactly, NaN and -0.0 included).
    pub fn bits(&self) -> (char, u64) {
        let bits = match *self {
            Arg::Ptr(p) => p as u64,
            Arg::I32(v) => v as u32 as u64,
            Arg::U32(v) => v as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
            Arg::F64(v) => v.to_bits(),
        };
        (self.kind(), bits)
    }
    fn kind(&self) -> char {
        match self {
            Arg::Ptr(_) => 'p',
            Arg::I32(_) => 'i',
            Arg::U32(_) => 'u',
            Arg::I64(_) => 'l',
            Arg::F32(_) => 'f',
            Arg::F64(_) => 'd',
        }
    }
    fn value_ptr(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(p) => p as *mut *mut c_void as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::U32(v) => v as *mut u32 as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
            Arg::F64(v) => v as *mut f64 as *mut c_void,
        }
    }
}

impl<T> From<*mut T> for Arg {
    fn from(p: *mut T) -> Self {
        Arg::Ptr(p as *mut c_void)
    }
}
impl<T> From<*const T> for Arg {
    fn from(p: *const T) -> Self {
        Arg::Ptr(p as *mut c_void)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}
impl From<u32> for Arg {
    fn from(v: u32) -> Self {
        Arg::U32(v)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}
impl From<f64> for Arg {
    fn from(v: f64) -> Self {
        Arg::F64(v)
    }
}

/// A launch's shape: `grid` blocks of `block` threads, `shared` bytes of dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: usize,
}

impl LaunchConfig {
    /// A 1-D launch without dynamic shared memory.
    pub fn linear(grid: u32, block: u32) -> Self {
        LaunchConfig {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared: 0,
        }
    }
    pub fn shared(mut self, bytes: usize) -> Self {
        self.shared = bytes;
        self
    }
}

/// The argument kinds of `name`'s parameters, one letter each (`p` pointer, `i` int, `u`
/// unsigned, `l` long long, `f` float, `d` double), or None if no kernel has that name.
pub fn signature(name: &str) -> Option<String> {
    let c = CString::new(name).ok()?;
    // Safety: the table holds static NUL-terminated strings.
    unsafe {
        let s = gany_host_signature(c.as_ptr());
        (!s.is_null()).then(|| CStr::from_ptr(s).to_string_lossy().into_owned())
    }
}

/// The order in which a block's threads run between barriers, and a launch's blocks run, for
/// launches from this thread. Running a kernel in both orders exposes a missing barrier: a
/// thread that reads shared memory another writes without `__syncthreads` in between sees the
/// stale value in one order; so does a block that reads what another block of the launch writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    FirstToLast,
    LastToFirst,
}

pub fn set_schedule(s: Schedule) {
    // Safety: sets a thread-local flag.
    unsafe { gany_host_set_reverse((s == Schedule::LastToFirst) as i32) }
}

/// When the kernels' asynchronous copies into shared memory (`cp.async`) land, for launches
/// from this thread. `AtIssue`: at once. `AtWait`: at the latest moment the PTX contract allows
/// (the `cp.async.wait_group` that covers the copy), the destination NaN from the issue until
/// then, which shows a tile read before its wait (copying at once hides that) as well as a
/// stage refilled while a warp still reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyTiming {
    AtIssue,
    AtWait,
}

pub fn set_copy_timing(t: CopyTiming) {
    // Safety: sets a thread-local flag.
    unsafe { gany_host_set_defer_copies((t == CopyTiming::AtWait) as i32) }
}

/// Wide (4-element vector) loads and stores made so far by kernels launched from this thread:
/// which path of an elementwise loop ran (common.cuh's `ew_loop`).
pub fn wide_accesses() -> u64 {
    // Safety: reads a thread-local counter.
    unsafe { gany_host_wide_accesses() }
}

/// Every kernel the host build holds, in file order.
pub fn kernel_names() -> Vec<String> {
    // Safety: indices below the count name static strings.
    unsafe {
        (0..gany_host_kernel_count())
            .map(|i| {
                CStr::from_ptr(gany_host_kernel_name(i))
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }
}

/// Most arguments a kernel takes: launches pass them in arrays of this size on the stack.
pub const MAX_ARGS: usize = 24;

/// A kernel of the host build's table, found by name once: launching it
/// ([`launch_resolved`]) searches nothing and allocates nothing on the Rust side.
#[derive(Clone, Copy, Debug)]
pub struct HostKernel {
    index: u32,
    name: &'static str,
    signature: &'static str,
}

impl HostKernel {
    pub fn name(&self) -> &'static str {
        self.name
    }
    /// Its argument kinds (see [`signature`]).
    pub fn signature(&self) -> &'static str {
        self.signature
    }
}

/// The host build's kernel `name`, or None if it has none of that name.
pub fn resolve(name: &str) -> Option<HostKernel> {
    let c = CString::new(name).ok()?;
    // Safety: the index is the table's; its strings are static and NUL-terminated.
    unsafe {
        let i = u32::try_from(gany_host_index(c.as_ptr())).ok()?;
        let text = |p: *const c_char| CStr::from_ptr(p).to_str().expect("an ASCII name");
        Some(HostKernel {
            index: i,
            name: text(gany_host_kernel_name(i)),
            signature: text(gany_host_signature_at(i)),
        })
    }
}

/// Runs kernel `name` on the host.
///
/// # Safety
/// As a CUDA launch: pointers must be valid for everything the kernel reads and writes at this
/// configuration. The argument kinds are checked (a wrong kind panics), their meaning is not.
pub unsafe fn launch(name: &str, cfg: LaunchConfig, args: &[Arg]) {
    let k = resolve(name).unwrap_or_else(|| panic!("no kernel named {name}"));
    launch_resolved(&k, cfg, args)
}

/// [`launch`] of a kernel found before: the arguments' kinds checked against its parameters,
/// their values passed from arrays on the stack.
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_resolved(k: &HostKernel, cfg: LaunchConfig, args: &[Arg]) {
    let sig = k.signature.as_bytes();
    let kinds_match =
        sig.len() == args.len() && args.iter().zip(sig).all(|(a, &s)| a.kind() as u8 == s);
    if !kinds_match {
        let got: String = args.iter().map(Arg::kind).collect();
        assert_eq!(got, k.signature, "kernel {}: argument kinds", k.name);
    }
    assert!(
        args.len() <= MAX_ARGS,
        "kernel {}: {} arguments",
        k.name,
        args.len()
    );
    let mut vals = [Arg::I32(0); MAX_ARGS];
    vals[..args.len()].copy_from_slice(args);
    let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for (p, v) in ptrs.iter_mut().zip(&mut vals[..args.len()]) {
        *p = v.value_ptr();
    }
    let rc = gany_host_launch_at(
        k.index,
        cfg.grid.as_ptr(),
        cfg.block.as_ptr(),
        cfg.shared,
        ptrs.as_mut_ptr(),
    );
    assert_eq!(rc, 0, "kernel {}: launch failed ({cfg:?})", k.name);
}

/// What `embedding_backward_sorted_*` reads (defined in core, where the batch builder uses it).
pub use ganymede_core::embedding_segments;

/// RoPE's frequencies `1 / theta^(2i / head_dim)` for `i < head_dim / 2`, in f32 as the CPU
/// backend (and transformers) compute them: what `head_norm_rope_*` kernels read as `inv_freq`.
pub fn rope_inv_freq(head_dim: usize, theta: f64) -> Vec<f32> {
    let (base, d) = (theta as f32, head_dim as f32);
    (0..head_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / d))
        .collect()
}

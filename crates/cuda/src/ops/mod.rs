//! The seam's operations as kernel launches, over any [`Launcher`]: the host build checks them
//! against the CPU backend and a GPU backend runs the very same launch logic.
//!
//! [`KernelOps`] implements [`ganymede_core::OptimOps`], and as inherent methods of the same
//! signatures every [`ganymede_core::Blas`] operation except `gemm`/`syrk` and every
//! [`ganymede_core::NnOps`] operation except `gemm_grouped` (those are a BLAS library's:
//! [`crate::kernel_backend::KernelBackend`] puts the two together). Launch shapes follow the
//! comment above each kernel in `kernels/*.cu`; each op checks its views' lengths before it
//! launches, since a kernel, unlike the CPU backend's slices, would not.
//!
//! Scratch (partial sums, uploaded integer data) comes from one grow-only pool, locked for the
//! duration of an op: launches are ordered on one stream, so the next op may reuse it.

mod blas;
mod gemm;
mod nn;
mod optim;

use crate::host::{Arg, LaunchConfig, MAX_ARGS};
use crate::kernel;
use crate::kernel::{Family, Kernel};
use crate::launch::Launcher;
use ganymede_core::{DType, Tensor, View, ViewMut};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

/// Launch sizes the ops choose; the defaults suit a GPU, tests shrink them so that grid-stride
/// loops and multi-row blocks are exercised on small shapes. Block reductions sum in an order
/// that follows the block size, so results depend on these in their last bits; at fixed sizes
/// they are deterministic (no floating-point atomics).
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// Threads per block of the 1-D elementwise (grid-stride) kernels and of the first pass of
    /// sums of squares.
    pub ew_block: u32,
    /// At most this many blocks for them (each thread then loops).
    pub ew_max_blocks: u32,
    /// Query rows per attention forward block (one warp each, at most 16).
    pub attn_rows: u32,
    /// At most this many threads per block of the kernels that take one block per row (norms,
    /// embedding, gather/combine), a multiple of 32: a row wider than this loops.
    pub row_block_max: u32,
    /// bf16 attention on the tensor-core kernels (`attention_*_tc{head_dim}_bf16`: mma.sync,
    /// sm_80 and later) where head_dim is 16, 32, 64 or 128; otherwise, and for f32, the SIMT
    /// kernels.
    /// Off by default; a GPU backend turns it on from compute capability 8.0
    /// ([`Tuning::for_device`]).
    pub attn_tc: bool,
    /// With `attn_tc`, at head_dim 16, 32 and 64: the fused tensor-core backward
    /// (`attention_backward_fused_tc{head_dim}_bf16`, FlashAttention-2's arrangement), whose
    /// dk/dv pass also adds dq into f32 sums with atomic adds, instead of a second pass over the
    /// keys for dq that computes S and dP again. dq is then not bitwise reproducible on a
    /// device (the adds' order varies). Off by default; on for a GPU ([`Tuning::for_device`]).
    pub attn_fused_dq: bool,
    /// With `attn_tc`, at head_dim 16, 32 and 64: the tensor-core forward with two m-tiles of
    /// 16 query rows a warp (`attention_forward_tc{head_dim}x2_bf16`, 128 queries a block), so
    /// that each K and V fragment loaded from shared memory feeds four products instead of two,
    /// at 254 registers (head_dim 64) and two blocks an SM instead of three. Bitwise the same
    /// results. Off by default (not yet timed on a GPU: the device check times both);
    /// `GANYMEDE_CUDA_ATTENTION=wide` turns it on for a GPU ([`Tuning::for_device`]).
    pub attn_wide_fwd: bool,
    /// The routed experts' grouped GEMMs with bf16 inputs on `gemm.cu`'s tensor-core kernel
    /// (one launch, any operand and result dtypes) instead of the device's library (cuBLAS's
    /// grouped GEMM, or one GEMM per expert for the f32 results it refuses). Off by default
    /// (not yet timed on a GPU: the device check times both); `GANYMEDE_CUDA_GROUPED=kernel`
    /// turns it on for a GPU ([`Tuning::for_device`]).
    pub grouped_tc: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            ew_block: 256,
            ew_max_blocks: 1024,
            attn_rows: 8,
            row_block_max: 256,
            attn_tc: false,
            attn_fused_dq: false,
            attn_wide_fwd: false,
            grouped_tc: false,
        }
    }
}

impl Tuning {
    /// The defaults for a device of compute capability `major`.`_`: tensor-core attention from
    /// 8.0 on, with the fused backward. `GANYMEDE_CUDA_ATTENTION`, a comma-separated list,
    /// changes them: `simt` (the SIMT kernels), `deterministic` (tensor cores with dq in its own
    /// pass: bitwise reproducible), `wide` (the forward with 32 query rows a warp). Any other
    /// word is an error that names it.
    pub fn for_device(major: u32) -> Result<Self, String> {
        let mut t = Self::for_device_with(
            major,
            std::env::var("GANYMEDE_CUDA_ATTENTION").ok().as_deref(),
        )?;
        // `loop` (one GEMM per expert) is the launcher's to read.
        t.grouped_tc =
            major >= 8 && std::env::var("GANYMEDE_CUDA_GROUPED").is_ok_and(|v| v == "kernel");
        Ok(t)
    }
    /// [`Tuning::for_device`] with the variable's value given.
    pub fn for_device_with(major: u32, attention: Option<&str>) -> Result<Self, String> {
        let (mut tc, mut fused, mut wide) = (true, true, false);
        for word in attention.unwrap_or("").split(',').map(str::trim) {
            match word {
                "" => {}
                "simt" => tc = false,
                "deterministic" => fused = false,
                "wide" => wide = true,
                _ => {
                    return Err(format!(
                        "GANYMEDE_CUDA_ATTENTION={:?}: {word:?} is not one of \"simt\", \
                         \"deterministic\", \"wide\" (unset: tensor cores with the fused \
                         backward)",
                        attention.unwrap_or("")
                    ))
                }
            }
        }
        let tc = tc && major >= 8;
        Ok(Tuning {
            attn_tc: tc,
            attn_fused_dq: tc && fused,
            attn_wide_fwd: tc && wide,
            ..Tuning::default()
        })
    }
}

/// The CPU backend's rows per partial sum of a column reduction (`RED_ROWS`): the same chunks
/// give the same rounding.
const CHUNK_ROWS: usize = 64;

/// Router choices per block of the dispatch's placement: a step of `medium` (16,384 tokens,
/// top-8) is 128 tiles, each taken in chunks of 256 by one block.
pub const DISPATCH_TILE: usize = 1024;

/// Scratch regions start at multiples of this many bytes from the pool's start (any element
/// type; coalesced access on a device, whose allocations are at least this aligned).
const SCRATCH_ALIGN: usize = 256;

/// The ops over launcher `L`.
pub struct KernelOps<L: Launcher> {
    launcher: L,
    tuning: Tuning,
    pool: Mutex<Option<Tensor>>,
    /// The fused attention backward's f32 dq sums, apart from the pool and of exactly the
    /// largest size asked (`ganymede_plan` predicts it: `attention_dq_sums_bytes`).
    dq_sums: Mutex<Option<Tensor>>,
    /// RoPE's frequency tables by (head_dim, theta's bits), uploaded once each: an upload per
    /// op from pageable host memory may wait for the stream.
    freqs: Mutex<Vec<((usize, u64), Tensor)>>,
    /// Multi-tensor ops' tables (i64 per tensor: address, length, ...) by content, uploaded once
    /// each (a step's gradients are the same tensors every step), at most [`TABLES`] kept.
    tables: Mutex<Vec<(Vec<i64>, Tensor)>>,
}

/// How many multi-tensor tables [`KernelOps`] keeps (the oldest goes first).
const TABLES: usize = 8;

impl<L: Launcher> KernelOps<L> {
    pub fn new(launcher: L) -> Self {
        Self::with_tuning(launcher, Tuning::default())
    }
    pub fn with_tuning(launcher: L, tuning: Tuning) -> Self {
        let Tuning {
            ew_block,
            ew_max_blocks,
            attn_rows,
            row_block_max,
            attn_tc: _,
            attn_fused_dq: _,
            attn_wide_fwd: _,
            grouped_tc: _,
        } = tuning;
        assert!(
            ew_block > 0
                && ew_block.is_multiple_of(32)
                && ew_max_blocks > 0
                && (1..=16).contains(&attn_rows)
                && row_block_max > 0
                && row_block_max.is_multiple_of(32),
            "launch sizes the kernels do not take: {tuning:?}"
        );
        KernelOps {
            launcher,
            tuning,
            pool: Mutex::new(None),
            dq_sums: Mutex::new(None),
            freqs: Mutex::new(Vec::new()),
            tables: Mutex::new(Vec::new()),
        }
    }
    pub fn launcher(&self) -> &L {
        &self.launcher
    }
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// A view's device address as a kernel argument.
    fn arg(&self, v: View) -> Arg {
        Arg::Ptr(self.launcher.addr(v))
    }
    /// A writable view's device address as a kernel argument.
    fn arg_mut(&self, v: ViewMut) -> Arg {
        Arg::Ptr(self.launcher.addr_mut(v))
    }
    fn launch(&self, k: Kernel, cfg: LaunchConfig, args: &[Arg]) {
        // Safety: every op checks its views' lengths against the sizes it passes, and carves
        // scratch of the sizes its kernels index, before calling this.
        unsafe { self.launcher.launch(k, cfg, args) }
    }

    /// Threads for one block per row of `dim`: a warp per 32 columns, up to the tuning's cap.
    fn row_block(&self, dim: usize) -> u32 {
        (dim.next_multiple_of(32) as u32).clamp(32, self.tuning.row_block_max)
    }

    /// One block per row: `rows` blocks of [`Self::row_block`] threads.
    fn per_row(&self, rows: usize, dim: usize) -> LaunchConfig {
        cfg(grid(rows, 1, 1), self.row_block(dim))
    }

    /// One warp per row over `rows` short rows: blocks of the tuning's row block
    /// ([`Tuning::row_block_max`] threads), a warp each.
    fn warp_per_row(&self, rows: usize) -> LaunchConfig {
        let warps = (self.tuning.row_block_max / 32) as usize;
        cfg(grid(rows.div_ceil(warps), 1, 1), (warps * 32) as u32)
    }

    /// A 1-D grid-stride launch over `n` elements.
    fn ew(&self, n: usize) -> LaunchConfig {
        let t = self.tuning;
        let blocks = n
            .div_ceil(t.ew_block as usize)
            .clamp(1, t.ew_max_blocks as usize);
        LaunchConfig::linear(blocks as u32, t.ew_block)
    }

    /// Regions of `sizes` bytes from the pool (grown if needed), held until the guard drops.
    fn scratch<const N: usize>(&self, sizes: [usize; N]) -> (Scratch<'_>, [*mut c_void; N]) {
        let mut offs = [0usize; N];
        let mut total = 0;
        for (o, s) in offs.iter_mut().zip(sizes) {
            *o = total;
            total += s.next_multiple_of(SCRATCH_ALIGN);
        }
        let mut guard = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|t| t.bytes() < total) {
            // Grow-only, with headroom, so the pool settles after the first steps.
            let bytes = total.max(guard.as_ref().map_or(0, |t| t.bytes() * 2));
            *guard = Some(self.launcher.alloc_scratch(bytes.max(SCRATCH_ALIGN)));
        }
        let base = self
            .launcher
            .addr_mut(guard.as_mut().expect("scratch").view_mut()) as *mut u8;
        let ptrs = offs.map(|o| base.wrapping_add(o) as *mut c_void);
        for (&p, s) in ptrs.iter().zip(sizes) {
            // Safety: disjoint regions of the pool, which this guard holds for the op alone.
            unsafe { self.launcher.mark(p, s) };
        }
        (Scratch { _guard: guard }, ptrs)
    }

    /// The device address of a table holding `table`, uploaded at its first use and kept: a
    /// step that passes the same tensors every time uploads nothing after its first (its
    /// launches are then the same from step to step).
    fn table(&self, table: Vec<i64>) -> *mut c_void {
        self.kept(&self.tables, table, TABLES, |t| t.clone())
    }

    /// The device address of `make(key)`'s values, uploaded at the first use of `key` and kept
    /// in `cache`, which holds at most `keep` (the oldest goes first).
    fn kept<K: PartialEq, T: Copy>(
        &self,
        cache: &Mutex<Vec<(K, Tensor)>>,
        key: K,
        keep: usize,
        make: impl FnOnce(&K) -> Vec<T>,
    ) -> *mut c_void {
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = cache.iter_mut().find(|(k, _)| *k == key) {
            return self.launcher.addr_mut(t.view_mut());
        }
        if cache.len() == keep {
            cache.remove(0);
        }
        let values = make(&key);
        let mut t = self
            .launcher
            .alloc_scratch(std::mem::size_of_val(&values[..]));
        let p = self.launcher.addr_mut(t.view_mut());
        self.put(p, &values);
        cache.push((key, t));
        p
    }

    /// The dq sums' slot of at least `bytes`, grown to exactly that where smaller.
    fn dq_sums(&self, bytes: usize) -> (Scratch<'_>, *mut c_void) {
        let mut guard = self.dq_sums.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|t| t.bytes() < bytes) {
            *guard = None; // freed before its successor is allocated
            *guard = Some(self.launcher.alloc_scratch(bytes.max(SCRATCH_ALIGN)));
        }
        let base = self
            .launcher
            .addr_mut(guard.as_mut().expect("dq sums").view_mut());
        // Safety: the slot holds at least `bytes`, and this guard holds it for the op alone.
        unsafe { self.launcher.mark(base, bytes) };
        (Scratch { _guard: guard }, base)
    }

    /// `bytes` (a multiple of 4) of device memory at `dst` set to zero by a kernel.
    fn zero(&self, dst: *mut c_void, bytes: usize) {
        assert!(bytes.is_multiple_of(4), "zero: {bytes} bytes");
        let n = bytes / 4;
        if n > 0 {
            self.launch(kernel!("zero_u32"), self.ew(n), &[dst.into(), i64_of(n)]);
        }
    }

    /// Host data into device memory (scratch regions, small constants), and back.
    fn put<T: Copy>(&self, dst: *mut c_void, src: &[T]) {
        // Safety: `dst` is a scratch region of at least `size_of_val(src)` bytes (callers size
        // it so); T is a plain integer or float.
        unsafe {
            let bytes =
                std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src));
            self.launcher.upload(dst, bytes)
        }
    }
    fn get<T: Copy>(&self, dst: &mut [T], src: *mut c_void) {
        // Safety: as `put`, the other way.
        unsafe {
            let bytes = std::slice::from_raw_parts_mut(
                dst.as_mut_ptr() as *mut u8,
                std::mem::size_of_val(dst),
            );
            self.launcher.download(bytes, src)
        }
    }
}

/// Holds the scratch pool (or the dq sums' slot) while an op's launches use it.
struct Scratch<'a> {
    _guard: MutexGuard<'a, Option<Tensor>>,
}

/// `{op}_f32` and `{op}_bf16`, indexed by [`dt_at`]: an op's kernel for its storage type.
const fn dtypes(op: &str) -> Family<2> {
    Family::new(&[&[op], &["_f32", "_bf16"]])
}

/// Storage `dt`'s index among an op's variants (`f32`, `bf16`; see [`dtypes`]).
fn dt_at(dt: DType, op: &str) -> usize {
    match dt {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F64 | DType::U32 => panic!("{op}: the kernels have no {} variant", dt.name()),
    }
}

/// `op`'s kernel for storage `dt`: `{op}_f32` or `{op}_bf16`, resolved at compile time (`op`
/// a literal or constant).
macro_rules! by_dtype {
    ($op:expr, $dt:expr) => {{
        const F: Family<2> = dtypes($op);
        F.get(&[dt_at($dt, $op)])
    }};
}
use by_dtype;

/// A kernel's arguments gathered in steps, on the stack (at most [`MAX_ARGS`]).
struct Args {
    args: [Arg; MAX_ARGS],
    len: usize,
}

impl Args {
    fn new() -> Self {
        Args {
            args: [Arg::I32(0); MAX_ARGS],
            len: 0,
        }
    }
    fn push(&mut self, a: Arg) {
        assert!(self.len < MAX_ARGS, "more than {MAX_ARGS} kernel arguments");
        self.args[self.len] = a;
        self.len += 1;
    }
    fn extend(&mut self, args: impl IntoIterator<Item = Arg>) {
        for a in args {
            self.push(a);
        }
    }
}

impl std::ops::Deref for Args {
    type Target = [Arg];
    fn deref(&self) -> &[Arg] {
        &self.args[..self.len]
    }
}

impl<const N: usize> From<[Arg; N]> for Args {
    fn from(a: [Arg; N]) -> Self {
        let mut args = Args::new();
        args.extend(a);
        args
    }
}

fn i32_of(x: usize) -> Arg {
    Arg::I32(i32::try_from(x).expect("size beyond the kernels' int range"))
}
fn i64_of(x: usize) -> Arg {
    Arg::I64(x as i64)
}
fn u32_of(x: usize) -> u32 {
    u32::try_from(x).expect("grid beyond u32")
}

/// A grid within CUDA's limits (x below 2³¹, y and z at most 65,535): beyond them a launch
/// fails on the device, so it fails here first, at any shape, in the host build as well.
fn grid(x: usize, y: usize, z: usize) -> [u32; 3] {
    assert!(
        x < 1 << 31 && y <= 65_535 && z <= 65_535,
        "a launch grid of {x} x {y} x {z} blocks is beyond CUDA's limits (y and z at most 65535)"
    );
    [u32_of(x), u32_of(y), u32_of(z)]
}

fn cfg(grid: [u32; 3], block: u32) -> LaunchConfig {
    LaunchConfig {
        grid,
        block: [block, 1, 1],
        shared: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::HostLauncher;
    use ganymede_core::{Category, CpuBackend, Device, Memory};

    #[test]
    fn grids_stay_within_the_device_limits() {
        assert_eq!(grid(1 << 20, 65_535, 7), [1 << 20, 65_535, 7]);
        for (x, y, z) in [(1, 65_536, 1), (1, 1, 65_536), (1 << 31, 1, 1)] {
            let e = std::panic::catch_unwind(|| grid(x, y, z)).expect_err("beyond the limits");
            let text = e.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(text.contains("beyond CUDA's limits"), "{text}");
        }
        // The shim refuses what the device would (a bad configuration, status 2).
        let shape = |grid, block| LaunchConfig {
            grid,
            block,
            shared: 0,
        };
        for cfg in [
            shape([1, 65_536, 1], [32, 1, 1]),
            shape([1, 1, 1], [1, 1, 65]),
            shape([1, 1, 1], [1025, 1, 1]),
        ] {
            let e = std::panic::catch_unwind(|| {
                let mut x = [0u32; 4];
                // Safety: refused before any thread runs.
                unsafe {
                    crate::host::launch("zero_u32", cfg, &[x.as_mut_ptr().into(), 4i64.into()])
                }
            });
            assert!(e.is_err(), "{cfg:?} was launched");
        }
    }

    #[test]
    fn the_device_defaults_and_their_variable() {
        let t = |major, v| {
            let t = Tuning::for_device_with(major, v).unwrap();
            (t.attn_tc, t.attn_fused_dq, t.attn_wide_fwd)
        };
        assert_eq!(t(9, None), (true, true, false));
        assert_eq!(t(9, Some("")), (true, true, false));
        assert_eq!(t(8, Some("deterministic")), (true, false, false));
        assert_eq!(t(9, Some("wide")), (true, true, true));
        assert_eq!(t(9, Some("deterministic, wide")), (true, false, true));
        assert_eq!(t(9, Some("simt")), (false, false, false));
        assert_eq!(t(9, Some("simt,wide")), (false, false, false));
        assert_eq!(t(7, None), (false, false, false));
        let err = Tuning::for_device_with(9, Some("wide,determinstic")).unwrap_err();
        assert!(
            err.contains("GANYMEDE_CUDA_ATTENTION=\"wide,determinstic\"")
                && err.contains("\"determinstic\" is not one of"),
            "{err}"
        );
    }

    #[test]
    fn scratch_regions_are_aligned_disjoint_and_pooled() {
        let cpu = CpuBackend::default();
        let ops = KernelOps::new(HostLauncher::new(cpu.clone()));
        let held = || {
            cpu.ledger()
                .report()
                .current(Device::Host, Category::Buffers)
        };
        let (s, [a, b, c]) = ops.scratch([10, 0, 300]);
        let (a, b, c) = (a as usize, b as usize, c as usize);
        // Offsets from the pool's start (a device allocation is at least that aligned; the
        // host's f64 pool 8 bytes).
        assert!(a % 8 == 0 && (b - a) % SCRATCH_ALIGN == 0 && (c - a) % SCRATCH_ALIGN == 0);
        assert!(a + 10 <= b && b <= c, "in order, disjoint");
        drop(s);
        let first = held();
        assert!(first >= (SCRATCH_ALIGN + 300) as u64);
        // Smaller requests reuse the pool; a larger one replaces it (the old one freed).
        drop(ops.scratch([64, 64]));
        assert_eq!(held(), first);
        drop(ops.scratch([4 * first as usize]));
        assert!(held() >= 4 * first && held() < 5 * first + SCRATCH_ALIGN as u64);
        // Bytes go there and back.
        let (_s, [p]) = ops.scratch([12]);
        ops.put(p, &[7u32, 8, 9]);
        let mut back = [0u32; 3];
        ops.get(&mut back, p);
        assert_eq!(back, [7, 8, 9]);
    }
}

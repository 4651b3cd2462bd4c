//! A launch in the steady state costs the launcher nothing but the launch (issue 32): the ops
//! layer names its kernels by number ([`ganymede_cuda::kernel::Kernel`], resolved at compile
//! time), each launcher resolves a kernel's handle once ([`ganymede_cuda::kernel::Resolved`]),
//! and arguments travel in arrays on the stack. Held here on the host launcher, whose ops layer
//! and handle table are the GPU launcher's: after a first round of ops, a second round of the
//! same ops resolves no kernel again and makes no heap allocation at all on this thread (the
//! shim's own C++ work, which stands in for the GPU, does not go through Rust's allocator).
//!
//! Its own test binary: the counting allocator is process-wide.

use ganymede_core::{
    AdamWStep, AttnDims, AttnGrads, AttnSaved, Blas, Category, CpuBackend, DType, DecayStep,
    GradScale, HeadRope, Ledger, Memory, NormSaved, OptimOps, Tensor,
};
use ganymede_cuda::launch::{HostLauncher, Launcher};
use ganymede_cuda::ops::{KernelOps, Tuning};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

/// Rust heap allocations made by this thread (allocations, zeroed allocations, reallocations).
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: nothing to count while the thread's locals are being torn down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: every call goes to the system allocator as it came.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count();
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        count();
        System.realloc(p, l, new)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

struct Tensors {
    x: Tensor,
    y: Tensor,
    xb: Tensor,
    yb: Tensor,
    m: Tensor,
    v: Tensor,
    w: Tensor,
    rstd: Tensor,
    dw: Tensor,
    acc: Tensor,
    q: Tensor,
    k: Tensor,
    vv: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    docs: Tensor,
}

const N: usize = 1024;
const DIM: usize = 64;
const ATTN: AttnDims = AttnDims {
    batch: 1,
    tq: 16,
    tk: 16,
    heads: 2,
    kv_heads: 1,
    head_dim: 32,
};
const ROPE: HeadRope = HeadRope {
    heads: 2,
    head_dim: 32,
    seq: 16,
    pos0: 0,
    theta: 10_000.0,
    eps: 1e-6,
};

impl Tensors {
    fn new(cpu: &CpuBackend) -> Self {
        let a = Category::Activations;
        let up = |n, seed| cpu.upload(&values(n, seed), &[n], a);
        let bf = |n, seed| {
            let mut t = cpu.zeros_of(&[n], DType::BF16, a);
            let src = up(n, seed);
            cpu.cast(t.view_mut(), src.view());
            t
        };
        let nq = ATTN.tq * ATTN.heads * ATTN.head_dim;
        let nk = ATTN.tk * ATTN.kv_heads * ATTN.head_dim;
        Tensors {
            x: up(N, 1),
            y: up(N, 2),
            xb: bf(N, 3),
            yb: bf(N, 4),
            m: up(N, 5),
            v: cpu.zeros(&[N], a),
            w: up(DIM, 6),
            rstd: cpu.zeros(&[64], a),
            dw: cpu.zeros(&[DIM], a),
            acc: cpu.zeros_of(&[1], DType::F64, a),
            q: up(nq, 7),
            k: up(nk, 8),
            vv: up(nk, 9),
            out: cpu.zeros(&[nq], a),
            lse: cpu.zeros(&[ATTN.tq * ATTN.heads], a),
            dq: cpu.zeros(&[nq], a),
            dk: cpu.zeros(&[nk], a),
            dv: cpu.zeros(&[nk], a),
            docs: cpu.upload_u32(&[0u32; 16], &[16], a),
        }
    }
}

/// A round of ops over every way the layer picks a kernel: by storage type, from one storage
/// to another, among a family (documents, head norms, attention passes), and with arguments
/// gathered in steps.
fn round(ops: &KernelOps<HostLauncher>, t: &mut Tensors) {
    ops.axpy(t.y.view_mut(), 0.5, t.x.view());
    ops.axpy(t.yb.view_mut(), 0.5, t.xb.view());
    ops.scale(t.y.view_mut(), 0.9);
    ops.add(t.yb.view_mut(), t.xb.view());
    ops.cast(t.xb.view_mut(), t.y.view());
    ops.sumsq_acc(t.acc.view_mut(), t.xb.view());
    ops.normalize_frobenius_strided(t.y.view_mut(), 4, 1e-7);
    ops.normalize_frobenius_strided_bf16(t.y.view(), t.yb.view_mut(), 4, 1e-7);
    let h = AdamWStep::at_step(1e-3, (0.9, 0.95), 1e-8, 0.1, 10);
    let (p, m, v, g) = (&mut t.x, &mut t.m, &mut t.v, &t.y);
    ops.adamw_step(
        p.view_mut(),
        m.view_mut(),
        v.view_mut(),
        g.view(),
        &h,
        Some(t.yb.view_mut()),
    );
    let d = DecayStep {
        lr: 1e-3,
        scale: 1.0,
        weight_decay: 0.1,
        rate: None,
        gate: GradScale::Host(1.0),
    };
    ops.decay_update(t.x.view_mut(), t.y.view(), &d, None);
    ops.rmsnorm_forward(
        t.m.view_mut(),
        t.rstd.view_mut().slice(0, N / DIM),
        t.x.view(),
        t.w.view(),
        DIM,
        1e-6,
    );
    let saved = NormSaved {
        x: t.x.view(),
        w: t.w.view(),
        rstd: t.rstd.view().slice(0, N / DIM),
    };
    ops.rmsnorm_backward(t.v.view_mut(), t.dw.view_mut(), t.y.view(), saved, DIM);
    // Head norms with RoPE over the queries' rows (16 positions of 2 heads of 32).
    let w = t.w.view().slice(0, ROPE.head_dim);
    let mut rstd = t.rstd.view_mut().slice(0, 16 * ROPE.heads);
    ops.head_norm_rope_forward(t.out.view_mut(), rstd.reborrow(), t.q.view(), w, ROPE);
    ops.head_norm_rope_forward_docs(
        t.out.view_mut(),
        rstd.reborrow(),
        t.q.view(),
        w,
        t.docs.view(),
        ROPE,
    );
    let saved = NormSaved {
        x: t.q.view(),
        w,
        rstd: rstd.as_view(),
    };
    let dw = t.dw.view_mut().slice(0, ROPE.head_dim);
    ops.head_norm_rope_backward_docs(
        t.dq.view_mut(),
        dw,
        t.out.view(),
        saved,
        t.docs.view(),
        ROPE,
    );
    ops.attention_forward(
        t.out.view_mut(),
        t.lse.view_mut(),
        t.q.view(),
        t.k.view(),
        t.vv.view(),
        ATTN,
    );
    let grads = AttnGrads {
        dq: t.dq.view_mut(),
        dk: t.dk.view_mut(),
        dv: t.dv.view_mut(),
    };
    let saved = AttnSaved {
        out: t.out.view(),
        q: t.q.view(),
        k: t.k.view(),
        v: t.vv.view(),
        lse: t.lse.view(),
    };
    ops.attention_backward_docs(grads, t.q.view(), saved, t.docs.view(), ATTN);
    ops.swiglu_forward(t.yb.view_mut(), t.x.view(), t.y.view());
}

#[test]
fn a_launch_in_the_steady_state_resolves_nothing_and_allocates_nothing() {
    let cpu = CpuBackend::new(Arc::new(Ledger::new()));
    let small = Tuning {
        ew_block: 64,
        ew_max_blocks: 3,
        row_block_max: 32,
        ..Tuning::default()
    };
    let ops = KernelOps::with_tuning(HostLauncher::new(cpu.clone()), small);
    let mut t = Tensors::new(&cpu);
    assert_eq!(ops.launcher().resolutions(), 0);
    // The first round resolves each kernel it launches once, and grows the scratch pool.
    round(&ops, &mut t);
    let first = ops.launcher().resolutions();
    assert!(first >= 20, "{first} kernels resolved");
    for _ in 0..2 {
        let before = allocations();
        round(&ops, &mut t);
        let made = allocations() - before;
        assert_eq!(
            ops.launcher().resolutions(),
            first,
            "a kernel resolved again"
        );
        assert_eq!(made, 0, "heap allocations in a round of launches");
    }
    // The counter does count: one more kernel is one more resolution, and an allocation on
    // this thread is seen.
    ops.scale(t.yb.view_mut(), 0.5);
    assert_eq!(ops.launcher().resolutions(), first + 1);
    let before = allocations();
    std::hint::black_box(vec![0u8; 16]);
    assert_eq!(allocations() - before, 1);
}

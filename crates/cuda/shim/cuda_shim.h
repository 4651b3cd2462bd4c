// The host build of the CUDA kernels: just enough of CUDA C for kernels/*.cu to compile with
// g++ and run on the CPU, so their logic is tested without a GPU.
//
// Model: a launch runs its blocks one after another on the calling OS thread; the threads of a
// block are fibers (ucontext) switched only at barriers. That makes every run deterministic and
// cheap on a small machine (hundreds of OS threads per block would spend their time in the
// scheduler), while keeping the CUDA contract visible: a thread runs until it reaches
// __syncthreads() (or a warp-level exchange), and all threads of the block (or warp) must reach it
// (a block that cannot finish aborts with a message instead of hanging). Between barriers the
// threads run first to last, or last to first (host::set_schedule), so a missing barrier shows.
// `__shared__` is a static thread_local: one copy per OS thread, hence per running block, and
// separate for launches on different test threads. Kernels declare static shared arrays through
// common.cuh's GANY_SHARED, which fills them with NaN bytes at each block's first declaration
// (as dynamic shared memory is at each block), so nothing a block reads is left from another.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
};

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

// Barriers and the warp exchange, implemented in runtime.cpp.
extern "C" void gany_syncthreads();
extern "C" void gany_syncwarp();
extern "C" void* gany_dynamic_shared();
extern "C" unsigned long long* gany_warp_slots();
extern "C" unsigned* gany_warp_mma_slots();
// cp.async's 16-byte copy into shared memory, its commit_group and its wait_group N: at issue,
// or held back until the wait that covers them (host::set_copy_timing).
// A block's first declaration of a static shared array (common.cuh's GANY_SHARED): its bytes
// become NaN (0xff), once per block.
extern "C" void gany_shared_begin(void* p, size_t bytes);
extern "C" void gany_cp_async16(void* dst, const void* src, int valid);
extern "C" void gany_cp_commit();
extern "C" void gany_cp_wait(int n);

inline void __syncthreads() { gany_syncthreads(); }
inline void gany_full_mask(unsigned mask);
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    gany_full_mask(mask);
    gany_syncwarp();
}
// A kernel's launch precondition failed: stop loudly, as the device does.
[[noreturn]] inline void __trap() {
    std::fprintf(stderr, "cuda host shim: a kernel trapped (a launch precondition failed)\n");
    std::abort();
}
// Wide (vector) accesses made on this OS thread (common.cuh's vload/vstore), so tests can tell
// which path of an elementwise loop ran.
inline thread_local unsigned long long gany_wide_count = 0;
// A wide (vector) access at an address its width does not divide: the device faults.
[[noreturn]] inline void gany_misaligned(const void* p) {
    std::fprintf(stderr, "cuda host shim: a wide access at %p, which its width does not divide\n", p);
    std::abort();
}
// A `bytes`-wide access at p, which the device takes only where bytes divides p.
inline void gany_require_aligned(const void* p, unsigned long long bytes) {
    if ((unsigned long long)p % bytes != 0) gany_misaligned(p);
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// A warp shuffle: every lane publishes its value in the warp's slots, waits for the others,
// reads its source lane's slot, and waits again so no lane overwrites a slot still being read.
// Warp-level operations here assume the whole warp takes part, as every kernel's full mask says.
inline void gany_full_mask(unsigned mask) {
    if (mask != 0xffffffffu) {
        std::fprintf(stderr, "cuda host shim: a warp operation with a partial mask\n");
        std::abort();
    }
}

template <class T>
inline T gany_exchange(T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    unsigned long long* slots = gany_warp_slots();
    const unsigned lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int lane = lin % 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slots[lane] = bits;
    gany_syncwarp();
    T out;
    std::memcpy(&out, &slots[src & 31], sizeof(T));
    gany_syncwarp();
    return out;
}

inline int gany_lane() {
    const unsigned lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    return lin % 32;
}

template <class T>
inline T __shfl_xor_sync(unsigned member_mask, T v, int mask, int width = 32) {
    gany_full_mask(member_mask);
    const int lane = gany_lane();
    const int src = (lane & ~(width - 1)) | ((lane % width) ^ mask);
    return gany_exchange(v, src);
}
template <class T>
inline T __shfl_down_sync(unsigned member_mask, T v, unsigned delta, int width = 32) {
    gany_full_mask(member_mask);
    const int lane = gany_lane();
    const int within = lane % width;
    const int src = within + (int)delta < width ? lane + (int)delta : lane;
    return gany_exchange(v, src);
}
template <class T>
inline T __shfl_up_sync(unsigned member_mask, T v, unsigned delta, int width = 32) {
    gany_full_mask(member_mask);
    const int lane = gany_lane();
    const int within = lane % width;
    const int src = within >= (int)delta ? lane - (int)delta : lane;
    return gany_exchange(v, src);
}
template <class T>
inline T __shfl_sync(unsigned member_mask, T v, int src_lane, int width = 32) {
    gany_full_mask(member_mask);
    const int lane = gany_lane();
    return gany_exchange(v, (lane & ~(width - 1)) + (src_lane % width));
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with C = D (c += a b), emulated with the
// hardware's register layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"), so a kernel that
// assumes another layout computes something else here too. Lane = 4 gq + t holds
// a[0] = A[gq][2t, 2t+1], a[1] = A[gq+8][2t, 2t+1], a[2] = A[gq][2t+8, 2t+9],
// a[3] = A[gq+8][2t+8, 2t+9] (A 16×16, bf16 pairs, the lower index in the low half),
// b[0] = B[2t, 2t+1][gq], b[1] = B[2t+8, 2t+9][gq] (B 16×8), and c[0..1] = C[gq][2t, 2t+1],
// c[2..3] = C[gq+8][2t, 2t+1] (C 16×8, f32). Every lane publishes its operands, waits for the
// warp, computes its own four results (products exact in f32, summed in k order onto c), and
// waits again before the slots can be reused. The whole warp must take part, as on the device.
inline void gany_mma_m16n8k16_bf16(float* c, const unsigned* a, const unsigned* b) {
    unsigned* slots = gany_warp_mma_slots();  // 6 words per lane
    const int lane = gany_lane();
    for (int r = 0; r < 4; r++) slots[6 * lane + r] = a[r];
    slots[6 * lane + 4] = b[0];
    slots[6 * lane + 5] = b[1];
    gany_syncwarp();
    auto half = [](unsigned word, int hi) {
        const unsigned bits = (hi ? word >> 16 : word & 0xffffu) << 16;
        float x;
        std::memcpy(&x, &bits, 4);
        return x;
    };
    auto A = [&](int row, int col) {
        const int owner = 4 * (row % 8) + (col % 8) / 2, reg = (row / 8) + 2 * (col / 8);
        return half(slots[6 * owner + reg], col & 1);
    };
    auto B = [&](int kk, int col) {
        const int owner = 4 * col + (kk % 8) / 2, reg = kk / 8;
        return half(slots[6 * owner + 4 + reg], kk & 1);
    };
    const int gq = lane / 4, t = lane % 4;
    float d[4];
    for (int e = 0; e < 4; e++) {
        const int row = gq + 8 * (e / 2), col = 2 * t + (e & 1);
        float acc = c[e];
        for (int kk = 0; kk < 16; kk++) acc += A(row, kk) * B(kk, col);
        d[e] = acc;
    }
    gany_syncwarp();
    for (int e = 0; e < 4; e++) c[e] = d[e];
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16, emulated with the hardware's layout (PTX
// ISA, "Warp-level matrix load instruction: ldmatrix"): lane L gives the address of row L % 8 of
// matrix L / 8 (16-byte aligned, as the device requires), and receives in r[m] matrix m's
// elements (L / 4, 2 (L % 4)) and (L / 4, 2 (L % 4) + 1); with `trans` the matrix is read
// column-major, so r[m] gets (2 (L % 4), L / 4) and (2 (L % 4) + 1, L / 4) of the rows as
// stored. The lower index goes in the low half. The whole warp must take part.
inline void gany_ldmatrix_x4(unsigned* r, const void* row, bool trans) {
    if ((unsigned long long)row % 16 != 0) {
        std::fprintf(stderr, "cuda host shim: an ldmatrix row address that is not 16-byte aligned\n");
        std::abort();
    }
    unsigned long long* slots = gany_warp_slots();
    const int lane = gany_lane(), gq = lane / 4, t = lane % 4;
    slots[lane] = (unsigned long long)row;
    gany_syncwarp();
    auto at = [&](int m, int row_in, int col) {
        return (unsigned)reinterpret_cast<const unsigned short*>(slots[8 * m + row_in])[col];
    };
    unsigned out[4];
    for (int m = 0; m < 4; m++) {
        const unsigned lo = trans ? at(m, 2 * t, gq) : at(m, gq, 2 * t);
        const unsigned hi = trans ? at(m, 2 * t + 1, gq) : at(m, gq, 2 * t + 1);
        out[m] = lo | (hi << 16);
    }
    gany_syncwarp();
    for (int m = 0; m < 4; m++) r[m] = out[m];
}

// Atomics: fibers switch only at barriers, so a read-modify-write is never interleaved within a
// launch; the builtins keep them atomic for any other thread that might share the memory.
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
template <class T>
inline T gany_atomic_add_float(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}
inline float atomicAdd(float* p, float v) { return gany_atomic_add_float(p, v); }
inline double atomicAdd(double* p, double v) { return gany_atomic_add_float(p, v); }

// Intrinsics the kernels use, as their exact host equivalents.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// f64 arithmetic rounded as written (the device's intrinsics never contract into an FMA; the
// host build is compiled with -ffp-contract=off).
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double x) { return std::sqrt(x); }
inline double __longlong_as_double(long long x) {
    double d;
    std::memcpy(&d, &x, sizeof d);
    return d;
}
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
inline int __float_as_int(float x) { return (int)__float_as_uint(x); }
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }

// Dynamic shared memory (`extern __shared__ T name[]` on the device), see common.cuh.
#define GANY_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(gany_dynamic_shared())

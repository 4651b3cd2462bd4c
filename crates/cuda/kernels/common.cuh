// Shared by every kernel file: sources.rs puts it in front of each file for NVRTC, and the host
// build includes it after the shim (shim/cuda_shim.h). No headers: NVRTC compiles this alone.
//
// Storage types: f32 (`float`) and bf16 (`bf16`, the top half of an f32's bits, as
// ganymede_core::bf16), always computed in f32. The conversions are written out so that the
// host build and the device round identically (nearest even, NaN stays NaN).

#ifndef GANY_COMMON_CUH
#define GANY_COMMON_CUH

#ifndef GANY_HOST
#define GANY_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif

// A static shared array `T name dims`. In the host build a thread-local static that the shim
// fills with NaN bytes where a block first declares it: a device's shared memory holds whatever
// an earlier block left there, so a kernel that reads what it did not write (a masked row it
// never filled, say) reads NaN here too, instead of an earlier block's finite values.
#ifdef GANY_HOST
#define GANY_SHARED(T, name, dims) \
    static thread_local T name dims; \
    gany_shared_begin(&name, sizeof(name))
#else
#define GANY_SHARED(T, name, dims) __shared__ T name dims
#endif

// A launch precondition: a kernel that cannot honour its contract stops instead of writing
// wrong results (the launch then fails with an error on the device, aborts in the host build).
#define GANY_REQUIRE(cond) \
    do {                   \
        if (!(cond)) __trap(); \
    } while (0)

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __uint_as_float(((unsigned)h) << 16);
}

__device__ __forceinline__ bf16 f32_to_bf16(float x) {
    unsigned b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        // NaN: truncation alone could leave an infinity; set the quiet bit, keep the sign.
        return (bf16)((b >> 16) | 0x0040u);
    }
    // Adding 0x7fff rounds up past halfway; the extra 1 when the kept part is odd makes an
    // exact tie round only to an even result.
    unsigned bias = 0x7fffu + ((b >> 16) & 1u);
    return (bf16)((b + bias) >> 16);
}

// Loads and stores of a storage type in f32.
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = f32_to_bf16(v); }

#define GANY_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ long long global_tid() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_threads() {
    return (long long)gridDim.x * blockDim.x;
}

// Wide accesses for the memory-bound kernels. A warp's 4-byte loads move 128 bytes a request,
// and with one such load in flight per thread an H100/H200 keeps about 1 MB in flight across
// its SMs, where HBM at ~4.8 TB/s and ~600 ns asks for about 3 MB (Little's law, not measured):
// scalar f32 kernels top out near a third of the bandwidth, bf16 lower. These kernels move GANY_VW
// consecutive elements per access instead (16 bytes of f32, 8 of bf16) wherever every array
// they touch starts on such a boundary, and single elements otherwise and for the tail. Each
// element's arithmetic is the same on both paths, so results are bitwise the scalar loop's
// (sums aside: they add in another order).
#define GANY_VW 4

template <class T>
struct __align__(sizeof(T) * GANY_VW) gany_vec {
    T v[GANY_VW];
};
// The width of one step of an elementwise loop, as a type (a generic lambda's `auto` argument).
template <int W>
struct gany_width {
    static constexpr int n = W;
};

template <class T>
__device__ __forceinline__ bool vec_aligned1(const T* p) {
    return (unsigned long long)p % (sizeof(T) * GANY_VW) == 0;
}
// Whether every pointer starts on a GANY_VW-element boundary of its type.
template <class... T>
__device__ __forceinline__ bool vec_aligned(const T*... p) {
    return (true && ... && vec_aligned1(p));
}

template <class T>
__device__ __forceinline__ gany_vec<T> vload(const T* p) {
#ifdef GANY_HOST
    // The device faults on a misaligned wide access; the host would not notice one.
    if (!vec_aligned1(p)) gany_misaligned(p);
    gany_wide_count++;
    gany_vec<T> t;
    __builtin_memcpy(&t, p, sizeof t);
    return t;
#else
    return *reinterpret_cast<const gany_vec<T>*>(p);
#endif
}
template <class T>
__device__ __forceinline__ void vstore(T* p, const gany_vec<T>& t) {
#ifdef GANY_HOST
    if (!vec_aligned1(p)) gany_misaligned(p);
    gany_wide_count++;
    __builtin_memcpy(p, &t, sizeof t);
#else
    *reinterpret_cast<gany_vec<T>*>(p) = t;
#endif
}

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(bf16 h) { return bf16_to_f32(h); }
__device__ __forceinline__ void narrow(float* d, float x) { *d = x; }
__device__ __forceinline__ void narrow(bf16* d, float x) { *d = f32_to_bf16(x); }

// x[0..W) = the W elements at p in f32 (W == GANY_VW: one access, p aligned).
template <int W, class T>
__device__ __forceinline__ void ldw(float (&x)[W], const T* p) {
    if constexpr (W == 1) {
        x[0] = ld(p);
    } else {
        static_assert(W == GANY_VW, "a wide access is GANY_VW elements");
        const gany_vec<T> t = vload(p);
#pragma unroll
        for (int k = 0; k < W; k++) x[k] = widen(t.v[k]);
    }
}
// The W values x[0..W) stored at p in its storage.
template <int W, class T>
__device__ __forceinline__ void stw(T* p, const float (&x)[W]) {
    if constexpr (W == 1) {
        st(p, x[0]);
    } else {
        static_assert(W == GANY_VW, "a wide access is GANY_VW elements");
        gany_vec<T> t;
#pragma unroll
        for (int k = 0; k < W; k++) narrow(&t.v[k], x[k]);
        vstore(p, t);
    }
}

// W elements from s to d: the bits where the storages match, else rounded (f32 into bf16).
template <int W, class T>
__device__ __forceinline__ void copyw(T* d, const T* s) {
    if constexpr (W == 1) {
        *d = *s;
    } else {
        vstore(d, vload(s));
    }
}
template <int W>
__device__ __forceinline__ void copyw(bf16* d, const float* s) {
    float x[W];
    ldw(x, s);
    stw(d, x);
}

// Whether rows of dim elements at these arrays (each row's start a multiple of dim from its
// array's) can move GANY_VW elements at a time.
template <class... T>
__device__ __forceinline__ bool rows_wide(int dim, const T*... p) {
    return dim % GANY_VW == 0 && vec_aligned(p...);
}

// The block-strided loop over one row of dim elements (one block a row): body(i,
// gany_width<W>) takes elements i .. i + W, W = GANY_VW where `wide` (dim a multiple of
// GANY_VW and every row's start aligned), else 1.
template <class F>
__device__ __forceinline__ void row_loop(int dim, bool wide, F body) {
    if (wide) {
        for (int i = threadIdx.x * GANY_VW; i < dim; i += blockDim.x * GANY_VW)
            body(i, gany_width<GANY_VW>{});
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) body(i, gany_width<1>{});
    }
}

// The grid-stride loop of an elementwise kernel over n elements: body(i, gany_width<W>) takes
// elements i .. i + W, W = GANY_VW where `wide` (every array aligned, see vec_aligned), then 1
// for what is left.
// ew_loop as thread `tid` of `threads` (a multi-tensor kernel's share of one tensor: the share
// that thread would have in that tensor's own launch).
template <class F>
__device__ __forceinline__ void ew_loop_as(long long n, bool wide, long long tid,
                                           long long threads, F body) {
    long long done = 0;
    if (wide) {
        const long long nv = n / GANY_VW;
        for (long long j = tid; j < nv; j += threads) body(j * GANY_VW, gany_width<GANY_VW>{});
        done = nv * GANY_VW;
    }
    for (long long i = done + tid; i < n; i += threads) body(i, gany_width<1>{});
}
template <class F>
__device__ __forceinline__ void ew_loop(long long n, bool wide, F body) {
    ew_loop_as(n, wide, global_tid(), grid_threads(), body);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

// The row of a kernel that gives each short row a warp (a block's warps take consecutive rows).
__device__ __forceinline__ long long warp_row() {
    return (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

// Sum over a 1-D block whose size is a multiple of 32 (at most 1024); every thread gets the
// total. The order is fixed (per warp, then warps in order), so results are deterministic.
// Reuses its shared scratch, so it starts with a barrier for back-to-back calls.
template <class T>
__device__ __forceinline__ T block_sum(T v) {
    GANY_SHARED(T, part, [32]);
    GANY_REQUIRE(blockDim.x % 32 == 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    T t = lane < warps ? part[lane] : (T)0;
    return warp_sum(t);
}

// The f64 sum of squares of thread `tid`'s share (of `threads`, as ew_loop_as) of x's n
// elements, summed over the block (every thread gets it): one block's partial of a sum of
// squares, in one order wherever it is taken.
template <class T>
__device__ double sumsq_share(const T* x, long long n, long long tid, long long threads) {
    double s = 0.0;
    ew_loop_as(n, vec_aligned(x), tid, threads, [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float v[W];
        ldw(v, x + i);
#pragma unroll
        for (int k = 0; k < W; k++) s += (double)v[k] * (double)v[k];
    });
    return block_sum(s);
}

__device__ __forceinline__ float block_max(float v) {
    GANY_SHARED(float, part, [32]);
    GANY_REQUIRE(blockDim.x % 32 == 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < warps ? part[lane] : GANY_NEG_INF;
    return warp_max(t);
}

// Exclusive prefix sum of v over a 1-D block (size a multiple of 32); *total gets the sum.
__device__ __forceinline__ unsigned block_exclusive_scan(unsigned v, unsigned* total) {
    GANY_SHARED(unsigned, warp_tot, [32]);
    GANY_REQUIRE(blockDim.x % 32 == 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned inc = v;
    for (int d = 1; d < 32; d <<= 1) {
        unsigned o = __shfl_up_sync(0xffffffffu, inc, d);
        if (lane >= d) inc += o;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    unsigned before = 0, all = 0;
    for (int w = 0; w < warps; w++) {
        if (w < warp) before += warp_tot[w];
        all += warp_tot[w];
    }
    *total = all;
    return before + inc - v;
}

// Tensor cores (attention.cu, gemm.cu). Fragment layouts: attention.cu's tensor-core section.
// c += a b on the tensor cores.
__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned* a, const unsigned* b) {
#if defined(GANY_HOST)
    gany_mma_m16n8k16_bf16(c, a, b);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}

// Two bf16 as one operand register, x in the low half.
__device__ __forceinline__ unsigned pack_bf16(float x, float y) {
    return (unsigned)f32_to_bf16(x) | ((unsigned)f32_to_bf16(y) << 16);
}

#endif

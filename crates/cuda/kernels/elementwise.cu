// Elementwise kernels and reductions over flat arrays (Blas's vector ops, casts, SwiGLU).
// Compiled after common.cuh (see src/sources.rs).
//
// Launch: 1-D, any grid and block (grid-stride loops), unless a kernel says otherwise.

// n 32-bit words set to 0 (f32 and f64 zeros, u32 counts): what a zeroing upload from the host
// would do, without one (a pageable upload may wait for the stream).
extern "C" __global__ void zero_u32(unsigned* dst, long long n) {
    ew_loop(n, vec_aligned(dst), [&](long long i, auto w) {
        if constexpr (decltype(w)::n == 1) {
            dst[i] = 0u;
        } else {
            vstore(dst + i, gany_vec<unsigned>{});
        }
    });
}

// dst = src, rounded or widened by the storages' ld/st.
template <class D, class S>
__device__ void cast(D* dst, const S* src, long long n) {
    ew_loop(n, vec_aligned(dst, src), [&](long long i, auto w) {
        float x[decltype(w)::n];
        ldw(x, src + i);
        stw(dst + i, x);
    });
}
extern "C" __global__ void cast_f32_to_bf16(bf16* dst, const float* src, long long n) {
    cast(dst, src, n);
}
extern "C" __global__ void cast_bf16_to_f32(float* dst, const bf16* src, long long n) {
    cast(dst, src, n);
}

// y += alpha * x; y *= alpha; y += x (Blas's vector ops; bf16 for bf16 activations).
template <class T>
__device__ void axpy(T* y, float alpha, const T* x, long long n) {
    ew_loop(n, vec_aligned(y, x), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float a[W], b[W];
        ldw(a, y + i);
        ldw(b, x + i);
#pragma unroll
        for (int k = 0; k < W; k++) a[k] = a[k] + alpha * b[k];
        stw(y + i, a);
    });
}
template <class T>
__device__ void scale(T* y, float alpha, long long n) {
    ew_loop(n, vec_aligned(y), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float a[W];
        ldw(a, y + i);
#pragma unroll
        for (int k = 0; k < W; k++) a[k] = a[k] * alpha;
        stw(y + i, a);
    });
}
template <class T>
__device__ void add(T* y, const T* x, long long n) {
    axpy(y, 1.0f, x, n);  // 1·x is exact, fused or not: the bits of y + x
}

#define GANY_VECTOR_OPS(S, T)                                                                    \
    extern "C" __global__ void axpy_##S(T* y, float alpha, const T* x, long long n) {            \
        axpy(y, alpha, x, n);                                                                    \
    }                                                                                            \
    extern "C" __global__ void scale_##S(T* y, float alpha, long long n) { scale(y, alpha, n); } \
    extern "C" __global__ void add_##S(T* y, const T* x, long long n) { add(y, x, n); }
GANY_VECTOR_OPS(f32, float)
GANY_VECTOR_OPS(bf16, bf16)

// Sum of squares in two deterministic passes (no floating-point atomics): each block writes
// the f64 sum of its grid-stride share to partial[blockIdx.x]; then sum_acc_f64 adds the
// partials, in order, to acc[0]. Block size a multiple of 32.
template <class T>
__device__ void sumsq_partial(double* partial, const T* x, long long n) {
    const double s = sumsq_share(x, n, global_tid(), grid_threads());
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
extern "C" __global__ void sumsq_partial_f32(double* partial, const float* x, long long n) {
    sumsq_partial(partial, x, n);
}
extern "C" __global__ void sumsq_partial_bf16(double* partial, const bf16* x, long long n) {
    sumsq_partial(partial, x, n);
}

// acc[0] += Σ partial[0..n). One block, size a multiple of 32.
extern "C" __global__ void sum_acc_f64(double* acc, const double* partial, int n) {
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
    s = block_sum(s);
    if (threadIdx.x == 0) acc[0] += s;
}

// The sum of squares of many f32 tensors (a step's gradients) in two launches, with the bits of
// one sumsq_partial_f32 + sum_acc_f64 pair per tensor in table order. `table` holds four i64
// per tensor: its address, its length n, the blocks b that sumsq_partial_f32 would take for it
// and where its partials start. Pass 1, grid (the largest b, tensors): block x of tensor y,
// x < b, writes the f64 sum of its share (the grid-stride share of a b-block launch) to
// partial[start + x].
extern "C" __global__ void sumsq_partial_multi_f32(double* partial, const long long* table) {
    const long long* t = table + 4 * (long long)blockIdx.y;
    const long long n = t[1], b = t[2];
    if ((long long)blockIdx.x >= b) return;  // the whole block: no barrier is left waiting
    // sumsq_partial, as that block of a b-block launch.
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const double s = sumsq_share((const float*)t[0], n, tid, b * blockDim.x);
    if (threadIdx.x == 0) partial[t[3] + blockIdx.x] = s;
}

// Pass 2, one block (size a multiple of 32): acc[0] += each tensor's partials' sum, tensor by
// tensor, each sum in sum_acc_f64's order.
extern "C" __global__ void sum_acc_multi_f64(double* acc, const double* partial,
                                             const long long* table, int count) {
    for (int y = 0; y < count; y++) {
        const long long b = table[4 * y + 2], start = table[4 * y + 3];
        double s = 0.0;
        for (long long i = threadIdx.x; i < b; i += blockDim.x) s += partial[start + i];
        s = block_sum(s);
        if (threadIdx.x == 0) acc[0] += s;
    }
}

// SwiGLU: out = silu(gate) * up, in the CPU backend's order of operations.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(0.0f - g)); }

// O, the output's storage, may be bf16 where T is f32: the f32 result rounded once (the rows a
// bf16-input GEMM reads next).
template <class O, class T>
__device__ void swiglu_fwd(O* out, const T* gate, const T* up, long long n) {
    ew_loop(n, vec_aligned(out, gate, up), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float g[W], u[W], o[W];
        ldw(g, gate + i);
        ldw(u, up + i);
#pragma unroll
        for (int k = 0; k < W; k++) o[k] = g[k] * sigmoid(g[k]) * u[k];
        stw(out + i, o);
    });
}
// dgate, dup overwritten.
template <class O, class T>
__device__ void swiglu_bwd(O* dgate, O* dup, const T* dout, const T* gate, const T* up,
                           long long n) {
    ew_loop(n, vec_aligned(dgate, dup, dout, gate, up), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float d[W], g[W], u[W], dg[W], du[W];
        ldw(d, dout + i);
        ldw(g, gate + i);
        ldw(u, up + i);
#pragma unroll
        for (int k = 0; k < W; k++) {
            const float s = sigmoid(g[k]);
            du[k] = d[k] * g[k] * s;
            dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
        }
        stw(dup + i, du);
        stw(dgate + i, dg);
    });
}
// swiglu_forward_f32, _bf16 (one storage) and _f32_to_bf16 (f32 inputs, bf16 outputs).
#define GANY_SWIGLU(S, O, T)                                                                    \
    extern "C" __global__ void swiglu_forward_##S(O* out, const T* gate, const T* up,           \
                                                  long long n) {                                \
        swiglu_fwd(out, gate, up, n);                                                           \
    }                                                                                           \
    extern "C" __global__ void swiglu_backward_##S(O* dgate, O* dup, const T* dout,             \
                                                   const T* gate, const T* up, long long n) {   \
        swiglu_bwd(dgate, dup, dout, gate, up, n);                                              \
    }
GANY_SWIGLU(f32, float, float)
GANY_SWIGLU(bf16, bf16, bf16)
GANY_SWIGLU(f32_to_bf16, bf16, float)

// Elementwise kernels and reductions over flat arrays (Blas's vector ops, casts, SwiGLU).
// Compiled after common.cuh (see src/sources.rs).
//
// Launch: 1-D, any grid and block (grid-stride loops), unless a kernel says otherwise.

// n 32-bit words set to 0 (f32 and f64 zeros, u32 counts): what a zeroing upload from the host
// would do, without one (a pageable upload may wait for the stream).
extern "C" __global__ void zero_u32(unsigned* dst, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) dst[i] = 0u;
}

extern "C" __global__ void cast_f32_to_bf16(bf16* dst, const float* src, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) dst[i] = f32_to_bf16(src[i]);
}

extern "C" __global__ void cast_bf16_to_f32(float* dst, const bf16* src, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) dst[i] = bf16_to_f32(src[i]);
}

// y += alpha * x; y *= alpha; y += x (Blas's vector ops; bf16 for bf16 activations).
template <class T>
__device__ void axpy(T* y, float alpha, const T* x, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads())
        st(y + i, ld(y + i) + alpha * ld(x + i));
}
template <class T>
__device__ void scale(T* y, float alpha, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) st(y + i, ld(y + i) * alpha);
}
template <class T>
__device__ void add(T* y, const T* x, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) st(y + i, ld(y + i) + ld(x + i));
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
    double s = 0.0;
    for (long long i = global_tid(); i < n; i += grid_threads()) {
        double v = (double)ld(x + i);
        s += v * v;
    }
    s = block_sum(s);
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

// SwiGLU: out = silu(gate) * up, in the CPU backend's order of operations.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(0.0f - g)); }

// O, the output's storage, may be bf16 where T is f32: the f32 result rounded once (the rows a
// bf16-input GEMM reads next).
template <class O, class T>
__device__ void swiglu_fwd(O* out, const T* gate, const T* up, long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) {
        float g = ld(gate + i), u = ld(up + i);
        st(out + i, g * sigmoid(g) * u);
    }
}
// dgate, dup overwritten.
template <class O, class T>
__device__ void swiglu_bwd(O* dgate, O* dup, const T* dout, const T* gate, const T* up,
                           long long n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) {
        float d = ld(dout + i), g = ld(gate + i), u = ld(up + i);
        float s = sigmoid(g);
        st(dup + i, d * g * s);
        st(dgate + i, d * u * s * (1.0f + g * (1.0f - s)));
    }
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

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

// Sum over a 1-D block whose size is a multiple of 32 (at most 1024); every thread gets the
// total. The order is fixed (per warp, then warps in order), so results are deterministic.
// Reuses its shared scratch, so it starts with a barrier for back-to-back calls.
template <class T>
__device__ __forceinline__ T block_sum(T v) {
    __shared__ T part[32];
    GANY_REQUIRE(blockDim.x % 32 == 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    T t = lane < warps ? part[lane] : (T)0;
    return warp_sum(t);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
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
    __shared__ unsigned warp_tot[32];
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

#endif

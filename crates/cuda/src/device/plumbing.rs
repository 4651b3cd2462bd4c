//! The backend's own small kernels, compiled with the model's.

/// The kernels [`PLUMBING`] defines, in order: the slots of the backend's table of their
/// functions, each looked up at its first launch.
pub const PLUMBING_KERNELS: [&str; 7] = [
    "ganymede_cast_f32_to_bf16",
    "ganymede_sumsq_acc_f32",
    "ganymede_sumsq_acc_bf16",
    "ganymede_mirror_lower_f32",
    "ganymede_mirror_lower_batched_f32",
    "ganymede_cast_bf16_to_f32",
    "ganymede_mirror_lower_batched_f32_to_bf16",
];

/// The backend's own small kernels (casts, the f64 sum of squares, syrk's mirror), beside the model's in `sources::SOURCES`.
pub const PLUMBING: (&str, &str) = (
    "ganymede_plumbing.cu",
    r#"
// f32 to bf16 rounding to nearest even; NaN stays NaN (quieted, sign kept), as
// ganymede_core::bf16::from_f32 does bit for bit.
__device__ unsigned short ganymede_bf16_rne(float v) {
    unsigned int b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

extern "C" __global__ void ganymede_cast_f32_to_bf16(unsigned short* dst, const float* src,
                                                     unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = ganymede_bf16_rne(src[i]);
    }
}

// acc[0] += sum of x[i]^2 in f64 (the gradient norm's accumulator): a grid-stride sum per
// thread, a tree in shared memory per block (blockDim.x = 256), one atomic per block.
__device__ void ganymede_block_add(double* acc, double s) {
    __shared__ double part[256];
    part[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(acc, part[0]);
}

extern "C" __global__ void ganymede_sumsq_acc_f32(double* acc, const float* x,
                                                  unsigned long long n) {
    double s = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        double v = x[i];
        s += v * v;
    }
    ganymede_block_add(acc, s);
}

extern "C" __global__ void ganymede_sumsq_acc_bf16(double* acc, const unsigned short* x,
                                                   unsigned long long n) {
    double s = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        double v = __uint_as_float(((unsigned int)x[i]) << 16);
        s += v * v;
    }
    ganymede_block_add(acc, s);
}

// Row-major C [n, n] with row stride ldc: the strictly lower triangle copied onto the upper one
// (cuBLAS's syrk writes one triangle; the seam wants both), and the float whose bits are the
// low half of `diag_bits` added to the diagonal (Syrk::diag).
extern "C" __global__ void ganymede_mirror_lower_f32(float* c, unsigned long long n,
                                                     unsigned long long ldc,
                                                     unsigned long long diag_bits) {
    float diag = __uint_as_float((unsigned int)diag_bits);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n * n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long r = i / n, col = i % n;
        if (r > col) c[col * ldc + r] = c[r * ldc + col];
        if (r == col && diag != 0.0f) c[r * ldc + r] += diag;
    }
}

// ganymede_mirror_lower_f32 on `batch` such matrices, the i-th at c + i * stride.
extern "C" __global__ void ganymede_mirror_lower_batched_f32(float* c, unsigned long long n,
                                                             unsigned long long ldc,
                                                             unsigned long long diag_bits,
                                                             unsigned long long stride,
                                                             unsigned long long batch) {
    float diag = __uint_as_float((unsigned int)diag_bits);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < batch * n * n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long j = i % (n * n), r = j / n, col = j % n;
        float* m = c + (i / (n * n)) * stride;
        if (r > col) m[col * ldc + r] = m[r * ldc + col];
        if (r == col && diag != 0.0f) m[r * ldc + r] += diag;
    }
}

extern "C" __global__ void ganymede_cast_bf16_to_f32(float* dst, const unsigned short* src,
                                                     unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = __uint_as_float(((unsigned int)src[i]) << 16);
    }
}

// ganymede_mirror_lower_batched_f32 read from `w` (left as it is) and written rounded to bf16
// into `c16`, laid out as `w`: each matrix's lower triangle, its mirror and its diagonal plus
// the term, the bits of that kernel followed by ganymede_cast_f32_to_bf16 in one pass
// (Newton-Schulz's iterates kept in bf16).
extern "C" __global__ void ganymede_mirror_lower_batched_f32_to_bf16(
    unsigned short* c16, const float* w, unsigned long long n, unsigned long long ldc,
    unsigned long long diag_bits, unsigned long long stride, unsigned long long batch) {
    float diag = __uint_as_float((unsigned int)diag_bits);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < batch * n * n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long j = i % (n * n), r = j / n, col = j % n;
        unsigned long long base = (i / (n * n)) * stride;
        float v = r >= col ? w[base + r * ldc + col] : w[base + col * ldc + r];
        if (r == col && diag != 0.0f) v += diag;
        c16[base + r * ldc + col] = ganymede_bf16_rne(v);
    }
}
"#,
);

#[cfg(test)]
mod tests {
    #[test]
    fn the_plumbing_kernels_are_listed_in_order() {
        let found = crate::device::nvrtc::kernel_names(super::PLUMBING.1);
        assert_eq!(found, super::PLUMBING_KERNELS);
    }
}

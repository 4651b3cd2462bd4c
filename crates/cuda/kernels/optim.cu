// The optimizers' elementwise updates on f32 master state, in the CPU backend's order of
// operations. Hyperparameters arrive as f32 rounded once from the f64 values on the host, as the
// CPU backend rounds them. Compiled after common.cuh (see src/sources.rs).
// Launch: 1-D, any grid and block (grid-stride loops), unless a kernel says otherwise.

// The step's gradient scale where the device worked it out (step_scale_f64): gsp, an f64 holding
// an f32 value, replaces gs; NaN stops the update (the kernel writes nothing). Null: gs as given.
__device__ __forceinline__ bool stopped(const double* gsp) { return gsp && *gsp != *gsp; }
// False where the kernel must return at once; else gs is the factor to apply.
__device__ __forceinline__ bool grad_scale(const double* gsp, float& gs) {
    if (stopped(gsp)) return false;
    if (gsp) gs = (float)*gsp;
    return true;
}

// The step's rate in device memory (ganymede_core::DeviceRate: [lr, bc1, bc2] in f64), from
// which a kernel works out the constants the host would pass, each f64 operation rounded as the
// host rounds it (no contraction) and the result rounded to f32 once: the same bits. With it
// the update launches are the same at every step (a CUDA graph's replay); null: the host's.
struct Rate {
    const double* r;
    // AdamW's keep = 1 − lr·wd, step = lr / bc1, inv_sqrt_bc2 = 1 / sqrt(bc2).
    __device__ void adamw(double wd, float& keep, float& step, float& inv_sqrt_bc2) const {
        if (!r) return;
        keep = (float)__dsub_rn(1.0, __dmul_rn(r[0], wd));
        step = (float)__ddiv_rn(r[0], r[1]);
        inv_sqrt_bc2 = (float)__ddiv_rn(1.0, __dsqrt_rn(r[2]));
    }
    // Muon's alpha = lr·scale and keep = 1 − lr·wd.
    __device__ void decay(double scale, double wd, float& alpha, float& keep) const {
        if (!r) return;
        alpha = (float)__dmul_rn(r[0], scale);
        keep = (float)__dsub_rn(1.0, __dmul_rn(r[0], wd));
    }
};

// AdamW on g = grad·gs (gs: the clip coefficient or 1, so clipping needs no pass of its own):
// m = b1·m + (1−b1)·g; v = b2·v + (1−b2)·g²; p = p·keep − step·m / (sqrt(v)·inv_sqrt_bc2 + eps)
// with keep = 1 − lr·wd, step = lr / bc1, inv_sqrt_bc2 = 1 / sqrt(bc2) (from `rate` where it is
// not null, see Rate). With p16 (not null) the new p also goes there, rounded to bf16 (the
// compute copy, without a cast pass of its own).
struct AdamW {
    float gs, b1, b2, omb1, omb2, keep, step, inv_sqrt_bc2, eps;
    // Thread `tid` of `threads` over one tensor of n elements.
    __device__ void run(float* p, float* m, float* v, const float* g, bf16* p16, long long n,
                        long long tid, long long threads) const {
        // Every load before any store: four independent accesses in flight per thread.
        const bool wide = vec_aligned(p, m, v, g) && (!p16 || vec_aligned(p16));
        ew_loop_as(n, wide, tid, threads, [&](long long i, auto w) {
            constexpr int W = decltype(w)::n;
            float gi[W], mi[W], vi[W], pi[W];
            ldw(gi, g + i);
            ldw(mi, m + i);
            ldw(vi, v + i);
            ldw(pi, p + i);
#pragma unroll
            for (int k = 0; k < W; k++) {
                gi[k] = gi[k] * gs;
                mi[k] = b1 * mi[k] + omb1 * gi[k];
                vi[k] = b2 * vi[k] + omb2 * gi[k] * gi[k];
                pi[k] = pi[k] * keep - step * mi[k] / (sqrtf(vi[k]) * inv_sqrt_bc2 + eps);
            }
            stw(m + i, mi);
            stw(v + i, vi);
            stw(p + i, pi);
            if (p16) stw(p16 + i, pi);
        });
    }
};
extern "C" __global__ void adamw_step_f32(float* p, float* m, float* v, const float* g,
                                          long long n, float gs, const double* gsp, float b1,
                                          float b2, float omb1, float omb2, float keep, float step,
                                          float inv_sqrt_bc2, float eps, const double* rate,
                                          double wd) {
    if (!grad_scale(gsp, gs)) return;
    Rate{rate}.adamw(wd, keep, step, inv_sqrt_bc2);
    const AdamW a{gs, b1, b2, omb1, omb2, keep, step, inv_sqrt_bc2, eps};
    a.run(p, m, v, g, nullptr, n, global_tid(), grid_threads());
}
extern "C" __global__ void adamw_step_f32_rounded(float* p, float* m, float* v, const float* g,
                                                  bf16* p16, long long n, float gs,
                                                  const double* gsp, float b1, float b2,
                                                  float omb1, float omb2, float keep, float step,
                                                  float inv_sqrt_bc2, float eps,
                                                  const double* rate, double wd) {
    if (!grad_scale(gsp, gs)) return;
    Rate{rate}.adamw(wd, keep, step, inv_sqrt_bc2);
    const AdamW a{gs, b1, b2, omb1, omb2, keep, step, inv_sqrt_bc2, eps};
    a.run(p, m, v, g, p16, n, global_tid(), grid_threads());
}

// adamw_step_f32 (or _rounded) of many tensors in one launch: `table` holds eight i64 per
// tensor: p, m, v, g, p16 (0: no compute copy), n, the blocks b of its own launch, and its
// weight decay's f64 bits. Grid (the largest b, tensors): block x < b of tensor y takes the
// share block x of a b-block launch would (elementwise, so any share gives the same bits).
// keep = 1 − lr·wd per tensor, from the device rate or from `lr` (the host's, rounded as the
// host rounds it); step and inv_sqrt_bc2 as in adamw_step_f32.
extern "C" __global__ void adamw_step_multi_f32(const long long* table, float gs,
                                                const double* gsp, float b1, float b2,
                                                float omb1, float omb2, float step,
                                                float inv_sqrt_bc2, float eps,
                                                const double* rate, double lr) {
    if (!grad_scale(gsp, gs)) return;
    const long long* t = table + 8 * (long long)blockIdx.y;
    const long long b = t[6];
    if ((long long)blockIdx.x >= b) return;
    const double wd = __longlong_as_double(t[7]);
    float keep = (float)__dsub_rn(1.0, __dmul_rn(lr, wd));
    Rate{rate}.adamw(wd, keep, step, inv_sqrt_bc2);
    const AdamW a{gs, b1, b2, omb1, omb2, keep, step, inv_sqrt_bc2, eps};
    // This tensor's launch as adamw_step_f32 would make it alone: b blocks.
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    a.run((float*)t[0], (float*)t[1], (float*)t[2], (const float*)t[3], (bf16*)t[4], t[5], tid,
          b * blockDim.x);
}

// Nesterov momentum, in place on the gradient: g = g·gs; buf = mu·buf + g; g = g + mu·buf (the
// new buf). gsp as in adamw_step_f32.
extern "C" __global__ void nesterov_f32(float* buf, float* g, long long n, float mu, float gs,
                                        const double* gsp) {
    if (!grad_scale(gsp, gs)) return;
    ew_loop(n, vec_aligned(buf, g), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float gi[W], b[W];
        ldw(gi, g + i);
        ldw(b, buf + i);
#pragma unroll
        for (int k = 0; k < W; k++) {
            gi[k] = gi[k] * gs;
            b[k] = mu * b[k] + gi[k];
            gi[k] = gi[k] + mu * b[k];
        }
        stw(buf + i, b);
        stw(g + i, gi);
    });
}

// x *= 1 / (sqrt(sumsq[0]) + eps), the factor in f64 rounded once: the last step of the
// Frobenius normalisation after sumsq_partial_f32 + sum_acc_f64 into a zeroed sumsq.
extern "C" __global__ void scale_by_inv_norm_f32(float* x, const double* sumsq, double eps,
                                                 long long n) {
    const float f = (float)(1.0 / (sqrt(sumsq[0]) + eps));
    ew_loop(n, vec_aligned(x), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float a[W];
        ldw(a, x + i);
#pragma unroll
        for (int k = 0; k < W; k++) a[k] *= f;
        stw(x + i, a);
    });
}

// Frobenius normalisation of `count` matrices of n elements stored one after another in x, in
// three launches whatever `count` (Newton–Schulz of an expert stack normalises every matrix on
// its own). Pass 1, grid (blocks, count), blockIdx.y the matrix: each block writes the f64 sum
// of squares of its grid-stride share of its matrix to partial[y·gridDim.x + x], the partials
// sumsq_partial_f32 writes for that matrix alone.
extern "C" __global__ void sumsq_partial_strided_f32(double* partial, const float* x,
                                                     long long n) {
    const float* xm = x + (long long)blockIdx.y * n;
    const double s = sumsq_share(xm, n, global_tid(), grid_threads());
    if (threadIdx.x == 0) partial[(long long)blockIdx.y * gridDim.x + blockIdx.x] = s;
}

// Pass 2, one block of 256 per matrix: sums[y] = Σ partial[y·blocks ..+blocks), in the order
// sum_acc_f64 (256 threads) adds one matrix's partials to a zeroed accumulator.
extern "C" __global__ void sum_rows_f64(double* sums, const double* partial, int blocks) {
    const double* pm = partial + (long long)blockIdx.x * blocks;
    double s = 0.0;
    for (int i = threadIdx.x; i < blocks; i += blockDim.x) s += pm[i];
    s = block_sum(s);
    if (threadIdx.x == 0) sums[blockIdx.x] = 0.0 + s;
}

// Pass 3, pass 1's grid: matrix y times 1 / (sqrt(sums[y]) + eps), as scale_by_inv_norm_f32.
extern "C" __global__ void scale_by_inv_norm_strided_f32(float* x, const double* sums, double eps,
                                                         long long n) {
    const float f = (float)(1.0 / (sqrt(sums[blockIdx.y]) + eps));
    float* xm = x + (long long)blockIdx.y * n;
    ew_loop(n, vec_aligned(xm), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float a[W];
        ldw(a, xm + i);
#pragma unroll
        for (int k = 0; k < W; k++) a[k] *= f;
        stw(xm + i, a);
    });
}

// Pass 3 for Newton–Schulz in bf16 (issue 32): xb = bf16(x·f) for matrix y, f as above, x
// left as it is. The same bits as scale_by_inv_norm_strided_f32 then cast_f32_to_bf16, in one
// pass that reads 4 bytes and writes 2 an element instead of reading 8 and writing 6: the
// iteration's first operand straight from the normalisation.
extern "C" __global__ void scale_by_inv_norm_strided_f32_to_bf16(bf16* xb, const float* x,
                                                                 const double* sums, double eps,
                                                                 long long n) {
    const float f = (float)(1.0 / (sqrt(sums[blockIdx.y]) + eps));
    const float* xm = x + (long long)blockIdx.y * n;
    bf16* om = xb + (long long)blockIdx.y * n;
    ew_loop(n, vec_aligned(xm, om), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float a[W];
        ldw(a, xm + i);
#pragma unroll
        for (int k = 0; k < W; k++) a[k] *= f;
        stw(om + i, a);
    });
}

// p = p·keep − alpha·u, keep = 1 − decay; ROUND: the new p also into p16 in bf16.
template <bool ROUND>
__device__ void decay_update(float* p, const float* u, bf16* p16, long long n, float alpha,
                             float keep) {
    ew_loop(n, vec_aligned(p, u) && (!ROUND || vec_aligned(p16)), [&](long long i, auto w) {
        constexpr int W = decltype(w)::n;
        float a[W], b[W];
        ldw(a, p + i);
        ldw(b, u + i);
#pragma unroll
        for (int k = 0; k < W; k++) a[k] = a[k] * keep - alpha * b[k];
        stw(p + i, a);
        if constexpr (ROUND) stw(p16 + i, a);
    });
}
// gate: the step's device gradient scale or null; NaN stops the update, as in adamw_step_f32.
// rate: as there, alpha = lr·scale and keep = 1 − lr·wd from the device's lr.
extern "C" __global__ void decay_update_f32(float* p, const float* u, long long n, float alpha,
                                            float keep, const double* gate, const double* rate,
                                            double scale, double wd) {
    if (stopped(gate)) return;
    Rate{rate}.decay(scale, wd, alpha, keep);
    decay_update<false>(p, u, nullptr, n, alpha, keep);
}
extern "C" __global__ void decay_update_f32_rounded(float* p, const float* u, bf16* p16,
                                                    long long n, float alpha, float keep,
                                                    const double* gate, const double* rate,
                                                    double scale, double wd) {
    if (stopped(gate)) return;
    Rate{rate}.decay(scale, wd, alpha, keep);
    decay_update<true>(p, u, p16, n, alpha, keep);
}

// The step's gradient scale from sums (n f64: the global squared gradient norm, then figures
// that must be finite too), as the host's step_scale_value: NaN where one is not finite, else
// max_norm / (norm + 1e-6) rounded to f32 where the norm exceeds max_norm > 0, else 1. One
// thread: the update kernels read it (their gsp) instead of the host reading the norm.
extern "C" __global__ void step_scale_f64(double* scale, const double* sums, long long n,
                                          double max_norm) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (long long i = 0; i < n; i++) {
        // d − d is 0 for a finite d and NaN for an infinity or a NaN (no fast math here).
        const double z = sums[i] - sums[i];
        if (z != 0.0) {
            scale[0] = z;
            return;
        }
    }
    const double norm = sqrt(sums[0]);
    double s = 1.0;
    if (max_norm > 0.0 && norm > max_norm) s = (double)(float)(max_norm / (norm + 1e-6));
    scale[0] = s;
}

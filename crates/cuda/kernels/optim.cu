// The optimizers' elementwise updates on f32 master state, in the CPU backend's order of
// operations. Hyperparameters arrive as f32 rounded once from the f64 values on the host, as the
// CPU backend rounds them. Compiled after common.cuh (see src/sources.rs).
// Launch: 1-D, any grid and block (grid-stride loops), unless a kernel says otherwise.

// AdamW: m = b1·m + (1−b1)·g; v = b2·v + (1−b2)·g²;
// p = p·keep − step·m / (sqrt(v)·inv_sqrt_bc2 + eps)
// with keep = 1 − lr·wd, step = lr / bc1, inv_sqrt_bc2 = 1 / sqrt(bc2).
extern "C" __global__ void adamw_step_f32(float* p, float* m, float* v, const float* g,
                                          long long n, float b1, float b2, float omb1, float omb2,
                                          float keep, float step, float inv_sqrt_bc2, float eps) {
    for (long long i = global_tid(); i < n; i += grid_threads()) {
        const float gi = g[i];
        const float mi = b1 * m[i] + omb1 * gi;
        const float vi = b2 * v[i] + omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * keep - step * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
    }
}

// Nesterov momentum, in place on the gradient: buf = mu·buf + g; g = g + mu·buf (the new buf).
extern "C" __global__ void nesterov_f32(float* buf, float* g, long long n, float mu) {
    for (long long i = global_tid(); i < n; i += grid_threads()) {
        const float gi = g[i];
        const float b = mu * buf[i] + gi;
        buf[i] = b;
        g[i] = gi + mu * b;
    }
}

// x *= 1 / (sqrt(sumsq[0]) + eps), the factor in f64 rounded once: the last step of the
// Frobenius normalisation after sumsq_partial_f32 + sum_acc_f64 into a zeroed sumsq.
extern "C" __global__ void scale_by_inv_norm_f32(float* x, const double* sumsq, double eps,
                                                 long long n) {
    const float f = (float)(1.0 / (sqrt(sumsq[0]) + eps));
    for (long long i = global_tid(); i < n; i += grid_threads()) x[i] *= f;
}

// p = p·keep − alpha·u, keep = 1 − decay.
extern "C" __global__ void decay_update_f32(float* p, const float* u, long long n, float alpha,
                                            float keep) {
    for (long long i = global_tid(); i < n; i += grid_threads()) p[i] = p[i] * keep - alpha * u[i];
}

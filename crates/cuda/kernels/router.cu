// The router: softmax over experts, top-k of probs + bias (ties: lower index first),
// renormalisation, per-expert sums of probabilities, and the backward. f32: the router runs in
// full precision. Compiled after common.cuh (see src/sources.rs).
//
// One warp per row: lane l holds experts l, l + 32, ... (at most 1024 experts).

// probs = softmax(logits); idx, weights = top-k; weights renormalised to sum to one if renorm.
// bias may be null. Launch: grid rows, block 32.
extern "C" __global__ void router_forward_f32(float* probs, float* weights, unsigned* idx,
                                              const float* logits, const float* bias,
                                              int experts, int k, int renorm) {
    GANY_REQUIRE(blockDim.x == 32 && experts <= 1024 && k >= 1 && k <= 32 && k <= experts);
    const int lane = threadIdx.x;
    const long long row = blockIdx.x;
    const float* l = logits + row * experts;
    float* p = probs + row * experts;
    float m = GANY_NEG_INF;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) {
        const float v = expf(l[e] - m);
        p[e] = v;
        sum += v;
    }
    sum = warp_sum(sum);
    const float inv = 1.0f / sum;
    for (int e = lane; e < experts; e += 32) p[e] *= inv;  // each lane rereads its own writes

    // Top-k: per round, each lane's best untaken expert, then a warp argmax (higher score, or
    // equal score and lower index). Lane j keeps the j-th weight.
    unsigned taken = 0;  // bit q: expert lane + 32 q chosen
    float my_w = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bv = 0.0f, bp = 0.0f;
        for (int e = lane, q = 0; e < experts; e += 32, q++) {
            if (taken & (1u << q)) continue;
            const float sc = bias ? p[e] + bias[e] : p[e];
            if (best < 0 || sc > bv) {
                best = e;
                bv = sc;
                bp = p[e];
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const int ob = __shfl_xor_sync(0xffffffffu, best, o);
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const float op = __shfl_xor_sync(0xffffffffu, bp, o);
            if (ob >= 0 && (best < 0 || ov > bv || (ov == bv && ob < best))) {
                best = ob;
                bv = ov;
                bp = op;
            }
        }
        if (best % 32 == lane) taken |= 1u << (best / 32);
        if (lane == j) my_w = bp;
        if (lane == 0) idx[row * k + j] = (unsigned)best;
    }
    if (renorm) {
        // The CPU's order: a sequential sum over j, then a division.
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += __shfl_sync(0xffffffffu, my_w, j);
        my_w /= s;
    }
    if (lane < k) weights[row * k + lane] = my_w;
}

// dlogits (overwritten) from dweights and the per-expert constant dprob_const (f64).
// Launch: grid rows, block 32.
// The auxiliary loss's constant of expert e is coef · counts[e] / tokens, in f64 (AuxGrad::at),
// from the layer's global counts on the device.
extern "C" __global__ void router_backward_f32(float* dlogits, const float* dweights,
                                               const float* probs, const unsigned* idx,
                                               const double* counts, double coef,
                                               double tokens, int experts, int k, int renorm) {
    GANY_REQUIRE(blockDim.x == 32);
    const int lane = threadIdx.x;
    const long long row = blockIdx.x;
    const float* p = probs + row * experts;
    const float* dw = dweights + row * k;
    const unsigned* ix = idx + row * k;
    float* dp = dlogits + row * experts;
    for (int e = lane; e < experts; e += 32) dp[e] = (float)(coef * counts[e] / tokens);
    __syncwarp();
    if (lane == 0) {
        // k is small: one lane, in the CPU's order.
        if (renorm) {
            float sum = 0.0f, dot = 0.0f;
            for (int j = 0; j < k; j++) sum += p[ix[j]];
            for (int j = 0; j < k; j++) dot += dw[j] * p[ix[j]] / sum;
            for (int j = 0; j < k; j++) dp[ix[j]] += (dw[j] - dot) / sum;
        } else {
            for (int j = 0; j < k; j++) dp[ix[j]] += dw[j];
        }
    }
    __syncwarp();
    float dot = 0.0f;
    for (int e = lane; e < experts; e += 32) dot += dp[e] * p[e];
    dot = warp_sum(dot);
    for (int e = lane; e < experts; e += 32) dp[e] = p[e] * (dp[e] - dot);
}

// Per-expert sums of probabilities, deterministically: partial[chunk, e] = Σ over the chunk's
// rows in f64 (chunk_rows = 64, the CPU backend's), then col_sum_set_f64.
// Launch: grid (ceil(cols / block), ceil(rows / chunk_rows)), 1-D block.
extern "C" __global__ void col_sum_partial_f64(double* partial, const float* x, int rows,
                                               int cols, int chunk_rows) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int r0 = blockIdx.y * chunk_rows;
    const int r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    double s = 0.0;
    for (int r = r0; r < r1; r++) s += (double)x[(long long)r * cols + c];
    partial[(long long)blockIdx.y * cols + c] = s;
}

// out[c] = Σ_p partial[p, c], p in order. Launch: 1-D, cols threads in all.
extern "C" __global__ void col_sum_set_f64(double* out, const double* partial, int parts,
                                           int cols) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    double s = 0.0;
    for (int p = 0; p < parts; p++) s += partial[(long long)p * cols + c];
    out[c] = s;
}

// Softmax cross-entropy over the vocabulary. Compiled after common.cuh (see src/sources.rs).

// lse[r] = log Σ exp(logits[r]), one pass over the row: each thread keeps an online (max, sum)
// over its share of the vocabulary (4 columns at a time where rows_wide allows), then the block
// merges them.
// Launch: grid rows, block a multiple of 32.
template <class T>
__device__ void ce_fwd(float* lse, const T* logits, int vocab) {
    const T* x = logits + (long long)blockIdx.x * vocab;
    float m = GANY_NEG_INF, s = 0.0f;
    row_loop(vocab, rows_wide(vocab, logits), [&](int i, auto w) {
        constexpr int W = decltype(w)::n;
        float v[W];
        ldw(v, x + i);
#pragma unroll
        for (int e = 0; e < W; e++) {
            if (v[e] > m) {
                s = s * expf(m - v[e]) + 1.0f;
                m = v[e];
            } else {
                s += expf(v[e] - m);
            }
        }
    });
    const float mx = block_max(m);
    s = m == GANY_NEG_INF ? 0.0f : s * expf(m - mx);
    s = block_sum(s);
    if (threadIdx.x == 0) lse[blockIdx.x] = mx + logf(s);
}

// loss[0] += Σ_r (lse[r] − logits[r, targets[r]]), each term rounded in f32 then summed in f64.
// Launch: one block, a multiple of 32.
template <class T>
__device__ void ce_loss_acc(double* loss, const float* lse, const T* logits,
                            const unsigned* targets, int rows, int vocab) {
    double s = 0.0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x)
        s += (double)(lse[r] - ld(logits + (long long)r * vocab + targets[r]));
    s = block_sum(s);
    if (threadIdx.x == 0) loss[0] += s;
}

// In place: logits = scale · (softmax − onehot(target)). Launch: grid rows, any 1-D block.
template <class T>
__device__ void ce_bwd(T* logits, const float* lse, const unsigned* targets, int vocab,
                       float scale) {
    T* x = logits + (long long)blockIdx.x * vocab;
    const float l = lse[blockIdx.x];
    const unsigned t = targets[blockIdx.x];
    row_loop(vocab, rows_wide(vocab, logits), [&](int i, auto w) {
        constexpr int W = decltype(w)::n;
        float v[W];
        ldw(v, x + i);
#pragma unroll
        for (int e = 0; e < W; e++) {
            v[e] = expf(v[e] - l) * scale;
            if ((unsigned)(i + e) == t) v[e] -= scale;
        }
        stw(x + i, v);
    });
}

#define GANY_CROSS_ENTROPY(S, T)                                                                 \
    extern "C" __global__ void cross_entropy_forward_##S(float* lse, const T* logits,            \
                                                         int vocab) {                            \
        ce_fwd(lse, logits, vocab);                                                              \
    }                                                                                            \
    extern "C" __global__ void cross_entropy_loss_acc_##S(double* loss, const float* lse,        \
                                                          const T* logits,                       \
                                                          const unsigned* targets, int rows,     \
                                                          int vocab) {                           \
        ce_loss_acc(loss, lse, logits, targets, rows, vocab);                                    \
    }                                                                                            \
    extern "C" __global__ void cross_entropy_backward_##S(T* logits, const float* lse,           \
                                                          const unsigned* targets, int vocab,    \
                                                          float scale) {                         \
        ce_bwd(logits, lse, targets, vocab, scale);                                              \
    }
GANY_CROSS_ENTROPY(f32, float)
GANY_CROSS_ENTROPY(bf16, bf16)

// RMSNorm and per-head RMSNorm + rotate-half RoPE, forward and backward, in the CPU backend's
// order of operations. Activations and weights are the storage type T; the saved 1/rms and the
// weight gradients are f32.
//
// Weight gradients are reduced without atomics, deterministically: a *_dw_partial kernel sums
// each chunk of rows per column (chunk_rows = 64, the CPU backend's RED_ROWS, for the same
// rounding), then col_sum_acc_f32 adds the chunks' sums in order into dw.
// Compiled after common.cuh (see src/sources.rs).

// out[c] += Σ_p partial[p * cols + c], p in order. Launch: 1-D, cols threads in all.
extern "C" __global__ void col_sum_acc_f32(float* out, const float* partial, int parts, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = out[c];
    for (int p = 0; p < parts; p++) acc += partial[(long long)p * cols + c];
    out[c] = acc;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm over rows of dim: out = w * (x * rstd), rstd = 1/sqrt(mean(x²) + eps).
// Launch: grid rows, block a multiple of 32.

template <class T>
__device__ void rmsnorm_fwd(T* out, float* rstd, const T* x, const T* w, int dim, float eps) {
    const long long row = blockIdx.x;
    const T* xr = x + row * dim;
    T* outr = out + row * dim;
    const bool wide = rows_wide(dim, out, x, w);
    float ss = 0.0f;
    row_loop(dim, wide, [&](int i, auto wd) {
        constexpr int W = decltype(wd)::n;
        float v[W];
        ldw(v, xr + i);
#pragma unroll
        for (int e = 0; e < W; e++) ss += v[e] * v[e];
    });
    ss = block_sum(ss);
    const float rs = 1.0f / sqrtf(ss * (1.0f / (float)dim) + eps);
    if (threadIdx.x == 0) rstd[row] = rs;
    row_loop(dim, wide, [&](int i, auto wd) {
        constexpr int W = decltype(wd)::n;
        float v[W], g[W];
        ldw(v, xr + i);
        ldw(g, w + i);
#pragma unroll
        for (int e = 0; e < W; e++) v[e] = g[e] * (v[e] * rs);
        stw(outr + i, v);
    });
}

// dx += ∂/∂x (the row's part). Launch: grid rows, block a multiple of 32.
template <class T>
__device__ void rmsnorm_bwd_dx(T* dx, const T* dout, const T* x, const T* w, const float* rstd,
                               int dim) {
    const long long off = (long long)blockIdx.x * dim;
    const float r = rstd[blockIdx.x];
    const bool wide = rows_wide(dim, dx, dout, x, w);
    float dot = 0.0f;
    row_loop(dim, wide, [&](int i, auto wd) {
        constexpr int W = decltype(wd)::n;
        float d[W], g[W], v[W];
        ldw(d, dout + off + i);
        ldw(g, w + i);
        ldw(v, x + off + i);
#pragma unroll
        for (int e = 0; e < W; e++) dot += d[e] * g[e] * v[e];
    });
    dot = block_sum(dot);
    const float c = dot * r * r / (float)dim;
    row_loop(dim, wide, [&](int i, auto wd) {
        constexpr int W = decltype(wd)::n;
        float a[W], d[W], g[W], v[W];
        ldw(a, dx + off + i);
        ldw(d, dout + off + i);
        ldw(g, w + i);
        ldw(v, x + off + i);
#pragma unroll
        for (int e = 0; e < W; e++) a[e] = a[e] + r * (d[e] * g[e] - v[e] * c);
        stw(dx + off + i, a);
    });
}

// partial[chunk, i] = Σ over the chunk's rows of dout * (x * rstd).
// Launch: grid (ceil(dim / block), ceil(rows / chunk_rows)), 1-D block.
template <class T>
__device__ void rmsnorm_bwd_dw_partial(float* partial, const T* dout, const T* x,
                                       const float* rstd, int rows, int dim, int chunk_rows) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= dim) return;
    const int r0 = blockIdx.y * chunk_rows;
    const int r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float s = 0.0f;
    for (int r = r0; r < r1; r++) {
        const long long o = (long long)r * dim + i;
        s += ld(dout + o) * (ld(x + o) * rstd[r]);
    }
    partial[(long long)blockIdx.y * dim + i] = s;
}

#define GANY_RMSNORM(S, T)                                                                       \
    extern "C" __global__ void rmsnorm_forward_##S(T* out, float* rstd, const T* x, const T* w,  \
                                                   int dim, float eps) {                         \
        rmsnorm_fwd(out, rstd, x, w, dim, eps);                                                  \
    }                                                                                            \
    extern "C" __global__ void rmsnorm_backward_dx_##S(T* dx, const T* dout, const T* x,          \
                                                       const T* w, const float* rstd, int dim) { \
        rmsnorm_bwd_dx(dx, dout, x, w, rstd, dim);                                               \
    }                                                                                            \
    extern "C" __global__ void rmsnorm_backward_dw_partial_##S(                                  \
        float* partial, const T* dout, const T* x, const float* rstd, int rows, int dim,          \
        int chunk_rows) {                                                                        \
        rmsnorm_bwd_dw_partial(partial, dout, x, rstd, rows, dim, chunk_rows);                   \
    }
GANY_RMSNORM(f32, float)
GANY_RMSNORM(bf16, bf16)

// ---------------------------------------------------------------------------------------------
// Per-head RMSNorm (weight of head_dim) then rotate-half RoPE. Rows of heads × head_dim; row r
// sits at position pos0 + r % seq. inv_freq holds the head_dim / 2 frequencies
// 1 / theta^(2i / head_dim) as the host computes them in f32 (host::rope_inv_freq, the CPU
// backend's arithmetic): angles reach thousands of radians, so a powf that differs by an ulp on
// the device would move them by ~1e-3.

// Row `row`'s RoPE position: pos0 plus its place in its sequence, from its document's start
// under document masking (docs: one u32 a row, or null).
__device__ __forceinline__ int rope_pos(int pos0, long long row, int seq, const unsigned* docs) {
    return pos0 + (int)(row % seq) - (docs ? (int)docs[row] : 0);
}

__device__ __forceinline__ void rope_cs(int i, const float* inv_freq, int pos, float* c,
                                        float* s) {
    const float a = inv_freq[i] * (float)pos;
    *c = cosf(a);
    *s = sinf(a);
}

// One warp per head row: a head row is short (head_dim 64 is 256 bytes of f32), and a block per
// row would leave an SM at its 32 resident blocks with little in flight; warps of one block take
// consecutive head rows and reduce with shuffles, no block barrier. Lane l takes the rotation's
// pairs (i, i + half) for i = l, l + 32, ...
// Launch: grid ceil(nrh / warps per block), block 32 × warps per block; nrh = rows × heads.
// out may be bf16 where x is f32 (the rows attention reads under bf16 compute: each value
// rounded once, as a cast of the f32 result would).
template <class T, class O>
__device__ void head_norm_rope_fwd(O* out, float* rstd, const T* x, const T* w, int heads,
                                   int hd, int seq, int pos0, const float* inv_freq, float eps,
                                   long long nrh, const unsigned* docs) {
    const long long rh = warp_row();
    if (rh >= nrh) return;  // the whole warp: no barrier follows
    const int lane = threadIdx.x & 31;
    const int row = (int)(rh / heads);
    const long long off = rh * hd;
    const int half = hd / 2;
    float ss = 0.0f;
    for (int i = lane; i < half; i += 32) {
        const float a = ld(x + off + i), b = ld(x + off + i + half);
        ss += a * a + b * b;
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss * (1.0f / (float)hd) + eps);
    if (lane == 0) rstd[rh] = rs;
    const int pos = rope_pos(pos0, row, seq, docs);
    for (int i = lane; i < half; i += 32) {
        float c, s;
        rope_cs(i, inv_freq, pos, &c, &s);
        const float a = ld(w + i) * (ld(x + off + i) * rs);
        const float b = ld(w + i + half) * (ld(x + off + i + half) * rs);
        st(out + off + i, a * c - b * s);
        st(out + off + i + half, b * c + a * s);
    }
}

// dx overwritten. dout may be bf16 where x is f32 (attention's bf16 gradients, read widened,
// as a cast to f32 would). Launch: as the forward.
template <class T, class G>
__device__ void head_norm_rope_bwd_dx(T* dx, const G* dout, const T* x, const T* w,
                                      const float* rstd, int heads, int hd, int seq, int pos0,
                                      const float* inv_freq, long long nrh,
                                      const unsigned* docs) {
    const long long rh = warp_row();
    if (rh >= nrh) return;
    const int lane = threadIdx.x & 31;
    const int row = (int)(rh / heads);
    const long long off = rh * hd;
    const int half = hd / 2;
    const int pos = rope_pos(pos0, row, seq, docs);
    const float r = rstd[rh];
    // The rotation's transpose takes the gradient back to the normed vector: g.
    float dot = 0.0f;
    for (int i = lane; i < half; i += 32) {
        float c, s;
        rope_cs(i, inv_freq, pos, &c, &s);
        const float da = ld(dout + off + i), db = ld(dout + off + i + half);
        const float ga = da * c + db * s, gb = db * c - da * s;
        dot += ga * ld(w + i) * ld(x + off + i);
        dot += gb * ld(w + i + half) * ld(x + off + i + half);
    }
    dot = warp_sum(dot);
    const float k = dot * r * r / (float)hd;
    for (int i = lane; i < half; i += 32) {
        float c, s;
        rope_cs(i, inv_freq, pos, &c, &s);
        const float da = ld(dout + off + i), db = ld(dout + off + i + half);
        const float ga = da * c + db * s, gb = db * c - da * s;
        st(dx + off + i, r * (ga * ld(w + i) - ld(x + off + i) * k));
        st(dx + off + i + half, r * (gb * ld(w + i + half) - ld(x + off + i + half) * k));
    }
}

// partial[chunk, i] = Σ over the chunk's head rows (rows × heads of them, a head row being one
// head of one position, in memory order) of g_i * (x_i * rstd). Chunks of head rows rather than
// of positions: with every head of a position in one thread's loop, a step's 16k positions
// gave the GPU too few threads, each with too long a loop.
// Launch: grid (ceil(head_dim / block), min(chunks, 65535)), 1-D block; a block takes chunks
// blockIdx.y, + gridDim.y, ...
template <class T, class G>
__device__ void head_norm_rope_bwd_dw_partial(float* partial, const G* dout, const T* x,
                                              const float* rstd, int rows, int heads, int hd,
                                              int seq, int pos0, const float* inv_freq,
                                              int chunk_rows, const unsigned* docs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hd) return;
    const int half = hd / 2;
    const int j = i < half ? i : i - half;  // the frequency of this column
    const long long total = (long long)rows * heads;
    const long long chunks = (total + chunk_rows - 1) / chunk_rows;
    for (long long ch = blockIdx.y; ch < chunks; ch += gridDim.y) {
        const long long r0 = ch * chunk_rows;
        const long long r1 = r0 + chunk_rows < total ? r0 + chunk_rows : total;
        float acc = 0.0f;
        for (long long hr = r0; hr < r1; hr++) {
            float c, s;
            rope_cs(j, inv_freq, rope_pos(pos0, hr / heads, seq, docs), &c, &s);
            const long long off = hr * hd;
            const float da = ld(dout + off + j), db = ld(dout + off + j + half);
            const float g = i < half ? da * c + db * s : db * c - da * s;
            acc += g * (ld(x + off + i) * rstd[hr]);
        }
        partial[ch * hd + i] = acc;
    }
}

// The `_doc_` kernels: the same with each row's document start (docs, u32 a row) taken off
// its position (document masking; the ops layer checks the starts).
#define GANY_HEAD_NORM_ROPE(S, T, G)                                                             \
    extern "C" __global__ void head_norm_rope_forward_##S(                                       \
        G* out, float* rstd, const T* x, const T* w, int heads, int head_dim, int seq, int pos0, \
        const float* inv_freq, float eps, long long nrh) {                                       \
        head_norm_rope_fwd(out, rstd, x, w, heads, head_dim, seq, pos0, inv_freq, eps, nrh,      \
                           nullptr);                                                             \
    }                                                                                            \
    extern "C" __global__ void head_norm_rope_backward_dx_##S(                                   \
        T* dx, const G* dout, const T* x, const T* w, const float* rstd, int heads,              \
        int head_dim, int seq, int pos0, const float* inv_freq, long long nrh) {                 \
        head_norm_rope_bwd_dx(dx, dout, x, w, rstd, heads, head_dim, seq, pos0, inv_freq, nrh,   \
                              nullptr);                                                          \
    }                                                                                            \
    extern "C" __global__ void head_norm_rope_backward_dw_partial_##S(                           \
        float* partial, const G* dout, const T* x, const float* rstd, int rows, int heads,       \
        int head_dim, int seq, int pos0, const float* inv_freq, int chunk_rows) {                \
        head_norm_rope_bwd_dw_partial(partial, dout, x, rstd, rows, heads, head_dim, seq, pos0,  \
                                      inv_freq, chunk_rows, nullptr);                            \
    }                                                                                            \
    extern "C" __global__ void head_norm_rope_forward_doc_##S(                                   \
        G* out, float* rstd, const T* x, const T* w, int heads, int head_dim, int seq, int pos0, \
        const float* inv_freq, float eps, long long nrh, const unsigned* docs) {                 \
        head_norm_rope_fwd(out, rstd, x, w, heads, head_dim, seq, pos0, inv_freq, eps, nrh,      \
                           docs);                                                                \
    }                                                                                            \
    extern "C" __global__ void head_norm_rope_backward_dx_doc_##S(                               \
        T* dx, const G* dout, const T* x, const T* w, const float* rstd, int heads,              \
        int head_dim, int seq, int pos0, const float* inv_freq, long long nrh,                   \
        const unsigned* docs) {                                                                  \
        head_norm_rope_bwd_dx(dx, dout, x, w, rstd, heads, head_dim, seq, pos0, inv_freq, nrh,   \
                              docs);                                                             \
    }                                                                                            \
    extern "C" __global__ void head_norm_rope_backward_dw_partial_doc_##S(                       \
        float* partial, const G* dout, const T* x, const float* rstd, int rows, int heads,       \
        int head_dim, int seq, int pos0, const float* inv_freq, int chunk_rows,                  \
        const unsigned* docs) {                                                                  \
        head_norm_rope_bwd_dw_partial(partial, dout, x, rstd, rows, heads, head_dim, seq, pos0,  \
                                      inv_freq, chunk_rows, docs);                               \
    }
GANY_HEAD_NORM_ROPE(f32, float, float)
GANY_HEAD_NORM_ROPE(bf16, bf16, bf16)
// f32 rows with bf16 attention-side values: the forward's output, the backward's dout.
GANY_HEAD_NORM_ROPE(f32_bf16, float, bf16)

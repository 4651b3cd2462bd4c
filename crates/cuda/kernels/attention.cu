// Causal grouped-query attention, fused and tiled (flash-attention style): scores live only in
// registers and shared memory, one key tile at a time, with an online softmax, so memory is
// O(T · head_dim), never T × T. Backward recomputes probabilities from the saved log-sum-exp.
// Compiled after common.cuh (see src/sources.rs).
//
// Layouts (as the seam's AttnDims): q, out, dout, dq: [batch, tq, heads, head_dim];
// k, v, dk, dv: [batch, tk, kv_heads, head_dim]; lse, delta: [batch, heads, tq] (f32). Query i
// sits at key position tk - tq + i and sees keys 0 ..= that. Query head h reads kv head
// h / (heads / kv_heads). head_dim <= 128. scale = 1/sqrt(head_dim), rounded from f64 on the host.
//
// Document masking (the `_doc_` kernels, `data.document_mask`): docs, u32 [batch, tq], holds the
// key position where each query's document starts; query i then sees keys docs[i] ..= tk - tq + i.
// Starts never decrease along a sequence (the seam's contract), so a block's first row has its
// smallest start (keys before it are skipped tile by tile) and the queries that see a key are a
// prefix of those after it (the backward's key blocks stop there).
//
// The SIMT backward runs without floating-point atomics, deterministically: one kernel per key
// tile accumulates dk and dv over every query that sees it, another per query tile accumulates
// dq (each recomputes the probabilities). The tensor-core backward does the same, or (fused,
// head_dim <= 64) adds dq atomically from the dk/dv pass as FlashAttention-2 does.

#define ATT_MAXD 128
#define ATT_BK 32   // keys per forward tile: one per lane
#define ATT_MAXW 16  // warps (query rows) per forward block: more rows share each K/V tile
#define ATT_BQ 8    // queries per backward tile
#define ATT_BKB 16  // keys per backward tile; backward blocks are ATT_BQ * ATT_BKB threads

// Under document masking, the first query (of a sequence's tq, starts lo) whose document starts
// after key j: no query from there on sees key j.
__device__ __forceinline__ int doc_query_end(const unsigned* lo, int tq, int j) {
    int a = 0, e = tq;
    while (a < e) {
        const int m = (a + e) / 2;
        if ((int)lo[m] <= j)
            a = m + 1;
        else
            e = m;
    }
    return a;
}

__device__ __forceinline__ long long q_off(int b, int i, int h, int tq, int heads, int hd) {
    return (((long long)b * tq + i) * heads + h) * hd;
}
__device__ __forceinline__ long long kv_off(int b, int j, int g, int tk, int kvh, int hd) {
    return (((long long)b * tk + j) * kvh + g) * hd;
}

// Forward: one warp per query row; the block's warps share each K/V tile. Lane l scores key
// j0 + l, then the warp folds the tile into its running max, sum and output. docs: document
// starts, or null.
// Launch: grid (ceil(tq / W), heads, batch), block 32 W threads, W <= 16.
template <class T>
__device__ void attn_fwd(T* out, float* lse, const T* q, const T* k, const T* v, int tq, int tk,
                         int heads, int kvh, int hd, float scale, const unsigned* docs) {
    GANY_SHARED(float, Ks, [ATT_BK][ATT_MAXD + 1]);  // +1: lanes read different rows, no conflicts
    GANY_SHARED(float, Vs, [ATT_BK][ATT_MAXD]);
    GANY_SHARED(float, Qs, [ATT_MAXW][ATT_MAXD]);
    GANY_SHARED(float, Ps, [ATT_MAXW][ATT_BK]);
    GANY_REQUIRE(hd <= ATT_MAXD && blockDim.x % 32 == 0 && blockDim.x <= 32 * ATT_MAXW);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kvh), off = tk - tq;
    const int i0 = blockIdx.x * W, i = i0 + w;
    const bool valid = i < tq;
    const long long qo = q_off(b, i, h, tq, heads, hd);
    if (valid)
        for (int d = lane; d < hd; d += 32) Qs[w][d] = ld(q + qo + d);
    const int last = (i0 + W < tq ? i0 + W : tq) - 1;
    const int kend = off + last + 1;  // keys the block's rows need
    const unsigned* lo = docs ? docs + (long long)b * tq : nullptr;
    const int ilo = lo && valid ? (int)lo[i] : 0;  // this row's first key
    float m = GANY_NEG_INF, l = 0.0f;
    float o[ATT_MAXD / 32];
    for (int c = 0; c < ATT_MAXD / 32; c++) o[c] = 0.0f;
    for (int j0 = lo ? (int)lo[i0] / ATT_BK * ATT_BK : 0; j0 < kend; j0 += ATT_BK) {
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_BK * hd; e += blockDim.x) {
            const int jj = e / hd, d = e % hd, j = j0 + jj;
            float kk = 0.0f, vv = 0.0f;
            if (j < tk) {
                const long long ko = kv_off(b, j, g, tk, kvh, hd) + d;
                kk = ld(k + ko);
                vv = ld(v + ko);
            }
            Ks[jj][d] = kk;
            Vs[jj][d] = vv;
        }
        __syncthreads();
        if (valid) {
            const int j = j0 + lane;
            float s = GANY_NEG_INF;
            if (j <= off + i && j < tk && j >= ilo) {
                float dot = 0.0f;
                for (int d = 0; d < hd; d++) dot += Qs[w][d] * Ks[lane][d];
                s = scale * dot;
            }
            // A row's first tile that holds one of its keys makes m finite (without documents
            // key 0, in the first tile); until then p and alpha are 0 and o, l stay 0.
            const float mn = fmaxf(m, warp_max(s));
            const float p = s == GANY_NEG_INF ? 0.0f : expf(s - mn);
            const float alpha = m == GANY_NEG_INF ? 0.0f : expf(m - mn);
            l = l * alpha + warp_sum(p);
            Ps[w][lane] = p;
            __syncwarp();
            for (int c = 0; c < ATT_MAXD / 32; c++) {
                const int d = lane + 32 * c;
                if (d < hd) {
                    float acc = 0.0f;
                    for (int jj = 0; jj < ATT_BK; jj++) acc += Ps[w][jj] * Vs[jj][d];
                    o[c] = o[c] * alpha + acc;
                }
            }
            __syncwarp();
            m = mn;
        }
    }
    if (valid) {
        const float inv = 1.0f / l;
        for (int c = 0; c < ATT_MAXD / 32; c++) {
            const int d = lane + 32 * c;
            if (d < hd) st(out + qo + d, o[c] * inv);
        }
        if (lane == 0) lse[((long long)b * heads + h) * tq + i] = m + logf(l);
    }
}

// delta[b, h, i] = dout_i · out_i, the softmax backward's row term: a warp per row of q's
// layout (nrows = batch * tq * heads of them), a block's warps on consecutive rows (a block per
// 128-byte row left an SM little in flight). Launch: grid ceil(nrows / warps per block), block a
// multiple of 32.
template <class T>
__device__ void attn_bwd_delta(float* delta, const T* dout, const T* out, int tq, int heads,
                               int hd, long long nrows) {
    const long long r = warp_row();
    if (r >= nrows) return;  // the whole warp
    const int lane = threadIdx.x & 31;
    float s = 0.0f;
    for (int d = lane; d < hd; d += 32) s += ld(dout + r * hd + d) * ld(out + r * hd + d);
    s = warp_sum(s);
    const long long h = r % heads, bi = r / heads, i = bi % tq, b = bi / tq;
    if (lane == 0) delta[(b * heads + h) * tq + i] = s;
}

// Loads rows i0 .. i0 + ATT_BQ of q and dout with their lse and delta (zeros past tq).
template <class T>
__device__ void load_query_tile(float (*Qs)[ATT_MAXD], float (*Ds)[ATT_MAXD], float* Ls,
                                float* Dl, const T* q, const T* dout, const float* lse,
                                const float* delta, int b, int h, int i0, int tq, int heads,
                                int hd) {
    for (int e = threadIdx.x; e < ATT_BQ * hd; e += blockDim.x) {
        const int ii = e / hd, d = e % hd, i = i0 + ii;
        float qq = 0.0f, dd = 0.0f;
        if (i < tq) {
            const long long o = q_off(b, i, h, tq, heads, hd) + d;
            qq = ld(q + o);
            dd = ld(dout + o);
        }
        Qs[ii][d] = qq;
        Ds[ii][d] = dd;
    }
    if (threadIdx.x < ATT_BQ) {
        const int i = i0 + threadIdx.x;
        const long long r = ((long long)b * heads + h) * tq + i;
        Ls[threadIdx.x] = i < tq ? lse[r] : 0.0f;
        Dl[threadIdx.x] = i < tq ? delta[r] : 0.0f;
    }
}

// Thread (qi, kj) of an ATT_BQ × ATT_BKB tile: P and dS = P (dP − delta), zero where masked.
__device__ __forceinline__ void tile_p_ds(float (*Qs)[ATT_MAXD], float (*Ds)[ATT_MAXD],
                                          float (*Ks)[ATT_MAXD + 1], float (*Vs)[ATT_MAXD + 1],
                                          const float* Ls, const float* Dl, int i0, int j0,
                                          int tq, int tk, int hd, float scale, float* p_out,
                                          float* ds_out, const unsigned* lo) {
    const int qi = threadIdx.x / ATT_BKB, kj = threadIdx.x % ATT_BKB;
    const int i = i0 + qi, j = j0 + kj, off = tk - tq;
    float p = 0.0f, ds = 0.0f;
    if (i < tq && j < tk && j <= off + i && (!lo || j >= (int)lo[i])) {
        float s = 0.0f, dp = 0.0f;
        for (int d = 0; d < hd; d++) {
            s += Qs[qi][d] * Ks[kj][d];
            dp += Ds[qi][d] * Vs[kj][d];
        }
        p = expf(scale * s - Ls[qi]);
        ds = p * (dp - Dl[qi]);
    }
    *p_out = p;
    *ds_out = ds;
}

template <class T>
__device__ void load_key_tile(float (*Ks)[ATT_MAXD + 1], float (*Vs)[ATT_MAXD + 1], const T* k,
                              const T* v, int b, int g, int j0, int tk, int kvh, int hd) {
    for (int e = threadIdx.x; e < ATT_BKB * hd; e += blockDim.x) {
        const int jj = e / hd, d = e % hd, j = j0 + jj;
        float kk = 0.0f, vv = 0.0f;
        if (j < tk) {
            const long long o = kv_off(b, j, g, tk, kvh, hd) + d;
            kk = ld(k + o);
            vv = ld(v + o);
        }
        Ks[jj][d] = kk;
        Vs[jj][d] = vv;
    }
}

// dk, dv (overwritten) for one tile of ATT_BKB keys of kv head g, over every query of the
// group's heads that sees them. Launch: grid (ceil(tk / 16), kv_heads, batch), block 128.
template <class T>
__device__ void attn_bwd_dkdv(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                              const float* lse, const float* delta, int tq, int tk, int heads,
                              int kvh, int hd, float scale, const unsigned* docs) {
    GANY_SHARED(float, Ks, [ATT_BKB][ATT_MAXD + 1]);
    GANY_SHARED(float, Vs, [ATT_BKB][ATT_MAXD + 1]);
    GANY_SHARED(float, Qs, [ATT_BQ][ATT_MAXD]);
    GANY_SHARED(float, Ds, [ATT_BQ][ATT_MAXD]);
    GANY_SHARED(float, dKs, [ATT_BKB][ATT_MAXD]);
    GANY_SHARED(float, dVs, [ATT_BKB][ATT_MAXD]);
    GANY_SHARED(float, Ps, [ATT_BQ][ATT_BKB]);
    GANY_SHARED(float, dSs, [ATT_BQ][ATT_BKB]);
    GANY_SHARED(float, Ls, [ATT_BQ]);
    GANY_SHARED(float, Dl, [ATT_BQ]);
    GANY_REQUIRE(hd <= ATT_MAXD && blockDim.x == ATT_BQ * ATT_BKB);
    const int g = blockIdx.y, b = blockIdx.z, rep = heads / kvh, off = tk - tq;
    const int j0 = blockIdx.x * ATT_BKB;
    load_key_tile(Ks, Vs, k, v, b, g, j0, tk, kvh, hd);
    for (int e = threadIdx.x; e < ATT_BKB * hd; e += blockDim.x) {
        dKs[e / hd][e % hd] = 0.0f;
        dVs[e / hd][e % hd] = 0.0f;
    }
    // The first query that sees key j0 is j0 - off.
    int first = j0 - off;
    first = first < 0 ? 0 : first / ATT_BQ * ATT_BQ;
    const unsigned* lo = docs ? docs + (long long)b * tq : nullptr;
    const int qend = lo ? doc_query_end(lo, tq, j0 + ATT_BKB - 1) : tq;
    for (int h = g * rep; h < (g + 1) * rep; h++) {
        for (int i0 = first; i0 < qend; i0 += ATT_BQ) {
            __syncthreads();
            load_query_tile(Qs, Ds, Ls, Dl, q, dout, lse, delta, b, h, i0, tq, heads, hd);
            __syncthreads();
            float p, ds;
            tile_p_ds(Qs, Ds, Ks, Vs, Ls, Dl, i0, j0, tq, tk, hd, scale, &p, &ds, lo);
            Ps[threadIdx.x / ATT_BKB][threadIdx.x % ATT_BKB] = p;
            dSs[threadIdx.x / ATT_BKB][threadIdx.x % ATT_BKB] = ds;
            __syncthreads();
            // dV += Pᵀ dO; dK += scale dSᵀ Q. Each (key, dim) element stays with one thread.
            for (int e = threadIdx.x; e < ATT_BKB * hd; e += blockDim.x) {
                const int jj = e / hd, d = e % hd;
                float av = 0.0f, ak = 0.0f;
                for (int ii = 0; ii < ATT_BQ; ii++) {
                    av += Ps[ii][jj] * Ds[ii][d];
                    ak += dSs[ii][jj] * Qs[ii][d];
                }
                dVs[jj][d] += av;
                dKs[jj][d] += scale * ak;
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ATT_BKB * hd; e += blockDim.x) {
        const int jj = e / hd, d = e % hd, j = j0 + jj;
        if (j < tk) {
            const long long o = kv_off(b, j, g, tk, kvh, hd) + d;
            st(dk + o, dKs[jj][d]);
            st(dv + o, dVs[jj][d]);
        }
    }
}

// dq (overwritten) for one tile of ATT_BQ queries of head h, over the keys they see.
// Launch: grid (ceil(tq / 8), heads, batch), block 128.
template <class T>
__device__ void attn_bwd_dq(T* dq, const T* dout, const T* q, const T* k, const T* v,
                            const float* lse, const float* delta, int tq, int tk, int heads,
                            int kvh, int hd, float scale, const unsigned* docs) {
    GANY_SHARED(float, Ks, [ATT_BKB][ATT_MAXD + 1]);
    GANY_SHARED(float, Vs, [ATT_BKB][ATT_MAXD + 1]);
    GANY_SHARED(float, Qs, [ATT_BQ][ATT_MAXD]);
    GANY_SHARED(float, Ds, [ATT_BQ][ATT_MAXD]);
    GANY_SHARED(float, dQs, [ATT_BQ][ATT_MAXD]);
    GANY_SHARED(float, dSs, [ATT_BQ][ATT_BKB]);
    GANY_SHARED(float, Ls, [ATT_BQ]);
    GANY_SHARED(float, Dl, [ATT_BQ]);
    GANY_REQUIRE(hd <= ATT_MAXD && blockDim.x == ATT_BQ * ATT_BKB);
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kvh), off = tk - tq;
    const int i0 = blockIdx.x * ATT_BQ;
    load_query_tile(Qs, Ds, Ls, Dl, q, dout, lse, delta, b, h, i0, tq, heads, hd);
    for (int e = threadIdx.x; e < ATT_BQ * hd; e += blockDim.x) dQs[e / hd][e % hd] = 0.0f;
    const int last = (i0 + ATT_BQ < tq ? i0 + ATT_BQ : tq) - 1;
    const int kend = off + last + 1;
    const unsigned* lo = docs ? docs + (long long)b * tq : nullptr;
    for (int j0 = lo ? (int)lo[i0] / ATT_BKB * ATT_BKB : 0; j0 < kend; j0 += ATT_BKB) {
        __syncthreads();
        load_key_tile(Ks, Vs, k, v, b, g, j0, tk, kvh, hd);
        __syncthreads();
        float p, ds;
        tile_p_ds(Qs, Ds, Ks, Vs, Ls, Dl, i0, j0, tq, tk, hd, scale, &p, &ds, lo);
        dSs[threadIdx.x / ATT_BKB][threadIdx.x % ATT_BKB] = ds;
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_BQ * hd; e += blockDim.x) {
            const int ii = e / hd, d = e % hd;
            float acc = 0.0f;
            for (int jj = 0; jj < ATT_BKB; jj++) acc += dSs[ii][jj] * Ks[jj][d];
            dQs[ii][d] += scale * acc;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ATT_BQ * hd; e += blockDim.x) {
        const int ii = e / hd, d = e % hd, i = i0 + ii;
        if (i < tq) st(dq + q_off(b, i, h, tq, heads, hd) + d, dQs[ii][d]);
    }
}

#define GANY_ATTENTION(S, T)                                                                     \
    extern "C" __global__ void attention_forward_##S(T* out, float* lse, const T* q, const T* k, \
                                                     const T* v, int tq, int tk, int heads,      \
                                                     int kv_heads, int head_dim, float scale) {  \
        attn_fwd(out, lse, q, k, v, tq, tk, heads, kv_heads, head_dim, scale, nullptr);          \
    }                                                                                            \
    extern "C" __global__ void attention_backward_delta_##S(float* delta, const T* dout,         \
                                                            const T* out, int tq, int heads,     \
                                                            int head_dim, long long nrows) {     \
        attn_bwd_delta(delta, dout, out, tq, heads, head_dim, nrows);                            \
    }                                                                                            \
    extern "C" __global__ void attention_backward_dkdv_##S(                                      \
        T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,       \
        const float* delta, int tq, int tk, int heads, int kv_heads, int head_dim,               \
        float scale) {                                                                           \
        attn_bwd_dkdv(dk, dv, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads, head_dim,      \
                      scale, nullptr);                                                           \
    }                                                                                            \
    extern "C" __global__ void attention_backward_dq_##S(                                        \
        T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse,              \
        const float* delta, int tq, int tk, int heads, int kv_heads, int head_dim,               \
        float scale) {                                                                           \
        attn_bwd_dq(dq, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads, head_dim, scale,     \
                    nullptr);                                                                    \
    }                                                                                            \
    extern "C" __global__ void attention_forward_doc_##S(                                        \
        T* out, float* lse, const T* q, const T* k, const T* v, int tq, int tk, int heads,       \
        int kv_heads, int head_dim, float scale, const unsigned* docs) {                         \
        attn_fwd(out, lse, q, k, v, tq, tk, heads, kv_heads, head_dim, scale, docs);             \
    }                                                                                            \
    extern "C" __global__ void attention_backward_dkdv_doc_##S(                                  \
        T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,       \
        const float* delta, int tq, int tk, int heads, int kv_heads, int head_dim, float scale,  \
        const unsigned* docs) {                                                                  \
        attn_bwd_dkdv(dk, dv, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads, head_dim,      \
                      scale, docs);                                                              \
    }                                                                                            \
    extern "C" __global__ void attention_backward_dq_doc_##S(                                    \
        T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse,              \
        const float* delta, int tq, int tk, int heads, int kv_heads, int head_dim, float scale,  \
        const unsigned* docs) {                                                                  \
        attn_bwd_dq(dq, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads, head_dim, scale,     \
                    docs);                                                                       \
    }
GANY_ATTENTION(f32, float)
GANY_ATTENTION(bf16, bf16)

// -------------------------------------------------------------------------------------------
// Tensor-core kernels (bf16 storage): the same contract as above, for head_dim 16, 32, 64 or
// 128, with every product on mma.sync m16n8k16 (bf16 operands, f32 accumulators) as
// FlashAttention-2 arranges it. A warp owns 16 rows of each product; the softmax runs in f32 on
// the accumulator registers, and a probability tile goes back into the next product as an
// operand without leaving registers (the accumulator layout of two 16×8 tiles is the operand
// layout of one 16×16 tile). Probabilities and dS are rounded to bf16 as operands; the log-sum-
// exp, the row sums and every accumulation stay f32. Blocks are TC_W warps; K/V (forward, dq) or
// Q/dO (dk, dv) tiles pass through shared memory as bf16. Deterministic: every output element is
// one thread's, summed in a fixed order. Needs sm_80 (traps on older devices; the host chooses
// the kernels above there, see ops::Tuning::attn_tc).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16), lane = 4 gq + t: A (16×16, row-major)
// a[0] = A[gq][2t, 2t+1], a[1] = A[gq+8][2t, 2t+1], a[2] = A[gq][2t+8, 2t+9],
// a[3] = A[gq+8][2t+8, 2t+9]; B (16×8, k × n) b[0] = B[2t, 2t+1][gq], b[1] = B[2t+8, 2t+9][gq];
// C (16×8) c[0..1] = C[gq][2t, 2t+1], c[2..3] = C[gq+8][2t, 2t+1]. A pair's lower index is the
// register's low half. The host shim emulates exactly this (shim/cuda_shim.h).

#define TC_W 4              // warps per block
#define TC_BQ (16 * TC_W)   // queries per block (forward, dq) or per tile (dk, dv)
#define TC_BK 64            // keys per tile (forward, dq) or per block (dk, dv)
#define TC_HQ 32            // queries per step of dk/dv's score registers
#define TC_PAD 8            // bf16 padding of shared rows: an ldmatrix's 8 rows hit 32 banks
// Stage buffers of the forward's and dq's K/V tiles: two where they fit the static shared
// memory (head_dim <= 64: the next tile's copies fly while this one is computed), else one.
__host__ __device__ constexpr int tc_stages(int hd) { return hd <= 64 ? 2 : 1; }
// Shared bf16 elements: two [64][head_dim + pad] tiles per stage (K and V, or dk/dv's Q and
// dO), 36 KiB at head_dim 64's two stages, which also hold 128's one. Static shared memory (no
// opt-in needed) that leaves room for several blocks per SM.
#define TC_SMEM (2 * 2 * TC_BK * (64 + TC_PAD))
static_assert(2 * TC_BK * (ATT_MAXD + TC_PAD) <= TC_SMEM && TC_BQ == TC_BK, "tile sizes");

// 2^x on the special-function unit, subnormal results flushed to zero (a probability below
// 2^-126 is nothing beside its row's largest, which is 1); the host build uses exp2f. The
// tensor-core kernels take probabilities as ex2(s c - m c) with c = scale log2(e): one fused
// multiply-add and one ex2 per score instead of a multiply, a subtraction and expf's longer
// sequence: at head_dim 64 a score's softmax instructions rival its share of the products.
#define GANY_LOG2E 1.4426950408889634f
__device__ __forceinline__ float ex2(float x) {
#if defined(GANY_HOST)
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// A shared tile's address for the ldmatrix loads below. On the device, a 32-bit shared-window
// address made opaque where each tile loop iteration takes it, so that every unrolled load's
// address is formed from it there (an immediate offset) instead of being computed once before
// the loop and kept in a register of its own across it (that raised the forward's registers
// from 129 to 167 and spilled dk/dv at head_dim 128).
#if defined(GANY_HOST)
typedef const bf16* smem_t;
__device__ __forceinline__ smem_t smem(const bf16* p) { return p; }
__device__ __forceinline__ smem_t smem_at(smem_t base, int elems) { return base + elems; }
#else
typedef unsigned smem_t;
__device__ __forceinline__ smem_t smem(const bf16* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("" : "+r"(a));
    return a;
}
__device__ __forceinline__ smem_t smem_at(smem_t base, int elems) { return base + 2u * elems; }
#endif
// Four 8×8 bf16 matrices from shared memory in one warp instruction (ldmatrix .x4): lane L
// gives the address of row L % 8 of matrix L / 8 (16-byte aligned), r[m] receives matrix m's
// (L / 4, 2 (L % 4) .. + 1), or with TRANS its (2 (L % 4) .. + 1, L / 4): exactly an mma B
// operand's register. The host shim emulates this layout.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned* r, smem_t row) {
#if defined(GANY_HOST)
    gany_ldmatrix_x4(r, row, TRANS);
#else
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(row));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(row));
#endif
}
// The B operands (k × n = 16 × 8) of n-tiles n0 and n0 + 1 at k-step k0 of a product whose B is
// the transpose of a shared tile X, B[k][n] = X[n][k] (X's rows are the product's columns:
// K for S = Q K^T): b[0..1] for n0, b[2..3] for n0 + 1. X rows ld apart, starting 16-byte
// aligned.
__device__ __forceinline__ void b_from_rows(unsigned* b, smem_t x, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    ldsm_x4<false>(
        b, smem_at(x, (8 * n0 + 8 * (lane >> 4) + (lane & 7)) * ld + k0 + 8 * ((lane >> 3) & 1)));
}
// The same for B stored as it is, B[k][n] = X[k][n] (X's rows are the product's k: V for P V),
// read transposed.
__device__ __forceinline__ void b_from_cols(unsigned* b, smem_t x, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    ldsm_x4<true>(
        b, smem_at(x, (k0 + 8 * ((lane >> 3) & 1) + (lane & 7)) * ld + 8 * n0 + 8 * (lane >> 4)));
}
// c = a x^T over NT n-tiles of 8 (c's 8 NT columns are x's rows) and HD / 16 k-steps, with a
// warp's A operands in registers and x a shared tile read by rows: the scores S = Q K^T, and
// the backward's S, dP and their transposes. With MT > 1 the warp has MT m-tiles of 16 rows
// (c's tile mt · NT + n, a's mt · HD / 16 + kk), which share each B fragment loaded.
template <int HD, int NT, int MT = 1>
__device__ __forceinline__ void product_rows(float (*c)[4], const unsigned (*a)[4], smem_t x,
                                             int ld) {
#pragma unroll
    for (int n = 0; n < MT * NT; n++) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; n += 2)
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            unsigned bb[4];
            b_from_rows(bb, x, ld, n, kk * 16);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16_16816(c[mt * NT + n], a[mt * (HD / 16) + kk], bb);
                mma_bf16_16816(c[mt * NT + n + 1], a[mt * (HD / 16) + kk], bb + 2);
            }
        }
}
// Global loads element by element: a view may start at any element.
__device__ __forceinline__ unsigned ldg_pair(const bf16* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 16);
}
// The A operand of 16×16 tile from c (two adjacent 16×8 accumulator tiles): columns 0-7 from
// c0, 8-15 from c1.
__device__ __forceinline__ void acc_to_a(unsigned* a, const float* c0, const float* c1) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}
// 16 bytes from global src into shared dst without passing through registers (cp.async, sm_80
// and later), or 16 zero bytes where !valid (src is then not read). Completion is by group:
// cp_async_commit closes the group of the copies issued since the last one, cp_async_wait<N>
// waits until at most N groups are still in flight. The host build copies at once, or at the
// wait that covers the copy (the shim's two timings, both tested).
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src, bool valid) {
#if defined(GANY_HOST)
    gany_cp_async16(dst, src, valid);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(GANY_HOST)
    gany_cp_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(GANY_HOST)
    gany_cp_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// 64 rows r0 .. r0 + 63 of x (row r at x + r rs, HD wide; zero at or past n) into shared dst
// with row stride ds. Eight elements (16 bytes) per load where x's rows are 16-byte aligned, as
// whole tensors are (a warp reads consecutive 16-byte chunks of rows); a view at another offset
// goes element by element. Every tile stays row-major: operands that need a tile transposed
// read it with ldmatrix's .trans. With ASYNC the aligned rows go by cp.async (the caller
// commits and waits); the element-by-element path stays synchronous.
struct __align__(16) bf16x8 {
    bf16 h[8];
};
template <int HD, bool ASYNC = false>
__device__ __forceinline__ void tile_to_shared(bf16* dst, int ds, const bf16* x, long long rs,
                                               int r0, int n) {
    constexpr int ROWS = 64, CH = HD / 8;
    if ((unsigned long long)x % 16 == 0 && rs % 8 == 0) {
        for (int e = threadIdx.x; e < ROWS * CH; e += blockDim.x) {
            const int rr = e / CH, d = 8 * (e % CH);
            if (ASYNC) {
                const bool ok = r0 + rr < n;
                cp_async16(dst + rr * ds + d, ok ? x + (r0 + rr) * rs + d : x, ok);
                continue;
            }
            bf16x8 c;
            if (r0 + rr < n) {
                const bf16* src = x + (r0 + rr) * rs + d;
#ifdef GANY_HOST
                gany_require_aligned(src, 16);  // one 16-byte load on the device
                std::memcpy(&c, src, 16);
#else
                c = *reinterpret_cast<const bf16x8*>(src);
#endif
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) c.h[i] = 0;
            }
#ifdef GANY_HOST
            gany_require_aligned(dst + rr * ds + d, 16);
#endif
            *reinterpret_cast<bf16x8*>(dst + rr * ds + d) = c;
        }
    } else {
        for (int e = threadIdx.x; e < ROWS * HD; e += blockDim.x) {
            const int rr = e / HD, d = e % HD;
            dst[rr * ds + d] = r0 + rr < n ? x[(r0 + rr) * rs + d] : (bf16)0;
        }
    }
}

// A operands (rows r0 + gq, + 8; HD/16 tiles of 16 columns) of a [*, heads, HD]-strided row
// block of x; rows at or past n are zero. rs: elements between consecutive rows.
template <int HD>
__device__ __forceinline__ void load_a_rows(unsigned (*a)[4], const bf16* x, int r0, int n,
                                            long long rs) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = r0 + gq + 8 * (r & 1), col = kk * 16 + 2 * t + 8 * (r >> 1);
            a[kk][r] = row < n ? ldg_pair(x + row * rs + col) : 0u;
        }
}

// Two tiles a stage ([64][HD + pad] each: K and V, or Q and dO) in tc_stages(HD) stages of the
// shared block sm: tile it uses stage it % stages.
template <int HD>
struct TilePair {
    bf16* sm;
    static constexpr int LD = HD + TC_PAD;
    __device__ __forceinline__ bf16* first(int it) const {
        return sm + it % tc_stages(HD) * 2 * 64 * LD;
    }
    __device__ __forceinline__ bf16* second(int it) const { return first(it) + 64 * LD; }
    // Rows r0 .. r0 + 63 of x and of y (rs apart, n in all) into tile it's stage by cp.async.
    __device__ __forceinline__ void issue(int it, const bf16* x, const bf16* y, long long rs,
                                          int r0, int n) const {
        tile_to_shared<HD, true>(first(it), LD, x, rs, r0, n);
        tile_to_shared<HD, true>(second(it), LD, y, rs, r0, n);
    }
};

// The tile loop's copies over STAGES stage buffers (`issue(it)` starts tile it's copies into
// its stage, `it % STAGES`). With two, tile 0 is issued before the loop and each iteration
// issues tile it + 1 into the other stage, then waits for tile it only, so the next tile's
// copies are in flight while this one is computed; with one, each iteration copies its own.
// tiles_next's first barrier keeps the refilled stage's last readers ahead of the refill; its
// second makes tile it visible to every warp.
template <int STAGES, class F>
__device__ __forceinline__ void tiles_begin(F& issue, int nt) {
    if (STAGES == 2 && nt > 0) {
        issue(0);
        cp_async_commit();
    }
}
template <int STAGES, class F>
__device__ __forceinline__ void tiles_next(F& issue, int it, int nt) {
    __syncthreads();
    if (STAGES == 2) {
        if (it + 1 < nt) issue(it + 1);
        cp_async_commit();  // possibly empty: the wait below counts groups
        cp_async_wait<1>();
    } else {
        issue(it);
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();
}

// Forward. Block x takes the 64 MT queries from 64 MT (gridDim.x - 1 - x), warp w 16 MT of
// them (MT m-tiles of 16 rows, which share each K and V fragment loaded from shared memory:
// with MT = 2 a fragment feeds four products instead of two, as FlashAttention-2 tiles
// head_dim 64); the block's K/V tiles of 64 keys go through shared memory as [key][d] (B
// operands by ldmatrix, V's transposed). With DOC, docs holds the document starts (see the top
// of this file): the block's tiles begin at its first row's start. Launch: grid
// (ceil(tq / (64 MT)), heads, batch), block 128.
template <int HD, int MT, bool DOC>
__device__ void attn_fwd_tc(bf16* sm, bf16* out, float* lse, const bf16* q, const bf16* k,
                            const bf16* v, int tq, int tk, int heads, int kvh, float scale,
                            const unsigned* docs) {
    constexpr int KS = HD + TC_PAD, BQ = TC_BQ * MT, KT = HD / 16, NT = TC_BK / 8;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kvh), off = tk - tq;
    // The last query tile first: it sees the most keys, so the longest blocks start earliest.
    const int i0 = (gridDim.x - 1 - blockIdx.x) * BQ, r0 = i0 + 16 * MT * w;
    unsigned qa[MT * KT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        load_a_rows<HD>(qa + mt * KT, q + q_off(b, 0, h, tq, heads, HD), r0 + 16 * mt, tq,
                        (long long)heads * HD);
    // Per lane and m-tile: rows gq and gq + 8 of its 16; l sums this lane's columns only (the
    // quad's lanes share a row's max, so their partial sums add up at the end).
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = GANY_NEG_INF, l[mt][0] = l[mt][1] = 0.0f;
    const float c = scale * GANY_LOG2E;
    float o[MT * (HD / 8)][4];
#pragma unroll
    for (int n = 0; n < MT * (HD / 8); n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    const bf16 *kb = k + kv_off(b, 0, g, tk, kvh, HD), *vb = v + kv_off(b, 0, g, tk, kvh, HD);
    const long long kvrs = (long long)kvh * HD;  // between consecutive keys
    const int bend = off + (i0 + BQ < tq ? i0 + BQ : tq);                // keys the block needs
    const int wend = off + (r0 + 16 * MT < tq ? r0 + 16 * MT : tq);      // keys this warp needs
    // Document starts: this sequence's; the lane's rows' (row gq + 8 r of m-tile mt), and per
    // m-tile the largest (its last row's, warp-uniform) for the unmasked-tile test.
    const unsigned* lo = DOC ? docs + (long long)b * tq : nullptr;
    const auto lo_at = [&](int i) { return (int)lo[i < tq ? i : tq - 1]; };
    int lor[MT][2] = {}, lmax[MT] = {};
    if (DOC)
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            lor[mt][0] = lo_at(r0 + 16 * mt + gq);
            lor[mt][1] = lo_at(r0 + 16 * mt + gq + 8);
            lmax[mt] = lo_at(r0 + 16 * mt + 15);
        }
    const int t0 = DOC ? lo_at(i0) / TC_BK : 0;  // tiles before the block's first key
    const int wbeg = DOC ? lo_at(r0) : 0;        // the warp's first key
    const TilePair<HD> kv{sm};  // K and V
    auto issue = [&](int it) { kv.issue(it, kb, vb, kvrs, (t0 + it) * TC_BK, tk); };
    const int nt = (bend + TC_BK - 1) / TC_BK - t0;
    tiles_begin<tc_stages(HD)>(issue, nt);
    for (int it = 0; it < nt; it++) {
        const int j0 = (t0 + it) * TC_BK;
        tiles_next<tc_stages(HD)>(issue, it, nt);
        if (r0 >= tq || j0 >= wend) continue;  // warp-uniform: nothing this warp sees
        if (DOC && j0 + TC_BK <= wbeg) continue;  // the same, before its documents
        const smem_t ks = smem(kv.first(it)), vs = smem(kv.second(it));
        float s[MT * NT][4];
        product_rows<HD, NT, MT>(s, qa, ks, KS);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            float (*sc)[4] = s + mt * NT;  // this m-tile's scores
            const int rm = r0 + 16 * mt;
            // Scores stay unscaled (scale > 0 keeps the order); m is their running maximum.
            // Only a tile that crosses the diagonal or the end of the keys masks (warp-uniform).
            const bool full = j0 + TC_BK <= tk && j0 + TC_BK - 1 <= off + rm &&
                              (!DOC || j0 >= lmax[mt]);
            float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    if (!full) {
                        const int i = rm + gq + 8 * (e >> 1), j = j0 + n * 8 + 2 * t + (e & 1);
                        if (!(j <= off + i && j < tk && (!DOC || j >= lor[mt][e >> 1])))
                            sc[n][e] = GANY_NEG_INF;
                    }
                    mx[e >> 1] = fmaxf(mx[e >> 1], sc[n][e]);
                }
            float alpha[2], mc[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                alpha[r] = m[mt][r] == GANY_NEG_INF ? 0.0f : ex2((m[mt][r] - mx[r]) * c);
                l[mt][r] *= alpha[r];
                m[mt][r] = mx[r];
                mc[r] = mx[r] * c;
            }
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float x = sc[n][e];
                    const float p =
                        !full && x == GANY_NEG_INF ? 0.0f : ex2(fmaf(x, c, -mc[e >> 1]));
                    sc[n][e] = p;
                    l[mt][e >> 1] += p;
                }
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                float* on = o[mt * (HD / 8) + n];
                on[0] *= alpha[0];
                on[1] *= alpha[0];
                on[2] *= alpha[1];
                on[3] *= alpha[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < TC_BK / 16; kk++) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                acc_to_a(pa[mt], s[mt * NT + 2 * kk], s[mt * NT + 2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < HD / 8; n += 2) {
                unsigned bb[4];
                b_from_cols(bb, vs, KS, n, kk * 16);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16_16816(o[mt * (HD / 8) + n], pa[mt], bb);
                    mma_bf16_16816(o[mt * (HD / 8) + n + 1], pa[mt], bb + 2);
                }
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float lr = l[mt][r];
            lr += __shfl_xor_sync(0xffffffffu, lr, 1);
            lr += __shfl_xor_sync(0xffffffffu, lr, 2);
            const int i = r0 + 16 * mt + gq + 8 * r;
            if (i < tq) {
                const float inv = 1.0f / lr;
                const long long qo = q_off(b, i, h, tq, heads, HD);
#pragma unroll
                for (int n = 0; n < HD / 8; n++) {
                    st(out + qo + n * 8 + 2 * t, o[mt * (HD / 8) + n][2 * r] * inv);
                    st(out + qo + n * 8 + 2 * t + 1, o[mt * (HD / 8) + n][2 * r + 1] * inv);
                }
                if (t == 0) lse[((long long)b * heads + h) * tq + i] = m[mt][r] * scale + logf(lr);
            }
        }
}

#define TC_DSLD (TC_BK + TC_PAD)  // row stride of the staged dS ([query][key], bf16)
// p[0] += x, p[1] += y atomically (each on its own; p 8-byte aligned, in global memory): one
// vector reduction on sm_90 and later (red.global.add.v2.f32), two elsewhere.
__device__ __forceinline__ void atomic_add_pair(float* p, float x, float y) {
#if !defined(GANY_HOST) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
#if defined(GANY_HOST)
    // The host build holds the two scalar adds to the vector reduction's alignment.
    gany_require_aligned(p, 8);
#endif
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}
// The fused backward's dq share of one half tile (TC_HQ queries from query i0 of head h) over
// the block's 64 keys: dS (warp w's keys as dS^T accumulators ds, all zero where !act) is
// written as bf16 [query][key] into X, then warp w multiplies 16 of the queries by the [key][d]
// rows Ksm over a column group of d and adds the results, times scale, into dq_acc atomically.
// Every thread of the block calls it: it has two barriers. The first keeps X's last readers
// (the previous half's, or at head_dim 64 dV's reads of the dO rows X overlays) ahead of the
// writes.
template <int HD>
__device__ __forceinline__ void attn_dq_share(float* dq_acc, bf16* X, const bf16* Ksm,
                                              const float (*ds)[4], bool act, int h, int i0,
                                              int tq, int heads, float scale) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    __syncthreads();
#pragma unroll
    for (int n = 0; n < TC_HQ / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            X[(n * 8 + 2 * t + (e & 1)) * TC_DSLD + 16 * w + gq + 8 * (e >> 1)] =
                act ? f32_to_bf16(ds[n][e]) : (bf16)0;
    __syncthreads();
    // Warps: two of 16 queries by CG groups of HD / CG columns (at head_dim 16 two warps idle).
    constexpr int CG = HD >= 32 ? 2 : 1, NT = HD / CG / 8;
    static_assert(TC_W == 4 && TC_HQ == 32 && NT % 2 == 0, "dq share warp layout");
    const int mt = w & 1, cg = w >> 1;
    if (cg >= CG) return;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const smem_t xs = smem(X), ks = smem(Ksm);
#pragma unroll
    for (int kk = 0; kk < TC_BK / 16; kk++) {
        // A (16 queries × 16 keys) of the [query][key] rows: matrix L / 8 is rows + 8 (L / 8
        // odd), columns + 8 (L / 16).
        unsigned a[4];
        ldsm_x4<false>(a, smem_at(xs, (16 * mt + 8 * ((lane >> 3) & 1) + (lane & 7)) * TC_DSLD +
                                          kk * 16 + 8 * (lane >> 4)));
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned bk[4];  // B (k = key, n = d): the [key][d] rows read transposed
            b_from_cols(bk, ks, HD + TC_PAD, cg * NT + n, kk * 16);
            mma_bf16_16816(acc[n], a, bk);
            mma_bf16_16816(acc[n + 1], a, bk + 2);
        }
    }
    const int b = blockIdx.z;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int i = i0 + 16 * mt + gq + 8 * r;
        if (i < tq) {
            float* o = dq_acc + q_off(b, i, h, tq, heads, HD) + cg * NT * 8 + 2 * t;
#pragma unroll
            for (int n = 0; n < NT; n++)
                atomic_add_pair(o + n * 8, scale * acc[n][2 * r], scale * acc[n][2 * r + 1]);
        }
    }
}

// dk, dv (overwritten) for 64 keys of kv head g, warp w owning keys 64 x + 16 w .. + 15 (its
// K and V rows stay in registers as A operands), over every query of the group's heads that
// sees them, in tiles of 64 queries through shared memory (Q, dO as [query][d]): S^T = K Q^T,
// dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q with P^T and dS^T as A operands.
// With DQ (FlashAttention-2's arrangement, head_dim <= 64) the same pass also adds this key
// block's share of dq, scale dS K, into the f32 dq_acc (zeroed before, cast to bf16 after)
// with atomic adds: each half tile's dS goes through shared memory
// as [query][key] (at head_dim 64 over the half's dO rows, which dV has finished with) and the
// block's K rows wait there as [key][d]; the dq kernel's second S and dP are not computed. The
// atomics' order varies between runs on a device, so dq is then not bitwise reproducible.
// Launch: grid (ceil(tk / 64), kv_heads, batch), block 128.
// With DOC (document starts in docs, see the top of this file) the query tiles stop where the
// queries' documents start after the block's last key.
template <int HD, bool DQ, bool DOC>
__device__ void attn_bwd_dkdv_tc(bf16* sm, float* Ls, float* Dl, bf16* Ksm, bf16* DSsm,
                                 float* dq_acc, bf16* dk, bf16* dv, const bf16* dout,
                                 const bf16* q, const bf16* k, const bf16* v, const float* lse,
                                 const float* delta, int tq, int tk, int heads, int kvh,
                                 float scale, const unsigned* docs) {
    constexpr int S = HD + TC_PAD;
    static_assert(!DQ || HD <= 64, "dq's stages and K rows do not fit 48 KiB past head_dim 64");
    static_assert(HD != 64 || S == TC_DSLD, "at head_dim 64 dS takes the dO rows' place");
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const int g = blockIdx.y, b = blockIdx.z, rep = heads / kvh, off = tk - tq;
    const int j0 = blockIdx.x * TC_BK, k0 = j0 + 16 * w;
    const float c = scale * GANY_LOG2E;
    unsigned ka[HD / 16][4], va[HD / 16][4];
    load_a_rows<HD>(ka, k + kv_off(b, 0, g, tk, kvh, HD), k0, tk, (long long)kvh * HD);
    load_a_rows<HD>(va, v + kv_off(b, 0, g, tk, kvh, HD), k0, tk, (long long)kvh * HD);
    // dq's B operand: the block's keys as [key][d], visible after tiles_next's barriers.
    if (DQ)
        tile_to_shared<HD>(Ksm, S, k + kv_off(b, 0, g, tk, kvh, HD), (long long)kvh * HD, j0,
                           tk);
    float dkc[HD / 8][4], dvc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dkc[n][e] = dvc[n][e] = 0.0f;
    // The first query that sees key j0 is j0 - off.
    int first = j0 - off;
    first = first < 0 ? 0 : first / TC_BQ * TC_BQ;
    const unsigned* lo = DOC ? docs + (long long)b * tq : nullptr;
    const int qend = DOC ? doc_query_end(lo, tq, j0 + TC_BK - 1) : tq;
    // Tiles of 64 queries, head by head of the group: tile it's Q and dO ([TC_BQ][S] each),
    // lse (times log2 e, for ex2) and delta into its stage's buffers, as the forward's K and V.
    const int per_h = qend > first ? (qend - first + TC_BQ - 1) / TC_BQ : 0, nt = rep * per_h;
    const long long qrs = (long long)heads * HD;
    const TilePair<HD> qd{sm};  // Q and dO
    auto issue = [&](int it) {
        const int h = g * rep + it / per_h, i0 = first + it % per_h * TC_BQ;
        const long long qo = q_off(b, 0, h, tq, heads, HD);
        qd.issue(it, q + qo, dout + qo, qrs, i0, tq);
        float *ls = Ls + it % tc_stages(HD) * TC_BQ, *dl = Dl + it % tc_stages(HD) * TC_BQ;
        for (int ii = threadIdx.x; ii < TC_BQ; ii += blockDim.x) {
            const int i = i0 + ii;
            const long long r = ((long long)b * heads + h) * tq + i;
            ls[ii] = i < tq ? lse[r] * GANY_LOG2E : 0.0f;
            dl[ii] = i < tq ? delta[r] : 0.0f;
        }
    };
    tiles_begin<tc_stages(HD)>(issue, nt);
    for (int it = 0; it < nt; it++) {
        const int h = g * rep + it / per_h, i0 = first + it % per_h * TC_BQ;
        tiles_next<tc_stages(HD)>(issue, it, nt);
        bf16 *Qs = qd.first(it), *Ds = qd.second(it);
        const float *Lt = Ls + it % tc_stages(HD) * TC_BQ, *Dt = Dl + it % tc_stages(HD) * TC_BQ;
        const int ilast = (i0 + TC_BQ < tq ? i0 + TC_BQ : tq) - 1;
        // Warp-uniform: no query sees its keys. With DQ every warp stays for the barriers.
        if (!DQ && (k0 >= tk || k0 > off + ilast)) continue;
        // The tile's queries in two halves of TC_HQ: half the score registers live.
        for (int h0 = 0; h0 < TC_BQ; h0 += TC_HQ) {
            const int hlast = (i0 + h0 + TC_HQ < tq ? i0 + h0 + TC_HQ : tq) - 1;
            // Block-uniform: no query of the half sees the block's keys (or there is none).
            if (DQ && (i0 + h0 >= tq || j0 > off + hlast)) continue;
            const bool act = k0 < tk && k0 <= off + hlast &&  // warp-uniform
                             (!DOC || (int)lo[i0 + h0 < tq ? i0 + h0 : tq - 1] <= k0 + 15);
            const smem_t qsm = smem(Qs + h0 * S), dsm = smem(Ds + h0 * S);
            float sp[TC_HQ / 8][4], dp[TC_HQ / 8][4];  // S^T then P^T; dP^T then dS^T
            if (act) {
                product_rows<HD, TC_HQ / 8>(sp, ka, qsm, S);
                product_rows<HD, TC_HQ / 8>(dp, va, dsm, S);
                // Only a tile that crosses the diagonal or an end masks (warp-uniform).
                const bool full = i0 + h0 + TC_HQ <= tq && k0 + 16 <= tk &&
                                  k0 + 15 <= off + i0 + h0 && (!DOC || (int)lo[hlast] <= k0);
#pragma unroll
                for (int n = 0; n < TC_HQ / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int j = k0 + gq + 8 * (e >> 1);
                        const int ii = h0 + n * 8 + 2 * t + (e & 1), i = i0 + ii;
                        float p = 0.0f, ds = 0.0f;
                        if (full || (i < tq && j < tk && j <= off + i &&
                                     (!DOC || j >= (int)lo[i]))) {
                            p = ex2(fmaf(sp[n][e], c, -Lt[ii]));
                            ds = p * (dp[n][e] - Dt[ii]);
                        }
                        sp[n][e] = p;
                        dp[n][e] = ds;
                    }
#pragma unroll
                for (int kk = 0; kk < TC_HQ / 16; kk++) {
                    unsigned pa[4], sa[4];
                    acc_to_a(pa, sp[2 * kk], sp[2 * kk + 1]);
                    acc_to_a(sa, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
                    for (int n = 0; n < HD / 8; n += 2) {
                        // B (k = query, n = d): the [query][d] tiles read transposed.
                        unsigned bd[4], bq[4];
                        b_from_cols(bd, dsm, S, n, kk * 16);
                        b_from_cols(bq, qsm, S, n, kk * 16);
                        mma_bf16_16816(dvc[n], pa, bd);
                        mma_bf16_16816(dvc[n + 1], pa, bd + 2);
                        mma_bf16_16816(dkc[n], sa, bq);
                        mma_bf16_16816(dkc[n + 1], sa, bq + 2);
                    }
                }
            }
            if (DQ) attn_dq_share<HD>(dq_acc, HD >= 64 ? Ds + h0 * S : DSsm, Ksm, dp, act, h,
                                      i0 + h0, tq, heads, scale);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int j = k0 + gq + 8 * r;
        if (j < tk) {
            const long long o = kv_off(b, j, g, tk, kvh, HD);
#pragma unroll
            for (int n = 0; n < HD / 8; n++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    st(dk + o + n * 8 + 2 * t + c, scale * dkc[n][2 * r + c]);
                    st(dv + o + n * 8 + 2 * t + c, dvc[n][2 * r + c]);
                }
        }
    }
}

// dq (overwritten) for 64 queries of head h (the last tile in block 0), warp w owning 16 (its
// Q and dO rows in registers), over the keys they see in tiles of 64 through shared memory
// (K, V as [key][d]): S = Q K^T, dP = dO V^T, dQ += dS K with dS as the A operand.
// Launch: grid (ceil(tq / 64), heads, batch), block 128.
// With DOC (document starts in docs) the block's key tiles begin at its first row's start.
template <int HD, bool DOC>
__device__ void attn_bwd_dq_tc(bf16* sm, bf16* dq, const bf16* dout, const bf16* q,
                               const bf16* k, const bf16* v, const float* lse,
                               const float* delta, int tq, int tk, int heads, int kvh,
                               float scale, const unsigned* docs) {
    constexpr int S = HD + TC_PAD;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kvh), off = tk - tq;
    // The last query tile first: it sees the most keys, so the longest blocks start earliest.
    const int i0 = (gridDim.x - 1 - blockIdx.x) * TC_BQ, r0 = i0 + 16 * w;
    const float c = scale * GANY_LOG2E;
    unsigned qa[HD / 16][4], da[HD / 16][4];
    load_a_rows<HD>(qa, q + q_off(b, 0, h, tq, heads, HD), r0, tq, (long long)heads * HD);
    load_a_rows<HD>(da, dout + q_off(b, 0, h, tq, heads, HD), r0, tq, (long long)heads * HD);
    float L[2], Dv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int i = r0 + gq + 8 * r;
        const long long at = ((long long)b * heads + h) * tq + i;
        L[r] = i < tq ? lse[at] * GANY_LOG2E : 0.0f;  // for ex2 (see there)
        Dv[r] = i < tq ? delta[at] : 0.0f;
    }
    float dqc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) dqc[n][0] = dqc[n][1] = dqc[n][2] = dqc[n][3] = 0.0f;
    const bf16 *kb = k + kv_off(b, 0, g, tk, kvh, HD), *vb = v + kv_off(b, 0, g, tk, kvh, HD);
    const long long kvrs = (long long)kvh * HD;  // between consecutive keys
    const int bend = off + (i0 + TC_BQ < tq ? i0 + TC_BQ : tq);
    const int wend = off + (r0 + 16 < tq ? r0 + 16 : tq);
    // Document starts, as the forward: the lane's two rows', the warp's largest and smallest.
    const unsigned* lo = DOC ? docs + (long long)b * tq : nullptr;
    const auto lo_at = [&](int i) { return (int)lo[i < tq ? i : tq - 1]; };
    int lor[2] = {0, 0}, lmax = 0, wbeg = 0, t0 = 0;
    if (DOC) {
        lor[0] = lo_at(r0 + gq);
        lor[1] = lo_at(r0 + gq + 8);
        lmax = lo_at(r0 + 15);
        wbeg = lo_at(r0);
        t0 = lo_at(i0) / TC_BK;
    }
    const TilePair<HD> kv{sm};  // K and V, as the forward
    auto issue = [&](int it) { kv.issue(it, kb, vb, kvrs, (t0 + it) * TC_BK, tk); };
    const int nt = (bend + TC_BK - 1) / TC_BK - t0;
    tiles_begin<tc_stages(HD)>(issue, nt);
    for (int it = 0; it < nt; it++) {
        const int j0 = (t0 + it) * TC_BK;
        tiles_next<tc_stages(HD)>(issue, it, nt);
        if (r0 >= tq || j0 >= wend) continue;  // warp-uniform
        if (DOC && j0 + TC_BK <= wbeg) continue;
        const smem_t ks = smem(kv.first(it)), vs = smem(kv.second(it));
        float s[TC_BK / 8][4], dp[TC_BK / 8][4];
        product_rows<HD, TC_BK / 8>(s, qa, ks, S);
        product_rows<HD, TC_BK / 8>(dp, da, vs, S);
        // Only a tile that crosses the diagonal or an end masks (warp-uniform).
        const bool full = r0 + 16 <= tq && j0 + TC_BK <= tk && j0 + TC_BK - 1 <= off + r0 &&
                          (!DOC || j0 >= lmax);
#pragma unroll
        for (int n = 0; n < TC_BK / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = r0 + gq + 8 * (e >> 1), j = j0 + n * 8 + 2 * t + (e & 1);
                float ds = 0.0f;
                if (full || (i < tq && j < tk && j <= off + i && (!DOC || j >= lor[e >> 1]))) {
                    const float p = ex2(fmaf(s[n][e], c, -L[e >> 1]));
                    ds = p * (dp[n][e] - Dv[e >> 1]);
                }
                s[n][e] = ds;
            }
#pragma unroll
        for (int kk = 0; kk < TC_BK / 16; kk++) {
            unsigned sa[4];
            acc_to_a(sa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < HD / 8; n += 2) {
                // B (k = key, n = d): the [key][d] tile read transposed.
                unsigned bk[4];
                b_from_cols(bk, ks, S, n, kk * 16);
                mma_bf16_16816(dqc[n], sa, bk);
                mma_bf16_16816(dqc[n + 1], sa, bk + 2);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int i = r0 + gq + 8 * r;
        if (i < tq) {
            const long long o = q_off(b, i, h, tq, heads, HD);
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                st(dq + o + n * 8 + 2 * t, scale * dqc[n][2 * r]);
                st(dq + o + n * 8 + 2 * t + 1, scale * dqc[n][2 * r + 1]);
            }
        }
    }
}

// One kernel per op and head_dim (attention_forward_tc64_bf16, ...): a kernel's registers are
// those of its largest path, so head_dim 64 does not pay for 128's. Each comes again with
// document masking (`_doc_`, docs as the last argument); SFX is empty or `doc_`.
#define GANY_ATTENTION_TC_AS(HD, DKDV_BLOCKS, DOC, SFX, DOCS_PARAM, DOCS)                        \
    extern "C" __global__ void __launch_bounds__(32 * TC_W)                                     \
        attention_forward_tc##HD##_##SFX##bf16(bf16* out, float* lse, const bf16* q,            \
                                               const bf16* k, const bf16* v, int tq, int tk,    \
                                               int heads, int kv_heads, int head_dim,           \
                                               float scale DOCS_PARAM) {                        \
        GANY_SHARED(__align__(16) bf16, sm, [TC_SMEM]);                                         \
        GANY_REQUIRE(blockDim.x == 32 * TC_W && head_dim == HD);                                \
        attn_fwd_tc<HD, 1, DOC>(sm, out, lse, q, k, v, tq, tk, heads, kv_heads, scale, DOCS);   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * TC_W, DKDV_BLOCKS)                        \
        attention_backward_dkdv_tc##HD##_##SFX##bf16(                                           \
            bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,  \
            const float* lse, const float* delta, int tq, int tk, int heads, int kv_heads,      \
            int head_dim, float scale DOCS_PARAM) {                                             \
        GANY_SHARED(__align__(16) bf16, sm, [TC_SMEM]);                                         \
        GANY_SHARED(float, Ls, [2 * TC_BQ]);                                                    \
        GANY_SHARED(float, Dl, [2 * TC_BQ]);                                                    \
        GANY_REQUIRE(blockDim.x == 32 * TC_W && head_dim == HD);                                \
        attn_bwd_dkdv_tc<HD, false, DOC>(sm, Ls, Dl, nullptr, nullptr, nullptr, dk, dv, dout,   \
                                         q, k, v, lse, delta, tq, tk, heads, kv_heads, scale,   \
                                         DOCS);                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * TC_W)                                     \
        attention_backward_dq_tc##HD##_##SFX##bf16(                                             \
            bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,            \
            const float* lse, const float* delta, int tq, int tk, int heads, int kv_heads,      \
            int head_dim, float scale DOCS_PARAM) {                                             \
        GANY_SHARED(__align__(16) bf16, sm, [TC_SMEM]);                                         \
        GANY_REQUIRE(blockDim.x == 32 * TC_W && head_dim == HD);                                \
        attn_bwd_dq_tc<HD, DOC>(sm, dq, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads,     \
                                scale, DOCS);                                                   \
    }
#define GANY_COMMA ,
#define GANY_ATTENTION_TC(HD, DKDV_BLOCKS)                                                      \
    GANY_ATTENTION_TC_AS(HD, DKDV_BLOCKS, false, , , nullptr)                                   \
    GANY_ATTENTION_TC_AS(HD, DKDV_BLOCKS, true, doc_, GANY_COMMA const unsigned* docs, docs)
// dk/dv at head_dim 64 (medium's) held to 3 blocks an SM (168 registers; 180 unbounded, which
// leaves 2): 24 bytes of stack for one block in three more. The others as ptxas chooses.
GANY_ATTENTION_TC(16, 1)
GANY_ATTENTION_TC(32, 1)
GANY_ATTENTION_TC(64, 3)
GANY_ATTENTION_TC(128, 1)

// The fused backward (dk, dv and dq's f32 sums in one pass, see attn_bwd_dkdv_tc) where its
// shared memory fits, head_dim <= 64.
#define GANY_ATTENTION_TC_FUSED_AS(HD, BLOCKS, DOC, SFX, DOCS_PARAM, DOCS)                       \
    extern "C" __global__ void __launch_bounds__(32 * TC_W, BLOCKS)                             \
        attention_backward_fused_tc##HD##_##SFX##bf16(                                          \
            bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const bf16* q, const bf16* k,  \
            const bf16* v, const float* lse, const float* delta, int tq, int tk, int heads,     \
            int kv_heads, int head_dim, float scale DOCS_PARAM) {                               \
        GANY_SHARED(__align__(16) bf16, sm, [TC_SMEM]);                                         \
        GANY_SHARED(float, Ls, [2 * TC_BQ]);                                                    \
        GANY_SHARED(float, Dl, [2 * TC_BQ]);                                                    \
        GANY_SHARED(__align__(16) bf16, ks, [TC_BK * (HD + TC_PAD)]);                           \
        GANY_SHARED(__align__(16) bf16, dsx, [HD >= 64 ? 8 : TC_HQ * TC_DSLD]);                 \
        GANY_REQUIRE(blockDim.x == 32 * TC_W && head_dim == HD);                                \
        attn_bwd_dkdv_tc<HD, true, DOC>(sm, Ls, Dl, ks, dsx, dq_acc, dk, dv, dout, q, k, v,     \
                                        lse, delta, tq, tk, heads, kv_heads, scale, DOCS);      \
    }
#define GANY_ATTENTION_TC_FUSED(HD, BLOCKS)                                                      \
    GANY_ATTENTION_TC_FUSED_AS(HD, BLOCKS, false, , , nullptr)                                  \
    GANY_ATTENTION_TC_FUSED_AS(HD, BLOCKS, true, doc_, GANY_COMMA const unsigned* docs, docs)
// The forward with two m-tiles a warp (128 queries a block), where its registers allow.
#define GANY_ATTENTION_TC_WIDE_AS(HD, BLOCKS, DOC, SFX, DOCS_PARAM, DOCS)                        \
    extern "C" __global__ void __launch_bounds__(32 * TC_W, BLOCKS)                             \
        attention_forward_tc##HD##x2_##SFX##bf16(bf16* out, float* lse, const bf16* q,          \
                                                 const bf16* k, const bf16* v, int tq, int tk,  \
                                                 int heads, int kv_heads, int head_dim,         \
                                                 float scale DOCS_PARAM) {                      \
        GANY_SHARED(__align__(16) bf16, sm, [TC_SMEM]);                                         \
        GANY_REQUIRE(blockDim.x == 32 * TC_W && head_dim == HD);                                \
        attn_fwd_tc<HD, 2, DOC>(sm, out, lse, q, k, v, tq, tk, heads, kv_heads, scale, DOCS);   \
    }
#define GANY_ATTENTION_TC_WIDE(HD, BLOCKS)                                                       \
    GANY_ATTENTION_TC_WIDE_AS(HD, BLOCKS, false, , , nullptr)                                   \
    GANY_ATTENTION_TC_WIDE_AS(HD, BLOCKS, true, doc_, GANY_COMMA const unsigned* docs, docs)
GANY_ATTENTION_TC_WIDE(16, 2)
GANY_ATTENTION_TC_WIDE(32, 2)
GANY_ATTENTION_TC_WIDE(64, 2)

GANY_ATTENTION_TC_FUSED(16, 1)
GANY_ATTENTION_TC_FUSED(32, 1)
GANY_ATTENTION_TC_FUSED(64, 3)

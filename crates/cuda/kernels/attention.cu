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
// The backward runs without floating-point atomics, deterministically: one kernel per key tile
// accumulates dk and dv over every query that sees it, another per query tile accumulates dq
// (each recomputes the probabilities; FlashAttention-2 would add dq atomically instead).

#define ATT_MAXD 128
#define ATT_BK 32   // keys per forward tile: one per lane
#define ATT_MAXW 16  // warps (query rows) per forward block: more rows share each K/V tile
#define ATT_BQ 8    // queries per backward tile
#define ATT_BKB 16  // keys per backward tile; backward blocks are ATT_BQ * ATT_BKB threads

__device__ __forceinline__ long long q_off(int b, int i, int h, int tq, int heads, int hd) {
    return (((long long)b * tq + i) * heads + h) * hd;
}
__device__ __forceinline__ long long kv_off(int b, int j, int g, int tk, int kvh, int hd) {
    return (((long long)b * tk + j) * kvh + g) * hd;
}

// Forward: one warp per query row; the block's warps share each K/V tile. Lane l scores key
// j0 + l, then the warp folds the tile into its running max, sum and output.
// Launch: grid (ceil(tq / W), heads, batch), block 32 W threads, W <= 16.
template <class T>
__device__ void attn_fwd(T* out, float* lse, const T* q, const T* k, const T* v, int tq, int tk,
                         int heads, int kvh, int hd, float scale) {
    __shared__ float Ks[ATT_BK][ATT_MAXD + 1];  // +1: lanes read different rows, no conflicts
    __shared__ float Vs[ATT_BK][ATT_MAXD];
    __shared__ float Qs[ATT_MAXW][ATT_MAXD];
    __shared__ float Ps[ATT_MAXW][ATT_BK];
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
    float m = GANY_NEG_INF, l = 0.0f;
    float o[ATT_MAXD / 32];
    for (int c = 0; c < ATT_MAXD / 32; c++) o[c] = 0.0f;
    for (int j0 = 0; j0 < kend; j0 += ATT_BK) {
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
            if (j <= off + i && j < tk) {
                float dot = 0.0f;
                for (int d = 0; d < hd; d++) dot += Qs[w][d] * Ks[lane][d];
                s = scale * dot;
            }
            // Key 0 is visible to every row, so m is finite after the first tile.
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

// delta[b, h, i] = dout_i · out_i, the softmax backward's row term.
// Launch: grid batch * tq * heads (one row of q's layout each), block 32.
template <class T>
__device__ void attn_bwd_delta(float* delta, const T* dout, const T* out, int tq, int heads,
                               int hd) {
    GANY_REQUIRE(blockDim.x == 32);
    const long long r = blockIdx.x;
    float s = 0.0f;
    for (int d = threadIdx.x; d < hd; d += 32) s += ld(dout + r * hd + d) * ld(out + r * hd + d);
    s = warp_sum(s);
    const long long h = r % heads, bi = r / heads, i = bi % tq, b = bi / tq;
    if (threadIdx.x == 0) delta[(b * heads + h) * tq + i] = s;
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
                                          float* ds_out) {
    const int qi = threadIdx.x / ATT_BKB, kj = threadIdx.x % ATT_BKB;
    const int i = i0 + qi, j = j0 + kj, off = tk - tq;
    float p = 0.0f, ds = 0.0f;
    if (i < tq && j < tk && j <= off + i) {
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
                              int kvh, int hd, float scale) {
    __shared__ float Ks[ATT_BKB][ATT_MAXD + 1], Vs[ATT_BKB][ATT_MAXD + 1];
    __shared__ float Qs[ATT_BQ][ATT_MAXD], Ds[ATT_BQ][ATT_MAXD];
    __shared__ float dKs[ATT_BKB][ATT_MAXD], dVs[ATT_BKB][ATT_MAXD];
    __shared__ float Ps[ATT_BQ][ATT_BKB], dSs[ATT_BQ][ATT_BKB];
    __shared__ float Ls[ATT_BQ], Dl[ATT_BQ];
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
    for (int h = g * rep; h < (g + 1) * rep; h++) {
        for (int i0 = first; i0 < tq; i0 += ATT_BQ) {
            __syncthreads();
            load_query_tile(Qs, Ds, Ls, Dl, q, dout, lse, delta, b, h, i0, tq, heads, hd);
            __syncthreads();
            float p, ds;
            tile_p_ds(Qs, Ds, Ks, Vs, Ls, Dl, i0, j0, tq, tk, hd, scale, &p, &ds);
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
                            int kvh, int hd, float scale) {
    __shared__ float Ks[ATT_BKB][ATT_MAXD + 1], Vs[ATT_BKB][ATT_MAXD + 1];
    __shared__ float Qs[ATT_BQ][ATT_MAXD], Ds[ATT_BQ][ATT_MAXD], dQs[ATT_BQ][ATT_MAXD];
    __shared__ float dSs[ATT_BQ][ATT_BKB];
    __shared__ float Ls[ATT_BQ], Dl[ATT_BQ];
    GANY_REQUIRE(hd <= ATT_MAXD && blockDim.x == ATT_BQ * ATT_BKB);
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kvh), off = tk - tq;
    const int i0 = blockIdx.x * ATT_BQ;
    load_query_tile(Qs, Ds, Ls, Dl, q, dout, lse, delta, b, h, i0, tq, heads, hd);
    for (int e = threadIdx.x; e < ATT_BQ * hd; e += blockDim.x) dQs[e / hd][e % hd] = 0.0f;
    const int last = (i0 + ATT_BQ < tq ? i0 + ATT_BQ : tq) - 1;
    const int kend = off + last + 1;
    for (int j0 = 0; j0 < kend; j0 += ATT_BKB) {
        __syncthreads();
        load_key_tile(Ks, Vs, k, v, b, g, j0, tk, kvh, hd);
        __syncthreads();
        float p, ds;
        tile_p_ds(Qs, Ds, Ks, Vs, Ls, Dl, i0, j0, tq, tk, hd, scale, &p, &ds);
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
        attn_fwd(out, lse, q, k, v, tq, tk, heads, kv_heads, head_dim, scale);                   \
    }                                                                                            \
    extern "C" __global__ void attention_backward_delta_##S(float* delta, const T* dout,         \
                                                            const T* out, int tq, int heads,     \
                                                            int head_dim) {                      \
        attn_bwd_delta(delta, dout, out, tq, heads, head_dim);                                   \
    }                                                                                            \
    extern "C" __global__ void attention_backward_dkdv_##S(                                      \
        T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,       \
        const float* delta, int tq, int tk, int heads, int kv_heads, int head_dim,               \
        float scale) {                                                                           \
        attn_bwd_dkdv(dk, dv, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads, head_dim,      \
                      scale);                                                                    \
    }                                                                                            \
    extern "C" __global__ void attention_backward_dq_##S(                                        \
        T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse,              \
        const float* delta, int tq, int tk, int heads, int kv_heads, int head_dim,               \
        float scale) {                                                                           \
        attn_bwd_dq(dq, dout, q, k, v, lse, delta, tq, tk, heads, kv_heads, head_dim, scale);    \
    }
GANY_ATTENTION(f32, float)
GANY_ATTENTION(bf16, bf16)

// Grouped GEMM on the tensor cores: the routed experts' products in one launch, whatever the
// operand and result dtypes (cuBLAS's grouped GEMM refuses bf16 operands with an f32 result,
// which five of the experts' six backward products want; those otherwise run one GEMM per
// expert). Semantics of ganymede_core's NnOps::gemm_grouped with bf16 inputs: per group
// C = alpha op(A) op(B) + beta C, row-major with leading dimensions, operands rounded to bf16
// (nearest even) as they are loaded, products accumulated in f32 on mma.sync m16n8k16, C
// written in its dtype (a bf16 C rounded once). Deterministic: each output element is one
// thread's, its k summed in a fixed order.
//
// Groups are described in device memory (GG_DESC long longs each, see gg_desc below);
// gemm_experts_* below takes the experts' rows from offsets the device computed instead. Launch: one block of GG_THREADS per
// 64 × 64 output tile, tiles numbered group after group (desc's tile_start); grid.x = all tiles.
// Needs sm_80 (traps on older devices).

#define GG_BM 64
#define GG_BN 64
#define GG_BK 32
#define GG_PAD 8  // bf16 padding of shared rows
#define GG_THREADS 128
#define GG_DESC 14

// One group's description: the shape, leading dimensions, element offsets of A, B and C in
// their views, transposes, alpha and beta (f32 bits) and the first tile's number.
struct gg_desc {
    long long m, n, k, lda, ldb, ldc, a_off, b_off, c_off;
    bool ta, tb;
    float alpha, beta;
    long long tile_start;
};

__device__ __forceinline__ gg_desc gg_load(const long long* d) {
    gg_desc g;
    g.m = d[0];
    g.n = d[1];
    g.k = d[2];
    g.lda = d[3];
    g.ldb = d[4];
    g.ldc = d[5];
    g.a_off = d[6];
    g.b_off = d[7];
    g.c_off = d[8];
    g.ta = d[9] != 0;
    g.tb = d[10] != 0;
    g.alpha = __uint_as_float((unsigned)d[11]);
    g.beta = __uint_as_float((unsigned)d[12]);
    g.tile_start = d[13];
    return g;
}

// One operand element rounded to bf16 (an f32 is rounded; a bf16 is taken as it is).
__device__ __forceinline__ bf16 gg_round(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ bf16 gg_round(bf16 x) { return x; }

// A BM (or BN) × BK tile of op(X), staged through registers so that the next tile's global
// loads are in flight while the current one is multiplied: each thread holds GG_VECS runs of
// GG_VW elements, rounded to bf16. op(X)[r][c] is X[r·ld + c], or X[c·ld + r] transposed; a run
// lies along the stored rows' contiguous index (kk, or r transposed), so consecutive threads
// read consecutive runs. A run loads as one wide access where X and ld allow it (`wide`) and
// it lies inside the matrix; otherwise element by element, zeros outside. Either way the
// shared tile holds the same values.
#define GG_VW GANY_VW
#define GG_VECS (GG_BM * GG_BK / (GG_VW * GG_THREADS))
struct gg_regs {
    bf16 v[GG_VECS][GG_VW];
};

// Run j of this thread: its first (row, kk) in the tile.
__device__ __forceinline__ void gg_run(int j, bool trans, int* r, int* kk) {
    const int i = threadIdx.x + j * GG_THREADS;
    if (trans) {
        *r = (i % (GG_BM / GG_VW)) * GG_VW;
        *kk = i / (GG_BM / GG_VW);
    } else {
        *r = i / (GG_BK / GG_VW);
        *kk = (i % (GG_BK / GG_VW)) * GG_VW;
    }
}

template <typename T>
__device__ __forceinline__ bool gg_wide(const T* x, long long ld) {
    return vec_aligned(x) && ld % GG_VW == 0;
}

template <typename T>
__device__ __forceinline__ void gg_fetch(gg_regs& g, const T* x, long long ld, bool trans,
                                        bool wide, long long r0, long long rows, long long k0,
                                        long long k) {
#pragma unroll
    for (int j = 0; j < GG_VECS; j++) {
        int r, kk;
        gg_run(j, trans, &r, &kk);
        const long long gr = r0 + r, gk = k0 + kk;
        // The run's elements step along kk (stored rows) or r (transposed).
        const bool inside = trans ? (gk < k && gr + GG_VW <= rows) : (gr < rows && gk + GG_VW <= k);
        if (wide && inside) {
            const gany_vec<T> t = vload(trans ? x + gk * ld + gr : x + gr * ld + gk);
#pragma unroll
            for (int e = 0; e < GG_VW; e++) g.v[j][e] = gg_round(t.v[e]);
        } else {
#pragma unroll
            for (int e = 0; e < GG_VW; e++) {
                const long long er = gr + (trans ? e : 0), ek = gk + (trans ? 0 : e);
                g.v[j][e] = er < rows && ek < k ? gg_round(trans ? x[ek * ld + er] : x[er * ld + ek])
                                                : (bf16)0;
            }
        }
    }
}

__device__ __forceinline__ void gg_store(bf16 (*s)[GG_BK + GG_PAD], const gg_regs& g, bool trans) {
#pragma unroll
    for (int j = 0; j < GG_VECS; j++) {
        int r, kk;
        gg_run(j, trans, &r, &kk);
#pragma unroll
        for (int e = 0; e < GG_VW; e++) {
            if (trans)
                s[r + e][kk] = g.v[j][e];
            else
                s[r][kk + e] = g.v[j][e];
        }
    }
}

// Two neighbouring bf16 of a shared row as one operand register (lower index low).
__device__ __forceinline__ unsigned gg_pair(const bf16* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 16);
}

// One 64 × 64 tile of group g's C at (m0, n0): C = alpha op(A) op(B) + beta C over all of k
// (an empty k leaves beta C).
template <typename TA, typename TB, typename TC>
__device__ void gg_tile(TC* cg, const TA* ag, const TB* bg, const gg_desc& g, long long m0,
                        long long n0) {
    __shared__ __align__(16) bf16 sa[GG_BM][GG_BK + GG_PAD];
    // op(B) transposed: sb[col][kk] = op(B)[kk][col], so a B fragment's k pair is contiguous.
    __shared__ __align__(16) bf16 sb[GG_BN][GG_BK + GG_PAD];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gq = lane / 4, tq = lane % 4;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // the warp's 32 × 32 of the tile
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    // op(A) is m × k: A stored [m, k], or [k, m] transposed. op(B)ᵀ is n × k: B stored [n, k]
    // when transposed, else [k, n] (so the other way).
    const bool wa = gg_wide(ag, g.lda), wb = gg_wide(bg, g.ldb);
    gg_regs ra, rb;
    if (g.k > 0) {
        gg_fetch(ra, ag, g.lda, g.ta, wa, m0, g.m, 0, g.k);
        gg_fetch(rb, bg, g.ldb, !g.tb, wb, n0, g.n, 0, g.k);
    }
    for (long long k0 = 0; k0 < g.k; k0 += GG_BK) {
        gg_store(sa, ra, g.ta);
        gg_store(sb, rb, !g.tb);
        __syncthreads();
        // The next tile's loads, in flight during this one's products.
        if (k0 + GG_BK < g.k) {
            gg_fetch(ra, ag, g.lda, g.ta, wa, m0, g.m, k0 + GG_BK, g.k);
            gg_fetch(rb, bg, g.ldb, !g.tb, wb, n0, g.n, k0 + GG_BK, g.k);
        }
#pragma unroll
        for (int ks = 0; ks < GG_BK; ks += 16) {
            unsigned fa[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const bf16* r0 = &sa[wm + 16 * i + gq][ks + 2 * tq];
                const bf16* r8 = &sa[wm + 16 * i + gq + 8][ks + 2 * tq];
                fa[i][0] = gg_pair(r0);
                fa[i][1] = gg_pair(r8);
                fa[i][2] = gg_pair(r0 + 8);
                fa[i][3] = gg_pair(r8 + 8);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const bf16* col = &sb[wn + 8 * j + gq][ks + 2 * tq];
                const unsigned fb[2] = {gg_pair(col), gg_pair(col + 8)};
#pragma unroll
                for (int i = 0; i < 2; i++) mma_bf16_16816(acc[i][j], fa[i], fb);
            }
        }
        __syncthreads();
    }

    // C: c[0..1] at (row gq, cols 2tq, 2tq + 1), c[2..3] at row gq + 8.
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const long long r = m0 + wm + 16 * i + gq + (e >= 2 ? 8 : 0);
                const long long col = n0 + wn + 8 * j + 2 * tq + (e & 1);
                if (r >= g.m || col >= g.n) continue;
                TC* p = cg + r * g.ldc + col;
                float v = g.alpha * acc[i][j][e];
                if (g.beta != 0.f) v += g.beta * ld(p);
                st(p, v);
            }
}


template <typename TA, typename TB, typename TC>
__device__ void gemm_grouped(TC* c, const TA* a, const TB* b, const long long* desc,
                             int groups) {
#if !defined(GANY_HOST) && __CUDA_ARCH__ < 800
    __trap();
#endif
    // This block's group: the last whose first tile is at or before it.
    const long long tile = blockIdx.x;
    int gi = 0;
    while (gi + 1 < groups && desc[(long long)(gi + 1) * GG_DESC + 13] <= tile) gi++;
    const gg_desc g = gg_load(desc + (long long)gi * GG_DESC);
    const long long tn = (g.n + GG_BN - 1) / GG_BN, t = tile - g.tile_start;
    gg_tile(c + g.c_off, a + g.a_off, b + g.b_off, g, (t / tn) * GG_BM, (t % tn) * GG_BN);
}

// The routed experts' GEMMs with their rows read from device memory (offsets, u32 [E + 1], as
// the dispatch wrote them): no host read of the counts, so a step can run without waiting
// for them (and be captured as a graph). Expert e with rows r0 = offsets[e] .. offsets[e + 1]
// runs the template's GEMM with m (routed = 0) or k (routed = 1) set to its rows, on A, B and
// C from element offsets r0 · *_row + e · *_ex.
// Launch, routed on m: grid (ceil(max_rows / 64) + E, ceil(n / 64)); each block.x is one
// 64-row tile of one expert, tiles numbered expert after expert, blocks past the last exit.
// Routed on k: grid (E · ceil(m / 64), ceil(n / 64)); an expert without rows writes beta C
// (nothing at beta one).
template <typename TA, typename TB, typename TC>
__device__ void gemm_experts(TC* c, const TA* a, const TB* b, const unsigned* offsets,
                             int experts, int routed, long long m, long long n, long long k,
                             long long lda, long long ldb, long long ldc, int ta, int tb,
                             float alpha, float beta, long long a_row, long long a_ex,
                             long long b_row, long long b_ex, long long c_row,
                             long long c_ex) {
#if !defined(GANY_HOST) && __CUDA_ARCH__ < 800
    __trap();
#endif
    gg_desc g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.lda = lda;
    g.ldb = ldb;
    g.ldc = ldc;
    g.ta = ta != 0;
    g.tb = tb != 0;
    g.alpha = alpha;
    g.beta = beta;
    g.tile_start = 0;
    int e;
    long long m0;
    if (routed == 0) {
        // The expert whose tiles hold this one: a walk over the offsets (the same for every
        // thread, so broadcast reads).
        long long slot = blockIdx.x, first = 0;
        for (e = 0; e < experts; e++) {
            const long long rows = (long long)offsets[e + 1] - offsets[e];
            const long long tiles = (rows + GG_BM - 1) / GG_BM;
            if (slot < first + tiles) break;
            first += tiles;
        }
        if (e == experts) return;
        g.m = (long long)offsets[e + 1] - offsets[e];
        m0 = (slot - first) * GG_BM;
    } else {
        const long long tm = (m + GG_BM - 1) / GG_BM;
        e = (int)(blockIdx.x / tm);
        m0 = (blockIdx.x % tm) * GG_BM;
        g.k = (long long)offsets[e + 1] - offsets[e];
        if (g.k == 0 && beta == 1.f) return;
    }
    const long long r0 = offsets[e];
    g.a_off = r0 * a_row + e * a_ex;
    g.b_off = r0 * b_row + e * b_ex;
    g.c_off = r0 * c_row + e * c_ex;
    gg_tile(c + g.c_off, a + g.a_off, b + g.b_off, g, m0, (long long)blockIdx.y * GG_BN);
}

#define GEMM_GROUPED(NA, TA, NB, TB, NC, TC)                                                    \
    extern "C" __global__ void gemm_grouped_##NA##_##NB##_##NC(                                 \
        TC* c, const TA* a, const TB* b, const long long* desc, int groups) {                  \
        gemm_grouped<TA, TB, TC>(c, a, b, desc, groups);                                       \
    }
GEMM_GROUPED(f32, float, f32, float, f32, float)
GEMM_GROUPED(f32, float, bf16, bf16, f32, float)
GEMM_GROUPED(bf16, bf16, f32, float, f32, float)
GEMM_GROUPED(bf16, bf16, bf16, bf16, f32, float)
GEMM_GROUPED(f32, float, f32, float, bf16, bf16)
GEMM_GROUPED(f32, float, bf16, bf16, bf16, bf16)
GEMM_GROUPED(bf16, bf16, f32, float, bf16, bf16)
GEMM_GROUPED(bf16, bf16, bf16, bf16, bf16, bf16)

#define GEMM_EXPERTS(NA, TA, NB, TB, NC, TC)                                                    \
    extern "C" __global__ void gemm_experts_##NA##_##NB##_##NC(                                 \
        TC* c, const TA* a, const TB* b, const unsigned* offsets, int experts, int routed,     \
        long long m, long long n, long long k, long long lda, long long ldb, long long ldc,    \
        int ta, int tb, float alpha, float beta, long long a_row, long long a_ex,              \
        long long b_row, long long b_ex, long long c_row, long long c_ex) {                    \
        gemm_experts<TA, TB, TC>(c, a, b, offsets, experts, routed, m, n, k, lda, ldb, ldc,    \
                                 ta, tb, alpha, beta, a_row, a_ex, b_row, b_ex, c_row, c_ex);  \
    }
GEMM_EXPERTS(f32, float, f32, float, f32, float)
GEMM_EXPERTS(f32, float, bf16, bf16, f32, float)
GEMM_EXPERTS(bf16, bf16, f32, float, f32, float)
GEMM_EXPERTS(bf16, bf16, bf16, bf16, f32, float)
GEMM_EXPERTS(f32, float, f32, float, bf16, bf16)
GEMM_EXPERTS(f32, float, bf16, bf16, bf16, bf16)
GEMM_EXPERTS(bf16, bf16, f32, float, bf16, bf16)
GEMM_EXPERTS(bf16, bf16, bf16, bf16, bf16, bf16)

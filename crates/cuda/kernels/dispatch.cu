// Expert dispatch: group the (token, choice) pairs by expert with a counting sort, gather rows
// into the dispatched layout, and combine expert outputs back; forward and backward.
// Compiled after common.cuh (see src/sources.rs).
//
// The layout is the model's (Routing::dispatch): expert e's rows are offsets[e]..offsets[e+1],
// in increasing (token, choice) order; pos[t*k + j] is the row of token t's j-th choice and
// src[row] its token.

// The counting sort in three kernels over tiles of tile_len choices (one block per tile; a
// block's chunks of blockDim choices in order): per-tile counts per expert; their sums (the
// counts), the offsets and each tile's first row per expert; then each tile placing its
// choices. Stable: within a tile
// choices go in order, and tiles in order. Every thread's rank among equal experts earlier in
// its chunk is counted through shared memory, and the last of them moves the expert's cursor,
// so no atomics and the result is the same on every run. At most GANY_MAX_EXPERTS experts.
#define GANY_MAX_EXPERTS 1024
#define GANY_NO_EXPERT 0xffffffffu

// For the thread holding expert `mine` (or GANY_NO_EXPERT) in a chunk whose experts are in
// ids[0..blockDim): how many threads before it hold the same expert, and whether none after
// it does.
__device__ __forceinline__ unsigned chunk_rank(const unsigned* ids, unsigned mine, bool* last) {
    unsigned rank = 0;
    *last = true;
    for (int j = 0; j < (int)blockDim.x; j++) {
        if (ids[j] != mine) continue;
        if (j < (int)threadIdx.x) rank++;
        if (j > (int)threadIdx.x) *last = false;
    }
    return rank;
}

// One tile's pass: per chunk, `place(i, expert, row)` for each choice, where `row` is the
// expert's cursor plus the choice's rank; the cursors (cursor[0..experts], shared) move past
// the chunk.
template <class F>
__device__ void tile_pass(unsigned* cursor, const unsigned* idx, long long n, long long tile_len,
                          F place) {
    GANY_SHARED(unsigned, ids, [1024]);
    const long long i0 = (long long)blockIdx.x * tile_len;
    const long long i1 = i0 + tile_len < n ? i0 + tile_len : n;
    for (long long base = i0; base < i1; base += blockDim.x) {
        const long long i = base + threadIdx.x;
        const unsigned mine = i < i1 ? idx[i] : GANY_NO_EXPERT;
        ids[threadIdx.x] = mine;
        __syncthreads();
        bool last;
        const unsigned rank = chunk_rank(ids, mine, &last);
        if (mine != GANY_NO_EXPERT) place(i, mine, cursor[mine] + rank);
        __syncthreads();
        if (mine != GANY_NO_EXPERT && last) cursor[mine] += rank + 1;
        __syncthreads();
    }
}

// tiles[t * experts + e] = choices of expert e in tile t.
// Launch: grid ceil(n / tile_len), block a multiple of 32 up to 1024.
extern "C" __global__ void dispatch_tile_counts(unsigned* tiles, const unsigned* idx, int n,
                                                int experts, int tile_len) {
    GANY_SHARED(unsigned, cursor, [GANY_MAX_EXPERTS]);
    GANY_REQUIRE(experts <= GANY_MAX_EXPERTS && blockDim.x <= 1024);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) cursor[e] = 0;
    __syncthreads();
    tile_pass(cursor, idx, n, tile_len, [](long long, unsigned, unsigned) {});
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
        tiles[(long long)blockIdx.x * experts + e] = cursor[e];
}

// From the per-tile counts: counts[e] (their sum over tiles), offsets[e] = Σ_{f<e} counts[f]
// with offsets[experts] = n, and in place tiles[t * experts + e] = offsets[e] + Σ_{t' < t} (the
// counts of t'), tile t's first row of expert e. Launch: one block, experts threads rounded up
// to a multiple of 32 (at most 1024).
// totals (f64 [E], may be null) has each count added: a layer's counts over its chunks.
extern "C" __global__ void dispatch_tile_scan(unsigned* tiles, unsigned* counts,
                                              unsigned* offsets, double* totals, int n_tiles,
                                              int experts) {
    GANY_REQUIRE(gridDim.x == 1 && (int)blockDim.x >= experts);
    const int e = threadIdx.x;
    unsigned total = 0;
    if (e < experts)
        for (int t = 0; t < n_tiles; t++) total += tiles[(long long)t * experts + e];
    unsigned all;
    const unsigned first = block_exclusive_scan(total, &all);
    if (e < experts) {
        counts[e] = total;
        if (totals) totals[e] += (double)total;
        offsets[e] = first;
        unsigned run = first;
        for (int t = 0; t < n_tiles; t++) {
            const long long at = (long long)t * experts + e;
            const unsigned c = tiles[at];
            tiles[at] = run;
            run += c;
        }
    }
    if (e == 0) offsets[experts] = all;
}

// src[row] = the choice's token, pos[choice] = row, tile by tile from the scanned first rows.
// Launch: as dispatch_tile_counts.
extern "C" __global__ void dispatch_place(unsigned* src, unsigned* pos, const unsigned* tiles,
                                          const unsigned* idx, int n, int k, int experts,
                                          int tile_len) {
    GANY_SHARED(unsigned, cursor, [GANY_MAX_EXPERTS]);
    GANY_REQUIRE(experts <= GANY_MAX_EXPERTS && blockDim.x <= 1024);
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
        cursor[e] = tiles[(long long)blockIdx.x * experts + e];
    __syncthreads();
    tile_pass(cursor, idx, n, tile_len, [=](long long i, unsigned, unsigned row) {
        src[row] = (unsigned)(i / k);
        pos[i] = row;
    });
}

// Rows move GANY_VW elements at a time where rows_wide allows (row_loop in common.cuh); each
// element's arithmetic is the same either way, and the weights' dot products in combine_bwd add
// in another order.

// xe[r] = x[src[r]], in xe's storage O (the bits where O is T). Launch: grid = dispatched rows,
// any 1-D block.
template <class O, class T>
__device__ void gather_fwd(O* xe, const T* x, const unsigned* src, int dim) {
    const long long r = blockIdx.x, t = src[r];
    row_loop(dim, rows_wide(dim, xe, x), [&](int i, auto w) {
        copyw<decltype(w)::n>(xe + r * dim + i, x + t * dim + i);
    });
}

// dx[t] += Σ_j dxe[pos[t*k + j]], j in order. Launch: grid tokens, any 1-D block.
template <class T>
__device__ void gather_bwd(T* dx, const T* dxe, const unsigned* pos, int k, int dim) {
    const long long t = blockIdx.x;
    row_loop(dim, rows_wide(dim, dx, dxe), [&](int i, auto w) {
        constexpr int W = decltype(w)::n;
        float acc[W], v[W];
        ldw(acc, dx + t * dim + i);
        for (int j = 0; j < k; j++) {
            ldw(v, dxe + (long long)pos[t * k + j] * dim + i);
#pragma unroll
            for (int e = 0; e < W; e++) acc[e] += v[e];
        }
        stw(dx + t * dim + i, acc);
    });
}

// out[t] += Σ_j w[t*k + j] * ye[pos[t*k + j]], j in order, ye in its storage Y (widened).
// Launch: grid tokens, any 1-D block.
template <class T, class Y>
__device__ void combine_fwd(T* out, const Y* ye, const float* w, const unsigned* pos, int k,
                            int dim) {
    const long long t = blockIdx.x;
    row_loop(dim, rows_wide(dim, out, ye), [&](int i, auto wd) {
        constexpr int W = decltype(wd)::n;
        float acc[W], v[W];
        ldw(acc, out + t * dim + i);
        for (int j = 0; j < k; j++) {
            const float wj = w[t * k + j];
            ldw(v, ye + (long long)pos[t * k + j] * dim + i);
#pragma unroll
            for (int e = 0; e < W; e++) acc[e] += wj * v[e];
        }
        stw(out + t * dim + i, acc);
    });
}

// dw[t*k + j] = dout[t] · ye[pos], dye[pos] = w[t*k + j] * dout[t] (both overwritten; pos is a
// permutation, so each dye row is written once), dye in its storage O (bf16 from f32 rounds),
// ye in its storage Y (widened). Launch: grid tokens, block a multiple of 32.
template <class O, class T, class Y>
__device__ void combine_bwd(O* dye, float* dw, const T* dout, const Y* ye, const float* w,
                            const unsigned* pos, int k, int dim) {
    const long long t = blockIdx.x;
    const bool wide = rows_wide(dim, dye, dout, ye);
    for (int j = 0; j < k; j++) {
        const long long r = pos[t * k + j];
        const float wj = w[t * k + j];
        float dot = 0.0f;
        row_loop(dim, wide, [&](int i, auto wd) {
            constexpr int W = decltype(wd)::n;
            float d[W], y[W], g[W];
            ldw(d, dout + t * dim + i);
            ldw(y, ye + r * dim + i);
#pragma unroll
            for (int e = 0; e < W; e++) {
                dot += d[e] * y[e];
                g[e] = wj * d[e];
            }
            stw(dye + r * dim + i, g);
        });
        dot = block_sum(dot);
        if (threadIdx.x == 0) dw[t * k + j] = dot;
    }
}

#define GANY_DISPATCH(S, T)                                                                      \
    extern "C" __global__ void moe_gather_##S(T* xe, const T* x, const unsigned* src, int dim) { \
        gather_fwd(xe, x, src, dim);                                                             \
    }                                                                                            \
    extern "C" __global__ void moe_gather_backward_##S(T* dx, const T* dxe, const unsigned* pos, \
                                                       int k, int dim) {                         \
        gather_bwd(dx, dxe, pos, k, dim);                                                        \
    }                                                                                            \
    extern "C" __global__ void moe_combine_##S(T* out, const T* ye, const float* w,              \
                                               const unsigned* pos, int k, int dim) {            \
        combine_fwd(out, ye, w, pos, k, dim);                                                    \
    }                                                                                            \
    extern "C" __global__ void moe_combine_backward_##S(T* dye, float* dw, const T* dout,        \
                                                        const T* ye, const float* w,             \
                                                        const unsigned* pos, int k, int dim) {   \
        combine_bwd(dye, dw, dout, ye, w, pos, k, dim);                                          \
    }
GANY_DISPATCH(f32, float)
GANY_DISPATCH(bf16, bf16)
// The experts' rows under bf16 compute: f32 tokens dispatched into bf16 rows, and the combine's
// f32 gradient written as bf16 rows.
extern "C" __global__ void moe_gather_f32_to_bf16(bf16* xe, const float* x, const unsigned* src,
                                                  int dim) {
    gather_fwd(xe, x, src, dim);
}
extern "C" __global__ void moe_combine_backward_f32_to_bf16(bf16* dye, float* dw,
                                                            const float* dout, const float* ye,
                                                            const float* w, const unsigned* pos,
                                                            int k, int dim) {
    combine_bwd(dye, dw, dout, ye, w, pos, k, dim);
}
// The experts' outputs a bf16 GEMM wrote (bf16 GEMM outputs): combined into f32 tokens, and
// in backward read for the weights' gradient beside f32 output gradients, dye bf16 rows.
extern "C" __global__ void moe_combine_ye_bf16(float* out, const bf16* ye, const float* w,
                                               const unsigned* pos, int k, int dim) {
    combine_fwd(out, ye, w, pos, k, dim);
}
extern "C" __global__ void moe_combine_backward_ye_bf16(bf16* dye, float* dw, const float* dout,
                                                        const bf16* ye, const float* w,
                                                        const unsigned* pos, int k, int dim) {
    combine_bwd(dye, dw, dout, ye, w, pos, k, dim);
}

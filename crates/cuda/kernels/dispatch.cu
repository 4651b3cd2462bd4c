// Expert dispatch: group the (token, choice) pairs by expert with a counting sort, gather rows
// into the dispatched layout, and combine expert outputs back; forward and backward.
// Compiled after common.cuh (see src/sources.rs).
//
// The layout is the model's (Routing::dispatch): expert e's rows are offsets[e]..offsets[e+1],
// in increasing (token, choice) order; pos[t*k + j] is the row of token t's j-th choice and
// src[row] its token.

// counts[idx[i]] += 1 for the n = tokens * k choices; counts zeroed before.
// Launch: 1-D, any grid and block.
extern "C" __global__ void dispatch_count(unsigned* counts, const unsigned* idx, int n) {
    for (long long i = global_tid(); i < n; i += grid_threads()) atomicAdd(&counts[idx[i]], 1u);
}

// offsets[e] = Σ_{f<e} counts[f]; offsets[experts] = n. Launch: one block, one thread.
extern "C" __global__ void dispatch_offsets(unsigned* offsets, const unsigned* counts,
                                            int experts) {
    if (threadIdx.x != 0) return;
    unsigned s = 0;
    for (int e = 0; e < experts; e++) {
        offsets[e] = s;
        s += counts[e];
    }
    offsets[experts] = s;
}

// One block per expert scans every choice in order and places its own with a block prefix sum:
// stable, so rows within an expert are in (token, choice) order.
// Launch: grid experts, block a multiple of 32.
extern "C" __global__ void dispatch_place(unsigned* src, unsigned* pos, const unsigned* offsets,
                                          const unsigned* idx, int n, int k) {
    const unsigned e = blockIdx.x;
    unsigned next = offsets[e];
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const unsigned mine = (i < n && idx[i] == e) ? 1u : 0u;
        unsigned total;
        const unsigned rank = block_exclusive_scan(mine, &total);
        if (mine) {
            const unsigned p = next + rank;
            src[p] = (unsigned)(i / k);
            pos[i] = p;
        }
        next += total;
    }
}

// xe[r] = x[src[r]]. Launch: grid = dispatched rows, any 1-D block.
template <class T>
__device__ void gather_fwd(T* xe, const T* x, const unsigned* src, int dim) {
    const long long r = blockIdx.x, t = src[r];
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xe[r * dim + i] = x[t * dim + i];
}

// dx[t] += Σ_j dxe[pos[t*k + j]], j in order. Launch: grid tokens, any 1-D block.
template <class T>
__device__ void gather_bwd(T* dx, const T* dxe, const unsigned* pos, int k, int dim) {
    const long long t = blockIdx.x;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = ld(dx + t * dim + i);
        for (int j = 0; j < k; j++) acc += ld(dxe + (long long)pos[t * k + j] * dim + i);
        st(dx + t * dim + i, acc);
    }
}

// out[t] += Σ_j w[t*k + j] * ye[pos[t*k + j]], j in order. Launch: grid tokens, any 1-D block.
template <class T>
__device__ void combine_fwd(T* out, const T* ye, const float* w, const unsigned* pos, int k,
                            int dim) {
    const long long t = blockIdx.x;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = ld(out + t * dim + i);
        for (int j = 0; j < k; j++)
            acc += w[t * k + j] * ld(ye + (long long)pos[t * k + j] * dim + i);
        st(out + t * dim + i, acc);
    }
}

// dw[t*k + j] = dout[t] · ye[pos], dye[pos] = w[t*k + j] * dout[t] (both overwritten; pos is a
// permutation, so each dye row is written once). Launch: grid tokens, block a multiple of 32.
template <class T>
__device__ void combine_bwd(T* dye, float* dw, const T* dout, const T* ye, const float* w,
                            const unsigned* pos, int k, int dim) {
    const long long t = blockIdx.x;
    for (int j = 0; j < k; j++) {
        const long long r = pos[t * k + j];
        const float wj = w[t * k + j];
        float dot = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float d = ld(dout + t * dim + i);
            dot += d * ld(ye + r * dim + i);
            st(dye + r * dim + i, wj * d);
        }
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

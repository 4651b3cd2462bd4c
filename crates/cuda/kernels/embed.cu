// Token embedding, forward and backward. Compiled after common.cuh (see src/sources.rs).

// out[r] = wte[ids[r]], rows of dim (a bf16 table widened into f32 rows under bf16 compute).
// Launch: grid rows, any 1-D block.
template <class T, class W>
__device__ void embedding_fwd(T* out, const W* wte, const unsigned* ids, int dim) {
    const long long r = blockIdx.x;
    const long long src = (long long)ids[r] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) st(out + r * dim + i, ld(wte + src + i));
}

// dwte[ids[t]] += dout[t] without atomics, deterministically: the host groups the token ids
// when it builds the batch (ganymede_core::embedding_segments: `order` lists the tokens sorted
// by id, stably, and segment s holds order[seg_start[s] .. seg_start[s+1]], all of id
// seg_id[s]; past the last segment seg_start holds n, so those segments are empty), and each
// thread adds its column of its segment's rows in token order, as the CPU backend does (bit for
// bit). Byte ids leave a few segments thousands of rows long, so the rows are read EMB_UNROLL at
// a time before they are added (in order): a long segment is then bound by bandwidth rather
// than by one load's latency per row. The grid does not depend on how many segments there are
// (a CUDA graph replays it with the next batch's): blocks take segments in a grid-stride loop
// and stop at the first empty one.
// Launch: grid (any, column chunks of blockDim.x), any 1-D block; n the tokens.
#define EMB_UNROLL 8
template <class T>
__device__ void embedding_bwd_sorted(float* dwte, const T* dout, const unsigned* order,
                                     const unsigned* seg_start, const unsigned* seg_id, int dim,
                                     long long n) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= dim) return;  // no barrier below
    for (long long s = blockIdx.x; s < n; s += gridDim.x) {
        unsigned p = seg_start[s];
        const unsigned p1 = seg_start[s + 1];
        if (p == p1) return;  // the segments past the last are all empty
        const long long row = (long long)seg_id[s] * dim;
        float acc = dwte[row + i];
        for (; p + EMB_UNROLL <= p1; p += EMB_UNROLL) {
            float v[EMB_UNROLL];
#pragma unroll
            for (int u = 0; u < EMB_UNROLL; u++)
                v[u] = ld(dout + (long long)order[p + u] * dim + i);
#pragma unroll
            for (int u = 0; u < EMB_UNROLL; u++) acc += v[u];
        }
        for (; p < p1; p++) acc += ld(dout + (long long)order[p] * dim + i);
        dwte[row + i] = acc;
    }
}

extern "C" __global__ void embedding_forward_f32(float* out, const float* wte,
                                                 const unsigned* ids, int dim) {
    embedding_fwd(out, wte, ids, dim);
}
extern "C" __global__ void embedding_forward_bf16(bf16* out, const bf16* wte, const unsigned* ids,
                                                  int dim) {
    embedding_fwd(out, wte, ids, dim);
}
extern "C" __global__ void embedding_forward_f32_bf16(float* out, const bf16* wte,
                                                      const unsigned* ids, int dim) {
    embedding_fwd(out, wte, ids, dim);
}
extern "C" __global__ void embedding_backward_sorted_f32(float* dwte, const float* dout,
                                                         const unsigned* order,
                                                         const unsigned* seg_start,
                                                         const unsigned* seg_id, int dim,
                                                         long long n) {
    embedding_bwd_sorted(dwte, dout, order, seg_start, seg_id, dim, n);
}
extern "C" __global__ void embedding_backward_sorted_bf16(float* dwte, const bf16* dout,
                                                          const unsigned* order,
                                                          const unsigned* seg_start,
                                                          const unsigned* seg_id, int dim,
                                                          long long n) {
    embedding_bwd_sorted(dwte, dout, order, seg_start, seg_id, dim, n);
}

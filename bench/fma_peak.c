// This CPU's f32 FMA peak, measured: a loop of independent FMAs (enough accumulators to cover
// the FMA latency) per thread, for AVX2 (8 lanes) and AVX-512 (16 lanes). The result is the
// ceiling a GEMM can approach; comparing the two widths shows whether 512-bit FMAs are
// double-pumped (same FLOP/cycle as 256-bit).
//   gcc -O2 -mavx2 -mfma -mavx512f -fopenmp bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define N_ITERS 2400000000L

// Twelve named accumulators (an array made gcc keep them in memory, latency-bound).
#define ACC12(T, SET, FMA)                                                                  \
  T a0 = SET(0), a1 = SET(1), a2 = SET(2), a3 = SET(3), a4 = SET(4), a5 = SET(5), a6 = SET(6), \
    a7 = SET(7), a8 = SET(8), a9 = SET(9), a10 = SET(10), a11 = SET(11);                       \
  for (long it = 0; it < iters; it++) {                                                       \
    a0 = FMA(a0, m, b); a1 = FMA(a1, m, b); a2 = FMA(a2, m, b); a3 = FMA(a3, m, b);             \
    a4 = FMA(a4, m, b); a5 = FMA(a5, m, b); a6 = FMA(a6, m, b); a7 = FMA(a7, m, b);             \
    a8 = FMA(a8, m, b); a9 = FMA(a9, m, b); a10 = FMA(a10, m, b); a11 = FMA(a11, m, b);         \
  }
static double avx2(long iters) {
  __m256 m = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
#define S256(x) _mm256_set1_ps((float)(x))
  ACC12(__m256, S256, _mm256_fmadd_ps)
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
  float o[8];
  _mm256_storeu_ps(o, s);
  return o[0]; // keeps the loop alive
}
static double avx512(long iters) {
  __m512 m = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
#define S512(x) _mm512_set1_ps((float)(x))
  ACC12(__m512, S512, _mm512_fmadd_ps)
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                           _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
  return _mm512_reduce_add_ps(s);
}

int main(void) {
  long iters = N_ITERS / 12;
  for (int threads = 1; threads <= omp_get_num_procs(); threads++) {
    for (int w = 0; w < 2; w++) {
      double t0 = omp_get_wtime(), sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
      sink += w ? avx512(iters) : avx2(iters);
      double dt = omp_get_wtime() - t0;
      int lanes = w ? 16 : 8;
      double gflops = 2.0 * lanes * 12 * iters * threads / dt / 1e9;
      printf("%s threads %d: %.1f GFLOP/s f32 (%.1f per thread)%s\n", w ? "AVX-512" : "AVX2   ",
             threads, gflops, gflops / threads, sink == 12345.0 ? "!" : "");
    }
  }
  return 0;
}

// This CPU's f32 FMA peak, measured: a loop of independent FMAs (enough accumulators to cover
// the FMA latency) per thread, for AVX2 (8 lanes) and AVX-512 (16 lanes). The result is the
// ceiling a GEMM can approach; comparing the two widths shows whether 512-bit FMAs are
// double-pumped (same FLOP/cycle as 256-bit).
//   gcc -O2 -mavx2 -mfma -mavx512f -fopenmp bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define N_ITERS 2400000000L

static double avx2(long iters) {
  __m256 a[12], m = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
  for (long it = 0; it < iters; it++)
    for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], m, b);
  float s = 0, o[8];
  for (int i = 0; i < 12; i++) { _mm256_storeu_ps(o, a[i]); s += o[0]; }
  return s; // keeps the loop alive
}
static double avx512(long iters) {
  __m512 a[12], m = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
  for (long it = 0; it < iters; it++)
    for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], m, b);
  float s = 0;
  for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
  return s;
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

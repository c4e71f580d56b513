// The packed GEMM's tiles for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel
// client cores and servers before Skylake-SP): included by gemm.cpp, which owns the packed
// layout (its header comment) and picks these tiles where the AVX-512 ones are not built.
//
// Two tile shapes, both 12 ymm sums (there are 16 ymm registers): for decode-sized batches
// (M <= 8) 4 rows of x by half a panel (24 columns), three loads of W and four broadcasts of x
// per k; for more rows 6 by a third of a panel (16 columns), two loads of W per six rows, k
// in blocks of 128 that every row tile takes in turn while the block (W's 12 KB of it) is in
// L1. Threads split the panels. Measured on AMD Zen 3 (2 cores, the bench model's layers):
// about level with oneDNN in float32 (faster at M = 8 without the 49152-row LM head, ~15%
// slower with it), 3-7x faster than F.linear in bfloat16, where oneDNN has no GEMM on AVX2.
//
// float32: every output is sum_k x[m, k] * W[j, k], one FMA per k in order k = 0 … K-1, then
// + bias[j]: the same roundings as the AVX-512 tiles, so the two agree bit for bit.
// bfloat16 (no vdpbf16ps here): x and each panel are widened to float32 first, the panel into
// a per-thread buffer (at most K × 48 floats: 295 KB for K = 1536), with the two k of every
// pair swapped (k = 1, 0, 3, 2, …), so the FMAs run in vdpbf16ps's order (the odd k of a pair,
// then the even one; a product of two bfloat16 is exact in float32); the sum + bias is rounded
// to nearest even once. Either way a row's result depends only on that row (batch invariance).
#pragma once

#include <cstdint>

namespace shardserve_cpu {
constexpr int64_t kGemmPanel = 48;  // output columns per packed panel (gemm.cpp's layout)
}  // namespace shardserve_cpu

#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernel_common.h"

namespace shardserve_cpu::avx2 {

constexpr int64_t kPanel = kGemmPanel;

// The sums of one row of a tile, V ymm registers (8 V columns), and the step that adds
// x[k] * W[k, 0:8V) to them. Named registers, not an array: GCC keeps an array of ymm sums on
// the stack, one store per multiply-add.
template <int V>
struct Row {
  static_assert(V == 2 || V == 3);
  __m256 a, b, c;

  // the sums so far: zero, or (go on) the ones a previous block of k stored at `from`
  Row(const float* from, bool go_on)
      : a(go_on ? _mm256_loadu_ps(from) : _mm256_setzero_ps()),
        b(go_on ? _mm256_loadu_ps(from + 8) : _mm256_setzero_ps()),
        c(go_on && V > 2 ? _mm256_loadu_ps(from + 16) : _mm256_setzero_ps()) {}

  __attribute__((always_inline)) void add(const float* xk, __m256 w0, __m256 w1, __m256 w2) {
    const __m256 x = _mm256_broadcast_ss(xk);
    a = _mm256_fmadd_ps(x, w0, a);
    b = _mm256_fmadd_ps(x, w1, b);
    if constexpr (V > 2) c = _mm256_fmadd_ps(x, w2, c);
  }
  void store(float* out) const {
    _mm256_storeu_ps(out, a);
    _mm256_storeu_ps(out + 8, b);
    if constexpr (V > 2) _mm256_storeu_ps(out + 16, c);
  }
};

constexpr int64_t kMaxRows = 6;

// out[i * ld + c] (+)= sum_{k0 <= k < k1} x[i * ldx + k] * w[k * kPanel + c] for i < R, c < 8 V
// (ld = 8 V): added to what out holds when go_on, else from zero. R V sums (12 in the two
// shapes used), V loads of W and R broadcasts of x per k.
template <int V, int64_t R>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t k0,
          int64_t k1, bool go_on, float* __restrict out) {
  constexpr int64_t ld = 8 * V;
  Row<V> r0(out, go_on), r1(out + ld, go_on && R > 1), r2(out + 2 * ld, go_on && R > 2),
      r3(out + 3 * ld, go_on && R > 3), r4(out + 4 * ld, go_on && R > 4),
      r5(out + 5 * ld, go_on && R > 5);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kPanel;
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8),
                 w2 = V > 2 ? _mm256_loadu_ps(wk + 16) : w1;
    r0.add(x + k, w0, w1, w2);
    if constexpr (R > 1) r1.add(x + ldx + k, w0, w1, w2);
    if constexpr (R > 2) r2.add(x + 2 * ldx + k, w0, w1, w2);
    if constexpr (R > 3) r3.add(x + 3 * ldx + k, w0, w1, w2);
    if constexpr (R > 4) r4.add(x + 4 * ldx + k, w0, w1, w2);
    if constexpr (R > 5) r5.add(x + 5 * ldx + k, w0, w1, w2);
  }
  r0.store(out);
  if constexpr (R > 1) r1.store(out + ld);
  if constexpr (R > 2) r2.store(out + 2 * ld);
  if constexpr (R > 3) r3.store(out + 3 * ld);
  if constexpr (R > 4) r4.store(out + 4 * ld);
  if constexpr (R > 5) r5.store(out + 5 * ld);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, bool, float*);

// A tile shape: rows of x, columns of W, the k of one block (0: all of K at once), and the
// tile of each row count up to `rows`.
struct Shape {
  int64_t rows, cols, k_block;
  TileFn tiles[kMaxRows + 1];
};
// Decode-sized batches (M <= 8): 4 x 24, three loads of W per four rows, no pass over k
// blocks. Larger ones: 6 x 16, two loads of W per six rows, k in blocks of 128 whose W
// (12 KB) stays in L1 while every row tile takes the block in turn.
constexpr Shape kNarrow = {4, 24, 0, {nullptr, tile<3, 1>, tile<3, 2>, tile<3, 3>, tile<3, 4>}};
constexpr Shape kTall = {
    6, 16, 128, {nullptr, tile<2, 1>, tile<2, 2>, tile<2, 3>, tile<2, 4>, tile<2, 5>, tile<2, 6>}};

// y[m, col0 + c] = T(sums[m, c] + bias[col0 + c]) for the rows and columns of one tile.
template <typename T>
void store_tile(const float* sums, int64_t rows, int64_t cols, int64_t ld, const T* bias, T* y,
                int64_t ldy) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const float b = bias != nullptr ? to_f(bias[c]) : 0.f;
      y[i * ldy + c] = from_f<T>(sums[i * ld + c] + b);
    }
}

// One panel (`w`: float32, k rows kPanel apart, K of them) times the M rows of x (float32,
// rows ldx apart) into y's columns col0 … col0 + cols, in the shape M asks for. Whatever the
// shape or its blocks of k, each sum adds its k in order from zero, so the numbers do not
// depend on M.
template <typename T>
void panel_times_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K,
                      const T* bias, int64_t col0, int64_t cols, T* y, int64_t n) {
  const Shape& shape = M <= 8 ? kNarrow : kTall;
  thread_local std::vector<float> sums;
  sums.resize(((M + shape.rows - 1) / shape.rows) * shape.rows * shape.cols);
  const int64_t block = shape.k_block > 0 ? shape.k_block : std::max<int64_t>(K, 1);
  for (int64_t c0 = 0; c0 < cols; c0 += shape.cols) {
    const int64_t width = std::min(shape.cols, cols - c0);
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += block)
      for (int64_t m = 0; m < M; m += shape.rows)
        shape.tiles[std::min(shape.rows, M - m)](x + m * ldx, ldx, w + c0, k0,
                                                 std::min(K, k0 + block), k0 > 0,
                                                 &sums[m * shape.cols]);
    store_tile(sums.data(), M, width, shape.cols, bias == nullptr ? nullptr : bias + col0 + c0,
               y + col0 + c0, n);
  }
}

// float32: x [M, K], packed [P, K, 48] (gemm.cpp's layout) → y [M, n].
inline void gemm_f32(const float* x, int64_t ldx, int64_t M, const float* packed, int64_t P,
                     int64_t K, int64_t n, const float* bias, float* y) {
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
      panel_times_rows(x, ldx, M, packed + p * K * kPanel, K, bias, col0, cols, y, n);
    }
  });
}

// A bfloat16 panel [steps, 2 kPanel] (pairs) → float32 [2 steps, kPanel], each pair's k swapped:
// row 2s holds k = 2s + 1 (the high half of each 32-bit pair), row 2s + 1 holds k = 2s.
inline void widen_panel(const c10::BFloat16* panel, int64_t steps, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t j = 0; j < kPanel; j += 8) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (s * kPanel + j) * 2));
      float* pair = out + 2 * s * kPanel + j;  // row 2s (k = 2s + 1), then row 2s + 1 (k = 2s)
      _mm256_storeu_ps(pair, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
      _mm256_storeu_ps(pair + kPanel, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
}

// bfloat16: x [M, K], packed [P, steps, 2 kPanel] → y [M, n] (see the header comment).
inline void gemm_bf16(const c10::BFloat16* x, int64_t ldx, int64_t M,
                      const c10::BFloat16* packed, int64_t P, int64_t steps, int64_t K,
                      int64_t n, const c10::BFloat16* bias, c10::BFloat16* y) {
  const int64_t K2 = 2 * steps;  // K rounded up to whole pairs; the pad is 0 in x and W
  std::vector<float> wide_x(M * K2, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) wide_x[m * K2 + (k ^ 1)] = to_f(x[m * ldx + k]);
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wide_w;
    wide_w.resize(K2 * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
      widen_panel(packed + p * steps * 2 * kPanel, steps, wide_w.data());
      panel_times_rows(wide_x.data(), K2, M, wide_w.data(), K2, bias, col0, cols, y, n);
    }
  });
}

}  // namespace shardserve_cpu::avx2
#endif  // __AVX2__ && __FMA__

// Rows of x → per-block int8 activations, row-parallel: the first step of quant_gemm.cpp's
// and quant_panels.cpp's ops; and the checks and shapes those two ops share. quant_dot.h's quantize_row is the definition; with AVX-512
// (F + BW) the blocks are quantized sixteen values per instruction with the same float32 steps
// (amax, d = amax / 127, id = 1 / d, q = round-to-nearest-even(x · id) clamped to ±127, the
// same non-finite cases), so the same bytes: at M = 32 the scalar loop was ~20% of a decode
// step.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "kernel_common.h"
#include "quant_dot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SHARDSERVE_QUANT_ACT_AVX512 1
#endif

namespace shardserve_cpu::quant {

#if defined(SHARDSERVE_QUANT_ACT_AVX512)
// Sixteen values of x as float32.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row of x [n] → n / |A::q| blocks, bit for bit quantize_row's.
template <typename A, typename X>
void quantize_row_avx512(const X* x, int64_t n, A* out) {
  constexpr int64_t kB = sizeof(A::q), kV = kB / 16;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < n / kB; ++b) {
    __m512 v[kV];
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < kV; ++i) {
      v[i] = load16(x + b * kB + 16 * i);
      amax = _mm512_max_ps(amax, _mm512_and_ps(v[i], sign));
      nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
    }
    const float m = nan ? NAN : _mm512_reduce_max_ps(amax);
    const float d = m / 127.f, id = std::isfinite(d) && d != 0.f ? 1.f / d : 0.f;
    A& blk = out[b];
    blk.d = d;
    if (id == 0.f) {  // all-zero, or non-finite: quantize_row's zeros
      std::memset(blk.q, 0, kB);
      blk.sum = 0;
      if constexpr (kB == 256) std::memset(blk.bsums, 0, sizeof(blk.bsums));
      continue;
    }
    const __m512 scale = _mm512_set1_ps(id);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    int32_t sum = 0;
    for (int64_t i = 0; i < kV; ++i) {  // cvtps rounds to nearest even, as nearbyint does
      const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], scale)), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(blk.q + 16 * i), _mm512_cvtepi32_epi8(q));
      const int32_t s = _mm512_reduce_add_epi32(q);
      sum += s;
      if constexpr (kB == 256) blk.bsums[i] = static_cast<int16_t>(s);
    }
    blk.sum = sum;
  }
}
#endif

// x [M, K] (float32 or bfloat16) → M rows of K / |A::q| activation blocks, act_bytes per row.
template <typename X, typename A>
void quantize_rows(const X* x, int64_t M, int64_t K, uint8_t* act) {
  const int64_t row_bytes = K / static_cast<int64_t>(sizeof(A::q)) * sizeof(A);
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
#if defined(SHARDSERVE_QUANT_ACT_AVX512)
    for (int64_t m = m0; m < m1; ++m)
      quantize_row_avx512<A>(x + m * K, K, reinterpret_cast<A*>(act + m * row_bytes));
#else
    std::vector<float> buf(K);
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; ++k) buf[k] = to_f<X>(x[m * K + k]);
      quantize_row<A>(buf.data(), K, reinterpret_cast<A*>(act + m * row_bytes));
    }
#endif
  });
}

// What both quantized GEMM ops (quant_gemm, quant_gemm_panels) check and shape: x [..., K]
// float32 or bfloat16; ``blocks`` uint8 [N, row_bytes] of ``qtype`` for K, N a multiple of
// ``row_multiple`` (``layout`` names it in the error); bias [N] in x's dtype. Returns y
// [..., N] in x's dtype, filled by gemm(x, w, bias or nullptr, y, M, N, K) (typed pointers)
// unless M or N is 0.
template <typename Gemm>
at::Tensor quantized_linear(const char* op, const char* layout, int64_t row_multiple,
                            const at::Tensor& input, const at::Tensor& blocks, int64_t qtype,
                            const std::optional<at::Tensor>& bias, Gemm&& gemm) {
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              op, ": input must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(block_bytes(qtype) != 0, op, ": unsupported GGML type ", qtype);
  const int64_t K = input.size(-1), N = blocks.size(0);
  TORCH_CHECK(K % block_elems(qtype) == 0 && blocks.dim() == 2 && N % row_multiple == 0 &&
                  blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == K / block_elems(qtype) * block_bytes(qtype),
              op, ": ", layout, " of type ", qtype, " for K = ", K);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N &&
                                    bias->scalar_type() == dtype && bias->is_contiguous()),
              op, ": bias must be [N] in the input's dtype");
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  std::vector<int64_t> out_sizes = input.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty(out_sizes, x.options());
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return y;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    gemm(x.data_ptr<float>(), w, b, y.data_ptr<float>(), M, N, K);
  } else {
    using BF = c10::BFloat16;
    const BF* b = bias.has_value() ? bias->data_ptr<BF>() : nullptr;
    gemm(x.data_ptr<BF>(), w, b, y.data_ptr<BF>(), M, N, K);
  }
  return y;
}

}  // namespace shardserve_cpu::quant

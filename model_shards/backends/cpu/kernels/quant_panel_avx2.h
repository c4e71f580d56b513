// The 32-value types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) eight weight rows at a time: included by
// quant_gemm.cpp. Per block, the eight rows are decoded once into eight registers of unsigned
// quants; each activation row's block is loaded once, multiplied with all eight (vpdpbusd),
// and the eight int32 sums are reduced across lanes into one register whose lane i is weight
// row i (a fixed tree of horizontal adds), then scaled there: the scales, offsets and mins of
// the eight rows are vectors, so a block costs ~2.5 instructions per 32-value product rather
// than ~9 one row at a time (quant_dot_avx2.h's dot32, kept for the K-quants' shape).
//
//   y[m, n] = sum_b ad_b (wd_nb · Σ u q + c_nb · sum_b),   c = -8 wd | -16 wd | wm | -128 wd
//
// Q8_0 with VNNI: u = w + 128 (vpdpbusd does not saturate), c = -128 wd; without VNNI
// (maddubs saturates at 2^15): u = |w|, q signed by w, c = 0. Row n's lane never mixes with
// another row's, so the result depends on neither the other rows nor M.
#pragma once

#include "quant_dot_avx2.h"

#if defined(SHARDSERVE_QUANT_AVX2)

namespace shardserve_cpu::quant::avx2 {

// Lane i = Σ lanes of p[i] (a fixed tree: pairs, quads, then the two 128-bit halves).
inline __m256i reduce8(const __m256i* p) {
  const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                          _mm256_permute2x128_si256(q0, q1, 0x31));
}

// The float16 at byte ``off`` of block b of each of the eight rows, as eight floats.
inline __m256 gather_f16(const uint8_t* const* rows, int64_t offset) {
  uint16_t h[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&h[i], rows[i] + offset, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

constexpr bool kQ8Offset =
#if defined(SHARDSERVE_QUANT_VNNI)
    true;
#else
    false;
#endif

// One block of eight rows: their unsigned quants, scales and correction coefficients.
template <int64_t T>
struct Panel {
  __m256i u[8];
  __m256 wd, c;

  void load(const uint8_t* const* rows, int64_t b) {
    constexpr bool kFive = T == kQ5_0 || T == kQ5_1, kMin = T == kQ4_1 || T == kQ5_1;
    constexpr int kHead = kMin ? 4 : 2;
    for (int i = 0; i < 8; ++i) {
      const uint8_t* blk = rows[i] + b * block_bytes(T);
      if constexpr (T == kQ8_0) {
        const __m256i w8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        u[i] = kQ8Offset ? _mm256_xor_si256(w8, _mm256_set1_epi8(-128)) : w8;
      } else {
        const __m128i raw = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(blk + kHead + (kFive ? 4 : 0)));
        u[i] = low4(_mm256_setr_m128i(raw, _mm_srli_epi16(raw, 4)));
        if constexpr (kFive)
          u[i] = _mm256_or_si256(u[i], _mm256_and_si256(bytes_from_bits(blk + kHead),
                                                        _mm256_set1_epi8(0x10)));
      }
    }
    wd = gather_f16(rows, b * block_bytes(T));
    constexpr float kOff = T == kQ4_0 ? -8.f : T == kQ5_0 ? -16.f : T == kQ8_0 ? -128.f : 0.f;
    if constexpr (kMin) c = gather_f16(rows, b * block_bytes(T) + 2);
    else if constexpr (T == kQ8_0 && !kQ8Offset) c = _mm256_setzero_ps();
    else c = _mm256_mul_ps(wd, _mm256_set1_ps(kOff));
  }

  // Σ u q of the eight rows against one activation block, lane i = row i.
  __m256i dots(const int8_t* q8) const {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
    __m256i p[8];
    for (int i = 0; i < 8; ++i) {
      if constexpr (T == kQ8_0 && !kQ8Offset)
        p[i] = dot_u8s8(_mm256_abs_epi8(u[i]), _mm256_sign_epi8(q, u[i]));
      else
        p[i] = dot_u8s8(u[i], q);
    }
    return reduce8(p);
  }
};

// Eight weight rows (``rows``, each nb blocks) against R activation rows -> out[r * 8 + i].
template <int64_t T, int R>
void panel32(const uint8_t* const* rows, const ActA32* const* a, int64_t nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  Panel<T> panel;
  for (int64_t b = 0; b < nb; ++b) {
    panel.load(rows, b);
    for (int r = 0; r < R; ++r) {
      const ActA32& ab = a[r][b];
      const __m256 v = _mm256_cvtepi32_ps(panel.dots(ab.q));
      acc[r] = _mm256_fmadd_ps(v, _mm256_mul_ps(panel.wd, _mm256_set1_ps(ab.d)), acc[r]);
      acc[r] = _mm256_fmadd_ps(panel.c, _mm256_set1_ps(ab.d * static_cast<float>(ab.sum)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

}  // namespace shardserve_cpu::quant::avx2

#endif  // SHARDSERVE_QUANT_AVX2

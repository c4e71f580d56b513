// The 32-value types' eight-row panels with AVX-512 (BW + VL + VNNI): included by
// quant_gemm.cpp, which picks them over quant_panel_avx2.h's where the build has those.
//
// Same arithmetic as quant_panel_avx2.h's panel32 (the same exact int32 sums Σ u q, the same
// float32 steps per lane in the same order, so the two give identical bits); cheaper steps:
//   * two weight rows per zmm register: one vpdpbusd multiplies a pair of rows' blocks with
//     the activation block (held twice in the register), four per block of eight rows;
//   * the four registers reduce to one register of eight int32 (lane i = weight row i) with
//     two 128-bit lane shuffles and in-lane unpacks (12 instructions, not 8 + 21 uops of hadd);
//   * the eight rows' float16 scale (and min) come in as one 32-bit load per row, converted
//     together (vpmovdw + vcvtph2ps), not through memory;
//   * Q5_0 / Q5_1's fifth bits are a 64-bit mask (pdep) applied in one masked or per pair.
// Byte layout of a pair (rows a, b), in 128-bit lanes: the 4-bit types [a 0-15, b 0-15,
// a 16-31, b 16-31] (activations [q 0-15, q 0-15, q 16-31, q 16-31]); Q8_0 [a 0-31, b 0-31]
// (activations [q, q]).
#pragma once

#include "quant_panel_avx2.h"

#if defined(SHARDSERVE_QUANT_AVX2) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__BMI2__)
#define SHARDSERVE_QUANT_AVX512 1

namespace shardserve_cpu::quant::avx512 {

// Lane i = Σ of weight row i's int32 partials: p[j] holds rows 2j, 2j+1; kImmA / kImmB pick
// each row's first / second 128-bit lanes (the pair layouts above).
template <int kImmA, int kImmB>
inline __m256i reduce_pairs(const __m512i* p) {
  // [r0, r1, r2, r3] and [r4, r5, r6, r7], four int32 partials of each row per 128-bit lane
  const __m512i lo = _mm512_add_epi32(_mm512_shuffle_i32x4(p[0], p[1], kImmA),
                                      _mm512_shuffle_i32x4(p[0], p[1], kImmB));
  const __m512i hi = _mm512_add_epi32(_mm512_shuffle_i32x4(p[2], p[3], kImmA),
                                      _mm512_shuffle_i32x4(p[2], p[3], kImmB));
  // lane 4k: [lo_k 0+2, hi_k 0+2, lo_k 1+3, hi_k 1+3], then + its 64-bit swap
  const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi32(lo, hi), _mm512_unpackhi_epi32(lo, hi));
  const __m512i t = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_BADC));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, t));
}

// The 32 bits at ``offset`` of block b of each of the eight rows: lane i = row i.
inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m256i head32(const uint8_t* const* r, int64_t off) {
  auto four = [&](int i) {
    const __m128i v = _mm_cvtsi32_si128(load_i32(r[i] + off));
    return _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(v, load_i32(r[i + 1] + off), 1),
                                             load_i32(r[i + 2] + off), 2),
                            load_i32(r[i + 3] + off), 3);
  };
  return _mm256_setr_m128i(four(0), four(4));
}

inline __m256 f16_lo(__m256i v) { return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(v)); }
inline __m256 f16_hi(__m256i v) { return f16_lo(_mm256_srli_epi32(v, 16)); }

// One block of eight rows: four pair registers of unsigned quants, scales, coefficients.
template <int64_t T>
struct Panel {
  static constexpr bool kFive = T == kQ5_0 || T == kQ5_1, kMin = T == kQ4_1 || T == kQ5_1;
  static constexpr int kHead = kMin ? 4 : 2;
  __m512i u[4];
  __m256 wd, c;

  void load(const uint8_t* const* rows, int64_t b) {
    const int64_t off = b * block_bytes(T);
    for (int j = 0; j < 4; ++j) {
      const uint8_t* pa = rows[2 * j] + off;
      const uint8_t* pb = rows[2 * j + 1] + off;
      if constexpr (T == kQ8_0) {  // u = w + 128 (vpdpbusd does not saturate)
        const __m512i w8 = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa + 2))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 2)), 1);
        u[j] = _mm512_xor_si512(w8, _mm512_set1_epi8(-128));
      } else {
        constexpr int kQs = kHead + (kFive ? 4 : 0);
        const __m256i raw = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(pb + kQs),
                                                reinterpret_cast<const __m128i*>(pa + kQs));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw),
                                                _mm256_srli_epi16(raw, 4), 1);
        u[j] = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
        if constexpr (kFive) {
          uint32_t qa, qb;
          std::memcpy(&qa, pa + kHead, 4);
          std::memcpy(&qb, pb + kHead, 4);
          const __mmask64 m = _pdep_u64(qa, 0x0000FFFF0000FFFFull) |
                              _pdep_u64(qb, 0xFFFF0000FFFF0000ull);
          u[j] = _mm512_mask_add_epi8(u[j], m, u[j], _mm512_set1_epi8(0x10));  // bit 4 is clear
        }
      }
    }
    const __m256i head = head32(rows, off);
    wd = f16_lo(head);
    constexpr float kOff = T == kQ4_0 ? -8.f : T == kQ5_0 ? -16.f : T == kQ8_0 ? -128.f : 0.f;
    if constexpr (kMin) c = f16_hi(head);
    else c = _mm256_mul_ps(wd, _mm256_set1_ps(kOff));
  }

  // The activation block as the pairs' layout wants it.
  static __m512i act(const int8_t* q8) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
    const __m512i qq = _mm512_broadcast_i64x4(q);  // [q 0-15, q 16-31, q 0-15, q 16-31]
    if constexpr (T == kQ8_0) return qq;
    else return _mm512_shuffle_i64x2(qq, qq, _MM_SHUFFLE(3, 1, 2, 0));
  }

  // Σ u q of the eight rows against one activation block, lane i = row i.
  __m256i dots(__m512i q) const {
    __m512i p[4];
    for (int j = 0; j < 4; ++j) p[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[j], q);
    if constexpr (T == kQ8_0) return reduce_pairs<0x88, 0xDD>(p);
    else return reduce_pairs<0x44, 0xEE>(p);
  }
};

// Eight weight rows (``rows``, each nb blocks) against R activation rows -> out[r * 8 + i];
// the float steps are quant_panel_avx2.h's panel32's, lane for lane.
template <int64_t T, int R>
void panel32(const uint8_t* const* rows, const ActA32* const* a, int64_t nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  Panel<T> panel;
  // the next eight rows (they follow row 7 when the rows are consecutive), a block's share
  // of their bytes per block: they arrive from memory while these are multiplied
  const uint8_t* next = rows[7] + (rows[1] - rows[0]);
  constexpr int64_t kShare = 8 * block_bytes(T);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t p = 0; p < kShare; p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + b * kShare + p), _MM_HINT_T0);
    panel.load(rows, b);
    for (int r = 0; r < R; ++r) {
      const ActA32& ab = a[r][b];
      const __m256 v = _mm256_cvtepi32_ps(panel.dots(Panel<T>::act(ab.q)));
      acc[r] = _mm256_fmadd_ps(v, _mm256_mul_ps(panel.wd, _mm256_set1_ps(ab.d)), acc[r]);
      acc[r] = _mm256_fmadd_ps(panel.c, _mm256_set1_ps(ab.d * static_cast<float>(ab.sum)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

}  // namespace shardserve_cpu::quant::avx512

#endif

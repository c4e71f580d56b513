// The K-quants (Q4_K, Q5_K, Q6_K) eight weight rows at a time, as quant_panel_avx2.h does for
// the 32-value types: included by quant_gemm.cpp. Per 256-value superblock the rows' scales
// and mins are unpacked once into vectors (lane i = row i); per 32-value sub-block the eight
// rows' quants are decoded once, each activation row's sub-block is loaded once, and the
// eight vpdpbusd sums are reduced to one register of row lanes, times the rows' sub-block
// scales (Q6_K: maddubs, then madd with each row's two 16-value group scales, before the
// reduction). The mins (Q6_K:
// the offset 32) are Σ over sub-blocks of the rows' mins times the activation's block sums.
//
//   Q4_K / Q5_K  y += d ad Σ_j sc_j Σ u q - dmin ad Σ_j m_j bsum_j
//   Q6_K         y += d ad (Σ_g sc_g Σ u q - 32 Σ_g sc_g bsum_g)
//
// all integer until the one float scaling per superblock; rows never mix (batch invariance).
#pragma once

#include "quant_panel_avx2.h"

#if defined(SHARDSERVE_QUANT_AVX2)

namespace shardserve_cpu::quant::avx2 {

inline __m256i load_i32(const int32_t* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

// One superblock of eight rows: d, dmin and the per-sub-block (Q6_K: per group) scale and min
// vectors, and where each row's quants are.
template <int64_t T>
struct KPanel {
  static constexpr int kGroups = T == kQ6_K ? 16 : 8;
  const uint8_t* blk[8];
  __m256 d, dmin;
  alignas(32) int32_t sc[kGroups][8];
  alignas(32) int32_t mn[8][8];  // Q4_K / Q5_K mins

  void load(const uint8_t* const* rows, int64_t b) {
    alignas(32) float dd[8], dm[8];
    for (int i = 0; i < 8; ++i) {
      blk[i] = rows[i] + b * block_bytes(T);
      if constexpr (T == kQ6_K) {
        dd[i] = fp16(blk[i] + 208), dm[i] = 0.f;
        const auto* s = reinterpret_cast<const int8_t*>(blk[i] + 192);
        for (int g = 0; g < 16; ++g) sc[g][i] = s[g];
      } else {
        dd[i] = fp16(blk[i]), dm[i] = fp16(blk[i] + 2);
        int s[8], m[8];
        k_scale_min(blk[i] + 4, s, m);
        for (int j = 0; j < 8; ++j) sc[j][i] = s[j], mn[j][i] = m[j];
      }
    }
    d = _mm256_load_ps(dd), dmin = _mm256_load_ps(dm);
  }

  // Row i's unsigned quants of sub-block j (Q6_K: j = 4 h + s, half h, quarter s).
  __m256i quants(int i, int j) const {
    const uint8_t* p = blk[i];
    if constexpr (T == kQ6_K) {
      const int h = j >> 2, s = j & 3;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (s & 1)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      return _mm256_or_si256(low4(s >> 1 ? _mm256_srli_epi16(l, 4) : l), bit_to(qh, 2 * s, 3, 4));
    } else {
      const uint8_t* qs = p + (T == kQ5_K ? 48 : 16);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j >> 1)));
      __m256i u = low4(j & 1 ? _mm256_srli_epi16(v, 4) : v);
      if constexpr (T == kQ5_K)
        u = _mm256_or_si256(u, bit_to(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)), j, 1, 4));
      return u;
    }
  }
};

template <int64_t T, int R>
void panel_k(const uint8_t* const* rows, const ActA256* const* a, int64_t nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  KPanel<T> panel;
  const uint8_t* next = rows[7] + (rows[1] - rows[0]);  // the next eight rows, prefetched
  constexpr int64_t kShare = 8 * block_bytes(T);        // a block's share of their bytes
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t p = 0; p < kShare; p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + b * kShare + p), _MM_HINT_T0);
    panel.load(rows, b);
    __m256i isum[R], msum[R];
    for (int r = 0; r < R; ++r) isum[r] = msum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i u[8], scale[8];
      for (int i = 0; i < 8; ++i) {
        u[i] = panel.quants(i, j);
        if constexpr (T == kQ6_K)  // 16-bit lanes 0-7: group 2j, 8-15: group 2j + 1
          scale[i] = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(panel.sc[2 * j][i])),
                                       _mm_set1_epi16(static_cast<int16_t>(panel.sc[2 * j + 1][i])));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r][b].q + 32 * j));
        __m256i p[8];
        for (int i = 0; i < 8; ++i) {  // Q6_K: u <= 63, so maddubs cannot saturate
          if constexpr (T == kQ6_K)
            p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], q), scale[i]);
          else
            p[i] = dot_u8s8(u[i], q);
        }
        __m256i v = reduce8(p);
        if constexpr (T != kQ6_K) v = _mm256_mullo_epi32(v, load_i32(panel.sc[j]));
        isum[r] = _mm256_add_epi32(isum[r], v);
      }
    }
    for (int r = 0; r < R; ++r) {
      const ActA256& ab = a[r][b];
      for (int g = 0; g < KPanel<T>::kGroups; ++g) {
        const int bsum = T == kQ6_K ? ab.bsums[g] : ab.bsums[2 * g] + ab.bsums[2 * g + 1];
        const __m256i w = load_i32(T == kQ6_K ? panel.sc[g] : panel.mn[g]);
        msum[r] = _mm256_add_epi32(msum[r], _mm256_mullo_epi32(w, _mm256_set1_epi32(bsum)));
      }
      const __m256 ad = _mm256_set1_ps(ab.d);
      if constexpr (T == kQ6_K) {
        const __m256i total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(msum[r], 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(panel.d, ad), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(panel.d, ad), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(panel.dmin, ad), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

}  // namespace shardserve_cpu::quant::avx2

#endif  // SHARDSERVE_QUANT_AVX2

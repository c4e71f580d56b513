// The AVX2 (+ VNNI where built) dot products of quant_dot.h's contract: one weight row
// against R activation rows, each weight block decoded into 32 unsigned bytes per register
// (Q8_0: abs(w) with q signed by w), multiplied with the int8 activations by vpdpbusd (or
// maddubs + madd), summed in int32 lanes and scaled once per block (K-quants: once per 256).
#pragma once

#include "quant_dot.h"

#if defined(SHARDSERVE_QUANT_AVX2)

namespace shardserve_cpu::quant::avx2 {

inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(SHARDSERVE_QUANT_VNNI)
  return SHARDSERVE_DPBUSD(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Per-lane int32 sums of bytes 0-15 times lo and bytes 16-31 times hi.
struct Scale {
  __m256i v;
};
inline Scale scale2(int lo, int hi) {
#if defined(SHARDSERVE_QUANT_VNNI)
  return {_mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi)};
#else
  return {_mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(lo)),
                            _mm_set1_epi16(static_cast<int16_t>(hi)))};
#endif
}
inline __m256i scaled_dot(__m256i u, __m256i s, Scale sc) {
#if defined(SHARDSERVE_QUANT_VNNI)
  return _mm256_mullo_epi32(SHARDSERVE_DPBUSD(_mm256_setzero_si256(), u, s), sc.v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc.v);
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i bit_to(__m256i v, int shift, int mask, int to) {  // ((v >> shift) & mask) << to
  const __m256i b = _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(mask));
  return _mm256_slli_epi16(b, to);
}

// Byte i = 0xFF where bit i of the 32 bits at p is set (ggml's bytes_from_bits_32).
inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

template <int64_t T, int R>
void dot32(const uint8_t* w, const ActA32* const* a, int64_t nb, float* out) {
  constexpr bool kFive = T == kQ5_0 || T == kQ5_1, kMin = T == kQ4_1 || T == kQ5_1;
  constexpr int kHead = kMin ? 4 : 2, kOff = T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : 0;
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), corr[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(T);
    const float wd = fp16(blk);
    __m256i u;
    if constexpr (T == kQ8_0) {
      u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      const __m128i raw = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(blk + kHead + (kFive ? 4 : 0)));
      u = low4(_mm256_setr_m128i(raw, _mm_srli_epi16(raw, 4)));
      if constexpr (kFive)
        u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits(blk + kHead),
                                                _mm256_set1_epi8(0x10)));
    }
    for (int r = 0; r < R; ++r) {
      const ActA32& ab = a[r][b];
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab.q));
      __m256i p;
      if constexpr (T == kQ8_0) p = dot_u8s8(_mm256_abs_epi8(u), _mm256_sign_epi8(q, u));
      else p = dot_u8s8(u, q);
      const float s = wd * ab.d;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc[r]);
      if constexpr (kOff != 0) corr[r] -= s * static_cast<float>(kOff * ab.sum);
      if constexpr (kMin) corr[r] += fp16(blk + 2) * ab.d * static_cast<float>(ab.sum);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + corr[r];
}

// Q6_K: 16 groups of 16 with int8 scales; u = the 6-bit quants, offset 32 via the bsums.
template <int R>
void dot_q6k(const uint8_t* w, const ActA256* const* a, int64_t nb, float* out) {
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), corr[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(kQ6_K);
    __m256i isum[R];
    int32_t msum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256(), msum[r] = 0;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int h = 0; h < 2; ++h) {
      const auto* ql = reinterpret_cast<const __m256i*>(blk + 64 * h);
      const __m256i l0 = _mm256_loadu_si256(ql), l1 = _mm256_loadu_si256(ql + 1);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m256i us[4] = {_mm256_or_si256(low4(l0), bit_to(qh, 0, 3, 4)),
                             _mm256_or_si256(low4(l1), bit_to(qh, 2, 3, 4)),
                             _mm256_or_si256(low4(_mm256_srli_epi16(l0, 4)), bit_to(qh, 4, 3, 4)),
                             _mm256_or_si256(low4(_mm256_srli_epi16(l1, 4)), bit_to(qh, 6, 3, 4))};
      for (int s = 0; s < 4; ++s) {
        const int g = 8 * h + 2 * s;
        const Scale scale = scale2(sc[g], sc[g + 1]);
        for (int r = 0; r < R; ++r) {
          const auto* q = reinterpret_cast<const __m256i*>(a[r][b].q + 128 * h + 32 * s);
          isum[r] = _mm256_add_epi32(isum[r], scaled_dot(us[s], _mm256_loadu_si256(q), scale));
          msum[r] += 32 * (sc[g] * a[r][b].bsums[g] + sc[g + 1] * a[r][b].bsums[g + 1]);
        }
      }
    }
    const float d = fp16(blk + 208);
    for (int r = 0; r < R; ++r) {
      const float s = d * a[r][b].d;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(s), acc[r]);
      corr[r] -= s * static_cast<float>(msum[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + corr[r];
}

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.
template <int64_t T, int R>
void dot_k(const uint8_t* w, const ActA256* const* a, int64_t nb, float* out) {
  if constexpr (T == kQ6_K) {
    dot_q6k<R>(w, a, nb, out);
    return;
  }
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), corr[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(T);
    __m256i isum[R];
    int32_t msum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256(), msum[r] = 0;
    int sc[8], m[8];
    k_scale_min(blk + 4, sc, m);
    const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);
    const __m256i qh = T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                  : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = low4(v), hi = low4(_mm256_srli_epi16(v, 4));
      if constexpr (T == kQ5_K) {
        lo = _mm256_or_si256(lo, bit_to(qh, 2 * j, 1, 4));
        hi = _mm256_or_si256(hi, bit_to(qh, 2 * j + 1, 1, 4));
      }
      const Scale s_lo = scale2(sc[2 * j], sc[2 * j]), s_hi = scale2(sc[2 * j + 1], sc[2 * j + 1]);
      for (int r = 0; r < R; ++r) {
        const auto* q = reinterpret_cast<const __m256i*>(a[r][b].q + 64 * j);
        const __m256i p = _mm256_add_epi32(scaled_dot(lo, _mm256_loadu_si256(q), s_lo),
                                           scaled_dot(hi, _mm256_loadu_si256(q + 1), s_hi));
        isum[r] = _mm256_add_epi32(isum[r], p);
      }
    }
    const float d = fp16(blk), dmin = fp16(blk + 2);
    for (int r = 0; r < R; ++r) {
      const ActA256& ab = a[r][b];
      for (int j = 0; j < 8; ++j) msum[r] += m[j] * (ab.bsums[2 * j] + ab.bsums[2 * j + 1]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * ab.d), acc[r]);
      corr[r] -= dmin * ab.d * static_cast<float>(msum[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + corr[r];
}

}  // namespace shardserve_cpu::quant::avx2

#endif  // SHARDSERVE_QUANT_AVX2

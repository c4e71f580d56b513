// The AVX2 (+ VNNI where built) pieces of the quantized GEMM's panels (quant_panel_avx2.h,
// quant_panel_k_avx2.h): unsigned-by-signed int8 dot products (vpdpbusd, or maddubs + madd),
// nibble and bit-plane unpacking of GGML blocks into 32 unsigned bytes per register.
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

}  // namespace shardserve_cpu::quant::avx2

#endif  // SHARDSERVE_QUANT_AVX2

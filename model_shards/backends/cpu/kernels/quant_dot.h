// Dot products of GGML weight blocks with per-block int8 activations: included by
// quant_gemm.cpp (which owns the op, its contract and the measurements).
//
// Activations: each row of x is quantized per block (quantize_row below) to
//   ActA32  (the 32-value weight types):  d = max|x| / 127, q = round(x / d) in [-127, 127],
//           sum = Σ q   (the weight types' offsets and mins fold into sum)
//   ActA256 (the K-quants):               the same over 256 values, bsums[g] = Σ q over 16
// so every block product is an exact int32 dot product, scaled once in float32.
//
// Per weight block (layouts: model_shards/quant/dequantize.py), with u the unsigned quants:
//   Q8_0  wd ad Σ w q                     Q4_0 / Q5_0  wd ad (Σ u q - 8|16 sum)
//   Q4_1 / Q5_1  wd ad Σ u q + wm ad sum
//   Q4_K / Q5_K  d ad Σ_j sc_j Σ u q - dmin ad Σ_j m_j (bsums of sub-block j)
//   Q6_K  d ad Σ_g sc_g (Σ u q - 32 bsums_g)
// dot_scalar<T, R> computes R activation rows against one weight row: the weight block is
// decoded once for the R rows, and each row's sums follow exactly the steps they would alone,
// so the result never depends on R (batch invariance). The AVX2 panels (quant_panel*.h) run
// the int8 products on VNNI (vpdpbusd) where the build has it (AVX-VNNI or AVX512-VNNI+VL),
// else maddubs + madd.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SHARDSERVE_QUANT_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SHARDSERVE_QUANT_VNNI 1
#define SHARDSERVE_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define SHARDSERVE_QUANT_VNNI 1
#define SHARDSERVE_DPBUSD _mm256_dpbusd_avx_epi32
#endif
#endif

namespace shardserve_cpu::quant {

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12,
                       kQ5_K = 13, kQ6_K = 14 };

constexpr int64_t block_elems(int64_t t) { return t >= kQ4_K ? 256 : 32; }
constexpr int64_t block_bytes(int64_t t) {
  return t == kQ4_0 ? 18 : t == kQ4_1 ? 20 : t == kQ5_0 ? 22 : t == kQ5_1 ? 24 : t == kQ8_0 ? 34
       : t == kQ4_K ? 144 : t == kQ5_K ? 176 : t == kQ6_K ? 210 : 0;
}
constexpr bool is_k(int64_t t) { return t >= kQ4_K; }

// f(std::integral_constant<int64_t, T>{}) for the served GGML type t, T its compile-time value
// (the kernels' per-type dispatch); false if t is none of them.
template <typename F>
bool with_type(int64_t t, F&& f) {
  switch (t) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); return true;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); return true;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); return true;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); return true;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); return true;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); return true;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); return true;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); return true;
    default: return false;
  }
}

struct ActA32 { float d; int32_t sum; int8_t q[32]; };
struct ActA256 { float d; int32_t sum; int16_t bsums[16]; int8_t q[256]; };

template <int64_t T>
using Act = std::conditional_t<is_k(T), ActA256, ActA32>;

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// x [n] float32 -> n / 32 (or / 256) activation blocks.
template <typename A>
void quantize_row(const float* x, int64_t n, A* out) {
  constexpr int64_t kB = sizeof(A::q);
  for (int64_t b = 0; b < n / kB; ++b) {
    const float* xb = x + b * kB;
    float amax = 0.f;  // NaN if the block holds one: its outputs are then NaN too
    for (int64_t i = 0; i < kB; ++i) {
      const float a = std::fabs(xb[i]);
      amax = (a > amax || a != a) ? a : amax;
    }
    const float d = amax / 127.f, id = std::isfinite(d) && d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kB; ++i) {
      const float scaled = xb[i] * id;  // inf * 0 in a non-finite block: NaN, taken as 0
      const int v = scaled == scaled ? static_cast<int>(std::nearbyint(scaled)) : 0;
      out[b].q[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
      sum += out[b].q[i];
    }
    out[b].d = d;
    out[b].sum = sum;
    if constexpr (kB == 256) {
      for (int g = 0; g < 16; ++g) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += out[b].q[16 * g + i];
        out[b].bsums[g] = static_cast<int16_t>(s);
      }
    }
  }
}

// Q4_K / Q5_K's 6-bit scales and mins of the 8 sub-blocks.
inline void k_scale_min(const uint8_t* s, int* sc, int* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// ---- scalar: one block's values as ints, then plain loops ------------------------------
template <int64_t T>
void decode32(const uint8_t* blk, int* u) {  // the 32-value types' quants (Q8_0: signed)
  if constexpr (T == kQ8_0) {
    for (int i = 0; i < 32; ++i) u[i] = static_cast<int8_t>(blk[2 + i]);
    return;
  }
  const int head = (T == kQ4_1 || T == kQ5_1) ? 4 : 2;
  const bool five = T == kQ5_0 || T == kQ5_1;
  const uint8_t* qs = blk + head + (five ? 4 : 0);
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, blk + head, 4);
  for (int i = 0; i < 16; ++i) {
    u[i] = (qs[i] & 0x0F) | (five ? ((qh >> i) & 1) << 4 : 0);
    u[i + 16] = (qs[i] >> 4) | (five ? ((qh >> (i + 16)) & 1) << 4 : 0);
  }
}

template <int64_t T>
void decode256(const uint8_t* blk, int* u) {  // K-quants: the 256 unsigned quants
  if constexpr (T == kQ6_K) {
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int lo = (blk[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0x0F;
          const int hi = (blk[128 + 32 * h + l] >> (2 * s)) & 3;
          u[128 * h + 32 * s + l] = lo | (hi << 4);
        }
    return;
  }
  const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 32; ++l) {
      int v = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0x0F;
      if (T == kQ5_K) v |= ((blk[16 + l] >> j) & 1) << 4;
      u[32 * j + l] = v;
    }
}

template <int64_t T, int R>
void dot_scalar(const uint8_t* w, const Act<T>* const* a, int64_t nb, float* out) {
  float acc[R] = {};
  int u[256];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(T);
    for (int r = 0; r < R; ++r) {
      const Act<T>& ab = a[r][b];
      if constexpr (!is_k(T)) {
        if (r == 0) decode32<T>(blk, u);
        int32_t dot = 0;
        for (int i = 0; i < 32; ++i) dot += u[i] * ab.q[i];
        const int off = T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : 0;
        const float s = fp16(blk) * ab.d;
        acc[r] += s * static_cast<float>(dot - off * ab.sum);
        if (T == kQ4_1 || T == kQ5_1) acc[r] += fp16(blk + 2) * ab.d * static_cast<float>(ab.sum);
      } else {
        if (r == 0) decode256<T>(blk, u);
        int32_t isum = 0, msum = 0;
        if constexpr (T == kQ6_K) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          for (int g = 0; g < 16; ++g) {
            int32_t dot = 0;
            for (int i = 0; i < 16; ++i) dot += u[16 * g + i] * ab.q[16 * g + i];
            isum += sc[g] * dot;
            msum += sc[g] * 32 * ab.bsums[g];
          }
          const float s = fp16(blk + 208) * ab.d;
          acc[r] += s * static_cast<float>(isum) - s * static_cast<float>(msum);
        } else {
          int sc[8], m[8];
          k_scale_min(blk + 4, sc, m);
          for (int j = 0; j < 8; ++j) {
            int32_t dot = 0;
            for (int i = 0; i < 32; ++i) dot += u[32 * j + i] * ab.q[32 * j + i];
            isum += sc[j] * dot;
            msum += m[j] * (ab.bsums[2 * j] + ab.bsums[2 * j + 1]);
          }
          acc[r] += fp16(blk) * ab.d * static_cast<float>(isum) -
                    fp16(blk + 2) * ab.d * static_cast<float>(msum);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

}  // namespace shardserve_cpu::quant

// Sixteen weight rows at a time from row panels (model_shards/quant/panels.py: the rows'
// blocks interleaved, one 64-byte load = the same four quant bytes of the sixteen rows):
// included by quant_panels.cpp. Every vpdpbusd multiplies four quants of each of the sixteen
// rows with four activations broadcast to all lanes, so lane i accumulates row i's dot
// product with no reduction across lanes, and a block's sixteen scales are one load. A
// block (a K-quant's sub-block) of the sixteen rows is decoded once into eight registers of
// unsigned quants, then used by every activation row of the tile (R of them).
//
// The arithmetic is quant_panel_avx2.h's and quant_panel_k_avx2.h's lane for lane (the same
// exact int32 sums, the same float32 steps in the same order), so a row's output has the
// same bits as from the GGML-layout kernels, whatever R or M.
#pragma once

#include "quant_dot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define SHARDSERVE_QUANT_PANELS 1

namespace shardserve_cpu::quant::panels {

constexpr int kRows = 16;

inline __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512i low4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline __m512i high4(__m512i v) { return low4(_mm512_srli_epi16(v, 4)); }
inline __m512 f16x16(const uint8_t* p) {  // sixteen float16 → float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i bytes16(const uint8_t* p) {  // sixteen bytes (one per row) → unsigned int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i quad(const int8_t* q) {  // four activations in every lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}
// Panel block b + ahead's bytes (about 2 KiB ahead, into the next group's at the end of one:
// a thread's groups are one sequential stream), so that memory keeps up at small M.
template <int64_t T>
inline void prefetch_ahead(const uint8_t* panel, int64_t b) {
  constexpr int64_t kBlock = kRows * block_bytes(T), kAhead = kBlock >= 2048 ? 1 : 2048 / kBlock;
  const char* p = reinterpret_cast<const char*>(panel + (b + kAhead) * kBlock);
  for (int64_t off = 0; off < kBlock; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Σ over the eight operands u[g] · q[4g .. 4g + 3], two chains (integer sums: exact in any order)
inline __m512i dot8(const __m512i* u, const int8_t* q) {
  __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], quad(q));
  __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4], quad(q + 16));
  for (int g = 1; g < 4; ++g) {
    s0 = _mm512_dpbusd_epi32(s0, u[g], quad(q + 4 * g));
    s1 = _mm512_dpbusd_epi32(s1, u[g + 4], quad(q + 16 + 4 * g));
  }
  return _mm512_add_epi32(s0, s1);
}

// ---- the 32-value types ------------------------------------------------------------------
// Panel block: d[16] (f16) | m[16] (Q4_1, Q5_1) | qh[16] (Q5_0, Q5_1: u32 per row) | quants:
// 4-bit types four loads (low nibbles: values 4g.., high: 16 + 4g..), Q8_0 eight.
template <int64_t T>
struct Block32 {
  static constexpr bool kMin = T == kQ4_1 || T == kQ5_1, kFive = T == kQ5_0 || T == kQ5_1;
  static constexpr int kQh = kMin ? 64 : 32, kQs = kQh + (kFive ? 64 : 0);
  static constexpr float kOff = T == kQ4_0 ? -8.f : T == kQ5_0 ? -16.f : T == kQ8_0 ? -128.f : 0.f;
  __m512i u[8];  // operand g: values 4g .. 4g + 3 of each row
  __m512 wd, c;  // the rows' scales, and their coefficient of the activation sum

  void decode(const uint8_t* p) {
    wd = f16x16(p);
    if constexpr (kMin) c = f16x16(p + 32);
    else c = _mm512_mul_ps(wd, _mm512_set1_ps(kOff));
    const uint8_t* qs = p + kQs;
    if constexpr (T == kQ8_0) {  // u = w + 128 (vpdpbusd does not saturate)
      for (int g = 0; g < 8; ++g) u[g] = _mm512_xor_si512(load(qs + 64 * g), _mm512_set1_epi8(-128));
    } else {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = load(qs + 64 * g);
        u[g] = low4(v), u[g + 4] = high4(v);
      }
    }
    if constexpr (kFive) {  // bits 4g .. 4g + 3 of a row's qh → bit 4 of its four bytes
      const __m512i spread = _mm512_setr_epi32(
          0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000,
          0x00101010, 0x10000000, 0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010,
          0x10101000, 0x10101010);
      const __m512i qh = load(p + kQh);
      for (int g = 0; g < 8; ++g)  // vpermd reads the index's low four bits
        u[g] = _mm512_or_si512(u[g], _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * g), spread));
    }
  }
};

// Sixteen rows' panel blocks (``panel``, nb of them) against R activation rows → out[r * 16 + i].
template <int64_t T, int R>
void tile32(const uint8_t* panel, const ActA32* const* a, int64_t nb, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  Block32<T> blk;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<T>(panel, b);
    blk.decode(panel + b * kRows * block_bytes(T));
    for (int r = 0; r < R; ++r) {
      const ActA32& ab = a[r][b];
      const __m512 v = _mm512_cvtepi32_ps(dot8(blk.u, ab.q));
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(blk.wd, _mm512_set1_ps(ab.d)), acc[r]);
      acc[r] = _mm512_fmadd_ps(blk.c, _mm512_set1_ps(ab.d * static_cast<float>(ab.sum)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + kRows * r, acc[r]);
}

// ---- the K-quants ------------------------------------------------------------------------
// Q4_K / Q5_K panel superblock: d[16] | dmin[16] | scale byte i of the 16 rows, i = 0..11 |
// (Q5_K) qh: eight loads, byte l of a row = fifth bits of values l, 32 + l, .. | quants: chunk
// c (32 bytes of a row: sub-blocks 2c low nibbles, 2c + 1 high) in eight loads.
template <int64_t T>
struct BlockK4 {
  static constexpr int kQs = 256 + (T == kQ5_K ? 512 : 0);
  __m512 d, dmin;
  __m512i sc[8], mn[8];

  void decode_scales(const uint8_t* p) {
    d = f16x16(p), dmin = f16x16(p + 32);
    const uint8_t* s = p + 64;  // s + 16 i: byte i of the rows' 12
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
    for (int j = 0; j < 4; ++j) {  // k_scale_min's unpacking, sixteen rows per lane
      const __m512i sj = bytes16(s + 16 * j), sj4 = bytes16(s + 16 * (j + 4));
      const __m512i sj8 = bytes16(s + 16 * (j + 8));
      sc[j] = _mm512_and_si512(sj, six);
      mn[j] = _mm512_and_si512(sj4, six);
      const __m512i top = _mm512_set1_epi32(0x30);
      sc[j + 4] = _mm512_or_si512(_mm512_and_si512(sj8, four),
                                  _mm512_and_si512(_mm512_srli_epi32(sj, 2), top));
      mn[j + 4] = _mm512_or_si512(_mm512_srli_epi32(sj8, 4),
                                  _mm512_and_si512(_mm512_srli_epi32(sj4, 2), top));
    }
  }

  // Sub-block j's eight operands (values 32 j + 4 g ..).
  void quants(const uint8_t* p, int j, __m512i* u) const {
    const uint8_t* qs = p + kQs + 512 * (j >> 1);
    for (int g = 0; g < 8; ++g) {
      const __m512i v = load(qs + 64 * g);
      u[g] = j & 1 ? high4(v) : low4(v);
      if constexpr (T == kQ5_K) {  // bit j of qh byte l → bit 4
        const __m512i h = load(p + 256 + 64 * g);
        const __m512i moved = j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
        u[g] = _mm512_or_si512(u[g], _mm512_and_si512(moved, _mm512_set1_epi8(0x10)));
      }
    }
  }
};

template <int64_t T, int R>
void tile_k4(const uint8_t* panel, const ActA256* const* a, int64_t nb, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  BlockK4<T> blk;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<T>(panel, b);
    const uint8_t* p = panel + b * kRows * block_bytes(T);
    blk.decode_scales(p);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i u[8];
      blk.quants(p, j, u);
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot8(u, a[r][b].q + 32 * j), blk.sc[j]));
    }
    for (int r = 0; r < R; ++r) {
      const ActA256& ab = a[r][b];
      __m512i msum = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const int bsum = ab.bsums[2 * j] + ab.bsums[2 * j + 1];
        msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(blk.mn[j], _mm512_set1_epi32(bsum)));
      }
      const __m512 ad = _mm512_set1_ps(ab.d);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(blk.d, ad), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(blk.dmin, ad), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + kRows * r, acc[r]);
}

// Q6_K panel superblock: d[16] | group scale g of the 16 rows (int8), g = 0..15 | ql: half h,
// chunk c in eight loads each | qh: half h in eight loads. Quarter s of half h (values
// 128 h + 32 s ..) is chunk s & 1's low (s < 2) or high nibbles, with bits 2 s, 2 s + 1 of qh.
struct BlockQ6K {
  static void quants(const uint8_t* p, int h, int s, __m512i* u) {
    const uint8_t* ql = p + 288 + 512 * (2 * h + (s & 1));
    const uint8_t* qh = p + 2336 + 512 * h;
    for (int g = 0; g < 8; ++g) {
      const __m512i v = load(ql + 64 * g), hb = load(qh + 64 * g);
      const __m512i top = s == 0 ? _mm512_slli_epi16(hb, 4) : s == 1 ? _mm512_slli_epi16(hb, 2)
                        : s == 2 ? hb : _mm512_srli_epi16(hb, 2);
      u[g] = _mm512_or_si512(s < 2 ? low4(v) : high4(v), _mm512_and_si512(top, _mm512_set1_epi8(0x30)));
    }
  }
  static __m512i scale(const uint8_t* p, int g) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * g)));
  }
};

// Σ over operands first .. first + 3 (one 16-value group)
inline __m512i dot4(const __m512i* u, const int8_t* q) {
  __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], quad(q));
  __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], quad(q + 4));
  s0 = _mm512_dpbusd_epi32(s0, u[2], quad(q + 8));
  s1 = _mm512_dpbusd_epi32(s1, u[3], quad(q + 12));
  return _mm512_add_epi32(s0, s1);
}

template <int R>
void tile_q6k(const uint8_t* panel, const ActA256* const* a, int64_t nb, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<kQ6_K>(panel, b);
    const uint8_t* p = panel + b * kRows * block_bytes(kQ6_K);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {  // j = 4 h + s: values 32 j .. 32 j + 31, groups 2 j, 2 j + 1
      __m512i u[8];
      BlockQ6K::quants(p, j >> 2, j & 3, u);
      const __m512i sa = BlockQ6K::scale(p, 2 * j), sb = BlockQ6K::scale(p, 2 * j + 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a[r][b].q + 32 * j;
        const __m512i v = _mm512_add_epi32(_mm512_mullo_epi32(dot4(u, q), sa),
                                           _mm512_mullo_epi32(dot4(u + 4, q + 16), sb));
        isum[r] = _mm512_add_epi32(isum[r], v);
      }
    }
    const __m512 d = f16x16(p);
    for (int r = 0; r < R; ++r) {
      const ActA256& ab = a[r][b];
      __m512i msum = _mm512_setzero_si512();
      for (int g = 0; g < 16; ++g)
        msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(BlockQ6K::scale(p, g), _mm512_set1_epi32(ab.bsums[g])));
      const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(msum, 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(ab.d)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + kRows * r, acc[r]);
}

}  // namespace shardserve_cpu::quant::panels

#endif

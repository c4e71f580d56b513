// What the kernel sources share, each written once here: the decode-attention operands, the
// index check, the float32 <-> bfloat16 conversions (one value and 16 lanes at a time) and the
// exp polynomial. Included by cpu_ops.cpp, decode_attention.cpp, decode_attention_avx512.cpp,
// prefill_attention*.cpp, gemm.cpp, gemm_avx2.h and lora.cpp (sampling_ops.cpp needs none).
//
// torch's JIT build re-builds when a listed source or a build flag changes, not a header:
// model_shards/backends/cpu/build.py puts a hash of this file into the flags.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace shardserve_cpu {

// The operands of decode attention as raw pointers and sizes. q: [B, nh, D] (row stride
// q_stride); k, v: pools [slots, nkv, D]; tables: [B, max_blocks]; lens: [B]; out like q.
// The caller has checked shapes, dtypes and contiguity.
template <typename T>
struct DecodeAttentionArgs {
  int64_t B, nh, nkv, D, q_stride, group, max_blocks, slot_stride;
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* tables;
  const int64_t* lens;

  DecodeAttentionArgs(const at::Tensor& q_, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      at::Tensor& out_, int64_t head_dim)
      : B(q_.size(0)),
        nh(q_.size(1)),
        nkv(k_pool.size(1)),
        D(head_dim),
        q_stride(q_.stride(0)),
        group(nh / nkv),
        max_blocks(block_tables.size(1)),
        slot_stride(nkv * head_dim),
        q(q_.data_ptr<T>()),
        k(k_pool.data_ptr<T>()),
        v(v_pool.data_ptr<T>()),
        out(out_.data_ptr<T>()),
        tables(block_tables.data_ptr<int64_t>()),
        lens(context_lens.data_ptr<int64_t>()) {}
};

// The first position a decode row reads: len - window with a sliding window (window > 0).
inline int64_t window_first(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// The running state of decode attention's online softmax before a sequence's first keys: the
// sums of p v (acc) and of p (l) 0, the maxima (m) -inf.
inline void reset_online_softmax(std::vector<float>& acc, std::vector<float>& l,
                                 std::vector<float>& m) {
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(l.begin(), l.end(), 0.f);
  std::fill(m.begin(), m.end(), -INFINITY);
}

// Every index a kernel reads through (positions, slots, block ids, lengths) is checked
// against the tensor it indexes, so a bad plan is an error, never a stray read or write.
// A plain loop over the (contiguous int64) index: every layer of a step checks the same
// few hundred values, and tensor reductions would cost more than the kernels' own work.
inline void check_range(const at::Tensor& index, int64_t low, int64_t high, const char* what) {
  const int64_t* v = index.data_ptr<int64_t>();
  for (int64_t i = 0, n = index.numel(); i < n; ++i)
    TORCH_CHECK(v[i] >= low && v[i] < high, what, " out of range [", low, ", ", high, "): ", v[i]);
}

// ---- float32 <-> bfloat16, one value at a time ----------------------------------------------
// Written so that GCC vectorizes the loops that use them (c10::BFloat16's own conversions keep
// those loops scalar). A bfloat16 is the top half of a float32's bits.

inline float bits_to_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t f_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <>
inline float to_f<c10::BFloat16>(c10::BFloat16 x) {
  return bits_to_f(static_cast<uint32_t>(x.x) << 16);
}

// float -> T, round to nearest even (NaN stays NaN), as c10::BFloat16 does.
template <typename T>
inline T from_f(float f) { return static_cast<T>(f); }

template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  const uint32_t u = f_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// Round a float to T's precision and back (identity for float).
template <typename T>
inline float round_to(float f) { return to_f<T>(from_f<T>(f)); }

// ---- e^x ----------------------------------------------------------------------------------
// e^x for finite x, relative error ~1e-7: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts),
// e^r by a degree-6 Taylor polynomial, times 2^n. Inputs are clamped to the float range (e^x
// underflows to ~1e-38 instead of 0 below -87). The method once, for any lane type: `Lanes`
// supplies the arithmetic (ScalarLanes: one float, in loops GCC vectorizes, which std::exp
// would keep scalar; Avx512Lanes: 16 lanes).
template <typename Lanes>
inline typename Lanes::V exp_poly(typename Lanes::V x) {
  using V = typename Lanes::V;
  x = Lanes::clamp(x, -87.0f, 88.0f);
  const V n = Lanes::round(Lanes::mul(x, 1.44269504088896341f));
  const V r = Lanes::fnmadd(n, 1.428606765330187e-06f, Lanes::fnmadd(n, 0.693145751953125f, x));
  V p = Lanes::splat(1.f / 720.f);
  p = Lanes::fmadd(p, r, 1.f / 120.f);
  p = Lanes::fmadd(p, r, 1.f / 24.f);
  p = Lanes::fmadd(p, r, 1.f / 6.f);
  p = Lanes::fmadd(p, r, 0.5f);
  p = Lanes::fmadd(p, r, 1.f);
  p = Lanes::fmadd(p, r, 1.f);
  return Lanes::scale(p, n);  // p 2^n
}

struct ScalarLanes {
  using V = float;
  static V clamp(V x, float lo, float hi) { return std::min(std::max(x, lo), hi); }
  static V round(V x) { return std::nearbyint(x); }
  static V mul(V x, float c) { return x * c; }
  static V fnmadd(V a, float c, V b) { return b - a * c; }  // b - a c
  static V splat(float c) { return c; }
  static V fmadd(V a, V b, float c) { return a * b + c; }
  static V scale(V p, V n) {  // 2^n from the exponent bits
    return p * bits_to_f(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  }
};

inline float exp_f(float x) { return exp_poly<ScalarLanes>(x); }

#if defined(__AVX512F__)
struct Avx512Lanes {
  using V = __m512;
  static V clamp(V x, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
  }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V mul(V x, float c) { return _mm512_mul_ps(x, _mm512_set1_ps(c)); }
  static V fnmadd(V a, float c, V b) { return _mm512_fnmadd_ps(a, _mm512_set1_ps(c), b); }
  static V splat(float c) { return _mm512_set1_ps(c); }
  static V fmadd(V a, V b, float c) { return _mm512_fmadd_ps(a, b, _mm512_set1_ps(c)); }
  static V scale(V p, V n) { return _mm512_scalef_ps(p, n); }
};

// e^x per lane, and of one value through the same vector code (so both agree bit for bit).
inline __m512 exp512(__m512 x) { return exp_poly<Avx512Lanes>(x); }
inline float exp1(float x) { return _mm512_cvtss_f32(exp512(_mm512_set1_ps(x))); }

// ---- float32 <-> bfloat16, 16 lanes at a time -------------------------------------------------
inline __m512 bf16_bits_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 consecutive values widened to float32; with a mask, only its lanes are read (others 0).
inline __m512 widen16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 widen16(const c10::BFloat16* x) {
  return bf16_bits_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
inline __m512 widen16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }

// 16 float32 values stored as T; with a mask, only its lanes are written.
inline void store16(float* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
inline void store16(float* dst, __mmask16 m, __m512 x) { _mm512_mask_storeu_ps(dst, m, x); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline __m512 widen16(const c10::BFloat16* x, __mmask16 m) {
  return bf16_bits_to_f32(_mm256_maskz_loadu_epi16(m, x));
}
// Rounded to nearest even by vcvtneps2bf16 (which, unlike from_f, flushes subnormals to 0).
inline void store16(c10::BFloat16* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
}
inline void store16(c10::BFloat16* dst, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(dst, m, (__m256i)_mm512_cvtneps_pbh(x));
}
#endif
#endif  // __AVX512F__

}  // namespace shardserve_cpu

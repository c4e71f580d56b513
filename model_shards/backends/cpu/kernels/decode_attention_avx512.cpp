// Decode attention over the paged KV pool with AVX-512 (float32) and AVX-512 BF16 (bfloat16).
//
// Same contract as the portable kernel in decode_attention.cpp (see decode_attention there):
// out[b, h, :] = softmax(scale * q[b, h] . K[ctx(b)]) V[ctx(b)], one task per sequence, one
// pass over its context with an online softmax, every row computed on its own.
//
// What makes it fast: the scores of up to 16 tokens are 16 vector accumulators reduced together
// by one transpose-and-add tree (hsum16) instead of one horizontal sum per (token, head); in
// bfloat16 the q . k products are vdpbf16ps (bf16 pairs multiplied exactly, summed in float32),
// so the keys are never widened; the softmax of 16 scores is one vector exp; a head's running
// sum of p v stays in registers across the chunk (the common head dims are compiled in:
// 48, 64, 80, 96, 128, 256).
//
// decode_attention_avx512 returns false (and does nothing) where it does not apply: a build
// without these instructions, another dtype, or a head dim not compiled in. The caller then
// runs the portable kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_common.h"

namespace shardserve_cpu {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kLanes = 16;   // float32 lanes of a zmm register

// v[0..15] -> one vector whose lane i is the sum of v[i]'s 16 lanes.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane sums of 4 inputs
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add the four 128-bit lanes: even lanes + odd lanes, twice.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                 _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                 _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w, y, 0x88), _mm512_shuffle_f32x4(w, y, 0xDD));
}

// Storage type → the q . k dot of one (head, token) as a vector of partial sums (widening,
// rounding stores and e^x are kernel_common.h's).
struct F32 {
  using T = float;
  static constexpr int64_t kDotStep = 16;
  template <int64_t kD>
  static __m512 dot(const float* q, const float* k) {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t d = kDotStep; d < kD; d += kDotStep)
      s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), s);
    return s;
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
struct BF16 {
  using T = c10::BFloat16;
  static constexpr int64_t kDotStep = 32;
  static __m512bh load_bh(const T* x) { return (__m512bh)_mm512_loadu_si512(x); }
  // 16 values in the low half, zeros above (a head dim that is an odd multiple of 16).
  static __m512bh load_half_bh(const T* x) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>(0xFFFF), x);
  }
  template <int64_t kD>
  static __m512 dot(const T* q, const T* k) {
    __m512 s = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + kDotStep <= kD; d += kDotStep) s = _mm512_dpbf16_ps(s, load_bh(q + d), load_bh(k + d));
    if constexpr (kD % kDotStep != 0) s = _mm512_dpbf16_ps(s, load_half_bh(q + d), load_half_bh(k + d));
    return s;
  }
};
#endif

// A sequence's context in chunks of up to 16 tokens; a chunk ends early at a block edge or at
// the context's end, so its rows are consecutive slots of one block and K and V of a chunk
// are two contiguous runs of the pools. The chunk at t0 has chunk_tokens tokens from slot
// chunk_slot.
inline int64_t chunk_tokens(int64_t len, int64_t t0, int64_t block_size) {
  return std::min({kLanes, len - t0, block_size - t0 % block_size});
}

inline int64_t chunk_slot(const int64_t* table, int64_t t0, int64_t block_size) {
  return table[t0 / block_size] * block_size + t0 % block_size;
}

// The chunk after the current one (the next chunk of this sequence, or past its end the first
// of the next sequence this task runs), brought into L2 a share at a time: the head loop of the
// current chunk prefetches 1/nh of it per head, so the memory stream overlaps the compute.
// (Prefetching a whole chunk at once, 2 x 12 KB for 16 tokens of 3 x 64 float32 heads, stalled
// the core on its outstanding misses: measured here, the spread prefetch ran the benchmark
// model's decode attention 1.6-2x faster from DRAM.)
template <typename T>
struct NextChunk {
  const char* k = nullptr;  // nullptr: no next chunk in this task
  const char* v = nullptr;
  int64_t bytes = 0;  // of K (and of V)
  int64_t share = 0;  // bytes per head, a whole number of cache lines

  // The chunk at token `next` of sequence b, or the first of b + 1 (< end) past its end.
  NextChunk(const DecodeAttentionArgs<T>& a, int64_t block_size, int64_t window, int64_t b,
            int64_t next, int64_t end) {
    int64_t len = a.lens[b];
    if (next >= len) {
      if (++b >= end) return;
      len = a.lens[b];
      next = window_first(len, window);
    }
    const int64_t slot = chunk_slot(a.tables + b * a.max_blocks, next, block_size);
    k = reinterpret_cast<const char*>(a.k + slot * a.slot_stride);
    v = reinterpret_cast<const char*>(a.v + slot * a.slot_stride);
    bytes = chunk_tokens(len, next, block_size) * a.slot_stride * int64_t(sizeof(T));
    share = (bytes / 64 + a.nh) / a.nh * 64;
  }

  // Head h's share of K and V into L2.
  void prefetch(int64_t h) const {
    if (k == nullptr) return;
    for (int64_t byte = h * share, stop = std::min(bytes, byte + share); byte < stop; byte += 64) {
      _mm_prefetch(k + byte, _MM_HINT_T1);
      _mm_prefetch(v + byte, _MM_HINT_T1);
    }
  }
};

// out[h, :] = acc[h, :] / l[h] for the nh heads of one sequence, stored as T.
template <int64_t kD, typename T>
inline void store_normalized(const float* acc, const float* l, int64_t nh, T* out) {
  for (int64_t h = 0; h < nh; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / l[h]);
    for (int64_t d = 0; d < kD; d += kLanes)
      store16(out + h * kD + d, _mm512_mul_ps(_mm512_loadu_ps(&acc[h * kD + d]), inv));
  }
}

// scale * q . k of a chunk's tokens, soft-capped to cap * tanh(s / cap) when cap > 0, with
// tanh(x) = 1 - 2 / (e^(2x) + 1) and 2x clamped to +-40 (where tanh is +-1 in float32).
inline __m512 chunk_scores(__m512 dots, __m512 vscale, float cap) {
  const __m512 s = _mm512_mul_ps(dots, vscale);
  if (cap <= 0.f) return s;
  const __m512 c = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  __m512 x2 = _mm512_mul_ps(two, _mm512_div_ps(s, c));
  x2 = _mm512_max_ps(_mm512_min_ps(x2, _mm512_set1_ps(40.f)), _mm512_set1_ps(-40.f));
  const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp512(x2), one)));
  return _mm512_mul_ps(c, tanh);
}

// kD: the head dim, a compile-time constant so that a head's q and its running sum of p v
// stay in registers. window > 0: only the last window positions; softcap > 0: capped scores.
template <typename S, int64_t kD>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
         const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
         double scale, int64_t window, double softcap, at::Tensor& out) {
  using T = typename S::T;
  constexpr int64_t kChunks = kD / kLanes;
  const DecodeAttentionArgs<T> a(q, k_pool, v_pool, block_tables, context_lens, out, kD);
  const int64_t nh = a.nh, group = a.group, slot_stride = a.slot_stride;
  const T *kp = a.k, *vp = a.v;
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const float cap = static_cast<float>(softcap);
  at::parallel_for(0, a.B, 1, [&](int64_t begin, int64_t end) {
    // acc: [nh, D] running sums of p v; m, l: running max and sum of e^(s - m) per head.
    std::vector<float> acc(nh * kD), m(nh), l(nh);
    alignas(64) float e[kLanes];
    __m512 partial[kLanes];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = a.lens[b];
      const int64_t* table = a.tables + b * a.max_blocks;
      const T* qb = a.q + b * a.q_stride;
      reset_online_softmax(acc, l, m);
      // One chunk at a time (chunk_tokens), the next one's K and V prefetched meanwhile.
      for (int64_t t0 = window_first(len, window), n = 0; t0 < len; t0 += n) {
        n = chunk_tokens(len, t0, block_size);
        const int64_t first_slot = chunk_slot(table, t0, block_size);
        const NextChunk<T> ahead(a, block_size, window, b, t0 + n, end);
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
        for (int64_t h = 0; h < nh; ++h) {
          const int64_t kv_offset = first_slot * slot_stride + (h / group) * kD;
          const T* k0 = kp + kv_offset;
          const T* v0 = vp + kv_offset;
          const T* qh = qb + h * kD;
          ahead.prefetch(h);
          for (int64_t i = 0; i < n; ++i) partial[i] = S::template dot<kD>(qh, k0 + i * slot_stride);
          for (int64_t i = n; i < kLanes; ++i) partial[i] = _mm512_setzero_ps();
          const __m512 s =
              _mm512_mask_blend_ps(valid, neg_inf, chunk_scores(hsum16(partial), vscale, cap));
          const float m_new = std::max(m[h], _mm512_reduce_max_ps(s));
          const float correction = exp1(m[h] - m_new);
          const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
          l[h] = l[h] * correction + _mm512_reduce_add_ps(p);
          m[h] = m_new;
          _mm512_store_ps(e, p);
          float* acc_h = &acc[h * kD];
          __m512 sum[kChunks];
          const __m512 c = _mm512_set1_ps(correction);
          for (int64_t d = 0; d < kChunks; ++d) sum[d] = _mm512_mul_ps(_mm512_loadu_ps(acc_h + d * kLanes), c);
          for (int64_t i = 0; i < n; ++i) {
            const __m512 w = _mm512_set1_ps(e[i]);
            const T* v = v0 + i * slot_stride;
            for (int64_t d = 0; d < kChunks; ++d)
              sum[d] = _mm512_fmadd_ps(w, widen16(v + d * kLanes), sum[d]);
          }
          for (int64_t d = 0; d < kChunks; ++d) _mm512_storeu_ps(acc_h + d * kLanes, sum[d]);
        }
      }
      store_normalized<kD>(acc.data(), l.data(), nh, a.out + b * nh * kD);
    }
  });
}

// Runs S's kernel when the head dim is one it is compiled for.
template <typename S>
bool run_for_head_dim(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      int64_t block_size, double scale, int64_t window, double softcap,
                      at::Tensor& out) {
  auto go = [&](auto kernel) {
    kernel(q, k_pool, v_pool, block_tables, context_lens, block_size, scale, window, softcap, out);
    return true;
  };
  switch (q.size(2)) {
    case 48: return go(run<S, 48>);
    case 64: return go(run<S, 64>);
    case 80: return go(run<S, 80>);
    case 96: return go(run<S, 96>);
    case 128: return go(run<S, 128>);
    case 256: return go(run<S, 256>);
    default: return false;
  }
}

}  // namespace
#endif  // __AVX512F__

bool decode_attention_avx512_supports(at::ScalarType dtype, int64_t head_dim) {
  const bool head_dim_ok = head_dim == 48 || head_dim == 64 || head_dim == 80 || head_dim == 96 ||
                           head_dim == 128 || head_dim == 256;
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return head_dim_ok;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (dtype == at::kBFloat16) return head_dim_ok;
#endif
#endif
  (void)dtype, (void)head_dim_ok;
  return false;
}

bool decode_attention_avx512(const at::Tensor& q, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t block_size, double scale,
                             int64_t window, double softcap, at::Tensor& out) {
  if (!decode_attention_avx512_supports(q.scalar_type(), q.size(2))) return false;
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat)
    return run_for_head_dim<F32>(q, k_pool, v_pool, block_tables, context_lens, block_size, scale,
                                 window, softcap, out);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (q.scalar_type() == at::kBFloat16)
    return run_for_head_dim<BF16>(q, k_pool, v_pool, block_tables, context_lens, block_size, scale,
                                  window, softcap, out);
#endif
#endif
  (void)k_pool, (void)v_pool, (void)block_tables, (void)context_lens, (void)block_size,
      (void)scale, (void)window, (void)softcap, (void)out;
  return false;
}

}  // namespace shardserve_cpu

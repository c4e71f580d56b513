// Prefill attention over the paged KV pool with AVX-512 (float32) and AVX-512 BF16 (bfloat16):
// the vectorized kernel of torch.ops.shardserve_cpu.prefill_attention (contract, tasks and
// threads: prefill_attention.cpp).
//
// One task (a tile of up to 16 query rows of one head) runs an online softmax over its keys,
// 16 keys a step (a step ends early at a block edge, so its K and V rows are contiguous):
// the step's keys are transposed once (lane i = key i), then for 8 rows at a time the scores
// are one FMA per head-dim value and row (float32; bfloat16: one vdpbf16ps per pair of values,
// exact products summed in float32), no horizontal sums, and each V row loaded once is added
// into the 8 rows' sums. The common head dims are compiled in (48, 64, 80, 96, 128, 256).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel_common.h"
#include "prefill_attention.h"

namespace shardserve_cpu::prefill {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kGroup = 8;  // query rows whose scores and sums of p v advance together

// r[0..15] (16 rows of 16 32-bit values) transposed in place: r[c] becomes column c.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane k: column 4k + j of rows 4i .. 4i+3
    r[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
  }
}

// Storage type → q . k of 16 keys at once from the keys transposed into "words" (kt[w] holds
// word w of the 16 keys): float32 words one value each (an FMA per word); bfloat16 words a
// pair of values each, multiplied exactly and summed in float32 by vdpbf16ps.
struct F32Tile {
  using T = float;
  static constexpr int64_t words(int64_t d) { return d; }
  static __m512 step(__m512 s, const T* q, int64_t w, __m512 kt) {
    return _mm512_fmadd_ps(_mm512_set1_ps(q[w]), kt, s);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
struct BF16Tile {
  using T = c10::BFloat16;
  static constexpr int64_t words(int64_t d) { return d / 2; }
  static __m512 step(__m512 s, const T* q, int64_t w, __m512 kt) {
    uint32_t pair;
    std::memcpy(&pair, q + 2 * w, sizeof pair);
    return _mm512_dpbf16_ps(s, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                            (__m512bh)_mm512_castps_si512(kt));
  }
};
#endif

// kt[w] = word w of the n <= 16 keys from k0 (rows slot_stride apart; lanes >= n zero).
template <typename S, int64_t kD>
inline void transpose_keys(const typename S::T* k0, int64_t slot_stride, int64_t n, __m512* kt) {
  constexpr int64_t kWords = S::words(kD);
  __m512 r[16];
  for (int64_t c = 0; c < kWords; c += 16) {
    const int64_t cols = std::min<int64_t>(16, kWords - c);
    const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1u);
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(k0 + i * slot_stride) + c)
                   : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t j = 0; j < cols; ++j) kt[c + j] = r[j];
  }
}

// The online-softmax state of a tile's rows: running sums of p v, max, sum of e^(s - max).
template <int64_t kD>
struct TileState {
  alignas(64) float acc[kRows * kD];
  alignas(64) float p[kGroup][kKeys];  // a group's weights of the current step
  float m[kRows], l[kRows];
};

// Rows g0 .. g0 + 7 of the tile (those past `rows` computed on row 0's q and discarded) over
// one step of n keys at t0: scores from the transposed keys, each row's mask (causal edge,
// window edge) and softmax update, then p v added into the rows' sums.
template <typename S, int64_t kD>
inline void group_step(const PrefillArgs<typename S::T>& a, const Task& t, const __m512* kt,
                       const typename S::T* v0, int64_t t0, int64_t n, int64_t g0, int64_t rows,
                       TileState<kD>& st) {
  using T = typename S::T;
  const int64_t start = a.starts[t.n], first_row = a.q_starts[t.n] + t.r0;
  const T* q[kGroup];
  __m512 s[kGroup];
  for (int64_t g = 0; g < kGroup; ++g) {
    const int64_t r = g0 + g < rows ? g0 + g : 0;
    q[g] = a.q + (first_row + r) * a.q_stride + t.h * kD;
    s[g] = _mm512_setzero_ps();
  }
  for (int64_t w = 0; w < S::words(kD); ++w)
    for (int64_t g = 0; g < kGroup; ++g) s[g] = S::step(s[g], q[g], w, kt[w]);
  float correction[kGroup];
  for (int64_t g = 0; g < kGroup; ++g) {
    const int64_t r = g0 + g, p = start + t.r0 + r;
    const int64_t lo = std::max<int64_t>(0, first_key(p, a.window) - t0);
    const int64_t hi = std::min(n, p + 1 - t0);
    if (r >= rows || hi <= lo) {  // nothing to add: weights 0, sums kept
      _mm512_store_ps(st.p[g], _mm512_setzero_ps());
      correction[g] = 1.f;
      continue;
    }
    const __mmask16 valid = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                           _mm512_mul_ps(s[g], _mm512_set1_ps(a.scale)));
    const float m_new = std::max(st.m[r], _mm512_reduce_max_ps(sc));
    correction[g] = exp1(st.m[r] - m_new);  // ~0 on the row's first step (m = -inf)
    const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
    st.l[r] = st.l[r] * correction[g] + _mm512_reduce_add_ps(e);
    st.m[r] = m_new;
    _mm512_store_ps(st.p[g], e);
  }
  for (int64_t d = 0; d < kD; d += 16) {
    __m512 sum[kGroup];
    for (int64_t g = 0; g < kGroup; ++g)
      sum[g] = _mm512_mul_ps(_mm512_loadu_ps(&st.acc[(g0 + g) * kD + d]),
                             _mm512_set1_ps(correction[g]));
    for (int64_t i = 0; i < n; ++i) {
      const __m512 v = widen16(v0 + i * a.slot_stride + d);
      for (int64_t g = 0; g < kGroup; ++g)
        sum[g] = _mm512_fmadd_ps(_mm512_set1_ps(st.p[g][i]), v, sum[g]);
    }
    for (int64_t g = 0; g < kGroup; ++g) _mm512_storeu_ps(&st.acc[(g0 + g) * kD + d], sum[g]);
  }
}

// One task: the keys from the tile's first visible one to its last row's position, in steps
// of up to 16 slots that end early at a block edge (so a step's K and V rows are contiguous);
// each step's keys are transposed once and applied to the tile's rows kGroup at a time.
template <typename S, int64_t kD>
void vectorized_task(const PrefillArgs<typename S::T>& a, const Task& t) {
  const int64_t start = a.starts[t.n], bs = a.block_size, rows = t.r1 - t.r0;
  const int64_t* table = a.tables + t.n * a.max_blocks;
  const int64_t kv = (t.h / a.group) * kD, first_row = a.q_starts[t.n] + t.r0;
  TileState<kD> st;
  std::fill(st.acc, st.acc + kRows * kD, 0.f);
  std::fill(st.m, st.m + kRows, -INFINITY);
  std::fill(st.l, st.l + kRows, 0.f);
  __m512 kt[S::words(kD)];
  const int64_t last = start + t.r1 - 1;  // the last row's position
  for (int64_t t0 = first_key(start + t.r0, a.window), n = 0; t0 <= last; t0 += n) {
    n = std::min({kKeys, last + 1 - t0, bs - t0 % bs});
    const int64_t offset = slot_of(table, t0, bs) * a.slot_stride + kv;
    transpose_keys<S, kD>(a.k + offset, a.slot_stride, n, kt);
    for (int64_t g0 = 0; g0 < rows; g0 += kGroup)
      group_step<S, kD>(a, t, kt, a.v + offset, t0, n, g0, rows, st);
  }
  for (int64_t r = 0; r < rows; ++r) {
    typename S::T* o = a.out + (first_row + r) * a.out_stride + t.h * kD;
    const __m512 inv = _mm512_set1_ps(1.f / st.l[r]);
    for (int64_t d = 0; d < kD; d += 16)
      store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(&st.acc[r * kD + d]), inv));
  }
}

// S's kernel when the head dim is compiled in; false (nothing done) otherwise.
template <typename S>
bool run_vectorized(const PrefillArgs<typename S::T>& a, const std::vector<Task>& tasks) {
  auto go = [&](auto kernel) {
    for_each_task(tasks, [&](const Task& t) { kernel(a, t); });
    return true;
  };
  switch (a.D) {
    case 48: return go(vectorized_task<S, 48>);
    case 64: return go(vectorized_task<S, 64>);
    case 80: return go(vectorized_task<S, 80>);
    case 96: return go(vectorized_task<S, 96>);
    case 128: return go(vectorized_task<S, 128>);
    case 256: return go(vectorized_task<S, 256>);
    default: return false;
  }
}
}  // namespace
#endif  // __AVX512F__

bool run_avx512(const PrefillArgs<float>& a, const std::vector<Task>& tasks) {
#if defined(__AVX512F__)
  return run_vectorized<F32Tile>(a, tasks);
#else
  (void)a, (void)tasks;
  return false;
#endif
}

bool run_avx512(const PrefillArgs<c10::BFloat16>& a, const std::vector<Task>& tasks) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  return run_vectorized<BF16Tile>(a, tasks);
#else
  (void)a, (void)tasks;
  return false;
#endif
}

}  // namespace shardserve_cpu::prefill


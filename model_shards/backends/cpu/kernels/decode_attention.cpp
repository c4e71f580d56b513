// Paged decode attention, torch.ops.shardserve_cpu.decode_attention (float32 and bfloat16):
// the op's argument checks, the portable kernel, and the choice of the AVX-512 kernel of
// decode_attention_avx512.cpp where it applies.
//
// Each sequence is computed on its own, with a fixed order of operations, so its result never
// depends on what else is in the batch. Arithmetic is float32; 16-bit inputs are widened on
// load and the output rounded once on store.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_common.h"
#include "ops.h"

namespace shardserve_cpu {
// decode_attention_avx512.cpp: false where it does not apply (no AVX-512, dtype, head dim).
bool decode_attention_avx512(const at::Tensor& q, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t block_size, double scale,
                             int64_t window, double softcap, at::Tensor& out);
bool decode_attention_avx512_supports(at::ScalarType dtype, int64_t head_dim);
}  // namespace shardserve_cpu

namespace {

// kernel_common.h: index checks, the online softmax's reset, float32 <-> bfloat16, e^x.
using shardserve_cpu::check_range;
using shardserve_cpu::exp_f;
using shardserve_cpu::from_f;
using shardserve_cpu::reset_online_softmax;
using shardserve_cpu::to_f;
using shardserve_cpu::window_first;

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_f(b[i]);
  return s;
}

// One key row's scores for every head, p[h * p_stride] = (scaled q_h) . k (soft-capped to
// cap * tanh(s / cap) when cap > 0); query head h reads KV head h / group.
template <typename T>
inline void token_scores(const float* qf, const T* krow, int64_t nh, int64_t D, int64_t group,
                         float cap, float* p, int64_t p_stride) {
  for (int64_t h = 0; h < nh; ++h) {
    const float s = dot(&qf[h * D], krow + (h / group) * D, D);
    p[h * p_stride] = cap > 0.f ? cap * std::tanh(s / cap) : s;
  }
}

// out[b, h, :] = softmax(scale * q[b, h] . K[ctx(b)]) V[ctx(b)], over the paged pool.
// q: [B, nh, D]; k_pool, v_pool: [slots, nkv, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64. Query head h reads KV head h / (nh / nkv). kD > 0: the head dim
// as a compile-time constant (the common sizes), else a.D.
// One task per sequence, one pass over its context block by block (online softmax):
// scores of a block from its K rows, then its V rows, each row holding every KV head
// contiguously, so both pools stream front to back. window > 0: only the last window
// positions; softcap > 0: scores squashed to softcap * tanh(s / softcap).
template <typename T, int64_t kD>
void decode_attention_impl(const shardserve_cpu::DecodeAttentionArgs<T>& a, int64_t block_size,
                           double scale, int64_t window, double softcap) {
  const int64_t B = a.B, nh = a.nh, D = kD > 0 ? kD : a.D, q_stride = a.q_stride, group = a.group;
  const int64_t max_blocks = a.max_blocks, slot_stride = a.slot_stride;
  const T *qp = a.q, *kp = a.k, *vp = a.v;
  T* op = a.out;
  const int64_t *tables = a.tables, *lens = a.lens;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nh * D), acc(nh * D), p(nh * block_size), m(nh), l(nh);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f(qp[b * q_stride + h * D + d]) * fscale;
      reset_online_softmax(acc, l, m);
      const int64_t first = window_first(len, window);
      for (int64_t t0 = first, n = 0; t0 < len; t0 += n) {  // up to a block edge at a time
        const int64_t block = (table[t0 / block_size] * block_size + t0 % block_size) * slot_stride;
        n = std::min(block_size - t0 % block_size, len - t0);
        for (int64_t i = 0; i < n; ++i)
          token_scores(qf.data(), kp + block + i * slot_stride, nh, D, group, cap,
                       &p[i], block_size);
        for (int64_t h = 0; h < nh; ++h) {
          float* ph = &p[h * block_size];
          float block_max = -INFINITY;
          for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, ph[i]);
          const float m_new = std::max(m[h], block_max);
          const float correction = t0 == first ? 0.f : exp_f(m[h] - m_new);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < n; ++i) {
            ph[i] = exp_f(ph[i] - m_new);
            sum += ph[i];
          }
          l[h] = l[h] * correction + sum;
          m[h] = m_new;
          float* a = &acc[h * D];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
        }
        for (int64_t i = 0; i < n; ++i) {
          const T* vrow = vp + block + i * slot_stride;
          for (int64_t h = 0; h < nh; ++h) {
            const float w = p[h * block_size + i];
            const T* v = vrow + (h / group) * D;
            float* a = &acc[h * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * to_f(v[d]);
          }
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; ++d) op[(b * nh + h) * D + d] = from_f<T>(acc[h * D + d] * inv);
      }
    }
  });
}

// The portable kernel on decode_attention's checked operands.
template <typename T, int64_t kD>
void decode_attention_portable(const at::Tensor& q, const at::Tensor& k_pool,
                               const at::Tensor& v_pool, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t block_size, double scale,
                               int64_t window, double softcap, at::Tensor& out) {
  const shardserve_cpu::DecodeAttentionArgs<T> a(q, k_pool, v_pool, block_tables, context_lens,
                                                 out, kD > 0 ? kD : q.size(2));
  decode_attention_impl<T, kD>(a, block_size, scale, window, softcap);
}

// vectorized: use the AVX-512 kernel where the build and the shapes allow (the default);
// false runs this portable kernel, which tests compare against the same reference.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, bool vectorized, int64_t window,
                            double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "decode_attention: bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_pool.is_contiguous() &&
                  v_pool.is_contiguous(),
              "decode_attention: q rows must hold contiguous heads; pools must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "decode_attention: dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "decode_attention: block tables and lengths must be int64");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "decode_attention: heads not a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "decode_attention: one block table and one length per query");
  TORCH_CHECK(block_size > 0 && k_pool.size(0) % block_size == 0 && v_pool.sizes() == k_pool.sizes(),
              "decode_attention: pools must hold whole blocks of block_size slots");
  check_range(tables, 0, k_pool.size(0) / block_size, "decode_attention: block id");
  check_range(lens, 1, tables.size(1) * block_size + 1, "decode_attention: context length");
  at::Tensor out = at::empty(q.sizes(), q.options());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode_attention: float32 or bfloat16 only");
  if (vectorized && shardserve_cpu::decode_attention_avx512(q, k_pool, v_pool, tables, lens,
                                                            block_size, scale, window, softcap, out))
    return out;
  const bool f32 = q.scalar_type() == at::kFloat;
  using bf = c10::BFloat16;
  auto run = [&](auto impl_f32, auto impl_bf16) {
    (f32 ? impl_f32 : impl_bf16)(q, k_pool, v_pool, tables, lens, block_size, scale, window,
                                 softcap, out);
  };
  switch (q.size(2)) {
    case 64: run(decode_attention_portable<float, 64>, decode_attention_portable<bf, 64>); break;
    case 128: run(decode_attention_portable<float, 128>, decode_attention_portable<bf, 128>); break;
    default: run(decode_attention_portable<float, 0>, decode_attention_portable<bf, 0>);
  }
  return out;
}

}  // namespace

at::Tensor shardserve_cpu::ops::decode_attention(
    const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
    double scale, bool vectorized, int64_t window, double softcap) {
  return ::decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_size, scale,
                            vectorized, window, softcap);
}

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, bool vectorized=True, int window=0, "
        "float softcap=0.0) -> Tensor");
  m.def("decode_attention_vectorized(ScalarType dtype, int head_dim) -> bool",
        &shardserve_cpu::decode_attention_avx512_supports);
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }

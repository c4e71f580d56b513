// Fused CPU kernels for decoding (float32 and bfloat16), registered as torch.ops.shardserve_cpu.*
//
// Each op computes every output row independently, with a fixed order of operations,
// so a row's result never depends on what else is in the batch. Arithmetic is float32;
// 16-bit inputs are widened on load and rounded once on store, except where a comment
// names the rounding that matches the reference implementation.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel_common.h"

namespace shardserve_cpu {
// decode_attention_avx512.cpp: false where it does not apply (no AVX-512, dtype, head dim).
bool decode_attention_avx512(const at::Tensor& q, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t block_size, double scale,
                             at::Tensor& out);
bool decode_attention_avx512_supports(at::ScalarType dtype, int64_t head_dim);
}  // namespace shardserve_cpu

namespace {

// Below about this many elements an op runs on one thread: a parallel region costs more
// than it saves, and with the cores shared (frontend, other ranks) a descheduled thread
// stalls the whole region.
constexpr int64_t kSerialElements = 64 * 1024;

inline int64_t rows_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, row_elements));
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

// Conversions and exp written so that GCC vectorizes the loops that use them
// (c10::BFloat16's own conversions and std::exp keep those loops scalar).
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

// e^x for finite x, relative error ~1e-7: x = n ln2 + r, |r| <= ln2 / 2, e^r by a
// degree-6 Taylor polynomial, 2^n from the exponent bits. Inputs are clamped to the
// float range (e^x underflows to ~1e-38 instead of 0 below -87).
inline float exp_f(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * bits_to_f(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_f(b[i]);
  return s;
}

// out[b, h, :] = softmax(scale * q[b, h] . K[ctx(b)]) V[ctx(b)], over the paged pool.
// q: [B, nh, D]; k_pool, v_pool: [slots, nkv, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64. Query head h reads KV head h / (nh / nkv).
template <typename T, int64_t kD>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           int64_t block_size, double scale, at::Tensor& out) {
  // kD > 0: the head dim as a compile-time constant (the common sizes), else q.size(2)
  const shardserve_cpu::DecodeAttentionArgs<T> a(q, k_pool, v_pool, block_tables, context_lens,
                                                 out, kD > 0 ? kD : q.size(2));
  const int64_t B = a.B, nh = a.nh, D = a.D, q_stride = a.q_stride, group = a.group;
  const int64_t max_blocks = a.max_blocks, slot_stride = a.slot_stride;
  const T *qp = a.q, *kp = a.k, *vp = a.v;
  T* op = a.out;
  const int64_t *tables = a.tables, *lens = a.lens;
  const float fscale = static_cast<float>(scale);
  // One task per sequence, one pass over its context block by block (online softmax):
  // scores of a block from its K rows, then its V rows, each row holding every KV head
  // contiguously, so both pools stream front to back.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nh * D), acc(nh * D), p(nh * block_size), m(nh), l(nh);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f(qp[b * q_stride + h * D + d]) * fscale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = table[t0 / block_size] * block_size * slot_stride;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const T* krow = kp + block + i * slot_stride;
          for (int64_t h = 0; h < nh; ++h)
            p[h * block_size + i] = dot(&qf[h * D], krow + (h / group) * D, D);
        }
        for (int64_t h = 0; h < nh; ++h) {
          float* ph = &p[h * block_size];
          float block_max = -INFINITY;
          for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, ph[i]);
          const float m_new = std::max(m[h], block_max);
          const float correction = t0 == 0 ? 0.f : exp_f(m[h] - m_new);
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

// vectorized: use the AVX-512 kernel where the build and the shapes allow (the default);
// false runs this portable kernel, which tests compare against the same reference.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, bool vectorized) {
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
                                                            block_size, scale, out))
    return out;
  const bool f32 = q.scalar_type() == at::kFloat;
  using bf = c10::BFloat16;
  auto run = [&](auto impl_f32, auto impl_bf16) {
    (f32 ? impl_f32 : impl_bf16)(q, k_pool, v_pool, tables, lens, block_size, scale, out);
  };
  switch (q.size(2)) {
    case 64: run(decode_attention_impl<float, 64>, decode_attention_impl<bf, 64>); break;
    case 128: run(decode_attention_impl<float, 128>, decode_attention_impl<bf, 128>); break;
    default: run(decode_attention_impl<float, 0>, decode_attention_impl<bf, 0>);
  }
  return out;
}

// y = w * round(x * rsqrt(mean(x^2) + eps)); x: [T, H] (rows contiguous), w: [H].
// With a residual: first residual += x (rounded to the dtype), then normalize the sum;
// both residual and the returned y are updated/written. Matches HF's RMSNorm rounding.
template <typename T>
void rms_norm_impl(const T* x, T* residual, const T* w, T* y, int64_t rows, int64_t H,
                   int64_t x_stride, float eps) {
  at::parallel_for(0, rows, rows_grain(H), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          const float sum = round_to<T>(to_f(xr[i]) + to_f(rr[i]));
          rr[i] = from_f<T>(sum);
          buf[i] = sum;
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) buf[i] = to_f(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += buf[i] * buf[i];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* yr = y + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) yr[i] = from_f<T>(to_f(w[i]) * round_to<T>(buf[i] * rstd));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with unit column stride");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(1),
              "rms_norm: weight must be a contiguous [H] of x's dtype");
  const int64_t rows = x.size(0), H = x.size(1);
  at::Tensor y = at::empty({rows, H}, x.options());
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be a contiguous tensor like x");
  }
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                         weight.data_ptr<float>(), y.data_ptr<float>(), rows, H, x.stride(0), eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    using bf = c10::BFloat16;
    rms_norm_impl<bf>(x.data_ptr<bf>(), residual ? residual->data_ptr<bf>() : nullptr,
                      weight.data_ptr<bf>(), y.data_ptr<bf>(), rows, H, x.stride(0), eps);
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  }
  return y;
}

// Rotary embedding (half-split layout) on the q and k heads of qkv [T, (nh + 2 nkv) * D], in
// place, then k and v of token t written to slot slot_mapping[t] of the pools [slots, nkv, D].
// cos, sin: [P, D] float32 tables (both halves equal). Rounds like the reference in 16 bits:
// x' = round(round(x1 * c) + round(-x2 * s)) with c, s rounded to the dtype first.
template <typename T>
void rotary_and_cache_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool,
                           const at::Tensor& slot_mapping, int64_t nh, int64_t nkv) {
  const int64_t T_ = qkv.size(0), D = k_pool.size(2), half = D / 2, row = qkv.stride(0);
  T* x = qkv.data_ptr<T>();
  T* kp = k_pool.data_ptr<T>();
  T* vp = v_pool.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t table_row = cos.size(1);
  at::parallel_for(0, T_, rows_grain(row), [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + pos[t] * table_row;
      const float* st = sp + pos[t] * table_row;
      for (int64_t i = 0; i < half; ++i) {
        c[i] = round_to<T>(ct[i]);
        s[i] = round_to<T>(st[i]);
      }
      T* xt = x + t * row;
      for (int64_t h = 0; h < nh + nkv; ++h) {
        T* xh = xt + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(xh[i]), x2 = to_f(xh[i + half]);
          const float a1 = round_to<T>(x1 * c[i]), b1 = round_to<T>(-x2 * s[i]);
          const float a2 = round_to<T>(x2 * c[i]), b2 = round_to<T>(x1 * s[i]);
          xh[i] = from_f<T>(a1 + b1);
          xh[i + half] = from_f<T>(a2 + b2);
        }
      }
      const int64_t slot = slots[t];
      std::copy(xt + nh * D, xt + (nh + nkv) * D, kp + slot * nkv * D);
      std::copy(xt + (nh + nkv) * D, xt + (nh + 2 * nkv) * D, vp + slot * nkv * D);
    }
  });
}

void rotary_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                      const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_and_cache: qkv must be [T, width]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.size(1) == num_kv_heads,
              "rotary_and_cache: pools must be contiguous [slots, nkv, D]");
  const int64_t D = k_pool.size(2);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "rotary_and_cache: qkv width");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D &&
                  sin.sizes() == cos.sizes(),
              "rotary_and_cache: cos/sin must be contiguous float32 [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0),
              "rotary_and_cache: positions and slot_mapping must be int64 [T]");
  TORCH_CHECK(qkv.scalar_type() == k_pool.scalar_type() && v_pool.sizes() == k_pool.sizes(),
              "rotary_and_cache: pools must match each other and qkv's dtype");
  check_range(positions, 0, cos.size(0), "rotary_and_cache: position");
  check_range(slot_mapping, 0, k_pool.size(0), "rotary_and_cache: slot");
  if (qkv.scalar_type() == at::kFloat) {
    rotary_and_cache_impl<float>(qkv, positions, cos, sin, k_pool, v_pool, slot_mapping,
                                 num_heads, num_kv_heads);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rotary_and_cache_impl<c10::BFloat16>(qkv, positions, cos, sin, k_pool, v_pool, slot_mapping,
                                         num_heads, num_kv_heads);
  } else {
    TORCH_CHECK(false, "rotary_and_cache: float32 or bfloat16 only");
  }
}

// y = round(round(silu(gate)) * up) for x = [gate | up]: [T, 2I] -> [T, I].
template <typename T>
void silu_and_mul_impl(const T* x, T* y, int64_t rows, int64_t I, int64_t x_stride) {
  at::parallel_for(0, rows, rows_grain(3 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + I;
      T* yr = y + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float gf = to_f(g[i]);
        const float act = round_to<T>(gf / (1.f + exp_f(-gf)));
        yr[i] = from_f<T>(act * to_f(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2I] with unit column stride");
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({rows, I}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(x.data_ptr<float>(), y.data_ptr<float>(), rows, I, x.stride(0));
  } else if (x.scalar_type() == at::kBFloat16) {
    using bf = c10::BFloat16;
    silu_and_mul_impl<bf>(x.data_ptr<bf>(), y.data_ptr<bf>(), rows, I, x.stride(0));
  } else {
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  }
  return y;
}

// Index of each row's maximum, the first one on ties; a NaN counts as the maximum (the first
// NaN wins), as in torch.argmax. x: [S, V] with unit column stride -> [S] int64.
// One pass: 16 lanes each keep the first maximum of their residue class, then the lanes are
// merged (largest value, then smallest index). A row holding a NaN is scanned again for it.
template <typename T>
void argmax_impl(const T* x, int64_t* out, int64_t rows, int64_t V, int64_t x_stride) {
  constexpr int64_t kLanes = 16;
  at::parallel_for(0, rows, rows_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      alignas(64) float lane_max[kLanes];
      alignas(64) int32_t lane_index[kLanes];
      alignas(64) int32_t lane_nan[kLanes];
      const int64_t whole = V / kLanes * kLanes;
#if defined(__AVX512F__)
      __m512 best_v = _mm512_set1_ps(-INFINITY);
      __m512i index_v = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __mmask16 nan_lanes = 0;
      for (int64_t i0 = 0; i0 < whole; i0 += kLanes) {
        const __m512 v = shardserve_cpu::widen16(xr + i0);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best_v, _CMP_GT_OQ);
        best_v = _mm512_mask_mov_ps(best_v, greater, v);
        index_v = _mm512_mask_mov_epi32(index_v, greater, at);
        nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        at = _mm512_add_epi32(at, _mm512_set1_epi32(kLanes));
      }
      _mm512_store_ps(lane_max, best_v);
      _mm512_store_si512(lane_index, index_v);
      _mm512_store_si512(lane_nan, _mm512_maskz_set1_epi32(nan_lanes, 1));
#else
      std::fill(lane_max, lane_max + kLanes, -INFINITY);
      std::fill(lane_index, lane_index + kLanes, 0);
      std::fill(lane_nan, lane_nan + kLanes, 0);
      for (int64_t i0 = 0; i0 < whole; i0 += kLanes) {
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = to_f(xr[i0 + l]);
          const bool greater = v > lane_max[l];
          lane_max[l] = greater ? v : lane_max[l];
          lane_index[l] = greater ? static_cast<int32_t>(i0 + l) : lane_index[l];
          lane_nan[l] |= static_cast<int32_t>(v != v);
        }
      }
#endif
      bool nan = false;
      for (int64_t l = 0; l < kLanes; ++l) nan = nan || lane_nan[l] != 0;
      float best = -INFINITY;
      int64_t index = -1;  // none yet
      for (int64_t l = 0; l < kLanes; ++l) {
        if (lane_max[l] > best || (lane_max[l] == best && lane_index[l] < index) ||
            (index < 0 && lane_max[l] == best && whole > 0)) {
          best = lane_max[l];
          index = lane_index[l];
        }
      }
      for (int64_t i = whole; i < V; ++i) {
        const float v = to_f(xr[i]);
        nan = nan || v != v;
        if (v > best || index < 0) {
          best = v;
          index = i;
        }
      }
      if (nan) {
        for (int64_t i = 0; i < V; ++i)
          if (to_f(xr[i]) != to_f(xr[i])) {
            index = i;
            break;
          }
      }
      out[r] = index;
    }
  });
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
                  x.size(1) < std::numeric_limits<int32_t>::max(),
              "argmax: x must be [S, V] with unit column stride and 0 < V < 2^31");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_impl<float>(x.data_ptr<float>(), out.data_ptr<int64_t>(), x.size(0), x.size(1),
                       x.stride(0));
  } else if (x.scalar_type() == at::kBFloat16) {
    using bf = c10::BFloat16;
    argmax_impl<bf>(x.data_ptr<bf>(), out.data_ptr<int64_t>(), x.size(0), x.size(1), x.stride(0));
  } else {
    TORCH_CHECK(false, "argmax: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(shardserve_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, bool vectorized=True) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("decode_attention_vectorized(ScalarType dtype, int head_dim) -> bool",
        &shardserve_cpu::decode_attention_avx512_supports);
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_and_cache", &rotary_and_cache);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax", &argmax);
}

// Fused CPU kernels for decoding (float32 and bfloat16), registered as torch.ops.shardserve_cpu.*:
// RMSNorm (+ residual), RoPE + K/V cache write, SiLU-and-mul and the row argmax (decode
// attention is decode_attention.cpp's). This file holds the library's TORCH_LIBRARY; the other
// sources add their ops as fragments.
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
#include <limits>
#include <vector>

#include "kernel_common.h"
#include "ops.h"

namespace {

// Below about this many elements an op runs on one thread: a parallel region costs more
// than it saves, and with the cores shared (frontend, other ranks) a descheduled thread
// stalls the whole region.
constexpr int64_t kSerialElements = 64 * 1024;

inline int64_t rows_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, row_elements));
}

// kernel_common.h: index checks, the float32 <-> bfloat16 conversions and e^x.
using shardserve_cpu::check_range;
using shardserve_cpu::exp_f;
using shardserve_cpu::from_f;
using shardserve_cpu::round_to;
using shardserve_cpu::to_f;

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

constexpr int64_t kArgmaxLanes = 16;

// One pass over x[0, whole) (whole a multiple of 16): lane l sees x[l], x[l + 16], ... and keeps
// its first maximum (lane_max, lane_index; -inf and 0 when whole is 0); lane_nan[l] is 1 where
// one of its values is a NaN, else 0.
template <typename T>
inline void lane_maxima(const T* xr, int64_t whole, float* lane_max, int32_t* lane_index,
                        int32_t* lane_nan) {
  constexpr int64_t kLanes = kArgmaxLanes;
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
}

// The lanes merged: the largest lane maximum, the smallest index among equals, into `best`;
// returns its index, or -1 (and best = -inf) when whole is 0.
inline int64_t merge_lanes(const float* lane_max, const int32_t* lane_index, int64_t whole,
                           float& best) {
  best = -INFINITY;
  int64_t index = -1;  // none yet
  for (int64_t l = 0; l < kArgmaxLanes; ++l) {
    if (lane_max[l] > best || (lane_max[l] == best && lane_index[l] < index) ||
        (index < 0 && lane_max[l] == best && whole > 0)) {
      best = lane_max[l];
      index = lane_index[l];
    }
  }
  return index;
}

// The index of the first NaN of x[0, V), or `none` if there is none.
template <typename T>
inline int64_t first_nan(const T* xr, int64_t V, int64_t none) {
  for (int64_t i = 0; i < V; ++i)
    if (to_f(xr[i]) != to_f(xr[i])) return i;
  return none;
}

// Index of each row's maximum, the first one on ties; a NaN counts as the maximum (the first
// NaN wins), as in torch.argmax. x: [S, V] with unit column stride -> [S] int64.
// One pass: 16 lanes each keep the first maximum of their residue class, then the lanes are
// merged (largest value, then smallest index). A row holding a NaN is scanned again for it.
template <typename T>
void argmax_impl(const T* x, int64_t* out, int64_t rows, int64_t V, int64_t x_stride) {
  constexpr int64_t kLanes = kArgmaxLanes;
  at::parallel_for(0, rows, rows_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      alignas(64) float lane_max[kLanes];
      alignas(64) int32_t lane_index[kLanes];
      alignas(64) int32_t lane_nan[kLanes];
      const int64_t whole = V / kLanes * kLanes;
      lane_maxima(xr, whole, lane_max, lane_index, lane_nan);
      bool nan = false;
      for (int64_t l = 0; l < kLanes; ++l) nan = nan || lane_nan[l] != 0;
      float best;
      int64_t index = merge_lanes(lane_max, lane_index, whole, best);
      for (int64_t i = whole; i < V; ++i) {  // the tail, past the last whole 16
        const float v = to_f(xr[i]);
        nan = nan || v != v;
        if (v > best || index < 0) {
          best = v;
          index = i;
        }
      }
      if (nan) index = first_nan(xr, V, index);
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

namespace shardserve_cpu::ops {
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps) {
  return ::rms_norm(x, residual, weight, eps);
}
void rotary_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                      const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  ::rotary_and_cache(qkv, positions, cos, sin, k_pool, v_pool, slot_mapping, num_heads,
                     num_kv_heads);
}
at::Tensor silu_and_mul(const at::Tensor& x) { return ::silu_and_mul(x); }
}  // namespace shardserve_cpu::ops

TORCH_LIBRARY(shardserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_and_cache", &rotary_and_cache);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax", &argmax);
}

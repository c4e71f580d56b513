// The GEMM of linear layers whose GGML blocks the backend laid out as row panels at load
// (model_shards/quant/panels.py): torch.ops.shardserve_cpu.quant_gemm_panels.
//
//   y [..., N] = x [..., K] W^T (+ bias),   W [N, K] as row panels, uint8 [N, row_bytes], N % 16 = 0
//
// Same contract, activations and arithmetic as quant_gemm (quant_gemm.cpp): x quantized per
// block to int8 once per call, exact int32 block products, the float32 steps of its AVX2 /
// AVX-512 panels, so y has the same bits as quant_gemm on the GGML layout of W, and row m of
// y depends only on row m of x (batch invariance). Built only with AVX-512 BW + VL + VNNI
// (quant_panels_isa() is "" elsewhere, and the backend keeps the GGML layout).
//
// Work split: threads take groups of sixteen weight rows; within a group, tiles of up to
// eight rows of x (kTile), each block of the sixteen rows decoded once per tile
// (quant_panels_avx512.h). Why the layout: in the GGML layout a block's eight rows sit
// 600 bytes apart, their scales are gathered one by one and each row's int32 partials are
// reduced across lanes, about half of a block's ~90 instructions; in panels a row is a lane
// throughout and a block of sixteen rows is ~25 instructions for the first row of x, ~13
// for each further one.
//
// Measured (python -m benchmarks micro quant_gemm, 2 threads of a shared 2-core Xeon with
// AVX-512 VNNI, 2026-12-05): the dense bfloat16 packed GEMM's time over ours, SmolLM2-135M's
// shapes; GGML layout (quant_gemm.cpp's table) -> row panels:
//
//   type   M = 1                   M = 8                   M = 32                  M = 128
//   Q8_0   0.8 - 2.2 -> 1.1 - 2.6   0.8 - 1.7 -> 1.8 - 3.6   0.8 - 1.2 -> 2.2 - 3.5   2.3 - 2.8
//   Q4_1   0.7 - 2.5 -> 1.1 - 4.1   0.7 - 1.4 -> 1.9 - 3.8   0.7 - 1.1 -> 2.2 - 3.7   2.4 - 3.0
//   Q5_0   0.5 - 2.2 -> 0.9 - 3.2   0.7 - 1.4 -> 1.5 - 2.9   0.7 - 1.1 -> 1.8 - 2.8   1.9 - 2.2
//   Q4_K   0.5       -> 1.1         0.8       -> 1.9         0.8       -> 2.1         2.2
//   Q6_K   0.8       -> 0.7         0.6       -> 1.3         0.6       -> 1.5         1.5
//
// (the activation quantization, quant_act.h, vectorized at the same time, is part of both
// columns' right-hand side). At M = 1 the large matrices stream from memory at ~20-25 GB/s,
// the two cores' roof; the small ones are bound by the per-call work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kernel_common.h"
#include "ops.h"
#include "quant_act.h"
#include "quant_dot.h"
#include "quant_panels_avx512.h"

namespace shardserve_cpu {
namespace {

using namespace quant;

constexpr int kTile = 8;  // rows of x per pass over a group's blocks

std::string quant_panels_isa() {
#if defined(SHARDSERVE_QUANT_PANELS)
  return "avx512-vnni";
#else
  return "";
#endif
}

#if defined(SHARDSERVE_QUANT_PANELS)
using TileFn = void (*)(const uint8_t*, const void* const*, int64_t, float*);

template <int64_t T, int R>
void tile_entry(const uint8_t* w, const void* const* a, int64_t nb, float* out) {
  if constexpr (T == kQ6_K) panels::tile_q6k<R>(w, reinterpret_cast<const ActA256* const*>(a), nb, out);
  else if constexpr (is_k(T)) panels::tile_k4<T, R>(w, reinterpret_cast<const ActA256* const*>(a), nb, out);
  else panels::tile32<T, R>(w, reinterpret_cast<const ActA32* const*>(a), nb, out);
}

template <int64_t T>
TileFn pick(int rows) {
  switch (rows) {
    case 1: return &tile_entry<T, 1>;
    case 2: return &tile_entry<T, 2>;
    case 3: return &tile_entry<T, 3>;
    case 4: return &tile_entry<T, 4>;
    case 5: return &tile_entry<T, 5>;
    case 6: return &tile_entry<T, 6>;
    case 7: return &tile_entry<T, 7>;
    default: return &tile_entry<T, kTile>;
  }
}

TileFn tile_fn(int64_t t, int rows) {
  TileFn fn = nullptr;
  const bool known = with_type(t, [&](auto type) { fn = pick<decltype(type)::value>(rows); });
  TORCH_CHECK(known, "quant_gemm_panels: unsupported GGML type ", t);
  return fn;
}

template <typename X>
void run(const X* x, const uint8_t* w, int64_t qtype, const X* bias, X* y, int64_t M, int64_t N,
         int64_t K) {
  const bool k_quant = is_k(qtype);
  const int64_t nb = K / block_elems(qtype), group_bytes = panels::kRows * nb * block_bytes(qtype);
  const int64_t a_row = nb * (k_quant ? sizeof(ActA256) : sizeof(ActA32));
  std::vector<uint8_t> act(M * a_row);
  if (k_quant) quantize_rows<X, ActA256>(x, M, K, act.data());
  else quantize_rows<X, ActA32>(x, M, K, act.data());
  const TileFn full = tile_fn(qtype, kTile), rest = tile_fn(qtype, static_cast<int>(M % kTile));
  at::parallel_for(0, N / panels::kRows, 1, [&](int64_t g0, int64_t g1) {
    float out[kTile * panels::kRows];
    const void* a[kTile];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        for (int r = 0; r < rows; ++r) a[r] = act.data() + (m0 + r) * a_row;
        (rows == kTile ? full : rest)(w + g * group_bytes, a, nb, out);
        for (int r = 0; r < rows; ++r)
          for (int i = 0; i < panels::kRows; ++i) {
            const int64_t n = g * panels::kRows + i;
            const float v = out[r * panels::kRows + i] + (bias != nullptr ? to_f<X>(bias[n]) : 0.f);
            y[(m0 + r) * N + n] = from_f<X>(v);
          }
      }
    }
  });
}
#endif

at::Tensor quant_gemm_panels(const at::Tensor& input, const at::Tensor& panels, int64_t qtype,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!quant_panels_isa().empty(), "quant_gemm_panels: this build has no AVX-512 VNNI");
  return quantized_linear(
      "quant_gemm_panels", "panels must be uint8 [16 n, row_bytes]", 16, input,
      panels, qtype, bias,
      [&](const auto* x, const uint8_t* w, const auto* b, auto* y, int64_t M, int64_t N,
          int64_t K) {
#if defined(SHARDSERVE_QUANT_PANELS)
        run(x, w, qtype, b, y, M, N, K);
#endif
      });
}

}  // namespace

at::Tensor ops::quant_gemm_panels(const at::Tensor& input, const at::Tensor& panels, int64_t qtype,
                                  const std::optional<at::Tensor>& bias) {
  return shardserve_cpu::quant_gemm_panels(input, panels, qtype, bias);
}
}  // namespace shardserve_cpu

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("quant_panels_isa() -> str", &shardserve_cpu::quant_panels_isa);
  m.def("quant_gemm_panels(Tensor input, Tensor panels, int qtype, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) {
  m.impl("quant_gemm_panels", &shardserve_cpu::quant_gemm_panels);
}

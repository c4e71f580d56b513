// The GEMM of linear layers whose weights stay GGML block-quantized:
// torch.ops.shardserve_cpu.quant_gemm. (Where the build has AVX-512 VNNI the backend lays the
// weights out as row panels after loading and quant_panels.cpp serves them, same bits; this
// kernel then serves the few rows of a segment that do not fill a panel of sixteen.)
//
//   y [..., N] = x [..., K] W^T (+ bias),   W [N, K] given as its GGML blocks [N, row_bytes]
//
// for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32-value blocks) and Q4_K, Q5_K, Q6_K (256-value blocks),
// as llama.cpp's CPU backend computes them: each row of x is quantized per block to int8
// (quant_dot.h: one float32 scale per 32 values for the 32-value types, per 256 for the
// K-quants, plus the block sums the weight types' offsets and mins need), every block
// product is an exact int32 dot product (AVX2: vpdpbusd with VNNI, else maddubs + madd;
// quant_dot_avx2.h) scaled once in float32 per block, and the blocks' terms are added in
// order of k.
// No dense copy of W exists at any time.
//
// Work split: threads take chunks of 16 weight rows (ATen parallel_for). Within a chunk, eight
// weight rows at a time (quant_panel_avx2.h, quant_panel_k_avx2.h): each block of the eight is
// decoded once and multiplied with each row of x, four rows of x per pass, the eight rows'
// int32 sums reduced into one register whose lanes are the weight rows and scaled there as
// vectors. Where the build has AVX-512 BW + VL + VNNI, the 32-value types take
// quant_panel_avx512.h's panels instead: two weight rows per vpdpbusd, a shuffle reduction in
// place of hadd trees, the next eight rows prefetched while these are multiplied; the same
// int32 sums and float steps lane for lane, so the same bits as the AVX2 panels.
// Activations are quantized once per call. quant_dot.h's scalar kernels compute the
// same sums one weight row at a time: the path of builds without AVX2 + F16C (and of
// quant_gemm(..., vectorized=False), which the tests run too).
//
// Measured (benchmarks/micro/quant_gemm.py --threads 1, one thread of a shared 2-core Intel
// Xeon with AVX-512 VNNI, load average 4-7, so +-10%): time of the dense bfloat16 packed GEMM
// over ours, SmolLM2-135M's shapes (qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down
// 576 x 1536, LM head 49152 x 576; K-quants only on down, K = 576 not being a multiple of
// 256). The 32-value types at M <= 32: the AVX2 panels -> the AVX-512 panels, one session:
//
//   type   M = 1                  M = 8                  M = 32
//   Q8_0   0.9 - 1.9 -> 0.8 - 2.2   0.7 - 1.4 -> 0.8 - 1.7   0.8 - 1.1 -> 0.8 - 1.2
//   Q4_0   0.8 - 2.3 -> 0.7 - 2.4   0.7 - 1.3 -> 0.8 - 1.5   0.7 - 1.1 -> 0.7 - 1.2
//   Q4_1   0.7 - 2.0 -> 0.7 - 2.5   0.7 - 1.1 -> 0.7 - 1.4   0.7 - 1.0 -> 0.7 - 1.1
//   Q5_0   0.6 - 1.6 -> 0.5 - 2.2   0.7 - 1.1 -> 0.7 - 1.4   0.7 - 1.0 -> 0.7 - 1.1
//   Q5_1   0.6 - 1.4 -> 0.6 - 2.0   0.6 - 1.1 -> 0.7 - 1.3   0.6 - 0.9 -> 0.7 - 1.0
//
// (the LM head gains most, +25-55% at M = 1: streamed from L3, the prefetch hides it; down
// +5-25%; the small matrices sit in L2 and are bound by instructions per block, within the
// noise). Per call at M = 1 on one thread, Q4_1: gate/up ~62 us, LM head ~1.3 -> ~1.0 ms.
// The K-quant panels prefetch the same way: a Q6_K 32768 x 1536 at M = 1 ~4.1-4.9 -> ~3.2-3.5
// ms (Q4_K, bound by its decoding at ~11 GB/s, unchanged).
// Earlier (the AVX2 panels; M = 128 / 512 unchanged since, and the K-quants, whose panels are
// still quant_panel_k_avx2.h's):
//
//   type   M = 1        M = 8        M = 32       M = 128      M = 512
//   Q8_0   0.8 - 3.3    1.0 - 1.4    1.0 - 1.2    1.0 - 1.1    0.9 - 1.2
//   Q4_0   0.8 - 3.9    0.9 - 2.0    0.8 - 1.3    0.9          0.9
//   Q4_1   0.8 - 2.8    0.8 - 1.5    0.8 - 1.1    0.8 - 0.9    0.8 - 1.2
//   Q5_0   0.6 - 3.0    0.8 - 1.5    0.8 - 0.9    0.8 - 1.0    0.8 - 0.9
//   Q5_1   0.5 - 2.1    0.8 - 1.3    0.7 - 1.0    0.7 - 1.1    0.7 - 0.8
//   Q4_K   0.5          0.8          0.8          0.8          0.9
//   Q5_K   0.8          0.7          0.6          0.7          0.6
//   Q6_K   0.8          0.6          0.6          0.5          0.5
//
// (the high ends at M = 1 are the large matrices, where reading 4-8 bits per weight instead
// of 16 wins; the small ones sit in cache). End to end on the bench model (decode_step, one
// thread, bfloat16 activations): q4_0 58 / 171 / 221 tok/s and q8_0 34 / 151 / 227 against
// bfloat16 weights' 29 / 130 / 210 at concurrency 1 / 8 / 32.
//
// Choice for large M: dequantizing W into the bfloat16 panels and running gemm.cpp costs at
// least that GEMM (ratio 1 above) plus the dequantization per call, so it could win only where
// the ratio is below 1 at large M (the 5- and 6-bit types, by under 2x less the
// dequantization); one path keeps the kernel simple and every row's arithmetic the same at
// every M, so the integer path serves all M. Faster still would be weights repacked at load
// so that rows sit in lanes (llama.cpp's interleaved Q4_0x8 layouts): profiled, an eight-row
// block of the AVX-512 panel is ~90 instructions at ~4 per cycle, about half of them the
// eight rows' scattered float16 scales and the lane reduction, which such a layout removes
// (eight scales in one load, sums already in their rows' lanes).
//
// Accuracy: y differs from x · dequantize(W)^T by the activation rounding alone (each x value
// moves by at most d / 2 = max|x_block| / 254), a relative error of ~0.3-1% of a row's output
// scale; tests/model_shards/backends/cpu/test_quant_gemm.py states the bound it checks.
//
// Contract: y[m, n] depends only on row m of x and row n of W: the quantization of a row of
// x is the row's alone, and the sum for (m, n) runs the same steps whatever M, the tile of
// four rows or the thread count (batch invariance). float32 and bfloat16 x; y in x's dtype,
// rounded once (to nearest even) after + bias.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kernel_common.h"
#include "ops.h"
#include "quant_act.h"
#include "quant_dot.h"
#include "quant_dot_avx2.h"
#include "quant_panel_avx2.h"
#include "quant_panel_avx512.h"
#include "quant_panel_k_avx2.h"

namespace shardserve_cpu {
namespace {

using namespace quant;

constexpr int64_t kChunk = 16;  // weight rows per work item
constexpr int kTile = 4;        // rows of x per weight-row pass
constexpr int64_t kPanelRows = 8;  // weight rows per pass (the 32-value types' panels)

using DotFn = void (*)(const uint8_t*, const void* const*, int64_t, float*);

// The scalar kernels (quant_dot.h): builds without AVX2 + F16C, and vectorized=False.
template <int64_t T, int R>
void dot_entry(const uint8_t* w, const void* const* a, int64_t nb, float* out) {
  dot_scalar<T, R>(w, reinterpret_cast<const Act<T>* const*>(a), nb, out);
}

template <int64_t T>
DotFn pick(int rows) {
  return rows == kTile ? &dot_entry<T, kTile> : &dot_entry<T, 1>;
}

DotFn dot_fn(int64_t t, int rows) {
  DotFn fn = nullptr;
  const bool known = with_type(t, [&](auto type) { fn = pick<decltype(type)::value>(rows); });
  TORCH_CHECK(known, "quant_gemm: unsupported GGML type ", t);
  return fn;
}

// The 32-value types' eight-row panels (quant_panel_avx2.h); nullptr: none for this type/build.
using PanelFn = void (*)(const uint8_t* const*, const void* const*, int64_t, float*);

template <int64_t T, int R>
void panel_entry(const uint8_t* const* w, const void* const* a, int64_t nb, float* out) {
#if defined(SHARDSERVE_QUANT_AVX2)
  if constexpr (is_k(T)) avx2::panel_k<T, R>(w, reinterpret_cast<const ActA256* const*>(a), nb, out);
#if defined(SHARDSERVE_QUANT_AVX512)
  else avx512::panel32<T, R>(w, reinterpret_cast<const ActA32* const*>(a), nb, out);
#else
  else avx2::panel32<T, R>(w, reinterpret_cast<const ActA32* const*>(a), nb, out);
#endif
#endif
}

template <int64_t T>
PanelFn pick_panel(int rows) {
  return rows == kTile ? &panel_entry<T, kTile> : &panel_entry<T, 1>;
}

PanelFn panel_fn(int64_t t, int rows, bool vectorized) {
#if defined(SHARDSERVE_QUANT_AVX2)
  if (!vectorized) return nullptr;
  PanelFn fn = nullptr;
  with_type(t, [&](auto type) { fn = pick_panel<decltype(type)::value>(rows); });
  return fn;
#else
  return nullptr;
#endif
}

std::string quant_gemm_isa() {
#if defined(SHARDSERVE_QUANT_AVX512)
  return "avx512-vnni";  // the 32-value types' panels; the K-quants' stay avx2-vnni
#elif defined(SHARDSERVE_QUANT_VNNI)
  return "avx2-vnni";
#elif defined(SHARDSERVE_QUANT_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

template <typename X>
void run(const X* x, const uint8_t* w, int64_t qtype, const X* bias, X* y, int64_t M, int64_t N,
         int64_t K, bool vectorized) {
  const bool k_quant = is_k(qtype);
  const int64_t nb = K / block_elems(qtype), w_row = nb * block_bytes(qtype);
  const int64_t a_row = nb * (k_quant ? sizeof(ActA256) : sizeof(ActA32));
  std::vector<uint8_t> act(M * a_row);
  if (k_quant) quantize_rows<X, ActA256>(x, M, K, act.data());
  else quantize_rows<X, ActA32>(x, M, K, act.data());
  const DotFn one = dot_fn(qtype, 1), tile = dot_fn(qtype, kTile);
  const PanelFn p_one = panel_fn(qtype, 1, vectorized), p_tile = panel_fn(qtype, kTile, vectorized);
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  auto store = [&](int64_t m, int64_t n, float v) {
    y[m * N + n] = from_f<X>(v + (bias != nullptr ? to_f<X>(bias[n]) : 0.f));
  };
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0 * kChunk; n0 < std::min(N, c1 * kChunk); n0 += kPanelRows) {
      const int64_t width = std::min<int64_t>(kPanelRows, N - n0);
      const uint8_t* rows[kPanelRows];
      for (int64_t i = 0; i < kPanelRows; ++i) rows[i] = w + std::min(n0 + i, N - 1) * w_row;
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int r_count = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        const void* a[kTile];
        for (int r = 0; r < r_count; ++r) a[r] = act.data() + (m0 + r) * a_row;
        float out[kTile * kPanelRows];
        if (p_one != nullptr) {  // eight weight rows at once; lane i of out[r * 8 ..] is row i
          if (r_count == kTile) p_tile(rows, a, nb, out);
          else for (int r = 0; r < r_count; ++r) p_one(rows, a + r, nb, out + r * kPanelRows);
        } else {
          for (int64_t i = 0; i < width; ++i) {
            float o[kTile];
            if (r_count == kTile) tile(rows[i], a, nb, o);
            else for (int r = 0; r < r_count; ++r) one(rows[i], a + r, nb, o + r);
            for (int r = 0; r < r_count; ++r) out[r * kPanelRows + i] = o[r];
          }
        }
        for (int r = 0; r < r_count; ++r)
          for (int64_t i = 0; i < width; ++i) store(m0 + r, n0 + i, out[r * kPanelRows + i]);
      }
    }
  });
}

at::Tensor quant_gemm(const at::Tensor& input, const at::Tensor& blocks, int64_t qtype,
                      const std::optional<at::Tensor>& bias, bool vectorized) {
  return quantized_linear(
      "quant_gemm", "blocks must be uint8 [N, row_bytes]", 1, input, blocks, qtype, bias,
      [&](const auto* x, const uint8_t* w, const auto* b, auto* y, int64_t M, int64_t N,
          int64_t K) { run(x, w, qtype, b, y, M, N, K, vectorized); });
}

}  // namespace

at::Tensor ops::quant_gemm(const at::Tensor& input, const at::Tensor& blocks, int64_t qtype,
                           const std::optional<at::Tensor>& bias, bool vectorized) {
  return shardserve_cpu::quant_gemm(input, blocks, qtype, bias, vectorized);
}
}  // namespace shardserve_cpu

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("quant_gemm_isa() -> str", &shardserve_cpu::quant_gemm_isa);
  m.def("quant_gemm(Tensor input, Tensor blocks, int qtype, Tensor? bias=None, "
        "bool vectorized=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) { m.impl("quant_gemm", &shardserve_cpu::quant_gemm); }

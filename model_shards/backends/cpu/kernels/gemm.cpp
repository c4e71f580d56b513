// The GEMM of every CPU linear layer in float32 and bfloat16: torch.ops.shardserve_cpu.gemm.
//
//   y [..., n] = x [..., K] W^T (+ bias),   W [n, K] given once to pack_gemm
//
// (leading dims of x are flattened into M rows, as F.linear does; y has x's dtype)
//
// W is packed into panels of kPanel = 48 output columns so that one step of k is three
// consecutive zmm loads (the AVX2 tiles of gemm_avx2.h, for CPUs without AVX-512, read the
// same panels: gemm_isa says which tiles run):
//   float32:  [P, K, 48],            element (p, k, j) = W[48p + j, k];
//   bfloat16: [P, ceil(K / 2), 96],  element (p, h, 2j + e) = W[48p + j, 2h + e],
// P = ceil(n / 48), zero-padded past n and K. A tile of up to 8 rows of x by one panel keeps
// its 8 x 48 float32 sums in 24 registers while k runs over K: per step, three loads of W, one
// broadcast of x per row and 24 multiply-adds. In float32 a step is one k and an FMA; in
// bfloat16 it is a pair of k and one vdpbf16ps, which multiplies the two bf16 pairs exactly
// and adds both products to the float32 sum, so each instruction does twice the work. Threads
// split the panels; each weight byte comes from memory once per call and is reused by every
// row.
//
// For the short, wide products of decoding (a few dozen rows against a large matrix) this ran
// 10-25% faster than oneDNN's packed linear in float32 and 15-25% in bfloat16 on the one CPU
// we measured (AMD Zen 4, the benchmark model's layer shapes, 1 and 2 threads), and
// as fast for long prefill batches. The benchmark tables (benchmarks/README.md) show its
// effect end to end only.
//
// Contract: every output is sum_k x[m, k] * W[j, k] accumulated in float32 in order k = 0,
// 1, ..., K - 1 (float32: one FMA per k; bfloat16: per pair of k, the exact products added
// by vdpbf16ps), then + bias[j], then (bfloat16) rounded to nearest even. A row's result
// therefore depends only on that row, never on M, on the other rows or on the thread count
// (batch invariance).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "gemm_avx2.h"
#include "kernel_common.h"
#include "ops.h"

namespace shardserve_cpu {
namespace {

constexpr int64_t kPanel = kGemmPanel;  // 48 output columns per panel: three zmm of sums
constexpr int64_t kRows = 8;    // rows of x per register tile

// k values per packed step: 1 in float32, a pair in bfloat16.
int64_t step_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// The tiles a dtype can run on: AVX-512 (bfloat16: with AVX512_BF16) where the build has it,
// else AVX2 + FMA (gemm_avx2.h), else none (the cpu backend then packs for oneDNN).
enum class Isa { kNone, kAvx2, kAvx512 };

Isa widest_isa(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return Isa::kAvx512;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (dtype == at::kBFloat16) return Isa::kAvx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dtype == at::kFloat || dtype == at::kBFloat16) return Isa::kAvx2;
#endif
  return Isa::kNone;
}

std::atomic<bool> g_avx2_only{false};  // gemm_isa(dtype, "avx2"): the AVX2 tiles even here

Isa isa_for(at::ScalarType dtype) {
  const Isa widest = widest_isa(dtype);
  return widest == Isa::kAvx512 && g_avx2_only.load() ? Isa::kAvx2 : widest;
}

bool gemm_supported(at::ScalarType dtype) { return widest_isa(dtype) != Isa::kNone; }

// The tiles gemm runs for `dtype` ("avx512", "avx2", "none"); `use` = "avx2" makes every dtype
// run the AVX2 tiles where they are built (to compare both ISAs on one machine), "widest" undoes
// it. The packed layout is the same for both, so packed weights stay valid.
std::string gemm_isa(at::ScalarType dtype, std::optional<c10::string_view> use) {
  if (use.has_value()) {
    TORCH_CHECK(*use == "avx2" || *use == "widest", "gemm_isa: use must be 'avx2' or 'widest'");
    g_avx2_only.store(*use == "avx2");
  }
  const Isa isa = isa_for(dtype);
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "none";
}

// W [n, K] -> panels (layout in the header comment), `step` consecutive k per column.
template <typename T>
void pack_panels(const T* src, T* dst, int64_t n, int64_t K, int64_t step) {
  const int64_t P = (n + kPanel - 1) / kPanel, steps = (K + step - 1) / step;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      T* panel = dst + p * steps * kPanel * step;
      for (int64_t j = 0; j < cols; ++j) {
        const T* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k)
          panel[(k / step) * kPanel * step + j * step + k % step] = row[k];
      }
    }
  });
}

at::Tensor pack_gemm(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && gemm_supported(weight.scalar_type()),
              "pack_gemm: weight must be [n, K] in a dtype gemm_vectorized accepts, got ",
              weight.scalar_type(), " ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), K = w.size(1), step = step_of(w.scalar_type());
  at::Tensor packed =
      at::zeros({(n + kPanel - 1) / kPanel, (K + step - 1) / step, kPanel * step}, w.options());
  if (w.scalar_type() == at::kBFloat16)
    pack_panels(w.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), n, K, step);
  else
    pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), n, K, step);
  return packed;
}

#if defined(__AVX512F__)
// What a tile needs of the element type: one step's multiply-add of a broadcast x value
// (float32: x[k]; bfloat16: the pair x[k], x[k + 1]) into the sums. The bias is widened and
// the results stored by kernel_common.h's widen16 and store16.
struct F32 {
  using T = float;
  using X = __m512;
  static constexpr int64_t kStep = 1;
  static X load_w(const T* w) { return _mm512_loadu_ps(w); }
  static X broadcast(const T* x) { return _mm512_set1_ps(*x); }
  static X broadcast_last(const T* x) { return broadcast(x); }  // never needed: a step is one k
  static __m512 madd(__m512 acc, X a, X w) { return _mm512_fmadd_ps(a, w, acc); }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
struct BF16 {
  using T = c10::BFloat16;
  using X = __m512bh;
  static constexpr int64_t kStep = 2;
  static X load_w(const T* w) { return (__m512bh)_mm512_loadu_si512(w); }
  // x[0], x[1] as one 32-bit lane (x[0] in the low half, as vdpbf16ps pairs them)
  static X broadcast(const T* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  // the last value of an odd K, paired with 0
  static X broadcast_last(const T* x) {
    uint16_t bits;
    std::memcpy(&bits, x, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
  }
  static __m512 madd(__m512 acc, X a, X w) { return _mm512_dpbf16_ps(acc, a, w); }
};
#endif

// y[0:R, 0:48) of one panel (columns past `cols` are not stored); x and y rows are `ldx` and
// `ldy` elements apart.
template <typename E, int64_t R>
void tile(const typename E::T* __restrict x, int64_t ldx, const typename E::T* __restrict panel,
          int64_t K, const typename E::T* bias, int64_t cols, typename E::T* __restrict y,
          int64_t ldy) {
  constexpr int64_t width = kPanel * E::kStep;  // elements per packed step
  __m512 acc[R][3];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  // one packed step s: acc[i] += x[i, k..] * W[panel, k..] for the step's k
  const auto step = [&](int64_t s, auto broadcast) __attribute__((always_inline)) {
    const typename E::T* w = panel + s * width;
    const typename E::X w0 = E::load_w(w), w1 = E::load_w(w + 16 * E::kStep),
                        w2 = E::load_w(w + 32 * E::kStep);
    for (int64_t i = 0; i < R; ++i) {
      const typename E::X a = broadcast(x + i * ldx + s * E::kStep);
      acc[i][0] = E::madd(acc[i][0], a, w0);
      acc[i][1] = E::madd(acc[i][1], a, w1);
      acc[i][2] = E::madd(acc[i][2], a, w2);
    }
  };
  const int64_t whole = K / E::kStep;  // steps with all their k inside K
  for (int64_t s = 0; s < whole; ++s)
    step(s, [](const typename E::T* xk) { return E::broadcast(xk); });
  if (whole * E::kStep < K)  // bfloat16 with odd K: x[K - 1] has no partner
    step(whole, [](const typename E::T* xk) { return E::broadcast_last(xk); });
  for (int64_t j = 0; j < 3; ++j) {
    const int64_t left = cols - j * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const __m512 b = bias != nullptr ? widen16(bias + j * 16, mask) : _mm512_setzero_ps();
    for (int64_t i = 0; i < R; ++i) store16(y + i * ldy + j * 16, mask, _mm512_add_ps(acc[i][j], b));
  }
}

template <typename E>
void run_tiles(const at::Tensor& x, const at::Tensor& packed, int64_t n,
               const std::optional<at::Tensor>& bias, at::Tensor& y) {
  using T = typename E::T;
  using TileFn = void (*)(const T*, int64_t, const T*, int64_t, const T*, int64_t, T*, int64_t);
  static constexpr TileFn kTiles[kRows + 1] = {nullptr,       tile<E, 1>, tile<E, 2>,
                                               tile<E, 3>,    tile<E, 4>, tile<E, 5>,
                                               tile<E, 6>,    tile<E, 7>, tile<E, 8>};
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), P = packed.size(0);
  const int64_t panel_size = packed.size(1) * packed.size(2);
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
      for (int64_t m = 0; m < M; m += kRows) {
        // the first tile brings the panel in from memory (the hardware prefetcher follows
        // its stream); the others find it in cache
        kTiles[std::min(kRows, M - m)](xp + m * ldx, ldx, wp + p * panel_size, K,
                                        bp == nullptr ? nullptr : bp + col0, cols,
                                        yp + m * n + col0, n);
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
void run_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t n,
              const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), P = packed.size(0);
  if (x.scalar_type() == at::kFloat) {
    avx2::gemm_f32(x.data_ptr<float>(), ldx, M, packed.data_ptr<float>(), P, K, n,
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
    return;
  }
  using BF = c10::BFloat16;
  avx2::gemm_bf16(x.data_ptr<BF>(), ldx, M, packed.data_ptr<BF>(), P, packed.size(1), K, n,
                  bias.has_value() ? bias->data_ptr<BF>() : nullptr, y.data_ptr<BF>());
}
#endif

at::Tensor gemm(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(input.dim() >= 1 && gemm_supported(dtype),
              "gemm: input must be [..., K] in a dtype gemm_vectorized accepts, got ", dtype);
  const int64_t K = input.size(-1), step = step_of(dtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.size(2) == kPanel * step && packed.size(1) == (K + step - 1) / step &&
                  (n + kPanel - 1) / kPanel == packed.size(0),
              "gemm: packed weight must come from pack_gemm for ", n, " outputs, K = ", K,
              " and ", dtype);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    bias->scalar_type() == dtype && bias->is_contiguous()),
              "gemm: bias must be [n] in the input's dtype");
  at::Tensor x = input.reshape({-1, K});
  if (x.stride(1) != 1 || (x.size(0) > 1 && x.stride(0) < K)) x = x.contiguous();
  std::vector<int64_t> out_sizes = input.sizes().vec();
  out_sizes.back() = n;
  at::Tensor y = at::empty(out_sizes, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const Isa isa = isa_for(dtype);
#if defined(__AVX512F__)
  if (isa == Isa::kAvx512 && dtype == at::kFloat) run_tiles<F32>(x, packed, n, bias, y);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (isa == Isa::kAvx512 && dtype == at::kBFloat16) run_tiles<BF16>(x, packed, n, bias, y);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == Isa::kAvx2) run_avx2(x, packed, n, bias, y);
#endif
  return y;
}

}  // namespace

at::Tensor ops::gemm(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                     const std::optional<at::Tensor>& bias) {
  return shardserve_cpu::gemm(input, packed, n, bias);
}
}  // namespace shardserve_cpu

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("gemm_vectorized(ScalarType dtype) -> bool", &shardserve_cpu::gemm_supported);
  m.def("gemm_isa(ScalarType dtype, str? use=None) -> str", &shardserve_cpu::gemm_isa);
  m.def("pack_gemm(Tensor weight) -> Tensor");
  m.def("gemm(Tensor input, Tensor packed, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) {
  m.impl("pack_gemm", &shardserve_cpu::pack_gemm);
  m.impl("gemm", &shardserve_cpu::gemm);
}

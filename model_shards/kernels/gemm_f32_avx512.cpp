// The float32 GEMM of every CPU linear layer: torch.ops.shardserve_cpu.gemm_f32.
//
//   y [..., n] = x [..., K] W^T (+ bias),   W [n, K] given once to pack_gemm_f32
//
// (leading dims of x are flattened into M rows, as F.linear does)
//
// W is packed into panels of kPanel = 48 output columns, [P, K, 48] with P = ceil(n / 48),
// zero-padded past n, so that a panel's row k is three consecutive zmm loads. A tile of
// up to 8 rows of x by one panel keeps its 8 x 48 sums in 24 registers while k runs over
// K: per k, three loads of W, one broadcast of x per row and 24 FMAs. Threads split the
// panels; each weight byte comes from memory once per call and is reused by every row.
//
// For the short, wide products of decoding (a few dozen rows against a large matrix)
// this ran 15-25% faster than oneDNN's packed linear on the one CPU we measured (AMD Zen 4,
// the benchmark model's layer shapes, 1 and 2 threads), and as fast for long prefill
// batches. The benchmark tables (benchmarks/README.md) show its effect end to end only.
//
// Contract: every output is sum_k x[m, k] * W[j, k] accumulated in float32 FMAs in order
// k = 0, 1, ..., K - 1, then + bias[j]. A row's result therefore depends only on that row,
// never on M, on the other rows or on the thread count (batch invariance).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace shardserve_cpu {
namespace {

constexpr int64_t kPanel = 48;  // output columns per packed panel: three zmm registers
constexpr int64_t kRows = 8;    // rows of x per register tile
constexpr int64_t kPrefetchRows = 16;  // how far ahead in k the first tile prefetches W

bool gemm_f32_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_gemm_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_gemm_f32: weight must be float32 [n, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), K = w.size(1), P = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        float* col = dst + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
    }
  });
  return packed;
}

#if defined(__AVX512F__)
// y[0:R, 0:48) of one panel (columns past `cols` are not stored); x and y rows are
// `ldx` and `ldy` apart.
template <int64_t R>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
          const float* bias, int64_t cols, float* __restrict y, int64_t ldy, bool prefetch) {
  __m512 acc[R][3];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    if (prefetch && k + kPrefetchRows < K) {
      const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * kPanel);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16),
                 w2 = _mm512_loadu_ps(w + 32);
    for (int64_t i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(a, w2, acc[i][2]);
    }
  }
  for (int64_t j = 0; j < 3; ++j) {
    const int64_t left = cols - j * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
    for (int64_t i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + j * 16, mask, _mm512_add_ps(acc[i][j], b));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, float*,
                        int64_t, bool);
constexpr TileFn kTiles[kRows + 1] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,
                                      tile<5>,  tile<6>, tile<7>, tile<8>};
#endif

at::Tensor gemm_f32(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(gemm_f32_supported(), "gemm_f32: built without AVX-512");
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == at::kFloat,
              "gemm_f32: input must be float32 [..., K]");
  const int64_t K = input.size(-1);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(1) == K &&
                  (n + kPanel - 1) / kPanel == packed.size(0),
              "gemm_f32: packed weight must come from pack_gemm_f32 for ", n, " outputs and K = ",
              K);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "gemm_f32: bias must be float32 [n]");
  at::Tensor x = input.reshape({-1, K});
  if (x.stride(1) != 1 || (x.size(0) > 1 && x.stride(0) < K)) x = x.contiguous();
  const int64_t M = x.size(0), P = packed.size(0), ldx = x.stride(0);
  std::vector<int64_t> out_sizes = input.sizes().vec();
  out_sizes.back() = n;
  at::Tensor y = at::empty(out_sizes, x.options());
  if (M == 0 || n == 0) return y;
#if defined(__AVX512F__)
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
      const float* panel = wp + p * K * kPanel;
      for (int64_t m = 0; m < M; m += kRows) {
        // the first tile brings the panel in from memory; the others find it in cache
        kTiles[std::min(kRows, M - m)](xp + m * ldx, ldx, panel, K, bp == nullptr ? nullptr : bp + col0,
                                        cols, yp + m * n + col0, n, m == 0);
      }
    }
  });
#endif
  return y;
}

}  // namespace
}  // namespace shardserve_cpu

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("gemm_f32_vectorized() -> bool", &shardserve_cpu::gemm_f32_supported);
  m.def("pack_gemm_f32(Tensor weight) -> Tensor");
  m.def("gemm_f32(Tensor input, Tensor packed, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) {
  m.impl("pack_gemm_f32", &shardserve_cpu::pack_gemm_f32);
  m.impl("gemm_f32", &shardserve_cpu::gemm_f32);
}

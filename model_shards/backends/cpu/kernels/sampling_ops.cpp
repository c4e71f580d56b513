// The random draw of sampling: torch.ops.shardserve_cpu.exponential_race.
//
// Row r of probs [S, V] (float32, any positive sum) draws token
//   argmin_i  E_i / p_i,   E_i = -log(u_i),   u_i = uniform(seeds[r], i) in (0, 1)
// which picks i with probability p_i / sum p (the exponential race, i.e. Gumbel-max, the
// draw torch.multinomial makes for one sample). u_i comes from a counter-based hash, the
// splitmix64 finalizer of seeds[r] + (i + 1) * golden, so the draw is a pure function of
// (seed, probs): the same on every batch composition, and a tiny change in p moves the
// winner only near a tie (an inverse-CDF draw would instead move with the summed error
// of every earlier token). The same draw in PyTorch ops: exponential_race in
// model_shards/backends/reference.py; the hash, splitmix64: model_shards/splitmix.py.
//
// Speed: the uniforms are hashed block by block in a vectorizable loop; a token whose
// (1 - u_i) / p_i already exceeds the best ratio cannot win (E_i >= 1 - u_i), so its
// logarithm is skipped, and only a handful of tokens per row take one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int64_t kBlock = 512;

inline double uniform_open(uint64_t seed, uint64_t counter) {
  uint64_t z = seed + counter * kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<double>(z >> 11) + 0.5) * 0x1p-53;  // 53 bits, never 0 or 1
}

int64_t race_row(const float* p, int64_t V, uint64_t seed) {
  double best = std::numeric_limits<double>::infinity();
  int64_t winner = 0;  // a row without positive mass (NaN, all zero) answers 0
  alignas(64) double u[kBlock];
  for (int64_t i0 = 0; i0 < V; i0 += kBlock) {
    const int64_t n = std::min(kBlock, V - i0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) u[j] = uniform_open(seed, static_cast<uint64_t>(i0 + j + 1));
    for (int64_t j = 0; j < n; ++j) {
      const double pj = p[i0 + j];
      // !(pj > 0) also skips NaN; the margin keeps a rounding of log from being skipped.
      if (!(pj > 0.0) || (1.0 - u[j]) > best * pj * (1.0 + 1e-12)) continue;
      const double ratio = -std::log(u[j]) / pj;
      if (ratio < best) {
        best = ratio;
        winner = i0 + j;
      }
    }
  }
  return winner;
}

at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& seeds) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1,
              "exponential_race: probs must be float32 [S, V] with unit column stride");
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == at::kLong && seeds.is_contiguous() &&
                  seeds.size(0) == probs.size(0),
              "exponential_race: seeds must be int64 [S]");
  at::Tensor out = at::empty({probs.size(0)}, seeds.options());
  const float* p = probs.data_ptr<float>();
  const int64_t* s = seeds.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t V = probs.size(1), stride = probs.stride(0);
  at::parallel_for(0, probs.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = race_row(p + r * stride, V, static_cast<uint64_t>(s[r]));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("exponential_race(Tensor probs, Tensor seeds) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) { m.impl("exponential_race", &exponential_race); }

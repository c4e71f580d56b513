// Paged prefill attention, torch.ops.shardserve_cpu.prefill_attention (float32 and bfloat16):
// causal attention of every prefill chunk of a step, read straight from the paged pool.
//
// Chunk n is the packed query rows q_starts[n] .. q_starts[n] + q_lens[n] - 1; its query i sits
// at position start_positions[n] + i and attends to positions 0 .. start_positions[n] + i of
// its sequence (only the last `window` of them when window > 0) through block_tables[n].
// Query head h reads KV head h / (nh / nkv). Soft-capped scores are not served here (the
// backend falls back to the reference path).
//
// Work is split into tasks of (chunk, row tile of kRows queries, head); the tasks are dealt
// to the threads round-robin (so causal rows of growing cost spread evenly). Each task runs
// on one thread in a fixed order whatever the thread count, so the output never depends on
// it. Arithmetic is float32; 16-bit inputs are widened on load (or multiplied exactly by
// vdpbf16ps) and the output rounded once on store.
//
// Kernels: with AVX-512 (float32) or AVX-512 BF16 (bfloat16) and a compiled-in head dim (as
// decode attention's: 48, 64, 80, 96, 128, 256), the online-softmax kernel of
// prefill_attention_avx512.cpp; otherwise (or vectorized=False) the portable two-pass kernel
// here, one query row at a time. Shared definitions: prefill_attention.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernel_common.h"
#include "prefill_attention.h"

namespace {

using namespace shardserve_cpu::prefill;  // PrefillArgs, Task, kRows, first_key, ...
using shardserve_cpu::exp_f;
using shardserve_cpu::from_f;
using shardserve_cpu::to_f;

// Tasks in the order (chunk, row tile, head).
std::vector<Task> make_tasks(const int64_t* q_lens, int64_t num_chunks, int64_t nh) {
  std::vector<Task> tasks;
  for (int64_t n = 0; n < num_chunks; ++n)
    for (int64_t r0 = 0; r0 < q_lens[n]; r0 += kRows)
      for (int64_t h = 0; h < nh; ++h) tasks.push_back({n, h, r0, std::min(r0 + kRows, q_lens[n])});
  return tasks;
}

// ---- portable kernel: two passes per query row ---------------------------------------------
// Scores of the row's visible keys into s, their max, e^(s - max) and its sum, then the
// weighted sum of V rows; D at run time.
template <typename T>
void portable_task(const PrefillArgs<T>& a, const Task& t, std::vector<float>& s,
                   std::vector<float>& acc) {
  const int64_t D = a.D, start = a.starts[t.n], bs = a.block_size;
  const int64_t* table = a.tables + t.n * a.max_blocks;
  const int64_t kv = (t.h / a.group) * D;
  for (int64_t r = t.r0; r < t.r1; ++r) {
    const int64_t p = start + r, first = first_key(p, a.window), n = p + 1 - first;
    const T* qr = a.q + (a.q_starts[t.n] + r) * a.q_stride + t.h * D;
    s.resize(n);
    float max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = a.k + slot_of(table, first + j, bs) * a.slot_stride + kv;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += to_f(qr[d]) * to_f(kr[d]);
      s[j] = dot * a.scale;
      max = std::max(max, s[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += s[j] = exp_f(s[j] - max);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = a.v + slot_of(table, first + j, bs) * a.slot_stride + kv;
      const float w = s[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w * to_f(vr[d]);
    }
    T* o = a.out + (a.q_starts[t.n] + r) * a.out_stride + t.h * D;
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) o[d] = from_f<T>(acc[d] * inv);
  }
}

template <typename T>
void run_portable(const PrefillArgs<T>& a, const std::vector<Task>& tasks) {
  for_each_task(tasks, [&](const Task& t) {
    thread_local std::vector<float> s, acc;
    acc.resize(a.D);
    portable_task(a, t, s, acc);
  });
}

// ---- vectorized kernel: online softmax, 16 keys a step -------------------------------------
// The vectorized kernel where it applies (vectorized, the CPU's instructions, the head dim),
// else the portable one.
template <typename T>
void run(const PrefillArgs<T>& a, const std::vector<Task>& tasks, bool vectorized) {
  if (!(vectorized && run_avx512(a, tasks))) run_portable(a, tasks);
}

// Shapes, dtypes and strides of the operands; every index the kernels read through.
void check_operands(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& out, const at::Tensor& tables, const at::Tensor& q_starts,
                    const at::Tensor& q_lens, const at::Tensor& starts, int64_t block_size,
                    int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && out.sizes() == q.sizes(),
              "prefill_attention: q, out [T, nh, D] and pools [slots, nkv, D]");
  const int64_t D = q.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "prefill_attention: float32 or bfloat16 only");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "prefill_attention: q, pools and out must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D,
              "prefill_attention: each row of q and out must hold its heads contiguously");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes() &&
                  k_pool.size(2) == D,
              "prefill_attention: contiguous pools [slots, nkv, D] of q's head dim");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "prefill_attention: heads not a multiple of kv heads");
  TORCH_CHECK(block_size > 0 && k_pool.size(0) % block_size == 0,
              "prefill_attention: pools must hold whole blocks of block_size slots");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0 (0: none)");
  for (const at::Tensor* x : {&tables, &q_starts, &q_lens, &starts})
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous(),
                "prefill_attention: indices must be contiguous int64");
  const int64_t N = q_lens.numel(), max_blocks = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == N && q_starts.numel() == N &&
                  starts.numel() == N,
              "prefill_attention: one block table, row start and position start per chunk");
  const int64_t *rs = q_starts.data_ptr<int64_t>(), *ls = q_lens.data_ptr<int64_t>();
  const int64_t* ps = starts.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(ls[n] >= 0 && rs[n] >= 0 && rs[n] + ls[n] <= q.size(0),
                "prefill_attention: chunk ", n, " rows out of range");
    TORCH_CHECK(ps[n] >= 0 && ps[n] + ls[n] <= max_blocks * block_size,
                "prefill_attention: chunk ", n, " positions beyond its block table");
    if (ls[n] == 0) continue;
    const int64_t first = first_key(ps[n], window) / block_size;
    const int64_t end = (ps[n] + ls[n] - 1) / block_size + 1;  // the blocks read
    const int64_t* table = tables.data_ptr<int64_t>() + n * max_blocks;
    for (int64_t b = first; b < end; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < k_pool.size(0) / block_size,
                  "prefill_attention: block id out of range: ", table[b]);
  }
}

template <typename T>
PrefillArgs<T> make_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         at::Tensor& out, const at::Tensor& tables, const at::Tensor& q_starts,
                         const at::Tensor& q_lens, const at::Tensor& starts, int64_t block_size,
                         double scale, int64_t window) {
  const int64_t nh = q.size(1), nkv = k_pool.size(1), D = q.size(2);
  return {nh,
          D,
          nh / nkv,
          q.stride(0),
          out.stride(0),
          tables.size(1),
          nkv * D,
          block_size,
          window,
          static_cast<float>(scale),
          q.data_ptr<T>(),
          k_pool.data_ptr<T>(),
          v_pool.data_ptr<T>(),
          out.data_ptr<T>(),
          tables.data_ptr<int64_t>(),
          q_starts.data_ptr<int64_t>(),
          q_lens.data_ptr<int64_t>(),
          starts.data_ptr<int64_t>()};
}

// Writes the chunks' rows of out (others untouched). window > 0: a sliding window.
void prefill_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       at::Tensor& out, const at::Tensor& block_tables, const at::Tensor& q_starts,
                       const at::Tensor& q_lens, const at::Tensor& start_positions,
                       int64_t block_size, double scale, int64_t window, bool vectorized) {
  check_operands(q, k_pool, v_pool, out, block_tables, q_starts, q_lens, start_positions,
                 block_size, window);
  const std::vector<Task> tasks = make_tasks(q_lens.data_ptr<int64_t>(), q_lens.numel(), q.size(1));
  if (tasks.empty()) return;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    const auto a = make_args<T>(q, k_pool, v_pool, out, block_tables, q_starts, q_lens,
                                start_positions, block_size, scale, window);
    run(a, tasks, vectorized);
  };
  if (q.scalar_type() == at::kFloat)
    go(float{});
  else
    go(c10::BFloat16{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor(a!) out, "
        "Tensor block_tables, Tensor q_starts, Tensor q_lens, Tensor start_positions, "
        "int block_size, float scale, int window=0, bool vectorized=True) -> ()");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

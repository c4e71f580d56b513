// What the two prefill-attention sources share: the operands as raw pointers, the tasks the
// work is split into and how they are dealt to the threads, and the vectorized kernel's entry.
// prefill_attention.cpp holds the op (argument checks, the portable kernel),
// prefill_attention_avx512.cpp the vectorized kernel.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardserve_cpu::prefill {

constexpr int64_t kRows = 16;  // query rows of one task
constexpr int64_t kKeys = 16;  // keys of one step of the vectorized kernel (a zmm of scores)

// The operands as raw pointers. q, out: [T, nh, D] (row strides q_stride, out_stride, heads
// contiguous); k, v: pools [slots, nkv, D]; tables [N, max_blocks]; q_starts, q_lens,
// starts: [N]. The caller has checked shapes, dtypes, strides and indices.
template <typename T>
struct PrefillArgs {
  int64_t nh, D, group, q_stride, out_stride, max_blocks, slot_stride, block_size, window;
  float scale;
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* tables;
  const int64_t* q_starts;
  const int64_t* q_lens;
  const int64_t* starts;
};

// Query rows r0 .. r1 - 1 (chunk-relative) of chunk n, head h.
struct Task {
  int64_t n, h, r0, r1;
};

// The first position a query at position p sees.
inline int64_t first_key(int64_t p, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
}

// The pool slot of position t through one block table.
inline int64_t slot_of(const int64_t* table, int64_t t, int64_t block_size) {
  return table[t / block_size] * block_size + t % block_size;
}

// Runs body(task) for every task; thread t of nt takes tasks t, t + nt, t + 2 nt, ...
template <typename F>
void for_each_task(const std::vector<Task>& tasks, const F& body) {
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = t; i < count; i += nt) body(tasks[i]);
  });
}

// prefill_attention_avx512.cpp: runs the vectorized kernel over every task and returns true
// where it applies (AVX-512 (BF16) in this build, a compiled-in head dim), else false.
bool run_avx512(const PrefillArgs<float>& a, const std::vector<Task>& tasks);
bool run_avx512(const PrefillArgs<c10::BFloat16>& a, const std::vector<Task>& tasks);

}  // namespace shardserve_cpu::prefill

// What both kernel sources (cpu_ops.cpp, decode_attention_avx512.cpp) share.
//
// torch's JIT build re-builds when a listed source or a build flag changes, not a header:
// model_shards/kernels/__init__.py puts a hash of this file into the flags.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace shardserve_cpu {

// The operands of decode attention as raw pointers and sizes. q: [B, nh, D] (row stride
// q_stride); k, v: pools [slots, nkv, D]; tables: [B, max_blocks]; lens: [B]; out like q.
// The caller has checked shapes, dtypes and contiguity.
template <typename T>
struct DecodeAttentionArgs {
  int64_t B, nh, nkv, D, q_stride, group, max_blocks, slot_stride;
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* tables;
  const int64_t* lens;

  DecodeAttentionArgs(const at::Tensor& q_, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      at::Tensor& out_, int64_t head_dim)
      : B(q_.size(0)),
        nh(q_.size(1)),
        nkv(k_pool.size(1)),
        D(head_dim),
        q_stride(q_.stride(0)),
        group(nh / nkv),
        max_blocks(block_tables.size(1)),
        slot_stride(nkv * head_dim),
        q(q_.data_ptr<T>()),
        k(k_pool.data_ptr<T>()),
        v(v_pool.data_ptr<T>()),
        out(out_.data_ptr<T>()),
        tables(block_tables.data_ptr<int64_t>()),
        lens(context_lens.data_ptr<int64_t>()) {}
};

#if defined(__AVX512F__)
// 16 consecutive values widened to float32.
inline __m512 widen16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 widen16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

}  // namespace shardserve_cpu

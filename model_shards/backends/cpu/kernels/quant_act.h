// Rows of x → per-block int8 activations (quant_dot.h's quantize_row), row-parallel: the
// first step of quant_gemm.cpp's and quant_panels.cpp's ops.
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "kernel_common.h"
#include "quant_dot.h"

namespace shardserve_cpu::quant {

// x [M, K] (float32 or bfloat16) → M rows of K / |A::q| activation blocks, act_bytes per row.
template <typename X, typename A>
void quantize_rows(const X* x, int64_t M, int64_t K, uint8_t* act) {
  const int64_t row_bytes = K / static_cast<int64_t>(sizeof(A::q)) * sizeof(A);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(K);
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; ++k) buf[k] = to_f<X>(x[m * K + k]);
      quantize_row<A>(buf.data(), K, reinterpret_cast<A*>(act + m * row_bytes));
    }
  });
}

}  // namespace shardserve_cpu::quant

// The library's ops as C++ functions, for kernels that call other kernels without the
// dispatcher (decode_stack.cpp). Each is the function its source registers as
// torch.ops.shardserve_cpu.<name>: the same checks, the same bits.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace shardserve_cpu::ops {

// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps);
void rotary_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                      const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_and_mul(const at::Tensor& x);

// decode_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, bool vectorized, int64_t window,
                            double softcap);

// gemm.cpp, quant_gemm.cpp, quant_panels.cpp
at::Tensor gemm(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                const std::optional<at::Tensor>& bias);
at::Tensor quant_gemm(const at::Tensor& input, const at::Tensor& blocks, int64_t qtype,
                      const std::optional<at::Tensor>& bias, bool vectorized);
at::Tensor quant_gemm_panels(const at::Tensor& input, const at::Tensor& panels, int64_t qtype,
                             const std::optional<at::Tensor>& bias);

}  // namespace shardserve_cpu::ops

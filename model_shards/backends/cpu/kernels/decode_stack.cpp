// A decode step through a plain pre-norm decoder stack in one call:
// torch.classes.shardserve_cpu.DecodeStack (built by backends/cpu/decode_stack.py).
//
// Per layer, the ops models/stack.py's DecoderLayer calls one by one from Python, in the same
// order on the same tensors, so the result has the same bits:
//
//   h, residual = rms_norm(x, residual)            (layer 0: residual = x)
//   qkv = h Wqkv^T (+ b)                           [T, (nh + 2 nkv) D]
//   q, k RMS-normalized per head, in place         (Qwen3's q_norm / k_norm, when given)
//   q = rope(q), k = rope(k); k, v -> the layer's paged pools at slot_mapping
//   o = decode_attention(q, pools) Wo^T (+ b)      [T, H]
//   h, residual = rms_norm(o, residual)
//   x = silu_and_mul(h Wgu^T) Wdown^T (+ b)        [T, H]
//
// and returns x + residual. What it saves is the Python between the kernels: ~45 op calls a
// layer through modules, the backend and the dispatcher, ~60 us a layer on the 2-core Xeon,
// a quarter of a 135M-parameter model's decode step at batch 1. Every step is a decode (one
// token a sequence) of one KV group, tensor parallel 1: the Python side checks, and takes the
// module path otherwise.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace shardserve_cpu {
namespace {

// How a segment's rows multiply (backends/cpu/decode_stack.py names them the same).
enum SegmentKind : int64_t { kPanels = 0, kBlocks = 1, kPacked = 2, kDense = 3 };

// Output features [start, end) of a linear layer: GGML blocks (panels or not, qtype), a
// packed GEMM's panels, or a dense [rows, in] weight.
struct Segment {
  at::Tensor data;
  int64_t kind, qtype, start, end;
};

at::Tensor run_segment(const Segment& s, const at::Tensor& x, const std::optional<at::Tensor>& b) {
  switch (s.kind) {
    case kPanels: return ops::quant_gemm_panels(x, s.data, s.qtype, b);
    case kBlocks: return ops::quant_gemm(x, s.data, s.qtype, b, true);
    case kPacked: return ops::gemm(x, s.data, s.end - s.start, b);
    default: return at::linear(x, s.data, b);
  }
}

// One linear layer: x [T, in] -> [T, out]. ``bias`` goes into the GEMM (column-parallel
// layers); ``bias_after`` is added to its result (row-parallel ones add it after the
// all-reduce).
struct Linear {
  std::vector<Segment> segments;
  int64_t out = 0;
  std::optional<at::Tensor> bias, bias_after;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (segments.size() == 1 && segments[0].start == 0 && segments[0].end == out) {
      y = run_segment(segments[0], x, bias);
    } else {  // backend.py quantized_linear: zeros, each segment into its columns
      y = at::zeros({x.size(0), out}, x.options());
      for (const Segment& s : segments) {
        std::optional<at::Tensor> b;
        if (bias.has_value()) b = bias->slice(0, s.start, s.end).contiguous();
        y.slice(1, s.start, s.end).copy_(run_segment(s, x, b));
      }
    }
    return bias_after.has_value() ? y + *bias_after : y;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // [H] each
  std::optional<at::Tensor> q_norm, k_norm;  // [D] each, per head
  Linear qkv, o, gate_up, down;
};

// part [T, heads * D] (a view into qkv) normalized per head in place, as RotaryAttention does:
// rows [T * heads, D] (a copy), then copied back.
void norm_heads(at::Tensor part, const at::Tensor& weight, double eps, int64_t D) {
  at::Tensor y = ops::rms_norm(part.reshape({-1, D}), std::nullopt, weight, eps);
  part.copy_(y.view(part.sizes()));
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double scale)
      : eps_(eps), nh_(num_heads), nkv_(num_kv_heads), d_(head_dim), scale_(scale) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeStack: q_norm with k_norm");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm),
                            std::move(k_norm), {}, {}, {}, {}});
  }

  // Linear ``which`` (0 qkv, 1 o, 2 gate_up, 3 down) of the last layer added.
  void add_segment(int64_t which, at::Tensor data, int64_t kind, int64_t qtype, int64_t start,
                   int64_t end, int64_t out) {
    Linear& l = linear(which);
    TORCH_CHECK(kind >= kPanels && kind <= kDense, "DecodeStack: segment kind ", kind);
    l.segments.push_back(Segment{std::move(data), kind, qtype, start, end});
    l.out = out;
  }

  void set_bias(int64_t which, at::Tensor bias, bool after) {
    (after ? linear(which).bias_after : linear(which).bias) = std::move(bias);
  }

  // x [T, H] (the embeddings, updated in place as the residual stream, as the module path
  // does); positions, slot_mapping, context_lens [T] int64; cos, sin [P, D] float32;
  // block_tables [T, nblk]; k_pools, v_pools: each layer's [slots, nkv, D].
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor context_lens,
                     int64_t block_size, std::vector<at::Tensor> k_pools,
                     std::vector<at::Tensor> v_pools) {
    TORCH_CHECK(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(),
                "DecodeStack: one K and one V pool per layer");
    const int64_t T = x.size(0);
    std::optional<at::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor h = ops::rms_norm(x, residual, l.input_norm, eps_);
      if (!residual.has_value()) residual = x;
      at::Tensor qkv = l.qkv(h).contiguous();
      if (l.q_norm.has_value()) {
        norm_heads(qkv.slice(1, 0, nh_ * d_), *l.q_norm, eps_, d_);
        norm_heads(qkv.slice(1, nh_ * d_, (nh_ + nkv_) * d_), *l.k_norm, eps_, d_);
      }
      ops::rotary_and_cache(qkv, positions, cos, sin, k_pools[i], v_pools[i], slot_mapping, nh_,
                            nkv_);
      at::Tensor q = qkv.view({T, -1, d_}).slice(1, 0, nh_);  // [T, nh, D], rotated in place
      at::Tensor o = ops::decode_attention(q, k_pools[i], v_pools[i], block_tables, context_lens,
                                           block_size, scale_, true, 0, 0.0);
      h = ops::rms_norm(l.o(o.reshape({T, nh_ * d_})), residual, l.post_norm, eps_);
      x = l.down(ops::silu_and_mul(l.gate_up(h)));
    }
    return residual.has_value() ? x + *residual : x;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  Linear& linear(int64_t which) {
    TORCH_CHECK(!layers_.empty() && which >= 0 && which < 4, "DecodeStack: linear ", which);
    Layer& l = layers_.back();
    Linear* all[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    return *all[which];
  }

  double eps_;
  int64_t nh_, nkv_, d_;
  double scale_;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace shardserve_cpu

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  using shardserve_cpu::DecodeStack;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<double, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_segment", &DecodeStack::add_segment)
      .def("set_bias", &DecodeStack::set_bias)
      .def("forward", &DecodeStack::forward)
      .def("num_layers", &DecodeStack::num_layers);
}

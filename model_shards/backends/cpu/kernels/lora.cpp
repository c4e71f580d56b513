// Multi-LoRA on CPU: torch.ops.shardserve_cpu.lora_add (float32 and bfloat16).
//
//   y [T, out] += (x [T, in] a_s^T) b_s^T,   s = row_slots[t] (rows with s < 0: untouched)
//
// a [S, R, in], b [S, out, R]: every slot's adapter (layers/lora.py). The reference backend's
// GEMMs per slot, its rows gathered once for all slots (slot by slot) and their products added
// back once, in one call a linear layer: from Python they were ~60 us an adapter a layer,
// ~30 ms of an 80 ms step with four adapters over seven linears and 30 layers. (A per-row loop
// of float32 dot products was no faster: its expand reduces across lanes for every output.)

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

// Rows of each slot in use, slots in ascending order (the reference's order).
std::vector<std::pair<int64_t, std::vector<int64_t>>> slot_rows(const int64_t* slots,
                                                               int64_t rows) {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> groups;
  for (int64_t t = 0; t < rows; ++t) {
    if (slots[t] < 0) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == slots[t]; });
    if (it == groups.end()) groups.push_back({slots[t], {t}});
    else it->second.push_back(t);
  }
  std::sort(groups.begin(), groups.end(),
            [](const auto& l, const auto& r) { return l.first < r.first; });
  return groups;
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& row_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.is_contiguous() && y.is_contiguous() &&
                  x.size(0) == y.size(0),
              "lora_add: x [T, in] and y [T, out] must be contiguous");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() &&
                  a.size(0) == b.size(0) && a.size(1) == b.size(2) && a.size(2) == x.size(1) &&
                  b.size(1) == y.size(1),
              "lora_add: a must be [S, R, in] and b [S, out, R], contiguous");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type() &&
                  y.scalar_type() == x.scalar_type(),
              "lora_add: x, y, a and b must share a dtype");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() &&
                  row_slots.numel() >= x.size(0),
              "lora_add: row_slots must be contiguous int64 [>= T]");
  const int64_t rows = x.size(0);
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slots[t] < a.size(0), "lora_add: row ", t, " names slot ", slots[t], " of ",
                a.size(0));
  const auto groups = slot_rows(slots, rows);
  if (groups.empty()) return;
  std::vector<int64_t> order;  // the adapter rows, slot by slot
  for (const auto& group : groups)
    order.insert(order.end(), group.second.begin(), group.second.end());
  at::Tensor index = at::tensor(order, row_slots.options());
  at::Tensor xs = x.index_select(0, index);                           // [N, in], slot by slot
  at::Tensor delta = at::empty({xs.size(0), y.size(1)}, y.options());  // [N, out]
  int64_t start = 0;
  for (const auto& [slot, members] : groups) {
    const int64_t n = static_cast<int64_t>(members.size());
    at::Tensor shrunk = at::mm(xs.narrow(0, start, n), a[slot].t());  // [n, R]
    at::Tensor out = delta.narrow(0, start, n);
    at::mm_out(out, shrunk, b[slot].t());  // [n, out]
    start += n;
  }
  y.index_add_(0, index, delta);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slots) -> ()");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) { m.impl("lora_add", &lora_add); }

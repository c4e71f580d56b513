// Multi-LoRA on CPU: torch.ops.shardserve_cpu.lora_add (float32 and bfloat16).
//
//   y [T, out] += (x [T, in] a_s^T) b_s^T,   s = row_slots[t] (rows with s < 0: untouched)
//
// a [S, R, in]; bt [S, R, out], b transposed (layers/lora.py holds b so on this backend);
// cols [S, R, 2] (or empty: every column): b[s]'s rank r is zero outside output columns
// cols[s, r, 0] <= o < cols[s, r, 1], so a fused layer's block-diagonal b (each part's ranks
// feed only its outputs) and ranks below the maximum (empty spans) are skipped, never read.
//
// A task is a block of one slot's rows and a range of output columns; threads split tasks.
// For each tile of up to kRows rows: the shrink v [rows, R] = x a_s^T (each value one float32
// sum over in, rounded to the dtype), then the expand: per tile of 32 output columns, the
// float32 sums of v[t, r] bt[s, r, cols] over the ranks whose span meets the tile, added to y
// and rounded once. x's rows are read in place (no gather), each byte of a_s and bt_s once per
// row tile: at a decode step of 32 rows over four adapters this is bound by reading the
// adapters from memory (~0.65 MB a layer in float32; ATen GEMMs per slot cost ~20 us a call
// over that), so the shrink prefetches the next pair of a's rows as it goes (the hardware's
// prefetch stops at each 4 KiB page, about two rows of a) and, into L2, the lines of bt that
// the expand reads next, so that memory streams while it computes. A row's result depends on
// that row only (a skipped rank adds exact zeros), never on the batch or the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernel_common.h"

namespace shardserve_cpu {
namespace {

constexpr int64_t kRows = 8;       // rows of a register tile
constexpr int64_t kCols = 32;      // output columns of an expand tile: two zmm
constexpr int64_t kChunk = 64;     // rows of a task at most (prefill splits into tasks)
constexpr int64_t kMinCols = 256;  // output columns of a task at least, when columns split
constexpr int kLines = 2;          // lines of bt prefetched per step of the shrink

template <typename T>
struct LoraOperands {
  const T* x;
  T* y;
  const T* a;
  const T* bt;
  int64_t in, out, rank, x_stride, y_stride;
};

// A task: rows rows[begin, end) of slot `slot`, output columns [c0, c1).
struct Task {
  int64_t slot, begin, end, c0, c1;
};

// A rank of a task's slot with its nonzero columns, clipped to the task's.
struct Span {
  int64_t r, lo, hi;
};

// Walks the lines of bt that an expand will read (each span's columns, rank by rank), so that
// the shrink before it can prefetch them a few at a time.
template <typename T>
struct LineCursor {
  const T* bt_s;
  const std::vector<Span>& spans;
  int64_t out, span = 0, col = 0;

  const char* next() {
    while (span < static_cast<int64_t>(spans.size())) {
      const Span& sp = spans[span];
      const int64_t c = std::max(col, sp.lo);
      if (c < sp.hi) {
        col = c + 64 / static_cast<int64_t>(sizeof(T));
        return reinterpret_cast<const char*>(bt_s + sp.r * out + c);
      }
      ++span, col = 0;
    }
    return nullptr;
  }
};

// The ranks of slot `slot` whose columns meet [c0, c1), in rank order.
std::vector<Span> spans_of(const int64_t* cols, int64_t slot, int64_t rank, int64_t out,
                           int64_t c0, int64_t c1) {
  std::vector<Span> spans;
  for (int64_t r = 0; r < rank; ++r) {
    const int64_t lo = cols ? std::max(c0, cols[(slot * rank + r) * 2]) : c0;
    const int64_t hi = cols ? std::min(c1, cols[(slot * rank + r) * 2 + 1]) : c1;
    if (lo < hi) spans.push_back({r, lo, std::min(hi, out)});
  }
  return spans;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// v[j][r] = x[rows[j]] . a_s[r] (rounded to T) for every span's r, two ranks at a time.
template <typename T, int NB>
void shrink(const LoraOperands<T>& o, const T* a_s, const int64_t* rows,
            const std::vector<Span>& spans, float* v, LineCursor<T>& lines) {
  const T* xr[NB];
  for (int j = 0; j < NB; ++j) xr[j] = o.x + rows[j] * o.x_stride;
  const int64_t full = o.in / 16 * 16;
  const __mmask16 m = tail_mask(o.in - full);
  for (size_t i = 0; i < spans.size(); i += 2) {
    const int64_t r0 = spans[i].r, r1 = i + 1 < spans.size() ? spans[i + 1].r : r0;
    const T* a0 = a_s + r0 * o.in;
    const T* a1 = a_s + r1 * o.in;
    __m512 s0[NB], s1[NB];
    for (int j = 0; j < NB; ++j) s0[j] = s1[j] = _mm512_setzero_ps();
    const char* next = reinterpret_cast<const char*>(a1 + o.in);  // the next pair's rows
    auto step = [&](int64_t k, auto load) {
      _mm_prefetch(next + 2 * k * sizeof(T), _MM_HINT_T0);
      _mm_prefetch(next + 2 * k * sizeof(T) + 64, _MM_HINT_T0);
      for (int l = 0; l < kLines; ++l)
        if (const char* line = lines.next()) _mm_prefetch(line, _MM_HINT_T1);
      const __m512 va0 = load(a0 + k), va1 = load(a1 + k);
      for (int j = 0; j < NB; ++j) {
        const __m512 vx = load(xr[j] + k);
        s0[j] = _mm512_fmadd_ps(vx, va0, s0[j]);
        s1[j] = _mm512_fmadd_ps(vx, va1, s1[j]);
      }
    };
    for (int64_t k = 0; k < full; k += 16) step(k, [](const T* p) { return widen16(p); });
    if (full < o.in) step(full, [m](const T* p) { return widen16(p, m); });
    for (int j = 0; j < NB; ++j) {
      v[j * o.rank + r0] = round_to<T>(_mm512_reduce_add_ps(s0[j]));
      v[j * o.rank + r1] = round_to<T>(_mm512_reduce_add_ps(s1[j]));
    }
  }
}

// y[rows[j], c0:c1] += sum over spans of v[j][r] bt_s[r] (their columns in c0:c1), one rounding.
template <typename T, int NB>
void expand(const LoraOperands<T>& o, const T* bt_s, const int64_t* rows,
            const std::vector<Span>& spans, const float* v, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += kCols) {
    const int64_t n = std::min(kCols, c1 - c);
    const __mmask16 m0 = tail_mask(std::min<int64_t>(n, 16));
    const __mmask16 m1 = tail_mask(std::max<int64_t>(n - 16, 0));
    __m512 d0[NB], d1[NB];
    for (int j = 0; j < NB; ++j) d0[j] = d1[j] = _mm512_setzero_ps();
    for (const Span& sp : spans) {
      if (sp.hi <= c || sp.lo >= c + n) continue;
      const T* b = bt_s + sp.r * o.out + c;
      const __m512 vb0 = widen16(b, m0), vb1 = widen16(b + 16, m1);
      for (int j = 0; j < NB; ++j) {
        const __m512 vs = _mm512_set1_ps(v[j * o.rank + sp.r]);
        d0[j] = _mm512_fmadd_ps(vs, vb0, d0[j]);
        d1[j] = _mm512_fmadd_ps(vs, vb1, d1[j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      T* yr = o.y + rows[j] * o.y_stride + c;
      store16(yr, m0, _mm512_add_ps(widen16(yr, m0), d0[j]));
      store16(yr + 16, m1, _mm512_add_ps(widen16(yr + 16, m1), d1[j]));
    }
  }
}

#else  // portable loops (GCC vectorizes the inner ones), the same sums in the same order

template <typename T, int NB>
void shrink(const LoraOperands<T>& o, const T* a_s, const int64_t* rows,
            const std::vector<Span>& spans, float* v, LineCursor<T>&) {
  for (const Span& sp : spans) {
    const T* a = a_s + sp.r * o.in;
    for (int j = 0; j < NB; ++j) {
      const T* x = o.x + rows[j] * o.x_stride;
      float s = 0.f;
      for (int64_t k = 0; k < o.in; ++k) s += to_f(x[k]) * to_f(a[k]);
      v[j * o.rank + sp.r] = round_to<T>(s);
    }
  }
}

template <typename T, int NB>
void expand(const LoraOperands<T>& o, const T* bt_s, const int64_t* rows,
            const std::vector<Span>& spans, const float* v, int64_t c0, int64_t c1) {
  std::vector<float> d(static_cast<size_t>(c1 - c0));
  for (int j = 0; j < NB; ++j) {
    std::fill(d.begin(), d.end(), 0.f);
    for (const Span& sp : spans) {
      const T* b = bt_s + sp.r * o.out;
      const float s = v[j * o.rank + sp.r];
      for (int64_t c = sp.lo; c < sp.hi; ++c) d[c - c0] += s * to_f(b[c]);
    }
    T* y = o.y + rows[j] * o.y_stride;
    for (int64_t c = c0; c < c1; ++c) y[c] = from_f<T>(to_f(y[c]) + d[c - c0]);
  }
}

#endif

// One tile of NB rows of a task: its shrink, then its expand.
template <typename T, int NB>
void tile(const LoraOperands<T>& o, const Task& task, const int64_t* rows,
          const std::vector<Span>& spans, float* v) {
  const T* bt_s = o.bt + task.slot * o.rank * o.out;
  LineCursor<T> lines{bt_s, spans, o.out};
  shrink<T, NB>(o, o.a + task.slot * o.rank * o.in, rows, spans, v, lines);
  expand<T, NB>(o, bt_s, rows, spans, v, task.c0, task.c1);
}

template <typename T>
void run_task(const LoraOperands<T>& o, const Task& task, const int64_t* order,
              const int64_t* cols) {
  const auto spans = spans_of(cols, task.slot, o.rank, o.out, task.c0, task.c1);
  if (spans.empty()) return;
  std::vector<float> v(static_cast<size_t>(kRows * o.rank));
  for (int64_t t = task.begin; t < task.end; t += kRows) {
    const int64_t* rows = order + t;
    switch (std::min(kRows, task.end - t)) {
      case 1: tile<T, 1>(o, task, rows, spans, v.data()); break;
      case 2: tile<T, 2>(o, task, rows, spans, v.data()); break;
      case 3: tile<T, 3>(o, task, rows, spans, v.data()); break;
      case 4: tile<T, 4>(o, task, rows, spans, v.data()); break;
      case 5: tile<T, 5>(o, task, rows, spans, v.data()); break;
      case 6: tile<T, 6>(o, task, rows, spans, v.data()); break;
      case 7: tile<T, 7>(o, task, rows, spans, v.data()); break;
      default: tile<T, 8>(o, task, rows, spans, v.data()); break;
    }
  }
}

// The adapter rows slot by slot (slots ascending) into `order`; tasks of at most kChunk rows,
// each over column ranges of at least kMinCols so that every thread has a task.
std::vector<Task> plan_tasks(const int64_t* slots, int64_t rows, int64_t num_slots,
                             int64_t out, std::vector<int64_t>& order) {
  std::vector<std::vector<int64_t>> members(static_cast<size_t>(num_slots));
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) members[slots[t]].push_back(t);
  std::vector<Task> blocks;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t begin = static_cast<int64_t>(order.size());
    order.insert(order.end(), members[s].begin(), members[s].end());
    for (int64_t t = begin; t < static_cast<int64_t>(order.size()); t += kChunk)
      blocks.push_back({s, t, std::min<int64_t>(t + kChunk, order.size()), 0, out});
  }
  const int64_t threads = at::get_num_threads(), n = static_cast<int64_t>(blocks.size());
  const int64_t want = n == 0 ? 1 : (threads + n - 1) / n;
  const int64_t pieces = std::max<int64_t>(1, std::min(want, out / kMinCols));
  if (pieces == 1) return blocks;
  const int64_t width = (out / pieces + kCols - 1) / kCols * kCols;  // whole expand tiles
  std::vector<Task> tasks;
  for (const Task& b : blocks)
    for (int64_t c = 0; c < out; c += width)
      tasks.push_back({b.slot, b.begin, b.end, c, std::min(c + width, out)});
  return tasks;
}

void check_operands(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& bt, const at::Tensor& cols, const at::Tensor& row_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 &&
                  x.size(0) == y.size(0),
              "lora_add: x [T, in] and y [T, out] must have unit column strides");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1) && a.size(2) == x.size(1) &&
                  bt.size(2) == y.size(1),
              "lora_add: a must be [S, R, in] and bt [S, R, out], contiguous");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && bt.scalar_type() == x.scalar_type() &&
                  y.scalar_type() == x.scalar_type(),
              "lora_add: x, y, a and bt must share a dtype");
  TORCH_CHECK(cols.numel() == 0 || (cols.scalar_type() == at::kLong && cols.is_contiguous() &&
                                    cols.numel() == a.size(0) * a.size(1) * 2),
              "lora_add: cols must be contiguous int64 [S, R, 2] or empty");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() &&
                  row_slots.numel() >= x.size(0),
              "lora_add: row_slots must be contiguous int64 [>= T]");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(slots[t] < a.size(0), "lora_add: row ", t, " names slot ", slots[t], " of ",
                a.size(0));
}

template <typename T>
void lora_add_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& bt, const at::Tensor& cols, const at::Tensor& row_slots) {
  const LoraOperands<T> o{x.data_ptr<T>(), y.data_ptr<T>(),  a.data_ptr<T>(), bt.data_ptr<T>(),
                          x.size(1),       y.size(1),        a.size(1),       x.stride(0),
                          y.stride(0)};
  std::vector<int64_t> order;
  const auto tasks =
      plan_tasks(row_slots.data_ptr<int64_t>(), x.size(0), a.size(0), o.out, order);
  const int64_t* spans = cols.numel() ? cols.data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) run_task(o, tasks[i], order.data(), spans);
  });
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& cols, const at::Tensor& row_slots) {
  check_operands(y, x, a, bt, cols, row_slots);
  if (x.scalar_type() == at::kBFloat16)
    lora_add_typed<c10::BFloat16>(y, x, a, bt, cols, row_slots);
  else if (x.scalar_type() == at::kFloat)
    lora_add_typed<float>(y, x, a, bt, cols, row_slots);
  else
    TORCH_CHECK(false, "lora_add: float32 or bfloat16, not ", x.scalar_type());
}

}  // namespace
}  // namespace shardserve_cpu

TORCH_LIBRARY_FRAGMENT(shardserve_cpu, m) {
  m.def(
      "lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor cols, Tensor row_slots) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(shardserve_cpu, CPU, m) { m.impl("lora_add", &shardserve_cpu::lora_add); }

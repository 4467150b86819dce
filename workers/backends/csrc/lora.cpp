// A LoRA adapter's delta on a projection's output: out += (x a_t) b_t, with x [M, K], a_t
// [K, R], b_t [R, N] and out [M, N] of one dtype (fp32 or bf16), all contiguous. With several
// adapters stacked along R, `offsets` [adapters + 1] bounds each one's columns and `rows` [M]
// names each row's adapter (-1: none): a row takes its adapter's columns alone; `mask`, where
// given, is lora_mask's [M, R] of them (a step's projections of one layout share it).
//
// For a few rows (decode) the two products are a few thousand multiply-adds a row: one loop
// over K into R fp32 sums, then one over R into N fp32 sums added to the row, costs less than
// dispatching the two matmuls torch would run. Past kLoraLoopRows rows the matmuls win, and
// it runs them (at::mm, then addmm_: the ops the Python path's Backend.lora_add runs), so the
// model's Python path and the layer stack give the same results for every row count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace tierserve {
namespace {

constexpr int64_t kLoraLoopRows = 8;

// Output columns a thread takes at least: below, the fork costs more than the work.
constexpr int64_t kLoraColumnGrain = 512;

// Each row's [first, last) columns of a_t / b_t: those of its adapter (offsets[j] ..
// offsets[j + 1] for adapter j = rows[m]; none where j < 0), or all of them without rows.
struct LoraColumns {
  const int64_t* offsets;
  const int64_t* rows;
  int64_t width;
  std::pair<int64_t, int64_t> of(int64_t m) const {
    if (rows == nullptr) return {0, width};
    const int64_t j = rows[m];
    return j < 0 ? std::pair<int64_t, int64_t>{0, 0}
                 : std::pair<int64_t, int64_t>{offsets[j], offsets[j + 1]};
  }
};

template <typename T>
void lora_rows(const T* x, const T* a_t, const T* b_t, T* out, int64_t rows, int64_t k_dim,
               int64_t r_dim, int64_t n_dim, const LoraColumns& columns) {
  std::vector<float> t(r_dim);
  for (int64_t m = 0; m < rows; ++m) {
    const auto [c0, c1] = columns.of(m);
    if (c0 >= c1) continue;
    std::fill(t.begin() + c0, t.begin() + c1, 0.0f);
    const T* xm = x + m * k_dim;
    for (int64_t k = 0; k < k_dim; ++k) {
      const float xk = static_cast<float>(xm[k]);
      const T* ak = a_t + k * r_dim;
      for (int64_t r = c0; r < c1; ++r) t[r] += xk * static_cast<float>(ak[r]);
    }
    if constexpr (!std::is_same_v<T, float>) {  // x a_t is a T temporary, as torch's mm gives
      for (int64_t r = c0; r < c1; ++r) t[r] = static_cast<float>(static_cast<T>(t[r]));
    }
    T* om = out + m * n_dim;
    at::parallel_for(0, n_dim, kLoraColumnGrain, [&](int64_t n0, int64_t n1) {
      std::vector<float> acc(n1 - n0, 0.0f);
      for (int64_t r = c0; r < c1; ++r) {
        const float tr = t[r];
        const T* br = b_t + r * n_dim + n0;
        for (int64_t n = 0; n < n1 - n0; ++n) acc[n] += tr * static_cast<float>(br[n]);
      }
      for (int64_t n = n0; n < n1; ++n)
        om[n] = static_cast<T>(static_cast<float>(om[n]) + acc[n - n0]);
    });
  }
}

// [M, W] of 1 where a row's adapter owns the column, else 0, in x's dtype.
at::Tensor lora_mask(const at::Tensor& x, int64_t width, const at::Tensor& offsets,
                     const at::Tensor& rows) {
  const at::Tensor adapter = rows.clamp_min(0);
  const at::Tensor lo = offsets.index_select(0, adapter).unsqueeze(1);
  const at::Tensor hi = offsets.index_select(0, adapter + 1).unsqueeze(1);
  const at::Tensor cols = at::arange(width, offsets.options()).unsqueeze(0);
  return ((cols >= lo) & (cols < hi) & (rows >= 0).unsqueeze(1)).to(x.scalar_type());
}

void lora_add_into(const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b_t,
                   const std::optional<at::Tensor>& offsets,
                   const std::optional<at::Tensor>& rows,
                   const std::optional<at::Tensor>& mask, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && a_t.dim() == 2 && b_t.dim() == 2 && out.dim() == 2 &&
                  x.size(1) == a_t.size(0) && a_t.size(1) == b_t.size(0) &&
                  b_t.size(1) == out.size(1) && x.size(0) == out.size(0),
              "lora_add: x [M, K], a_t [K, R], b_t [R, N], out [M, N]");
  TORCH_CHECK(x.scalar_type() == a_t.scalar_type() && x.scalar_type() == b_t.scalar_type() &&
                  x.scalar_type() == out.scalar_type(),
              "lora_add: one dtype for every tensor");
  TORCH_CHECK(offsets.has_value() == rows.has_value(),
              "lora_add: offsets and rows go together");
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == x.size(0) &&
                    rows->scalar_type() == at::kLong && offsets->scalar_type() == at::kLong &&
                    rows->is_contiguous() && offsets->is_contiguous(),
                "lora_add: rows [M] and offsets int64");
  }
  const int64_t rows_n = x.size(0);
  if (rows_n > kLoraLoopRows || !x.is_contiguous() || !out.is_contiguous() ||
      !a_t.is_contiguous() || !b_t.is_contiguous() ||
      (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16)) {
    at::Tensor xa = at::mm(x, a_t);
    if (rows.has_value())
      xa.mul_(mask.has_value() ? *mask : lora_mask(x, a_t.size(1), *offsets, *rows));
    out.addmm_(xa, b_t);
    return;
  }
  const int64_t k_dim = x.size(1), r_dim = a_t.size(1), n_dim = out.size(1);
  const LoraColumns columns{offsets.has_value() ? offsets->data_ptr<int64_t>() : nullptr,
                            rows.has_value() ? rows->data_ptr<int64_t>() : nullptr, r_dim};
  if (x.scalar_type() == at::kFloat) {
    lora_rows(x.data_ptr<float>(), a_t.data_ptr<float>(), b_t.data_ptr<float>(),
              out.data_ptr<float>(), rows_n, k_dim, r_dim, n_dim, columns);
  } else {
    lora_rows(x.data_ptr<at::BFloat16>(), a_t.data_ptr<at::BFloat16>(),
              b_t.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows_n, k_dim, r_dim,
              n_dim, columns);
  }
}

void lora_add(const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b_t,
              const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& rows,
              const std::optional<at::Tensor>& mask, at::Tensor out) {
  lora_add_into(x, a_t, b_t, offsets, rows, mask, out);
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("lora_add(Tensor x, Tensor a_t, Tensor b_t, Tensor? offsets, Tensor? rows, "
        "Tensor? mask, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("lora_add", &tierserve::lora_add);
}

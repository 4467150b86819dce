// A LoRA adapter's delta on a projection's output: out += (x a_t) b_t, with x [M, K], a_t
// [K, R], b_t [R, N] and out [M, N] of one dtype (fp32 or bf16), all contiguous.
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
#include <type_traits>
#include <vector>

namespace tierserve {
namespace {

constexpr int64_t kLoraLoopRows = 8;

// Output columns a thread takes at least: below, the fork costs more than the work.
constexpr int64_t kLoraColumnGrain = 512;

template <typename T>
void lora_rows(const T* x, const T* a_t, const T* b_t, T* out, int64_t rows, int64_t k_dim,
               int64_t r_dim, int64_t n_dim) {
  std::vector<float> t(r_dim);
  for (int64_t m = 0; m < rows; ++m) {
    std::fill(t.begin(), t.end(), 0.0f);
    const T* xm = x + m * k_dim;
    for (int64_t k = 0; k < k_dim; ++k) {
      const float xk = static_cast<float>(xm[k]);
      const T* ak = a_t + k * r_dim;
      for (int64_t r = 0; r < r_dim; ++r) t[r] += xk * static_cast<float>(ak[r]);
    }
    if constexpr (!std::is_same_v<T, float>) {  // x a_t is a T temporary, as torch's mm gives
      for (int64_t r = 0; r < r_dim; ++r) t[r] = static_cast<float>(static_cast<T>(t[r]));
    }
    T* om = out + m * n_dim;
    at::parallel_for(0, n_dim, kLoraColumnGrain, [&](int64_t n0, int64_t n1) {
      std::vector<float> acc(n1 - n0, 0.0f);
      for (int64_t r = 0; r < r_dim; ++r) {
        const float tr = t[r];
        const T* br = b_t + r * n_dim + n0;
        for (int64_t n = 0; n < n1 - n0; ++n) acc[n] += tr * static_cast<float>(br[n]);
      }
      for (int64_t n = n0; n < n1; ++n)
        om[n] = static_cast<T>(static_cast<float>(om[n]) + acc[n - n0]);
    });
  }
}

void lora_add_into(const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b_t,
                   at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && a_t.dim() == 2 && b_t.dim() == 2 && out.dim() == 2 &&
                  x.size(1) == a_t.size(0) && a_t.size(1) == b_t.size(0) &&
                  b_t.size(1) == out.size(1) && x.size(0) == out.size(0),
              "lora_add: x [M, K], a_t [K, R], b_t [R, N], out [M, N]");
  TORCH_CHECK(x.scalar_type() == a_t.scalar_type() && x.scalar_type() == b_t.scalar_type() &&
                  x.scalar_type() == out.scalar_type(),
              "lora_add: one dtype for every tensor");
  const int64_t rows = x.size(0);
  if (rows > kLoraLoopRows || !x.is_contiguous() || !out.is_contiguous() ||
      !a_t.is_contiguous() || !b_t.is_contiguous() ||
      (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16)) {
    out.addmm_(at::mm(x, a_t), b_t);
    return;
  }
  const int64_t k_dim = x.size(1), r_dim = a_t.size(1), n_dim = out.size(1);
  if (x.scalar_type() == at::kFloat) {
    lora_rows(x.data_ptr<float>(), a_t.data_ptr<float>(), b_t.data_ptr<float>(),
              out.data_ptr<float>(), rows, k_dim, r_dim, n_dim);
  } else {
    lora_rows(x.data_ptr<at::BFloat16>(), a_t.data_ptr<at::BFloat16>(),
              b_t.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, k_dim, r_dim,
              n_dim);
  }
}

void lora_add(const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b_t,
              at::Tensor out) {
  lora_add_into(x, a_t, b_t, out);
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("lora_add(Tensor x, Tensor a_t, Tensor b_t, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("lora_add", &tierserve::lora_add);
}

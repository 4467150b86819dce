// The greedy head's route past its fp32 rows (workers/backends/greedy.py): greedy_tokens'
// answer (greedy_head.cpp) from int8_head.cpp's passes. The first pass runs over every panel and
// the second only over the panels of the columns the first leaves as candidates (a few of the
// vocabulary on a trained model): two passes everywhere would double the products, and one pass
// alone would leave the exact step several times the columns.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tierserve {
namespace {

// Candidates per max_candidates past which a row's one-pass candidates are not narrowed.
constexpr int64_t kNarrowedLimit = 16;

// Per row of int8_greedy_tokens: the candidates of its one-pass logits, narrowed by both passes
// over their panels only, then computed exactly.
template <typename W>
int64_t int8_greedy_row(const QuantRows& x, int64_t r, const HeadCodes& head,
                        const float* approx, const float* xr, const W* packed,
                        const float* norms, const float* devs, int64_t n, float gamma,
                        int out_bits, bool pairs, int64_t max_cand, std::vector<int64_t>& cand) {
  const int64_t k = x.k;
  const float* err = x.err + 4 * r;
  LogitBound e1, e2;
  if (!logit_bound(xr, k, true, err[0], err[1], gamma, norms, devs, e1) ||
      !logit_bound(xr, k, true, err[2], err[3], gamma, norms, devs, e2))
    return -1;
  const float cut1 = candidate_floor(approx, n, e1, out_bits);
  if (std::isnan(cut1)) return -1;
  candidate_columns(approx, n, e1, cut1, cand);
  if (cand.empty()) return -1;
  // A row this flat after one pass stays past max_cand after two as good as always.
  if (max_cand > 0 && static_cast<int64_t>(cand.size()) > kNarrowedLimit * max_cand) return -2;
  std::vector<float> vals(cand.size());
  float panel_vals[kI8Feat];
  int64_t panel = -1;
  float best = -INFINITY;
  for (size_t i = 0; i < cand.size(); ++i) {
    if (cand[i] / kI8Feat != panel) {
      panel = cand[i] / kI8Feat;
#if defined(__AVX512F__)
      int8_tile<1, 1, 2>(x, r, head, panel, panel_vals, kI8Feat,
                         std::min<int64_t>(kI8Feat, n - panel * kI8Feat));
#endif
    }
    vals[i] = panel_vals[cand[i] % kI8Feat];
    if (!std::isfinite(vals[i])) return -1;
    best = std::max(best, vals[i] - e2.at(cand[i]));
  }
  const float cut2 = widen_floor(best, out_bits);
  size_t kept = 0;
  for (size_t i = 0; i < cand.size(); ++i)
    if (vals[i] + e2.at(cand[i]) >= cut2) cand[kept++] = cand[i];
  cand.resize(kept);
  if (cand.empty()) return -1;
  if (max_cand > 0 && static_cast<int64_t>(cand.size()) > max_cand) return -2;
  return exact_argmax(xr, packed, k, pairs, cand);
}

// The greedy head's route past its fp32 rows (greedy.py): greedy_tokens' answer for x [M, K]
// against the head's panels, from the int8 codes' logits of x's rows quantized once, whose
// candidates are narrowed by the second pass over their own panels (a pass over every panel
// would double the products) -> long[M], -1 and -2 as greedy_tokens gives them.
at::Tensor int8_greedy_tokens(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scales, const at::Tensor& sums,
                              const at::Tensor& packed, const at::Tensor& norms,
                              const at::Tensor& devs, int64_t n, double gamma,
                              int64_t max_candidates) {
  const char* op = "int8_greedy_tokens: ";
  check_int8_head(op, x, codes, scales, sums, n);
  check_greedy_head(op, x, packed, norms, devs, n);
  const int64_t m = x.size(0), k = x.size(1);
  const QuantRows rows = quantize_rows(x);
  const HeadCodes head = head_codes(codes, scales, sums);
  at::Tensor approx = at::empty({m, n}, x.options());
  pass_logits(rows, m, head, n, 1, approx.data_ptr<float>());
  const float g = static_cast<float>(gamma);
  return tokens_by_row(packed, m, [&](int64_t r, const auto* w, bool pairs, int out_bits,
                                      std::vector<int64_t>& cand) {
    return int8_greedy_row(rows, r, head, approx.data_ptr<float>() + r * n,
                           x.data_ptr<float>() + r * k, w, norms.data_ptr<float>(),
                           devs.data_ptr<float>(), n, g, out_bits, pairs, max_candidates, cand);
  });
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("int8_greedy_tokens(Tensor x, Tensor codes, Tensor scales, Tensor sums, Tensor packed, "
        "Tensor norms, Tensor devs, int n, float gamma, int max_candidates=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("int8_greedy_tokens", &tierserve::int8_greedy_tokens);
}

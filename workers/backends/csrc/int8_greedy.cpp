// The greedy head's route where the CPU has AVX512_VNNI (workers/backends/greedy.py):
// greedy_tokens' answer (greedy_head.cpp) from int8_head.cpp's passes. The first pass runs over
// every panel and the second only over the panels of the columns the first leaves as candidates
// (a few of the vocabulary on a trained model): two passes everywhere would double the products,
// and one pass alone would leave the exact step several times the columns.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace tierserve {
namespace {

// One-pass candidates per max_candidates past which a row is not narrowed but takes its full
// product: the second pass narrows only the row's own quantization error, not the codes', and
// leaves a row that flat (all its logits near the best) past max_candidates still.
constexpr size_t kNarrowedLimit = 16;

// Keeps the candidates (index order, in one pass's candidate_columns) whose logit from both
// passes, over their panels only, is within the bound e of the best; false where one of those
// logits is not finite.
bool narrow_by_second_pass(const QuantRows& x, int64_t r, const HeadCodes& head, int64_t n,
                           const LogitBound& e, int out_bits, std::vector<int64_t>& cand) {
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
    if (!std::isfinite(vals[i])) return false;
    best = std::max(best, vals[i] - e.at(cand[i]));
  }
  const float cut = widen_floor(best, out_bits);
  size_t kept = 0;
  for (size_t i = 0; i < cand.size(); ++i)
    if (vals[i] + e.at(cand[i]) >= cut) cand[kept++] = cand[i];
  cand.resize(kept);
  return true;
}

// Per row of int8_greedy_tokens: the candidates of its one-pass logits, narrowed by both passes,
// then computed exactly; -1 and -2 as greedy_row gives them.
template <typename W>
int64_t int8_greedy_row(const QuantRows& x, int64_t r, const HeadCodes& head,
                        const float* approx, const float* xr, const W* packed,
                        const float* norms, const float* devs, int64_t n, float gamma,
                        int out_bits, bool pairs, int64_t max_cand, std::vector<int64_t>& cand) {
  const float* err = x.err + 4 * r;  // per number of passes: ||x - xhat||, its terms' norm
  LogitBound one, two;
  if (!logit_bound(xr, x.k, true, err[0], err[1], gamma, norms, devs, one) ||
      !logit_bound(xr, x.k, true, err[2], err[3], gamma, norms, devs, two))
    return -1;
  const float cut = candidate_floor(approx, n, one, out_bits);
  if (std::isnan(cut)) return -1;
  candidate_columns(approx, n, one, cut, cand);
  if (cand.empty()) return -1;
  const auto limit = static_cast<size_t>(max_cand);
  if (max_cand > 0 && cand.size() > kNarrowedLimit * limit) return -2;
  if (!narrow_by_second_pass(x, r, head, n, two, out_bits, cand) || cand.empty()) return -1;
  if (max_cand > 0 && cand.size() > limit) return -2;
  return exact_argmax(xr, packed, x.k, pairs, cand);
}

// greedy_tokens' answer for x [M, K] against the head's panels, from the int8 codes' logits of
// x's rows quantized once, whose candidates the second pass narrows over their own panels ->
// long[M], -1 and -2 as greedy_tokens gives them.
at::Tensor int8_greedy_tokens(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scales, const at::Tensor& packed,
                              const at::Tensor& norms, const at::Tensor& devs, int64_t n,
                              double gamma,
                              int64_t max_candidates, const std::optional<at::Tensor>& q8_scales) {
  const char* op = "int8_greedy_tokens: ";
  check_int8_head(op, x, codes, scales, n);
  check_greedy_head(op, x, packed, q8_scales, norms, devs, n);
  const int64_t m = x.size(0), k = x.size(1);
  const QuantRows rows = quantize_rows(x);
  const HeadCodes head = head_codes(codes, scales);
  at::Tensor approx = at::empty({m, n}, x.options());
  pass_logits(rows, m, head, n, 1, approx.data_ptr<float>());
  const float g = static_cast<float>(gamma);
  return tokens_by_row(packed, q8_scales, m, [&](int64_t r, const auto* w, bool pairs, int out_bits,
                                      std::vector<int64_t>& cand) {
    return int8_greedy_row(rows, r, head, approx.data_ptr<float>() + r * n,
                           x.data_ptr<float>() + r * k, w, norms.data_ptr<float>(),
                           devs.data_ptr<float>(), n, g, out_bits, pairs, max_candidates, cand);
  });
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("int8_greedy_tokens(Tensor x, Tensor codes, Tensor scales, Tensor packed, Tensor norms, "
        "Tensor devs, int n, float gamma, int max_candidates=0, Tensor? q8_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("int8_greedy_tokens", &tierserve::int8_greedy_tokens);
}

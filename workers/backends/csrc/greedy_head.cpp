// Exact greedy tokens of an LM head without its full product (workers/backends/greedy.py):
// approximate logits from the head's Q8_0 codes, bounded per vocabulary row, and the full
// product's own arithmetic for the rows that could still be the maximum. The columns are read
// from the head's panels (panels.h; bf16 pair panels through linear_pairs.cpp), so the token
// is the one argmax over linear_f32 / linear_half's logits gives, bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace tierserve {
namespace {

template <typename W, int L>
void exact_columns(const float* x, const W* packed, int64_t k, const int64_t* cols, float* out) {
  // L independent chains, each the FMA chain linear_f32 (or linear_half) runs for its column.
  float acc[L] = {};
  const W* base[L];
  for (int l = 0; l < L; ++l)
    base[l] = packed + (cols[l] / kPanel) * k * kPanel + cols[l] % kPanel;
  for (int64_t i = 0; i < k; ++i)
    for (int l = 0; l < L; ++l)
      acc[l] = std::fma(x[i], static_cast<float>(base[l][i * kPanel]), acc[l]);
  for (int l = 0; l < L; ++l) out[l] = acc[l];
}

// A Q8_0 head's codes (quant.cpp's panels: codes [P, B, 32, kPanel] int8, scales [P, B,
// kPanel] fp32), whose products run linear_f32's chain over the rebuilt weights q d (exact in
// fp32): its exact columns rebuild them the same way.
struct Q8Panels {
  const int8_t* codes;
  const float* scales;
  int64_t blocks;
};

template <int L>
void exact_q8_columns(const float* x, const Q8Panels& w, const int64_t* cols, float* out) {
  float acc[L] = {};
  const int8_t* codes[L];
  const float* scales[L];
  for (int l = 0; l < L; ++l) {
    const int64_t p = cols[l] / kPanel, f = cols[l] % kPanel;
    codes[l] = w.codes + p * w.blocks * 32 * kPanel + f;
    scales[l] = w.scales + p * w.blocks * kPanel + f;
  }
  for (int64_t b = 0; b < w.blocks; ++b)
    for (int64_t i = 0; i < 32; ++i)
      for (int l = 0; l < L; ++l) {
        const float weight = static_cast<float>(codes[l][(b * 32 + i) * kPanel]) *
                             scales[l][b * kPanel];
        acc[l] = std::fma(x[b * 32 + i], weight, acc[l]);
      }
  for (int l = 0; l < L; ++l) out[l] = acc[l];
}

// A logit as the full product stores it: fp32, or rounded once to the weight's half type.
template <typename W>
inline float stored(float v) {
  if constexpr (std::is_same_v<W, float> || std::is_same_v<W, Q8Panels>) {
    return v;
  } else {
    return static_cast<float>(static_cast<W>(v));
  }
}

// Exact greedy tokens of y = x W^T (W in panels of W's type, fp32 math, each logit rounded once
// to W's type) from an approximation of y.
//
// approx [M, N] fp32 is xhat What^T in fp32 arithmetic, What a rebuilt approximation of W (GGUF
// Q8_0 codes, exact in fp32), dev_j >= |w_j - what_j| and norms_j >= |w_j| (Euclidean), and
// xhat either x itself (an FMA chain over k) or x quantized (int8_head.cpp: sums over blocks
// of one or two passes of codes), with xe >= |x - xhat| (0 for x itself) and xa >= the norm of
// the elementwise sum of the absolute values of xhat's terms (|x| for x itself). Each chain errs
// by at most gamma = K u / (1 - K u) times the sum of its |products| (Higham), so
//   |approx_j - y_j| <= e_j = (|x| + xe + gamma xa) dev_j + (xe + gamma (|x| + xa)) norms_j
//                             + flush_j,
// flush_j = 2^-126 (sqrt(K) (|x| + norms_j) + K) covering subnormals flushed on the way (for a
// quantized x also its block scales' products, 2^-126 times 32 x 127^2 each at most). Every
// j that could be the argmax has approx_j + e_j >= best = max_i (approx_i - e_i); with a
// half-precision output, every j whose rounded logit could equal the rounded maximum, which is
// within two units in the last place of it: approx_j + e_j >= best - 2^-(bits - 2) |best|.
// Only those candidates are computed, with the full product's arithmetic (one FMA chain over k
// in order, from 0, then the rounding), and the first index of their maximum is the row's
// token: the token argmax_rows(linear(x, W)) gives, bit for bit.

// e_j = a dev_j + b norms_j + c for one row.
struct LogitBound {
  float a = 0, b = 0, c = 0;
  const float* norms = nullptr;
  const float* devs = nullptr;

  float at(int64_t j) const { return a * devs[j] + b * norms[j] + c; }
  Vec at_vec(int64_t j) const { return splat(a) * load(devs + j) + splat(b) * load(norms + j) + c; }
};

// The bound for row x [k]; false where x, xe or xa is not finite.
bool logit_bound(const float* x, int64_t k, bool quantized, float xe, float xa, float gamma,
                 const float* norms, const float* devs, LogitBound& e) {
  double sq = 0;
  for (int64_t i = 0; i < k; ++i) sq += static_cast<double>(x[i]) * x[i];
  const float xn = static_cast<float>(std::sqrt(sq)) * (1.0f + 1e-6f);
  if (!quantized) xa = xn;
  if (!std::isfinite(xn) || !std::isfinite(xe) || !std::isfinite(xa)) return false;
  constexpr float kTiny = 1.1754944e-38f;  // 2^-126
  const float slack = 1.0f + 1e-5f;  // the bound's own fp32 arithmetic
  // At most two passes of k / 32 blocks, each product of scales of at most 32 x 127^2 times
  // its value.
  const float scaled = quantized ? 2.0f * k * (127.0f * 127.0f) : 0.0f;
  e.c = kTiny * (std::sqrt(static_cast<float>(k)) * xn + k + scaled) * 1.01f;
  e.a = (xn + xe + gamma * xa) * slack;
  e.b = (xe + gamma * (xn + xa)) * slack + kTiny * std::sqrt(static_cast<float>(k)) * 1.01f;
  e.norms = norms;
  e.devs = devs;
  return true;
}

// The lowest value a candidate's upper bound may take, from best = max_j (approx_j - e_j): best
// itself, or for a half-precision output (out_bits > 0) two units in its last place below.
float widen_floor(float best, int out_bits) {
  return out_bits > 0 ? best - (std::ldexp(std::fabs(best), -(out_bits - 2)) + 1.1754944e-38f)
                      : best;
}

// widen_floor of best = max_j (approx_j - e_j) over approx [n]; NaN where approx holds a
// non-finite value.
float candidate_floor(const float* approx, int64_t n, const LogitBound& e, int out_bits) {
  Vec lo = splat(-INFINITY), bad = Vec{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec v = load(approx + j);
    const Vec low = v - e.at_vec(j);
    lo = lo > low ? lo : low;
    bad += v - v;  // NaN for a NaN or infinite v
  }
  float best = -INFINITY, nan_check = 0;
  for (int l = 0; l < kLanes; ++l) {
    best = std::max(best, lo[l]);
    nan_check += bad[l];
  }
  for (; j < n; ++j) {
    nan_check += approx[j] - approx[j];
    best = std::max(best, approx[j] - e.at(j));
  }
  if (nan_check != 0 || !std::isfinite(best)) return NAN;
  return widen_floor(best, out_bits);
}

// The columns j of approx [n] with approx_j + e_j >= cut, in index order, into cand.
void candidate_columns(const float* approx, int64_t n, const LogitBound& e, float cut,
                       std::vector<int64_t>& cand) {
  cand.clear();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec high = load(approx + j) + e.at_vec(j);
    if (hmax(high) >= cut)
      for (int l = 0; l < kLanes; ++l)
        if (high[l] >= cut) cand.push_back(j + l);
  }
  for (; j < n; ++j)
    if (approx[j] + e.at(j) >= cut) cand.push_back(j);
}

// The first of the candidates (in index order, at least one) whose logit, computed as the full
// product computes and stores it, is the largest; -1 where that logit is not finite.
template <typename W>
int64_t exact_argmax(const float* x, const W* packed, int64_t k, bool pairs,
                     std::vector<int64_t>& cand) {
  constexpr int kGroup = 8;
  while (cand.size() % kGroup) cand.push_back(cand.back());  // repeats do not change the argmax
  int64_t arg = -1;
  float top = -INFINITY;
  float vals[kGroup];
  for (size_t i = 0; i < cand.size(); i += kGroup) {
    if constexpr (std::is_same_v<W, Q8Panels>) {
      exact_q8_columns<kGroup>(x, *packed, cand.data() + i, vals);
    } else if constexpr (std::is_same_v<W, c10::BFloat16>) {
      if (pairs)
        exact_pair_columns<kGroup>(x, packed, k, cand.data() + i, vals);
      else
        exact_columns<W, kGroup>(x, packed, k, cand.data() + i, vals);
    } else {
      exact_columns<W, kGroup>(x, packed, k, cand.data() + i, vals);
    }
    for (int l = 0; l < kGroup; ++l) {
      const float v = stored<W>(vals[l]);
      if (v > top || arg < 0) {
        top = v;
        arg = cand[i + l];
      }
    }
  }
  return std::isfinite(top) ? arg : -1;
}

// A row whose x or approx holds a non-finite value gets -1 (the caller takes the full path);
// one with more than max_cand candidates (0: no limit), -2 (the caller takes that row's full
// product).
template <typename W>
int64_t greedy_row(const float* approx, const float* x, bool quantized, float xe, float xa,
                   const W* packed, const float* norms, const float* devs, int64_t n, int64_t k,
                   float gamma, int out_bits, bool pairs, int64_t max_cand,
                   std::vector<int64_t>& cand) {
  LogitBound e;
  if (!logit_bound(x, k, quantized, xe, xa, gamma, norms, devs, e)) return -1;
  const float cut = candidate_floor(approx, n, e, out_bits);
  if (std::isnan(cut)) return -1;
  candidate_columns(approx, n, e, cut, cand);
  // The column that set `best` is always a candidate (its upper bound is at least its lower);
  // should rounding ever say otherwise, the full path decides.
  if (cand.empty()) return -1;
  // Past max_cand candidates, their columns (read across the panels, a line per weight) cost
  // more than the row's own full product (the weights streamed once): the caller runs that.
  if (max_cand > 0 && static_cast<int64_t>(cand.size()) > max_cand) return -2;
  return exact_argmax(x, packed, k, pairs, cand);
}

// The checks of a Q8_0 head's codes [P, K / 32, 32, kPanel] and scales [P, K / 32, kPanel].
void check_q8_panels(const char* op, const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), op,
              "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, op, "x must be [M, K], K a multiple of 32");
  const int64_t blocks = x.size(1) / 32;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.is_contiguous() &&
                  codes.size(1) == blocks && codes.size(2) == 32 && codes.size(3) == kPanel,
              op, "Q8_0 codes must be contiguous int8 [P, ", blocks, ", 32, ", kPanel, "]");
  const int64_t panels = codes.size(0);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, op, "n = ", n,
              " does not match ", panels, " panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == panels * blocks * kPanel,
              op, "Q8_0 scales must be contiguous float32 [P, ", blocks, ", ", kPanel, "]");
}

// The checks every greedy op makes of x [M, K], the head's weight (panels, or Q8_0 codes where
// q8_scales holds their scales) and its norms and devs [n].
void check_greedy_head(const char* op, const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& q8_scales, const at::Tensor& norms,
                       const at::Tensor& devs, int64_t n) {
  if (q8_scales)
    check_q8_panels(op, x, packed, *q8_scales, n);
  else
    check_panel_shapes(op, x, packed, n);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              "x must be a contiguous float32 [M, K] tensor");
  const auto wt = packed.scalar_type();
  TORCH_CHECK(q8_scales || wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf, op,
              "the weight must be float32, bfloat16 or float16 panels, or Q8_0 codes");
  for (const at::Tensor* t : {&norms, &devs})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == n,
                op, "norms and devs must be contiguous float32 [n] CPU tensors");
  TORCH_CHECK(!pair_layout(packed) || bf16_pairs(), op,
              "bf16 pair panels need a CPU with AVX512_BF16");
}

// long[M]: row(r, the weight as its own type (a Q8Panels where q8_scales is given), whether it
// is bf16 pair panels, out_bits, a candidate buffer) for every row r, in parallel.
template <typename Row>
at::Tensor tokens_by_row(const at::Tensor& packed, const std::optional<at::Tensor>& q8_scales,
                         int64_t m, Row row) {
  const auto wt = packed.scalar_type();
  const int out_bits = q8_scales || wt == at::kFloat ? 0 : wt == at::kBFloat16 ? 8 : 11;
  const bool pairs = !q8_scales && pair_layout(packed);
  const Q8Panels q8 = q8_scales ? Q8Panels{packed.data_ptr<int8_t>(),
                                           q8_scales->data_ptr<float>(), packed.size(1)}
                                : Q8Panels{};
  at::Tensor out = at::empty({m}, packed.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cand;
    for (int64_t r = r0; r < r1; ++r) {
      if (q8_scales)
        o[r] = row(r, &q8, false, out_bits, cand);
      else if (wt == at::kFloat)
        o[r] = row(r, packed.data_ptr<float>(), false, out_bits, cand);
      else if (wt == at::kBFloat16)
        o[r] = row(r, packed.data_ptr<c10::BFloat16>(), pairs, out_bits, cand);
      else
        o[r] = row(r, packed.data_ptr<c10::Half>(), false, out_bits, cand);
    }
  });
  return out;
}

at::Tensor greedy_tokens(const at::Tensor& approx, const at::Tensor& x, const at::Tensor& packed,
                         const at::Tensor& norms, const at::Tensor& devs, int64_t n,
                         double gamma, const std::optional<at::Tensor>& x_err,
                         int64_t max_candidates, const std::optional<at::Tensor>& q8_scales) {
  const char* op = "greedy_tokens: ";
  check_greedy_head(op, x, packed, q8_scales, norms, devs, n);
  TORCH_CHECK(approx.device().is_cpu() && approx.scalar_type() == at::kFloat &&
                  approx.is_contiguous() && approx.dim() == 2 && approx.size(0) == x.size(0) &&
                  approx.size(1) == n,
              op, "approx must be a contiguous float32 [", x.size(0), ", ", n, "] CPU tensor");
  TORCH_CHECK(!x_err || (x_err->device().is_cpu() && x_err->scalar_type() == at::kFloat &&
                         x_err->is_contiguous() && x_err->numel() == 2 * x.size(0)),
              op, "x_err must be a contiguous float32 [M, 2] CPU tensor");
  const float* xe = x_err ? x_err->data_ptr<float>() : nullptr;
  const int64_t k = x.size(1);
  const float g = static_cast<float>(gamma);
  return tokens_by_row(packed, q8_scales, x.size(0), [&](int64_t r, const auto* w, bool pairs,
                                              int out_bits, std::vector<int64_t>& cand) {
    return greedy_row(approx.data_ptr<float>() + r * n, x.data_ptr<float>() + r * k,
                      xe != nullptr, xe ? xe[2 * r] : 0.0f, xe ? xe[2 * r + 1] : 0.0f, w,
                      norms.data_ptr<float>(), devs.data_ptr<float>(), n, k, g, out_bits, pairs,
                      max_candidates, cand);
  });
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("greedy_tokens(Tensor approx, Tensor x, Tensor packed, Tensor norms, Tensor devs, "
        "int n, float gamma, Tensor? x_err=None, int max_candidates=0, "
        "Tensor? q8_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("greedy_tokens", &tierserve::greedy_tokens);
}

// fp32 linear layer (y = x W^T + b) for CPU, over a weight packed once at load time.
//
// MKL's sgemm reaches ~350 GFLOPS here on prefill-sized inputs but only ~170-250 on decode-sized
// ones (M = a few dozen rows), where it re-packs the weight on every call. This kernel keeps the
// weight in the microkernel's layout instead: panels of kNR output features, each panel
// [K][kNR] contiguous, so one k step reads kNR weights as two vector loads.
//
// Every output element is one FMA chain over k = 0 .. K-1 in order (K-blocking reloads the
// accumulators and continues the same chain), then + bias: the result does not depend on M, on
// the thread count or on how the work was split.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <array>
#include <utility>
#include <cstdint>

namespace tierserve {
namespace {

constexpr int kNR = 2 * kLanes;  // output features per panel
constexpr int kMaxMR = 12;       // rows per microkernel call: 2 * 12 accumulators + 2 + 1 zmm
constexpr int64_t kKC = 256;     // k per block: a [kKC][kNR] panel slice is 32 KiB, L1-resident

// c[MR][kNR] (row stride ldc) = (first ? 0 : c) + a[MR][kc] (row stride lda) . b[kc][kNR].
// Meanwhile asks for pf_lines cache lines from pf on into L2: the weight slice that comes next.
template <int MR>
void microkernel(int64_t kc, const float* __restrict a, int64_t lda, const float* __restrict b,
                 float* __restrict c, int64_t ldc, bool first, const float* pf, int64_t pf_lines) {
  Vec lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = first ? Vec{} : load(c + r * ldc);
    hi[r] = first ? Vec{} : load(c + r * ldc + kLanes);
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (k < pf_lines) __builtin_prefetch(pf + k * kLanes, 0, 2);
    const Vec b0 = load(b + k * kNR), b1 = load(b + k * kNR + kLanes);
    for (int r = 0; r < MR; ++r) {
      const Vec av = splat(a[r * lda + k]);
      lo[r] += av * b0;
      hi[r] += av * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * ldc, lo[r]);
    store(c + r * ldc + kLanes, hi[r]);
  }
}

using Micro = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool,
                       const float*, int64_t);

template <int... MR>
constexpr auto micro_table(std::integer_sequence<int, MR...>) {
  return std::array<Micro, sizeof...(MR)>{&microkernel<MR + 1>...};
}
constexpr auto kMicro = micro_table(std::make_integer_sequence<int, kMaxMR>{});

// Rows [m0, m1) of the output through panel p. A full panel accumulates straight into out; the
// last panel of an N that is not a multiple of kNR accumulates into a scratch tile per row tile.
void run_panel(const float* x, int64_t ldx, const float* packed, const float* bias, float* out,
               int64_t n, int64_t k, int64_t m0, int64_t m1, int64_t p) {
  const float* panel = packed + p * k * kNR;
  const int64_t col = p * kNR, width = std::min<int64_t>(kNR, n - col);
  const int64_t rows = m1 - m0;
  // Balanced row tiles: ceil(rows / kMaxMR) tiles whose sizes differ by at most one.
  const int64_t tiles = (rows + kMaxMR - 1) / kMaxMR;
  auto tile_rows = [&](int64_t t) { return rows / tiles + (t < rows % tiles ? 1 : 0); };
  if (width == kNR) {
    for (int64_t kc = 0; kc < k; kc += kKC) {
      const int64_t kn = std::min(kKC, k - kc);
      // The weight is streamed from memory once per call, in address order (panels are
      // contiguous): while the row tiles reuse this slice from L1, they prefetch the next
      // slice, a share each, since hardware prefetchers do not run that far ahead.
      const float* next = panel + (kc + kn) * kNR;
      const int64_t share = (kn * kNR / kLanes + tiles - 1) / tiles;
      for (int64_t t = 0, r0 = m0; t < tiles; r0 += tile_rows(t), ++t)
        kMicro[tile_rows(t) - 1](kn, x + r0 * ldx + kc, ldx, panel + kc * kNR, out + r0 * n + col,
                                 n, kc == 0, next + t * share * kLanes, share);
    }
  } else {
    alignas(64) float tail[kMaxMR * kNR];
    for (int64_t t = 0, r0 = m0; t < tiles; r0 += tile_rows(t), ++t) {
      const int64_t mr = tile_rows(t);
      for (int64_t kc = 0; kc < k; kc += kKC)
        kMicro[mr - 1](std::min(kKC, k - kc), x + r0 * ldx + kc, ldx, panel + kc * kNR, tail, kNR,
                       kc == 0, nullptr, 0);
      for (int64_t r = 0; r < mr; ++r)
        std::copy_n(tail + r * kNR, width, out + (r0 + r) * n + col);
    }
  }
  if (bias != nullptr)
    for (int64_t r = m0; r < m1; ++r)
      for (int64_t j = 0; j < width; ++j) out[r * n + col + j] += bias[col + j];
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t n) {
  const char* op = "linear_f32: ";
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, op,
              "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR && packed.is_contiguous(), op,
              "packed weight must be a contiguous [panels, K, ", kNR, "] tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, op, "x has K = ", k, ", the weight ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kNR && n <= panels * kNR, op, "n = ", n, " does not match ",
              panels, " panels");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                op, "bias must be a contiguous float32 [n] tensor");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Work items are (row block, panel), panel-major within a row block: a thread's contiguous
  // share of items is a run of panels, so with few rows each thread streams its own share of
  // the weight, and a row block (the rows one panel slice is reused over) stays in L2.
  constexpr int64_t kRowBlock = 192;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rb = i / panels;
      run_panel(xp, ldx, wp, b, op_, n, k, rb * kRowBlock, std::min(m, (rb + 1) * kRowBlock),
                i % panels);
    }
  });
  return out;
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(tierserve, m) {
  m.def("linear_f32(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tierserve, CPU, m) {
  m.impl("linear_f32", &tierserve::linear_f32);
}

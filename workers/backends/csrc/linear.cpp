// Linear layer (y = x W^T + b) for CPU, over a weight packed once at load time: fp32, or bf16 /
// fp16 weights computed in fp32.
//
// MKL's sgemm re-packs the weight on every call, which costs most at decode sizes (M = a few
// dozen rows). This kernel keeps the weight in the microkernel's layout instead: panels of kNR
// output features, each panel [K][kNR] contiguous, so one k step reads kNR weights as two
// vector loads. Half-precision weights are widened to fp32 in registers as they are loaded
// (CPUs without native bf16 math, where torch's own bf16 linear is several times slower than
// its fp32 one), halving the bytes a decode step streams.
//
// Every output element is one FMA chain over k = 0 .. K-1 in order (K-blocking reloads the
// accumulators and continues the same chain), then + bias: the result does not depend on M, on
// the thread count or on how the work was split. Half-precision outputs are that fp32 value
// rounded once, as oneDNN's bf16 linear rounds its fp32 accumulator.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace tierserve {
namespace {

constexpr int kNR = kPanel;  // output features per panel: two Vecs
static_assert(kNR == 2 * kLanes);
// Rows per microkernel call: 2 accumulators a row, plus the two weight Vecs and the broadcast
// input, must fit the register file (12 rows on AVX-512's 32 registers, 6 on AVX2's 16).
constexpr int kMaxMR = (kVecRegs - 3) / 2 > 12 ? 12 : (kVecRegs - 3) / 2;
// k per block: a [kKC][kNR] fp32 panel slice (32 KiB on AVX-512, 16 on AVX2) stays in L1.
constexpr int64_t kKC = 256;
constexpr int64_t kLine = 64;  // bytes per cache line

// c[MR][kNR] (row stride ldc) = (first ? 0 : c) + a[MR][kc] (row stride lda) . b[kc][kNR].
// Meanwhile prefetches pf_lines cache lines from pf on: the weight slice that comes next. A
// Streaming kernel is a caller's only row tile, which reads that slice once, right after this
// one: it takes all of it (at most two lines a k step), with a non-temporal hint, since a
// decode step's weights are read once a step and should not displace what the step reads
// again (bench/decode_step.py times the step); other tiles share the slice out, a line a k step
// into L2, where the row tiles after them find it.
template <typename W, int MR, bool Streaming>
void microkernel(int64_t kc, const float* __restrict a, int64_t lda, const W* __restrict b,
                 float* __restrict c, int64_t ldc, bool first, const char* pf, int64_t pf_lines) {
  Vec lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = first ? Vec{} : load(c + r * ldc);
    hi[r] = first ? Vec{} : load(c + r * ldc + kLanes);
  }
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (Streaming) {
      if (k < pf_lines) __builtin_prefetch(pf + k * kLine, 0, 0);
      if (k + kc < pf_lines) __builtin_prefetch(pf + (k + kc) * kLine, 0, 0);
    } else if (k < pf_lines) {
      __builtin_prefetch(pf + k * kLine, 0, 2);
    }
    const Vec b0 = load_as_float(b + k * kNR), b1 = load_as_float(b + k * kNR + kLanes);
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

template <typename W>
using Micro = void (*)(int64_t, const float*, int64_t, const W*, float*, int64_t, bool,
                       const char*, int64_t);

template <typename W, bool Streaming, int... MR>
constexpr auto micro_table(std::integer_sequence<int, MR...>) {
  static_assert(kNR * sizeof(W) <= 2 * kLine, "a streaming kernel prefetches two lines a step");
  return std::array<Micro<W>, sizeof...(MR)>{&microkernel<W, MR + 1, Streaming>...};
}
template <typename W>
constexpr auto kStreamMicro = micro_table<W, true>(std::make_integer_sequence<int, kMaxMR>{});
template <typename W>
constexpr auto kMicro = micro_table<W, false>(std::make_integer_sequence<int, kMaxMR>{});

// Two adjacent panels at once (64 output features on AVX-512): 4 accumulators a row, so a k step
// loads four weight Vecs and one input per row for 4 FMAs a row, against two and one for 2
// with one panel; fewer loads per FMA. Needs 4 MR + 5 registers: AVX-512 only (6 rows).
// Each output element is the single-panel microkernel's FMA chain (k in order, from c).
constexpr bool kPairs = kVecRegs >= 32;
constexpr int kMaxMR2 = (kVecRegs - 5) / 4 > 6 ? 6 : (kVecRegs - 5) / 4;

template <typename W, int MR>
void microkernel2(int64_t kc, const float* __restrict a, int64_t lda, const W* __restrict b,
                  const W* __restrict b2, float* __restrict c, int64_t ldc, bool first,
                  const char* pf, const char* pf2, int64_t pf_lines) {
  Vec acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = first ? Vec{} : load(c + r * ldc + v * kLanes);
  for (int64_t k = 0; k < kc; ++k) {
    if (k < pf_lines) {
      __builtin_prefetch(pf + k * kLine, 0, 2);
      __builtin_prefetch(pf2 + k * kLine, 0, 2);
    }
    const Vec w0 = load_as_float(b + k * kNR), w1 = load_as_float(b + k * kNR + kLanes);
    const Vec w2 = load_as_float(b2 + k * kNR), w3 = load_as_float(b2 + k * kNR + kLanes);
    for (int r = 0; r < MR; ++r) {
      const Vec av = splat(a[r * lda + k]);
      acc[r][0] += av * w0;
      acc[r][1] += av * w1;
      acc[r][2] += av * w2;
      acc[r][3] += av * w3;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
}

template <typename W>
using Micro2 = void (*)(int64_t, const float*, int64_t, const W*, const W*, float*, int64_t, bool,
                        const char*, const char*, int64_t);

template <typename W, int... MR>
constexpr auto micro2_table(std::integer_sequence<int, MR...>) {
  return std::array<Micro2<W>, sizeof...(MR)>{&microkernel2<W, MR + 1>...};
}
template <typename W>
constexpr auto kMicro2 = micro2_table<W>(std::make_integer_sequence<int, kMaxMR2>{});

// Rows [m0, m1) of the fp32 output through full panel p, or panels p and p + 1 where Two (no
// bias), accumulated straight into out.
template <typename W, bool Two>
void run_full_panels(const float* x, int64_t ldx, const W* packed, float* out, int64_t n,
                     int64_t k, int64_t m0, int64_t m1, int64_t p) {
  constexpr int kMR = Two ? kMaxMR2 : kMaxMR;
  const W* panel = packed + p * k * kNR;
  const W* panel2 = panel + k * kNR;  // read where Two only
  const int64_t col = p * kNR, rows = m1 - m0;
  // Balanced row tiles: ceil(rows / kMR) tiles whose sizes differ by at most one.
  const int64_t tiles = (rows + kMR - 1) / kMR;
  auto tile_rows = [&](int64_t t) { return rows / tiles + (t < rows % tiles ? 1 : 0); };
  for (int64_t kc = 0; kc < k; kc += kKC) {
    const int64_t kn = std::min(kKC, k - kc);
    // The weight is streamed from memory once per call, in address order (panels are
    // contiguous): while the row tiles reuse this slice from L1, they prefetch the next
    // slice, a share each, since hardware prefetchers do not run that far ahead.
    const char* next = reinterpret_cast<const char*>(panel + (kc + kn) * kNR);
    const char* next2 = reinterpret_cast<const char*>(panel2 + (kc + kn) * kNR);
    const int64_t lines = (kn * kNR * static_cast<int64_t>(sizeof(W)) + kLine - 1) / kLine;
    const int64_t share = (lines + tiles - 1) / tiles;
    for (int64_t t = 0, r0 = m0; t < tiles; r0 += tile_rows(t), ++t) {
      const float* a = x + r0 * ldx + kc;
      float* c = out + r0 * n + col;
      if constexpr (Two)
        kMicro2<W>[tile_rows(t) - 1](kn, a, ldx, panel + kc * kNR, panel2 + kc * kNR, c, n,
                                     kc == 0, next + t * share * kLine,
                                     next2 + t * share * kLine, share);
      else
        (tiles == 1 ? kStreamMicro<W> : kMicro<W>)[tile_rows(t) - 1](
            kn, a, ldx, panel + kc * kNR, c, n, kc == 0, next + t * share * kLine, share);
    }
  }
}

// Rows [m0, m1) of the fp32 output through panel p (no bias). The last panel of an N that is
// not a multiple of kNR accumulates into a scratch tile per row tile.
template <typename W>
void run_panel(const float* x, int64_t ldx, const W* packed, float* out, int64_t n, int64_t k,
               int64_t m0, int64_t m1, int64_t p) {
  const int64_t col = p * kNR, width = std::min<int64_t>(kNR, n - col);
  if (width == kNR) return run_full_panels<W, false>(x, ldx, packed, out, n, k, m0, m1, p);
  const W* panel = packed + p * k * kNR;
  const int64_t rows = m1 - m0, tiles = (rows + kMaxMR - 1) / kMaxMR;
  alignas(64) float tail[kMaxMR * kNR];
  for (int64_t t = 0, r0 = m0; t < tiles; ++t) {
    const int64_t mr = rows / tiles + (t < rows % tiles ? 1 : 0);
    for (int64_t kc = 0; kc < k; kc += kKC)
      kMicro<W>[mr - 1](std::min(kKC, k - kc), x + r0 * ldx + kc, ldx, panel + kc * kNR, tail,
                        kNR, kc == 0, nullptr, 0);
    for (int64_t r = 0; r < mr; ++r)
      std::copy_n(tail + r * kNR, width, out + (r0 + r) * n + col);
    r0 += mr;
  }
}

// A single input row (decode) through kGroup full panels at once. The microkernel gives one
// row two accumulators, whose FMA chains then wait on the FMA latency every k step; kGroup
// panels give 2 x kGroup independent chains. Each chain is the microkernel's own (k in order from
// zero), so the products equal those of any M.
constexpr int kGroup = kVecRegs >= 32 ? 8 : 4;  // 16 (of 32) or 8 (of 16) accumulators
constexpr int64_t kRowAhead = 8;                   // k steps each weight stream is prefetched ahead

template <typename W, int G>
void row_panels(int64_t k, const float* __restrict a, const W* __restrict b, float* __restrict c) {
  const int64_t stride = k * kNR;  // one panel
  Vec lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = Vec{};
  for (int64_t i = 0; i < k; ++i) {
    const Vec av = splat(a[i]);
    for (int g = 0; g < G; ++g) {
      const W* p = b + g * stride + i * kNR;
      if (i + kRowAhead < k) __builtin_prefetch(p + kRowAhead * kNR, 0, 0);
      lo[g] += av * load_as_float(p);
      hi[g] += av * load_as_float(p + kLanes);
    }
  }
  for (int g = 0; g < G; ++g) {
    store(c + g * kNR, lo[g]);
    store(c + g * kNR + kLanes, hi[g]);
  }
}

// row_panels over `count` (1 .. kGroup) full panels.
template <typename W, int G = kGroup>
void row_panels_n(int64_t count, int64_t k, const float* a, const W* b, float* c) {
  if constexpr (G > 1) {
    if (count < G) return row_panels_n<W, G - 1>(count, k, a, b, c);
  }
  row_panels<W, G>(k, a, b, c);
}

// out[M, n] fp32 = x[M, K] fp32 (row stride ldx) times the panels, no bias.
template <typename W>
void panel_product(const float* xp, int64_t ldx, int64_t m, int64_t k, const W* wp,
                   int64_t panels, float* op, int64_t n) {
  // fp32 panels stream from memory one after another, one sequential stream per thread:
  // kGroup streams at once speed up the products alone but not a decode step
  // (bench/decode_step.py). Half-precision ones are bound by the FMA latency of a single row,
  // which kGroup chains hide.
  if (m == 1 && !std::is_same_v<W, float>) {
    // A partial last panel takes run_panel, which writes only its columns.
    single_row_panels(
        panels, n / kNR, kGroup,
        [&](int64_t p, int64_t count) {
          row_panels_n<W>(count, k, xp, wp + p * k * kNR, op + p * kNR);
        },
        [&](int64_t p) { run_panel(xp, ldx, wp, op, n, k, 0, 1, p); });
    return;
  }
  // Work items are (row block, panel), panel-major within a row block: a thread's contiguous
  // share of items is a run of panels, so with few rows each thread streams its own share of
  // the weight, and a row block (the rows one panel slice is reused over) stays in L2. Row
  // blocks are of equal size (within one row), at most kRowBlock: items are then equal work,
  // and the threads' equal shares of items equal shares of the product (256 rows as blocks
  // of 192 and 64 would leave one of two threads a quarter of the work).
  constexpr int64_t kRowBlock = 192;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  auto block_start = [&](int64_t rb) { return m * rb / row_blocks; };
  // Items of two full panels where the ISA has the registers for it and the batch is
  // prefill-sized (on few rows the pair kernel's 6-row tiles lose to 12-row ones; README, CPU
  // kernels, has the measurements); an odd last full panel and a partial one are items of
  // their own.
  constexpr int64_t kPairMinRows = 256;
  const int64_t full = n / kNR, pairs = kPairs && m >= kPairMinRows ? full / 2 : 0;
  const int64_t per_block = pairs + (panels - 2 * pairs);
  at::parallel_for(0, row_blocks * per_block, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rb = i / per_block, j = i % per_block;
      const int64_t r0 = block_start(rb), r1 = block_start(rb + 1);
      if (j < pairs)
        run_full_panels<W, true>(xp, ldx, wp, op, n, k, r0, r1, 2 * j);
      else
        run_panel(xp, ldx, wp, op, n, k, r0, r1, 2 * pairs + (j - pairs));
    }
  });
}

void linear_f32_into(const at::Tensor& x, const at::Tensor& packed,
                     const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& out) {
  const float* b = check_panel_linear("linear_f32: ", x, packed, bias, n, /*narrow=*/true);
  check_out_rows("linear_f32: ", out, x.size(0), n, x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return;
  float* op = out.data_ptr<float>();
  // Panels of bf16 / fp16 values are widened in registers; each output's FMA chain is the fp32
  // panels' own, so the products are bitwise those of the same values held in fp32.
  const float* xp = x.data_ptr<float>();
  switch (packed.scalar_type()) {
    case at::kBFloat16:
      panel_product(xp, x.stride(0), m, k, packed.data_ptr<c10::BFloat16>(), packed.size(0),
                    op, n);
      break;
    case at::kHalf:
      panel_product(xp, x.stride(0), m, k, packed.data_ptr<c10::Half>(), packed.size(0), op, n);
      break;
    default:
      panel_product(xp, x.stride(0), m, k, packed.data_ptr<float>(), packed.size(0), op, n);
  }
  if (b != nullptr)
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < n; ++j) op[r * n + j] += b[j];
    });
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "linear_f32: x must be [M, K] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_f32_into(x, packed, bias, n, out);
  return out;
}

// out = round_T(acc + b), acc [M, n] fp32.
template <typename T>
void finish_half(const float* ap, const T* bias, int64_t m, int64_t n, at::Tensor& out) {
  T* op = out.data_ptr<T>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < n; ++j) {
        const float v = ap[r * n + j] + (bias != nullptr ? static_cast<float>(bias[j]) : 0.0f);
        op[r * n + j] = static_cast<T>(v);
      }
  });
}

// y = round_T(x W^T + b) for bf16 / fp16 x, W (panels of T, or bf16 pair panels) and b: fp32
// products and sums.
template <typename T>
void half_linear(const at::Tensor& x, const at::Tensor& packed, const T* bias, int64_t n,
                 at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pair_layout(packed)) {
      TORCH_CHECK(bf16_pairs(), "linear_half: bf16 pair panels need a CPU with AVX512_BF16");
      if (m == 1)
        return pair_row_half(xp, k, packed.data_ptr<T>(), packed.size(0), bias,
                             out.data_ptr<T>(), n);
    }
  }
  // fp32 copies of x ([M, K]: a Vec of inputs per splat) and of the product, in plain buffers:
  // for a lone decode row, tensor allocations and conversions through the dispatcher cost a
  // good part of a small weight's product.
  std::unique_ptr<float[]> acc(new float[m * n]);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pair_layout(packed)) {
      pair_product(xp, ldx, m, k, packed.data_ptr<T>(), packed.size(0), acc.get(), n);
      return finish_half(acc.get(), bias, m, n, out);
    }
  }
  std::unique_ptr<float[]> xf(new float[m * k]);
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = static_cast<float>(xp[r * ldx + i]);
  });
  panel_product(xf.get(), k, m, k, packed.data_ptr<T>(), packed.size(0), acc.get(), n);
  finish_half(acc.get(), bias, m, n, out);
}

void linear_half_into(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& out) {
  const char* op = "linear_half: ";
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, op, "bfloat16 or float16 only");
  TORCH_CHECK(packed.scalar_type() == dtype, op, "x and the packed weight must share a dtype");
  check_panel_shapes(op, x, packed, n);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n, op,
                "bias must be a contiguous [n] tensor of x's dtype");
  check_out_rows(op, out, x.size(0), n, x.scalar_type());
  if (x.size(0) == 0) return;
  if (dtype == at::kBFloat16)
    half_linear<c10::BFloat16>(x, packed, bias ? bias->data_ptr<c10::BFloat16>() : nullptr, n,
                               out);
  else
    half_linear<c10::Half>(x, packed, bias ? bias->data_ptr<c10::Half>() : nullptr, n, out);
}

at::Tensor linear_half(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "linear_half: x must be [M, K] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_half_into(x, packed, bias, n, out);
  return out;
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("linear_f32(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("linear_half(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("bf16_pairs() -> bool", &tierserve::bf16_pairs);
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("linear_f32", &tierserve::linear_f32);
  m.impl("linear_half", &tierserve::linear_half);
}

// Linear layers over GGUF block-quantized weights (Q4_1, Q8_0), with the fp32 panel kernel's
// arithmetic.
//
// A GGUF model's fp32 weights are its quantized blocks dequantized: Q4_1 w = q * d + m (q a
// 4-bit code, d and m per block of 32 inputs), Q8_0 w = q * d (q an int8 code). Decode-sized
// products are bound by the bytes of weight they stream: 4 per fp32 weight, under one here.
// quant_encode.cpp finds, per block, codes and scales that rebuild every fp32 weight exactly (or
// declines the tensor), and the product rebuilds each weight in registers before the same FMA
// chain over k = 0 .. K-1 in order that csrc/linear.cpp runs on the fp32 panels. So a product
// here equals linear_f32's on the same weight bit for bit, and a layer may send any batch size
// to either kernel without a request's tokens depending on its batch.
//
// Batches past a few rows rebuild a k-slice of a panel once into L1 and run linear.cpp's
// microkernel over it (kernels.cpp includes linear.cpp first): the same chain, the same bits.
//
// Layout, per panel of kNR output features (as linear.cpp's) and per block of 32 inputs:
//   Q4_1 codes [32][kNR / 2] bytes, byte j of a row holding feature j (low nibble) and feature
//   j + kLanes (high nibble); Q8_0 codes [32][kNR] int8; scales d [kNR] and offsets m [kNR]
//   fp32. Features past N in the last panel have zero codes, scales and offsets.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace tierserve {
namespace {

constexpr int kQNR = 2 * kLanes;  // output features per panel, as linear.cpp's kNR
constexpr int64_t kQBlock = 32;   // inputs per GGUF block
// Rows per tile: two accumulators a row, plus two scales, two offsets, two rebuilt weight Vecs
// and the broadcast input.
constexpr int kQMR = (kVecRegs - 7) / 2 > 8 ? 8 : (kVecRegs - 7) / 2;

inline Vec to_vec(const IVec& v) { return __builtin_convertvector(v, Vec); }

// Codes of one input row of a Q4_1 panel -> (features 0 .. kLanes-1, kLanes .. kNR-1).
inline std::pair<Vec, Vec> unpack_q4(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
  const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
#else
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_and_si128(raw, mask));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
#endif
  return {to_vec((IVec)lo), to_vec((IVec)hi)};
}

// Codes of one input row of a Q8_0 panel -> (features 0 .. kLanes-1, kLanes .. kNR-1).
inline std::pair<Vec, Vec> unpack_q8(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i hi =
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes)));
#else
  const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi =
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kLanes)));
#endif
  return {to_vec((IVec)lo), to_vec((IVec)hi)};
}

// One fused multiply-add, rounded once: the encoder checks its weights with std::fma.
inline Vec fma_vec(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// Prefetches, non-temporally, block b of the panel after the one at codes / d / m (panels
// follow each other: codes blocks * block_bytes apart, scales and offsets blocks * kQNR). Always
// inlined: GCC finds a separate copy free of side effects (a prefetch is none) and deletes its
// calls.
template <bool Q4>
__attribute__((always_inline)) inline void prefetch_next_block(const char* codes, const float* d,
                                                               const float* m, int64_t blocks,
                                                               int64_t b) {
  constexpr int64_t block_bytes = kQBlock * (Q4 ? kQNR / 2 : kQNR);
  const char* next = codes + blocks * block_bytes + b * block_bytes;
  for (int64_t at = 0; at < block_bytes; at += 64) __builtin_prefetch(next + at, 0, 0);
  for (const float* v : {d, m}) {
    if (v == nullptr) continue;
    const char* row = reinterpret_cast<const char*>(v + (blocks + b) * kQNR);
    for (int64_t at = 0; at < kQNR * static_cast<int64_t>(sizeof(float)); at += 64)
      __builtin_prefetch(row + at, 0, 0);
  }
}

// out[MR][width] (row stride ldo) = x[MR][K] (row stride ldx) . one panel's weights. With
// `next`, block by block, the panel after this one is prefetched: a thread streams its run of
// panels once, and the hardware prefetchers alone leave part of each panel to arrive on demand.
template <bool Q4, int MR>
void quant_tile(const float* __restrict x, int64_t ldx, const void* codes, const float* d,
                const float* m, int64_t blocks, float* __restrict out, int64_t ldo,
                int64_t width, bool next) {
  constexpr int64_t row_bytes = Q4 ? kQNR / 2 : kQNR;
  Vec lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = Vec{};
  for (int64_t b = 0; b < blocks; ++b) {
    if (next) prefetch_next_block<Q4>(static_cast<const char*>(codes), d, m, blocks, b);
    const Vec d0 = load(d + b * kQNR), d1 = load(d + b * kQNR + kLanes);
    const Vec m0 = Q4 ? load(m + b * kQNR) : Vec{}, m1 = Q4 ? load(m + b * kQNR + kLanes) : Vec{};
    const char* block = static_cast<const char*>(codes) + b * kQBlock * row_bytes;
    for (int64_t kk = 0; kk < kQBlock; ++kk) {
      Vec w0, w1;
      if constexpr (Q4) {
        const auto [c0, c1] = unpack_q4(reinterpret_cast<const uint8_t*>(block + kk * row_bytes));
        w0 = fma_vec(c0, d0, m0);
        w1 = fma_vec(c1, d1, m1);
      } else {
        const auto [c0, c1] = unpack_q8(reinterpret_cast<const int8_t*>(block + kk * row_bytes));
        w0 = c0 * d0;
        w1 = c1 * d1;
      }
      const int64_t k = b * kQBlock + kk;
      // The panel kernel's own statement, so that both compile to the same FMA.
      for (int r = 0; r < MR; ++r) {
        const Vec av = splat(x[r * ldx + k]);
        lo[r] += av * w0;
        hi[r] += av * w1;
      }
    }
  }
  alignas(64) float tile[kQNR];
  for (int r = 0; r < MR; ++r) {
    store(tile, lo[r]);
    store(tile + kLanes, hi[r]);
    std::copy_n(tile, width, out + r * ldo);
  }
}

template <bool Q4>
using QuantTile = void (*)(const float*, int64_t, const void*, const float*, const float*,
                           int64_t, float*, int64_t, int64_t, bool);

template <bool Q4, int... MR>
constexpr auto quant_table(std::integer_sequence<int, MR...>) {
  return std::array<QuantTile<Q4>, sizeof...(MR)>{&quant_tile<Q4, MR + 1>...};
}
template <bool Q4>
constexpr auto kQuantTile = quant_table<Q4>(std::make_integer_sequence<int, kQMR>{});

const float* check_quant(const char* op, const at::Tensor& x, const at::Tensor& codes,
                         const at::Tensor& d, const at::Tensor& m, bool q4,
                         const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, "x must be a float32 [M, K] CPU tensor with contiguous rows");
  const int64_t k = x.size(1), blocks = k / kQBlock, panels = (n + kQNR - 1) / kQNR;
  TORCH_CHECK(k % kQBlock == 0 && n > 0, op, "K must be a multiple of 32 and n positive");
  const auto code_type = q4 ? at::kByte : at::kChar;
  TORCH_CHECK(codes.scalar_type() == code_type && codes.is_contiguous() &&
                  codes.numel() == panels * blocks * kQBlock * (q4 ? kQNR / 2 : kQNR),
              op, "codes do not match x and n");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() &&
                  d.numel() == panels * blocks * kQNR,
              op, "scales do not match x and n");
  TORCH_CHECK(!q4 || (m.scalar_type() == at::kFloat && m.is_contiguous() &&
                      m.numel() == d.numel()),
              op, "offsets do not match the scales");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, "bias must be a contiguous float32 [n] tensor");
  return bias->data_ptr<float>();
}

// One k-slice [kn][kQNR] of panel p rebuilt as fp32 into dst (the panel kernel's layout), from
// block kc / 32 on: the same values quant_tile rebuilds in registers.
template <bool Q4>
void dequant_slice(const char* codes, const float* d, const float* m, int64_t kc, int64_t kn,
                   float* dst) {
  constexpr int64_t row_bytes = Q4 ? kQNR / 2 : kQNR;
  for (int64_t b = kc / kQBlock; b < (kc + kn) / kQBlock; ++b) {
    const Vec d0 = load(d + b * kQNR), d1 = load(d + b * kQNR + kLanes);
    const Vec m0 = Q4 ? load(m + b * kQNR) : Vec{}, m1 = Q4 ? load(m + b * kQNR + kLanes) : Vec{};
    const char* block = codes + b * kQBlock * row_bytes;
    for (int64_t kk = 0; kk < kQBlock; ++kk) {
      float* row = dst + (b * kQBlock + kk - kc) * kQNR;
      if constexpr (Q4) {
        const auto [c0, c1] = unpack_q4(reinterpret_cast<const uint8_t*>(block + kk * row_bytes));
        store(row, fma_vec(c0, d0, m0));
        store(row + kLanes, fma_vec(c1, d1, m1));
      } else {
        const auto [c0, c1] = unpack_q8(reinterpret_cast<const int8_t*>(block + kk * row_bytes));
        store(row, c0 * d0);
        store(row + kLanes, c1 * d1);
      }
    }
  }
}

// Rows [m0, m1) of out through panel p, k-slices rebuilt into L1 once and reused by every row
// tile with the panel kernel's microkernel: linear_f32's FMA chain, so its bits.
template <bool Q4>
void run_quant_panel(const float* x, int64_t ldx, const char* codes, const float* d,
                     const float* m, int64_t k, float* out, int64_t n, int64_t m0, int64_t m1,
                     int64_t p) {
  alignas(64) float slice[kKC * kQNR];
  const int64_t col = p * kQNR, width = std::min<int64_t>(kQNR, n - col);
  const int64_t rows = m1 - m0;
  const int64_t tiles = (rows + kMaxMR - 1) / kMaxMR;
  auto tile_rows = [&](int64_t t) { return rows / tiles + (t < rows % tiles ? 1 : 0); };
  std::vector<float> tail;
  float* dst = out + m0 * n + col;
  int64_t ldd = n;
  if (width < kQNR) {  // the last, padded panel: accumulate into a scratch of full width
    tail.assign(rows * kQNR, 0.0f);
    dst = tail.data();
    ldd = kQNR;
  }
  for (int64_t kc = 0; kc < k; kc += kKC) {
    const int64_t kn = std::min(kKC, k - kc);
    dequant_slice<Q4>(codes, d, m, kc, kn, slice);
    for (int64_t t = 0, r0 = 0; t < tiles; r0 += tile_rows(t), ++t)
      kMicro<float>[tile_rows(t) - 1](kn, x + (m0 + r0) * ldx + kc, ldx, slice, dst + r0 * ldd,
                                      ldd, kc == 0, nullptr, 0);
  }
  if (width < kQNR)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(tail.data() + r * kQNR, width, out + (m0 + r) * n + col);
}

// Rows up to this many rebuild the weights in registers for each row tile; more rows share
// one rebuild per k-slice (run_quant_panel). Both give the same bits.
constexpr int64_t kQDirectRows = kQMR;

void quant_linear_into(const char* op, bool q4, const at::Tensor& x, const at::Tensor& codes,
                       const at::Tensor& d, const at::Tensor& m,
                       const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& out) {
  const float* b = check_quant(op, x, codes, d, m, q4, bias, n);
  check_out_rows(op, out, x.size(0), n, x.scalar_type());
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kQBlock;
  const int64_t panels = (n + kQNR - 1) / kQNR;
  const int64_t panel_bytes = blocks * kQBlock * (q4 ? kQNR / 2 : kQNR);
  if (rows == 0) return;
  const float* xp = x.data_ptr<float>();
  const char* cp = static_cast<const char*>(codes.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = q4 ? m.data_ptr<float>() : nullptr;
  float* op_ = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  if (rows <= kQDirectRows) {
    // Each thread streams a contiguous run of panels once, all row tiles reusing it.
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col = p * kQNR, width = std::min<int64_t>(kQNR, n - col);
        for (int64_t r0 = 0; r0 < rows; r0 += kQMR) {
          const int64_t mr = std::min<int64_t>(kQMR, rows - r0);
          const auto tile = q4 ? kQuantTile<true>[mr - 1] : kQuantTile<false>[mr - 1];
          tile(xp + r0 * ldx, ldx, cp + p * panel_bytes, dp + p * blocks * kQNR,
               q4 ? mp + p * blocks * kQNR : nullptr, blocks, op_ + r0 * n + col, n, width,
               p + 1 < p1);  // rows <= kQMR: one row tile, the panel's only reader
        }
      }
    });
  } else {
    // As linear.cpp's panel_product: (row block, panel) items, panel-major in a row block,
    // row blocks of equal size (within one row) so that items are equal work.
    constexpr int64_t kRowBlock = 192;
    const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
    at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t rb = i / panels, p = i % panels;
        const int64_t r0 = rows * rb / row_blocks, r1 = rows * (rb + 1) / row_blocks;
        const float* pm = q4 ? mp + p * blocks * kQNR : nullptr;
        if (q4)
          run_quant_panel<true>(xp, ldx, cp + p * panel_bytes, dp + p * blocks * kQNR, pm, k,
                                op_, n, r0, r1, p);
        else
          run_quant_panel<false>(xp, ldx, cp + p * panel_bytes, dp + p * blocks * kQNR, pm, k,
                                 op_, n, r0, r1, p);
      }
    });
  }
  if (b != nullptr)
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < n; ++j) op_[r * n + j] += b[j];
    });
}

at::Tensor quant_linear(const char* op, bool q4, const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& d, const at::Tensor& m,
                        const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, op, "x must be a float32 [M, K] tensor");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  quant_linear_into(op, q4, x, codes, d, m, bias, n, out);
  return out;
}

// The codes rebuilt as fp32 panels [panels, K, kQNR] (linear.cpp's layout), for a product
// too large for the kernels above: the caller hands them to AMX or MKL for that call only.
at::Tensor quant_dequant_panels(const at::Tensor& codes, const at::Tensor& d,
                                const std::optional<at::Tensor>& m, int64_t k) {
  const bool q4 = m.has_value();
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && d.is_contiguous() &&
                  k % kQBlock == 0 && codes.size(1) * kQBlock == k,
              "quant_dequant_panels: codes do not match K = ", k);
  const int64_t panels = codes.size(0), blocks = k / kQBlock;
  const int64_t panel_bytes = blocks * kQBlock * (q4 ? kQNR / 2 : kQNR);
  at::Tensor out = at::empty({panels, k, kQNR}, d.options());
  const char* cp = static_cast<const char*>(codes.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = q4 ? m->data_ptr<float>() : nullptr;
  float* op_ = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = op_ + p * k * kQNR;
      if (q4)
        dequant_slice<true>(cp + p * panel_bytes, dp + p * blocks * kQNR,
                            mp + p * blocks * kQNR, 0, k, dst);
      else
        dequant_slice<false>(cp + p * panel_bytes, dp + p * blocks * kQNR, nullptr, 0, k, dst);
    }
  });
  return out;
}

at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                       const at::Tensor& m, const std::optional<at::Tensor>& bias, int64_t n) {
  return quant_linear("linear_q4_1: ", true, x, codes, d, m, bias, n);
}

at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  return quant_linear("linear_q8_0: ", false, x, codes, d, d, bias, n);
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("linear_q4_1(Tensor x, Tensor codes, Tensor d, Tensor m, Tensor? bias, int n) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor codes, Tensor d, Tensor? bias, int n) -> Tensor");
  m.def("quant_dequant_panels(Tensor codes, Tensor d, Tensor? m, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("linear_q4_1", &tierserve::linear_q4_1);
  m.impl("linear_q8_0", &tierserve::linear_q8_0);
  m.impl("quant_dequant_panels", &tierserve::quant_dequant_panels);
}

// Approximate LM-head logits for a batch of rows from the head's Q8_0 codes and the rows
// quantized to 8 bits twice over, by AVX512_VNNI's dot product (vpdpbusd: 64 byte products
// summed into 16 int32 lanes per instruction), for the greedy head's route at batch sizes
// (greedy.py), where the fp32 route rebuilds every weight block and costs what the full product
// does.
//
// A row x is quantized per block b of 32 inputs: dx_b = max |x_b| / 127, q = round(x / dx_b)
// in [-127, 127], then its remainder r = x - dx_b q the same way (er_b, s): xhat = dx_b q +
// er_b s, within about 2^-16 of x where one pass alone left 2^-8, which the bound's share of
// the logits' spread would otherwise multiply into hundreds of candidates on a flat
// distribution. Codes are held as unsigned bytes (+ 128); per block the int32 sum of (q + 128) w
// over the block's codes w, less 128 times the codes' sum (stored with the codes), is exactly
// the sum of q w. The logit is sum_b d_b (dx_b (q . w) + er_b (s . w)) in fp32.
//
// x_err [M, 2] is, per row, ||x - xhat|| and || |dx q| + |er s| || (elementwise), each
// computed in double and rounded up: what greedy_row's bound adds for the rows' quantization
// and what bounds the fp32 rounding of the sum. A row holding a non-finite value gets inf.
//
// Codes [P, B, 8, 16, 4] int8: per panel of 16 output features and block, eight groups of
// four inputs, each group a feature's four codes side by side (one int32 lane per feature);
// scales [P, B, 16] fp32 and sums [P, B, 16] int32 (128 x the block's codes summed); P even,
// its padding features all zero.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>

namespace tierserve {
namespace {

constexpr int64_t kI8Block = 32;  // inputs per Q8_0 block
constexpr int kI8Feat = 16;      // output features per panel: one int32 lane each
constexpr int kI8Rows = 2;       // rows per tile: 8 int32 and 4 fp32 accumulators; more spill

bool cpu_int8_dot() {
#if defined(__AVX512F__)
  static const bool on = __builtin_cpu_supports("avx512vnni");
  return on;
#else
  return false;
#endif
}

// Whether this library runs int8_head_logits on this CPU.
bool int8_dot() { return kLanes == 16 && cpu_int8_dot(); }

// One pass of a block's quantization: codes + 128 of v [32] at scale max|v| / 127 into q, the
// scale returned; v left holding its remainder.
inline float quantize_block(double* v, uint8_t* q) {
  double amax = 0.0;
  for (int64_t i = 0; i < kI8Block; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = static_cast<float>(amax / 127.0);
  for (int64_t i = 0; i < kI8Block; ++i) {
    const int c = d > 0.0f ? std::clamp(static_cast<int>(std::nearbyint(v[i] / d)), -127, 127) : 0;
    q[i] = static_cast<uint8_t>(c + 128);
    // d c is exact (24 + 8 bits) and within a few binades of v where c != 0, so the remainder
    // is exact or (second pass) within 2^-53 of it: err's 1e-6 margin covers that.
    v[i] -= static_cast<double>(d) * c;
  }
  return d;
}

// Row x [K] -> codes q1, q2 (+ 128) [K] and scales d1, d2 [K / 32]; err[0] = ||x - xhat||,
// err[1] = || |d1 q1| + |d2 q2| ||, both rounded up, or inf for a non-finite row.
void quantize_row(const float* x, int64_t k, uint8_t* q1, uint8_t* q2, float* d1, float* d2,
                  float* err) {
  double rest = 0.0, mag = 0.0;
  for (int64_t b = 0; b < k / kI8Block; ++b) {
    double v[kI8Block], first[kI8Block];
    bool finite = true;
    for (int64_t i = 0; i < kI8Block; ++i) {
      v[i] = x[b * kI8Block + i];
      finite = finite && std::isfinite(v[i]);
    }
    if (!finite) {
      std::fill(q1, q1 + k, uint8_t{128});
      std::fill(q2, q2 + k, uint8_t{128});
      std::fill(d1, d1 + k / kI8Block, 0.0f);
      std::fill(d2, d2 + k / kI8Block, 0.0f);
      err[0] = err[1] = INFINITY;
      return;
    }
    d1[b] = quantize_block(v, q1 + b * kI8Block);
    for (int64_t i = 0; i < kI8Block; ++i) first[i] = x[b * kI8Block + i] - v[i];
    d2[b] = quantize_block(v, q2 + b * kI8Block);
    for (int64_t i = 0; i < kI8Block; ++i) {
      const double second = static_cast<double>(d2[b]) * (q2[b * kI8Block + i] - 128);
      const double a = std::fabs(first[i]) + std::fabs(second);
      rest += v[i] * v[i];
      mag += a * a;
    }
  }
  err[0] = static_cast<float>(std::sqrt(rest) * (1.0 + 1e-6)) * (1.0f + 1e-6f);
  err[1] = static_cast<float>(std::sqrt(mag) * (1.0 + 1e-6)) * (1.0f + 1e-6f);
}

#if defined(__AVX512F__)
// out[r][0 .. 32) for MR rows and one pair of panels (p0, p0 + 1), over all blocks; q1, q2 and
// d1, d2 the rows' two passes of codes and scales.
template <int MR>
__attribute__((target("avx512vnni"))) void int8_tile(
    const uint8_t* q1, const uint8_t* q2, int64_t k, const float* d1, const float* d2,
    const int8_t* codes, const float* scales, const int32_t* sums, int64_t p0, float* out,
    int64_t ldo, int64_t cols) {
  const int64_t blocks = k / kI8Block;
  const int64_t panel_codes = blocks * kI8Block * kI8Feat, panel_meta = blocks * kI8Feat;
  const int8_t* w[2] = {codes + p0 * panel_codes, codes + (p0 + 1) * panel_codes};
  const float* s[2] = {scales + p0 * panel_meta, scales + (p0 + 1) * panel_meta};
  const int32_t* c[2] = {sums + p0 * panel_meta, sums + (p0 + 1) * panel_meta};
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i one[MR][2], two[MR][2];
    for (int r = 0; r < MR; ++r)
      one[r][0] = one[r][1] = two[r][0] = two[r][1] = _mm512_setzero_si512();
    for (int g = 0; g < kI8Block / 4; ++g) {
      const int64_t at = (b * (kI8Block / 4) + g) * 64;
      const __m512i w0 = _mm512_loadu_si512(w[0] + at), w1 = _mm512_loadu_si512(w[1] + at);
      for (int r = 0; r < MR; ++r) {
        int32_t a, e;
        __builtin_memcpy(&a, q1 + r * k + b * kI8Block + g * 4, 4);
        __builtin_memcpy(&e, q2 + r * k + b * kI8Block + g * 4, 4);
        const __m512i av = _mm512_set1_epi32(a), ev = _mm512_set1_epi32(e);
        one[r][0] = _mm512_dpbusd_epi32(one[r][0], av, w0);
        one[r][1] = _mm512_dpbusd_epi32(one[r][1], av, w1);
        two[r][0] = _mm512_dpbusd_epi32(two[r][0], ev, w0);
        two[r][1] = _mm512_dpbusd_epi32(two[r][1], ev, w1);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i sum = _mm512_loadu_si512(c[h] + b * kI8Feat);
      const __m512 scale = _mm512_loadu_ps(s[h] + b * kI8Feat);
      for (int r = 0; r < MR; ++r) {
        const __m512 x1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(one[r][h], sum));
        const __m512 x2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(two[r][h], sum));
        acc[r][h] = _mm512_fmadd_ps(x1, _mm512_mul_ps(scale, _mm512_set1_ps(d1[r * blocks + b])),
                                    acc[r][h]);
        acc[r][h] = _mm512_fmadd_ps(x2, _mm512_mul_ps(scale, _mm512_set1_ps(d2[r * blocks + b])),
                                    acc[r][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t from = h * kI8Feat, n = std::clamp<int64_t>(cols - from, 0, kI8Feat);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + from, mask, acc[r][h]);
  }
}

using I8Tile = void (*)(const uint8_t*, const uint8_t*, int64_t, const float*, const float*,
                        const int8_t*, const float*, const int32_t*, int64_t, float*, int64_t,
                        int64_t);
template <int... R>
constexpr std::array<I8Tile, sizeof...(R)> i8_tiles(std::integer_sequence<int, R...>) {
  return {&int8_tile<R + 1>...};
}
constexpr auto kI8Tiles = i8_tiles(std::make_integer_sequence<int, kI8Rows>{});
#endif

std::tuple<at::Tensor, at::Tensor> int8_head_logits(const at::Tensor& x, const at::Tensor& codes,
                                                    const at::Tensor& scales,
                                                    const at::Tensor& sums, int64_t n) {
  const char* op = "int8_head_logits: ";
  TORCH_CHECK(int8_dot(), op, "needs a CPU with AVX512_VNNI and the avx512 or amx library");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              op, "x must be a contiguous float32 [M, K] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kI8Block;
  TORCH_CHECK(k > 0 && k % kI8Block == 0, op, "K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 5 && codes.is_contiguous() &&
                  codes.size(0) % 2 == 0 && codes.size(1) == blocks && codes.size(2) == 8 &&
                  codes.size(3) == kI8Feat && codes.size(4) == 4,
              op, "codes must be contiguous int8 [P, ", blocks, ", 8, 16, 4], P even");
  const int64_t panels = codes.size(0);
  TORCH_CHECK(n > 0 && n <= panels * kI8Feat, op, "n must be in [1, ", panels * kI8Feat, "]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == panels * blocks * kI8Feat,
              op, "scales must be contiguous float32 [P, B, 16]");
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.is_contiguous() &&
                  sums.numel() == panels * blocks * kI8Feat,
              op, "sums must be contiguous int32 [P, B, 16]");
  at::Tensor q = at::empty({2, m, k}, x.options().dtype(at::kByte));
  at::Tensor dx = at::empty({2, m, blocks}, x.options());
  at::Tensor err = at::empty({m, 2}, x.options());
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* q1 = q.data_ptr<uint8_t>();
  uint8_t* q2 = q1 + m * k;
  float* d1 = dx.data_ptr<float>();
  float* d2 = d1 + m * blocks;
  float* ep = err.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * k, k, q1 + r * k, q2 + r * k, d1 + r * blocks, d2 + r * blocks,
                   ep + 2 * r);
  });
#if defined(__AVX512F__)
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int32_t* up = sums.data_ptr<int32_t>();
  float* op_ = out.data_ptr<float>();
  // Items are pairs of panels, each over all rows: a pair's codes (18 KiB at K = 576) stay in
  // L1 while the row tiles reuse them, and each thread streams its own share of the codes.
  const int64_t pairs = (std::min(panels, (n + kI8Feat - 1) / kI8Feat) + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t col = pair * 2 * kI8Feat, cols = std::min<int64_t>(2 * kI8Feat, n - col);
      for (int64_t r = 0; r < m; r += kI8Rows) {
        const int64_t rows = std::min<int64_t>(kI8Rows, m - r);
        kI8Tiles[rows - 1](q1 + r * k, q2 + r * k, k, d1 + r * blocks, d2 + r * blocks, cp, sp,
                           up, 2 * pair, op_ + r * n + col, n, cols);
      }
    }
  });
#endif
  return {out, err};
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("int8_dot() -> bool", &tierserve::int8_dot);
  m.def("int8_head_logits(Tensor x, Tensor codes, Tensor scales, Tensor sums, int n) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("int8_head_logits", &tierserve::int8_head_logits);
}

// Approximate LM-head logits for a batch of rows from the head's Q8_0 codes and the rows
// quantized to 8 bits, by AVX512_VNNI's dot product (vpdpbusd: 64 byte products summed into 16
// int32 lanes per instruction), for the greedy head's route at batch sizes (greedy.py), where
// the fp32 route rebuilds every weight block and costs what the full product does.
//
// A row x is quantized per block b of 32 inputs: dx_b = max |x_b| / 127, q = round(x / dx_b)
// in [-127, 127], then its remainder r = x - dx_b q the same way (er_b, s): xhat = dx_b q +
// er_b s, within about 2^-16 of x where one pass alone left 2^-8. The head's codes are held as
// unsigned bytes (w + 128), vpdpbusd's unsigned operand; per block the int32 sum of (w + 128) q,
// less 128 times the row's sum of q over the block (kept with the row's codes), is exactly
// the sum of q w. The logit is sum_b d_b (dx_b (q . w) [+ er_b (s . w)]) in fp32.
//
// int8_head_logits gives the logits of one pass or of both; int8_greedy.cpp runs the passes
// where the greedy head needs them.
//
// x_err [M, 2] is, per row, ||x - xhat|| and || |dx q| (+ |er s|) || (elementwise), each
// computed in double and rounded up: what greedy_head.cpp's bound adds for the rows'
// quantization and what bounds the fp32 rounding of the sum. A row holding a non-finite value
// gets inf.
//
// Codes [pairs, B, 8, 2, 16, 4] uint8 (w + 128): per pair of panels of 16 output features (a
// Q8_0 panel of quant.cpp's 32), block and group of four inputs, each panel's 16 features' four
// codes side by side (one int32 lane per feature), so that a tile reads its pair's codes
// strictly in order; scales [pairs, B, 32] fp32, both panels' per block. Padding features: codes
// 128 (w = 0), scales 0.

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

// One pass of a block's quantization: codes of v [32] at scale max|v| / 127 into q and 128 x
// their sum (the correction for the head's codes + 128) into *shift, the scale returned; v left
// holding its remainder.
inline float quantize_block(double* v, int8_t* q, int32_t* shift) {
  double amax = 0.0;
  for (int64_t i = 0; i < kI8Block; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = static_cast<float>(amax / 127.0);
  int32_t sum = 0;
  for (int64_t i = 0; i < kI8Block; ++i) {
    const int c = d > 0.0f ? std::clamp(static_cast<int>(std::nearbyint(v[i] / d)), -127, 127) : 0;
    q[i] = static_cast<int8_t>(c);
    sum += c;
    // d c is exact (24 + 8 bits) and within a few binades of v where c != 0, so the remainder
    // is exact or (second pass) within 2^-53 of it: err's 1e-6 margin covers that.
    v[i] -= static_cast<double>(d) * c;
  }
  *shift = 128 * sum;
  return d;
}

// Row x [K] -> codes q1, q2 [K], scales d1, d2 [K / 32] and 128 x the codes' block sums s1, s2
// [K / 32]; err [4]: per number of passes p (1, 2), ||x - xhat_p|| and || the elementwise sum
// of |each pass's terms| ||, rounded up, or inf for a non-finite row.
void quantize_row(const float* x, int64_t k, int8_t* q1, int8_t* q2, float* d1, float* d2,
                  int32_t* s1, int32_t* s2, float* err) {
  double rest1 = 0.0, mag1 = 0.0, rest2 = 0.0, mag2 = 0.0;
  for (int64_t b = 0; b < k / kI8Block; ++b) {
    double v[kI8Block], first[kI8Block];
    bool finite = true;
    for (int64_t i = 0; i < kI8Block; ++i) {
      v[i] = x[b * kI8Block + i];
      finite = finite && std::isfinite(v[i]);
    }
    if (!finite) {
      std::fill(q1, q1 + k, int8_t{0});
      std::fill(q2, q2 + k, int8_t{0});
      std::fill(d1, d1 + k / kI8Block, 0.0f);
      std::fill(d2, d2 + k / kI8Block, 0.0f);
      std::fill(s1, s1 + k / kI8Block, 0);
      std::fill(s2, s2 + k / kI8Block, 0);
      std::fill(err, err + 4, INFINITY);
      return;
    }
    d1[b] = quantize_block(v, q1 + b * kI8Block, s1 + b);
    for (int64_t i = 0; i < kI8Block; ++i) {
      first[i] = x[b * kI8Block + i] - v[i];
      rest1 += v[i] * v[i];
      mag1 += first[i] * first[i];
    }
    d2[b] = quantize_block(v, q2 + b * kI8Block, s2 + b);
    for (int64_t i = 0; i < kI8Block; ++i) {
      const double second = static_cast<double>(d2[b]) * q2[b * kI8Block + i];
      const double a = std::fabs(first[i]) + std::fabs(second);
      rest2 += v[i] * v[i];
      mag2 += a * a;
    }
  }
  const double sums[4] = {rest1, mag1, rest2, mag2};
  for (int i = 0; i < 4; ++i)
    err[i] = static_cast<float>(std::sqrt(sums[i]) * (1.0 + 1e-6)) * (1.0f + 1e-6f);
}

// Rows quantized by quantize_row: row r's pass p codes at q[p] + r k, scales and shifted sums
// at d[p] + r k / 32 and s[p] + r k / 32, its err at err + 4 r.
struct QuantRows {
  at::Tensor storage, scales, sums, errs;
  const int8_t* q[2];
  const float* d[2];
  const int32_t* s[2];
  const float* err;
  int64_t k;
};

QuantRows quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kI8Block;
  QuantRows rows;
  rows.storage = at::empty({2, m, k}, x.options().dtype(at::kChar));
  rows.scales = at::empty({2, m, blocks}, x.options());
  rows.sums = at::empty({2, m, blocks}, x.options().dtype(at::kInt));
  rows.errs = at::empty({m, 4}, x.options());
  int8_t* q = rows.storage.data_ptr<int8_t>();
  float* d = rows.scales.data_ptr<float>();
  int32_t* s = rows.sums.data_ptr<int32_t>();
  float* err = rows.errs.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * k, k, q + r * k, q + (m + r) * k, d + r * blocks,
                   d + (m + r) * blocks, s + r * blocks, s + (m + r) * blocks, err + 4 * r);
  });
  rows.q[0] = q, rows.q[1] = q + m * k;
  rows.d[0] = d, rows.d[1] = d + m * blocks;
  rows.s[0] = s, rows.s[1] = s + m * blocks;
  rows.err = err;
  rows.k = k;
  return rows;
}

// A head's codes in int8_head_logits' layout.
struct HeadCodes {
  const uint8_t* codes;
  const float* scales;
  int64_t panels;
};

#if defined(__AVX512F__)
// out[r][0 .. NP 16) for MR rows from r0 and NP panels from p0, over all blocks, from the
// rows' first PASSES passes of codes.
template <int MR, int NP, int PASSES>
__attribute__((target("avx512vnni"))) void int8_tile(const QuantRows& x, int64_t r0,
                                                     const HeadCodes& head, int64_t p0,
                                                     float* out, int64_t ldo, int64_t cols) {
  const int64_t k = x.k, blocks = k / kI8Block;
  // Panel p is half p % 2 of pair p / 2, whose stream holds per block and group both halves'
  // 64 bytes, and per block both halves' 16 scales.
  const uint8_t* w[NP];
  const float* s[NP];
  for (int h = 0; h < NP; ++h) {
    const int64_t pair = (p0 + h) / 2, half = (p0 + h) % 2;
    w[h] = head.codes + pair * blocks * 2 * kI8Block * kI8Feat + half * 64;
    s[h] = head.scales + pair * blocks * 2 * kI8Feat + half * kI8Feat;
  }
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < NP; ++h) acc[r][h] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[PASSES][MR][NP];
    for (int p = 0; p < PASSES; ++p)
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < NP; ++h) dot[p][r][h] = _mm512_setzero_si512();
    for (int g = 0; g < kI8Block / 4; ++g) {
      const int64_t at = (b * (kI8Block / 4) + g) * 2 * 64;
      __m512i wv[NP];
      for (int h = 0; h < NP; ++h) wv[h] = _mm512_loadu_si512(w[h] + at);
      for (int p = 0; p < PASSES; ++p)
        for (int r = 0; r < MR; ++r) {
          int32_t a;
          __builtin_memcpy(&a, x.q[p] + (r0 + r) * k + b * kI8Block + g * 4, 4);
          const __m512i av = _mm512_set1_epi32(a);
          for (int h = 0; h < NP; ++h) dot[p][r][h] = _mm512_dpbusd_epi32(dot[p][r][h], wv[h], av);
        }
    }
    for (int h = 0; h < NP; ++h) {
      const __m512 scale = _mm512_loadu_ps(s[h] + 2 * b * kI8Feat);
      for (int r = 0; r < MR; ++r)
        for (int p = 0; p < PASSES; ++p) {
          const int64_t rb = (r0 + r) * blocks + b;
          const __m512 xs = _mm512_cvtepi32_ps(
              _mm512_sub_epi32(dot[p][r][h], _mm512_set1_epi32(x.s[p][rb])));
          const __m512 ds = _mm512_set1_ps(x.d[p][rb]);
          acc[r][h] = _mm512_fmadd_ps(xs, _mm512_mul_ps(scale, ds), acc[r][h]);
        }
    }
  }
  for (int h = 0; h < NP; ++h) {
    const int64_t from = h * kI8Feat, n = std::clamp<int64_t>(cols - from, 0, kI8Feat);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + from, mask, acc[r][h]);
  }
}

using I8Tile = void (*)(const QuantRows&, int64_t, const HeadCodes&, int64_t, float*, int64_t,
                        int64_t);
template <int PASSES, int... R>
constexpr std::array<I8Tile, sizeof...(R)> i8_tiles(std::integer_sequence<int, R...>) {
  return {&int8_tile<R + 1, 2, PASSES>...};
}
// Row tiles over a pair of panels: one pass keeps 4 rows' accumulators in registers, two keep 2.
constexpr auto kOnePassTiles = i8_tiles<1>(std::make_integer_sequence<int, 4>{});
constexpr auto kTwoPassTiles = i8_tiles<2>(std::make_integer_sequence<int, 2>{});
#endif

// out [M, n] = the approximate logits of x's rows from their first `passes` passes.
void pass_logits(const QuantRows& x, int64_t m, const HeadCodes& head, int64_t n, int passes,
                 float* out) {
#if defined(__AVX512F__)
  const auto& tiles = passes == 1 ? kOnePassTiles.data() : kTwoPassTiles.data();
  const int64_t tile_rows = passes == 1 ? kOnePassTiles.size() : kTwoPassTiles.size();
  // Items are pairs of panels, each over all rows: a pair's codes (18 KiB at K = 576) stay in
  // L1 while the row tiles reuse them, and each thread streams its own share of the codes.
  const int64_t pairs = (std::min(head.panels, (n + kI8Feat - 1) / kI8Feat) + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t col = pair * 2 * kI8Feat, cols = std::min<int64_t>(2 * kI8Feat, n - col);
      for (int64_t r = 0; r < m; r += tile_rows) {
        const int64_t rows = std::min<int64_t>(tile_rows, m - r);
        tiles[rows - 1](x, r, head, 2 * pair, out + r * n + col, n, cols);
      }
    }
  });
#else
  (void)x, (void)m, (void)head, (void)n, (void)passes, (void)out;
#endif
}

void check_int8_head(const char* op, const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(int8_dot(), op, "needs a CPU with AVX512_VNNI and the avx512 or amx library");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              op, "x must be a contiguous float32 [M, K] CPU tensor");
  const int64_t k = x.size(1), blocks = k / kI8Block;
  TORCH_CHECK(k > 0 && k % kI8Block == 0, op, "K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 6 && codes.is_contiguous() &&
                  codes.size(1) == blocks && codes.size(2) == 8 && codes.size(3) == 2 &&
                  codes.size(4) == kI8Feat && codes.size(5) == 4,
              op, "codes must be contiguous uint8 [pairs, ", blocks, ", 8, 2, 16, 4]");
  const int64_t panels = 2 * codes.size(0);
  TORCH_CHECK(n > 0 && n <= panels * kI8Feat, op, "n must be in [1, ", panels * kI8Feat, "]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == panels * blocks * kI8Feat,
              op, "scales must be contiguous float32 [pairs, B, 32]");
}

HeadCodes head_codes(const at::Tensor& codes, const at::Tensor& scales) {
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), 2 * codes.size(0)};
}

std::tuple<at::Tensor, at::Tensor> int8_head_logits(const at::Tensor& x, const at::Tensor& codes,
                                                    const at::Tensor& scales, int64_t n,
                                                    int64_t passes) {
  const char* op = "int8_head_logits: ";
  check_int8_head(op, x, codes, scales, n);
  TORCH_CHECK(passes == 1 || passes == 2, op, "passes must be 1 or 2, got ", passes);
  const QuantRows rows = quantize_rows(x);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  pass_logits(rows, x.size(0), head_codes(codes, scales), n, static_cast<int>(passes),
              out.data_ptr<float>());
  return {out, rows.errs.narrow(1, 2 * (passes - 1), 2).contiguous()};
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("int8_dot() -> bool", &tierserve::int8_dot);
  m.def("int8_head_logits(Tensor x, Tensor codes, Tensor scales, int n, int passes=2) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("int8_head_logits", &tierserve::int8_head_logits);
}

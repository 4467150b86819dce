// Approximate LM-head logits for a batch of rows from the head's Q8_0 codes and the rows
// quantized to 8 bits, by AVX512_VNNI's dot product (vpdpbusd: 64 byte products summed into 16
// int32 lanes per instruction), for the greedy head's route at batch sizes (greedy.py), where
// the fp32 route rebuilds every weight block and costs what the full product does.
//
// A row x is quantized per block b of 32 inputs: dx_b = max |x_b| / 127, q = round(x / dx_b)
// in [-127, 127], held as the unsigned byte q + 128. Per block the int32 sum of (q + 128) w
// over the block's codes w, less 128 times the codes' sum (stored with the codes), is exactly
// the sum of q w; the logit is then sum_b (dx_b d_b) * that, in fp32. x_err = ||x - xhat||
// (xhat_k = dx_b q_k), computed in double and rounded up, is what greedy_row's bound adds for
// the rows' quantization. A row holding a non-finite value gets x_err = inf (greedy_row then
// leaves it to the full product).
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
#include <cmath>
#include <cstdint>
#include <tuple>

namespace tierserve {
namespace {

constexpr int64_t kI8Block = 32;  // inputs per Q8_0 block
constexpr int kI8Feat = 16;      // output features per panel: one int32 lane each
constexpr int kI8Rows = 4;       // rows per tile: 2 x 4 int32 and 2 x 4 fp32 accumulators

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

// Row r of x [M, K] -> bytes q + 128 [K], scales dx [K / 32]; returns ||x - xhat|| rounded up,
// or inf for a non-finite row.
float quantize_row(const float* x, int64_t k, uint8_t* q, float* dx) {
  double err = 0.0;
  for (int64_t b = 0; b < k / kI8Block; ++b) {
    const float* xb = x + b * kI8Block;
    float amax = 0.0f;
    for (int64_t i = 0; i < kI8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    if (!std::isfinite(amax)) {
      std::fill(q, q + k, uint8_t{128});
      std::fill(dx, dx + k / kI8Block, 0.0f);
      return INFINITY;
    }
    const float d = amax / 127.0f;
    dx[b] = d;
    for (int64_t i = 0; i < kI8Block; ++i) {
      const int v = d > 0.0f ? static_cast<int>(std::nearbyint(xb[i] / d)) : 0;
      const int c = std::clamp(v, -127, 127);
      q[b * kI8Block + i] = static_cast<uint8_t>(c + 128);
      const double e = static_cast<double>(xb[i]) - static_cast<double>(d) * c;
      err += e * e;
    }
  }
  return static_cast<float>(std::sqrt(err) * (1.0 + 1e-6)) * (1.0f + 1e-6f);
}

#if defined(__AVX512F__)
// out[r][0 .. 32) for MR rows and one pair of panels (p0, p0 + 1), over all blocks.
template <int MR>
__attribute__((target("avx512vnni"))) void int8_tile(
    const uint8_t* q, int64_t k, const float* dx, const int8_t* codes, const float* scales,
    const int32_t* sums, int64_t p0, float* out, int64_t ldo, int64_t cols) {
  const int64_t blocks = k / kI8Block;
  const int64_t panel_codes = blocks * kI8Block * kI8Feat, panel_meta = blocks * kI8Feat;
  const int8_t* w[2] = {codes + p0 * panel_codes, codes + (p0 + 1) * panel_codes};
  const float* s[2] = {scales + p0 * panel_meta, scales + (p0 + 1) * panel_meta};
  const int32_t* c[2] = {sums + p0 * panel_meta, sums + (p0 + 1) * panel_meta};
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][2];
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int g = 0; g < kI8Block / 4; ++g) {
      const int64_t at = (b * (kI8Block / 4) + g) * 64;
      const __m512i w0 = _mm512_loadu_si512(w[0] + at), w1 = _mm512_loadu_si512(w[1] + at);
      for (int r = 0; r < MR; ++r) {
        int32_t four;
        __builtin_memcpy(&four, q + r * k + b * kI8Block + g * 4, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], xv, w0);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], xv, w1);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i sum = _mm512_loadu_si512(c[h] + b * kI8Feat);
      const __m512 scale = _mm512_loadu_ps(s[h] + b * kI8Feat);
      for (int r = 0; r < MR; ++r) {
        const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][h], sum));
        acc[r][h] = _mm512_fmadd_ps(exact, _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * blocks + b])),
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

using I8Tile = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, const float*,
                        const int32_t*, int64_t, float*, int64_t, int64_t);
constexpr I8Tile kI8Tiles[kI8Rows] = {&int8_tile<1>, &int8_tile<2>, &int8_tile<3>,
                                      &int8_tile<4>};
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
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kByte));
  at::Tensor dx = at::empty({m, blocks}, x.options());
  at::Tensor err = at::empty({m}, x.options());
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* dp = dx.data_ptr<float>();
  float* ep = err.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ep[r] = quantize_row(xp + r * k, k, qp + r * k, dp + r * blocks);
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
        kI8Tiles[rows - 1](qp + r * k, k, dp + r * blocks, cp, sp, up, 2 * pair,
                           op_ + r * n + col, n, cols);
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

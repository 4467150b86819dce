// bf16 linears on AVX512_BF16's dot product (vdpbf16ps), over weights packed in k pairs.
//
// Widening bf16 weights to fp32 costs a decode step's single row two conversions and two FMAs
// per 32 weights, which caps the panel kernel below what memory delivers on a fast machine.
// vdpbf16ps multiplies 32 bf16 pairs and adds both products to 16 fp32 lanes in one
// instruction: a quarter of the work per weight. Its operands are pairs (k = 2j, 2j + 1) of
// inputs and of weights, so a pair panel ([ceil(N / kNR), K / 2, 2 kNR] bf16, panels.h) holds,
// for each k pair j, its kNR output features' weight pairs side by side: two zmm.
//
// Every output element is one chain of vdpbf16ps over j = 0 .. K/2 - 1 in order, from zero,
// then the bias and one rounding to bf16: the same for every M, thread count and split, and in
// the greedy head's exact columns (exact_pair_columns), which run the same instruction per lane.
// The products of two bf16 are exact in fp32; the instruction adds them in its own order and
// treats subnormal inputs as zero, so results differ from the widening path's in the last bits.
//
// Compiled in the AVX-512 variants and used where the CPU has AVX512_BF16 (cpu_bf16_dot);
// included by kernels.cpp before linear.cpp, which dispatches to it by the panels' shape.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace tierserve {
namespace {

#if defined(__AVX512F__)

inline bool cpu_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

constexpr int64_t kPairRow = 2 * kPanel;  // bf16 per k pair of a panel: two zmm
// Panels a single row runs at once: 4 chains, each a dot product of a k pair, keep ahead of
// the memory; two weight streams a thread, which the hardware prefetchers follow (software
// prefetches of them, and 8 streams a thread, measured 2-4% slower on Zen 5).
constexpr int kPairGroup = 2;
constexpr int kPairMaxMR = 12;            // rows per microkernel: 24 accumulators + 3
constexpr int64_t kPairKC = 128;          // k pairs per block: a 16 KiB panel slice in L1

inline uint32_t input_pair(const c10::BFloat16* x) {
  uint32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// c[kNR * G] = one row's pairs a[k2] through G consecutive pair panels.
template <int G>
__attribute__((target("avx512bf16"))) void row_pair_panels(int64_t k2, const uint32_t* a,
                                                           const c10::BFloat16* b, float* c) {
  const int64_t stride = k2 * kPairRow;
  __m512 lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k2; ++i) {
    const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i]));
    for (int g = 0; g < G; ++g) {
      const c10::BFloat16* p = b + g * stride + i * kPairRow;
      lo[g] = _mm512_dpbf16_ps(lo[g], av, (__m512bh)_mm512_loadu_si512(p));
      hi[g] = _mm512_dpbf16_ps(hi[g], av, (__m512bh)_mm512_loadu_si512(p + 32));
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm512_storeu_ps(c + g * kPanel, lo[g]);
    _mm512_storeu_ps(c + g * kPanel + kLanes, hi[g]);
  }
}

template <int G = kPairGroup>
void row_pair_panels_n(int64_t count, int64_t k2, const uint32_t* a, const c10::BFloat16* b,
                       float* c) {
  if constexpr (G > 1) {
    if (count < G) return row_pair_panels_n<G - 1>(count, k2, a, b, c);
  }
  row_pair_panels<G>(k2, a, b, c);
}

// c[MR][kNR] (row stride ldc) = (first ? 0 : c) + rows a (bf16, row stride lda, kc2 pairs) through
// one pair panel's slice b; prefetches pf_lines cache lines from pf on (the next slice's share).
template <int MR>
__attribute__((target("avx512bf16"))) void pair_microkernel(
    int64_t kc2, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, float* c,
    int64_t ldc, bool first, const char* pf, int64_t pf_lines) {
  __m512 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
    hi[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + kLanes);
  }
  for (int64_t i = 0; i < kc2; ++i) {
    if (i < pf_lines) __builtin_prefetch(pf + i * 64, 0, 2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + i * kPairRow);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + i * kPairRow + 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh av =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(input_pair(a + r * lda + 2 * i)));
      lo[r] = _mm512_dpbf16_ps(lo[r], av, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], av, w1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(c + r * ldc, lo[r]);
    _mm512_storeu_ps(c + r * ldc + kLanes, hi[r]);
  }
}

using PairMicro = void (*)(int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, float*,
                           int64_t, bool, const char*, int64_t);

template <int... MR>
constexpr auto pair_micro_table(std::integer_sequence<int, MR...>) {
  return std::array<PairMicro, sizeof...(MR)>{&pair_microkernel<MR + 1>...};
}
constexpr auto kPairMicro = pair_micro_table(std::make_integer_sequence<int, kPairMaxMR>{});

// Rows [m0, m1) through pair panel p into out [M, n] fp32 (no bias); a partial last panel goes
// through a scratch tile per row tile, of which only its columns are copied.
void run_pair_panel(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* packed, float* out,
                    int64_t n, int64_t k, int64_t m0, int64_t m1, int64_t p) {
  const int64_t col = p * kPanel, width = std::min<int64_t>(kPanel, n - col);
  const c10::BFloat16* panel = packed + p * k * kPanel;
  const int64_t rows = m1 - m0, tiles = (rows + kPairMaxMR - 1) / kPairMaxMR, k2 = k / 2;
  alignas(64) float tail[kPairMaxMR * kPanel];
  for (int64_t kc = 0; kc < k2; kc += kPairKC) {
    const int64_t kn = std::min(kPairKC, k2 - kc);
    // While the row tiles reuse this slice from L1, they prefetch the next one, a share each.
    const char* next = reinterpret_cast<const char*>(panel + (kc + kn) * kPairRow);
    const int64_t lines = kc + kn < k2 ? kn * kPairRow * 2 / 64 : 0;
    const int64_t share = (lines + tiles - 1) / tiles;
    for (int64_t t = 0, r0 = m0; t < tiles; ++t) {
      const int64_t mr = rows / tiles + (t < rows % tiles ? 1 : 0);
      const bool full = width == kPanel;
      float* c = full ? out + r0 * n + col : tail;
      const int64_t ldc = full ? n : kPanel;
      if (!full && kc > 0)  // the scratch tile holds another row tile's sums: reload this one's
        for (int64_t r = 0; r < mr; ++r)
          std::copy_n(out + (r0 + r) * n + col, width, tail + r * kPanel);
      kPairMicro[mr - 1](kn, x + r0 * ldx + 2 * kc, ldx, panel + kc * kPairRow, c, ldc, kc == 0,
                         next + t * share * 64, std::max<int64_t>(0, std::min(share,
                                                                 lines - t * share)));
      if (!full)
        for (int64_t r = 0; r < mr; ++r)
          std::copy_n(tail + r * kPanel, width, out + (r0 + r) * n + col);
      r0 += mr;
    }
  }
}

// out[M, n] fp32 = x[M, K] bf16 (row stride ldx, K even) through `panels` pair panels, no bias.
void pair_product(const c10::BFloat16* xp, int64_t ldx, int64_t m, int64_t k,
                  const c10::BFloat16* wp, int64_t panels, float* op, int64_t n) {
  const int64_t k2 = k / 2;
  if (m == 1) {
    const uint32_t* a = reinterpret_cast<const uint32_t*>(xp);
    single_row_panels(
        panels, n / kPanel, kPairGroup,
        [&](int64_t p, int64_t count) {
          row_pair_panels_n(count, k2, a, wp + p * k * kPanel, op + p * kPanel);
        },
        [&](int64_t p) { run_pair_panel(xp, ldx, wp, op, n, k, 0, 1, p); });
    return;
  }
  // Items (row block, panel), panel-major within a row block, as the widening path's.
  constexpr int64_t kRowBlock = 192;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rb = i / panels, p = i % panels;
      run_pair_panel(xp, ldx, wp, op, n, k, m * rb / row_blocks, m * (rb + 1) / row_blocks, p);
    }
  });
}

// out[1, n] bf16 = round(x[1, K] W^T + b) (b null: + 0, as finish_half adds it) through the pair
// panels: each claim's chains into a scratch tile, rounded there by the thread that ran them,
// so that one row needs no fp32 product of its own and no pass over it after the join. The
// partial last panel runs whole (its padding weights are zero): the same chain per column.
void pair_row_half(const c10::BFloat16* xp, int64_t k, const c10::BFloat16* wp, int64_t panels,
                   const c10::BFloat16* bias, c10::BFloat16* out, int64_t n) {
  const uint32_t* a = reinterpret_cast<const uint32_t*>(xp);
  const int64_t k2 = k / 2;
  auto finish = [&](const float* tile, int64_t col, int64_t width) {
    for (int64_t j = 0; j < width; ++j)
      out[col + j] = static_cast<c10::BFloat16>(
          tile[j] + (bias != nullptr ? static_cast<float>(bias[col + j]) : 0.0f));
  };
  single_row_panels(
      panels, n / kPanel, kPairGroup,
      [&](int64_t p, int64_t count) {
        alignas(64) float tile[kPairGroup * kPanel];
        row_pair_panels_n(count, k2, a, wp + p * k * kPanel, tile);
        finish(tile, p * kPanel, count * kPanel);
      },
      [&](int64_t p) {
        alignas(64) float tile[kPanel];
        row_pair_panels<1>(k2, a, wp + p * k * kPanel, tile);
        finish(tile, p * kPanel, n - p * kPanel);
      });
}

// out[L] = columns cols[L] of x W^T, each by the chain pair_product runs for it (the same
// instruction, a lane per column); x holds bf16 values in fp32.
template <int L>
__attribute__((target("avx512bf16,avx512vl"))) void exact_pair_columns(
    const float* x, const c10::BFloat16* packed, int64_t k, const int64_t* cols, float* out) {
  static_assert(L == 8, "one ymm of columns");
  const uint32_t* base[L];
  for (int l = 0; l < L; ++l)
    base[l] = reinterpret_cast<const uint32_t*>(packed + (cols[l] / kPanel) * k * kPanel) +
              cols[l] % kPanel;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < k / 2; ++j) {
    uint32_t lo, hi;
    std::memcpy(&lo, x + 2 * j, sizeof(lo));
    std::memcpy(&hi, x + 2 * j + 1, sizeof(hi));
    const uint32_t pair = (lo >> 16) | (hi & 0xFFFF0000u);
    const int64_t at = j * kPanel;  // a k pair of a panel is kNR words
    const __m256i w = _mm256_setr_epi32(
        static_cast<int>(base[0][at]), static_cast<int>(base[1][at]),
        static_cast<int>(base[2][at]), static_cast<int>(base[3][at]),
        static_cast<int>(base[4][at]), static_cast<int>(base[5][at]),
        static_cast<int>(base[6][at]), static_cast<int>(base[7][at]));
    acc = _mm256_dpbf16_ps(acc, (__m256bh)_mm256_set1_epi32(static_cast<int>(pair)),
                           (__m256bh)w);
  }
  _mm256_storeu_ps(out, acc);
}

#else  // AVX2 builds: no pair panels

inline bool cpu_bf16_dot() { return false; }

inline void pair_product(const c10::BFloat16*, int64_t, int64_t, int64_t, const c10::BFloat16*,
                         int64_t, float*, int64_t) {
  TORCH_CHECK(false, "pair panels need an AVX-512 build");
}

inline void pair_row_half(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                          const c10::BFloat16*, c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "pair panels need an AVX-512 build");
}

template <int L>
void exact_pair_columns(const float*, const c10::BFloat16*, int64_t, const int64_t*, float*) {
  TORCH_CHECK(false, "pair panels need an AVX-512 build");
}

#endif

// Whether bf16 weights of an even K are packed in pairs for this library on this CPU.
bool bf16_pairs() { return kLanes == 16 && cpu_bf16_dot(); }

}  // namespace
}  // namespace tierserve

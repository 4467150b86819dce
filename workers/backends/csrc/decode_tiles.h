// Decode attention's work on one tile of kTile tokens of one item (paged_attention.cpp): the
// query heads' scores against the tile's K rows, their online softmax, and the V rows
// accumulated into the heads' outputs. Rows come as arrays of pointers into the paged pool, so
// nothing here knows blocks or tables.
//
// Vectorised with vec.h's Vec (one register of floats; head dims are multiples of it): g++ turns
// plain loops here into gathers and scalar adds. D and the heads done at once are template
// parameters, so rows are fixed numbers of Vecs and the accumulators stay in registers.
#pragma once

#include "attention_math.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace tierserve {
namespace {

constexpr int kTile = 32;   // tokens scored between two online-softmax rescales

// Query heads scored and accumulated at once per KV head: their accumulator rows and one K or
// V row fit in half the vector registers.
template <int D>
constexpr int kHeadsAtOnce = std::max(1, (kVecRegs / 2) / (D / kLanes));

// kLanes Vecs -> one Vec whose lane i is the sum of v[i]'s lanes: a tree of two-source shuffles,
// each level halving the lanes every input owns (kLanes - 1 shuffle pairs in all, against
// kLanes horizontal sums).
inline Vec transpose_sum(Vec* v) {
#if defined(__AVX512F__)
  for (int i = 0; i < 8; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
#else
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// Blocks are scattered over the pool, which the hardware prefetchers cannot follow, and decode
// attention is bound by memory: rows a few tokens ahead are prefetched a row at a time,
// interleaved with the current tile's work (see score_tile, accumulate_heads); issued all at
// once they would stall on the core's queue of outstanding misses. They go to L2
// (prefetcht2), not L1: an L1 prefetch holds one of L1's few miss buffers until its line
// arrives, L2's queue is deeper, so more rows are in flight, and a line in L2 reaches L1 in a
// few cycles when used. Always inlined: GCC finds a separate copy free of side effects (a
// prefetch is none) and deletes its calls.
template <typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* row, int bytes) {
  if (row == nullptr) return;
  const char* at = reinterpret_cast<const char*>(row);
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, 1);
}

// p[h][j] <- q[h] . k[j][h / group] for the item's query heads h (q [heads, D] scaled, p rows
// kTile apart) and the tile's n tokens; -inf for the tile's padding. Token-major, so each block
// is read front to back; a K row is loaded once for its group of query heads, and the lane-wise
// products of kLanes tokens are summed across lanes together (transpose_sum).
template <typename T, int D>
void score_tile(const float* q, int64_t span, int64_t group, const T* const* krows, int n,
                float* p, Vec* part, const T* const* pf, int pf_bytes) {
  constexpr int kVecs = D / kLanes;
  const int64_t heads = span * group;
  for (int j = 0; j < n; ++j) {
    prefetch_row(pf[j], pf_bytes);
    for (int64_t kv = 0; kv < span; ++kv) {
      const T* row = krows[j] + kv * D;
      Vec k[kVecs];
      for (int c = 0; c < kVecs; ++c) k[c] = load_as_float(row + c * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        const float* qh = q + h * D;
        Vec acc = load(qh) * k[0];
        for (int c = 1; c < kVecs; ++c) acc += load(qh + c * kLanes) * k[c];
        part[h * kTile + j] = acc;
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    Vec* ph = part + h * kTile;
    for (int j = n; j < kTile; ++j) ph[j] = Vec{};
    for (int b = 0; b < kTile; b += kLanes) store(p + h * kTile + b, transpose_sum(ph + b));
    std::fill(p + h * kTile + n, p + (h + 1) * kTile, kNegInf);
  }
}

#if defined(__AVX512F__)
// Whether bf16 scores take AVX512_BF16's dot product: where the CPU has it, unless a test turned
// it off (set_bf16_dot) to compare both paths on one machine.
std::atomic<bool>& bf16_dot_flag() {
  static std::atomic<bool> on{static_cast<bool>(__builtin_cpu_supports("avx512bf16"))};
  return on;
}

// score_tile for bf16 rows by vdpbf16ps: p[h][j] <- scale * (q[h] . k[j][h / group]), q the
// unscaled bf16 queries [heads, D]. Each of a K row's D / 32 zmm of bf16 pairs is loaded once for
// the group's query heads; the products are exact in fp32 and summed in fp32 (in another order
// than score_tile's FMA chain).
template <int D>
__attribute__((target("avx512bf16"))) void score_tile_dot(
    const c10::BFloat16* q, float scale, int64_t span, int64_t group,
    const c10::BFloat16* const* krows, int n, float* p, Vec* part,
    const c10::BFloat16* const* pf, int pf_bytes) {
  static_assert(D % 32 == 0 && kLanes == 16, "rows are whole zmm of 32 bf16");
  constexpr int kZmm = D / 32;
  const int64_t heads = span * group;
  for (int j = 0; j < n; ++j) {
    prefetch_row(pf[j], pf_bytes);
    for (int64_t kv = 0; kv < span; ++kv) {
      const c10::BFloat16* row = krows[j] + kv * D;
      __m512bh k[kZmm];
      for (int c = 0; c < kZmm; ++c) k[c] = (__m512bh)_mm512_loadu_si512(row + c * 32);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        const c10::BFloat16* qh = q + h * D;
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < kZmm; ++c)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + c * 32), k[c]);
        part[h * kTile + j] = (Vec)acc;
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    Vec* ph = part + h * kTile;
    for (int j = n; j < kTile; ++j) ph[j] = Vec{};
    for (int b = 0; b < kTile; b += kLanes) store(p + h * kTile + b, transpose_sum(ph + b) * scale);
    std::fill(p + h * kTile + n, p + (h + 1) * kTile, kNegInf);
  }
}
#endif

// acc[h] += sum_j p[h][j] * v[j] for NH query heads of one KV head, their accumulator rows
// held in registers over the tile and each V row loaded once for all of them.
template <typename T, int D, int NH>
void accumulate_heads(const float* p, const T* const* vrows, int64_t offset, int n, float* acc,
                      const T* const* pf, int pf_bytes) {
  constexpr int kVecs = D / kLanes;
  Vec rows[NH][kVecs];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kVecs; ++c) rows[h][c] = load(acc + h * D + c * kLanes);
  for (int j = 0; j < n; ++j) {
    if (pf != nullptr) prefetch_row(pf[j], pf_bytes);
    const T* row = vrows[j] + offset;
    Vec v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = load_as_float(row + c * kLanes);
    for (int h = 0; h < NH; ++h) {
      const Vec w = splat(p[h * kTile + j]);
      for (int c = 0; c < kVecs; ++c) rows[h][c] += w * v[c];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kVecs; ++c) store(acc + h * D + c * kLanes, rows[h][c]);
}

// Calls f(integral_constant<NH>, g0) over the group's query heads in chunks of at most
// kHeadsAtOnce<D>, so that each chunk runs fully unrolled with its rows in registers.
template <int D, typename F>
void for_head_chunks(int64_t group, F&& f) {
  constexpr int kMax = kHeadsAtOnce<D>;
  for (int64_t g0 = 0; g0 < group; g0 += kMax) {
    switch (std::min<int64_t>(kMax, group - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: if constexpr (kMax >= 2) f(std::integral_constant<int, 2>{}, g0); break;
      case 3: if constexpr (kMax >= 3) f(std::integral_constant<int, 3>{}, g0); break;
      default: if constexpr (kMax >= 4) f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

// acc[h] += sum_j p[h][j] * v[j][h / group] for the item's query heads h, in chunks of heads
// per KV head; the first chunk also issues the V prefetches.
template <typename T, int D>
void accumulate_tile(int64_t span, int64_t group, const float* p, const T* const* vrows, int n,
                     float* acc, const T* const* pf, int pf_bytes) {
  for (int64_t kv = 0; kv < span; ++kv)
    for_head_chunks<D>(group, [&](auto nh, int64_t g0) {
      const int64_t h = kv * group + g0;
      accumulate_heads<T, D, decltype(nh)::value>(p + h * kTile, vrows, kv * D, n, acc + h * D,
                                                   kv == 0 && g0 == 0 ? pf : nullptr, pf_bytes);
    });
}

// Folds one tile of scores into the running (max, sum) and turns them into weights relative to
// the new max; the accumulated outputs are rescaled to the same reference.
template <int D>
void softmax_update(int64_t group, float* p, float* m, float* l, float* acc) {
  static_assert(kTile % kLanes == 0);
  constexpr int kTileVecs = kTile / kLanes;
  for (int64_t g = 0; g < group; ++g) {
    float* pg = p + g * kTile;
    Vec s[kTileVecs];
    Vec top = s[0] = load(pg);
    for (int i = 1; i < kTileVecs; ++i) {
      s[i] = load(pg + i * kLanes);
      top = top > s[i] ? top : s[i];
    }
    const float new_max = std::max(m[g], hmax(top));
    Vec sum{};
    for (int i = 0; i < kTileVecs; ++i) {
      const Vec e = exp_nonpositive(s[i] - new_max);
      store(pg + i * kLanes, e);
      sum += e;
    }
    if (new_max != m[g]) {
      const float alpha = exp_nonpositive(m[g] - new_max);
      for (int d = 0; d < D; d += kLanes) store(acc + g * D + d, load(acc + g * D + d) * alpha);
      l[g] *= alpha;
      m[g] = new_max;
    }
    l[g] += hsum(sum);
  }
}

}  // namespace
}  // namespace tierserve

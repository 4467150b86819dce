// Paged decode attention for CPU: every decode sequence attends with its one query token over
// its whole context, read in place from the block-structured KV pool through its block table.
// A sequence's table is row i of block_tables, or row rows[i] where rows is given: the worker
// passes its persistent table and each query's row, so a step builds no table of its own.
//
// A work item is (sequence, range of KV heads, part of the context), spread over
// at::parallel_for's threads (see run_decode). It walks its tokens in tiles of kTile, token-major:
// a token's K rows of all the item's KV heads are contiguous in the pool, so each block is read
// front to back. Per KV head, a K row is loaded once for all query heads sharing it, and the
// lane-wise products of kLanes tokens are summed across lanes together; the tile's V rows are
// then accumulated into those heads' outputs, held in registers. bf16 rows widen in registers.
// Every K/V row of the context is read from memory exactly once: an item first pulls its rows
// into cache with demand loads (pull_rows), and the tile kAhead ahead is prefetched a token at a
// time meanwhile, into L2. On CPUs with AVX512_BF16, bf16 scores take its dot product
// (vdpbf16ps: pairs of bf16 products summed in fp32) on the stored bf16 query and K rows, then
// the scale: no widening of either (score_tile_dot).
// Softmax is online (streaming) over tiles, in fp32 whatever the storage type.
// With a sliding window W > 0, a token attends to the last W tokens of its context only
// (Mistral's: keys j with q - W < j <= q); tiles start at the window's first token.
//
// Vectorised with vec.h's Vec (one register of floats; head dims are multiples of it): g++ turns
// plain loops here into gathers and scalar adds. D and the heads done at once are template
// parameters, so rows are fixed numbers of Vecs and the accumulators stay in registers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

namespace tierserve {
namespace {

constexpr int kTile = 32;   // tokens scored between two online-softmax rescales
constexpr int kAhead = 2;   // tiles between a prefetch and the use
constexpr int kPart = 128; // tokens of one work item of a split context, at most (whole tiles)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (it is only taken of score - running max). Below -87 the result is
// exactly 0, so -inf (an empty running max, tile padding) gives 0.
inline Vec exp_nonpositive(Vec x) {
  const auto underflow = x < -87.0f;
  const Vec e = exp_in_range(underflow ? splat(-87.0f) : x);
  return underflow ? Vec{} : e;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

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

template <typename T>
struct DecodeArgs {
  const T* q;
  int64_t q_seq_stride, q_head_stride;
  const T* k_cache;
  const T* v_cache;
  int64_t block_stride;  // bs * kv_heads * D elements
  int64_t row_stride;    // kv_heads * D elements: one token of one block
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* rows;  // [nd] table row of each sequence; nullptr: row i for sequence i
  const int32_t* seq_lens;
  int64_t kv_heads, group, block_size;
  float scale;
  int window;  // 0: the whole context
  T* out;  // [nd, kv_heads * group, D], contiguous
};

// Per-thread scratch for one work item's query heads (at most all of them), sized once per
// thread rather than per item.
struct Scratch {
  std::vector<float> q;       // [heads, D] scaled queries
  std::vector<float> acc;     // [heads, D] unnormalised outputs
  std::vector<float> p;       // [heads, kTile] scores, then probabilities
  std::vector<float> m, l;    // [heads] running max and running sum of exp
  std::vector<Vec> part;      // [heads, kTile] lane-wise products of q and each K row
  std::vector<c10::BFloat16> qb;  // [heads, D] unscaled bf16 queries (score_tile_dot)
  Scratch(int64_t heads, int D)
      : q(heads * D), acc(heads * D), p(heads * kTile), m(heads), l(heads), part(heads * kTile),
        qb(heads * D) {}
};

// Addresses of the rows of KV head h0 of tokens t0 .. t0 + n - 1 in the K and V pools (a
// token's rows of all heads follow each other). Tokens walk their block table without a
// division per token. Rows past n are null.
template <typename T>
void row_addresses(const DecodeArgs<T>& a, const int32_t* table, int64_t h0, int64_t D, int t0,
                   int n, const T** krows, const T** vrows) {
  int64_t bi = t0 / a.block_size, off = t0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t at = table[bi] * a.block_stride + off * a.row_stride + h0 * D;
    krows[j] = a.k_cache + at;
    vrows[j] = a.v_cache + at;
    if (++off == a.block_size) {
      off = 0;
      ++bi;
    }
  }
  for (int j = n; j < kTile; ++j) krows[j] = vrows[j] = nullptr;
}

// Blocks are scattered over the pool, which the hardware prefetchers cannot follow, and decode
// attention is bound by memory: the rows of the tile kAhead tiles ahead are prefetched a row at
// a time, interleaved with the current tile's work (see score_tile, accumulate_heads). Issued
// all at once they overflow the core's queue of outstanding misses and are dropped.
template <typename T>
inline void prefetch_row(const T* row, int bytes) {
  if (row == nullptr) return;
  const char* at = reinterpret_cast<const char*>(row);
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, 2);
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

// Whether an item of T rows of D values scores by score_tile_dot.
template <typename T, int D>
inline bool scores_by_dot() {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0)
    return bf16_dot_flag().load(std::memory_order_relaxed);
#endif
  return false;
}

// score_tile_dot on an item's scratch, for the T and D it takes (scores_by_dot).
template <typename T, int D>
void score_by_dot(Scratch& s, float scale, int64_t span, int64_t group, const T* const* krows,
                  int n, const T* const* pf, int pf_bytes) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
    score_tile_dot<D>(s.qb.data(), scale, span, group, krows, n, s.p.data(), s.part.data(), pf,
                      pf_bytes);
    return;
  }
#endif
  TORCH_CHECK(false, "paged_decode_attention: no bf16 dot product for this row");
}

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

// A work item: the query heads of KV heads [h0, h1) of one sequence over context tokens
// [t_begin, t_end).
struct Item {
  int64_t seq, h0, h1;
  int t_begin, t_end;
  int64_t part;  // row of the partial results; -1: the item covers the whole context
};

// The rows of tile `tile` of an item (kTile tokens from its first), for prefetching; null
// rows past its end.
template <typename T, int D>
void tile_rows(const DecodeArgs<T>& a, const Item& it, int tile, const T** krows,
               const T** vrows) {
  const int32_t* table = a.block_tables + (a.rows ? a.rows[it.seq] : it.seq) * a.table_stride;
  const int t0 = it.t_begin + tile * kTile;
  row_addresses<T>(a, table, it.h0, D, t0, std::clamp(it.t_end - t0, 0, kTile), krows, vrows);
}

inline int num_tiles(const Item& it) { return (it.t_end - it.t_begin + kTile - 1) / kTile; }

// Demand loads of the K and V rows of an item's first tiles (up to kPullBytes): a load per cache
// line, independent of each other, so the core keeps as many misses in flight as it tracks.
// Prefetches a row at a time alone leave the scoring waiting on memory (bench/decode_step.py
// with a long context shows the difference); the rows then wait in L2 for the scoring.
constexpr int64_t kPullBytes = 256 << 10;

template <typename T>
void pull_rows(const DecodeArgs<T>& a, const Item& it, const int32_t* table, int64_t D,
               int bytes) {
  const int tiles = static_cast<int>(std::min<int64_t>(
      num_tiles(it), std::max<int64_t>(1, kPullBytes / (2 * kTile * int64_t{bytes}))));
  const T* krows[kTile];
  const T* vrows[kTile];
  uint8_t sink = 0;
  for (int t = 0; t < tiles; ++t) {
    const int t0 = it.t_begin + t * kTile, n = std::min(kTile, it.t_end - t0);
    row_addresses<T>(a, table, it.h0, D, t0, n, krows, vrows);
    for (int j = 0; j < n; ++j) {
      const auto* k = reinterpret_cast<const volatile uint8_t*>(krows[j]);
      const auto* v = reinterpret_cast<const volatile uint8_t*>(vrows[j]);
      for (int b = 0; b < bytes; b += 64) sink ^= k[b] ^ v[b];
      sink ^= k[bytes - 1] ^ v[bytes - 1];  // a row that starts mid-line ends in one more
    }
  }
  asm volatile("" : : "r"(sink));
}

// The item's scaled queries into s, its outputs and running (max, sum) reset.
template <typename T, int D>
void start_item(const DecodeArgs<T>& a, const Item& it, Scratch& s, bool dot) {
  const int64_t heads = (it.h1 - it.h0) * a.group;
  for (int64_t h = 0; h < heads; ++h) {
    const T* src = a.q + it.seq * a.q_seq_stride + (it.h0 * a.group + h) * a.q_head_stride;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (dot) {
        std::copy_n(src, D, s.qb.begin() + h * D);
        continue;
      }
    }
    for (int d = 0; d < D; ++d) s.q[h * D + d] = static_cast<float>(src[d]) * a.scale;
  }
  std::fill_n(s.acc.begin(), heads * D, 0.0f);
  std::fill_n(s.m.begin(), heads, kNegInf);
  std::fill_n(s.l.begin(), heads, 0.0f);
}

// Scores an item's tokens, online softmax over tiles. Tiles are the outer loop, so the item's KV
// heads consume each tile of blocks together while it is in cache. Leaves the unnormalised
// outputs and the running (max, sum) in s. The prefetches run kAhead tiles ahead through the
// item, then on into `next` (the item this thread takes next, or null), so that an item starts
// on rows already on their way; the first `ready` tiles of this one were prefetched so.
// Returns how many tiles of `next` it prefetched.
template <typename T, int D>
int attend(const DecodeArgs<T>& a, const Item& it, const Item* next, int ready, Scratch& s) {
  const int64_t group = a.group, span = it.h1 - it.h0, heads = span * group;
  const int32_t* table = a.block_tables + (a.rows ? a.rows[it.seq] : it.seq) * a.table_stride;
  const bool dot = scores_by_dot<T, D>();
  start_item<T, D>(a, it, s, dot);
  // A token's rows of the item's KV heads are contiguous: prefetched as one span. Every item
  // has the same span.
  const int bytes = static_cast<int>(span * D * sizeof(T));
  const int tiles = num_tiles(it), next_tiles = next ? num_tiles(*next) : 0;
  pull_rows<T>(a, it, table, D, bytes);
  const T* krows[kTile];
  const T* vrows[kTile];
  const T* kpf[kTile];
  const T* vpf[kTile];
  for (int t = ready; t < kAhead && t < tiles; ++t) {
    tile_rows<T, D>(a, it, t, kpf, vpf);
    for (int j = 0; j < kTile; ++j) {
      prefetch_row(kpf[j], bytes);
      prefetch_row(vpf[j], bytes);
    }
  }
  int next_ready = 0;
  for (int t = 0; t < tiles; ++t) {
    const int t0 = it.t_begin + t * kTile, n = std::min(kTile, it.t_end - t0);
    if (t + kAhead < tiles) {
      tile_rows<T, D>(a, it, t + kAhead, kpf, vpf);
    } else if (t + kAhead - tiles < next_tiles) {
      tile_rows<T, D>(a, *next, t + kAhead - tiles, kpf, vpf);
      next_ready = t + kAhead - tiles + 1;
    } else {
      std::fill_n(kpf, kTile, nullptr);
      std::fill_n(vpf, kTile, nullptr);
    }
    row_addresses<T>(a, table, it.h0, D, t0, n, krows, vrows);
    if (dot)
      score_by_dot<T, D>(s, a.scale, span, group, krows, n, kpf, bytes);
    else
      score_tile<T, D>(s.q.data(), span, group, krows, n, s.p.data(), s.part.data(), kpf, bytes);
    softmax_update<D>(heads, s.p.data(), s.m.data(), s.l.data(), s.acc.data());
    accumulate_tile<T, D>(span, group, s.p.data(), vrows, n, s.acc.data(), vpf, bytes);
  }
  return next_ready;
}

// Partial results of the parts of split contexts: per part and query head, m, l, then D
// unnormalised outputs.
template <int D>
constexpr int64_t kPartialRow = D + 2;

template <typename T, int D>
void write_out(const DecodeArgs<T>& a, const Item& it, const Scratch& s) {
  const int64_t heads = (it.h1 - it.h0) * a.group;
  T* out = a.out + (it.seq * a.kv_heads + it.h0) * a.group * D;
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / s.l[h];  // l >= 1: the max score contributes exp(0)
    for (int d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(s.acc[h * D + d] * inv);
  }
}

template <typename T, int D>
void write_partial(const DecodeArgs<T>& a, const Item& it, const Scratch& s, float* partials) {
  const int64_t heads = (it.h1 - it.h0) * a.group, all_heads = a.kv_heads * a.group;
  float* row = partials + (it.part * all_heads + it.h0 * a.group) * kPartialRow<D>;
  for (int64_t h = 0; h < heads; ++h, row += kPartialRow<D>) {
    row[0] = s.m[h];
    row[1] = s.l[h];
    std::copy_n(s.acc.data() + h * D, D, row + 2);
  }
}

// out[seq] from its parts [p0, p0 + parts), merged in part order (so the result depends on
// the context length only, never on the batch or the threads): each part's sums are rescaled
// to the largest running max of all parts.
template <typename T, int D>
void merge_parts(const DecodeArgs<T>& a, int64_t seq, int64_t p0, int64_t parts,
                 const float* partials) {
  constexpr int kVecs = D / kLanes;
  const int64_t heads = a.kv_heads * a.group;
  T* out = a.out + seq * heads * D;
  for (int64_t h = 0; h < heads; ++h) {
    float top = kNegInf;
    for (int64_t p = 0; p < parts; ++p)
      top = std::max(top, partials[((p0 + p) * heads + h) * kPartialRow<D>]);
    Vec acc[kVecs] = {};
    float l = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      const float* row = partials + ((p0 + p) * heads + h) * kPartialRow<D>;
      const float w = exp_nonpositive(row[0] - top);
      l += w * row[1];
      for (int c = 0; c < kVecs; ++c) acc[c] += splat(w) * load(row + 2 + c * kLanes);
    }
    const float inv = 1.0f / l;
    for (int c = 0; c < kVecs; ++c)
      for (int i = 0; i < kLanes; ++i)
        out[h * D + c * kLanes + i] = static_cast<T>(acc[c][i] * inv);
  }
}

// Work items. A context longer than kPart tokens is split into parts of about kPart tokens
// (num_parts_of, part_offset), each its own item (flash-decoding), so that one long sequence
// keeps every thread busy; the parts' results are merged by whichever thread finishes a
// sequence's last part. With enough items to keep every thread busy, an item takes all KV
// heads, so each block of the pool is read as one contiguous run; with few, it takes one KV
// head, for parallelism. Items are claimed from a shared counter, longest first: contexts are
// ragged, so equal counts of items are far from equal work.
struct Plan {
  std::vector<Item> items;
  std::vector<int64_t> first_part;  // per sequence: its first row of partials (-1: one part)
  std::vector<int64_t> num_parts;   // per sequence
  int64_t total_parts = 0;          // rows of partials
  int64_t heads_per_item = 1;
};

// How many parts a split context of `span` tokens takes: one per kPart tokens, made even (so
// that two threads share a lone sequence evenly; one part over would leave one of them idle for
// a part's time). Depends on the length alone, so a sequence's result does not depend on the
// batch or the threads.
inline int64_t num_parts_of(int span) {
  const int64_t parts = (span + kPart - 1) / kPart, tiles = (span + kTile - 1) / kTile;
  return parts > 1 && parts % 2 == 1 && parts < tiles ? parts + 1 : parts;
}

// Offset of part p of a span split into `parts`: whole tiles, as even as tiles allow, the
// longer parts first.
inline int part_offset(int span, int64_t parts, int64_t p) {
  const int64_t tiles = (span + kTile - 1) / kTile, base = tiles / parts, extra = tiles % parts;
  return static_cast<int>((p * base + std::min(p, extra)) * kTile);
}

template <typename T>
Plan plan_items(const DecodeArgs<T>& a, int64_t num_seqs, int64_t threads) {
  Plan plan;
  plan.first_part.resize(num_seqs);
  plan.num_parts.resize(num_seqs);
  std::vector<int> start(num_seqs);
  int64_t units = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int len = a.seq_lens[s];
    start[s] = a.window > 0 && len > a.window ? len - a.window : 0;
    const int64_t parts = plan.num_parts[s] = num_parts_of(len - start[s]);
    units += parts;
    plan.first_part[s] = parts > 1 ? plan.total_parts : -1;
    if (parts > 1) plan.total_parts += parts;
  }
  const int64_t per_item = plan.heads_per_item = units >= 2 * threads ? a.kv_heads : 1;
  plan.items.reserve(units * (a.kv_heads / per_item));
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t p = 0; p < plan.num_parts[s]; ++p)
      for (int64_t h0 = 0; h0 < a.kv_heads; h0 += per_item) {
        const int span = a.seq_lens[s] - start[s];
        const int t0 = start[s] + part_offset(span, plan.num_parts[s], p);
        const int t1 = start[s] + part_offset(span, plan.num_parts[s], p + 1);
        plan.items.push_back({s, h0, h0 + per_item, t0, std::min(t1, a.seq_lens[s]),
                              plan.num_parts[s] > 1 ? plan.first_part[s] + p : -1});
      }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const Item& x, const Item& y) {
    return x.t_end - x.t_begin > y.t_end - y.t_begin;
  });
  return plan;
}

template <typename T, int D>
void run_decode(const DecodeArgs<T>& a, int64_t num_seqs) {
  static_assert(D % kLanes == 0, "rows are processed in whole vectors of kLanes floats");
  const int64_t threads = at::get_num_threads();
  const Plan plan = plan_items(a, num_seqs, threads);
  const std::vector<Item>& items = plan.items;
  std::vector<float> partials(plan.total_parts * a.kv_heads * a.group * kPartialRow<D>);
  // Items of each split sequence still running; the thread taking it to 0 merges.
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s)
    pending[s].store(plan.num_parts[s] * (a.kv_heads / plan.heads_per_item));
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(plan.heads_per_item * a.group, D);
    // A thread claims its next item before finishing the current one, to prefetch into it.
    int ready = 0;
    for (int64_t i = next.fetch_add(1); i < count;) {
      const int64_t following = next.fetch_add(1);
      const Item& it = items[i];
      ready = attend<T, D>(a, it, following < count ? &items[following] : nullptr, ready,
                           scratch);
      i = following;
      if (it.part < 0) {
        write_out<T, D>(a, it, scratch);
        continue;
      }
      write_partial<T, D>(a, it, scratch, partials.data());
      if (pending[it.seq].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_parts<T, D>(a, it.seq, plan.first_part[it.seq], plan.num_parts[it.seq],
                          partials.data());
    }
  });
}

// The head dims compiled in, each a multiple of kLanes; one list feeds the dispatch and the
// decode_head_dims op the Python side asks before choosing the kernel.
#define TIERSERVE_HEAD_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(112) X(128) X(192) X(256)

template <typename T>
void dispatch_head_dim(const DecodeArgs<T>& a, int64_t num_seqs, int64_t head_dim) {
  switch (head_dim) {
#define TIERSERVE_CASE(DIM) \
  case DIM:                 \
    return run_decode<T, DIM>(a, num_seqs);
    TIERSERVE_HEAD_DIMS(TIERSERVE_CASE)
#undef TIERSERVE_CASE
  }
  TORCH_CHECK(false, "paged_decode_attention: unsupported head_dim ", head_dim);
}

std::vector<int64_t> decode_head_dims() {
#define TIERSERVE_ITEM(DIM) DIM,
  return {TIERSERVE_HEAD_DIMS(TIERSERVE_ITEM)};
#undef TIERSERVE_ITEM
}

// Every block a sequence will read must be a real pool block: the kernel indexes raw memory.
void check_tables(const at::Tensor& block_tables, const int32_t* rows, const at::Tensor& seq_lens,
                  int64_t num_blocks, int64_t block_size) {
  const int64_t nd = seq_lens.size(0), num_rows = block_tables.size(0);
  const int64_t width = block_tables.size(1);
  const int32_t* table = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < nd; ++s) {
    const int64_t row = rows ? rows[s] : s;
    TORCH_CHECK(row >= 0 && row < num_rows, "paged_decode_attention: rows[", s, "] = ", row,
                " is not a row of block_tables [", num_rows, ", ", width, "]");
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block_size, "paged_decode_attention: seq_lens[",
                s, "] = ", lens[s], " is outside [1, ", width * block_size, "]");
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = table[row * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: block_tables[", row, ", ",
                  b, "] = ", id, " is not a block of a pool of ", num_blocks);
    }
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const std::optional<at::Tensor>& rows) {
  const char* op = "paged_decode_attention: ";
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), op, "all inputs must be CPU tensors");
  TORCH_CHECK(q.dim() == 3, op, "q must be [num_decodes, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, op,
              "k_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, "v_cache ", v_cache.sizes(),
              " != k_cache ", k_cache.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op,
              "dtype must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              op, "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op,
              "the KV pool must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), op, "q head_dim ", q.size(2), " != pool head_dim ",
              k_cache.size(3));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, op, "heads (", q.size(1),
              ") must be a multiple of kv_heads (", k_cache.size(2), ")");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, op,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous(), op,
              "block_tables must be a contiguous [num_rows, max_blocks] tensor");
  if (rows) {
    TORCH_CHECK(rows->device().is_cpu() && rows->scalar_type() == at::kInt && rows->dim() == 1 &&
                    rows->size(0) == q.size(0) && rows->is_contiguous(),
                op, "rows must be a contiguous int32 [num_decodes] CPU tensor");
  } else {
    TORCH_CHECK(block_tables.size(0) == q.size(0), op,
                "without rows, block_tables must have one row per query: ",
                block_tables.size(0), " rows for ", q.size(0));
  }
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(), op,
              "seq_lens must be a contiguous [num_decodes] tensor");
}

template <typename T>
DecodeArgs<T> make_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const int32_t* rows,
                        const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  return DecodeArgs<T>{
      q.data_ptr<T>(), q.stride(0), q.stride(1),
      k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
      k_cache.size(1) * kv_heads * head_dim, kv_heads * head_dim,
      block_tables.data_ptr<int32_t>(), block_tables.size(1), rows,
      seq_lens.data_ptr<int32_t>(),
      kv_heads, q.size(1) / kv_heads, k_cache.size(1),
      static_cast<float>(scale), static_cast<int>(window),
      out.data_ptr<T>()};
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& rows_in) {
  check_inputs(q_in, k_cache, v_cache, block_tables, seq_lens, rows_in);
  TORCH_CHECK(window >= 0 && window < (int64_t{1} << 31), "paged_decode_attention: window ",
              window, " must be in [0, 2^31)");
  const int64_t head_dim = k_cache.size(3);
  const int32_t* rows = rows_in ? rows_in->data_ptr<int32_t>() : nullptr;
  check_tables(block_tables, rows, seq_lens, k_cache.size(0), k_cache.size(1));
  // Rows of q may be strided (a slice of the fused qkv projection); each head's D values must
  // be contiguous.
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat)
    dispatch_head_dim(
        make_args<float>(q, k_cache, v_cache, block_tables, rows, seq_lens, scale, window, out),
        q.size(0), head_dim);
  else
    dispatch_head_dim(make_args<c10::BFloat16>(q, k_cache, v_cache, block_tables, rows, seq_lens,
                                               scale, window, out),
                      q.size(0), head_dim);
  return out;
}

// Turns the bf16 dot product on (where the CPU has it) or off; whether it is now on.
bool set_bf16_dot(bool enabled) {
#if defined(__AVX512F__)
  const bool on = enabled && __builtin_cpu_supports("avx512bf16");
  bf16_dot_flag().store(on);
  return on;
#else
  (void)enabled;
  return false;
#endif
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("set_bf16_dot(bool enabled) -> bool", &tierserve::set_bf16_dot);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0, Tensor? rows=None) -> Tensor");
  m.def("decode_head_dims() -> int[]", &tierserve::decode_head_dims);
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("paged_decode_attention", &tierserve::paged_decode_attention);
}

// Paged decode attention for CPU: every decode sequence attends with its one query token over
// its whole context, read in place from the block-structured KV pool through its block table.
// A sequence's table is row i of block_tables, or row rows[i] where rows is given: the worker
// passes its persistent table and each query's row, so a step builds no table of its own.
//
// A work item is (sequence, range of KV heads), spread over at::parallel_for's threads (see
// run_decode). It walks the context in tiles of kTile tokens, token-major: a token's K rows of
// all the item's KV heads are contiguous in the pool, so each block is read front to back, and
// every query head sharing a KV head is scored against the row while it is in L1; the tile's V
// rows are then accumulated into all heads' outputs while in cache. Every K/V row of the context
// is read from memory exactly once, and the tile kAhead ahead is prefetched a token at a time
// meanwhile, into L2.
// Softmax is online (streaming) over tiles, in fp32 whatever the storage type.
// With a sliding window W > 0, a token attends to the last W tokens of its context only
// (Mistral's: keys j with q - W < j <= q); tiles start at the window's first token.
//
// Vectorised with vec.h's Vec (one register of floats; head dims are multiples of it). Plain
// loops proved fragile here: g++ turned the V accumulation into gathers and the dot-product reductions into
// scalar adds. D is a template parameter, so a row is a fixed number of Vecs and a row of
// accumulators stays in registers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace tierserve {
namespace {

constexpr int kTile = 32;   // tokens scored between two online-softmax rescales
constexpr int kAhead = 2;   // tiles between a prefetch and the use
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (it is only taken of score - running max). Below -87 the result is
// exactly 0, so -inf (an empty running max, tile padding) gives 0.
inline Vec exp_nonpositive(Vec x) {
  const auto underflow = x < -87.0f;
  const Vec e = exp_in_range(underflow ? splat(-87.0f) : x);
  return underflow ? Vec{} : e;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

template <int D>
inline float dot(const float* a, const float* b) {
  Vec acc = load(a) * load(b);
  for (int d = kLanes; d < D; d += kLanes) acc += load(a + d) * load(b + d);
  return hsum(acc);
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
  std::vector<float> k, v;    // [kTile, kv_heads, D] fp32 copies of bf16 rows
  Scratch(int64_t heads, int64_t kv_heads, int D)
      : q(heads * D), acc(heads * D), p(heads * kTile), m(heads), l(heads),
        k(kTile * kv_heads * D), v(kTile * kv_heads * D) {}
};

// Points rows[j] (j < n) at the fp32 K and V rows of KV heads [h0, h0 + span) of tokens
// t0 .. t0 + n - 1 ([span, D] each, contiguous in the pool), converting bf16 rows into scratch.
// Tokens walk their block table without a division per token.
template <typename T, int D>
void fetch_rows(const DecodeArgs<T>& a, const int32_t* table, int64_t h0, int64_t span, int t0,
                int n, Scratch& s, const float** krows, const float** vrows) {
  const T* k_cache = a.k_cache + h0 * D;
  const T* v_cache = a.v_cache + h0 * D;
  int64_t bi = t0 / a.block_size, off = t0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t at = table[bi] * a.block_stride + off * a.row_stride;
    if constexpr (std::is_same_v<T, float>) {
      krows[j] = k_cache + at;
      vrows[j] = v_cache + at;
    } else {
      float* kf = s.k.data() + j * span * D;
      float* vf = s.v.data() + j * span * D;
      for (int d = 0; d < span * D; d += kLanes) {
        store(kf + d, load_bf16(k_cache + at + d));
        store(vf + d, load_bf16(v_cache + at + d));
      }
      krows[j] = kf;
      vrows[j] = vf;
    }
    if (++off == a.block_size) {
      off = 0;
      ++bi;
    }
  }
}

// Addresses of the K and V rows of tokens t0 .. t0 + n - 1, for prefetching them one tile ahead
// of use: blocks are scattered over the pool, which the hardware prefetchers cannot follow, and
// decode attention is bound by memory. The prefetches are issued a row at a time, interleaved
// with the current tile's work (see score_tile, accumulate_tile): issued all at once they
// overflow the core's queue of outstanding misses and are dropped.
template <typename T, int D>
void row_addresses(const DecodeArgs<T>& a, const int32_t* table, int64_t kv_head, int t0, int n,
                   const char** kaddr, const char** vaddr) {
  int64_t bi = t0 / a.block_size, off = t0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t at = table[bi] * a.block_stride + off * a.row_stride + kv_head * D;
    kaddr[j] = reinterpret_cast<const char*>(a.k_cache + at);
    vaddr[j] = reinterpret_cast<const char*>(a.v_cache + at);
    if (++off == a.block_size) {
      off = 0;
      ++bi;
    }
  }
  for (int j = n; j < kTile; ++j) kaddr[j] = vaddr[j] = nullptr;
}

inline void prefetch_row(const char* row, int bytes) {
  if (row == nullptr) return;
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
}

// p[h][j] <- q[h] . k[j][h / group] for the span's heads h and j < n, -inf for the tile's
// padding. Token-major, so that each block is read front to back.
template <int D>
void score_tile(const float* q, int64_t span, int64_t group, const float* const* krows, int n,
                float* p, const char* const* pf, int pf_bytes) {
  const int64_t heads = span * group;
  for (int j = 0; j < n; ++j) {
    prefetch_row(pf[j], pf_bytes);
    for (int64_t h = 0; h < heads; ++h) p[h * kTile + j] = dot<D>(q + h * D, krows[j] + (h / group) * D);
  }
  for (int64_t h = 0; h < heads; ++h) std::fill(p + h * kTile + n, p + (h + 1) * kTile, kNegInf);
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

// acc[g] += sum_j p[g][j] * v[j], with one row of accumulators held in registers per query head.
template <int D>
void accumulate_tile(int64_t span, int64_t group, const float* p, const float* const* vrows, int n,
                     float* acc, const char* const* pf, int pf_bytes) {
  constexpr int kVecs = D / kLanes;
  for (int j = 0; j < kTile; ++j) prefetch_row(pf[j], pf_bytes);
  // One KV head at a time, its group's accumulator rows in registers over the tile; the tile's
  // V rows are in cache by now (their K rows were just read through the same blocks).
  for (int64_t kv = 0; kv < span; ++kv) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kv * group + g;
      float* ag = acc + h * D;
      Vec row[kVecs];
      for (int c = 0; c < kVecs; ++c) row[c] = load(ag + c * kLanes);
      for (int j = 0; j < n; ++j) {
        const Vec w = splat(p[h * kTile + j]);
        const float* vr = vrows[j] + kv * D;
        for (int c = 0; c < kVecs; ++c) row[c] += w * load(vr + c * kLanes);
      }
      for (int c = 0; c < kVecs; ++c) store(ag + c * kLanes, row[c]);
    }
  }
}

// Query heads of KV heads [h0, h1) of one sequence over its whole context. Tiles are the outer
// loop, so the item's KV heads consume each tile of blocks together while it is in cache.
template <typename T, int D>
void attend(const DecodeArgs<T>& a, int64_t seq, int64_t h0, int64_t h1, Scratch& s) {
  const int64_t group = a.group, heads = (h1 - h0) * group;
  const int len = a.seq_lens[seq];
  const int start = a.window > 0 && len > a.window ? len - a.window : 0;
  const int32_t* table = a.block_tables + (a.rows ? a.rows[seq] : seq) * a.table_stride;
  for (int64_t h = 0; h < heads; ++h) {
    const T* src = a.q + seq * a.q_seq_stride + (h0 * group + h) * a.q_head_stride;
    for (int d = 0; d < D; ++d) s.q[h * D + d] = static_cast<float>(src[d]) * a.scale;
  }
  std::fill_n(s.acc.begin(), heads * D, 0.0f);
  std::fill_n(s.m.begin(), heads, kNegInf);
  std::fill_n(s.l.begin(), heads, 0.0f);
  // A token's rows of the item's KV heads are contiguous: prefetched as one span, during the
  // tile before.
  const int span = static_cast<int>((h1 - h0) * D * sizeof(T));
  const float* krows[kTile];
  const float* vrows[kTile];
  const char* kpf[kTile];
  const char* vpf[kTile];
  for (int t = start; t < start + kAhead * kTile && t < len; t += kTile) {
    row_addresses<T, D>(a, table, h0, t, std::min(kTile, len - t), kpf, vpf);
    for (int j = 0; j < kTile; ++j) {
      prefetch_row(kpf[j], span);
      prefetch_row(vpf[j], span);
    }
  }
  for (int t0 = start; t0 < len; t0 += kTile) {
    const int n = std::min(kTile, len - t0);
    row_addresses<T, D>(a, table, h0, t0 + kAhead * kTile,
                        std::clamp(len - t0 - kAhead * kTile, 0, kTile), kpf, vpf);
    fetch_rows<T, D>(a, table, h0, h1 - h0, t0, n, s, krows, vrows);
    score_tile<D>(s.q.data(), h1 - h0, group, krows, n, s.p.data(), kpf, span);
    softmax_update<D>(heads, s.p.data(), s.m.data(), s.l.data(), s.acc.data());
    accumulate_tile<D>(h1 - h0, group, s.p.data(), vrows, n, s.acc.data(), vpf, span);
  }
  T* out = a.out + (seq * a.kv_heads + h0) * group * D;
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / s.l[h];  // l >= 1: the max score contributes exp(0)
    for (int d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(s.acc[h * D + d] * inv);
  }
}

// Work item = (sequence, range of KV heads). With enough sequences to keep every thread busy,
// an item takes all KV heads of its sequence, so each block of the pool is read as one
// contiguous run; with few sequences it takes one KV head, for parallelism. Items are claimed
// from a shared counter, longest sequences first, rather than split statically: contexts are
// ragged, so equal counts of items are far from equal work.
template <typename T, int D>
void run_decode(const DecodeArgs<T>& a, int64_t num_seqs) {
  static_assert(D % kLanes == 0, "rows are processed in whole vectors of kLanes floats");
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 4 * threads ? a.kv_heads : 1;
  const int64_t chunks = a.kv_heads / heads_per_item;
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return a.seq_lens[x] > a.seq_lens[y]; });
  const int64_t items = num_seqs * chunks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(heads_per_item * a.group, heads_per_item, D);
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t h0 = (i % chunks) * heads_per_item;
      attend<T, D>(a, order[i / chunks], h0, h0 + heads_per_item, scratch);
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

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0, Tensor? rows=None) -> Tensor");
  m.def("decode_head_dims() -> int[]", &tierserve::decode_head_dims);
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("paged_decode_attention", &tierserve::paged_decode_attention);
}

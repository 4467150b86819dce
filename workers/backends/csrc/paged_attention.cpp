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
// Every K/V row of the context is read from memory exactly once: each row a tile scores or
// accumulates prefetches the row kAhead tokens further on, through the end of the item and on
// into the next item its thread takes, so that rows arrive while the tile before them computes.
// On CPUs with AVX512_BF16, bf16 scores take its dot product
// (vdpbf16ps: pairs of bf16 products summed in fp32) on the stored bf16 query and K rows, then
// the scale: no widening of either (score_tile_dot).
// Softmax is online (streaming) over tiles, in fp32 whatever the storage type.
// With a sliding window W > 0, a token attends to the last W tokens of its context only
// (Mistral's: keys j with q - W < j <= q); tiles start at the window's first token.
//
// decode_plan.h holds a call's checked arguments and its items, decode_tiles.h the work on one
// tile; this file runs the items: prefetches, an item's tiles in turn, and the
// merge of a split context's parts.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "attention_math.h"
#include "decode_plan.h"
#include "decode_tiles.h"
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

// Tokens between a row's prefetch and its use. Each prefetch holds a miss buffer until its
// line arrives; rows far ahead queue behind them and arrive no sooner.
constexpr int kAhead = 12;

// Per-thread scratch for one work item's query heads (at most all of them), kept by each
// thread across calls and grown as needed: a step makes one call per layer. Every field is
// written by an item before it is read (start_item, the tiles' scores).
struct Scratch {
  std::vector<float> q;       // [heads, D] scaled queries
  std::vector<float> acc;     // [heads, D] unnormalised outputs
  std::vector<float> p;       // [heads, kTile] scores, then probabilities
  std::vector<float> m, l;    // [heads] running max and running sum of exp
  std::vector<Vec> part;      // [heads, kTile] lane-wise products of q and each K row
  std::vector<c10::BFloat16> qb;  // [heads, D] unscaled bf16 queries (score_tile_dot)

  // This thread's scratch, sized for `heads` query heads of D values.
  static Scratch& of_thread(int64_t heads, int D) {
    thread_local Scratch s;
    const int64_t h = std::max<int64_t>(heads, s.m.size());
    const int64_t w = std::max<int64_t>(heads * D, s.q.size());
    if (h > static_cast<int64_t>(s.m.size()) || w > static_cast<int64_t>(s.q.size())) {
      s.q.resize(w);
      s.acc.resize(w);
      s.qb.resize(w);
      s.p.resize(h * kTile);
      s.m.resize(h);
      s.l.resize(h);
      s.part.resize(h * kTile);
    }
    return s;
  }
};

// Addresses of the rows of KV head h0 of tokens t0 .. t0 + n - 1 in the K and V pools (a
// token's rows of all heads follow each other). Tokens walk their block table without a
// division per token.
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
}

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

template <typename T>
inline const int32_t* table_of(const DecodeArgs<T>& a, const Item& it) {
  return a.block_tables + (a.rows ? a.rows[it.seq] : it.seq) * a.table_stride;
}

// The rows to prefetch beside a tile: those of kTile tokens from token `from` of the item
// (counted from its first), running on into `next` (null: none) past the item's end; null past
// both.
template <typename T, int D>
void ahead_rows(const DecodeArgs<T>& a, const Item& it, const Item* next, int from,
                const T** krows, const T** vrows) {
  const int len = it.t_end - it.t_begin;
  int filled = 0;
  if (from < len) {
    filled = std::min(kTile, len - from);
    row_addresses<T>(a, table_of(a, it), it.h0, D, it.t_begin + from, filled, krows, vrows);
  }
  if (next != nullptr && filled < kTile) {
    const int skip = std::max(0, from - len);
    const int n = std::min(kTile - filled, next->t_end - next->t_begin - skip);
    if (n > 0) {
      row_addresses<T>(a, table_of(a, *next), next->h0, D, next->t_begin + skip, n,
                       krows + filled, vrows + filled);
      filled += n;
    }
  }
  std::fill(krows + filled, krows + kTile, nullptr);
  std::fill(vrows + filled, vrows + kTile, nullptr);
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
// outputs and the running (max, sum) in s. Prefetches run kAhead tokens ahead through the item
// and on into `next` (the item this thread takes next, or null); unless `started`, the item's
// own first kAhead tokens were not prefetched by the item before it, and are first.
template <typename T, int D>
void attend(const DecodeArgs<T>& a, const Item& it, const Item* next, bool started, Scratch& s) {
  const int64_t group = a.group, span = it.h1 - it.h0, heads = span * group;
  const bool dot = scores_by_dot<T, D>();
  start_item<T, D>(a, it, s, dot);
  // A token's rows of the item's KV heads are contiguous: prefetched as one span. Every item
  // has the same span.
  const int bytes = static_cast<int>(span * D * sizeof(T));
  const T* krows[kTile];
  const T* vrows[kTile];
  const T* kpf[kTile];
  const T* vpf[kTile];
  if (!started) {
    ahead_rows<T, D>(a, it, nullptr, 0, kpf, vpf);
    for (int j = 0; j < kAhead; ++j) {
      prefetch_row(kpf[j], bytes);
      prefetch_row(vpf[j], bytes);
    }
  }
  const int32_t* table = table_of(a, it);
  const int tiles = num_tiles(it);
  for (int t = 0; t < tiles; ++t) {
    const int t0 = it.t_begin + t * kTile, n = std::min(kTile, it.t_end - t0);
    ahead_rows<T, D>(a, it, next, t * kTile + kAhead, kpf, vpf);
    row_addresses<T>(a, table, it.h0, D, t0, n, krows, vrows);
    if (dot)
      score_by_dot<T, D>(s, a.scale, span, group, krows, n, kpf, bytes);
    else
      score_tile<T, D>(s.q.data(), span, group, krows, n, s.p.data(), s.part.data(), kpf, bytes);
    softmax_update<D>(heads, s.p.data(), s.m.data(), s.l.data(), s.acc.data());
    accumulate_tile<T, D>(span, group, s.p.data(), vrows, n, s.acc.data(), vpf, bytes);
  }
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
    Scratch& scratch = Scratch::of_thread(plan.heads_per_item * a.group, D);
    // A thread claims its next item before finishing the current one, to prefetch into it.
    bool started = false;
    for (int64_t i = next.fetch_add(1); i < count;) {
      const int64_t following = next.fetch_add(1);
      const Item& it = items[i];
      attend<T, D>(a, it, following < count ? &items[following] : nullptr, started, scratch);
      started = true;
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

// Into out, contiguous of q's shape and dtype.
void paged_decode_attention_into(const at::Tensor& q_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, int64_t window,
                                 const std::optional<at::Tensor>& rows_in, at::Tensor& out) {
  check_inputs(q_in, k_cache, v_cache, block_tables, seq_lens, rows_in);
  TORCH_CHECK(window >= 0 && window < (int64_t{1} << 31), "paged_decode_attention: window ",
              window, " must be in [0, 2^31)");
  const int64_t head_dim = k_cache.size(3);
  const int32_t* rows = rows_in ? rows_in->data_ptr<int32_t>() : nullptr;
  check_tables(block_tables, rows, seq_lens, k_cache.size(0), k_cache.size(1));
  // Rows of q may be strided (a slice of the fused qkv projection); each head's D values must
  // be contiguous.
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type() && out.device().is_cpu(),
              "paged_decode_attention: out must be a contiguous CPU tensor of q's shape and dtype");
  if (q.scalar_type() == at::kFloat)
    dispatch_head_dim(
        make_args<float>(q, k_cache, v_cache, block_tables, rows, seq_lens, scale, window, out),
        q.size(0), head_dim);
  else
    dispatch_head_dim(make_args<c10::BFloat16>(q, k_cache, v_cache, block_tables, rows, seq_lens,
                                               scale, window, out),
                      q.size(0), head_dim);
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& rows_in) {
  TORCH_CHECK(q_in.dim() == 3, "paged_decode_attention: q must be [num_decodes, heads, "
              "head_dim], got ", q_in.sizes());
  at::Tensor out = at::empty(q_in.sizes(), q_in.options());
  paged_decode_attention_into(q_in, k_cache, v_cache, block_tables, seq_lens, scale, window,
                              rows_in, out);
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

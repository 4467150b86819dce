// What one paged_decode_attention call works on: its arguments (checked against the pool, since
// the kernel indexes raw memory) and its work items, each (sequence, range of KV heads, part of
// the context).
#pragma once

#include <ATen/ATen.h>

#include "decode_tiles.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace tierserve {
namespace {

constexpr int kPart = 128; // tokens of one work item of a split context, at most (whole tiles)

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

// A work item: the query heads of KV heads [h0, h1) of one sequence over context tokens
// [t_begin, t_end).
struct Item {
  int64_t seq, h0, h1;
  int t_begin, t_end;
  int64_t part;  // row of the partial results; -1: the item covers the whole context
};

inline int num_tiles(const Item& it) { return (it.t_end - it.t_begin + kTile - 1) / kTile; }

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

}  // namespace
}  // namespace tierserve

// Causal prefill attention for CPU, fp32 or bf16 storage (fp32 math): a chunk of L query
// tokens over its S >= L keys (the chunk's own, after any cached prefix), query i sitting at
// position S - L + i. Flash-style:
// scores are computed a tile of keys at a time and folded into an online softmax, so no
// [L, S] matrix is ever formed, and key tiles past a query tile's last position are never
// touched (half the work of a dense causal product).
//
// A work item is (KV head, tile of kQTile query tokens): its rows are the tile's tokens times
// the group of query heads sharing that KV head, so every K and V row read serves the whole
// group. K is transposed once per call into [kv_heads, D, S] so that a score tile is an
// outer-product GEMM micro-kernel (keys along the vector lanes, D the reduction), as the
// panel linear kernel is; V rows are read in place. Items are claimed from a shared counter,
// the longest (latest) query tiles first.
// With a sliding window W > 0, a query attends to keys j with pos - W < j <= pos (Mistral's).
// exp_nonpositive and TIERSERVE_HEAD_DIMS are decode attention's (attention_math.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_math.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

namespace tierserve {
namespace {

constexpr int kQTile = 16;          // query tokens per work item
constexpr int kKTile = 4 * 8;       // keys per score tile: a multiple of 2 Vecs at every width
constexpr int kKVecs = kKTile / kLanes;
constexpr float kMasked = -std::numeric_limits<float>::infinity();

template <typename T>
struct PrefillArgs {
  const T* q;
  int64_t q_tok, q_head;  // strides of q [L, H, D]
  const T* v;
  int64_t v_tok, v_head;  // strides of v [S, KV, D]
  const float* kt;        // [kv_heads, D, s_pad], transposed K, zero-padded past S
  int64_t s_pad;
  int64_t L, S, kv_heads, group;
  float scale;
  int64_t window;
  T* out;  // [L, H, D] contiguous
};

struct PrefillScratch {
  std::vector<float> q, p, acc, m, l;
  std::vector<char> seen;  // per row: whether the current key tile holds a key it sees
  explicit PrefillScratch(int64_t rows, int D)
      : q(rows * D), p(rows * kKTile), acc(rows * D), m(rows), l(rows), seen(rows) {}
};

// Rows of a head dim's sums accumulated at once: their sums and a V row fill about half the
// vector registers (one row of 256 values on AVX-512, or of 64 on AVX2).
template <int D>
constexpr int64_t kRowsAtOnce = std::max(1, (kVecRegs / 2) / (D / kLanes));

// acc[i] += sum_j p[i][j] v[j] for R rows (p rows kKTile apart, acc rows D apart) over the
// tile's nk keys, V rows v_tok apart: each row's chain in key order, its sums in registers.
template <typename T, int D, int R>
inline void accumulate_rows(const float* p, const T* v, int64_t v_tok, int64_t nk, float* acc) {
  constexpr int kVecs = D / kLanes;
  Vec row[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < kVecs; ++c) row[i][c] = load(acc + i * D + c * kLanes);
  for (int64_t j = 0; j < nk; ++j, v += v_tok) {
    Vec x[kVecs];
    for (int c = 0; c < kVecs; ++c) x[c] = load_as_float(v + c * kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec w = splat(p[i * kKTile + j]);
      for (int c = 0; c < kVecs; ++c) row[i][c] += w * x[c];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < kVecs; ++c) store(acc + i * D + c * kLanes, row[i][c]);
}

// p[r][0..kKTile) <- q[r] . K[k0 + j] for rows [0, rows), four rows at a time in registers.
template <int D>
void prefill_scores(const float* q, int64_t rows, const float* kt, int64_t s_pad, int64_t k0,
                float* p) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    for (int jv = 0; jv < kKVecs; jv += 2) {
      Vec a[4][2] = {};
      const float* col = kt + k0 + jv * kLanes;
      for (int d = 0; d < D; ++d) {
        const Vec k_lo = load(col + d * s_pad), k_hi = load(col + d * s_pad + kLanes);
        for (int i = 0; i < 4; ++i) {
          const Vec x = splat(q[(r + i) * D + d]);
          a[i][0] += x * k_lo;
          a[i][1] += x * k_hi;
        }
      }
      for (int i = 0; i < 4; ++i) {
        store(p + (r + i) * kKTile + jv * kLanes, a[i][0]);
        store(p + (r + i) * kKTile + (jv + 1) * kLanes, a[i][1]);
      }
    }
  }
  for (; r < rows; ++r) {
    for (int jv = 0; jv < kKVecs; ++jv) {
      Vec a{};
      const float* col = kt + k0 + jv * kLanes;
      for (int d = 0; d < D; ++d) a += splat(q[r * D + d]) * load(col + d * s_pad);
      store(p + r * kKTile + jv * kLanes, a);
    }
  }
}

// One key tile's scores in s.p folded into each row's online softmax: probabilities into p,
// the running sums rescaled to the new max; s.seen says which rows see a key of the tile.
template <int D>
void fold_softmax(PrefillScratch& s, int64_t rows) {
  constexpr int kVecs = D / kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = s.p.data() + r * kKTile;
    Vec sc[kKVecs];
    Vec top = sc[0] = load(pr);
    for (int i = 1; i < kKVecs; ++i) {
      sc[i] = load(pr + i * kLanes);
      top = top > sc[i] ? top : sc[i];
    }
    const float new_max = std::max(s.m[r], hmax(top));
    s.seen[r] = new_max != kMasked;
    if (!s.seen[r]) continue;  // nothing visible to this row yet
    Vec sum{};
    for (int i = 0; i < kKVecs; ++i) {
      const Vec e = exp_nonpositive(sc[i] - new_max);
      store(pr + i * kLanes, e);
      sum += e;
    }
    float* ar = s.acc.data() + r * D;
    const float alpha = s.m[r] == kMasked ? 0.0f : exp_nonpositive(s.m[r] - new_max);
    for (int c = 0; c < kVecs; ++c) store(ar + c * kLanes, load(ar + c * kLanes) * alpha);
    s.l[r] = s.l[r] * alpha + hsum(sum);
    s.m[r] = new_max;
  }
}

// The tile's nk V rows (vrows, v_tok apart) into the rows' sums by their probabilities,
// kRowsAtOnce<D> rows at a time where all of them see the tile (each row's chain over the keys
// is unchanged; the rows only share the V loads).
template <typename T, int D>
void accumulate_tile(const T* vrows, int64_t v_tok, int64_t nk, int64_t rows,
                     PrefillScratch& s) {
  constexpr int64_t kRows = kRowsAtOnce<D>;
  for (int64_t r = 0; r < rows;) {
    const bool all = r + kRows <= rows &&
                     std::all_of(s.seen.begin() + r, s.seen.begin() + r + kRows,
                                 [](char x) { return x != 0; });
    if (all) {
      accumulate_rows<T, D, kRows>(s.p.data() + r * kKTile, vrows, v_tok, nk,
                                   s.acc.data() + r * D);
      r += kRows;
    } else {
      if (s.seen[r])
        accumulate_rows<T, D, 1>(s.p.data() + r * kKTile, vrows, v_tok, nk, s.acc.data() + r * D);
      ++r;
    }
  }
}

// One item: query tokens [t0, t1) of the chunk, the query heads of KV head g.
template <typename T, int D>
void attend_tile(const PrefillArgs<T>& a, int64_t g, int64_t t0, int64_t t1, PrefillScratch& s) {
  const int64_t G = a.group, rows = (t1 - t0) * G, offset = a.S - a.L;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const T* src = a.q + t * a.q_tok + (g * G + h) * a.q_head;
      float* dst = s.q.data() + ((t - t0) * G + h) * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
    }
  std::fill_n(s.acc.begin(), rows * D, 0.0f);
  std::fill_n(s.m.begin(), rows, kMasked);
  std::fill_n(s.l.begin(), rows, 0.0f);
  const int64_t first_pos = offset + t0, last_pos = offset + t1 - 1;
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  const float* kt = a.kt + g * D * a.s_pad;
  for (int64_t k0 = start; k0 <= last_pos; k0 += kKTile) {
    const int64_t nk = std::min<int64_t>(kKTile, last_pos + 1 - k0);
    prefill_scores<D>(s.q.data(), rows, kt, a.s_pad, k0, s.p.data());
    // Mask keys past a row's position, before its window, or past the tile's end.
    const bool open = k0 + kKTile - 1 <= first_pos &&
                      (a.window == 0 || k0 > last_pos - a.window);
    if (!open) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = offset + t0 + r / G;
        float* pr = s.p.data() + r * kKTile;
        for (int j = 0; j < kKTile; ++j) {
          const int64_t key = k0 + j;
          if (j >= nk || key > pos || (a.window > 0 && key <= pos - a.window)) pr[j] = kMasked;
        }
      }
    }
    fold_softmax<D>(s, rows);
    accumulate_tile<T, D>(a.v + k0 * a.v_tok + g * a.v_head, a.v_tok, nk, rows, s);
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = (t - t0) * G + h;
      const float inv = 1.0f / s.l[r];  // l >= 1: every row sees at least its own key
      T* dst = a.out + (t * a.kv_heads * G + g * G + h) * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(s.acc[r * D + d] * inv);
    }
}

template <typename T, int D>
void run_prefill(const PrefillArgs<T>& a) {
  static_assert(D % kLanes == 0, "rows are processed in whole vectors of kLanes floats");
  const int64_t tiles = (a.L + kQTile - 1) / kQTile, items = tiles * a.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    PrefillScratch scratch(kQTile * a.group, D);
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t tile = tiles - 1 - i / a.kv_heads;  // latest (most keys) first
      const int64_t t0 = tile * kQTile;
      attend_tile<T, D>(a, i % a.kv_heads, t0, std::min(t0 + kQTile, a.L), scratch);
    }
  });
}

template <typename T>
PrefillArgs<T> make_prefill_args(const at::Tensor& q, const at::Tensor& v, const at::Tensor& kt,
                                 int64_t S, int64_t KV, double scale, int64_t window,
                                 at::Tensor& out) {
  return PrefillArgs<T>{q.data_ptr<T>(), q.stride(0), q.stride(1),
                        v.data_ptr<T>(), v.stride(0), v.stride(1),
                        kt.data_ptr<float>(), kt.size(2), q.size(0), S, KV, q.size(1) / KV,
                        static_cast<float>(scale), window, out.data_ptr<T>()};
}

template <typename T>
void dispatch_prefill(const PrefillArgs<T>& args, int64_t head_dim) {
  switch (head_dim) {
#define TIERSERVE_CASE(DIM)    \
  case DIM:                    \
    return run_prefill<T, DIM>(args);
    TIERSERVE_HEAD_DIMS(TIERSERVE_CASE)
#undef TIERSERVE_CASE
  }
  TORCH_CHECK(false, "prefill_attention: unsupported head_dim ", head_dim);
}

at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, double scale, int64_t window) {
  const char* op = "prefill_attention: ";
  for (const at::Tensor* t : {&q_in, &k_in, &v_in}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == q_in.scalar_type() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                op, "q, k and v must be CPU tensors of one dtype, float32 or bfloat16");
    TORCH_CHECK(t->dim() == 3, op, "q must be [L, heads, D], k and v [S, kv_heads, D]");
  }
  TORCH_CHECK(k_in.sizes() == v_in.sizes(), op, "k ", k_in.sizes(), " != v ", v_in.sizes());
  const int64_t L = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t S = k_in.size(0), KV = k_in.size(1);
  TORCH_CHECK(k_in.size(2) == D, op, "q and k head dims differ");
  TORCH_CHECK(L >= 1 && S >= L, op, "need 1 <= L <= S, got L=", L, " S=", S);
  TORCH_CHECK(KV >= 1 && H % KV == 0, op, "heads (", H, ") must be a multiple of kv_heads (", KV,
              ")");
  TORCH_CHECK(window >= 0, op, "window must be >= 0");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor v = v_in.stride(2) == 1 ? v_in : v_in.contiguous();
  // [KV, D, S_pad] fp32, zero-padded to whole key tiles (and one extra: a tile may start
  // anywhere).
  const int64_t s_pad = (S + 2 * kKTile - 1) / kKTile * kKTile;
  at::Tensor kt = at::zeros({KV, D, s_pad}, k_in.options().dtype(at::kFloat));
  kt.narrow(2, 0, S).copy_(k_in.permute({1, 2, 0}));
  at::Tensor out = at::empty({L, H, D}, q.options());
  if (q.scalar_type() == at::kFloat)
    dispatch_prefill(make_prefill_args<float>(q, v, kt, S, KV, scale, window, out), D);
  else
    dispatch_prefill(make_prefill_args<c10::BFloat16>(q, v, kt, S, KV, scale, window, out), D);
  return out;
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("prefill_attention", &tierserve::prefill_attention);
}

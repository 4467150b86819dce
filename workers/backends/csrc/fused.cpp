// Fused elementwise ops of a Llama layer for CPU: each reads its inputs and writes its outputs
// once, where the torch formulation makes ~7 passes and as many temporaries (at prefill sizes
// they cost as much as the attention). Each reproduces the Hugging Face formulation's roundings
// step by step (for bf16: where HF rounds a temporary to bf16, so do these), so results differ
// from torch's only by the order of the RMS sum and by exp's last ulp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace tierserve {
namespace {

// Loads and stores of kLanes values of T as fp32; bf16 stores round to nearest even (NaN kept
// NaN), as c10::BFloat16's conversion does.
template <typename T>
inline Vec vload(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else {
    return load_bf16(p);
  }
}

template <typename T>
inline void vstore(T* p, Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    store(p, v);
  } else {
    store_bf16(p, v);
  }
}

// The first n (<= kLanes) values, the other lanes 0; and a store of the first n lanes.
template <typename T>
inline Vec vload_n(const T* p, int64_t n) {
  if (n == kLanes) return vload(p);
  alignas(64) T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return vload(tmp);
}

template <typename T>
inline void vstore_n(T* p, Vec v, int64_t n) {
  if (n == kLanes) return vstore(p, v);
  alignas(64) T tmp[kLanes];
  vstore(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

// fp32 -> T -> fp32: the value a T temporary holds.
template <typename T>
inline Vec round_to(Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[kLanes];
    vstore(tmp, v);
    return vload(tmp);
  }
}

// Lane 0 first, in order.
inline float sum_lanes(Vec v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// exp(x) for all x, saturating to 0 and to +inf like expf.
inline Vec exp_all(Vec x) {
  const auto lo = x < -87.33654f, hi = x > 88.72283f;
  const Vec e = exp_in_range(lo ? splat(-87.0f) : (hi ? splat(88.0f) : x));
  return lo ? Vec{} : (hi ? splat(INFINITY) : e);
}

void check_rows(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, what, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, op, what, " must be [rows, width] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, what,
              " must be float32 or bfloat16");
}

// ---------------------------------------------------------------- RMSNorm (+ residual add)

// HF: h = x + residual (in T); out = weight * T(h32 * rsqrt(mean(h32^2) + eps)), in T.
template <typename T>
void rms_norm_rows(const T* x, int64_t ldx, const T* res, int64_t ldr, const T* w, T* out,
                   T* res_out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * ldx;
      T* o = out + r * width;
      const T* h = xr;
      if (res != nullptr) {
        T* hr = res_out + r * width;
        const T* rr = res + r * ldr;
        for (int64_t j = 0; j < width; j += kLanes) {
          const int64_t n = std::min<int64_t>(kLanes, width - j);
          vstore_n(hr + j, vload_n(xr + j, n) + vload_n(rr + j, n), n);
        }
        h = hr;
      }
      Vec sq{};
      for (int64_t j = 0; j < width; j += kLanes) {
        const Vec v = vload_n(h + j, std::min<int64_t>(kLanes, width - j));
        sq += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum_lanes(sq) / static_cast<float>(width) + eps);
      for (int64_t j = 0; j < width; j += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, width - j);
        vstore_n(o + j, vload_n(w + j, n) * round_to<T>(vload_n(h + j, n) * inv), n);
      }
    }
  });
}

// norm(x + residual) into out and x + residual into res_out, which it returns; without a
// residual, norm(x) into out, and x is returned (res_out untouched).
at::Tensor rms_norm_into(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                         const at::Tensor& weight, double eps, at::Tensor& out,
                         at::Tensor& res_out) {
  const char* op = "rms_norm: ";
  check_rows(x, "x", op);
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == width, op, "weight must be a contiguous [", width, "] tensor of x's dtype");
  check_out_rows(op, out, rows, width, x.scalar_type());
  if (residual.has_value()) {
    check_rows(*residual, "residual", op);
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), op,
                "residual must match x");
    check_out_rows(op, res_out, rows, width, x.scalar_type());
  }
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0),
                         residual ? residual->data_ptr<float>() : nullptr,
                         residual ? residual->stride(0) : 0, weight.data_ptr<float>(),
                         out.data_ptr<float>(), residual ? res_out.data_ptr<float>() : nullptr,
                         rows, width, e);
  } else {
    using B = c10::BFloat16;
    rms_norm_rows<B>(x.data_ptr<B>(), x.stride(0), residual ? residual->data_ptr<B>() : nullptr,
                     residual ? residual->stride(0) : 0, weight.data_ptr<B>(), out.data_ptr<B>(),
                     residual ? res_out.data_ptr<B>() : nullptr, rows, width, e);
  }
  return residual.has_value() ? res_out : x;
}

// Returns (norm(x + residual), x + residual), or (norm(x), x) without a residual.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  check_rows(x, "x", "rms_norm: ");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor res_out = residual.has_value() ? at::empty(x.sizes(), x.options()) : x;
  at::Tensor stream = rms_norm_into(x, residual, weight, eps, out, res_out);
  return {out, stream};
}

// ---------------------------------------------------------------- SiLU and mul

// HF: T(silu(gate)) * up, each rounded to T; silu(g) = g / (1 + exp(-g)).
template <typename T>
void silu_mul_rows(const T* x, int64_t ldx, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * ldx;
      const T* u = g + d;
      T* o = out + r * d;
      for (int64_t j = 0; j < d; j += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, d - j);
        const Vec gv = vload_n(g + j, n);
        const Vec s = round_to<T>(gv / (1.0f + exp_all(-gv)));
        vstore_n(o + j, s * vload_n(u + j, n), n);
      }
    }
  });
}

void silu_and_mul_into(const at::Tensor& x, at::Tensor& out) {
  const char* op = "silu_and_mul: ";
  check_rows(x, "x", op);
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, op, "width ", x.size(1), " must be even");
  check_out_rows(op, out, rows, d, x.scalar_type());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows<float>(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), rows, d);
  else
    silu_mul_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0),
                                 out.data_ptr<c10::BFloat16>(), rows, d);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x", "silu_and_mul: ");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_into(x, out);
  return out;
}

// ---------------------------------------------------------------- rotary + KV cache write

// One head row of D values, rotate-half RoPE: out1 = x1 c - x2 s, out2 = x2 c + x1 s, each
// product and the sum rounded to T as HF's (q * cos) + (rotate_half(q) * sin) rounds them. No
// FMA contraction here, so that fp32 results equal torch's bit for bit.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_row(const T* x, const T* c, const T* s,
                                                              T* out, int64_t half) {
  for (int64_t j = 0; j < half; j += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, half - j);
    const Vec x1 = vload_n(x + j, n), x2 = vload_n(x + half + j, n);
    const Vec cv = vload_n(c + j, n), sv = vload_n(s + j, n);
    const Vec a = round_to<T>(x1 * cv), b = round_to<T>(-x2 * sv);
    const Vec e = round_to<T>(x2 * cv), f = round_to<T>(x1 * sv);
    vstore_n(out + j, a + b, n);
    vstore_n(out + half + j, e + f, n);
  }
}

template <typename T>
void rotary_rows(const T* qkv, int64_t ld, const T* cos, const T* sin, int64_t ldcs, T* q_out,
                 T* k_out, T* k_cache, T* v_cache, const int64_t* slots, int64_t tokens,
                 int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = qkv + t * ld;
      const T* c = cos + t * ldcs;
      const T* s = sin + t * ldcs;
      for (int64_t h = 0; h < heads; ++h) rotate_row(row + h * d, c, s, q_out + (t * heads + h) * d, half);
      T* kr = k_out + t * kv_heads * d;
      for (int64_t h = 0; h < kv_heads; ++h) rotate_row(row + (heads + h) * d, c, s, kr + h * d, half);
      const int64_t at_slot = slots[t] * kv_heads * d;
      std::memcpy(k_cache + at_slot, kr, kv_heads * d * sizeof(T));
      std::memcpy(v_cache + at_slot, row + (heads + kv_heads) * d, kv_heads * d * sizeof(T));
    }
  });
}

// qkv [T, (heads + 2 kv_heads) D], cos/sin [T, D/2] in qkv's dtype, pools [blocks, block_size,
// kv_heads, D], slot_mapping int64 [T] -> q [T, heads, D] and k [T, kv_heads, D] rotated, into
// q and k (contiguous); the rotated K and the V of every token are written to their pool slots.
void rotary_write_kv_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& slot_mapping, int64_t heads, at::Tensor& q,
                          at::Tensor& k) {
  const char* op = "rotary_write_kv: ";
  check_rows(qkv, "qkv", op);
  check_rows(cos, "cos", op);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), op,
              "k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, D] pools");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), d = k_cache.size(3);
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, op,
              "qkv, cos, sin and the pools must share a dtype");
  TORCH_CHECK(d % 2 == 0, op, "head_dim ", d, " must be even");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, op, "qkv width ", qkv.size(1),
              " != (", heads, " + 2 * ", kv_heads, ") * ", d);
  TORCH_CHECK(cos.sizes() == sin.sizes() && sin.stride(0) == cos.stride(0) && sin.stride(1) == 1 &&
                  cos.size(0) == tokens && cos.size(1) == d / 2, op, "cos and sin must be [", tokens,
              ", ", d / 2, "] alike");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens, op, "slot_mapping must be a contiguous int64 [",
              tokens, "] tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, op, "slot ", slots[t], " is outside the pool");
  TORCH_CHECK(q.is_contiguous() && q.numel() == tokens * heads * d && q.scalar_type() == dtype &&
                  k.is_contiguous() && k.numel() == tokens * kv_heads * d &&
                  k.scalar_type() == dtype, op, "q and k must be contiguous [", tokens,
              ", heads, ", d, "] tensors of qkv's dtype");
  if (dtype == at::kFloat) {
    rotary_rows<float>(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(),
                       sin.data_ptr<float>(), cos.stride(0), q.data_ptr<float>(), k.data_ptr<float>(),
                       k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots, tokens, heads,
                       kv_heads, d);
  } else {
    using B = c10::BFloat16;
    rotary_rows<B>(qkv.data_ptr<B>(), qkv.stride(0), cos.data_ptr<B>(), sin.data_ptr<B>(),
                   cos.stride(0), q.data_ptr<B>(), k.data_ptr<B>(), k_cache.data_ptr<B>(),
                   v_cache.data_ptr<B>(), slots, tokens, heads, kv_heads, d);
  }
}

std::tuple<at::Tensor, at::Tensor> rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos,
                                                   const at::Tensor& sin, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache,
                                                   const at::Tensor& slot_mapping, int64_t heads) {
  check_rows(qkv, "qkv", "rotary_write_kv: ");
  TORCH_CHECK(k_cache.dim() == 4, "rotary_write_kv: k_cache must be a [blocks, block_size, "
              "kv_heads, D] pool");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), d = k_cache.size(3);
  at::Tensor q = at::empty({tokens, heads, d}, qkv.options());
  at::Tensor k = at::empty({tokens, kv_heads, d}, qkv.options());
  rotary_write_kv_into(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, q, k);
  return {q, k};
}

// ---------------------------------------------------------------- Greedy sampling

// The first index of each row's maximum, NaN above every number (as torch's max(dim) picks):
// one pass, kLanes running (max, index) lanes, where torch's max(dim) makes several
// (bench/step_profile.py times both).
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  IVec lane = lane_ids();
  IVec at = n >= kLanes ? lane : IVec{} - 1;  // -1: a lane that saw nothing
  Vec best = n >= kLanes ? vload(row) : Vec{};
  int64_t j = n >= kLanes ? kLanes : 0;
  for (lane += static_cast<int>(j); j + kLanes <= n; j += kLanes, lane += kLanes) {
    const Vec v = vload(row + j);
    // Strictly greater keeps a lane's first maximum; a NaN beats a number, not a NaN.
    const IVec take = (v > best) | ((v != v) & (best == best));
    best = take ? v : best;
    at = take ? lane : at;
  }
  float bv = -INFINITY;
  int64_t bi = -1;
  auto offer = [&](float v, int64_t i) {
    const bool better = bi < 0 || v > bv || (v != v && bv == bv) ||
                        ((v == bv || (v != v && bv != bv)) && i < bi);
    if (better) {
      bv = v;
      bi = i;
    }
  };
  for (int l = 0; l < kLanes; ++l)
    if (at[l] >= 0) offer(best[l], at[l]);
  for (; j < n; ++j) offer(static_cast<float>(row[j]), j);
  return bi;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  const char* op = "argmax_rows: ";
  check_rows(x, "x", op);
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), op, "rows must hold 1 .. 2^31 - 1 values");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (x.scalar_type() == at::kFloat)
        o[r] = row_argmax(x.data_ptr<float>() + r * ld, n);
      else
        o[r] = row_argmax(x.data_ptr<c10::BFloat16>() + r * ld, n);
    }
  });
  return out;
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("rms_norm", &tierserve::rms_norm);
  m.impl("silu_and_mul", &tierserve::silu_and_mul);
  m.impl("argmax_rows", &tierserve::argmax_rows);
  m.impl("rotary_write_kv", &tierserve::rotary_write_kv);
}

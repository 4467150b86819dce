// The panel layout of linear weights, shared by linear.cpp (which defines it), linear_pairs.cpp
// and linear_amx.cpp (which read it): [ceil(N / kPanel), K, kPanel], panel p holding output
// features [p * kPanel, (p + 1) * kPanel) as a contiguous [K][kPanel] block, the last one
// zero-padded; a panel is two Vecs wide, so its width depends on the build's ISA. Every kernel
// source includes it, so kernels.build_dir_for hashes it with them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

namespace tierserve {

constexpr int64_t kPanel = 2 * kLanes;  // output features per panel: two Vecs

// Whether packed holds bf16 pair panels ([ceil(N / kPanel), K / 2, 2 kPanel]: per k pair, the
// panel's output features' weights for k = 2j and 2j + 1 side by side; linear_pairs.cpp).
inline bool pair_layout(const at::Tensor& packed) {
  return packed.dim() == 3 && packed.size(2) == 2 * kPanel &&
         packed.scalar_type() == at::kBFloat16;
}

// Checks the shapes of y = x W^T + b's inputs, W in panels of N = n output features.
inline void check_panel_shapes(const char* op, const at::Tensor& x, const at::Tensor& packed,
                               int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, "x must be [M, K] with contiguous rows");
  const bool pairs = pair_layout(packed);
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kPanel || pairs) && packed.is_contiguous(),
              op, "packed weight must be a contiguous [panels, K, ", kPanel,
              "] tensor (or bf16 [panels, K / 2, ", 2 * kPanel, "] pairs)");
  const int64_t panels = packed.size(0), k = pairs ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(k == x.size(1), op, "x has K = ", x.size(1), ", the weight ", k);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, op, "n = ", n,
              " does not match ", panels, " panels");
}

// Items [0, count) over the threads: each owns an equal run (within one) and claims it from
// the front, at most `most` items a claim and fewer as the run ends (half of what is left, at
// least kStolenItems); a thread done with its run takes kStolenItems at a time from the backs
// of the others'. The bandwidth each core gets differs from one product to the next, and with
// fixed shares the faster thread waits at the join for the other's last items.
constexpr int64_t kStolenItems = 2;

struct alignas(64) ItemRun {
  std::atomic<uint64_t> ends;  // unclaimed items [front, back): front low 32 bits, back high
};

inline uint64_t pack_ends(int64_t front, int64_t back) {
  return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
}

// Claims items [from, from + n) of run r, from its front (owner) or its back; returns n, 0
// when none are left.
inline int64_t claim_items(ItemRun& r, bool owner, int64_t most, int64_t& from) {
  uint64_t ends = r.ends.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t front = static_cast<int64_t>(ends & 0xffffffffu);
    const int64_t back = static_cast<int64_t>(ends >> 32), left = back - front;
    if (left <= 0) return 0;
    const int64_t n = std::min(left, owner ? std::clamp(left / 2, kStolenItems, most)
                                           : kStolenItems);
    const uint64_t after = owner ? pack_ends(front + n, back) : pack_ends(front, back - n);
    if (r.ends.compare_exchange_weak(ends, after, std::memory_order_relaxed)) {
      from = owner ? front : back - n;
      return n;
    }
  }
}

// Calls work(begin, end) on claims of items [0, count) as above (count < 2^31, most >= 2).
template <typename Work>
void balanced_runs(int64_t count, int64_t most, Work&& work) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  std::unique_ptr<ItemRun[]> runs(new ItemRun[std::max<int64_t>(threads, 1)]);
  for (int64_t t = 0; t < threads; ++t)
    runs[t].ends.store(pack_ends(count * t / threads, count * (t + 1) / threads),
                       std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = 0; i < threads; ++i) {
        int64_t from = 0;
        for (int64_t n; (n = claim_items(runs[(t + i) % threads], i == 0, most, from)) > 0;)
          work(from, from + n);
      }
  });
}

// A single input row through `panels` panels, the first `full` of them whole, claimed as
// balanced_runs deals them (at most `group` a claim): whole(first, count) for whole ones,
// partial(p) for the partial last panel. The runs are of panels, not of whole groups: those
// would leave one thread most of a weight whose panels are few (576 outputs are 18 panels on
// AVX-512).
template <typename Whole, typename Partial>
void single_row_panels(int64_t panels, int64_t full, int64_t group, Whole&& whole,
                       Partial&& partial) {
  balanced_runs(panels, group, [&](int64_t p0, int64_t p1) {
    const int64_t last = std::min(p1, full);
    if (p0 < last) whole(p0, last - p0);
    if (p1 > full) partial(full);
  });
}

// Checks an op's output buffer, which its kernel writes through raw pointers.
inline void check_out_rows(const char* op, const at::Tensor& out, int64_t rows, int64_t width,
                           at::ScalarType dtype) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == width && out.scalar_type() == dtype && out.device().is_cpu(),
              op, "out must be a contiguous [", rows, ", ", width, "] CPU tensor of x's dtype");
}

// Checks an fp32 y = x W^T + b's inputs; returns b's data (or nullptr). narrow: the panels may
// also hold bf16 or fp16 values (weights exactly representable there), in the plain layout.
inline const float* check_panel_linear(const char* op, const at::Tensor& x,
                                       const at::Tensor& packed,
                                       const std::optional<at::Tensor>& bias, int64_t n,
                                       bool narrow = false) {
  const auto w = packed.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (w == at::kFloat || (narrow && (w == at::kBFloat16 || w == at::kHalf))),
              op, narrow ? "float32 x; float32, bfloat16 or float16 panels only" : "float32 only");
  check_panel_shapes(op, x, packed, n);
  TORCH_CHECK(w == at::kFloat || !pair_layout(packed), op, "fp32 x needs plain panels");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, "bias must be a contiguous float32 [n] tensor");
  return bias->data_ptr<float>();
}

}  // namespace tierserve

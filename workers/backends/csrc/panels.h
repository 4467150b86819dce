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
#include <cstdint>
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

// A single input row through `panels` panels, the first `full` of them whole: each thread
// takes an equal run of panels (within one), its whole ones `group` at a time
// (whole(first, count)), then the partial last panel (partial(p)) where its run holds it.
// Whole groups as work items would leave one thread most of a weight whose panels are few
// (576 outputs are 18 panels on AVX-512).
template <typename Whole, typename Partial>
void single_row_panels(int64_t panels, int64_t full, int64_t group, Whole&& whole,
                       Partial&& partial) {
  const int64_t chunks = std::min<int64_t>(at::get_num_threads(), panels);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = panels * t / chunks, p1 = panels * (t + 1) / chunks;
      const int64_t last = std::min(p1, full);
      for (int64_t p = p0; p < last; p += group) whole(p, std::min(group, last - p));
      if (p1 > full) partial(full);
    }
  });
}

// Checks an fp32 y = x W^T + b's inputs; returns b's data (or nullptr).
inline const float* check_panel_linear(const char* op, const at::Tensor& x,
                                       const at::Tensor& packed,
                                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, op,
              "float32 only");
  check_panel_shapes(op, x, packed, n);
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, "bias must be a contiguous float32 [n] tensor");
  return bias->data_ptr<float>();
}

}  // namespace tierserve

// Coded fp32 panels (linear_coded.cpp, which is included before this file and defines the
// layout and the decoder) from an fp32 weight at load, and back to fp32 panels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

namespace tierserve {
namespace {

// The fp32 panels ([panels, K, kPanel], linear.cpp's layout) the coded panels hold.
at::Tensor coded_panels(const at::Tensor& body, const at::Tensor& table,
                        const at::Tensor& escapes, int64_t n, int64_t k) {
  const CodedView w = check_coded("coded_panels: ", body, table, escapes, n, k);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::empty({panels, k, kPanel}, at::kFloat);
  float* o = out.data_ptr<float>();
  const CodedDecoder dec(w.tops);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = o + p * k * kPanel;
      for (int64_t i = 0; i < k; ++i)
        decode_step(dec, w.panel(p) + i * kCodedStep, panel + i * kPanel);
      escapes_of(w, p).patch(panel, 0, k);
      const int64_t width = std::min<int64_t>(kPanel, n - p * kPanel);
      if (width < kPanel)  // padding rows: zero, as linear.cpp pads them
        for (int64_t i = 0; i < k; ++i)
          std::fill_n(panel + i * kPanel + width, kPanel - width, 0.0f);
    }
  });
  return out;
}

// The plain [n, K] fp32 weight the coded panels hold (MKL's operand past the panel kernel's
// rows): per panel, blocks of k steps decoded into a tile, then written out as runs of each
// output feature's row, so that neither side is read or written with a stride.
at::Tensor coded_weight(const at::Tensor& body, const at::Tensor& table,
                        const at::Tensor& escapes, int64_t n, int64_t k) {
  const CodedView w = check_coded("coded_weight: ", body, table, escapes, n, k);
  constexpr int64_t kBlock = 64;  // k steps a tile: 8 KiB of fp32 on AVX-512
  at::Tensor out = at::empty({n, k}, at::kFloat);
  float* o = out.data_ptr<float>();
  const CodedDecoder dec(w.tops);
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float tile[kBlock * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      F32Escapes escapes_p = escapes_of(w, p);
      const int64_t width = std::min<int64_t>(kPanel, n - p * kPanel);
      for (int64_t k0 = 0; k0 < k; k0 += kBlock) {
        const int64_t kn = std::min(kBlock, k - k0);
        for (int64_t i = 0; i < kn; ++i)
          decode_step(dec, w.panel(p) + (k0 + i) * kCodedStep, tile + i * kPanel);
        escapes_p.patch(tile, k0, k0 + kn);
        for (int64_t j = 0; j < width; ++j)
          for (int64_t i = 0; i < kn; ++i) o[(p * kPanel + j) * k + k0 + i] = tile[i * kPanel + j];
      }
    }
  });
  return out;
}

// The top byte of an fp32 value.
inline uint32_t top_byte(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits >> 24;
}

// How often each top byte occurs in w.
std::array<int64_t, 256> top_byte_counts(const float* w, int64_t numel) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> counts(threads * 256, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t* c = counts.data() + t * 256;
      for (int64_t i = numel * t / threads; i < numel * (t + 1) / threads; ++i) ++c[top_byte(w[i])];
    }
  });
  std::array<int64_t, 256> total{};
  for (int64_t t = 0; t < threads; ++t)
    for (int v = 0; v < 256; ++v) total[v] += counts[t * 256 + v];
  return total;
}

// The 16 most frequent top bytes by `counts` (ties in value order), as value << 24.
std::array<int32_t, kCodes> most_frequent(const std::array<int64_t, 256>& counts) {
  std::array<int, 256> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return counts[a] > counts[b]; });
  std::array<int32_t, kCodes> tops;
  for (int c = 0; c < kCodes; ++c)
    tops[c] = static_cast<int32_t>(static_cast<uint32_t>(order[c]) << 24);
  return tops;
}

// Each top byte's code: its index in tops, or -1 (an escape).
std::array<int16_t, 256> codes_of(const std::array<int32_t, kCodes>& tops) {
  std::array<int16_t, 256> code;
  code.fill(-1);
  for (int c = 0; c < kCodes; ++c)
    code[static_cast<uint32_t>(tops[c]) >> 24] = static_cast<int16_t>(c);
  return code;
}

// (body, table, escapes) from the coded body, the table's top bytes and each panel's escapes
// (position, bits pairs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_escapes(
    const at::Tensor& body, const std::array<int32_t, kCodes>& tops,
    const std::vector<std::vector<int32_t>>& escapes) {
  const int64_t panels = static_cast<int64_t>(escapes.size());
  at::Tensor table = at::empty({kCodes + panels + 1}, at::kInt);
  int32_t* t = table.data_ptr<int32_t>();
  std::copy(tops.begin(), tops.end(), t);
  int64_t total = 0;
  for (int64_t p = 0; p < panels; ++p) {
    t[kCodes + p] = static_cast<int32_t>(total);
    total += static_cast<int64_t>(escapes[p].size()) / 2;
  }
  TORCH_CHECK(total < (int64_t{1} << 31), "coded panels: too many escapes");
  t[kCodes + panels] = static_cast<int32_t>(total);
  at::Tensor flat = at::empty({total, 2}, at::kInt);
  for (int64_t p = 0; p < panels; ++p)
    std::copy(escapes[p].begin(), escapes[p].end(), flat.data_ptr<int32_t>() + 2 * t[kCodes + p]);
  return {body, table, flat};
}

// Panel p's coded bytes into body; appends its escapes ((k * kPanel + column, bits) pairs, in
// (k, column) order) to `escapes`.
void encode_panel(const float* w, int64_t n, int64_t k, int64_t p,
                  const std::array<int16_t, 256>& code, uint8_t* body,
                  std::vector<int32_t>& escapes) {
  const int64_t rows = std::min<int64_t>(kPanel, n - p * kPanel);
  for (int64_t i = 0; i < k; ++i) {
    uint8_t* step = body + (p * k + i) * kCodedStep;
    for (int64_t col = 0; col < rows; ++col) {
      uint32_t bits;
      std::memcpy(&bits, w + (p * kPanel + col) * k + i, sizeof(bits));
      int c = code[bits >> 24];
      if (c < 0) {
        escapes.push_back(static_cast<int32_t>(i * kPanel + col));
        escapes.push_back(static_cast<int32_t>(bits));
        c = 0;
      }
      uint8_t* vec = step + (col / kLanes) * kCodedVecBytes;
      const int64_t lane = col % kLanes;
      vec[3 * lane] = static_cast<uint8_t>(bits);
      vec[3 * lane + 1] = static_cast<uint8_t>(bits >> 8);
      vec[3 * lane + 2] = static_cast<uint8_t>(bits >> 16);
      vec[3 * kLanes + lane / 2] |= static_cast<uint8_t>(c << (4 * (lane % 2)));
    }
  }
}

// (body, table, escapes) of an fp32 [n, K] weight (layout at the top of the file).
std::tuple<at::Tensor, at::Tensor, at::Tensor> coded_encode(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 2 && weight.numel() > 0,
              "coded_encode: weight must be a non-empty float32 [n, K] CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(k * kPanel < (int64_t{1} << 31), "coded_encode: K too large");
  const float* src = w.data_ptr<float>();
  const std::array<int32_t, kCodes> tops = most_frequent(top_byte_counts(src, w.numel()));
  const std::array<int16_t, 256> code = codes_of(tops);
  // Zeroed: code nibbles are or-ed in, and padding rows' lanes stay zero.
  at::Tensor body = at::zeros({panels * k * kCodedStep + kCodedPad}, at::kByte);
  std::vector<std::vector<int32_t>> escapes(panels);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      encode_panel(src, n, k, p, code, body.data_ptr<uint8_t>(), escapes[p]);
  });
  return pack_escapes(body, tops, escapes);
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("coded_encode(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("coded_panels(Tensor body, Tensor table, Tensor escapes, int n, int k) -> Tensor");
  m.def("coded_weight(Tensor body, Tensor table, Tensor escapes, int n, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("coded_encode", &tierserve::coded_encode);
  m.impl("coded_panels", &tierserve::coded_panels);
  m.impl("coded_weight", &tierserve::coded_weight);
}

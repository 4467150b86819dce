// GGUF block codes (Q4_1, Q8_0) in quant.cpp's panel layout, from fp32 weights, two ways (included
// after quant.cpp, whose layout constants it uses):
// - quant_encode_*: codes that rebuild every weight exactly, where the weights are a GGUF
//   file's blocks dequantized (or none: the caller keeps the fp32 kernel);
// - quant_quantize_*: any finite weight quantized with the arithmetic of llama.cpp's reference
//   quantizer (gguf-py's quantize_blocks in fp32, as quant.py's reference_quantize, operation for
//   operation: the codes equal a GGUF file's); none where a value is not finite. The engine's quantization at load, and the
//   greedy head's Q8_0 copy of a dense head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace tierserve {
namespace {

// fp16 neighbours of v (v rounded to fp16, then up to two fp16 steps either way), as fp32:
// GGUF scales are fp16, and the rounding of the weights they produced hides the exact one.
inline int fp16_candidates(float v, float* out) {
  const uint16_t bits = c10::Half(v).x;
  int count = 0;
  for (int step : {0, -1, 1, -2, 2}) {
    const int b = static_cast<int>(bits & 0x7FFF) + step;
    if (b < 0 || b >= 0x7C00) continue;  // past zero, or infinities and NaNs
    out[count++] = static_cast<float>(c10::Half(static_cast<uint16_t>((bits & 0x8000) | b),
                                                c10::Half::from_bits()));
  }
  return count;
}

// Codes, scale and offset rebuilding w[0..31] exactly as fma(q, d, m), q in 0..15; false where
// none of the candidate scales does.
bool encode_q4_block(const float* w, uint8_t* q, float& d, float& m) {
  float lo = w[0], hi = w[0];
  for (int j = 1; j < kQBlock; ++j) lo = std::min(lo, w[j]), hi = std::max(hi, w[j]);
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  m = lo;
  float cands[5];
  const int count = hi == lo ? 1 : fp16_candidates((hi - lo) / 15.0f, cands);
  if (hi == lo) cands[0] = 0.0f;
  for (int c = 0; c < count; ++c) {
    d = cands[c];
    bool exact = true;
    for (int j = 0; j < kQBlock && exact; ++j) {
      const float code = d == 0.0f ? 0.0f : std::nearbyint((w[j] - m) / d);
      q[j] = static_cast<uint8_t>(std::clamp(code, 0.0f, 15.0f));
      exact = std::fma(static_cast<float>(q[j]), d, m) == w[j];
    }
    if (exact) return true;
  }
  return false;
}

// Codes and scale rebuilding w[0..31] exactly as q * d, q in -127..127.
bool encode_q8_block(const float* w, int8_t* q, float& d) {
  float amax = 0.0f;
  for (int j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(w[j]));
  if (!std::isfinite(amax)) return false;
  float cands[5];
  const int count = amax == 0.0f ? 1 : fp16_candidates(amax / 127.0f, cands);
  if (amax == 0.0f) cands[0] = 0.0f;
  for (int c = 0; c < count; ++c) {
    d = cands[c];
    bool exact = true;
    for (int j = 0; j < kQBlock && exact; ++j) {
      const float code = d == 0.0f ? 0.0f : std::nearbyint(w[j] / d);
      q[j] = static_cast<int8_t>(std::clamp(code, -127.0f, 127.0f));
      exact = static_cast<float>(q[j]) * d == w[j];
    }
    if (exact) return true;
  }
  return false;
}

// The reference quantizer's Q8_0 block: d = amax / 127, q = round(w / d) (half away from
// zero, as ggml's roundf), w times 1 / d in fp32; d kept as its fp16 value. False for a block
// holding a non-finite value, which has no codes.
bool quantize_q8_block(const float* w, int8_t* q, float& d) {
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < kQBlock; ++j) {
    finite &= std::isfinite(w[j]);
    amax = std::max(amax, std::fabs(w[j]));
  }
  if (!finite) return false;
  const float scale = amax / 127.0f;
  const float inv = scale == 0.0f ? 0.0f : 1.0f / scale;
  for (int j = 0; j < kQBlock; ++j) q[j] = static_cast<int8_t>(std::round(w[j] * inv));
  d = static_cast<float>(c10::Half(scale));
  return true;
}

// The reference quantizer's Q4_1 block: d = (max - min) / 15, m = min, q = trunc((w - m) / d +
// 0.5) clamped to 0..15, each operation rounded to fp32 on its own; d and m kept as fp16 values.
// False for a block holding a non-finite value.
bool quantize_q4_block(const float* w, uint8_t* q, float& d, float& m) {
  float lo = w[0], hi = w[0];
  bool finite = true;
  for (int j = 0; j < kQBlock; ++j) {
    finite &= std::isfinite(w[j]);
    lo = std::min(lo, w[j]), hi = std::max(hi, w[j]);
  }
  if (!finite) return false;
  const float scale = (hi - lo) / 15.0f;
  const float inv = scale == 0.0f ? 0.0f : 1.0f / scale;
  for (int j = 0; j < kQBlock; ++j) {
    float t = (w[j] - lo) * inv;
    // -ffp-contract=fast would fuse the product into the sum below: one rounding, not two.
    asm("" : "+x"(t));
    q[j] = static_cast<uint8_t>(std::clamp(std::trunc(t + 0.5f), 0.0f, 15.0f));
  }
  d = static_cast<float>(c10::Half(scale));
  m = static_cast<float>(c10::Half(lo));
  return true;
}

// Lays one feature's block out in its panel: codes into column f of the [32][row_bytes] rows.
void place_q4(const uint8_t* q, uint8_t* rows, int f) {
  const int byte = f % kLanes, shift = f < kLanes ? 0 : 4;
  for (int j = 0; j < kQBlock; ++j) rows[j * (kQNR / 2) + byte] |= q[j] << shift;
}

// w [N, K] fp32 -> (codes, d, m) in the panel layout, each block by encode(block, q, d, m) (m
// unused for Q8_0); empty tensors where it declines a block. m is empty for Q8_0.
template <bool Q4, typename Encode>
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_panels(const char* op,
                                                             const at::Tensor& weight,
                                                             Encode encode) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 2 && weight.size(1) % kQBlock == 0,
              op, "weight must be a float32 [N, K] CPU tensor, K a multiple of 32");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = k / kQBlock;
  const int64_t panels = (n + kQNR - 1) / kQNR;
  const int64_t row_bytes = Q4 ? kQNR / 2 : kQNR;
  at::Tensor codes = at::zeros({panels, blocks, kQBlock, row_bytes},
                               w.options().dtype(Q4 ? at::kByte : at::kChar));
  at::Tensor d = at::zeros({panels, blocks, kQNR}, w.options());
  at::Tensor m = Q4 ? at::zeros({panels, blocks, kQNR}, w.options()) : at::empty({0}, w.options());
  std::atomic<bool> ok{true};
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) int8_t q[kQBlock];
    for (int64_t p = p0; p < p1 && ok.load(std::memory_order_relaxed); ++p)
      for (int64_t f = 0; f < kQNR && p * kQNR + f < n; ++f)
        for (int64_t b = 0; b < blocks; ++b) {
          const float* block = wp + (p * kQNR + f) * k + b * kQBlock;
          const int64_t at_ = (p * blocks + b) * kQNR + f;
          float unused = 0.0f;
          float& mp = Q4 ? m.data_ptr<float>()[at_] : unused;
          if (!encode(block, q, d.data_ptr<float>()[at_], mp)) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
          if constexpr (Q4) {
            place_q4(reinterpret_cast<uint8_t*>(q),
                     codes.data_ptr<uint8_t>() + (p * blocks + b) * kQBlock * row_bytes, f);
          } else {
            int8_t* rows = codes.data_ptr<int8_t>() + (p * blocks + b) * kQBlock * row_bytes;
            for (int j = 0; j < kQBlock; ++j) rows[j * row_bytes + f] = q[j];
          }
        }
  });
  if (!ok.load()) {
    const auto none = at::empty({0}, w.options());
    return {none, none, none};
  }
  return {codes, d, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_encode_q4_1(const at::Tensor& weight) {
  return encode_panels<true>("quant_encode_q4_1: ", weight,
                             [](const float* w, int8_t* q, float& d, float& m) {
                               return encode_q4_block(w, reinterpret_cast<uint8_t*>(q), d, m);
                             });
}

std::tuple<at::Tensor, at::Tensor> quant_encode_q8_0(const at::Tensor& weight) {
  auto [codes, d, m] = encode_panels<false>(
      "quant_encode_q8_0: ", weight,
      [](const float* w, int8_t* q, float& d, float&) { return encode_q8_block(w, q, d); });
  return {codes, d};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_quantize_q4_1(const at::Tensor& weight) {
  return encode_panels<true>("quant_quantize_q4_1: ", weight,
                             [](const float* w, int8_t* q, float& d, float& m) {
                               return quantize_q4_block(w, reinterpret_cast<uint8_t*>(q), d, m);
                             });
}

std::tuple<at::Tensor, at::Tensor> quant_quantize_q8_0(const at::Tensor& weight) {
  auto [codes, d, m] = encode_panels<false>(
      "quant_quantize_q8_0: ", weight,
      [](const float* w, int8_t* q, float& d, float&) { return quantize_q8_block(w, q, d); });
  return {codes, d};
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("quant_encode_q4_1(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("quant_encode_q8_0(Tensor weight) -> (Tensor, Tensor)");
  m.def("quant_quantize_q4_1(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("quant_quantize_q8_0(Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("quant_encode_q4_1", &tierserve::quant_encode_q4_1);
  m.impl("quant_encode_q8_0", &tierserve::quant_encode_q8_0);
  m.impl("quant_quantize_q4_1", &tierserve::quant_quantize_q4_1);
  m.impl("quant_quantize_q8_0", &tierserve::quant_quantize_q8_0);
}

// Q8_0 linears with int8 activations (W8A8): each input row is quantized to 8 bits per block of
// 32 inputs, as llama.cpp's Q8_0 x Q8_0 dot product does, and each block's product of codes is
// an exact int32 sum; a decode step then streams the weight's bytes once (1.125 a weight) with
// 32 or 64 multiply-adds per instruction, where quant.cpp's fp32 chain rebuilds every weight.
//
// Row quantization, per block b of a row x (all fp32, every step rounded as IEEE does):
//   a = max |x_i|, dx_b = a / 127, q_i = round_half_even(x_i * (1 / dx_b)) in [-127, 127]
//   (q = 0 for dx_b = 0); a non-finite value makes dx_b NaN, and the row's outputs NaN.
// Output j: y_j = sum over b in order of fma(float(dot_b), d_jb * dx_b, y_j), then + bias_j,
// where dot_b = sum_i w_ji q_i is exact (|dot| < 2^24, so float(dot) is too). Every ISA path
// forms the same dot and runs the same fp32 operations, so its bits are the same on every CPU
// and at every batch size (rows are independent).
//
// Weights [pairs, B, 1088] uint8, one stream read in order: per pair of panels (32 output
// features, 16 a panel) and block b, for each of eight groups of four inputs, each panel's 64
// bytes (its 16 features' four codes side by side, as w + 128 so that AVX512_VNNI's vpdpbusd
// takes them as its unsigned operand), then both panels' 16 scales d (fp16, as GGUF stores
// them: the fp32 value widens exactly). Padding features: codes 128 (w = 0) and scales 0. The
// panels' codes interleaved group by group, not one panel's 512 bytes after the other's: a tile
// then reads its stream strictly forwards, which the hardware prefetchers follow better than
// two streams 512 bytes apart.
//
// Tiles: AVX512_VNNI's vpdpbusd where the CPU has it (the sum of (w + 128) q, less 128 times
// the block's sum of q); elsewhere a 256-bit tile: vpmaddubsw of |q| and w with q's sign, then
// vpmaddwd (|q|, |w| <= 127 keep the 16-bit pair sums below 2^15).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace tierserve {
namespace {

constexpr int64_t kW8Block = 32;  // inputs per block
constexpr int64_t kW8Feat = 16;   // output features per panel
constexpr int64_t kW8PanelBlock = kW8Block * kW8Feat;  // code bytes of a panel's block
// Bytes of a panel pair's block: both panels' codes, then both panels' scales.
constexpr int64_t kW8PairBlock = 2 * kW8PanelBlock + 2 * kW8Feat * 2;

// Whether the CPU has AVX512_VNNI: int8_head.cpp's cpu_int8_dot (kernels.cpp includes it first).
bool w8_vnni() { return cpu_int8_dot(); }

// Rows quantized per block: q [M, K] int8, dx [M, B] fp32, sq [M, B] int32 (sum of q: VNNI's
// correction), in one buffer of w8_rows_bytes(M, K) bytes.
struct W8Rows {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t k, blocks;
};

inline int64_t w8_rows_bytes(int64_t m, int64_t k) {
  return m * k + 8 * m * (k / kW8Block);  // k is a multiple of 32: the floats stay aligned
}

// One block of 32 inputs: codes into q, their sum into *sum, the scale returned.
inline float quantize_w8_block(const float* x, int8_t* q, int32_t* sum) {
  uint32_t top = 0;  // max |x| as bits: NaN's bits exceed every finite value's and inf's
  for (int64_t i = 0; i < kW8Block; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    top = std::max(top, bits & 0x7FFFFFFFu);
  }
  float amax;
  std::memcpy(&amax, &top, 4);
  const float d = amax / 127.0f;
  const bool usable = d != 0.0f && std::isfinite(d);
  const float inv = usable ? 1.0f / d : 0.0f;
  int32_t s = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < kW8Block; i += 16) {
    __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
    c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(c));
    s += _mm512_reduce_add_epi32(c);
  }
#else
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < kW8Block; i += 8) {
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
    c = _mm256_max_epi32(_mm256_min_epi32(c, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), c);
    for (int j = 0; j < 8; ++j) {
      q[i + j] = static_cast<int8_t>(lanes[j]);
      s += lanes[j];
    }
  }
#endif
  if (!usable)  // inv = 0 zeroed the codes; a NaN scale carries a non-finite row to its outputs
    return std::isfinite(d) ? d : NAN;
  *sum = s;
  return d;
}

// x's rows quantized into `buffer` (w8_rows_bytes of x's shape, 4-byte aligned).
W8Rows quantize_w8_rows(const at::Tensor& x, uint8_t* buffer) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kW8Block, ldx = x.stride(0);
  int8_t* q = reinterpret_cast<int8_t*>(buffer);
  float* d = reinterpret_cast<float*>(buffer + m * k);
  int32_t* s = reinterpret_cast<int32_t*>(buffer + m * k + 4 * m * blocks);
  const float* xp = x.data_ptr<float>();
  auto quantize = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        s[r * blocks + b] = 0;
        d[r * blocks + b] = quantize_w8_block(xp + r * ldx + b * kW8Block,
                                              q + r * k + b * kW8Block, s + r * blocks + b);
      }
  };
  if (m * k < 16384)
    quantize(0, m);  // a decode step's rows: less than a thread hand-off costs
  else
    at::parallel_for(0, m, 16, quantize);
  return {q, d, s, k, blocks};
}

// Panel h's 16 scales (fp16) in a pair's block.
inline const uint16_t* w8_scales(const uint8_t* block, int h) {
  return reinterpret_cast<const uint16_t*>(block + 2 * kW8PanelBlock) + h * kW8Feat;
}

// 8 fp16 scales widened to fp32 (exactly).
__attribute__((target("avx2,f16c"))) inline __m256 widen8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// No software prefetch: a tile reads its pair's stream strictly forwards (a thread's run of
// pairs is contiguous), which the hardware prefetchers follow; prefetches of each block a few
// blocks ahead, issued beside the tile's work, only slowed it.

#if defined(__AVX512F__)
// out[r][0 .. cols) for MR rows from r0 over one panel pair (32 features), by vpdpbusd.
template <int MR>
__attribute__((target("avx512vnni"))) void w8_tile_vnni(const W8Rows& x, int64_t r0,
                                                        const uint8_t* pair, float* out,
                                                        int64_t ldo, int64_t cols) {
  const int64_t blocks = x.blocks;
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = pair + b * kW8PairBlock;
    __m512i dot[MR][2];
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int g = 0; g < kW8Block / 4; ++g) {
      const __m512i w0 = _mm512_loadu_si512(block + 2 * g * 64);
      const __m512i w1 = _mm512_loadu_si512(block + (2 * g + 1) * 64);
      for (int r = 0; r < MR; ++r) {
        int32_t a;
        std::memcpy(&a, x.q + (r0 + r) * x.k + b * kW8Block + g * 4, 4);
        const __m512i av = _mm512_set1_epi32(a);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, av);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, av);
      }
    }
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(w8_scales(block, 0))));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(w8_scales(block, 1))));
    for (int r = 0; r < MR; ++r) {
      const int64_t rb = (r0 + r) * blocks + b;
      const __m512i shift = _mm512_set1_epi32(128 * x.s[rb]);
      const __m512 dx = _mm512_set1_ps(x.d[rb]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][0], shift)),
                                  _mm512_mul_ps(d0, dx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][1], shift)),
                                  _mm512_mul_ps(d1, dx), acc[r][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t from = h * kW8Feat, n = std::clamp<int64_t>(cols - from, 0, kW8Feat);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + from, mask, acc[r][h]);
  }
}
#endif

// The same tile in 256-bit registers, by vpmaddubsw and vpmaddwd: one row (16 ymm hold its
// four accumulators, four block sums and the operands).
__attribute__((target("avx2,fma"))) void w8_tile_avx2(const W8Rows& x, int64_t r0,
                                                      const uint8_t* pair, float* out,
                                                      int64_t ldo, int64_t cols) {
  const int64_t blocks = x.blocks;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const int8_t* q = x.q + r0 * x.k;
  __m256 acc[4];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = pair + b * kW8PairBlock;
    __m256i dot[4];
    for (auto& d : dot) d = _mm256_setzero_si256();
    for (int g = 0; g < kW8Block / 4; ++g) {
      int32_t a;
      std::memcpy(&a, q + b * kW8Block + g * 4, 4);
      const __m256i av = _mm256_set1_epi32(a), mag = _mm256_sign_epi8(av, av);
      for (int j = 0; j < 4; ++j) {  // quarter j: panel j / 2, features 8 (j % 2) ..
        const __m256i w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                block + (2 * g + j / 2) * 64 + (j % 2) * 32)),
            flip);
        dot[j] = _mm256_add_epi32(
            dot[j], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(w, av)), ones));
      }
    }
    const __m256 dx = _mm256_set1_ps(x.d[r0 * blocks + b]);
    for (int j = 0; j < 4; ++j) {
      const __m256 d = widen8(w8_scales(block, j / 2) + (j % 2) * 8);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j]), _mm256_mul_ps(d, dx), acc[j]);
    }
  }
  alignas(32) float lanes[2 * kW8Feat];
  for (int j = 0; j < 4; ++j) _mm256_store_ps(lanes + 8 * j, acc[j]);
  std::copy_n(lanes, std::min<int64_t>(cols, 2 * kW8Feat), out);
  (void)ldo;
}

using W8Tile = void (*)(const W8Rows&, int64_t, const uint8_t*, float*, int64_t, int64_t);
struct W8Tiles {
  const W8Tile* tiles;
  int64_t rows;  // rows a tile holds at most
};

// Which tiles a product takes: the CPU's best, or one forced (tests, bench/linear_kernels.py).
enum W8Choice : int64_t { kW8Auto = 0, kW8Vnni = 1, kW8Narrow = 2 };

// The tiles of a product: vpdpbusd's where the CPU has AVX512_VNNI, else the 256-bit tile (the
// same bits either way).
W8Tiles w8_tiles(int64_t choice) {
  static constexpr std::array<W8Tile, 1> narrow = {&w8_tile_avx2};
#if defined(__AVX512F__)
  static constexpr std::array<W8Tile, 4> vnni = {&w8_tile_vnni<1>, &w8_tile_vnni<2>,
                                                 &w8_tile_vnni<3>, &w8_tile_vnni<4>};
  if (w8_vnni() && choice != kW8Narrow) return {vnni.data(), static_cast<int64_t>(vnni.size())};
#endif
  (void)choice;
  return {narrow.data(), static_cast<int64_t>(narrow.size())};
}

// The path this library takes on this CPU.
std::string int8_linear_path() { return w8_vnni() ? "avx512_vnni" : "avx2"; }

void check_int8_linear(const char* op, const at::Tensor& x, const at::Tensor& pairs,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, "x must be a float32 [M, K] CPU tensor with unit column stride");
  const int64_t k = x.size(1), blocks = k / kW8Block;
  TORCH_CHECK(k > 0 && k % kW8Block == 0, op, "K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(pairs.scalar_type() == at::kByte && pairs.dim() == 3 && pairs.is_contiguous() &&
                  pairs.size(1) == blocks && pairs.size(2) == kW8PairBlock,
              op, "pairs must be contiguous uint8 [pairs, ", blocks, ", ", kW8PairBlock, "]");
  const int64_t features = pairs.size(0) * 2 * kW8Feat;
  TORCH_CHECK(n > 0 && n <= features, op, "n must be in [1, ", features, "]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == n),
              op, "bias must be a contiguous float32 [n]");
}

void linear_int8_into(const at::Tensor& x, const at::Tensor& pairs_,
                      const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& out,
                      int64_t choice = kW8Auto) {
  const char* op = "linear_int8: ";
  check_int8_linear(op, x, pairs_, bias, n);
  const int64_t m = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == m && out.size(1) == n,
              op, "out must be a contiguous float32 [", m, ", ", n, "]");
  TORCH_CHECK(choice == kW8Auto || choice == kW8Narrow || (choice == kW8Vnni && w8_vnni()),
              op, "tiles must be 0 (auto), 2 (256-bit) or, where the CPU has AVX512_VNNI, 1");
  if (m == 0) return;
  // The rows' codes, reused call after call by this thread (a decode step makes ~100 calls).
  thread_local std::vector<uint8_t> buffer;
  const auto need = static_cast<size_t>(w8_rows_bytes(m, x.size(1)));
  if (buffer.size() < need) buffer.resize(need);
  const W8Rows rows = quantize_w8_rows(x, buffer.data());
  const uint8_t* w = pairs_.data_ptr<uint8_t>();
  const W8Tiles tiles = w8_tiles(choice);
  const int64_t pairs = (n + 2 * kW8Feat - 1) / (2 * kW8Feat);
  const int64_t pair_bytes = rows.blocks * kW8PairBlock;
  float* o = out.data_ptr<float>();
  // Items: (row block, panel pair), pair-major within a row block; a pair's bytes (1,088 a
  // block) stay in L1 / L2 while its row tiles reuse them. A decode's few rows: one row block,
  // each thread streaming its run of pairs, one contiguous stream.
  constexpr int64_t kRowBlock = 64;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rb = i / pairs, pair = i % pairs;
      const int64_t r0 = m * rb / row_blocks, r1 = m * (rb + 1) / row_blocks;
      const int64_t col = pair * 2 * kW8Feat, cols = std::min<int64_t>(2 * kW8Feat, n - col);
      for (int64_t r = r0; r < r1; r += tiles.rows) {
        const int64_t mr = std::min<int64_t>(tiles.rows, r1 - r);
        tiles.tiles[mr - 1](rows, r, w + pair * pair_bytes, o + r * n + col, n, cols);
      }
    }
  });
  if (bias.has_value()) {
    const float* b = bias->data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {  // a prefill's rows: shared
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < n; ++j) o[r * n + j] += b[j];
    });
  }
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& pairs,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t tiles) {
  TORCH_CHECK(x.dim() == 2, "linear_int8: x must be a float32 [M, K] tensor");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_int8_into(x, pairs, bias, n, out, tiles);
  return out;
}

// x's rows as linear_int8 quantizes them: (q [M, K] int8, dx [M, K / 32] fp32).
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1 && x.size(1) % kW8Block == 0,
              "int8_quantize_rows: x must be a float32 [M, K] CPU tensor, K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor buffer = at::empty({w8_rows_bytes(m, k)}, x.options().dtype(at::kByte));
  quantize_w8_rows(x, buffer.data_ptr<uint8_t>());
  return {buffer.narrow(0, 0, m * k).view(at::kChar).view({m, k}),
          buffer.narrow(0, m * k, 4 * m * (k / kW8Block)).view(at::kFloat).view({m, k / kW8Block})};
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("int8_linear_path() -> str", &tierserve::int8_linear_path);
  m.def("linear_int8(Tensor x, Tensor pairs, Tensor? bias, int n, int tiles=0) -> Tensor");
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("linear_int8", &tierserve::linear_int8);
  m.impl("int8_quantize_rows", &tierserve::int8_quantize_rows);
}

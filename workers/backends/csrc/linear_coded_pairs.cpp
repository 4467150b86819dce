// bf16 pair panels (linear_pairs.cpp) with each value's top byte coded, as linear_coded.cpp codes
// fp32 panels (included after both): a bf16 value's top byte is its sign and the exponent's 7
// high bits, its low byte the exponent's lowest bit and the 7 mantissa bits. The low byte is
// kept, the top byte becomes a 4-bit index into the weight's 16 most frequent ones, and the
// rare others (escapes) keep their bits in a list per panel. 12 bits a value: a single row
// streams 3/4 of the pair panels' bytes, and every output is their own chain of vdpbf16ps over
// the same values, so the products are bitwise theirs.
//
// Layout: per pair panel p, per k pair j, its 2 kPanel values (pair_layout's order) as two
// halves of 32, kPairCodedHalf bytes each: 32 low bytes, then 16 code bytes (value l's code in
// byte l % 16, the low nibble for l < 16). The body ends with kCodedPad spare bytes. table and
// escapes as linear_coded.cpp's, an escape's position j * 2 kPanel + value index and its bits the
// low 16 of the second int32. Padding features (past n) hold zero bytes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

namespace tierserve {
namespace {

constexpr int64_t kCodedPairRow = 2 * kPanel;           // values in a k pair of a pair panel
constexpr int64_t kPairCodedHalf = 48;                  // 32 values: 32 low bytes, 16 codes
constexpr int64_t kPairCodedStep = kCodedPairRow / 32 * kPairCodedHalf;  // a k pair, coded
using PairEscapes = EscapeCursor<c10::BFloat16, kCodedPairRow>;

struct CodedPairView {
  const uint8_t* body;
  const int32_t* tops;
  const int32_t* starts;
  const int32_t* escapes;
  int64_t k2;  // k pairs

  const uint8_t* panel(int64_t p) const { return body + p * k2 * kPairCodedStep; }
  PairEscapes escapes_of(int64_t p) const { return PairEscapes(escapes, starts, p); }
};

#if defined(__AVX512F__)

// Decodes 32 coded bf16 values in registers: low bytes widened to words, each word's nibble
// looked up in a table of top bytes (value << 8) and or-ed in.
class PairDecoder {
 public:
  explicit PairDecoder(const int32_t* tops) {
    // vpermw reads an index's low 5 bits: entries 16..31 repeat 0..15, so that the first 16
    // values may keep the other nibble above their own.
    alignas(64) uint16_t table[32];
    for (int i = 0; i < 32; ++i)
      table[i] = static_cast<uint16_t>((static_cast<uint32_t>(tops[i % kCodes]) >> 24) << 8);
    table_ = _mm512_load_si512(table);
  }

  __m512i operator()(const uint8_t* src) const {
    const __m512i low = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m256i codes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32)));
    const __m512i index =
        _mm512_inserti64x4(_mm512_castsi256_si512(codes), _mm256_srli_epi16(codes, 4), 1);
    return _mm512_or_si512(low, _mm512_permutexvar_epi16(index, table_));
  }

 private:
  __m512i table_;
};

// A k pair's 2 kPanel values into dst, escapes written in.
inline void decode_pair_step(const PairDecoder& dec, const uint8_t* src, PairEscapes& escapes,
                             int64_t j, c10::BFloat16* dst) {
  _mm512_storeu_si512(dst, dec(src));
  _mm512_storeu_si512(dst + 32, dec(src + kPairCodedHalf));
  escapes.patch(dst, j, j + 1);
}

// c[MR][kPanel] (row stride ldc) = rows a (bf16, row stride lda) through pair panel p: per
// output pair_microkernel's chain (k pairs in order from zero), the panel decoded once, in
// registers, except at k pairs with escapes.
template <int MR>
__attribute__((target("avx512bf16"))) void coded_pair_tile(
    const PairDecoder& dec, const CodedPairView& w, int64_t p, const c10::BFloat16* a,
    int64_t lda, float* c, int64_t ldc) {
  const uint8_t* body = w.panel(p);
  PairEscapes escapes = w.escapes_of(p);
  __m512 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < w.k2; ++j) {
    const uint8_t* s = body + j * kPairCodedStep;
    __builtin_prefetch(s + kCodedAhead * kPairCodedStep, 0, 0);
    __builtin_prefetch(s + kCodedAhead * kPairCodedStep + kLine, 0, 0);
    __m512bh w0, w1;
    if (escapes.next_k(-1) != j) {
      w0 = (__m512bh)dec(s);
      w1 = (__m512bh)dec(s + kPairCodedHalf);
    } else {
      alignas(64) c10::BFloat16 step[kCodedPairRow];
      decode_pair_step(dec, s, escapes, j, step);
      w0 = (__m512bh)_mm512_load_si512(step);
      w1 = (__m512bh)_mm512_load_si512(step + 32);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh av =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(input_pair(a + r * lda + 2 * j)));
      lo[r] = _mm512_dpbf16_ps(lo[r], av, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], av, w1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(c + r * ldc, lo[r]);
    _mm512_storeu_ps(c + r * ldc + kLanes, hi[r]);
  }
}

using CodedPairTile = void (*)(const PairDecoder&, const CodedPairView&, int64_t,
                               const c10::BFloat16*, int64_t, float*, int64_t);

template <int... MR>
constexpr auto coded_pair_tile_table(std::integer_sequence<int, MR...>) {
  return std::array<CodedPairTile, sizeof...(MR)>{&coded_pair_tile<MR + 1>...};
}
constexpr auto kCodedPairTile =
    coded_pair_tile_table(std::make_integer_sequence<int, kPairMaxMR>{});

// The first row tile of k pairs [kc, kc + kn) of panel p: c[MR][kPanel] = (first ? 0 : c) +
// rows a through those pairs, as pair_microkernel computes it, decoding them as it goes into
// slice[kn][2 kPanel] (escapes written in) for the other tiles.
template <int MR>
__attribute__((target("avx512bf16"))) void coded_pair_slice_tile(
    const PairDecoder& dec, const uint8_t* body, PairEscapes& escapes, int64_t kc, int64_t kn,
    const c10::BFloat16* a, int64_t lda, c10::BFloat16* slice, float* c, int64_t ldc,
    bool first) {
  __m512 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
    hi[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + kLanes);
  }
  for (int64_t j = 0; j < kn; ++j) {
    const uint8_t* s = body + (kc + j) * kPairCodedStep;
    __builtin_prefetch(s + kCodedAhead * kPairCodedStep, 0, 0);
    __builtin_prefetch(s + kCodedAhead * kPairCodedStep + kLine, 0, 0);
    c10::BFloat16* row = slice + j * kCodedPairRow;
    __m512i w0 = dec(s), w1 = dec(s + kPairCodedHalf);
    _mm512_storeu_si512(row, w0);
    _mm512_storeu_si512(row + 32, w1);
    if (escapes.next_k(-1) == kc + j) {
      escapes.patch(row - j * kCodedPairRow, kc, kc + j + 1);
      w0 = _mm512_loadu_si512(row);
      w1 = _mm512_loadu_si512(row + 32);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh av =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(input_pair(a + r * lda + 2 * j)));
      lo[r] = _mm512_dpbf16_ps(lo[r], av, (__m512bh)w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], av, (__m512bh)w1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(c + r * ldc, lo[r]);
    _mm512_storeu_ps(c + r * ldc + kLanes, hi[r]);
  }
}

using CodedPairSliceTile = void (*)(const PairDecoder&, const uint8_t*, PairEscapes&, int64_t,
                                    int64_t, const c10::BFloat16*, int64_t, c10::BFloat16*,
                                    float*, int64_t, bool);

template <int... MR>
constexpr auto coded_pair_slice_table(std::integer_sequence<int, MR...>) {
  return std::array<CodedPairSliceTile, sizeof...(MR)>{&coded_pair_slice_tile<MR + 1>...};
}
constexpr auto kCodedPairSliceTile =
    coded_pair_slice_table(std::make_integer_sequence<int, kPairMaxMR>{});

// Rows [m0, m1) (more than a tile) through pair panel p: per block of k pairs, the first row
// tile decodes the block into a bf16 slice as it runs, and pair_microkernel runs the other
// tiles over the slice, as over pair panels.
void coded_pair_rows(const PairDecoder& dec, const CodedPairView& w, const c10::BFloat16* x,
                     int64_t ldx, float* out, int64_t n, int64_t m0, int64_t m1, int64_t p) {
  const int64_t col = p * kPanel, width = std::min<int64_t>(kPanel, n - col), rows = m1 - m0;
  const int64_t tiles = (rows + kPairMaxMR - 1) / kPairMaxMR;
  auto tile_rows = [&](int64_t t) { return rows / tiles + (t < rows % tiles ? 1 : 0); };
  std::unique_ptr<float[]> tail(width < kPanel ? new float[rows * kPanel] : nullptr);
  float* c = tail ? tail.get() : out + m0 * n + col;
  const int64_t ldc = tail ? kPanel : n;
  alignas(64) c10::BFloat16 slice[kPairKC * kCodedPairRow];
  PairEscapes escapes = w.escapes_of(p);
  const c10::BFloat16* a = x + m0 * ldx;
  for (int64_t kc = 0; kc < w.k2; kc += kPairKC) {
    const int64_t kn = std::min(kPairKC, w.k2 - kc);
    kCodedPairSliceTile[tile_rows(0) - 1](dec, w.panel(p), escapes, kc, kn, a + 2 * kc, ldx,
                                          slice, c, ldc, kc == 0);
    for (int64_t t = 1, r = tile_rows(0); t < tiles; r += tile_rows(t), ++t)
      kPairMicro[tile_rows(t) - 1](kn, a + r * ldx + 2 * kc, ldx, slice, c + r * ldc, ldc,
                                   kc == 0, nullptr, 0);
  }
  if (tail)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(c + r * kPanel, width, out + (m0 + r) * n + col);
}

// out[M, n] fp32 = x[M, K] bf16 through the coded pair panels, no bias.
void coded_pair_product(const CodedPairView& w, const c10::BFloat16* x, int64_t ldx, int64_t m,
                        int64_t panels, float* out, int64_t n) {
  const PairDecoder dec(w.tops);
  if (m <= kPairMaxMR) {
    const CodedPairTile tile = kCodedPairTile[m - 1];
    single_row_panels(
        panels, n / kPanel, kPairGroup,
        [&](int64_t p0, int64_t count) {
          for (int64_t p = p0; p < p0 + count; ++p) tile(dec, w, p, x, ldx, out + p * kPanel, n);
        },
        [&](int64_t p) {
          alignas(64) float c[kPairMaxMR * kPanel];
          tile(dec, w, p, x, ldx, c, kPanel);
          for (int64_t r = 0; r < m; ++r)
            std::copy_n(c + r * kPanel, n - p * kPanel, out + r * n + p * kPanel);
        });
    return;
  }
  constexpr int64_t kRowBlock = 192;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rb = i / panels, p = i % panels;
      coded_pair_rows(dec, w, x, ldx, out, n, m * rb / row_blocks, m * (rb + 1) / row_blocks, p);
    }
  });
}

#endif

CodedPairView check_coded_pairs(const char* op, const at::Tensor& body, const at::Tensor& table,
                                const at::Tensor& escapes, int64_t n, int64_t k) {
  TORCH_CHECK(bf16_pairs(), op, "coded pair panels need a CPU with AVX512_BF16");
  TORCH_CHECK(k > 0 && k % 2 == 0 && n > 0, op, "K must be even and positive");
  const int64_t panels = (n + kPanel - 1) / kPanel, bytes = panels * (k / 2) * kPairCodedStep;
  TORCH_CHECK(body.device().is_cpu() && body.scalar_type() == at::kByte && body.dim() == 1 &&
                  body.is_contiguous() && body.numel() == bytes + kCodedPad,
              op, "body must be a contiguous uint8 tensor of ", bytes + kCodedPad, " bytes");
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kInt && table.dim() == 1 &&
                  table.is_contiguous() && table.numel() == kCodes + panels + 1,
              op, "table must be a contiguous int32 [", kCodes + panels + 1, "] tensor");
  TORCH_CHECK(escapes.device().is_cpu() && escapes.scalar_type() == at::kInt &&
                  escapes.dim() == 2 && escapes.size(1) == 2 && escapes.is_contiguous(),
              op, "escapes must be a contiguous int32 [E, 2] tensor");
  const int32_t* starts = table.data_ptr<int32_t>() + kCodes;
  TORCH_CHECK(starts[0] == 0 && starts[panels] == escapes.size(0), op,
              "the table's escape starts do not cover the escapes");
  return CodedPairView{body.data_ptr<uint8_t>(), table.data_ptr<int32_t>(), starts,
                       escapes.data_ptr<int32_t>(), k / 2};
}

void linear_coded_pairs_into(const at::Tensor& x, const at::Tensor& body, const at::Tensor& table,
                             const at::Tensor& escapes, const std::optional<at::Tensor>& bias,
                             int64_t n, at::Tensor& out) {
  const char* op = "linear_coded_pairs: ";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, "x must be a bfloat16 [M, K] CPU tensor with contiguous rows");
  const CodedPairView w = check_coded_pairs(op, body, table, escapes, n, x.size(1));
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == n,
                op, "bias must be a contiguous bfloat16 [n] tensor");
  check_out_rows(op, out, x.size(0), n, at::kBFloat16);
  const int64_t m = x.size(0);
  if (m == 0) return;
#if defined(__AVX512F__)
  std::unique_ptr<float[]> acc(new float[m * n]);
  coded_pair_product(w, x.data_ptr<c10::BFloat16>(), x.stride(0), m, (n + kPanel - 1) / kPanel,
                     acc.get(), n);
  finish_half(acc.get(), bias ? bias->data_ptr<c10::BFloat16>() : nullptr, m, n, out);
#else
  (void)w;
#endif
}

at::Tensor linear_coded_pairs(const at::Tensor& x, const at::Tensor& body, const at::Tensor& table,
                              const at::Tensor& escapes, const std::optional<at::Tensor>& bias,
                              int64_t n) {
  TORCH_CHECK(x.dim() == 2, "linear_coded_pairs: x must be [M, K] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_coded_pairs_into(x, body, table, escapes, bias, n, out);
  return out;
}

// Pair panel p's coded bytes into body (k2 k pairs, `width` real features); appends its
// escapes (position, bits pairs, in decode order) to `escapes`. A value's feature is its index
// in the k pair over 2: padding features' values are skipped.
void encode_pair_panel(const uint16_t* panel, int64_t k2, int64_t width,
                       const std::array<int16_t, 256>& code, uint8_t* body,
                       std::vector<int32_t>& escapes) {
  for (int64_t j = 0; j < k2; ++j)
    for (int64_t v = 0; v < 2 * width; ++v) {
      const uint16_t bits = panel[j * kCodedPairRow + v];
      int c = code[bits >> 8];
      if (c < 0) {
        escapes.push_back(static_cast<int32_t>(j * kCodedPairRow + v));
        escapes.push_back(static_cast<int32_t>(bits));
        c = 0;
      }
      uint8_t* half = body + j * kPairCodedStep + (v / 32) * kPairCodedHalf;
      const int64_t l = v % 32;
      half[l] = static_cast<uint8_t>(bits);
      half[32 + l % 16] |= static_cast<uint8_t>(c << (4 * (l / 16)));
    }
}

// (body, table, escapes) of bf16 pair panels [panels, K / 2, 2 kPanel] of an [n, K] weight.
std::tuple<at::Tensor, at::Tensor, at::Tensor> coded_pairs_encode(const at::Tensor& panels,
                                                                  int64_t n) {
  const char* op = "coded_pairs_encode: ";
  TORCH_CHECK(bf16_pairs(), op, "coded pair panels need a CPU with AVX512_BF16");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kBFloat16 &&
                  pair_layout(panels) && panels.is_contiguous() && panels.size(1) > 0,
              op, "panels must be contiguous bf16 pair panels");
  const int64_t count = panels.size(0), k2 = panels.size(1);
  TORCH_CHECK(n > (count - 1) * kPanel && n <= count * kPanel, op, "n does not match the panels");
  TORCH_CHECK(k2 * 2 * kPanel < (int64_t{1} << 31), op, "K too large");
  const uint16_t* src = reinterpret_cast<const uint16_t*>(panels.data_ptr<c10::BFloat16>());
  auto width = [&](int64_t p) { return std::min<int64_t>(kPanel, n - p * kPanel); };
  std::array<int64_t, 256> counts{};
  for (int64_t p = 0; p < count; ++p)
    for (int64_t j = 0; j < k2; ++j)
      for (int64_t v = 0; v < 2 * width(p); ++v)
        ++counts[src[(p * k2 + j) * kCodedPairRow + v] >> 8];
  const std::array<int32_t, kCodes> tops = most_frequent(counts);
  const std::array<int16_t, 256> code = codes_of(tops);
  at::Tensor body = at::zeros({count * k2 * kPairCodedStep + kCodedPad}, at::kByte);
  std::vector<std::vector<int32_t>> escapes(count);
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      encode_pair_panel(src + p * k2 * kCodedPairRow, k2, width(p), code,
                        body.data_ptr<uint8_t>() + p * k2 * kPairCodedStep, escapes[p]);
  });
  return pack_escapes(body, tops, escapes);
}

// The bf16 pair panels the coded ones hold (padding features zero).
at::Tensor coded_pairs_panels(const at::Tensor& body, const at::Tensor& table,
                              const at::Tensor& escapes, int64_t n, int64_t k) {
  const CodedPairView w = check_coded_pairs("coded_pairs_panels: ", body, table, escapes, n, k);
  const int64_t count = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({count, k / 2, 2 * kPanel}, at::kBFloat16);
#if defined(__AVX512F__)
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const PairDecoder dec(w.tops);
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      PairEscapes escapes_p = w.escapes_of(p);
      c10::BFloat16* panel = o + p * w.k2 * kCodedPairRow;
      for (int64_t j = 0; j < w.k2; ++j)
        decode_pair_step(dec, w.panel(p) + j * kPairCodedStep, escapes_p, j, panel + j * kCodedPairRow);
      const int64_t width = std::min<int64_t>(kPanel, n - p * kPanel);
      for (int64_t j = 0; width < kPanel && j < w.k2; ++j)
        std::fill_n(panel + j * kCodedPairRow + 2 * width, 2 * (kPanel - width), c10::BFloat16(0.0f));
    }
  });
#else
  (void)w;
#endif
  return out;
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("coded_pairs_encode(Tensor panels, int n) -> (Tensor, Tensor, Tensor)");
  m.def("coded_pairs_panels(Tensor body, Tensor table, Tensor escapes, int n, int k) -> Tensor");
  m.def("linear_coded_pairs(Tensor x, Tensor body, Tensor table, Tensor escapes, Tensor? bias, "
        "int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("coded_pairs_encode", &tierserve::coded_pairs_encode);
  m.impl("coded_pairs_panels", &tierserve::coded_pairs_panels);
  m.impl("linear_coded_pairs", &tierserve::linear_coded_pairs);
}

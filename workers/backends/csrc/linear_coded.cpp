// fp32 linear weights with their sign-and-exponent bytes coded (included after linear.cpp, whose
// microkernels it runs): a weight's low 24 bits (the mantissa and the exponent's lowest bit)
// are kept as 3 bytes, its top byte (the sign and the exponent's 7 high bits) as a 4-bit index
// into a table of the 16 top bytes most frequent in that weight. Trained weights span a few
// binades, so those 16 hold almost every value; the rest (escapes: mostly values near zero)
// keep their exact bits in a list per panel, which the kernels write over the decoded lanes.
// 28 bits a weight: a memory-bound product streams 7/8 of the fp32 panels' bytes, and every
// output is the fp32 panels' own FMA chain over the same values, so products are bitwise theirs.
//
// Layout, in linear.cpp's panel order: per panel p, per k, two Vecs of kLanes weights each,
// kCodedVecBytes a Vec: 3 kLanes low bytes (lane j's at 3 j, little endian), then kLanes / 2
// code bytes (lane j's code in byte j / 2, the low nibble for an even j). The body ends with
// kCodedPad spare bytes: a Vec is decoded from one full-width load at its start.
// table (int32): [0, 16) the top bytes (as value << 24), then per panel p the index of its first
// escape, panels + 1 entries. escapes (int32 [E, 2]): (k * kPanel + column, fp32 bits), panel
// by panel, each panel's in (k, column) order. Lanes of padding rows (past n) hold zero bytes,
// whatever they decode to no output reads.

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

namespace tierserve {
namespace {

constexpr int64_t kCodedVecBytes = 7 * kLanes / 2;   // 3 low bytes and a nibble a lane
constexpr int64_t kCodedStep = 2 * kCodedVecBytes;   // one k step of a panel
constexpr int64_t kCodedPad = 64;                    // past the last Vec's full-width load
constexpr int kCodes = 16;

// Decodes a Vec of coded weights in registers: bytes gathered into lanes, each lane's nibble
// looked up in the table, the top byte put over the low 24 bits.
class CodedDecoder {
 public:
  explicit CodedDecoder(const int32_t* tops) {
#if defined(__AVX512F__)
    // Lane group i (128 bits) holds weights 4 i .. 4 i + 3: their 12 low bytes are dwords
    // 3 i .. 3 i + 2, their two code bytes (48 + 2 i, 48 + 2 i + 1) sit in dword 12 + i / 2.
    alignas(64) int32_t perm[16], shift[16];
    alignas(64) uint8_t ctrl[64];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        perm[4 * i + j] = j < 3 ? 3 * i + j : 12 + i / 2;
        for (int b = 0; b < 3; ++b) ctrl[16 * i + 4 * j + b] = static_cast<uint8_t>(3 * j + b);
        ctrl[16 * i + 4 * j + 3] = static_cast<uint8_t>(12 + 2 * (i % 2) + j / 2);
        shift[4 * i + j] = 24 + 4 * (j & 1);
      }
    perm_ = _mm512_load_si512(perm);
    ctrl_ = _mm512_load_si512(ctrl);
    shift_ = _mm512_load_si512(shift);
    table_ = _mm512_loadu_si512(tops);
#else
    // 128-bit half h holds weights 4 h .. 4 h + 3: low bytes dwords {0,1,2} or {3,4,5}, both
    // halves' code bytes in dword 6 (bytes 24 .. 27).
    perm_ = _mm256_setr_epi32(0, 1, 2, 6, 3, 4, 5, 6);
    alignas(32) uint8_t ctrl[32], table[32];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) {
        for (int b = 0; b < 3; ++b) ctrl[16 * h + 4 * j + b] = static_cast<uint8_t>(3 * j + b);
        ctrl[16 * h + 4 * j + 3] = static_cast<uint8_t>(12 + 2 * h + j / 2);
      }
    for (int c = 0; c < kCodes; ++c)
      table[c] = table[16 + c] = static_cast<uint8_t>(static_cast<uint32_t>(tops[c]) >> 24);
    ctrl_ = _mm256_load_si256(reinterpret_cast<const __m256i*>(ctrl));
    table_ = _mm256_load_si256(reinterpret_cast<const __m256i*>(table));
    shift_ = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
#endif
  }

  Vec operator()(const uint8_t* src) const {
#if defined(__AVX512F__)
    const __m512i raw = _mm512_loadu_si512(src);
    const __m512i d = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(perm_, raw), ctrl_);
    // vpermd reads the low 4 bits of each index alone: the nibble, shifted down.
    const __m512i top = _mm512_permutexvar_epi32(_mm512_srlv_epi32(d, shift_), table_);
    // (d & 0x00FFFFFF) | top
    return (Vec)_mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(d, _mm512_set1_epi32(0x00FFFFFF), top, 0xEA));
#else
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i d = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(raw, perm_), ctrl_);
    // The lane's nibble moved to bits 24..27, the other bytes' indices with the high bit set
    // (a zero byte from the shuffle).
    const __m256i idx =
        _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(d, shift_),
                                         _mm256_set1_epi32(0x0F000000)),
                        _mm256_set1_epi32(0x00808080));
    const __m256i top = _mm256_shuffle_epi8(table_, idx);
    return (Vec)_mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(d, _mm256_set1_epi32(0x00FFFFFF)), top));
#endif
  }

 private:
#if defined(__AVX512F__)
  __m512i perm_, ctrl_, shift_, table_;
#else
  __m256i perm_, ctrl_, shift_, table_;
#endif
};

// A coded weight as the kernels read it.
struct CodedView {
  const uint8_t* body;
  const int32_t* tops;     // table[0, 16)
  const int32_t* starts;   // table[16, 16 + panels + 1)
  const int32_t* escapes;  // [E, 2]
  int64_t k;

  const uint8_t* panel(int64_t p) const { return body + p * k * kCodedStep; }
};

// A panel's escapes, taken in (step, lane) order as its steps are decoded: a step is Width
// values of T (fp32: a k step of kPanel columns; bf16 pair panels: a k pair of 2 kPanel).
template <typename T, int64_t Width>
class EscapeCursor {
 public:
  EscapeCursor(const int32_t* escapes, const int32_t* starts, int64_t p)
      : at_(escapes + 2 * static_cast<int64_t>(starts[p])),
        end_(escapes + 2 * static_cast<int64_t>(starts[p + 1])) {}

  // The next step holding an escape (`none` where there is none).
  int64_t next_k(int64_t none) const { return at_ < end_ ? at_[0] / Width : none; }

  // Writes the escapes of steps [k0, k1) over slice[k - k0][lane] (their bits are the low
  // sizeof(T) bytes of each entry's second int32).
  void patch(T* slice, int64_t k0, int64_t k1) {
    for (; at_ < end_ && at_[0] < k1 * Width; at_ += 2)
      std::memcpy(slice + (at_[0] - k0 * Width), at_ + 1, sizeof(T));
  }

 private:
  const int32_t* at_;
  const int32_t* end_;
};

using F32Escapes = EscapeCursor<float, kPanel>;

inline F32Escapes escapes_of(const CodedView& w, int64_t p) {
  return F32Escapes(w.escapes, w.starts, p);
}

inline void decode_step(const CodedDecoder& dec, const uint8_t* src, float* dst) {
  store(dst, dec(src));
  store(dst + kLanes, dec(src + kCodedVecBytes));
}

constexpr int64_t kCodedAhead = 32;  // k steps a panel's bytes are prefetched ahead

inline void prefetch_ahead(const uint8_t* step, bool stream) {
  // Past the panel's end too: into the next panel, which a thread's run of panels usually
  // reads next (a prefetch never faults). A panel's only reader streams it past the caches
  // (a decode step reads its weights once); where another tile reads it again it goes to L2.
  if (stream) {
    __builtin_prefetch(step + kCodedAhead * kCodedStep, 0, 0);
    __builtin_prefetch(step + kCodedAhead * kCodedStep + kLine, 0, 0);
  } else {
    __builtin_prefetch(step + kCodedAhead * kCodedStep, 0, 2);
    __builtin_prefetch(step + kCodedAhead * kCodedStep + kLine, 0, 2);
  }
}

// c[MR][kPanel] (row stride ldc) = a[MR][k] (row stride lda) . panel p: per output the fp32
// panels' FMA chain (k in order from zero), as a lone row tile runs it over them. Runs of k
// steps without escapes decode in registers; a step with one goes through a buffer that its
// escapes are written into.
template <int MR>
void coded_tile(const CodedDecoder& dec, const CodedView& w, int64_t p, const float* __restrict a,
                int64_t lda, float* __restrict c, int64_t ldc, bool stream) {
  const uint8_t* body = w.panel(p);
  const int64_t k = w.k;
  F32Escapes escapes = escapes_of(w, p);
  // No lambda over the accumulators: a captured array stays in memory, a load and a store
  // around every FMA.
  Vec lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = Vec{};
  for (int64_t i = 0, stop = escapes.next_k(k); i < k; ++i) {
    const uint8_t* s = body + i * kCodedStep;
    prefetch_ahead(s, stream);
    Vec w0, w1;
    if (i != stop) {
      w0 = dec(s);
      w1 = dec(s + kCodedVecBytes);
    } else {
      alignas(64) float step[kPanel];
      decode_step(dec, s, step);
      escapes.patch(step, i, i + 1);
      stop = escapes.next_k(k);
      w0 = load(step);
      w1 = load(step + kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      const Vec av = splat(a[r * lda + i]);
      lo[r] += av * w0;
      hi[r] += av * w1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * ldc, lo[r]);
    store(c + r * ldc + kLanes, hi[r]);
  }
}

using CodedTile = void (*)(const CodedDecoder&, const CodedView&, int64_t, const float*, int64_t,
                           float*, int64_t, bool);

template <int... MR>
constexpr auto coded_tile_table(std::integer_sequence<int, MR...>) {
  return std::array<CodedTile, sizeof...(MR)>{&coded_tile<MR + 1>...};
}
constexpr auto kCodedTile = coded_tile_table(std::make_integer_sequence<int, kMaxMR>{});

// Up to kMaxMR rows (one row tile) through the panels, dealt as single_row_panels deals a row's:
// each panel's bytes are decoded once, in registers.
void coded_few_rows(const CodedDecoder& dec, const CodedView& w, const float* x, int64_t ldx,
                    int64_t m, int64_t panels, float* out, int64_t n) {
  const CodedTile tile = kCodedTile[m - 1];
  single_row_panels(
      panels, n / kPanel, kGroup,
      [&](int64_t p0, int64_t count) {
        for (int64_t p = p0; p < p0 + count; ++p)
          tile(dec, w, p, x, ldx, out + p * kPanel, n, true);
      },
      [&](int64_t p) {
        alignas(64) float c[kMaxMR * kPanel];
        tile(dec, w, p, x, ldx, c, kPanel, true);
        for (int64_t r = 0; r < m; ++r)
          std::copy_n(c + r * kPanel, n - p * kPanel, out + r * n + p * kPanel);
      });
}

// The first row tile of a k block [kc, kc + kn) of panel p: c[MR][kPanel] = (first ? 0 : c) +
// a[MR][kn] . the block, as linear.cpp's microkernel computes it, decoding the block as it goes
// into slice[kn][kPanel] (escapes written in) for the other tiles: the decode's shuffles run
// beside this tile's FMAs.
template <int MR>
void coded_slice_tile(const CodedDecoder& dec, const uint8_t* body, F32Escapes& escapes,
                      int64_t kc, int64_t kn, const float* __restrict a, int64_t lda,
                      float* __restrict slice, float* __restrict c, int64_t ldc, bool first) {
  Vec lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = first ? Vec{} : load(c + r * ldc);
    hi[r] = first ? Vec{} : load(c + r * ldc + kLanes);
  }
  for (int64_t i = 0; i < kn; ++i) {
    const uint8_t* s = body + (kc + i) * kCodedStep;
    prefetch_ahead(s, true);
    float* row = slice + i * kPanel;
    Vec w0 = dec(s), w1 = dec(s + kCodedVecBytes);
    store(row, w0);
    store(row + kLanes, w1);
    if (escapes.next_k(-1) == kc + i) {
      escapes.patch(row - i * kPanel, kc, kc + i + 1);
      w0 = load(row);
      w1 = load(row + kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      const Vec av = splat(a[r * lda + i]);
      lo[r] += av * w0;
      hi[r] += av * w1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * ldc, lo[r]);
    store(c + r * ldc + kLanes, hi[r]);
  }
}

using CodedSliceTile = void (*)(const CodedDecoder&, const uint8_t*, F32Escapes&, int64_t,
                                int64_t, const float*, int64_t, float*, float*, int64_t, bool);

template <int... MR>
constexpr auto coded_slice_table(std::integer_sequence<int, MR...>) {
  return std::array<CodedSliceTile, sizeof...(MR)>{&coded_slice_tile<MR + 1>...};
}
constexpr auto kCodedSliceTile = coded_slice_table(std::make_integer_sequence<int, kMaxMR>{});

// `rows` rows as ceil(rows / kMaxMR) row tiles whose sizes differ by at most one.
struct TileSplit {
  explicit TileSplit(int64_t rows) : total(rows), tiles((rows + kMaxMR - 1) / kMaxMR) {}
  int64_t rows(int64_t t) const { return total / tiles + (t < total % tiles ? 1 : 0); }
  int64_t total, tiles;
};

// Panel p times the rows of `split` (a, row stride lda) into c (row stride ldc): per k block,
// the first tile decodes the block into an fp32 slice as it runs (coded_slice_tile), and
// linear.cpp's microkernel runs the other tiles over the slice, as over fp32 panels.
void coded_slices(const CodedDecoder& dec, const CodedView& w, int64_t p, const TileSplit& split,
                  const float* a, int64_t lda, float* c, int64_t ldc) {
  alignas(64) float slice[kKC * kPanel];
  F32Escapes escapes = escapes_of(w, p);
  const uint8_t* body = w.panel(p);
  for (int64_t kc = 0; kc < w.k; kc += kKC) {
    const int64_t kn = std::min(kKC, w.k - kc);
    kCodedSliceTile[split.rows(0) - 1](dec, body, escapes, kc, kn, a + kc, lda, slice, c, ldc,
                                       kc == 0);
    // The bytes the first tile decodes next (the next block, or the next panel's first, which
    // a thread's run of panels reads next) are fetched into L2 meanwhile, a share per other
    // tile: the first tile's own look-ahead is too short to hide memory's latency.
    const char* next = reinterpret_cast<const char*>(body + (kc + kn) * kCodedStep);
    const int64_t lines = (kKC * kCodedStep + kLine - 1) / kLine;
    const int64_t share = (lines + split.tiles - 2) / (split.tiles - 1);
    for (int64_t t = 1, r = split.rows(0); t < split.tiles; r += split.rows(t), ++t)
      kMicro<float>[split.rows(t) - 1](kn, a + r * lda + kc, lda, slice, c + r * ldc, ldc,
                                       kc == 0, next + (t - 1) * share * kLine, share);
  }
}

// Row tiles up to which each tile decodes the panel on its own, in registers (coded_tile):
// with few tiles that costs less than going through a slice in memory.
constexpr int64_t kOwnDecodeTiles = 3;

// Rows [m0, m1) of out through panel p, more rows than a tile: up to kOwnDecodeTiles tiles, each
// decodes the panel itself (coded_tile), else through slices (coded_slices). Either way each
// output is the fp32 panels' FMA chain.
void coded_rows_panel(const CodedDecoder& dec, const CodedView& w, const float* x, int64_t ldx,
                      float* out, int64_t n, int64_t m0, int64_t m1, int64_t p) {
  const int64_t col = p * kPanel, width = std::min<int64_t>(kPanel, n - col), rows = m1 - m0;
  // A partial last panel accumulates into a [rows][kPanel] buffer, its columns copied after.
  std::unique_ptr<float[]> tail(width < kPanel ? new float[rows * kPanel] : nullptr);
  float* c = tail ? tail.get() : out + m0 * n + col;
  const int64_t ldc = tail ? kPanel : n;
  const TileSplit split(rows);
  if (split.tiles <= kOwnDecodeTiles) {
    for (int64_t t = 0, r = 0; t < split.tiles; r += split.rows(t), ++t)
      kCodedTile[split.rows(t) - 1](dec, w, p, x + (m0 + r) * ldx, ldx, c + r * ldc, ldc,
                                    false);
  } else {
    coded_slices(dec, w, p, split, x + m0 * ldx, ldx, c, ldc);
  }
  if (tail)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(c + r * kPanel, width, out + (m0 + r) * n + col);
}

// out[M, n] = x[M, K] times the coded panels, no bias.
void coded_product(const CodedView& w, const float* x, int64_t ldx, int64_t m, int64_t panels,
                   float* out, int64_t n) {
  const CodedDecoder dec(w.tops);
  if (m <= kMaxMR) return coded_few_rows(dec, w, x, ldx, m, panels, out, n);
  // Items (row block, panel), panel-major within a row block, as panel_product deals them (a
  // single panel a time at every size: slices of two panels at once read slower here).
  constexpr int64_t kRowBlock = 192;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item / panels, p = item % panels;
      coded_rows_panel(dec, w, x, ldx, out, n, m * rb / row_blocks, m * (rb + 1) / row_blocks,
                       p);
    }
  });
}

CodedView check_coded(const char* op, const at::Tensor& body, const at::Tensor& table,
                      const at::Tensor& escapes, int64_t n, int64_t k) {
  TORCH_CHECK(body.device().is_cpu() && table.device().is_cpu() && escapes.device().is_cpu(), op,
              "CPU tensors only");
  TORCH_CHECK(n > 0 && k > 0, op, "empty weight");
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(body.scalar_type() == at::kByte && body.dim() == 1 && body.is_contiguous() &&
                  body.numel() == panels * k * kCodedStep + kCodedPad,
              op, "body must be a contiguous uint8 tensor of ", panels * k * kCodedStep + kCodedPad,
              " bytes for n = ", n, ", K = ", k);
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 1 && table.is_contiguous() &&
                  table.numel() == kCodes + panels + 1,
              op, "table must be a contiguous int32 [", kCodes + panels + 1, "] tensor");
  TORCH_CHECK(escapes.scalar_type() == at::kInt && escapes.dim() == 2 && escapes.size(1) == 2 &&
                  escapes.is_contiguous(),
              op, "escapes must be a contiguous int32 [E, 2] tensor");
  const int32_t* starts = table.data_ptr<int32_t>() + kCodes;
  TORCH_CHECK(starts[0] == 0 && starts[panels] == escapes.size(0), op,
              "the table's escape starts do not cover the escapes");
  return CodedView{body.data_ptr<uint8_t>(), table.data_ptr<int32_t>(), starts,
                   escapes.data_ptr<int32_t>(), k};
}

void linear_coded_into(const at::Tensor& x, const at::Tensor& body, const at::Tensor& table,
                       const at::Tensor& escapes, const std::optional<at::Tensor>& bias,
                       int64_t n, at::Tensor& out) {
  const char* op = "linear_coded: ";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, "x must be a float32 [M, K] CPU tensor with contiguous rows");
  const CodedView w = check_coded(op, body, table, escapes, n, x.size(1));
  check_out_rows(op, out, x.size(0), n, at::kFloat);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                op, "bias must be a contiguous float32 [n] tensor");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0);
  if (m == 0) return;
  float* o = out.data_ptr<float>();
  coded_product(w, x.data_ptr<float>(), x.stride(0), m, (n + kPanel - 1) / kPanel, o, n);
  if (b != nullptr)
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < n; ++j) o[r * n + j] += b[j];
    });
}

at::Tensor linear_coded(const at::Tensor& x, const at::Tensor& body, const at::Tensor& table,
                        const at::Tensor& escapes, const std::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x.dim() == 2, "linear_coded: x must be [M, K] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_coded_into(x, body, table, escapes, bias, n, out);
  return out;
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("linear_coded(Tensor x, Tensor body, Tensor table, Tensor escapes, Tensor? bias, int n) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("linear_coded", &tierserve::linear_coded);
}

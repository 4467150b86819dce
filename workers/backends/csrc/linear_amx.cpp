// fp32 linear layer (y = x W^T + b) on Intel AMX for prefill-sized inputs, to fp32 accuracy.
//
// Every fp32 value is split into three bf16 pieces (v = v1 + v2 + v3, exactly for normal
// numbers: each piece rounds to nearest even what the previous ones left), and the six products
// above fp32's rounding are summed: x1 w1 + (x2 w1 + x3 w1 + x1 w2 + x2 w2 + x1 w3). Each bf16
// product is exact in fp32 and AMX accumulates in fp32; the dropped terms (x2 w3, x3 w2, x3 w3)
// are at most ~2^-24 of x1 w1, one fp32 rounding. The big term and the corrections accumulate
// in separate tiles, added once at the end, so the sum's rounding error is that of one fp32 dot
// product of length K rather than 6K: a few times below MKL's sgemm against float64.
//
// AMX does ~16x the bf16 FLOPs of AVX-512 fp32 FMAs, so six products per fp32 product still
// leave it ahead of MKL's sgemm on prefill-sized inputs (bench/linear_kernels.py). The weight
// arrives in linear.cpp's panels ([K][32] per 32 output features) and is split into pieces on
// every call (6 bytes a weight, [N / 32][K / 32][2 column tiles][3 pieces][16 k pairs]
// [16 columns][2]), about what MKL's path spends rebuilding W from the panels. Decode-sized
// inputs stay on the panel kernel (the backend's panel_max_rows): with few rows the split and
// AMX's tile loads cost more than its FMAs. Activations are split per call into
// [3 pieces][M to 16][K to 32].
//
// Compiled in only by the amx variant (kernels.py: -mamx-tile -mamx-bf16 -mavx512bf16); in
// the others amx_available() is false and the op refuses.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TIERSERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tierserve {
namespace {


#ifdef TIERSERVE_AMX

constexpr int64_t kTileRows = 16;   // rows of an A or C tile; k pairs of a B tile
constexpr int64_t kTileK = 32;      // bf16 k per tile row (64 bytes)
constexpr int64_t kTileCols = 16;   // fp32 columns of a C tile
constexpr int64_t kBlockN = 2 * kTileCols;
static_assert(kBlockN == kPanel, "a column block is one linear.cpp panel");
constexpr int64_t kPieces = 3;
constexpr int64_t kTileElems = kTileRows * kTileK;        // bf16 per A or B tile (1 KiB)
constexpr int64_t kStepElems = 2 * kPieces * kTileElems;  // one (column block, k step): 6 KiB
// Rows per work item: a chunk's A pieces ([3][rows][K] bf16, ~kChunkBytes) stay in L2 (2 MiB
// here) next to the column block in use (K * 192 bytes) while the chunk runs through the
// column blocks; 1 MiB measured best of 0.375-1.5 MiB on SmolLM2's shapes at 2048 rows.
constexpr int64_t kMaxChunkRows = 256;
constexpr int64_t kChunkBytes = 1 << 20;

// Linux asks a process to request the AMX tile state before its first tile instruction.
bool request_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((d & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_available() {
  static const bool ok = request_amx();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 the big term of the two column tiles, 2, 3 their corrections; 4 x1; 5 x2 or x3;
// 6, 7 a weight piece for the two column tiles. All 16 rows x 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// acc = {big[16][32], corr[16][32]} fp32: one 16-row block of the A pieces (a: piece 0 at
// row 0, pieces piece_stride elements apart, rows lda elements apart) times one column block.
void tile_block(const uint16_t* a, int64_t lda, int64_t piece_stride, const uint16_t* b,
                int64_t ksteps, float* acc) {
  const int64_t stride = lda * 2;
  float* big = acc;
  float* corr = acc + kTileRows * kBlockN;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t ks = 0; ks < ksteps; ++ks) {
    const uint16_t* ak = a + ks * kTileK;
    const uint16_t* bk = b + ks * kStepElems;  // [column tile][piece][tile]
    _tile_loadd(4, ak, stride);
    _tile_loadd(6, bk, 64);
    _tile_loadd(7, bk + kPieces * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);  // x1 w1
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, ak + 2 * piece_stride, stride);
    _tile_dpbf16ps(2, 5, 6);  // x3 w1
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(5, ak + piece_stride, stride);
    _tile_dpbf16ps(2, 5, 6);  // x2 w1
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, bk + kTileElems, 64);
    _tile_loadd(7, bk + (kPieces + 1) * kTileElems, 64);
    _tile_dpbf16ps(2, 5, 6);  // x2 w2
    _tile_dpbf16ps(3, 5, 7);
    _tile_dpbf16ps(2, 4, 6);  // x1 w2
    _tile_dpbf16ps(3, 4, 7);
    _tile_loadd(6, bk + 2 * kTileElems, 64);
    _tile_loadd(7, bk + (kPieces + 2) * kTileElems, 64);
    _tile_dpbf16ps(2, 4, 6);  // x1 w3
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, big, kBlockN * 4);
  _tile_stored(1, big + kTileCols, kBlockN * 4);
  _tile_stored(2, corr, kBlockN * 4);
  _tile_stored(3, corr + kTileCols, kBlockN * 4);
}

// 16 floats -> their three bf16 pieces (round to nearest even; each remainder is exact).
inline void split3(__m512 v, __m256bh* h) {
  h[0] = _mm512_cvtneps_pbh(v);
  const __m512 rest = _mm512_sub_ps(v, _mm512_cvtpbh_ps(h[0]));
  h[1] = _mm512_cvtneps_pbh(rest);
  h[2] = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, _mm512_cvtpbh_ps(h[1])));
}

// Rows [r0, r1) of x [M][K] into pieces [3][mp][kp], padding columns zero.
void split_rows(const float* x, int64_t ldx, int64_t k, int64_t kp, int64_t mp, int64_t r0,
                int64_t r1, uint16_t* pieces) {
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* p0 = pieces + r * kp;
    const float* xr = x + r * ldx;
    for (int64_t j = 0; j < kp; j += 16) {
      const __mmask16 live = j + 16 <= k ? 0xFFFF : j < k ? (1u << (k - j)) - 1 : 0;
      __m256bh h[kPieces];
      split3(_mm512_maskz_loadu_ps(live, xr + j), h);
      for (int64_t p = 0; p < kPieces; ++p)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p0 + p * mp * kp + j),
                            reinterpret_cast<const __m256i&>(h[p]));
    }
  }
}

// One (panel, k step) of the weight into its 6 KiB of pieces: for each column tile and piece,
// [16 k pairs][16 columns][2], a column's two k values of a pair side by side (as TDPBF16PS
// reads B). Rows k >= K are zero.
void pack_step(const float* panel, int64_t k, int64_t ks, uint16_t* out) {
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t i = 0; i < kTileRows; ++i) {
      const int64_t k0 = ks * kTileK + 2 * i;
      const __m512 v0 = k0 < k ? _mm512_loadu_ps(panel + k0 * kPanel + t * kTileCols)
                               : _mm512_setzero_ps();
      const __m512 v1 = k0 + 1 < k ? _mm512_loadu_ps(panel + (k0 + 1) * kPanel + t * kTileCols)
                                   : _mm512_setzero_ps();
      __m256bh h0[kPieces], h1[kPieces];
      split3(v0, h0);
      split3(v1, h1);
      for (int64_t p = 0; p < kPieces; ++p) {
        const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h0[p]));
        const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h1[p]));
        _mm512_storeu_si512(out + (t * kPieces + p) * kTileElems + i * 2 * kTileCols,
                            _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
}

void store_block(const float* acc, int64_t rows, const float* bias, int64_t col, int64_t width,
                 float* out, int64_t n) {
  const float* corr = acc + kTileRows * kBlockN;
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * n + col;
    const float* g = acc + r * kBlockN;
    const float* c = corr + r * kBlockN;
    if (bias != nullptr)
      for (int64_t j = 0; j < width; ++j) o[j] = (g[j] + c[j]) + bias[col + j];
    else
      for (int64_t j = 0; j < width; ++j) o[j] = g[j] + c[j];
  }
}

void run_amx(const float* xp, int64_t ldx, int64_t m, int64_t k, const float* panels,
             int64_t blocks, const float* bias, int64_t n, float* outp, const at::Tensor& x) {
  const int64_t ksteps = (k + kTileK - 1) / kTileK, kp = ksteps * kTileK;
  const int64_t mp = (m + kTileRows - 1) / kTileRows * kTileRows;
  at::Tensor wpieces = at::empty({blocks * ksteps * kStepElems}, x.options().dtype(at::kBFloat16));
  auto* wp = reinterpret_cast<uint16_t*>(wpieces.data_ptr());
  at::parallel_for(0, blocks * ksteps, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      pack_step(panels + (i / ksteps) * k * kPanel, k, i % ksteps, wp + i * kStepElems);
  });
  at::Tensor xpieces = at::empty({kPieces, mp, kp}, x.options().dtype(at::kBFloat16));
  auto* pieces = reinterpret_cast<uint16_t*>(xpieces.data_ptr());
  at::parallel_for(0, mp, kTileRows, [&](int64_t r0, int64_t r1) {
    split_rows(xp, ldx, k, kp, mp, r0, std::min(r1, m), pieces);
    for (int64_t r = std::max(r0, m); r < r1; ++r)
      for (int64_t p = 0; p < kPieces; ++p) std::fill_n(pieces + (p * mp + r) * kp, kp, 0);
  });
  const int64_t chunk_rows = std::clamp<int64_t>(
      kChunkBytes / (kp * 2 * kPieces) / kTileRows * kTileRows, kTileRows, kMaxChunkRows);
  const int64_t chunks = (mp + chunk_rows - 1) / chunk_rows;
  // Items (row chunk, column block), column-major within a chunk: a thread's share is a run of
  // column blocks, which come from memory for a chunk's first row block and from L2 after.
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float acc[2 * kTileRows * kBlockN];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / blocks, nb = i % blocks;
      const int64_t col = nb * kBlockN, width = std::min(kBlockN, n - col);
      const int64_t row0 = chunk * chunk_rows, row_end = std::min(mp, row0 + chunk_rows);
      for (int64_t r0 = row0; r0 < row_end; r0 += kTileRows) {
        tile_block(pieces + r0 * kp, kp, mp * kp, wp + nb * ksteps * kStepElems, ksteps, acc);
        if (r0 < m) store_block(acc, std::min(kTileRows, m - r0), bias, col, width, outp + r0 * n, n);
      }
    }
    _tile_release();
  });
}

#else  // no AMX in this build

bool amx_available() { return false; }

#endif

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t n) {
  const char* op = "linear_amx: ";
  TORCH_CHECK(amx_available(), op, "this CPU, build or kernel does not offer AMX-BF16");
  const float* bp = check_panel_linear(op, x, packed, bias, n);
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
#ifdef TIERSERVE_AMX
  if (m > 0 && k > 0)
    run_amx(x.data_ptr<float>(), x.stride(0), m, k, packed.data_ptr<float>(), blocks, bp, n,
            out.data_ptr<float>(), x);
  else if (m > 0)
    out.copy_(bias.has_value() ? bias->expand({m, n}) : at::zeros({m, n}, x.options()));
#endif
  return out;
}

bool has_amx() { return amx_available(); }

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("linear_amx(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("has_amx() -> bool", &tierserve::has_amx);
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("linear_amx", &tierserve::linear_amx);
}

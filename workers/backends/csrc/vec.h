// Vector helpers shared by the CPU kernels, on GCC/Clang vector extensions. A Vec is one
// register of floats: 16 (a zmm) where the build targets AVX-512, 8 (a ymm) for AVX2, so that
// no kernel spills a register it does not have. Every kernel source includes it, so
// kernels.build_dir_for hashes it with them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace tierserve {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // floats per Vec: one zmm
constexpr int kVecRegs = 32;
#else
constexpr int kLanes = 8;  // floats per Vec: one ymm
constexpr int kVecRegs = 16;
#endif

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
using U16Vec = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
using U32Vec = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
using V8 = float __attribute__((vector_size(8 * sizeof(float))));
using V4 = float __attribute__((vector_size(4 * sizeof(float))));

// Unaligned views for loads and stores. Typed (not memcpy), so that type-based alias analysis
// knows a store of floats cannot change the pointers and strides the loops read.
using VecU = float __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));
using U16VecU = uint16_t
    __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(alignof(uint16_t))));

// One vbroadcastss (from memory where x is loaded). `Vec{} + x` would add a scalar 0 first
// (0 + x is not x for x = -0) and broadcast from a register, on the port the FMAs need.
inline Vec splat(float x) {
#if defined(__AVX512F__)
  return Vec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return Vec{x, x, x, x, x, x, x, x};
#endif
}

// 0, 1, ..., kLanes - 1.
inline IVec lane_ids() {
  IVec v{};
  for (int l = 0; l < kLanes; ++l) v[l] = l;
  return v;
}

inline Vec load(const float* p) { return *reinterpret_cast<const VecU*>(p); }

inline void store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }

// kLanes bf16 values -> fp32: bf16 is the top half of an fp32 bit pattern. Intrinsics: GCC
// builds the generic conversion from 256-bit halves at -march=x86-64-v4 (an extract, two
// widenings and an insert), a single widening from memory here.
inline Vec load_bf16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (Vec)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
  const __m256i wide =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#endif
}

// fp32 -> kLanes bf16 values, rounded to nearest even (NaN kept NaN), as c10::BFloat16 converts.
inline void store_bf16(c10::BFloat16* p, Vec v) {
  const U32Vec bits = reinterpret_cast<U32Vec>(v);
  const U32Vec rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  const U32Vec out = v != v ? U32Vec{} + 0x7FC0u : rounded;
  *reinterpret_cast<U16VecU*>(p) = __builtin_convertvector(out, U16Vec);
}

// The 8 lanes left after folding a Vec's halves together with op (the Vec itself on AVX2).
template <typename Op>
inline V8 fold_to_8(Vec v, Op op) {
#if defined(__AVX512F__)
  return op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  (void)op;
  return v;
#endif
}

// kLanes fp16 values -> fp32 (F16C), and back rounded to nearest even, as c10::Half converts.
// Intrinsics: GCC converts _Float16 vectors a lane at a time.
inline Vec load_fp16(const c10::Half* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

inline void store_fp16(c10::Half* p, Vec v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
}

// A Vec of T (float, bf16 or fp16) as fp32.
template <typename T>
inline Vec load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return load_bf16(p);
  } else {
    static_assert(std::is_same_v<T, c10::Half>);
    return load_fp16(p);
  }
}

// The largest lane of a NaN-free Vec, by a shuffle tree (a scalar loop is a chain of maxes).
inline float hmax(Vec v) {
  auto vmax = [](auto a, auto b) { return a > b ? a : b; };
  const V8 m8 = fold_to_8(v, vmax);
  const V4 m4 = vmax(__builtin_shufflevector(m8, m8, 0, 1, 2, 3),
                     __builtin_shufflevector(m8, m8, 4, 5, 6, 7));
  const float lo = m4[0] > m4[1] ? m4[0] : m4[1], hi = m4[2] > m4[3] ? m4[2] : m4[3];
  return lo > hi ? lo : hi;
}

// The sum of the lanes by a tree of shuffles and adds.
inline float hsum(Vec v) {
  const V8 h8 = fold_to_8(v, [](V8 a, V8 b) { return a + b; });
  const V4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) +
                __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// exp(x) for -87 <= x <= 88 (callers clamp): Cephes-style, x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by a degree-6 polynomial (about 1 ulp), 2^n built in the exponent bits.
inline Vec exp_in_range(Vec x) {
  // Round to nearest by the 1.5 * 2^23 trick: exact for |x * log2e| < 2^22.
  const Vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const Vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec y = p * r * r + r + 1.0f;
  const Vec scale = reinterpret_cast<Vec>((__builtin_convertvector(n, IVec) + 127) << 23);
  return y * scale;
}

}  // namespace tierserve

// The op namespace this build registers: one per ISA variant (tierserve_avx2, ...), set by
// kernels.py, so that several variants can be loaded into one process side by side.
#ifndef TIERSERVE_OPS
#define TIERSERVE_OPS tierserve
#endif
#define TIERSERVE_STR2(x) #x
#define TIERSERVE_STR(x) TIERSERVE_STR2(x)

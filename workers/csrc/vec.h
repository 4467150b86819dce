// Vector helpers shared by the CPU kernels, on GCC/Clang vector extensions: a Vec is 16 floats,
// one AVX-512 register (two AVX2 ones elsewhere). Every kernel source includes it, so
// kernels.build_dir_for hashes it with them.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace tierserve {

constexpr int kLanes = 16;  // floats per Vec

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
using U16Vec = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
using U32Vec = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// Unaligned views for loads and stores. Typed (not memcpy), so that type-based alias analysis
// knows a store of floats cannot change the pointers and strides the loops read.
using VecU = float __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));
using U16VecU = uint16_t
    __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(alignof(uint16_t))));

// One vbroadcastss (from memory where x is loaded). `Vec{} + x` would add a scalar 0 first
// (0 + x is not x for x = -0) and broadcast from a register, on the port the FMAs need.
inline Vec splat(float x) { return Vec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline Vec load(const float* p) { return *reinterpret_cast<const VecU*>(p); }

inline void store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }

// 16 bf16 values -> fp32: bf16 is the top half of an fp32 bit pattern.
inline Vec load_bf16(const c10::BFloat16* p) {
  const U16Vec bits = *reinterpret_cast<const U16VecU*>(p);
  return reinterpret_cast<Vec>(__builtin_convertvector(bits, U32Vec) << 16);
}

// fp32 -> 16 bf16 values, rounded to nearest even (NaN kept NaN), as c10::BFloat16 converts.
inline void store_bf16(c10::BFloat16* p, Vec v) {
  const U32Vec bits = reinterpret_cast<U32Vec>(v);
  const U32Vec rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  const U32Vec out = v != v ? U32Vec{} + 0x7FC0u : rounded;
  *reinterpret_cast<U16VecU*>(p) = __builtin_convertvector(out, U16Vec);
}

// The largest lane of a NaN-free Vec, by a shuffle tree (a scalar loop is a chain of 15 maxes).
inline float hmax(Vec v) {
  using V8 = float __attribute__((vector_size(8 * sizeof(float))));
  using V4 = float __attribute__((vector_size(4 * sizeof(float))));
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const V8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const V8 m8 = a > b ? a : b;
  const V4 c = __builtin_shufflevector(m8, m8, 0, 1, 2, 3);
  const V4 d = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const V4 m4 = c > d ? c : d;
  const float lo = m4[0] > m4[1] ? m4[0] : m4[1], hi = m4[2] > m4[3] ? m4[2] : m4[3];
  return lo > hi ? lo : hi;
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

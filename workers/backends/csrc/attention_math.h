// What decode and prefill attention share: exp of a score less its running max, and the head
// dims compiled in. kernels.cpp's one translation unit includes it through both sources.
#pragma once

#include "vec.h"

#include <limits>

namespace tierserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (it is only taken of score - running max). Below -87 the result is
// exactly 0, so -inf (an empty running max, tile padding) gives 0.
inline Vec exp_nonpositive(Vec x) {
  const auto underflow = x < -87.0f;
  const Vec e = exp_in_range(underflow ? splat(-87.0f) : x);
  return underflow ? Vec{} : e;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

}  // namespace
}  // namespace tierserve

// The head dims compiled in, each a multiple of kLanes; one list feeds the dispatch and the
// decode_head_dims op the Python side asks before choosing the kernel.
#define TIERSERVE_HEAD_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(112) X(128) X(192) X(256)

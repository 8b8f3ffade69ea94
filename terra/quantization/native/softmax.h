// The softmax's exponential and sums over 16 lanes of float32, shared by the attention kernels
// (prefill_attention.cc, cache_attention.h): inlined into each instruction set's function (isa.h).

#ifndef TERRA_QUANTIZATION_NATIVE_SOFTMAX_H_
#define TERRA_QUANTIZATION_NATIVE_SOFTMAX_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace terra::native {

// Below this exponent exp(x) is taken as 0 (it is under float32's smallest normal), so that masked
// logits (a bias of -1e9) and the -inf of a first tile's running maximum weigh exactly nothing.
constexpr float kMinExponent = -87.0f;

// exp(x) over 16 lanes, for x <= 0: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite), exp(r) by its
// Taylor polynomial of degree 7 (relative error under 1e-8 on that interval), times 2^n built in
// the exponent bits.
TERRA_INLINE Lanes ExpLanes(const Lanes& logits) {
  const Lanes low = Lanes{} + kMinExponent;
  const auto under = logits <= low;
  const Lanes x = under ? low : logits;
  const Lanes shifter = Lanes{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes n = (x * 1.44269504088896341f + shifter) - shifter;
  const Lanes r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  Lanes p = r * (1.0f / 5040) + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Int32Lanes exponent = (__builtin_convertvector(n, Int32Lanes) + 127) << 23;
  Lanes scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  const Lanes y = p * scale;
  return under ? Lanes{} : y;
}

// The largest of s[0, n).
TERRA_INLINE float RowMax(const float* s, int64_t n) {
  Lanes top = Lanes{} - std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes x = LoadLanes(s + j);
    top = x > top ? x : top;
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) best = std::max(best, top[l]);
  for (; j < n; ++j) best = std::max(best, s[j]);
  return best;
}

// s[j] = exp(s[j] - top) for j < n; returns their sum.
TERRA_INLINE float ExpAndSum(float* s, int64_t n, float top) {
  Lanes total = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes p = ExpLanes(LoadLanes(s + j) - top);
    StoreLanes(s + j, p);
    total += p;
  }
  if (j < n) {  // the tail through a buffer padded with -inf (exp 0)
    float padded[kLanes];
    std::fill(padded, padded + kLanes, -std::numeric_limits<float>::infinity());
    std::memcpy(padded, s + j, (n - j) * sizeof(float));
    const Lanes p = ExpLanes(LoadLanes(padded) - top);
    StoreLanes(padded, p);
    std::memcpy(s + j, padded, (n - j) * sizeof(float));
    total += p;
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += total[l];
  return sum;
}

}  // namespace terra::native

#endif  // TERRA_QUANTIZATION_NATIVE_SOFTMAX_H_

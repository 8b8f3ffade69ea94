// The softmax's exponential and sums over float32 lanes, shared by the attention kernels
// (prefill_attention.cc, cache_attention.h): inlined into each instruction set's function (isa.h).

#ifndef TERRA_BACKENDS_NATIVE_SOFTMAX_H_
#define TERRA_BACKENDS_NATIVE_SOFTMAX_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace terra::native {

// Below this exponent exp(x) is taken as 0 (it is under float32's smallest normal), so that masked
// logits (a bias of -1e9) and the -inf of a first tile's running maximum weigh exactly nothing.
constexpr float kMinExponent = -87.0f;

// exp(x) over the lanes of F (Int the int32 lanes of its width), for x <= 0: x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite), exp(r) by its Taylor polynomial of degree 7 (relative error under
// 1e-8 on that interval), times 2^n built in the exponent bits.
template <typename F, typename Int>
TERRA_INLINE F ExpLanes(const F& logits) {
  const F low = F{} + kMinExponent;
  const auto under = logits <= low;
  const F x = under ? low : logits;
  const F shifter = F{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const F n = (x * 1.44269504088896341f + shifter) - shifter;
  const F r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  F p = r * (1.0f / 5040) + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Int exponent = (__builtin_convertvector(n, Int) + 127) << 23;
  F scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  const F y = p * scale;
  return under ? F{} : y;
}

// The largest of s[0, n), in the instruction set I's select lanes (isa.h, SelectLanes).
template <typename I>
TERRA_INLINE float RowMax(const float* s, int64_t n) {
  constexpr int64_t N = I::kSelectLanes;
  using F = typename SelectLanes<N>::Float;
  F top = F{} - std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + N <= n; j += N) {
    F x;
    std::memcpy(&x, s + j, sizeof x);
    top = x > top ? x : top;
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < N; ++l) best = std::max(best, top[l]);
  for (; j < n; ++j) best = std::max(best, s[j]);
  return best;
}

// s[j] = exp(s[j] - top) for j < n; returns their sum.
template <typename I>
TERRA_INLINE float ExpAndSum(float* s, int64_t n, float top) {
  constexpr int64_t N = I::kSelectLanes;
  using F = typename SelectLanes<N>::Float;
  using Int = typename SelectLanes<N>::Int32;
  F total = {};
  int64_t j = 0;
  for (; j + N <= n; j += N) {
    F x;
    std::memcpy(&x, s + j, sizeof x);
    const F p = ExpLanes<F, Int>(x - top);
    std::memcpy(s + j, &p, sizeof p);
    total += p;
  }
  if (j < n) {  // the tail through a buffer padded with -inf (exp 0)
    float padded[N];
    std::fill(padded, padded + N, -std::numeric_limits<float>::infinity());
    std::memcpy(padded, s + j, (n - j) * sizeof(float));
    F x;
    std::memcpy(&x, padded, sizeof x);
    const F p = ExpLanes<F, Int>(x - top);
    std::memcpy(padded, &p, sizeof p);
    std::memcpy(s + j, padded, (n - j) * sizeof(float));
    total += p;
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < N; ++l) sum += total[l];
  return sum;
}

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_SOFTMAX_H_

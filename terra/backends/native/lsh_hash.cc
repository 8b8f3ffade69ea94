// The LSH hash (lsh_hash.h): each thread takes blocks of kHashBlock positions of one (batch row,
// head), multiplies them by the head's rotations into a [kHashBlock, W] buffer that stays in L1,
// and reduces each round's factors to their signed argmax. Why native: XLA:CPU writes the rotated
// [B, H, R, L, K] floats to memory, transposed, and reads them back for a max, a min and two
// selects, passes over memory that take longer than the product itself (docs/decode_speed.md,
// "Long documents").

#include "lsh_hash.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "threads.h"
#include "tile_products.h"

namespace terra::native {

namespace {

// Positions per block: one thread's unit of work.
constexpr int64_t kHashBlock = 64;

// argmax over the 2 h values [x_0 .. x_{h-1}, -x_0 .. -x_{h-1}]: the first index of the maximum,
// the first NaN if there is one.
TERRA_INLINE int32_t SignedArgmax(const float* x, int64_t h) {
  int32_t best = 0;
  float top = x[0];
  if (std::isnan(top)) return 0;
  for (int64_t i = 1; i < h; ++i) {
    if (std::isnan(x[i])) return static_cast<int32_t>(i);
    if (x[i] > top) top = x[i], best = static_cast<int32_t>(i);
  }
  for (int64_t i = 0; i < h; ++i)
    if (-x[i] > top) top = -x[i], best = static_cast<int32_t>(h + i);
  return best;
}

template <typename I>
TERRA_INLINE void HashBlock(const LshHashOperands& a, int64_t item, std::vector<float>& buffer) {
  const int64_t blocks = (a.length + kHashBlock - 1) / kHashBlock;
  const int64_t row = item / blocks, l0 = (item % blocks) * kHashBlock;
  const int64_t n = std::min(kHashBlock, a.length - l0), h = row % a.heads, W = a.width;
  buffer.resize(static_cast<size_t>(kHashBlock * W));
  float* rotated = buffer.data();
  const float* x = a.vecs + (row * a.length + l0) * a.depth;
  Product<I>({x, a.depth, a.rotations + h * a.depth * W, W, rotated, W, a.depth, false}, n, W);
  int64_t half_sum = 0;
  for (int64_t f = 0; f < a.n_factors; ++f) half_sum += a.factors[f] / 2;
  for (int64_t r = 0; r < a.rounds; ++r) {
    int32_t* out = a.buckets + (row * a.rounds + r) * a.length + l0;
    for (int64_t p = 0; p < n; ++p) {
      const float* column = rotated + p * W + r * half_sum;
      int32_t bucket = 0, radix = 1;
      for (int64_t f = 0; f < a.n_factors; ++f) {
        const int64_t half = a.factors[f] / 2;
        bucket += radix * SignedArgmax(column, half);
        radix *= static_cast<int32_t>(a.factors[f]);
        column += half;
      }
      out[p] = bucket;
    }
  }
}

}  // namespace

ffi::Error LshHash(ffi::ThreadPool& pool, const LshHashOperands& a) {
  const int isa = ActiveIsa();
  const int64_t items = a.batch * a.heads * ((a.length + kHashBlock - 1) / kHashBlock);
  const int64_t work_bytes = a.batch * a.heads * a.length * a.depth * static_cast<int64_t>(sizeof(float));
  Chunked(pool, items, 1, work_bytes, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA {
      for (int64_t item = begin; item < end; ++item) HashBlock<decltype(tag)>(a, item, buffer);
    });
  });
  return ffi::Error::Success();
}

}  // namespace terra::native

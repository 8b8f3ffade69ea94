// A sparse feed-forward layer's decode step in one call (terra/layers/sparse_feedforward.py):
//
//   low     = x C1ᵀ                                    C1 [L, d], output-major
//   logits  = low C2ᵀ + c_bias                         C2 [F, L] (the decode tree stores it output-major)
//   idx[k]  = first argmax of logits[k N : (k + 1) N]  block k of N units
//   mid[k]  = relu(W1[k N + idx[k]] . x)
//   y       = sum_k mid[k] W2[k N + idx[k]] + b2
//
// Each phase is the same loop as the product the unfused layer calls (the output-major rows, the
// gathered dot and sum), so both give the same floats. While a chunk of the controller picks its
// blocks' rows, it asks for their lines of W1, and a chunk of the dot asks for its rows of W2: by
// the time a phase needs its rows they are on their way, where the unfused products could only
// prefetch a few rows ahead of their own reading.

#include "sparse_feedforward.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "products.h"
#include "threads.h"

namespace terra::native {

namespace {

template <typename W>
struct SparseFeedForwardStep {
  Product<W> down, up;     // x -> low, low -> logits (before the bias)
  const float* up_bias;    // [F]
  GatheredRows<W> w1, w2;  // rows: the selected rows, [B, F / N]
  const float* out_bias;   // [d]
  int32_t* indices;        // [B, F / N], in block
  int32_t* rows;           // [B, F / N], in W1 and W2
  int64_t n_units;         // N

  // The first index of the maximum, or N where it is NaN (as block_argmax's max and min compute it).
  int32_t BlockArgmax(const float* logits) const {
    float top = logits[0];
    bool nan = false;
    for (int64_t j = 0; j < n_units; ++j) {
      nan |= logits[j] != logits[j];
      top = logits[j] > top ? logits[j] : top;
    }
    if (nan) return static_cast<int32_t>(n_units);
    for (int64_t j = 0; j < n_units; ++j)
      if (logits[j] == top) return static_cast<int32_t>(j);
    return static_cast<int32_t>(n_units);
  }
};

template <typename W>
void SparseFeedForwardDecode(ffi::ThreadPool& pool, const SparseFeedForwardStep<W>& s) {
  const int isa = ActiveIsa();
  const int64_t batch = s.down.batch, d = s.down.n_in, low_rows = s.down.n_out;
  const int64_t n_blocks = s.w1.k, width = static_cast<int64_t>(sizeof(W));
  // Chunks of about kChunkBytes of weights (whole blocks of the controller, whole lines of outputs).
  const int64_t down_rows = std::max<int64_t>(4, kChunkBytes / std::max<int64_t>(1, d * width) / 4 * 4);
  const int64_t up_blocks = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, s.n_units * low_rows * width));
  const int64_t dot_rows = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, d * width * batch));
  const int64_t columns = std::max<int64_t>(16, kChunkBytes / std::max<int64_t>(1, n_blocks * width * batch) / 16 * 16);
  const int64_t bytes = (low_rows * d + s.up.n_out * low_rows + 2 * n_blocks * d * batch) * width;
  auto count = [](int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; };
  RunPhases(pool, bytes >= kParallelBytes,
            {count(low_rows, down_rows), count(n_blocks, up_blocks), count(n_blocks, dot_rows), count(d, columns)},
            [&](int phase, int64_t c) {
              if (phase == 0) {
                OutputMajorRange(isa, s.down, c * down_rows, std::min(low_rows, (c + 1) * down_rows));
              } else if (phase == 1) {
                const int64_t k0 = c * up_blocks, k1 = std::min(n_blocks, k0 + up_blocks);
                OutputMajorRange(isa, s.up, k0 * s.n_units, k1 * s.n_units);
                for (int64_t b = 0; b < batch; ++b) {
                  float* logits = s.up.y + b * s.up.n_out;
                  for (int64_t k = k0; k < k1; ++k) {
                    float* block = logits + k * s.n_units;
                    for (int64_t j = 0; j < s.n_units; ++j) block[j] += s.up_bias[k * s.n_units + j];
                    const int32_t index = s.BlockArgmax(block);
                    s.indices[b * n_blocks + k] = index;
                    s.rows[b * n_blocks + k] = static_cast<int32_t>(k * s.n_units + index);
                    PrefetchRow(s.w1, b, k, 0, d);
                  }
                }
              } else if (phase == 2) {
                const int64_t j0 = c * dot_rows, j1 = std::min(n_blocks, j0 + dot_rows);
                for (int64_t b = 0; b < batch; ++b)
                  for (int64_t j = j0; j < j1; ++j) PrefetchRow(s.w2, b, j, 0, d);
                GatheredDotRange(isa, s.w1, j0, j1);
                for (int64_t b = 0; b < batch; ++b)
                  for (int64_t j = j0; j < j1; ++j) {
                    float& m = s.w1.y[b * n_blocks + j];
                    m = m < 0.0f ? 0.0f : m;  // relu, NaN kept as jnp.maximum keeps it
                  }
              } else {
                const int64_t c0 = c * columns, c1 = std::min(d, c0 + columns);
                GatheredSumRange(isa, s.w2, c0, c1);
                for (int64_t b = 0; b < batch; ++b)
                  for (int64_t i = c0; i < c1; ++i) s.w2.y[b * d + i] += s.out_bias[i];
              }
            });
}

}  // namespace

template <typename W>
ffi::Error SparseFeedForward(ffi::ThreadPool& pool, const float* x, ffi::Span<const int64_t> x_shape, const W* down,
                             ffi::Span<const int64_t> down_shape, const float* down_scale, const W* up,
                             ffi::Span<const int64_t> up_shape, const float* up_scale, const float* up_bias,
                             ffi::Span<const int64_t> bias_shape, const W* w1, const float* w1_scale, const W* w2,
                             const float* w2_scale, ffi::Span<const int64_t> w_shape,
                             ffi::Span<const int64_t> w2_shape, const float* out_bias, int64_t out_bias_size, float* y,
                             int32_t* indices) {
  if (x_shape.size() != 2 || down_shape.size() != 2 || up_shape.size() != 2 || bias_shape.size() != 2 ||
      w_shape.size() != 2)
    return ffi::Error::InvalidArgument("sparse feed-forward: x, C1, C2, the controller bias and W1/W2 must be 2-D");
  const int64_t batch = x_shape[0], d = x_shape[1], n_low = down_shape[0];
  const int64_t n_blocks = bias_shape[0], n_units = bias_shape[1], n_ff = n_blocks * n_units;
  if (down_shape[1] != d || up_shape[0] != n_ff || up_shape[1] != n_low || w_shape[0] != n_ff || w_shape[1] != d ||
      w2_shape.size() != 2 || w2_shape[0] != n_ff || w2_shape[1] != d || out_bias_size != d || n_ff < 1)
    return ffi::Error::InvalidArgument(
        "sparse feed-forward: x [B, d], C1 [L, d], C2 [F, L], bias [F / N, N], W1, W2 [F, d] and b2 [d] disagree");
  if (batch > kMaxRows) return ffi::Error::InvalidArgument("sparse feed-forward: at most 64 rows of x");
  // The intermediates are scratch of the calling thread that grows to the largest layer it has run
  // and is reused by its later calls: a fresh allocation per call would, for the wide logits, be
  // new pages the kernel must zero on every decode step, and XLA need not hold them as results. The
  // pool's threads only reach them through the step below, which ends with this call.
  thread_local std::vector<float> float_scratch;
  thread_local std::vector<int32_t> row_scratch;
  float_scratch.resize(static_cast<size_t>(batch * (n_low + n_ff + n_blocks)));
  row_scratch.resize(static_cast<size_t>(batch * n_blocks));
  float* low = float_scratch.data();
  float* logits = low + batch * n_low;
  float* mid = logits + batch * n_ff;
  int32_t* rows = row_scratch.data();
  const SparseFeedForwardStep<W> step{{x, down, down_scale, low, batch, d, n_low, 1},
                                      {low, up, up_scale, logits, batch, n_low, n_ff, 1},
                                      up_bias,
                                      {x, w1, w1_scale, rows, mid, batch, n_blocks, d, n_ff},
                                      {mid, w2, w2_scale, rows, y, batch, n_blocks, d, n_ff},
                                      out_bias,
                                      indices,
                                      rows,
                                      n_units};
  SparseFeedForwardDecode(pool, step);
  return ffi::Error::Success();
}

#define TERRA_INSTANTIATE(W)                                                                                      \
  template ffi::Error SparseFeedForward<W>(                                                                       \
      ffi::ThreadPool&, const float*, ffi::Span<const int64_t>, const W*, ffi::Span<const int64_t>, const float*, \
      const W*, ffi::Span<const int64_t>, const float*, const float*, ffi::Span<const int64_t>, const W*,         \
      const float*, const W*, const float*, ffi::Span<const int64_t>, ffi::Span<const int64_t>, const float*,     \
      int64_t, float*, int32_t*);
TERRA_INSTANTIATE(int8_t)
TERRA_INSTANTIATE(uint16_t)
#undef TERRA_INSTANTIATE

}  // namespace terra::native

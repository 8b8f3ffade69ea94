// A sparse feed-forward layer's decode step in one call (terra/layers/sparse_feedforward.py).

#ifndef TERRA_BACKENDS_NATIVE_SPARSE_FEEDFORWARD_H_
#define TERRA_BACKENDS_NATIVE_SPARSE_FEEDFORWARD_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// x [B, d]; the controller's C1 [L, d] and C2 [F, L] with its bias [F / N, N]; W1, W2 [F, d]; b2 [d]
// (the scales: int8's, nullptr for bfloat16). Results: y [B, d] and the block choices [B, F / N];
// the intermediates (low [B, L], logits [B, F], mid [B, F / N], the selected rows [B, F / N]) live
// in scratch the call allocates itself. W: int8_t or uint16_t (bfloat16 bits).
template <typename W>
ffi::Error SparseFeedForward(ffi::ThreadPool& pool, const float* x, ffi::Span<const int64_t> x_shape, const W* down,
                             ffi::Span<const int64_t> down_shape, const float* down_scale, const W* up,
                             ffi::Span<const int64_t> up_shape, const float* up_scale, const float* up_bias,
                             ffi::Span<const int64_t> bias_shape, const W* w1, const float* w1_scale, const W* w2,
                             const float* w2_scale, ffi::Span<const int64_t> w_shape,
                             ffi::Span<const int64_t> w2_shape, const float* out_bias, int64_t out_bias_size, float* y,
                             int32_t* indices);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_SPARSE_FEEDFORWARD_H_

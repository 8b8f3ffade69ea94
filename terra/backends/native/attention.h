// A sparse QKV layer's decode step in one call, with the attention over its cache
// (terra/layers/sparse_qkv.py, terra/layers/attention.py).

#ifndef TERRA_BACKENDS_NATIVE_ATTENTION_H_
#define TERRA_BACKENDS_NATIVE_ATTENTION_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// One operand as the sparse attention reads it: its data, shape and element count.
template <typename T>
struct Operand {
  T* data = nullptr;
  ffi::Span<const int64_t> shape;
  int64_t count = 0;
};

// A narrow weight: int8 values with their scale, or bfloat16 bits (W uint16_t, no scale: data nullptr).
template <typename W>
struct NarrowWeight {
  Operand<const W> values;
  Operand<const float> scale;
};

constexpr int kMaxConvolutions = 3;

// The operands and results of one terra_sparse_attention_* call, by name (handlers.cc binds them:
// one handler per weight store, attention mode and number of convolutions).
template <typename W>
struct SparseAttentionOperands {
  enum Mode : int64_t { kNone = 0, kSelf = 1, kCross = 2 };
  int64_t mode = kNone;  // kSelf: Q, K, V the three convolutions; kCross: Q the one convolution
  Operand<const float> x;                           // [B, d]
  NarrowWeight<W> gate;                             // D [S, d] (scale [S])
  NarrowWeight<W> kernel;                           // E [d, M] (scale [d])
  Operand<const float> mult_bias;                   // [S * M]
  Operand<const float> conv_rows;                   // [B, F - 1, S, M]
  int n_convs = 0;                                  // 1 to kMaxConvolutions
  NarrowWeight<W> conv_kernels[kMaxConvolutions];   // [F, k (odd), M, M_out] (scale [F, k, M])
  Operand<const float> conv_biases[kMaxConvolutions];  // [M_out]
  Operand<float> keys, values;                      // kSelf, kCross: [B, S, L, M] (S heads of M)
  Operand<const int32_t> index;                     // kSelf: the write position, s32[]
  Operand<const bool> key_mask;                     // kSelf: [B, L]
  Operand<const float> bias;                        // kCross: the additive encoder bias [B, L]
  // Results.
  float* outs[kMaxConvolutions] = {};  // [B, S, M_out] per convolution
  float* new_rows = nullptr;           // [B, F - 1, S, M] (aliased with conv_rows)
  float* y = nullptr;                  // kSelf, kCross: [B, S * M]
  float* new_keys = nullptr;           // kSelf: [B, S, L, M] (aliased with keys)
  float* new_values = nullptr;         // kSelf: [B, S, L, M] (aliased with values)
};

// The body of the terra_sparse_attention_* handlers (attention.cc). W: int8_t or uint16_t.
template <typename W>
ffi::Error SparseAttention(ffi::ThreadPool& pool, const SparseAttentionOperands<W>& operands);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_ATTENTION_H_

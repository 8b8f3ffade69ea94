// Softmax attention over a whole input in one call (a prefill's, or any long forward's without
// dropout): blocks of queries against tiles of keys with an online softmax, so that no
// [heads, queries, keys] scores are ever held (terra/layers/attention.py, blocked_attention).

#ifndef TERRA_QUANTIZATION_NATIVE_PREFILL_ATTENTION_H_
#define TERRA_QUANTIZATION_NATIVE_PREFILL_ATTENTION_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// Queries per block: one thread's unit of work, whose scores against one key tile stay in L2.
constexpr int64_t kQueryBlock = 64;

// The operands and result of one terra_blocked_attention{,_causal} call.
struct BlockedAttentionOperands {
  const float* q = nullptr;     // [B, H, Lq, Dh], already scaled by Dh^-0.5
  const float* kt = nullptr;    // [B, H, T, Dh, K]: key tile t's keys transposed, keys t*K .. t*K + K - 1
                                // (those past Lk are padding, never read into a result)
  const float* v = nullptr;     // [B, H, Lk, Dh]
  const float* bias = nullptr;  // [B, Lk], added to every query's logits
  int64_t batch = 0, heads = 0, q_length = 0, k_length = 0, dh = 0, tiles = 0, tile = 0;
  bool causal = false;          // key j visible to query i only for j <= i (Lq == Lk)
  float* out = nullptr;         // [B, H, Lq, Dh]
};

// The body of the terra_blocked_attention handlers (prefill_attention.cc).
ffi::Error BlockedAttention(ffi::ThreadPool& pool, const BlockedAttentionOperands& operands);

}  // namespace terra::native

#endif  // TERRA_QUANTIZATION_NATIVE_PREFILL_ATTENTION_H_

// Softmax attention over a whole input in one call (a prefill's, or any long forward's without
// dropout): blocks of queries against tiles of keys with an online softmax, so that no
// [heads, queries, keys] scores are ever held (terra/layers/attention.py, blocked_attention);
// and an LSH layer's attention over its sorted chunks, each with its adjacent ones.

#ifndef TERRA_BACKENDS_NATIVE_PREFILL_ATTENTION_H_
#define TERRA_BACKENDS_NATIVE_PREFILL_ATTENTION_H_

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

// The operands and results of one terra_lsh_chunk_attention call: an LSH layer's attention over its
// sorted entries (terra/layers/lsh_chunked_attention.py, lsh_attention), each chunk of C entries attending
// to its own chunk and the `before` previous and `after` next ones, cyclically, with the layer's
// masks: a key that is the query's own position (and real) gets kSelfLogit added, a later one
// (causal) or a padding key kMaskLogit.
constexpr float kSelfLogit = -1e5f;
constexpr float kMaskLogit = -1e9f;
struct LshChunkOperands {  // C a multiple of 16
  const float* q = nullptr;        // [B, H, N, C, Dh] sorted queries (unscaled)
  const float* kt = nullptr;       // [B, H, N, Dh, C] sorted keys (length-normalised, scaled by Dh^-0.5),
                                   // each chunk's transposed
  const float* v = nullptr;        // [B, H, N, C, Dh] sorted values
  const int32_t* pos = nullptr;    // [B, H, N, C] each sorted entry's position
  const int32_t* valid = nullptr;  // [B, H, N, C] 1 for a real key, 0 for padding
  int64_t rows = 0, chunks = 0, chunk = 0, dh = 0, before = 0, after = 0;  // rows = B * H
  bool causal = false;
  float* out = nullptr;  // [B, H, N, C, Dh] softmax-weighted values
  float* lse = nullptr;  // [B, H, N, C] log of the softmax's normaliser (its logsumexp)
};

ffi::Error LshChunkAttention(ffi::ThreadPool& pool, const LshChunkOperands& operands);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_PREFILL_ATTENTION_H_

// An LSH self-attention layer's decode-step attention in one call (terra/layers/lsh_attention.py):
// the choice of past keys from its per-bucket position lists, and the softmax over those keys' rows
// of the cache, read where they lie.

#ifndef TERRA_BACKENDS_NATIVE_LSH_ATTENTION_H_
#define TERRA_BACKENDS_NATIVE_LSH_ATTENTION_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// Hash rounds a call takes (the layer's n_hashes; the reference uses 1 to 8).
constexpr int64_t kMaxLshRounds = 8;

// The operands and results of one terra_lsh_decode_attention_* call; T the cache's element
// (float, int8_t with a float scale per row, or uint16_t bfloat16 bits).
template <typename T>
struct LshDecodeOperands {
  const float* q = nullptr;            // [B, H, Dh], already scaled by Dh^-0.5
  const T* keys = nullptr;             // [B, H, L, Dh] (length-normalised keys)
  const float* key_scale = nullptr;    // int8: [B, H, L]; else nullptr
  const T* values = nullptr;           // [B, H, L, Dh]
  const float* value_scale = nullptr;  // int8: [B, H, L]; else nullptr
  const int32_t* buckets = nullptr;    // [B, H, R, L]: each cached position's bucket per round, -1 none
  const int32_t* lists = nullptr;      // [B, H, R, NB, C]: per bucket, ring buffer of its latest positions
  const int32_t* counts = nullptr;     // [B, H, R, NB]: positions ever appended per bucket
  const int32_t* recent = nullptr;     // [B, C]: ring buffer of the latest real positions
  const int32_t* recent_count = nullptr;  // [B]
  const int32_t* q_buckets = nullptr;  // [B, H, R]: the query's buckets, -1 a padded query
  int64_t batch = 0, heads = 0, length = 0, dh = 0, rounds = 0, n_buckets = 0, capacity = 0;
  // Results, per (b, h): out [B, H, Dh] = sum_j exp(l_j - top) v_j, top [B, H] = max_j l_j
  // (-1e30 when no key is kept), total [B, H] = sum_j exp(l_j - top).
  float* out = nullptr;
  float* top = nullptr;
  float* total = nullptr;
};

// The body of the terra_lsh_decode_attention_* handlers (lsh_attention.cc).
template <typename T>
ffi::Error LshDecodeAttention(ffi::ThreadPool& pool, const LshDecodeOperands<T>& operands);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_LSH_ATTENTION_H_

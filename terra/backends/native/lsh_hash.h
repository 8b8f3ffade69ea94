// An LSH layer's angular hash of a whole sequence in one call (terra/layers/lsh_hashing.py,
// hash_vectors): each vector's product with its head's random rotations and, per hash round and
// bucket factor, the signed argmax, combined mixed-radix into the bucket id.

#ifndef TERRA_BACKENDS_NATIVE_LSH_HASH_H_
#define TERRA_BACKENDS_NATIVE_LSH_HASH_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// Bucket factors a call takes (the reference factorises into at most 2).
constexpr int64_t kMaxLshFactors = 4;

// The operands and result of one terra_lsh_hash call.
struct LshHashOperands {
  const float* vecs = nullptr;       // [B, H, L, D]
  const float* rotations = nullptr;  // [H, D, W]: head h's rotations, column r * K + k of round r
                                     // (K = sum(factors) / 2), W >= R * K a multiple of 16 (zero padded)
  int64_t batch = 0, heads = 0, length = 0, depth = 0, width = 0, rounds = 0;
  int64_t factors[kMaxLshFactors] = {};
  int64_t n_factors = 0;
  int32_t* buckets = nullptr;  // [B, H, R, L]: sum_f radix_f * argmax([x R_f, -x R_f]), radix_f the
                               // product of the factors before f; the first index of the maximum,
                               // NaN counting as the maximum (jnp.argmax's rule)
};

ffi::Error LshHash(ffi::ThreadPool& pool, const LshHashOperands& operands);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_LSH_HASH_H_

// A sparse QKV layer's decode step in one call, with the attention over its cache
// (terra/layers/sparse_qkv.py, terra/layers/attention.py).

#ifndef TERRA_QUANTIZATION_NATIVE_ATTENTION_H_
#define TERRA_QUANTIZATION_NATIVE_ATTENTION_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// The handler terra_sparse_attention: `attention` 0 (none), 1 (self) or 2 (cross); the operands
// and results as attention.cc lists them.
ffi::Error SparseAttention(ffi::ThreadPool pool, int64_t attention, ffi::RemainingArgs args, ffi::RemainingRets rets);

}  // namespace terra::native

#endif  // TERRA_QUANTIZATION_NATIVE_ATTENTION_H_

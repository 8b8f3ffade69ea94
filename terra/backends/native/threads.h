// Splitting a call's work between the calling thread and XLA's intra-op thread pool
// (Ctx<ThreadPool>): no second pool competes with XLA's threads.
//
// A call's work is one or more phases run in order (a fused layer's chain of products, each
// needing the last one's output), each cut into chunks that every participant claims from one
// atomic counter, so a helper that starts late (a sleeping pool thread is slow to wake, next to
// a call's length) simply finds fewer chunks left: the caller never waits for a helper to start,
// only for chunks already claimed to finish.

#ifndef TERRA_BACKENDS_NATIVE_THREADS_H_
#define TERRA_BACKENDS_NATIVE_THREADS_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// Below this many weight bytes a product runs on the calling thread alone: waking a helper costs
// more than it saves.
constexpr int64_t kParallelBytes = 256 << 10;
// Bytes of weights per chunk: small enough to balance two threads, large enough that claiming one
// (an atomic add) costs nothing next to streaming it.
constexpr int64_t kChunkBytes = 64 << 10;

// Threads that share a parallel call's chunks: the caller and its pool helpers, one per other core.
int64_t Workers(ffi::ThreadPool& pool);

// Runs run(phase, chunk) for the chunks of every phase in order (at most 4 phases, `chunks[p]` of
// phase p); `parallel`: share them with pool helpers.
void RunPhases(ffi::ThreadPool& pool, bool parallel, std::initializer_list<int64_t> chunks,
               std::function<void(int, int64_t)> run);

// Runs range(begin, end) over [0, n) in chunks of `chunk` on the calling thread and the pool, or
// at once on the calling thread when `work_bytes` is too little to share.
template <typename Range>
void Chunked(ffi::ThreadPool& pool, int64_t n, int64_t chunk, int64_t work_bytes, Range range) {
  if (work_bytes < kParallelBytes || n <= chunk) return range(0, n);
  RunPhases(pool, true, {(n + chunk - 1) / chunk},
            [&](int, int64_t c) { range(c * chunk, std::min(n, (c + 1) * chunk)); });
}

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_THREADS_H_

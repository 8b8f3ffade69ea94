// The cache attention handler (cache_attention.h): each (batch row, head) of a decode step's query
// against the visible rows of its cache, the heads shared between the pool's threads.

#include "cache_attention.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "threads.h"

namespace terra::native {

template <typename T>
ffi::Error CacheAttention(ffi::ThreadPool& pool, const CacheAttentionOperands<T>& a) {
  const int isa = ActiveIsa();
  const int64_t rows = a.batch * a.heads, L = a.length, dh = a.dh;
  const int64_t visible = std::clamp<int64_t>(a.visible, 0, L);
  const int64_t work_bytes = rows * visible * dh * static_cast<int64_t>(2 * sizeof(T));
  Chunked(pool, rows, 1, work_bytes, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA {
      using I = decltype(tag);
      for (int64_t r = begin; r < end; ++r) {
        CachedRows<T> c;
        c.keys = a.keys + r * L * dh, c.values = a.values + r * L * dh;
        c.key_scale = a.key_scale ? a.key_scale + r * L : nullptr;
        c.value_scale = a.value_scale ? a.value_scale + r * L : nullptr;
        c.bias = a.bias + (r / a.heads) * L;
        c.visible = visible, c.dh = dh;
        const SoftmaxTerms terms = AttendCachedRows<I>(a.q + r * dh, c, a.out + r * dh, buffer);
        a.top[r] = terms.top, a.total[r] = terms.total;
      }
    });
  });
  return ffi::Error::Success();
}

template ffi::Error CacheAttention<float>(ffi::ThreadPool&, const CacheAttentionOperands<float>&);
template ffi::Error CacheAttention<int8_t>(ffi::ThreadPool&, const CacheAttentionOperands<int8_t>&);
template ffi::Error CacheAttention<uint16_t>(ffi::ThreadPool&, const CacheAttentionOperands<uint16_t>&);

}  // namespace terra::native

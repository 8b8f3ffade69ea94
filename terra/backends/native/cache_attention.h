// A decode step's attention over a whole KV cache: one query per (batch row, head) against every
// visible position's key and value, stored float32, int8 (one float32 scale per row) or bfloat16
// bits (terra/backends/decode_state.py). The row-level core, AttendCachedRows, is inlined into each
// instruction set's function (isa.h) by three callers: the cache attention handler
// (terra_cache_attention_*, cache_attention.cc: a dense layer's self- and cross-attention step, and
// a sparse QKV step over a narrow cache), the fused sparse attention step (attention.cc), and an
// LSH step over the positions its buckets keep (lsh_attention.cc), which the core reads as a list.
//
// Why native: a step over a long context is a read of the cache, so its time is the cache's bytes
// at the memory's rate, if the arithmetic keeps up. XLA:CPU reads a narrow cache through widened
// float32 blocks written to memory, far more bytes than the cache holds (docs/decode_speed.md,
// "Long documents"); here each row is widened in registers as it is read. The
// keys' dots are taken a vector-width of rows at a time and reduced together (one transpose-and-add
// tree for 16 rows on AVX-512, not 16 reductions), the exponentials 16 lanes at a time, and the
// weighted sum of values keeps its accumulators in registers.

#ifndef TERRA_BACKENDS_NATIVE_CACHE_ATTENTION_H_
#define TERRA_BACKENDS_NATIVE_CACHE_ATTENTION_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "isa.h"
#include "softmax.h"
#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// XLA's MASK_VALUE (terra/backends/xla.py): a hidden position's logit gets it added, as the layer's
// bias adds it, so that a query whose every position is hidden averages them as XLA's softmax does.
constexpr float kCacheMaskLogit = -1e9f;
// The top logit reported when no position is visible: exp(kNoLogit - any real logit) is 0.
constexpr float kNoLogit = -1e30f;
// The largest head size the kernels take (their accumulators are arrays of this many floats).
constexpr int64_t kMaxCacheHeadSize = 512;

// One (batch row, head)'s cache as the core reads it.
template <typename T>
struct CachedRows {
  const T* keys = nullptr;             // [L, Dh]
  const float* key_scale = nullptr;    // int8: [L]; else nullptr
  const T* values = nullptr;           // [L, Dh]
  const float* value_scale = nullptr;  // int8: [L]; else nullptr
  const float* bias = nullptr;         // [L] added to the logits, or nullptr
  const bool* key_mask = nullptr;      // [L]: false adds kCacheMaskLogit; or nullptr
  int64_t visible = 0;                 // rows [0, visible) are attended to; the rest are not read
  int64_t dh = 0;                      // 1 to kMaxCacheHeadSize
  // The positions to read instead, `visible` of them (an LSH step's kept keys), each in [0, L);
  // nullptr: positions 0 .. visible - 1.
  const int32_t* rows = nullptr;

  TERRA_INLINE int64_t Row(int64_t j) const { return rows ? rows[j] : j; }
};

// The softmax's running terms over the visible rows j with logits l_j: top = max l_j (kNoLogit if
// none), total = sum exp(l_j - top); the caller's y holds sum exp(l_j - top) v_j.
struct SoftmaxTerms {
  float top = kNoLogit;
  float total = 0.0f;
};

namespace cache_attention {

// A row's elements as float32 vectors: loaded, or widened in registers.
template <typename I>
TERRA_INLINE typename I::Vec Wide(const float* p) {
  return I::Load(p);
}
template <typename I, typename W>
TERRA_INLINE typename I::Vec Wide(const W* p) {
  return I::Widen(p);
}
template <typename I>
TERRA_INLINE typename I::Vec Wide(const float* p, int64_t m) {
  return I::Load(p, m);
}
template <typename I, typename W>
TERRA_INLINE typename I::Vec Wide(const W* p, int64_t m) {
  return I::Widen(p, m);
}

// Bytes ahead of contiguous rows being read that are asked for (PrefetchLine): the hardware's
// stream prefetcher stops at each 4 KiB page, which a float32 cache crosses every 16 rows.
#ifndef TERRA_CACHE_PREFETCH_BYTES
#define TERRA_CACHE_PREFETCH_BYTES 8192
#endif
constexpr int64_t kPrefetchBytes = TERRA_CACHE_PREFETCH_BYTES;

// Rows ahead of the ones being read that are asked for when the rows are a list of positions
// (enough to cover a memory latency at the rate the rows are consumed).
constexpr int64_t kPrefetchRows = 16;

// Asks for the lines of [start, start + bytes).
TERRA_INLINE void PrefetchBytes(uintptr_t start, int64_t bytes) {
  for (uintptr_t line = start & ~uintptr_t{63}; line < start + bytes; line += 64) PrefetchLine(line);
}

// Asks for what rows [j, j + count) will read, that far ahead: contiguous rows kPrefetchBytes
// ahead, a list's rows kPrefetchRows ahead (with their scales).
template <typename T>
TERRA_INLINE void PrefetchRows(const CachedRows<T>& c, const T* base, const float* scale, int64_t j, int64_t count) {
  const int64_t row_bytes = c.dh * static_cast<int64_t>(sizeof(T));
  if (!c.rows) {
    if (kPrefetchBytes > 0) PrefetchBytes(reinterpret_cast<uintptr_t>(base + j * c.dh) + kPrefetchBytes, count * row_bytes);
    return;
  }
  const int64_t end = std::min(j + count + kPrefetchRows, c.visible);
  for (int64_t a = j + kPrefetchRows; a < end; ++a) {
    PrefetchBytes(reinterpret_cast<uintptr_t>(base + c.rows[a] * c.dh), row_bytes);
    if (scale) PrefetchLine(reinterpret_cast<uintptr_t>(scale + c.rows[a]));
  }
}

// Vectors per row: NV full vectors (a compile-time count, so the accumulators stay in registers),
// or with NV = 0 `full` of them (a run-time count) and a tail of `tail` lanes.
template <typename I, int NV>
struct RowShape {
  int64_t full, tail;
  TERRA_INLINE int64_t Full() const { return NV > 0 ? NV : full; }
};

// logits[l] = q . keys[l] (times its scale, plus the bias and mask terms) for l < visible.
template <typename I, int NV, typename T>
TERRA_INLINE void Logits(const float* q, const CachedRows<T>& c, RowShape<I, NV> shape, float* logits) {
  using Vec = typename I::Vec;
  constexpr int64_t W = I::kWidth;
  constexpr int64_t kMaxVectors = kMaxCacheHeadSize / W + 1;
  constexpr int64_t R = I::kTransposedSums ? W : 4;  // rows per block
  const int64_t dh = c.dh, n = c.visible, full = shape.Full(), tail = shape.tail;
  Vec qv[NV > 0 ? NV : kMaxVectors];
  for (int64_t v = 0; v < full; ++v) qv[v] = I::Load(q + v * W);
  Vec q_tail = I::Zero();
  if (NV == 0 && tail > 0) q_tail = I::Load(q + full * W, tail);
  int64_t l = 0;
  for (; l + R <= n; l += R) {
    PrefetchRows(c, c.keys, c.key_scale, l, R);
    const T* k[R];
    for (int64_t r = 0; r < R; ++r) k[r] = c.keys + c.Row(l + r) * dh;
    Vec acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = I::Zero();
    // Row after row, as they lie in memory: R independent chains of multiply-adds.
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < full; ++v) acc[r] = I::Fma(qv[v], Wide<I>(k[r] + v * W), acc[r]);
    if (NV == 0 && tail > 0)
      for (int64_t r = 0; r < R; ++r) acc[r] = I::Fma(q_tail, Wide<I>(k[r] + full * W, tail), acc[r]);
    if constexpr (I::kTransposedSums) {
      I::Store(logits + l, I::SumsOfWidth(acc));
    } else {
      for (int64_t r = 0; r < R; ++r) logits[l + r] = I::Sum(acc[r]);
    }
  }
  for (; l < n; ++l) {
    const T* k = c.keys + c.Row(l) * dh;
    Vec acc = I::Zero();
    for (int64_t v = 0; v < full; ++v) acc = I::Fma(qv[v], Wide<I>(k + v * W), acc);
    if (NV == 0 && tail > 0) acc = I::Fma(q_tail, Wide<I>(k + full * W, tail), acc);
    logits[l] = I::Sum(acc);
  }
  // q . (s K) = s (q . K), then the bias and the mask, in the order XLA's form adds them.
  if (c.key_scale)
    for (int64_t j = 0; j < n; ++j) logits[j] *= c.key_scale[c.Row(j)];
  if (c.bias)
    for (int64_t j = 0; j < n; ++j) logits[j] += c.bias[c.Row(j)];
  if (c.key_mask)
    for (int64_t j = 0; j < n; ++j) logits[j] += c.key_mask[c.Row(j)] ? 0.0f : kCacheMaskLogit;
}

// y = sum_j w[j] values[j] (times its scale) for j < n, two rows at a time into two sets of
// accumulators (each multiply-add waits on its accumulator's last).
template <typename I, int NV, typename T>
TERRA_INLINE void WeightedValues(const float* w, const CachedRows<T>& c, int64_t n, RowShape<I, NV> shape, float* y) {
  using Vec = typename I::Vec;
  constexpr int64_t W = I::kWidth;
  constexpr int64_t kMaxVectors = kMaxCacheHeadSize / W + 1;
  const int64_t dh = c.dh, full = shape.Full(), tail = shape.tail;
  Vec even[NV > 0 ? NV : kMaxVectors], odd[NV > 0 ? NV : kMaxVectors];
  for (int64_t v = 0; v < full; ++v) even[v] = odd[v] = I::Zero();
  Vec even_tail = I::Zero(), odd_tail = I::Zero();
  const T* values = c.values;
  const float* scale = c.value_scale;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const int64_t p0 = c.Row(j), p1 = c.Row(j + 1);
    const Vec w0 = I::Broadcast(scale ? w[j] * scale[p0] : w[j]);
    const Vec w1 = I::Broadcast(scale ? w[j + 1] * scale[p1] : w[j + 1]);
    const T* v0 = values + p0 * dh;
    const T* v1 = values + p1 * dh;
    PrefetchRows(c, values, scale, j, 2);
    for (int64_t v = 0; v < full; ++v) {
      even[v] = I::Fma(w0, Wide<I>(v0 + v * W), even[v]);
      odd[v] = I::Fma(w1, Wide<I>(v1 + v * W), odd[v]);
    }
    if (NV == 0 && tail > 0) {
      even_tail = I::Fma(w0, Wide<I>(v0 + full * W, tail), even_tail);
      odd_tail = I::Fma(w1, Wide<I>(v1 + full * W, tail), odd_tail);
    }
  }
  if (j < n) {
    const int64_t p0 = c.Row(j);
    const Vec w0 = I::Broadcast(scale ? w[j] * scale[p0] : w[j]);
    const T* v0 = values + p0 * dh;
    for (int64_t v = 0; v < full; ++v) even[v] = I::Fma(w0, Wide<I>(v0 + v * W), even[v]);
    if (NV == 0 && tail > 0) even_tail = I::Fma(w0, Wide<I>(v0 + full * W, tail), even_tail);
  }
  for (int64_t v = 0; v < full; ++v) {
    const Vec sum = even[v] + odd[v];
    I::Store(y + v * W, sum);
  }
  if (NV == 0 && tail > 0) {
    const Vec sum = even_tail + odd_tail;
    float lanes[W];
    I::Store(lanes, sum);
    std::copy(lanes, lanes + tail, y + full * W);
  }
}

template <typename I, int NV, typename T>
TERRA_INLINE SoftmaxTerms Attend(const float* q, const CachedRows<T>& c, float* y, std::vector<float>& buffer) {
  const int64_t n = c.visible;
  const RowShape<I, NV> shape{c.dh / I::kWidth, NV > 0 ? 0 : c.dh % I::kWidth};
  if (n <= 0) {
    std::fill(y, y + c.dh, 0.0f);
    return {};
  }
  buffer.resize(static_cast<size_t>(n));
  float* logits = buffer.data();
  Logits<I, NV>(q, c, shape, logits);
  SoftmaxTerms terms;
  terms.top = RowMax<I>(logits, n);
  terms.total = ExpAndSum<I>(logits, n, terms.top);  // logits[j] = exp(l_j - top)
  WeightedValues<I, NV>(logits, c, n, shape, y);
  return terms;
}

}  // namespace cache_attention

// One query q [Dh] (already scaled by Dh^-0.5) against the visible rows of one (batch row, head)'s
// cache: y [Dh] = sum_j exp(l_j - top) v_j, and the terms (top, total) for the caller to join with
// other keys (the query's own) and normalise. `buffer`: the caller's scratch for the logits.
template <typename I, typename T>
TERRA_INLINE SoftmaxTerms AttendCachedRows(const float* q, const CachedRows<T>& c, float* y,
                                           std::vector<float>& buffer) {
  using namespace cache_attention;
  if (c.dh % I::kWidth == 0) {
    switch (c.dh / I::kWidth) {
      case 1: return Attend<I, 1>(q, c, y, buffer);
      case 2: return Attend<I, 2>(q, c, y, buffer);
      case 4: return Attend<I, 4>(q, c, y, buffer);
      case 6: return Attend<I, 6>(q, c, y, buffer);
      case 8: return Attend<I, 8>(q, c, y, buffer);
      default: break;
    }
  }
  return Attend<I, 0>(q, c, y, buffer);
}

// The operands and results of one terra_cache_attention_* call; T the cache's element (float,
// int8_t with a float scale per row, or uint16_t bfloat16 bits).
template <typename T>
struct CacheAttentionOperands {
  const float* q = nullptr;            // [B, H, Dh], already scaled by Dh^-0.5
  const T* keys = nullptr;             // [B, H, L, Dh]
  const float* key_scale = nullptr;    // int8: [B, H, L]; else nullptr
  const T* values = nullptr;           // [B, H, L, Dh]
  const float* value_scale = nullptr;  // int8: [B, H, L]; else nullptr
  const float* bias = nullptr;         // [B, L] added to every head's logits
  int64_t batch = 0, heads = 0, length = 0, dh = 0;
  int64_t visible = 0;                 // positions [0, visible) are attended to (clamped to [0, L])
  // Results, per (b, h): out [B, H, Dh] = sum_j exp(l_j - top) v_j, top [B, H], total [B, H].
  float* out = nullptr;
  float* top = nullptr;
  float* total = nullptr;
};

// The body of the terra_cache_attention_* handlers (cache_attention.cc).
template <typename T>
ffi::Error CacheAttention(ffi::ThreadPool& pool, const CacheAttentionOperands<T>& operands);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_CACHE_ATTENTION_H_

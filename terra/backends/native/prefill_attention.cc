// Blocked softmax attention (prefill_attention.h): each thread takes blocks of kQueryBlock queries of
// one (batch row, head) and walks the key tiles, holding the block's scores against one tile, its
// running maxima and sums, and its float32 output rows (the online softmax of long-context
// prefill). Why native: XLA:CPU runs the query-chunked form as a product that writes a chunk's
// [heads, chunk, keys] scores to memory, a separate exponential pass and a second product, far
// below the rate of its small products (docs/decode_speed.md, "Long documents"); here the scores
// never leave L2, and a causal block stops at its last query's key.

#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "isa.h"
#include "softmax.h"
#include "tile_products.h"
#include "threads.h"

namespace terra::native {

namespace {

// One block of queries of one (batch row, head): `item` = (b * H + h) * blocks + block.
template <typename I>
TERRA_INLINE void AttendBlock(const BlockedAttentionOperands& a, int64_t item, std::vector<float>& buffer) {
  const int64_t dh = a.dh, K = a.tile, Lq = a.q_length, Lk = a.k_length;
  const int64_t blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  const int64_t bh = item / blocks, q0 = (item % blocks) * kQueryBlock;
  const int64_t nq = std::min(kQueryBlock, Lq - q0);
  const float* q = a.q + (bh * Lq + q0) * dh;
  const float* kt = a.kt + bh * a.tiles * dh * K;
  const float* v = a.v + bh * Lk * dh;
  const float* bias = a.bias + (bh / a.heads) * Lk;
  buffer.resize(static_cast<size_t>(kQueryBlock * (K + dh + 2)));
  float* s = buffer.data();              // [nq, K] scores, then weights
  float* o = s + kQueryBlock * K;        // [nq, dh] unnormalised outputs
  float* top = o + kQueryBlock * dh;     // [nq] running maxima
  float* total = top + kQueryBlock;      // [nq] running sums
  std::fill(o, o + nq * dh, 0.0f);
  std::fill(top, top + nq, -std::numeric_limits<float>::infinity());
  std::fill(total, total + nq, 0.0f);
  // A causal block sees no key past its last query.
  const int64_t key_end = a.causal ? std::min(Lk, q0 + nq) : Lk;
  for (int64_t k0 = 0, t = 0; k0 < key_end; k0 += K, ++t) {
    const int64_t nk = std::min(K, key_end - k0);
    const int64_t width = (nk + I::kWidth - 1) / I::kWidth * I::kWidth;  // <= K: K is a multiple of 64
    Product<I>({q, dh, kt + t * dh * K, K, s, K, dh, false}, nq, width);
    for (int64_t r = 0; r < nq; ++r) {
      float* row = s + r * K;
      const int64_t visible = a.causal ? std::clamp<int64_t>(q0 + r - k0 + 1, 0, nk) : nk;
      for (int64_t j = 0; j < visible; ++j) row[j] += bias[k0 + j];
      std::fill(row + visible, row + nk, 0.0f);
      if (visible == 0) continue;
      const float new_top = std::max(top[r], RowMax<I>(row, visible));
      const float shrink = std::exp(top[r] - new_top);  // 0 on the first tile (top = -inf)
      total[r] = total[r] * shrink + ExpAndSum<I>(row, visible, new_top);
      if (shrink != 1.0f)
        for (int64_t d = 0; d < dh; ++d) o[r * dh + d] *= shrink;
      top[r] = new_top;
    }
    Product<I>({s, K, v + k0 * dh, dh, o, dh, nk, true}, nq, dh);
  }
  float* out = a.out + (bh * Lq + q0) * dh;
  for (int64_t r = 0; r < nq; ++r) {
    const float inverse = 1.0f / total[r];
    for (int64_t d = 0; d < dh; ++d) out[r * dh + d] = o[r * dh + d] * inverse;
  }
}

// logits[j] += the layer's mask for the query at position `q` and keys at k_pos[j] (k_valid[j] 1
// for a real key), j < n, in the layer's order (_mask_bias): the self term, the causal one, padding.
template <typename I>
TERRA_INLINE void AddMaskBias(int32_t q, const int32_t* k_pos, const int32_t* k_valid, int64_t n, bool causal,
                              float* logits) {
  constexpr int64_t N = I::kSelectLanes;
  using F = typename SelectLanes<N>::Float;
  using Int = typename SelectLanes<N>::Int32;
  const Int query = Int{} + q;
  const F self = F{} + kSelfLogit, masked = F{} + kMaskLogit, zero = {};
  int64_t j = 0;
  for (; j + N <= n; j += N) {
    Int positions, valid;
    F row;
    std::memcpy(&positions, k_pos + j, sizeof positions);
    std::memcpy(&valid, k_valid + j, sizeof valid);
    std::memcpy(&row, logits + j, sizeof row);
    const auto real = valid != 0;
    F bias = (positions == query) & real ? self : zero;
    if (causal) bias += query < positions ? masked : zero;
    bias += real ? zero : masked;
    row += bias;
    std::memcpy(logits + j, &row, sizeof row);
  }
  for (; j < n; ++j) {
    float bias = (q == k_pos[j] && k_valid[j]) ? kSelfLogit : 0.0f;
    if (causal) bias += q < k_pos[j] ? kMaskLogit : 0.0f;
    bias += k_valid[j] ? 0.0f : kMaskLogit;
    logits[j] += bias;
  }
}

// One chunk n of one (batch row, head) of an LSH layer: `item` = row * N + n.
template <typename I>
TERRA_INLINE void AttendChunk(const LshChunkOperands& a, int64_t item, std::vector<float>& buffer) {
  const int64_t dh = a.dh, L = a.chunk, N = a.chunks, row = item / N, n = item % N;
  const int64_t segments = a.before + 1 + a.after, width = segments * L;
  buffer.resize(static_cast<size_t>(L * width));
  float* s = buffer.data();  // [L, width]: logits, then weights
  const int64_t base = row * N;  // chunk index of (row, 0)
  auto window_chunk = [&](int64_t w) { return base + ((n - a.before + w) % N + N) % N; };
  const float* q = a.q + (base + n) * L * dh;
  // Each segment's keys are their chunk's [Dh, C] transposed keys: the scores against segment w
  // fill columns [w C, (w + 1) C) of s.
  for (int64_t w = 0; w < segments; ++w)
    Product<I>({q, dh, a.kt + window_chunk(w) * dh * L, L, s + w * L, width, dh, false}, L, L);
  const int32_t* q_pos = a.pos + (base + n) * L;
  float* lse = a.lse + (base + n) * L;
  for (int64_t r = 0; r < L; ++r) {
    float* logits = s + r * width;
    for (int64_t w = 0; w < segments; ++w) {
      const int64_t m = window_chunk(w);
      const int32_t* k_pos = a.pos + m * L;
      const int32_t* k_valid = a.valid + m * L;
      float* part = logits + w * L;
      AddMaskBias<I>(q_pos[r], k_pos, k_valid, L, a.causal, part);
    }
    const float top = RowMax<I>(logits, width);
    const float total = ExpAndSum<I>(logits, width, top);
    lse[r] = top + std::log(total);
    const float inverse = 1.0f / total;
    for (int64_t j = 0; j < width; ++j) logits[j] *= inverse;
  }
  float* out = a.out + (base + n) * L * dh;
  std::fill(out, out + L * dh, 0.0f);
  for (int64_t w = 0; w < segments; ++w)
    Product<I>({s + w * L, width, a.v + window_chunk(w) * L * dh, dh, out, dh, L, true}, L, dh);
}

}  // namespace

ffi::Error LshChunkAttention(ffi::ThreadPool& pool, const LshChunkOperands& a) {
  const int isa = ActiveIsa();
  const int64_t items = a.rows * a.chunks;
  Chunked(pool, items, 1, items > 1 ? kParallelBytes : 0, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA {
      for (int64_t item = begin; item < end; ++item) AttendChunk<decltype(tag)>(a, item, buffer);
    });
  });
  return ffi::Error::Success();
}

ffi::Error BlockedAttention(ffi::ThreadPool& pool, const BlockedAttentionOperands& a) {
  const int isa = ActiveIsa();
  const int64_t blocks = (a.q_length + kQueryBlock - 1) / kQueryBlock;
  const int64_t items = a.batch * a.heads * blocks;
  // Each item reads every key and value row of its head: always worth sharing beyond one item.
  const int64_t work_bytes = items > 1 ? kParallelBytes : 0;
  Chunked(pool, items, 1, work_bytes, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA {
      for (int64_t item = begin; item < end; ++item) AttendBlock<decltype(tag)>(a, item, buffer);
    });
  });
  return ffi::Error::Success();
}

}  // namespace terra::native

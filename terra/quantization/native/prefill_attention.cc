// Blocked softmax attention (prefill_attention.h): each thread takes blocks of kQueryBlock queries of
// one (batch row, head) and walks the key tiles, holding the block's scores against one tile, its
// running maxima and sums, and its float32 output rows (the online softmax of long-context
// prefill). Why native: XLA:CPU runs the query-chunked form as a product that writes a chunk's
// [heads, chunk, keys] scores to memory, a separate exponential pass and a second product, about
// 50 GFLOP/s on a 2-core VM where its small products reach 229 (docs/decode_speed.md, "Long
// documents"); here the scores never leave L2, and a causal block stops at its last query's key.

#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "isa.h"
#include "softmax.h"
#include "threads.h"

namespace terra::native {

namespace {

// Both products of attention, scores = q k^T (k transposed) and out += weights v, are one product
// c [rows, width] (+)= a [rows, depth] b [depth, width], computed in register tiles of R rows of a by
// C vectors of b's columns: each step broadcasts R entries of a and multiplies them into C vectors
// of one row of b.
template <typename I>
constexpr int kTileVectors = I::kIsa == kAvx512 ? 4 : 2;
constexpr int kTileRows = 4;

// Rows of a, b and c `*_stride` apart; `accumulate`: add to c rather than overwrite it.
struct ProductOperands {
  const float* a;
  int64_t a_stride;
  const float* b;
  int64_t b_stride;
  float* c;
  int64_t c_stride;
  int64_t depth;
  bool accumulate;
};

// c[r, j0 + l] for r < R, l < C W.
template <typename I, int R, int C>
TERRA_INLINE void ProductTile(const ProductOperands& m, int64_t row, int64_t j0) {
  constexpr int64_t W = I::kWidth;
  const float* a = m.a + row * m.a_stride;
  float* c = m.c + row * m.c_stride + j0;
  typename I::Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) acc[r][v] = m.accumulate ? I::Load(c + r * m.c_stride + v * W) : I::Zero();
  for (int64_t t = 0; t < m.depth; ++t) {
    typename I::Vec b[C];
    for (int v = 0; v < C; ++v) b[v] = I::Load(m.b + t * m.b_stride + j0 + v * W);
    for (int r = 0; r < R; ++r) {
      const typename I::Vec ar = I::Broadcast(a[r * m.a_stride + t]);
      for (int v = 0; v < C; ++v) acc[r][v] = I::Fma(ar, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) I::Store(c + r * m.c_stride + v * W, acc[r][v]);
}

template <typename I, int R>
TERRA_INLINE void ProductRows(const ProductOperands& m, int64_t row, int64_t width) {
  constexpr int C = kTileVectors<I>;
  constexpr int64_t span = C * I::kWidth;
  int64_t j0 = 0;
  for (; j0 + span <= width; j0 += span) ProductTile<I, R, C>(m, row, j0);
  for (; j0 < width; j0 += I::kWidth) ProductTile<I, R, 1>(m, row, j0);
}

// The product over `rows` rows of a and `width` columns of b (a multiple of the vector width).
template <typename I>
TERRA_INLINE void Product(const ProductOperands& m, int64_t rows, int64_t width) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) ProductRows<I, kTileRows>(m, r, width);
  for (; r < rows; ++r) ProductRows<I, 1>(m, r, width);
}

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
      const float new_top = std::max(top[r], RowMax(row, visible));
      const float shrink = std::exp(top[r] - new_top);  // 0 on the first tile (top = -inf)
      total[r] = total[r] * shrink + ExpAndSum(row, visible, new_top);
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
TERRA_INLINE void AddMaskBias(int32_t q, const int32_t* k_pos, const int32_t* k_valid, int64_t n, bool causal,
                              float* logits) {
  const Int32Lanes query = Int32Lanes{} + q;
  const Lanes self = Lanes{} + kSelfLogit, masked = Lanes{} + kMaskLogit, zero = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Int32Lanes positions, valid;
    std::memcpy(&positions, k_pos + j, sizeof positions);
    std::memcpy(&valid, k_valid + j, sizeof valid);
    const auto real = valid != 0;
    Lanes bias = (positions == query) & real ? self : zero;
    if (causal) bias += query < positions ? masked : zero;
    bias += real ? zero : masked;
    StoreLanes(logits + j, LoadLanes(logits + j) + bias);
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
      AddMaskBias(q_pos[r], k_pos, k_valid, L, a.causal, part);
    }
    const float top = RowMax(logits, width);
    const float total = ExpAndSum(logits, width, top);
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

// The LSH decode-attention handler: for each (batch row, head), the keys the layer's rule keeps
// (terra/layers/lsh_attention.py, select_from_bucket_lists: those sharing the query's bucket in any
// hash round, newest first, then the newest others, n_keep = C in all) and the softmax-weighted sum
// of their values, with each kept row of the cache read once where it lies.
//
// Why in one native call: the rule is a merge of sorted lists, which XLA can only express as a
// ranking (a bisection over every candidate), and XLA's gather of the kept rows costs several times
// the rows' bytes; here the rows are prefetched a few positions ahead of their use and the heads are
// shared between the pool's threads (docs/architecture.md, "Long inputs").

#include "lsh_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "threads.h"

namespace terra::native {

namespace {

// Rows prefetched ahead of the one being read: enough to cover a memory latency at the rate the
// rows are consumed (a 64-wide dot and axpy per row).
constexpr int64_t kPrefetchAhead = 8;
constexpr float kNoKey = -1e30f;

TERRA_INLINE void PrefetchRow(const void* row, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(row);
  for (uintptr_t line = start & ~uintptr_t{63}; line < start + bytes; line += 64) PrefetchLine(line);
}

// The positions (b, h) attends to, at most C, into `kept`; returns how many. The lists are ring
// buffers: a list with `count` entries ever appended holds its j-th newest at slot
// (count - 1 - j) mod C, for j < min(count, C).
template <typename T>
int64_t KeptPositions(const LshDecodeOperands<T>& a, int64_t b, int64_t h, int32_t* kept) {
  const int64_t R = a.rounds, C = a.capacity, L = a.length, NB = a.n_buckets;
  const int32_t* q_buckets = a.q_buckets + (b * a.heads + h) * R;
  const int32_t* buckets = a.buckets + (b * a.heads + h) * R * L;
  // Same-bucket positions, newest first: a merge of the query's list in every round, a position in
  // several of them taken once. A list runs out early only when it holds every position of its
  // bucket (fewer than C were appended), or after C positions were taken, enough in all.
  // Each list is walked from its newest slot down, wrapping at 0, with no division per entry.
  const int32_t* lists[kMaxLshRounds];
  int64_t slot[kMaxLshRounds], left[kMaxLshRounds];
  for (int64_t r = 0; r < R; ++r) {
    const int32_t bucket = q_buckets[r];
    const bool own = bucket >= 0 && bucket < NB;
    const int64_t base = ((b * a.heads + h) * R + r) * NB + (own ? bucket : 0);
    const int64_t count = own ? a.counts[base] : 0;
    lists[r] = a.lists + base * C;
    left[r] = std::min<int64_t>(count, C);
    slot[r] = count > 0 ? (count - 1) % C : 0;
  }
  auto advance = [&](int64_t r) { --left[r], slot[r] = slot[r] == 0 ? C - 1 : slot[r] - 1; };
  int64_t n = 0;
  while (n < C) {
    int32_t newest = -1;
    for (int64_t r = 0; r < R; ++r)
      if (left[r] > 0) newest = std::max(newest, lists[r][slot[r]]);
    if (newest < 0) break;
    for (int64_t r = 0; r < R; ++r)
      if (left[r] > 0 && lists[r][slot[r]] == newest) advance(r);
    if (newest < L) kept[n++] = newest;
  }
  // Then the newest other positions: they are among the latest C real positions (fewer than C
  // positions, same-bucket or kept others, follow the last one kept).
  const int64_t recent_count = a.recent_count[b];
  const int32_t* recent = a.recent + b * C;
  int64_t j = recent_count > 0 ? (recent_count - 1) % C : 0;
  for (int64_t seen = std::min<int64_t>(recent_count, C); seen > 0 && n < C; --seen, j = j == 0 ? C - 1 : j - 1) {
    const int32_t p = recent[j];
    if (p < 0 || p >= L) continue;
    bool same = false;
    for (int64_t r = 0; r < R; ++r) same |= q_buckets[r] >= 0 && buckets[r * L + p] == q_buckets[r];
    if (!same) kept[n++] = p;
  }
  return n;
}

// One (b, h): its kept rows' logits, online softmax and weighted sum of values.
template <typename T>
void AttendHead(const LshDecodeOperands<T>& a, int64_t row) {
  const int64_t b = row / a.heads, h = row % a.heads, L = a.length, dh = a.dh;
  thread_local std::vector<int32_t> kept_buffer;
  kept_buffer.resize(static_cast<size_t>(a.capacity));
  int32_t* kept = kept_buffer.data();
  const int64_t n = KeptPositions(a, b, h, kept);
  const float* q = a.q + row * dh;
  const T* keys = a.keys + row * L * dh;
  const T* values = a.values + row * L * dh;
  const float* key_scale = a.key_scale ? a.key_scale + row * L : nullptr;
  const float* value_scale = a.value_scale ? a.value_scale + row * L : nullptr;
  float* y = a.out + row * dh;
  std::fill(y, y + dh, 0.0f);
  const int64_t row_bytes = dh * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < std::min(n, kPrefetchAhead); ++j) {
    PrefetchRow(keys + kept[j] * dh, row_bytes), PrefetchRow(values + kept[j] * dh, row_bytes);
  }
  float top = kNoKey, total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) {
      const int64_t ahead = kept[j + kPrefetchAhead];
      PrefetchRow(keys + ahead * dh, row_bytes), PrefetchRow(values + ahead * dh, row_bytes);
      if (key_scale) PrefetchLine(reinterpret_cast<uintptr_t>(key_scale + ahead));
      if (value_scale) PrefetchLine(reinterpret_cast<uintptr_t>(value_scale + ahead));
    }
    const int64_t p = kept[j];
    float logit = RowDot(q, keys + p * dh, dh);
    if (key_scale) logit *= key_scale[p];
    if (logit > top) {  // a new maximum: what was summed so far is rescaled to it
      const float shrink = std::exp(top - logit);
      total *= shrink;
      for (int64_t d = 0; d < dh; ++d) y[d] *= shrink;
      top = logit;
    }
    const float w = std::exp(logit - top);
    total += w;
    AddScaledRow(y, value_scale ? w * value_scale[p] : w, values + p * dh, dh);
  }
  a.top[row] = top;
  a.total[row] = total;
}

}  // namespace

template <typename T>
ffi::Error LshDecodeAttention(ffi::ThreadPool& pool, const LshDecodeOperands<T>& a) {
  const int64_t rows = a.batch * a.heads;
  const int64_t work_bytes = rows * a.capacity * a.dh * static_cast<int64_t>(2 * sizeof(T));
  Chunked(pool, rows, 1, work_bytes, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) AttendHead(a, r);
  });
  return ffi::Error::Success();
}

template ffi::Error LshDecodeAttention<float>(ffi::ThreadPool&, const LshDecodeOperands<float>&);
template ffi::Error LshDecodeAttention<int8_t>(ffi::ThreadPool&, const LshDecodeOperands<int8_t>&);
template ffi::Error LshDecodeAttention<uint16_t>(ffi::ThreadPool&, const LshDecodeOperands<uint16_t>&);

}  // namespace terra::native

// The LSH decode-attention handler: for each (batch row, head), the keys the layer's rule keeps
// (terra/layers/lsh_bucket_lists.py, select_from_bucket_lists: those sharing the query's bucket in any
// hash round, newest first, then the newest others, n_keep = C in all) and the softmax-weighted sum
// of their values, with each kept row of the cache read once where it lies.
//
// Why in one native call: the rule is a merge of sorted lists, which XLA can only express as a
// ranking (a bisection over every candidate), and XLA's gather of the kept rows costs more than
// reading the rows' bytes; here the rows are prefetched a few positions ahead of their use and the
// heads are shared between the pool's threads (docs/architecture.md, "Long inputs").

#include "lsh_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache_attention.h"
#include "isa.h"
#include "threads.h"

namespace terra::native {

namespace {

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

// One (b, h): its kept rows attended to by the cache attention's core (cache_attention.h), which
// reads each kept row where it lies, a few rows ahead of its use.
template <typename I, typename T>
TERRA_INLINE void AttendHead(const LshDecodeOperands<T>& a, int64_t row, std::vector<int32_t>& kept,
                             std::vector<float>& buffer) {
  const int64_t b = row / a.heads, h = row % a.heads, L = a.length, dh = a.dh;
  kept.resize(static_cast<size_t>(a.capacity));
  CachedRows<T> c;
  c.visible = KeptPositions(a, b, h, kept.data());
  c.rows = kept.data();
  c.keys = a.keys + row * L * dh, c.values = a.values + row * L * dh, c.dh = dh;
  c.key_scale = a.key_scale ? a.key_scale + row * L : nullptr;
  c.value_scale = a.value_scale ? a.value_scale + row * L : nullptr;
  const SoftmaxTerms terms = AttendCachedRows<I>(a.q + row * dh, c, a.out + row * dh, buffer);
  a.top[row] = terms.top;
  a.total[row] = terms.total;
}

}  // namespace

template <typename T>
ffi::Error LshDecodeAttention(ffi::ThreadPool& pool, const LshDecodeOperands<T>& a) {
  const int64_t rows = a.batch * a.heads;
  const int64_t work_bytes = rows * a.capacity * a.dh * static_cast<int64_t>(2 * sizeof(T));
  const int isa = ActiveIsa();
  Chunked(pool, rows, 1, work_bytes, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> kept;
    thread_local std::vector<float> buffer;
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA {
      for (int64_t r = begin; r < end; ++r) AttendHead<decltype(tag)>(a, r, kept, buffer);
    });
  });
  return ffi::Error::Success();
}

template ffi::Error LshDecodeAttention<float>(ffi::ThreadPool&, const LshDecodeOperands<float>&);
template ffi::Error LshDecodeAttention<int8_t>(ffi::ThreadPool&, const LshDecodeOperands<int8_t>&);
template ffi::Error LshDecodeAttention<uint16_t>(ffi::ThreadPool&, const LshDecodeOperands<uint16_t>&);

}  // namespace terra::native

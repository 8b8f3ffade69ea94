// The products on the calling thread and XLA's pool (products.h), each compiled once per
// instruction set from product_kernels.h.

#include "products.h"

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "product_kernels.h"
#include "threads.h"

namespace terra::native {

template <typename W>
void OutputMajorRange(int isa, const Product<W>& p, int64_t o_begin, int64_t o_end) {
  WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA { OutputMajorRows<decltype(tag)>(p, o_begin, o_end); });
}

template <typename W>
void GatheredDotRange(int isa, const GatheredRows<W>& p, int64_t j0, int64_t j1) {
  WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA { GatheredDotEntries<decltype(tag)>(p, j0, j1); });
}

template <typename W>
void GatheredSumRange(int isa, const GatheredRows<W>& p, int64_t c0, int64_t c1) {
  WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA { GatheredSumColumns<decltype(tag)>(p, c0, c1); });
}

template <typename W>
void OutputMajor(ffi::ThreadPool& pool, const Product<W>& p) {
  const int isa = ActiveIsa();
  const int64_t row_bytes = std::max<int64_t>(1, p.n_in * static_cast<int64_t>(sizeof(W)));
  // Whole groups of 4 rows per chunk, so that interleaved rows never leave a remainder mid-range.
  const int64_t rows = std::max<int64_t>(4, (kChunkBytes / row_bytes + 3) / 4 * 4);
  Chunked(pool, p.n_out, rows, p.n_out * row_bytes, [&](int64_t o0, int64_t o1) { OutputMajorRange(isa, p, o0, o1); });
}

template <typename W>
void InputMajor(ffi::ThreadPool& pool, const InputMajorProduct<W>& p) {
  const int isa = ActiveIsa();
  const int64_t items = InputMajorItems(p);
  // A tile reads n_in x kTile weights once per call and does batch multiply-adds with each: its
  // work is the weights times the rows (float32 multiply-adds cost about a streamed byte each).
  const int64_t work = p.n_in * p.n_out * (static_cast<int64_t>(sizeof(W)) + p.batch);
  const int64_t rows = std::min(p.batch, kRowChunk);  // an item's rows
  const int64_t per_item = std::max<int64_t>(1, p.n_in * kTile * (static_cast<int64_t>(sizeof(W)) + rows));
  Chunked(pool, items, std::max<int64_t>(1, kChunkBytes / per_item), work, [&](int64_t t0, int64_t t1) {
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA { InputMajorItemRange<decltype(tag)>(p, t0, t1); });
  });
}

template <typename W>
void GatheredDot(ffi::ThreadPool& pool, const GatheredRows<W>& p) {
  const int isa = ActiveIsa();
  const int64_t row_bytes = std::max<int64_t>(1, p.d * static_cast<int64_t>(sizeof(W)) * p.batch);
  Chunked(pool, p.k, std::max<int64_t>(1, kChunkBytes / row_bytes), p.k * row_bytes,
          [&](int64_t j0, int64_t j1) { GatheredDotRange(isa, p, j0, j1); });
}

template <typename W>
void GatheredSum(ffi::ThreadPool& pool, const GatheredRows<W>& p) {
  const int isa = ActiveIsa();
  // Columns in whole cache lines of float32 outputs, each chunk about kChunkBytes of weights.
  const int64_t column_bytes = std::max<int64_t>(1, p.k * static_cast<int64_t>(sizeof(W)) * p.batch);
  const int64_t columns = std::max<int64_t>(16, kChunkBytes / column_bytes / 16 * 16);
  Chunked(pool, p.d, columns, p.d * column_bytes, [&](int64_t c0, int64_t c1) { GatheredSumRange(isa, p, c0, c1); });
}

#define TERRA_INSTANTIATE(W)                                                                       \
  template void OutputMajorRange<W>(int, const Product<W>&, int64_t, int64_t);                     \
  template void GatheredDotRange<W>(int, const GatheredRows<W>&, int64_t, int64_t);                \
  template void GatheredSumRange<W>(int, const GatheredRows<W>&, int64_t, int64_t);                \
  template void OutputMajor<W>(ffi::ThreadPool&, const Product<W>&);                               \
  template void InputMajor<W>(ffi::ThreadPool&, const InputMajorProduct<W>&);                      \
  template void GatheredDot<W>(ffi::ThreadPool&, const GatheredRows<W>&);                          \
  template void GatheredSum<W>(ffi::ThreadPool&, const GatheredRows<W>&);
TERRA_INSTANTIATE(int8_t)
TERRA_INSTANTIATE(uint16_t)
#undef TERRA_INSTANTIATE
// float32 weights: the output-major product of a batch of rows (XLA:CPU's own product of a few
// rows reads the weights several times over; docs/decode_speed.md, "Batched decoding").
template void OutputMajorRange<float>(int, const Product<float>&, int64_t, int64_t);
template void OutputMajor<float>(ffi::ThreadPool&, const Product<float>&);

}  // namespace terra::native

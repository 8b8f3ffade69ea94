// A float32 product of rows in memory, in register tiles: both products of attention (scores =
// q k^T with k transposed, out += weights v; prefill_attention.cc) and an LSH hash's rotations
// (lsh_hash.cc). Inlined into each instruction set's function (isa.h).

#ifndef TERRA_BACKENDS_NATIVE_TILE_PRODUCTS_H_
#define TERRA_BACKENDS_NATIVE_TILE_PRODUCTS_H_

#include <cstdint>

#include "isa.h"

namespace terra::native {

// c [rows, width] (+)= a [rows, depth] b [depth, width], computed in register tiles of R rows of a
// by C vectors of b's columns: each step broadcasts R entries of a and multiplies them into C
// vectors of one row of b.
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

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_TILE_PRODUCTS_H_

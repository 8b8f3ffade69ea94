// Narrow-weight matrix-vector products for batch-1 decoding (int8 with float32 scales, or bfloat16
// as its uint16 bits), float32 activations and outputs: their operands, and the products run on
// the calling thread and XLA's pool (products.cc). Each is instantiated for W = int8_t and uint16_t.
//
// A decode step's time is the bytes of its weights divided by the memory bandwidth. XLA:CPU widens
// narrow weights block by block at best (terra/backends/xla.py); these kernels widen them
// a vector at a time in registers and multiply-add them into float32 accumulators, so memory
// traffic is the narrow bytes alone. Activations stay float32 and are never quantized.

#ifndef TERRA_BACKENDS_NATIVE_PRODUCTS_H_
#define TERRA_BACKENDS_NATIVE_PRODUCTS_H_

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// Rows of x the handlers take: decoding's batch or beams (native_kernels.MAX_ROWS), and for the
// input-major product a multiplicative layer's modules times the batch
// (native_kernels.MAX_INPUT_MAJOR_ROWS).
constexpr int64_t kMaxRows = 64;
constexpr int64_t kMaxInputMajorRows = 256;
// Rows of x the output-major kernel multiplies each widened weight vector into: R * B accumulators
// must stay in registers. More rows take several passes over a chunk of weights (products.cc
// shares out kChunkBytes of rows), the later passes reading it from cache, not from memory.
constexpr int64_t kRowsPerPass = 8;

// Output-major: y[b, o] = sum_g scale[o, g] * sum_{i in group g} x[b, i] * values[o, i], with
// groups of n_in / G consecutive inputs (one scale per output row and head).
template <typename W>
struct Product {
  const float* x;      // [batch, n_in]
  const W* values;     // [n_out, n_in]
  const float* scale;  // [n_out, groups]; nullptr: all 1 (bfloat16)
  float* y;            // [batch, n_out]
  int64_t batch, n_in, n_out, groups;

  float Scale(int64_t o, int64_t g) const { return scale ? scale[o * groups + g] : 1.0f; }
};

// Input-major: y[b, o] = sum_i x[b, i] * scale[i, o / group] * values[i, o], with `group` = out / G
// consecutive outputs sharing a scale per input (G = 1: one scale per input row).
template <typename W>
struct InputMajorProduct {
  const float* x;      // [batch, n_in]
  const W* values;     // [n_in, n_out]
  const float* scale;  // [n_in, groups]; nullptr: all 1 (bfloat16)
  float* y;            // [batch, n_out]
  int64_t batch, n_in, n_out, groups;
};

// Gathered rows: `rows [batch, k]` index rows of `values [n_rows, d]` (scale [n_rows] or nullptr).
//   dot: y[b, j] = scale[r] * sum_i x[b, i] * values[r, i],  r = rows[b, j]   (x [batch, d], y [batch, k])
//   sum: y[b, i] = sum_j x[b, j] * scale[r] * values[r, i]                    (x [batch, k], y [batch, d])
template <typename W>
struct GatheredRows {
  const float* x;
  const W* values;
  const float* scale;
  const int32_t* rows;
  float* y;
  int64_t batch, k, d, n_rows;

  // Clamped as jnp.take(mode='clip'): the indices are in range by construction (block offsets).
  int64_t Index(int64_t b, int64_t j) const {
    return std::min<int64_t>(std::max<int64_t>(rows[b * k + j], 0), n_rows - 1);
  }
  const W* Row(int64_t r) const { return values + r * d; }
  float Scale(int64_t r) const { return scale ? scale[r] : 1.0f; }
};

// Asks for the lines of columns [c0, c1) of the row that entry (b, j) selects. Selected rows are
// anywhere in the table, each in its own DRAM page, so reading one row after another would wait on
// memory for each: the kernels ask for rows ahead while they read the current one.
template <typename W>
TERRA_INLINE void PrefetchRow(const GatheredRows<W>& p, int64_t b, int64_t j, int64_t c0, int64_t c1) {
  const W* row = p.Row(p.Index(b, j));
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + c1);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(row + c0) & ~uintptr_t{63}; a < end; a += 64) PrefetchLine(a);
}

// The products on the calling thread alone, with instruction set `isa` (the pieces a fused call
// shares out itself): output rows [o_begin, o_end); dot entries [j0, j1) of every row of x; sum
// outputs [c0, c1) of every row of x.
template <typename W>
void OutputMajorRange(int isa, const Product<W>& p, int64_t o_begin, int64_t o_end);
template <typename W>
void GatheredDotRange(int isa, const GatheredRows<W>& p, int64_t j0, int64_t j1);
template <typename W>
void GatheredSumRange(int isa, const GatheredRows<W>& p, int64_t c0, int64_t c1);

// Whole products, shared with the pool when they are large enough, with the instruction set in use.
template <typename W>
void OutputMajor(ffi::ThreadPool& pool, const Product<W>& p);
template <typename W>
void InputMajor(ffi::ThreadPool& pool, const InputMajorProduct<W>& p);
template <typename W>
void GatheredDot(ffi::ThreadPool& pool, const GatheredRows<W>& p);
template <typename W>
void GatheredSum(ffi::ThreadPool& pool, const GatheredRows<W>& p);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_PRODUCTS_H_

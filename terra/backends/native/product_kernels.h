// The products' kernels, each written once over an instruction-set tag I (isa.h) and inlined into
// the function WithIsa compiles for that set. Included by the files that compile them:
// products.cc, and attention.cc (whose projections are input-major products).

#ifndef TERRA_BACKENDS_NATIVE_PRODUCT_KERNELS_H_
#define TERRA_BACKENDS_NATIVE_PRODUCT_KERNELS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "products.h"

namespace terra::native {

// ---------------------------------------------------------------------------------------------
// Output-major: how the row kernel walks the weights.
//
// Rows of `values` are read R at a time, each vector of x multiplied into all R rows, so every x
// load serves R rows: x stays float32, 4 bytes against each weight's 1 or 2, and once its rows no
// longer fit in L1 beside the streaming weights (d_model 9216: 36 KiB) reading rows one at a time
// is much slower. With the prefetch below, R rows at a time are as fast as one at a time on short
// rows, or faster.

// One core alone keeps too few cache misses in flight to stream at the machine's bandwidth while it
// computes: it asks for the weights kPrefetchBytes of reading ahead, into L2 (nearer, into L1, and
// farther both gain less).
constexpr int64_t kPrefetchBytes = 8 << 10;

// Prefetches what R rows read together (from `rows`, `n` weights each, now at input `i`) will
// need kPrefetchBytes of reading later: each row's stream moves at 1/R of the pace, so it looks
// kPrefetchBytes / R ahead, in its own row or, past its end, in the same row of the next R (for
// rows shorter than that, somewhere in the rows ahead: still lines about to be read).
// Every step asks for the line it looks ahead to, even when an earlier step already did (a step
// reads 16 bytes of each row of int8, 32 of bfloat16): asking once per line is slower for bfloat16.
template <typename W, int R>
TERRA_INLINE void PrefetchRows(const W* rows, int64_t n, int64_t i, int64_t count) {
  const int64_t step_bytes = count * static_cast<int64_t>(sizeof(W));
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(W));
  const int64_t ahead = i * static_cast<int64_t>(sizeof(W)) + kPrefetchBytes / R;
  // Integer addresses: the lines past the last row are never read, and prefetching them is harmless.
  const uintptr_t base = reinterpret_cast<uintptr_t>(rows) + (ahead < row_bytes ? ahead : (R - 1) * row_bytes + ahead);
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < step_bytes; k += 64) PrefetchLine(base + r * row_bytes + k);
}

// Rows per step for B rows of x: R * B accumulators fill the set's accumulator registers, at most
// 4 rows, and a power of two, so that a chunk of whole groups of 4 rows leaves no remainder.
constexpr int RowsPerStep(int accumulators, int batch) {
  int r = 4;
  while (r > 1 && r * batch > accumulators) r /= 2;
  return r;
}

// Output rows [o, o + R) against the B rows of x: R * B accumulators, one vector of inputs per step.
template <typename I, typename W, int B, int R>
TERRA_INLINE void OutputRows(const Product<W>& p, int64_t o) {
  using Vec = typename I::Vec;
  constexpr int64_t kWidth = I::kWidth;
  const int64_t n = p.n_in, group = n / p.groups;
  const W* rows = p.values + o * n;
  Vec total[R][B];
  for (int64_t g = 0; g < p.groups; ++g) {
    Vec acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = I::Zero();
    int64_t i = g * group;
    const int64_t end = i + group;
    for (; i + kWidth <= end; i += kWidth) {
      PrefetchRows<W, R>(rows, n, i, kWidth);
      Vec w[R];
      for (int r = 0; r < R; ++r) w[r] = I::Widen(rows + r * n + i);
      for (int b = 0; b < B; ++b) {
        const Vec xv = I::Load(p.x + b * n + i);
        for (int r = 0; r < R; ++r) acc[r][b] = I::Fma(w[r], xv, acc[r][b]);
      }
    }
    if (i < end) {
      Vec w[R];
      for (int r = 0; r < R; ++r) w[r] = I::Widen(rows + r * n + i, end - i);
      for (int b = 0; b < B; ++b) {
        const Vec xv = I::Load(p.x + b * n + i, end - i);
        for (int r = 0; r < R; ++r) acc[r][b] = I::Fma(w[r], xv, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec s = I::Broadcast(p.Scale(o + r, g));
      for (int b = 0; b < B; ++b) total[r][b] = g == 0 ? I::Mul(acc[r][b], s) : I::Fma(acc[r][b], s, total[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) p.y[b * p.n_out + o + r] = I::Sum(total[r][b]);
}

template <typename I, typename W, int B, int R = RowsPerStep(I::kAccumulators, B)>
TERRA_INLINE void OutputRowRange(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) OutputRows<I, W, B, R>(p, o);
  for (; o < o_end; ++o) OutputRows<I, W, B, 1>(p, o);
}

// One row of x against short rows of values (at most kShortRow inputs: the sparse feed-forward
// controller's [d_ff, d_lowrank] up-projection), kWidth outputs at a time with one accumulator
// each: with few inputs per output, reducing each output's vector on its own (OutputRows) costs
// about as much as its multiply-adds; here kWidth outputs share one reduction tree
// (I::SumsOfWidth) and a prefetch per line.
constexpr int64_t kShortRow = 256;
// Short rows are many per line, so the stream runs further ahead than kPrefetchBytes.
constexpr int64_t kShortRowPrefetchBytes = 16 << 10;

template <typename I, typename W>
TERRA_INLINE void ShortRows(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  using Vec = typename I::Vec;
  constexpr int64_t kWidth = I::kWidth;
  const int64_t n = p.n_in, row_bytes = n * static_cast<int64_t>(sizeof(W));
  int64_t o = o_begin;
  for (; o + kWidth <= o_end; o += kWidth) {
    const W* rows = p.values + o * n;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(rows) + kShortRowPrefetchBytes;
    for (int64_t line = 0; line < kWidth * row_bytes; line += 64) PrefetchLine(ahead + line);
    Vec acc[kWidth];
    for (int r = 0; r < kWidth; ++r) acc[r] = I::Zero();
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth) {
      const Vec xv = I::Load(p.x + i);
      for (int r = 0; r < kWidth; ++r) acc[r] = I::Fma(I::Widen(rows + r * n + i), xv, acc[r]);
    }
    if (i < n) {
      const Vec xv = I::Load(p.x + i, n - i);
      for (int r = 0; r < kWidth; ++r) acc[r] = I::Fma(I::Widen(rows + r * n + i, n - i), xv, acc[r]);
    }
    Vec y = I::SumsOfWidth(acc);
    if (p.scale) y = I::Mul(y, I::Load(p.scale + o));
    I::Store(p.y + o, y);
  }
  if (o < o_end) OutputRowRange<I, W, 1>(p, o, o_end);
}

// Output rows [o_begin, o_end) of every row of x, kRowsPerPass rows of x at a time: the range is a
// chunk of about kChunkBytes of weights (OutputMajor), so the passes after the first read it from
// cache and a batch of B rows streams the weights from memory once.
template <typename I, typename W>
TERRA_INLINE void OutputMajorRows(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  if constexpr (I::kTransposedSums) {
    if (p.batch == 1 && p.groups == 1 && p.n_in <= kShortRow) return ShortRows<I>(p, o_begin, o_end);
  }
  for (int64_t b0 = 0; b0 < p.batch; b0 += kRowsPerPass) {
    Product<W> part = p;
    part.x += b0 * p.n_in, part.y += b0 * p.n_out, part.batch = std::min(kRowsPerPass, p.batch - b0);
    switch (part.batch) {
      case 1: OutputRowRange<I, W, 1>(part, o_begin, o_end); break;
      case 2: OutputRowRange<I, W, 2>(part, o_begin, o_end); break;
      case 3: OutputRowRange<I, W, 3>(part, o_begin, o_end); break;
      case 4: OutputRowRange<I, W, 4>(part, o_begin, o_end); break;
      case 5: OutputRowRange<I, W, 5>(part, o_begin, o_end); break;
      case 6: OutputRowRange<I, W, 6>(part, o_begin, o_end); break;
      case 7: OutputRowRange<I, W, 7>(part, o_begin, o_end); break;
      default: OutputRowRange<I, W, 8>(part, o_begin, o_end); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Input-major and gathered-row products.
//
// The small kernels a sparse decode step reads input-major (the multiplicative layers' [d, M], the
// convolutions' unfolded [F*k*M, M], the controller's up-projection [d_lowrank, d_ff]) and the rows
// of W1 and W2 the controller selects (one per block, §2.1) are read here straight from their
// narrow store: XLA:CPU would widen them into float32 buffers first (a whole kernel, or every
// gathered row), and the buffers are the larger part of the step's memory traffic and allocation.
//
// Their bodies are loops over the 16 generic lanes (isa.h), written so that the compiler vectorises
// them (lane-wise accumulators, fixed-width inner loops, no reassociation needed), with the set's
// own widening (I::WidenLanes).

// Outputs per tile, and rows of x per pass when x has few rows (decoding's batch): a tile's run of
// kTile weights of each input is widened once into two vectors of lanes and multiplied into
// kInputRows rows, whose 2 * kInputRows accumulators stay in registers.
constexpr int64_t kTile = 32;
constexpr int kInputRows = 6;
// A tile reads kTile weights from every input's row, n_out apart: a stride the hardware prefetcher
// does not follow once rows are long, so it asks for its run kAheadInputs inputs ahead itself.
constexpr int64_t kAheadInputs = 32;
// Many rows (the S modules of a multiplicative layer, the windows of a convolution): the product
// is arithmetic-bound, and widening each weight once per pass of kInputRows rows would cost more
// than the multiply-adds. So a block of kBlockInputs inputs of the tile is widened (and scaled)
// once into an L1-resident float32 buffer, and every row of the chunk multiplies it in register
// tiles of I::kBlockRows rows (the accumulators fill the registers without spilling), the partial
// sums kept in y between blocks. Rows are shared out in chunks of kRowChunk so that both cores
// have work even when a layer has only a few tiles of outputs.
constexpr int64_t kBlockInputs = 64;
constexpr int64_t kRowChunk = 24;

// Outputs [c0, c0 + V * kLanes) (within one scale group g) for rows [b0, b0 + R) of x.
template <typename I, typename W, int R, int V>
TERRA_INLINE void InputMajorTile(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b0) {
  typename I::Wide acc[R][V] = {};
  const uintptr_t stride = p.n_out * sizeof(W);
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p.values + c0) + kAheadInputs * stride;
  for (int64_t i = 0; i < p.n_in; ++i) {
    const W* v = p.values + i * p.n_out + c0;
    PrefetchLine(ahead + i * stride);
    typename I::Wide w[V];
    for (int k = 0; k < V; ++k) w[k] = I::WidenLanes(v + k * kLanes);
    const float s = p.scale ? p.scale[i * p.groups + g] : 1.0f;
    for (int r = 0; r < R; ++r) {
      const float xs = p.x[(b0 + r) * p.n_in + i] * s;
      for (int k = 0; k < V; ++k) acc[r][k] += xs * w[k];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) I::StoreWide(p.y + (b0 + r) * p.n_out + c0 + k * kLanes, acc[r][k]);
}

// Rows [b_begin, b_end) of x, kInputRows at a time, for a tile of V vectors of outputs.
template <typename I, typename W, int V>
TERRA_INLINE void InputMajorRows(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b_begin,
                                 int64_t b_end) {
  int64_t b0 = b_begin;
  for (; b0 + kInputRows <= b_end; b0 += kInputRows) InputMajorTile<I, W, kInputRows, V>(p, g, c0, b0);
  switch (b_end - b0) {
    case 1: return InputMajorTile<I, W, 1, V>(p, g, c0, b0);
    case 2: return InputMajorTile<I, W, 2, V>(p, g, c0, b0);
    case 3: return InputMajorTile<I, W, 3, V>(p, g, c0, b0);
    case 4: return InputMajorTile<I, W, 4, V>(p, g, c0, b0);
    case 5: return InputMajorTile<I, W, 5, V>(p, g, c0, b0);
    default: return;
  }
}

// Rows [b0, b0 + R) times the widened block `w [n][V]` of inputs [i0, i0 + n), added to y (or
// written, for the first block).
template <typename I, int R, int V>
TERRA_INLINE void BlockTile(const float* x, int64_t n_in, float* y, int64_t n_out, const typename I::Wide (*w)[V],
                            int64_t n, int64_t i0, int64_t c0, int64_t b0, bool first) {
  typename I::Wide acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k)
      acc[r][k] = first ? typename I::Wide{} : I::LoadWide(y + (b0 + r) * n_out + c0 + k * kLanes);
  const float* xr = x + b0 * n_in + i0;
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < R; ++r) {
      const float xi = xr[r * n_in + i];
      for (int k = 0; k < V; ++k) acc[r][k] += xi * w[i][k];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) I::StoreWide(y + (b0 + r) * n_out + c0 + k * kLanes, acc[r][k]);
}

template <typename I, int R, int V>
TERRA_INLINE void BlockRows(const float* x, int64_t n_in, float* y, int64_t n_out, const typename I::Wide (*w)[V],
                            int64_t n, int64_t i0, int64_t c0, int64_t b_begin, int64_t b_end, bool first) {
  int64_t b0 = b_begin;
  for (; b0 + R <= b_end; b0 += R) BlockTile<I, R, V>(x, n_in, y, n_out, w, n, i0, c0, b0, first);
  if constexpr (R > 1) {
    if (b0 < b_end) {
      // The chunk's last rows: halving R until it fits (R - 1 templates each would bloat the code).
      BlockRows<I, (R + 1) / 2, V>(x, n_in, y, n_out, w, n, i0, c0, b0, b_end, first);
    }
  }
}

template <typename I, typename W, int V>
TERRA_INLINE void InputMajorBlocked(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b_begin,
                                    int64_t b_end) {
  alignas(64) typename I::Wide w[kBlockInputs][V];
  for (int64_t i0 = 0; i0 < p.n_in; i0 += kBlockInputs) {
    const int64_t n = std::min(kBlockInputs, p.n_in - i0);
    for (int64_t i = 0; i < n; ++i) {
      const W* v = p.values + (i0 + i) * p.n_out + c0;
      const float s = p.scale ? p.scale[(i0 + i) * p.groups + g] : 1.0f;
      for (int k = 0; k < V; ++k) w[i][k] = I::WidenLanes(v + k * kLanes) * s;
    }
    // The next block's weights are on their way while this one is multiplied (its rows are n_out
    // apart: the hardware prefetcher does not follow them when rows are long).
    const int64_t next_end = std::min(p.n_in, i0 + 2 * kBlockInputs);
    for (int64_t i = i0 + kBlockInputs; i < next_end; ++i) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(p.values + i * p.n_out + c0);
      PrefetchLine(first);
      PrefetchLine(first + V * kLanes * sizeof(W) - 1);
    }
    BlockRows<I, I::kBlockRows, V>(p.x, p.n_in, p.y, p.n_out, w, n, i0, c0, b_begin, b_end, i0 == 0);
  }
}

// Fewer than kLanes outputs (a group's last ones): plain loops, for rows [b_begin, b_end) of x.
template <typename W>
TERRA_INLINE void InputMajorNarrowTile(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t width,
                                       int64_t b_begin, int64_t b_end) {
  for (int64_t b = b_begin; b < b_end; ++b) {
    float acc[kLanes] = {};
    for (int64_t i = 0; i < p.n_in; ++i) {
      const W* v = p.values + i * p.n_out + c0;
      const float xs = p.x[b * p.n_in + i] * (p.scale ? p.scale[i * p.groups + g] : 1.0f);
      for (int64_t c = 0; c < width; ++c) acc[c] += xs * Widen(v[c]);
    }
    std::memcpy(p.y + b * p.n_out + c0, acc, width * sizeof(float));
  }
}

// Chunks of kRowChunk rows of x (one when there are few): each is its own work item.
template <typename W>
int64_t InputMajorRowChunks(const InputMajorProduct<W>& p) {
  return (p.batch + kRowChunk - 1) / kRowChunk;
}

// The work items of an input-major product: a tile of outputs inside one scale group, for a chunk
// of rows of x.
template <typename W>
int64_t InputMajorItems(const InputMajorProduct<W>& p) {
  return p.groups * ((p.n_out / p.groups + kTile - 1) / kTile) * InputMajorRowChunks(p);
}

// Vectors of V * kLanes outputs from c0, rows [b_begin, b_end): blocked when the rows are many.
template <typename I, typename W, int V>
TERRA_INLINE void InputMajorVectors(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b_begin,
                                    int64_t b_end) {
  if (b_end - b_begin > kInputRows) return InputMajorBlocked<I, W, V>(p, g, c0, b_begin, b_end);
  InputMajorRows<I, W, V>(p, g, c0, b_begin, b_end);
}

// Tile `tile` of scale group g's outputs, for rows [b_begin, b_end) of x.
template <typename I, typename W>
TERRA_INLINE void InputMajorTileRows(const InputMajorProduct<W>& p, int64_t g, int64_t tile, int64_t b_begin,
                                     int64_t b_end) {
  const int64_t group = p.n_out / p.groups, c0 = g * group + tile * kTile;
  const int64_t width = std::min(kTile, (g + 1) * group - c0);
  if (width == kTile) return InputMajorVectors<I, W, 2>(p, g, c0, b_begin, b_end);
  int64_t c = c0;
  if (width >= kLanes) InputMajorVectors<I, W, 1>(p, g, c, b_begin, b_end), c += kLanes;
  if (c < c0 + width) InputMajorNarrowTile(p, g, c, c0 + width - c, b_begin, b_end);
}

// Work items [t0, t1) (InputMajorItems).
template <typename I, typename W>
TERRA_INLINE void InputMajorItemRange(const InputMajorProduct<W>& p, int64_t t0, int64_t t1) {
  const int64_t chunks = InputMajorRowChunks(p);
  const int64_t tiles_per_group = (p.n_out / p.groups + kTile - 1) / kTile;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t chunk = t % chunks, tile = t / chunks;
    const int64_t b_begin = chunk * kRowChunk, b_end = std::min(p.batch, b_begin + kRowChunk);
    InputMajorTileRows<I, W>(p, tile / tiles_per_group, tile % tiles_per_group, b_begin, b_end);
  }
}

// Every output for rows [b_begin, b_end) of x.
template <typename I, typename W>
TERRA_INLINE void InputMajorRowRange(const InputMajorProduct<W>& p, int64_t b_begin, int64_t b_end) {
  const int64_t tiles_per_group = (p.n_out / p.groups + kTile - 1) / kTile;
  for (int64_t g = 0; g < p.groups; ++g)
    for (int64_t tile = 0; tile < tiles_per_group; ++tile) InputMajorTileRows<I, W>(p, g, tile, b_begin, b_end);
}

// Gathered rows: the row kAheadRows ahead is asked for (PrefetchRow) while the current one is read.
constexpr int64_t kAheadRows = 8;

// dot for entries [j0, j1) of every row of x. Four accumulators: one would wait on its own
// multiply-add's latency at every step (twice the widening's cost).
template <typename I, typename W>
TERRA_INLINE void GatheredDotEntries(const GatheredRows<W>& p, int64_t j0, int64_t j1) {
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* x = p.x + b * p.d;
    for (int64_t j = j0; j < std::min(j1, j0 + kAheadRows); ++j) PrefetchRow(p, b, j, 0, p.d);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = p.Index(b, j);
      const W* v = p.Row(r);
      if (j + kAheadRows < j1) PrefetchRow(p, b, j + kAheadRows, 0, p.d);
      typename I::Wide acc[4] = {};
      int64_t i = 0;
      for (; i + 4 * kLanes <= p.d; i += 4 * kLanes)
        for (int u = 0; u < 4; ++u) acc[u] += I::LoadWide(x + i + u * kLanes) * I::WidenLanes(v + i + u * kLanes);
      for (; i + kLanes <= p.d; i += kLanes) acc[0] += I::LoadWide(x + i) * I::WidenLanes(v + i);
      float total = 0.0f;
      for (; i < p.d; ++i) total += x[i] * Widen(v[i]);
      total = I::SumWide((acc[0] + acc[1]) + (acc[2] + acc[3]), total);
      p.y[b * p.k + j] = total * p.Scale(r);
    }
  }
}

// sum for outputs [c0, c1) of every row of x: the selected rows four at a time, so that each
// vector of y is loaded and stored once per four rows.
template <typename I, typename W>
TERRA_INLINE void GatheredSumColumns(const GatheredRows<W>& p, int64_t c0, int64_t c1) {
  constexpr int kRows = 4;
  for (int64_t b = 0; b < p.batch; ++b) {
    float* y = p.y + b * p.d;
    std::fill(y + c0, y + c1, 0.0f);
    for (int64_t j = 0; j < std::min(p.k, kAheadRows); ++j) PrefetchRow(p, b, j, c0, c1);
    for (int64_t j = 0; j < p.k; j += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, p.k - j));
      const W* v[kRows];
      float coefficient[kRows];
      for (int u = 0; u < kRows; ++u) {
        // Past the last row: row 0 again, with coefficient 0.
        const int64_t r = p.Index(b, u < n ? j + u : 0);
        v[u] = p.Row(r);
        coefficient[u] = u < n ? p.x[b * p.k + j + u] * p.Scale(r) : 0.0f;
      }
      for (int u = 0; u < n; ++u)
        if (j + u + kAheadRows < p.k) PrefetchRow(p, b, j + u + kAheadRows, c0, c1);
      int64_t c = c0;
      for (; c + kLanes <= c1; c += kLanes) {
        typename I::Wide acc = I::LoadWide(y + c);
        for (int u = 0; u < kRows; ++u) acc += coefficient[u] * I::WidenLanes(v[u] + c);
        I::StoreWide(y + c, acc);
      }
      for (; c < c1; ++c)
        for (int u = 0; u < kRows; ++u) y[c] += coefficient[u] * Widen(v[u][c]);
    }
  }
}

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_PRODUCT_KERNELS_H_

// The module convolution (module_convolution.h): each thread takes blocks of kConvolutionBlock
// positions of one (batch row, module) and accumulates the F k window terms into their output rows
// with the register-tiled product (tile_products.h), each term a [rows, M] by [M, N] product of
// rows S M apart. Why native: XLA:CPU's convolution op runs this shape (S = 16 modules, M = N = 64,
// a 3 x 3 window) well below its small products' rate (docs/decode_speed.md, "Long documents").

#include "module_convolution.h"

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "threads.h"
#include "tile_products.h"

namespace terra::native {

namespace {

// Positions per block: one thread's unit of work, whose output rows (N floats each) stay in L1.
constexpr int64_t kConvolutionBlock = 64;

template <typename I>
TERRA_INLINE void ConvolveBlock(const ModuleConvolutionOperands& a, int64_t item) {
  const int64_t S = a.modules, M = a.depth, N = a.features, L = a.length, F = a.length_kernel;
  const int64_t blocks = (L + kConvolutionBlock - 1) / kConvolutionBlock;
  const int64_t s = item % S, block = (item / S) % blocks, b = item / (S * blocks);
  const int64_t l0 = block * kConvolutionBlock, l1 = std::min(L, l0 + kConvolutionBlock);
  const int64_t row_stride = S * N;
  float* out = a.out + ((b * L + l0) * S + s) * N;
  for (int64_t l = l0; l < l1; ++l) std::copy(a.bias, a.bias + N, out + (l - l0) * row_stride);
  const int64_t half = (a.module_kernel - 1) / 2;
  for (int64_t t = 0; t < F; ++t) {
    // Term t reads position l - (F - 1) + t: none before the sequence's start.
    const int64_t first = std::max(l0, F - 1 - t);
    if (first >= l1) continue;
    for (int64_t j = 0; j < a.module_kernel; ++j) {
      const int64_t source = s + j - half;
      if (source < 0 || source >= S) continue;
      const float* u = a.u + ((b * L + first - (F - 1) + t) * S + source) * M;
      const float* w = a.kernel + (t * a.module_kernel + j) * M * N;
      Product<I>({u, S * M, w, N, out + (first - l0) * row_stride, row_stride, M, true}, l1 - first, N);
    }
  }
}

}  // namespace

ffi::Error ModuleConvolution(ffi::ThreadPool& pool, const ModuleConvolutionOperands& a) {
  const int isa = ActiveIsa();
  const int64_t blocks = (a.length + kConvolutionBlock - 1) / kConvolutionBlock;
  const int64_t items = a.batch * blocks * a.modules;
  const int64_t work_bytes = a.batch * a.length * a.modules * a.depth * static_cast<int64_t>(sizeof(float));
  Chunked(pool, items, 1, work_bytes, [&](int64_t begin, int64_t end) {
    WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA {
      for (int64_t item = begin; item < end; ++item) ConvolveBlock<decltype(tag)>(a, item);
    });
  });
  return ffi::Error::Success();
}

}  // namespace terra::native

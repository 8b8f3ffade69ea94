// The sparse-QKV layer's convolution over (length, modules) for a whole sequence in one call
// (terra/layers/sparse_qkv.py, convolve_modules): causal in length (F - 1 zero rows before the
// first position), the module axis zero-padded by (k - 1) / 2 on each side, the kernel shared
// across modules.

#ifndef TERRA_BACKENDS_NATIVE_MODULE_CONVOLUTION_H_
#define TERRA_BACKENDS_NATIVE_MODULE_CONVOLUTION_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

// The operands and result of one terra_module_convolution call.
struct ModuleConvolutionOperands {
  const float* u = nullptr;       // [B, L, S, M]
  const float* kernel = nullptr;  // [F, k, M, N], N a multiple of 16
  const float* bias = nullptr;    // [N]
  int64_t batch = 0, length = 0, modules = 0, depth = 0, features = 0, length_kernel = 0, module_kernel = 0;
  float* out = nullptr;  // [B, L, S, N]: out[b, l, s] = bias + sum_{t, j} u[b, l - F + 1 + t, s + j - (k - 1) / 2]
                         // . kernel[t, j], terms outside the sequence or the modules zero
};

ffi::Error ModuleConvolution(ffi::ThreadPool& pool, const ModuleConvolutionOperands& operands);

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_MODULE_CONVOLUTION_H_

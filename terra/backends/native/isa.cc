// Which instruction set the kernels run with: detected once at load time.

#include "isa.h"

namespace terra::native {

namespace {

int DetectIsa() {
#if TERRA_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

const int kSupportedIsa = DetectIsa();

}  // namespace

int SupportedIsa() { return kSupportedIsa; }

std::atomic<int> g_isa{kSupportedIsa};

}  // namespace terra::native

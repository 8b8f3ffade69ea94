// Narrow-weight matrix-vector products for batch-1 decoding on CPU, as XLA FFI custom calls.
//
// A decode step's time is the bytes of its weights divided by the memory bandwidth. XLA:CPU widens
// int8 or bfloat16 weights block by block at best (terra/quantization/products.py), which leaves
// about half of int8's advantage on the table. These handlers widen 16 weights at a time in
// registers and multiply-add them into float32 accumulators, so memory traffic is the narrow bytes
// alone. Activations stay float32 and are never quantized.
//
// Handlers (registered by terra/quantization/kernels.py), for B = 1..8 rows of x:
//   terra_output_major_int8  x f32[B, in], values s8[out, in], scale f32[out, G] (or f32[out], G = 1)
//                            -> y f32[B, out], y[b, o] = sum_g scale[o, g] * sum_{i in group g} x[b, i] * values[o, i]
//                            with groups of in / G consecutive inputs (one scale per output row and head).
//   terra_output_major_bf16  x f32[B, in], values u16[out, in] (bfloat16 bits) -> y f32[B, out].
//
// The instruction set is chosen once at load time (AVX-512, AVX2+FMA or portable C++) with
// __builtin_cpu_supports; each variant is compiled with a target attribute, never -march=native, so
// one build runs on any x86-64 machine. Large products split their rows between the calling thread
// and XLA's own intra-op thread pool (Ctx<ThreadPool>): no second pool competes with XLA's threads.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 reports its own intrinsics' deliberately undefined lanes (_mm512_undefined_*) as
// uninitialized wherever they are inlined: false positives that would bury real warnings.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define TERRA_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------
// Instruction set, chosen once.

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int DetectIsa() {
#if TERRA_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

const int kSupportedIsa = DetectIsa();
// What the handlers use: the best supported, or a lower one asked for (terra_narrow_products_isa).
std::atomic<int> g_isa{kSupportedIsa};

// ---------------------------------------------------------------------------------------------
// One product's operands, all row-major.

template <typename W>
struct Product {
  const float* x;      // [batch, n_in]
  const W* values;     // [n_out, n_in]
  const float* scale;  // [n_out, groups]; nullptr: all 1 (bfloat16)
  float* y;            // [batch, n_out]
  int64_t batch, n_in, n_out, groups;

  float Scale(int64_t o, int64_t g) const { return scale ? scale[o * groups + g] : 1.0f; }
};

inline float Widen(int8_t v) { return static_cast<float>(v); }
inline float Widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Portable C++: any machine.
template <typename W>
void OutputMajorScalar(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  const int64_t group = p.n_in / p.groups;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const W* row = p.values + o * p.n_in;
    for (int64_t b = 0; b < p.batch; ++b) {
      const float* x = p.x + b * p.n_in;
      float total = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float acc = 0.0f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) acc += x[i] * Widen(row[i]);
        total += acc * p.Scale(o, g);
      }
      p.y[b * p.n_out + o] = total;
    }
  }
}

#if TERRA_X86

// ---------------------------------------------------------------------------------------------
// How the vector kernels walk the weights (measured on a 2-core EPYC, 96 MiB of weights, B = 1..8).
//
// Rows of `values` are read R at a time (4, or 2 when B > 4: up to 16 accumulators), each vector of
// x multiplied into all R rows, so every x load serves R rows: x stays float32, 4 bytes against
// each weight's 1 or 2, and once its rows no longer fit in L1 beside the streaming weights
// (d_model 9216: 36 KiB) reading rows one at a time ran 1.5-2x slower. With the prefetch below,
// R rows at a time measured as fast as one at a time on short rows, or faster.

// One core alone keeps too few cache misses in flight to stream at the machine's bandwidth while it
// computes: asking for the weights 8 KiB of reading ahead, into L2, measured 20-40% faster than the
// hardware prefetcher alone (2 KiB ahead into L1: 10-20%; 16 KiB: less again).
constexpr int64_t kPrefetchBytes = 8 << 10;

// Prefetches what R rows read together (from `rows`, `n` weights each, now at input `i`) will
// need kPrefetchBytes of reading later: each row's stream moves at 1/R of the pace, so it looks
// kPrefetchBytes / R ahead, in its own row or, past its end, in the same row of the next R (for
// rows shorter than that, somewhere in the rows ahead: still lines about to be read).
// Every step asks for the line it looks ahead to, even when an earlier step already did (a step
// reads 16 bytes of each row of int8, 32 of bfloat16): asking once per line measured up to 40%
// slower for bfloat16.
template <typename W, int R>
inline void PrefetchRows(const W* rows, int64_t n, int64_t i, int count) {
  const int64_t step_bytes = count * static_cast<int64_t>(sizeof(W));
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(W));
  const int64_t ahead = i * static_cast<int64_t>(sizeof(W)) + kPrefetchBytes / R;
  // Integer addresses: the lines past the last row are never read, and prefetching them is harmless.
  const uintptr_t base = reinterpret_cast<uintptr_t>(rows) + (ahead < row_bytes ? ahead : (R - 1) * row_bytes + ahead);
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < step_bytes; k += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + r * row_bytes + k), _MM_HINT_T1);
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 weights per vector (16 vector registers). Tails go through zero-padded buffers.

#define TERRA_AVX2 __attribute__((target("avx2,fma")))

TERRA_AVX2 inline __m256 Widen8(const int8_t* v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}
TERRA_AVX2 inline __m256 Widen8(const uint16_t* v) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
template <typename W>
TERRA_AVX2 inline __m256 Widen8(const W* v, int64_t m) {
  W padded[8] = {};
  std::memcpy(padded, v, m * sizeof(W));
  return Widen8(padded);
}
TERRA_AVX2 inline __m256 Load8(const float* x, int64_t m) {
  float padded[8] = {};
  std::memcpy(padded, x, m * sizeof(float));
  return _mm256_loadu_ps(padded);
}
TERRA_AVX2 inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows [o, o + R) against the B rows of x: R * B accumulators, 8 inputs per step.
template <typename W, int B, int R>
TERRA_AVX2 void RowsAvx2(const Product<W>& p, int64_t o) {
  const int64_t n = p.n_in, group = n / p.groups;
  const W* rows = p.values + o * n;
  __m256 total[R][B];
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
    int64_t i = g * group;
    const int64_t end = i + group;
    for (; i + 8 <= end; i += 8) {
      PrefetchRows<W, R>(rows, n, i, 8);
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = Widen8(rows + r * n + i);
      for (int b = 0; b < B; ++b) {
        const __m256 xv = _mm256_loadu_ps(p.x + b * n + i);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(w[r], xv, acc[r][b]);
      }
    }
    if (i < end) {
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = Widen8(rows + r * n + i, end - i);
      for (int b = 0; b < B; ++b) {
        const __m256 xv = Load8(p.x + b * n + i, end - i);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(w[r], xv, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(p.Scale(o + r, g));
      for (int b = 0; b < B; ++b)
        total[r][b] = g == 0 ? _mm256_mul_ps(acc[r][b], s) : _mm256_fmadd_ps(acc[r][b], s, total[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) p.y[b * p.n_out + o + r] = Sum8(total[r][b]);
}

template <typename W, int B, int R>
TERRA_AVX2 void RangeAvx2(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) RowsAvx2<W, B, R>(p, o);
  for (; o < o_end; ++o) RowsAvx2<W, B, 1>(p, o);
}

// R * B accumulators of 16 registers (at most 8), leaving room for R weights and one x vector.
template <typename W, int B>
TERRA_AVX2 void OutputMajorAvx2B(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  RangeAvx2<W, B, (B <= 2 ? 4 : B <= 4 ? 2 : 1)>(p, o_begin, o_end);
}

template <typename W>
TERRA_AVX2 void OutputMajorAvx2(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  switch (p.batch) {
    case 1: return OutputMajorAvx2B<W, 1>(p, o_begin, o_end);
    case 2: return OutputMajorAvx2B<W, 2>(p, o_begin, o_end);
    case 3: return OutputMajorAvx2B<W, 3>(p, o_begin, o_end);
    case 4: return OutputMajorAvx2B<W, 4>(p, o_begin, o_end);
    case 5: return OutputMajorAvx2B<W, 5>(p, o_begin, o_end);
    case 6: return OutputMajorAvx2B<W, 6>(p, o_begin, o_end);
    case 7: return OutputMajorAvx2B<W, 7>(p, o_begin, o_end);
    case 8: return OutputMajorAvx2B<W, 8>(p, o_begin, o_end);
    default: return OutputMajorScalar(p, o_begin, o_end);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL): 16 weights per vector (32 vector registers), tails by masked loads.

#define TERRA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

TERRA_AVX512 inline __m512 Widen16(const int8_t* v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
}
TERRA_AVX512 inline __m512 Widen16(const uint16_t* v) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
TERRA_AVX512 inline __m512 Widen16(const int8_t* v, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, v)));
}
TERRA_AVX512 inline __m512 Widen16(const uint16_t* v, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v)), 16));
}

// Output rows [o, o + R) against the B rows of x: R * B accumulators, 16 inputs per step.
template <typename W, int B, int R>
TERRA_AVX512 void RowsAvx512(const Product<W>& p, int64_t o) {
  const int64_t n = p.n_in, group = n / p.groups;
  const W* rows = p.values + o * n;
  __m512 total[R][B];
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    int64_t i = g * group;
    const int64_t end = i + group;
    for (; i + 16 <= end; i += 16) {
      PrefetchRows<W, R>(rows, n, i, 16);
      __m512 w[R];
      for (int r = 0; r < R; ++r) w[r] = Widen16(rows + r * n + i);
      for (int b = 0; b < B; ++b) {
        const __m512 xv = _mm512_loadu_ps(p.x + b * n + i);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(w[r], xv, acc[r][b]);
      }
    }
    if (i < end) {
      const __mmask16 m = static_cast<__mmask16>((1u << (end - i)) - 1u);
      __m512 w[R];
      for (int r = 0; r < R; ++r) w[r] = Widen16(rows + r * n + i, m);
      for (int b = 0; b < B; ++b) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, p.x + b * n + i);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(w[r], xv, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(p.Scale(o + r, g));
      for (int b = 0; b < B; ++b)
        total[r][b] = g == 0 ? _mm512_mul_ps(acc[r][b], s) : _mm512_fmadd_ps(acc[r][b], s, total[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) p.y[b * p.n_out + o + r] = _mm512_reduce_add_ps(total[r][b]);
}

template <typename W, int B, int R>
TERRA_AVX512 void RangeAvx512(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) RowsAvx512<W, B, R>(p, o);
  for (; o < o_end; ++o) RowsAvx512<W, B, 1>(p, o);
}

// R * B accumulators of 32 registers (at most 16), leaving room for R weights and one x vector.
template <typename W, int B>
TERRA_AVX512 void OutputMajorAvx512B(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  RangeAvx512<W, B, (B <= 4 ? 4 : 2)>(p, o_begin, o_end);
}

template <typename W>
TERRA_AVX512 void OutputMajorAvx512(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  switch (p.batch) {
    case 1: return OutputMajorAvx512B<W, 1>(p, o_begin, o_end);
    case 2: return OutputMajorAvx512B<W, 2>(p, o_begin, o_end);
    case 3: return OutputMajorAvx512B<W, 3>(p, o_begin, o_end);
    case 4: return OutputMajorAvx512B<W, 4>(p, o_begin, o_end);
    case 5: return OutputMajorAvx512B<W, 5>(p, o_begin, o_end);
    case 6: return OutputMajorAvx512B<W, 6>(p, o_begin, o_end);
    case 7: return OutputMajorAvx512B<W, 7>(p, o_begin, o_end);
    case 8: return OutputMajorAvx512B<W, 8>(p, o_begin, o_end);
    default: return OutputMajorScalar(p, o_begin, o_end);
  }
}

#endif  // TERRA_X86

template <typename W>
void OutputMajorRange(int isa, const Product<W>& p, int64_t o_begin, int64_t o_end) {
#if TERRA_X86
  if (isa == kAvx512) return OutputMajorAvx512(p, o_begin, o_end);
  if (isa == kAvx2) return OutputMajorAvx2(p, o_begin, o_end);
#endif
  OutputMajorScalar(p, o_begin, o_end);
}

// ---------------------------------------------------------------------------------------------
// Splitting a product between the calling thread and XLA's intra-op pool.
//
// The rows are cut into chunks that every participant claims from one atomic counter, so a helper
// that starts late (a sleeping pool thread takes tens of microseconds to wake) simply finds fewer
// chunks left: the caller never waits for a helper to start, only for chunks already claimed to
// finish. The shared state is reference-counted, so a helper that runs after the call returned
// finds no chunk and touches nothing but that state.

// Below this many weight bytes a product runs on the calling thread alone: waking a helper costs
// more than it saves (streamed int8, 2-core EPYC: 128 KiB took 8.5 us alone, 11.6 us split;
// 256 KiB 13.8 us alone, 9.4 us split).
constexpr int64_t kParallelBytes = 256 << 10;
// Bytes of weights per chunk: small enough to balance two threads, large enough that claiming one
// (an atomic add) costs nothing next to streaming it.
constexpr int64_t kChunkBytes = 64 << 10;

struct Split {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n_chunks = 0;
  std::function<void(int64_t chunk)> run;

  void Work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) {
      run(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs run(chunk) for every chunk in [0, n_chunks) on the calling thread and pool helpers.
void Parallel(ffi::ThreadPool& pool, int64_t n_chunks, std::function<void(int64_t)> run) {
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  // The calling thread is one of the cores: more helpers than the other cores would only contend.
  const int64_t helpers = std::max<int64_t>(0, std::min({pool.num_threads(), cores - 1, n_chunks - 1}));
  if (helpers == 0) {
    for (int64_t c = 0; c < n_chunks; ++c) run(c);
    return;
  }
  auto split = std::make_shared<Split>();
  split->n_chunks = n_chunks;
  split->run = std::move(run);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([split] { split->Work(); });
  split->Work();
  while (split->done.load(std::memory_order_acquire) < n_chunks) {
#if TERRA_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }
}

template <typename W>
void OutputMajor(ffi::ThreadPool& pool, const Product<W>& p) {
  const int isa = g_isa.load(std::memory_order_relaxed);
  const int64_t row_bytes = std::max<int64_t>(1, p.n_in * static_cast<int64_t>(sizeof(W)));
  if (p.n_out * row_bytes < kParallelBytes) return OutputMajorRange(isa, p, 0, p.n_out);
  // Whole groups of 4 rows per chunk, so that interleaved rows never leave a remainder mid-range.
  const int64_t rows = std::max<int64_t>(4, (kChunkBytes / row_bytes + 3) / 4 * 4);
  const int64_t n_chunks = (p.n_out + rows - 1) / rows;
  Parallel(pool, n_chunks, [&](int64_t c) { OutputMajorRange(isa, p, c * rows, std::min(p.n_out, (c + 1) * rows)); });
}

// ---------------------------------------------------------------------------------------------
// Handlers.

constexpr int64_t kMaxRows = 8;  // rows of x: decoding's batch or beams (kernels.MAX_ROWS)

ffi::Error CheckShapes(ffi::Span<const int64_t> x, ffi::Span<const int64_t> values, ffi::Span<const int64_t> y) {
  if (x.size() != 2 || values.size() != 2 || y.size() != 2)
    return ffi::Error::InvalidArgument("narrow product: x, values and y must be 2-D");
  if (x[1] != values[1] || y[0] != x[0] || y[1] != values[0])
    return ffi::Error::InvalidArgument("narrow product: x [B, in], values [out, in] and y [B, out] disagree");
  if (x[0] > kMaxRows) return ffi::Error::InvalidArgument("narrow product: at most 8 rows of x");
  return ffi::Error::Success();
}

ffi::Error OutputMajorInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                               ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(x.dimensions(), values.dimensions(), y->dimensions()); error.failure()) return error;
  const int64_t n_out = values.dimensions()[0], n_in = values.dimensions()[1];
  const auto s = scale.dimensions();
  const int64_t groups = s.size() == 2 ? s[1] : 1;
  if (s.size() < 1 || s.size() > 2 || s[0] != n_out || groups < 1 || n_in % groups != 0)
    return ffi::Error::InvalidArgument("narrow product: scale must be [out] or [out, groups], groups dividing in");
  OutputMajor<int8_t>(pool, {x.typed_data(), values.typed_data(), scale.typed_data(), y->typed_data(),
                             x.dimensions()[0], n_in, n_out, groups});
  return ffi::Error::Success();
}

ffi::Error OutputMajorBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> values,
                               ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(x.dimensions(), values.dimensions(), y->dimensions()); error.failure()) return error;
  OutputMajor<uint16_t>(pool, {x.typed_data(), values.typed_data(), nullptr, y->typed_data(), x.dimensions()[0],
                               values.dimensions()[1], values.dimensions()[0], 1});
  return ffi::Error::Success();
}

}  // namespace

// The library is built with hidden visibility (no header internals exported); these are its API.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_output_major_int8, OutputMajorInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_output_major_bf16, OutputMajorBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The instruction set the handlers use: 0 portable C++, 1 AVX2+FMA, 2 AVX-512. request < 0 only
// asks; otherwise the handlers switch to min(request, the best this CPU supports), so that one
// machine can check every variant. Returns the set now in use.
extern "C" int terra_narrow_products_isa(int request) {
  if (request >= 0) g_isa.store(std::min(request, kSupportedIsa));
  return g_isa.load();
}

#pragma GCC visibility pop

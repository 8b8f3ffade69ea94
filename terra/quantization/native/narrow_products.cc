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
// and, for the sparse layers (any B up to 256 for the input-major product, up to 8 for the others):
//   terra_input_major_{int8,bf16}   x f32[B, in], values [in, out], scale f32[in, G] (int8; G groups
//                                   of out / G consecutive outputs) -> y f32[B, out]
//   terra_gathered_dot_{int8,bf16}  x f32[B, d], values [n, d], scale f32[n] (int8), rows s32[B, k]
//                                   -> y f32[B, k], y[b, j] = values[rows[b, j]] . x[b]
//   terra_gathered_sum_{int8,bf16}  x f32[B, k], values [n, d], scale f32[n] (int8), rows s32[B, k]
//                                   -> y f32[B, d], y[b] = sum_j x[b, j] values[rows[b, j]]
//
// The instruction set is chosen once at load time (AVX-512, AVX2+FMA or portable C++) with
// __builtin_cpu_supports; each variant is compiled with a target attribute, never -march=native, so
// one build runs on any x86-64 machine. Large products split their rows between the calling thread
// and XLA's own intra-op thread pool (Ctx<ThreadPool>): no second pool competes with XLA's threads.

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 reports its own intrinsics' deliberately undefined lanes (_mm512_undefined_*) as
// uninitialized wherever they are inlined: false positives that would bury real warnings.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The 64-byte vector helpers below are always inlined: no vector ever crosses a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
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

#define TERRA_INLINE inline __attribute__((always_inline))

// Asks for the line at `address` into L2 (any address: a prefetch never faults). An asm statement,
// because GCC 12 drops __builtin_prefetch and _mm_prefetch from some of the loops below.
TERRA_INLINE void PrefetchLine(uintptr_t address) {
#if TERRA_X86
  asm volatile("prefetcht1 (%0)" ::"r"(address));
#else
  __builtin_prefetch(reinterpret_cast<const void*>(address), 0, 2);
#endif
}

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
      PrefetchLine(base + r * row_bytes + k);
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

// The 16 sums of v[0..16) as one vector (sum r = lane r): a transpose-and-add tree of 45
// instructions, against about 10 for each _mm512_reduce_add_ps.
TERRA_AVX512 inline __m512 SumsOf16(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [r0 r1 r0 r1] partial sums of rows 2k, 2k + 1
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: [r0 r1 r2 r3] of rows 4k..4k + 3
    const __m512d a = _mm512_castps_pd(pairs[2 * k]), b = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the four 128-bit lanes: [q0 (lanes 0+1), q0 (2+3), q1 (0+1), q1 (2+3)], then whole sums.
  const __m512 h0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 h1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h0, h1, 0x88), _mm512_shuffle_f32x4(h0, h1, 0xdd));
}

// One row of x against short rows of values (at most kShortRow inputs: the sparse feed-forward
// controller's [d_ff, d_lowrank] up-projection), 16 outputs at a time with one accumulator each:
// with few inputs per output, reducing each output's vector on its own (RowsAvx512) costs about as
// much as its multiply-adds; here 16 outputs share one reduction tree and a prefetch per line.
constexpr int64_t kShortRow = 256;
// Streamed from memory by one core, [6144, 96] int8 ran at 9.4, 13.9, 16.9 and 16.5 GB/s asking
// 2, 4, 16 and 32 KiB ahead.
constexpr int64_t kShortRowPrefetchBytes = 16 << 10;

template <typename W>
TERRA_AVX512 void ShortRowsAvx512(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  const int64_t n = p.n_in, row_bytes = n * static_cast<int64_t>(sizeof(W));
  int64_t o = o_begin;
  for (; o + 16 <= o_end; o += 16) {
    const W* rows = p.values + o * n;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(rows) + kShortRowPrefetchBytes;
    for (int64_t line = 0; line < 16 * row_bytes; line += 64) PrefetchLine(ahead + line);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 xv = _mm512_loadu_ps(p.x + i);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(Widen16(rows + r * n + i), xv, acc[r]);
    }
    if (i < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
      const __m512 xv = _mm512_maskz_loadu_ps(m, p.x + i);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(Widen16(rows + r * n + i, m), xv, acc[r]);
    }
    __m512 y = SumsOf16(acc);
    if (p.scale) y = _mm512_mul_ps(y, _mm512_loadu_ps(p.scale + o));
    _mm512_storeu_ps(p.y + o, y);
  }
  if (o < o_end) RangeAvx512<W, 1, 4>(p, o, o_end);
}

template <typename W>
TERRA_AVX512 void OutputMajorAvx512(const Product<W>& p, int64_t o_begin, int64_t o_end) {
  if (p.batch == 1 && p.groups == 1 && p.n_in <= kShortRow) return ShortRowsAvx512(p, o_begin, o_end);
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

// A call's work is one or more phases run in order (a fused layer's chain of products, each
// needing the last one's output), each cut into chunks claimed from its own atomic counter. The
// calling thread opens a phase, claims its chunks, and waits for the chunks claimed by helpers
// before it opens the next; helpers follow it from phase to phase.
struct Phases {
  static constexpr int kMax = 4;
  int n_phases = 0;
  int64_t n_chunks[kMax] = {};
  std::atomic<int> open{-1};
  std::atomic<int64_t> next[kMax];
  std::atomic<int64_t> done[kMax];
  std::function<void(int phase, int64_t chunk)> run;

  Phases() {
    for (int p = 0; p < kMax; ++p) next[p].store(0), done[p].store(0);
  }

  // Claims and runs chunks of phase p until none is left; returns after the last claimed by this thread.
  void Work(int p) {
    for (int64_t c; (c = next[p].fetch_add(1, std::memory_order_relaxed)) < n_chunks[p];) {
      run(p, c);
      done[p].fetch_add(1, std::memory_order_release);
    }
  }

  void Help() {
    for (int p; (p = open.load(std::memory_order_acquire)) < n_phases;) {
      if (p >= 0) Work(p);
      for (int64_t spins = 0; open.load(std::memory_order_acquire) == p;) Pause(spins);
    }
  }

  // A waiting thread spins for about 1.6 us (64 pauses of 25 ns on Zen 4), then yields its core at each check: XLA's
  // executor runs independent operations on the same pool (the Terraformer's two residual
  // streams), and a thread spinning on a core that an operation it waits for needs held that
  // operation off for a scheduler time slice (single layer norms of 3 ms in the generation loop).
  // `spins` counts on every platform: LingeringHelpers::Wait reads it to know when to look at the clock.
  static TERRA_INLINE void Pause(int64_t& spins) {
    ++spins;
#if TERRA_X86
    if (spins < kSpins) return _mm_pause();
#endif
    std::this_thread::yield();
  }
  static constexpr int64_t kSpins = 64;
};

// Helpers stay for the next call. A pool thread woken for a call started its chunks 12 us after
// the call began (18 us in the dense int8 step), a sixth of a fused sparse layer's call, during
// which one core worked alone; the calls of a decode step come a few microseconds apart. So a
// helper that has finished waits up to kLingerNs for the next call's phases before it gives its
// pool thread back, and a call that finds a helper waiting hands its phases to it instead of
// scheduling one. A call never waits for a helper: one that arrives late finds the phases closed.
class LingeringHelpers {
 public:
  // Hands `phases` to a waiting helper; false when none is waiting for work.
  bool Post(const std::shared_ptr<Phases>& phases) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (waiting_ <= static_cast<int64_t>(posted_.size())) return false;
    posted_.push_back(phases);
    generation_.fetch_add(1, std::memory_order_release);
    return true;
  }

  // Called by a helper that has finished a call: the next call's phases, or null after kLingerNs.
  std::shared_ptr<Phases> Wait() {
    int64_t seen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++waiting_;
      seen = generation_.load(std::memory_order_relaxed);
    }
    const auto start = std::chrono::steady_clock::now();
    for (int64_t spins = 0;;) {
      const bool posted = generation_.load(std::memory_order_acquire) != seen;
      // The clock is read at each yield, and every 64 pauses before.
      const bool expired = !posted && (spins >= Phases::kSpins || (spins & 63) == 63) &&
                           std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kLingerNs);
      if (posted || expired) {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_relaxed);
        if (!posted_.empty()) {
          std::shared_ptr<Phases> phases = std::move(posted_.back());
          posted_.pop_back();
          --waiting_;
          return phases;
        }
        if (expired) {
          --waiting_;
          return nullptr;
        }
      }
      Phases::Pause(spins);
    }
  }

  static constexpr int64_t kLingerNs = 100000;

 private:
  std::mutex mutex_;
  int64_t waiting_ = 0;  // helpers in Wait, each owed at most one posted call
  std::vector<std::shared_ptr<Phases>> posted_;
  std::atomic<int64_t> generation_{0};
};

// Never destroyed: a pool thread may still be waiting in it while the process exits.
LingeringHelpers& Lingering() {
  static LingeringHelpers* helpers = new LingeringHelpers;
  return *helpers;
}

// Threads that share a parallel call's chunks: the caller and its pool helpers, one per other core.
int64_t Workers(ffi::ThreadPool& pool) {
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return 1 + std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), cores - 1));
}

// Runs run(phase, chunk) for the chunks of every phase in order (at most Phases::kMax); `parallel`:
// share them with pool helpers.
void RunPhases(ffi::ThreadPool& pool, bool parallel, std::initializer_list<int64_t> chunks,
               std::function<void(int, int64_t)> run) {
  const int64_t helpers = parallel ? Workers(pool) - 1 : 0;
  if (helpers == 0) {
    int p = 0;
    for (int64_t n : chunks) {
      for (int64_t c = 0; c < n; ++c) run(p, c);
      ++p;
    }
    return;
  }
  auto phases = std::make_shared<Phases>();
  for (int64_t n : chunks)
    if (phases->n_phases < Phases::kMax) phases->n_chunks[phases->n_phases++] = n;
  phases->run = std::move(run);
  for (int64_t h = 0; h < helpers; ++h) {
    if (Lingering().Post(phases)) continue;
    pool.Schedule([phases] {
      for (std::shared_ptr<Phases> next = phases; next; next = Lingering().Wait()) next->Help();
    });
  }
  for (int p = 0; p < phases->n_phases; ++p) {
    phases->open.store(p, std::memory_order_release);
    phases->Work(p);
    for (int64_t spins = 0; phases->done[p].load(std::memory_order_acquire) < phases->n_chunks[p];)
      Phases::Pause(spins);
  }
  phases->open.store(phases->n_phases, std::memory_order_release);
}

// Runs range(begin, end) over [0, n) in chunks of `chunk` on the calling thread and the pool, or
// at once on the calling thread when `work_bytes` is too little to share.
template <typename Range>
void Chunked(ffi::ThreadPool& pool, int64_t n, int64_t chunk, int64_t work_bytes, Range range) {
  if (work_bytes < kParallelBytes || n <= chunk) return range(0, n);
  RunPhases(pool, true, {(n + chunk - 1) / chunk}, [&](int, int64_t c) { range(c * chunk, std::min(n, (c + 1) * chunk)); });
}

template <typename W>
void OutputMajor(ffi::ThreadPool& pool, const Product<W>& p) {
  const int isa = g_isa.load(std::memory_order_relaxed);
  const int64_t row_bytes = std::max<int64_t>(1, p.n_in * static_cast<int64_t>(sizeof(W)));
  // Whole groups of 4 rows per chunk, so that interleaved rows never leave a remainder mid-range.
  const int64_t rows = std::max<int64_t>(4, (kChunkBytes / row_bytes + 3) / 4 * 4);
  Chunked(pool, p.n_out, rows, p.n_out * row_bytes, [&](int64_t o0, int64_t o1) { OutputMajorRange(isa, p, o0, o1); });
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
// Their bodies are plain C++ loops over contiguous runs of weights, written so that the compiler
// vectorises them (lane-wise accumulators, fixed-width inner loops, no reassociation needed), and
// compiled once per instruction set by inlining them into functions with a target attribute: one
// body, three machine codes, the same choice (g_isa) as the output-major kernels.

// 16 lanes of float32 as a GCC/Clang vector: one AVX-512 register, two AVX2
// ones, four SSE ones, whichever the target attribute of the function it is inlined into allows
// (plain loops over a float[16] were vectorised only 4 lanes wide).
constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int8_t Int8Lanes __attribute__((vector_size(kLanes)));
typedef uint16_t Uint16Lanes __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef int16_t Int16Lanes __attribute__((vector_size(kLanes * sizeof(int16_t))));
typedef int32_t Int32Lanes __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Uint32Lanes __attribute__((vector_size(kLanes * sizeof(uint32_t))));

TERRA_INLINE Lanes LoadLanes(const float* x) {
  Lanes lanes;
  std::memcpy(&lanes, x, sizeof lanes);
  return lanes;
}
// Generic widening, for the portable build: GCC 12 widens int8 lanes straight to int32 or float one
// lane at a time, so through int16 and int32.
TERRA_INLINE Lanes GenericWidenLanes(const int8_t* v) {
  Int8Lanes narrow;
  std::memcpy(&narrow, v, sizeof narrow);
  const Int32Lanes wide = __builtin_convertvector(__builtin_convertvector(narrow, Int16Lanes), Int32Lanes);
  return __builtin_convertvector(wide, Lanes);
}
TERRA_INLINE Lanes GenericWidenLanes(const uint16_t* v) {
  Uint16Lanes narrow;
  std::memcpy(&narrow, v, sizeof narrow);
  return reinterpret_cast<Lanes>(__builtin_convertvector(narrow, Uint32Lanes) << 16);
}

// 16 narrow weights as float32 lanes, with instruction set I's own conversions: the generic vector
// conversion above takes 8 instructions for 16 int8 weights where AVX-512 takes 2 (vpmovsxbd,
// vcvtdq2ps), and the bodies below are bound by widening, not by memory, when their weights are
// in cache (96 gathered rows of 1 KiB: 9.3 us on one core, 3x the widened instructions' rate).
template <int I, typename W>
TERRA_INLINE Lanes WidenLanes(const W* v) {
#if TERRA_X86
  if constexpr (I == kAvx512) {
    return reinterpret_cast<Lanes>(Widen16(v));
  } else if constexpr (I == kAvx2) {
    const __m256 low = Widen8(v), high = Widen8(v + 8);
    Lanes lanes;
    std::memcpy(&lanes, &low, sizeof low);
    std::memcpy(reinterpret_cast<char*>(&lanes) + sizeof low, &high, sizeof high);
    return lanes;
  }
#endif
  return GenericWidenLanes(v);
}

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

// Outputs per tile, and rows of x per pass when x has few rows (decoding's batch): a tile's run of
// kTile weights of each input is widened once into two vectors of lanes and multiplied into
// kInputRows rows, whose 2 * kInputRows accumulators stay in registers.
constexpr int64_t kTile = 32;
constexpr int kInputRows = 6;
// A tile reads kTile weights from every input's row, n_out apart: a stride the hardware prefetcher
// does not follow once rows are long (the controller's [96, 6144] up-projection streamed at
// 7-9 GB/s, the sparse loss's [1024, 8000] at 4-6), so it asks for its run kAheadInputs inputs
// ahead itself.
constexpr int64_t kAheadInputs = 32;
// Many rows (the S modules of a multiplicative layer, the windows of a convolution): the product
// is arithmetic-bound, and widening each weight once per pass of kInputRows rows would cost more
// than the multiply-adds. So a block of kBlockInputs inputs of the tile is widened (and scaled)
// once into an L1-resident float32 buffer, and every row of the chunk multiplies it in register
// tiles of R rows (R per instruction set: the accumulators fill the registers without spilling),
// the partial sums kept in y between blocks. Rows are shared out in chunks of kRowChunk so that
// both cores have work even when a layer has only a few tiles of outputs.
constexpr int64_t kBlockInputs = 64;
constexpr int64_t kRowChunk = 24;

// Outputs [c0, c0 + V * kLanes) (within one scale group g) for rows [b0, b0 + R) of x.
template <int I, typename W, int R, int V>
TERRA_INLINE void InputMajorTile(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b0) {
  Lanes acc[R][V] = {};
  const uintptr_t stride = p.n_out * sizeof(W);
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p.values + c0) + kAheadInputs * stride;
  for (int64_t i = 0; i < p.n_in; ++i) {
    const W* v = p.values + i * p.n_out + c0;
    PrefetchLine(ahead + i * stride);
    Lanes w[V];
    for (int k = 0; k < V; ++k) w[k] = WidenLanes<I>(v + k * kLanes);
    const float s = p.scale ? p.scale[i * p.groups + g] : 1.0f;
    for (int r = 0; r < R; ++r) {
      const float xs = p.x[(b0 + r) * p.n_in + i] * s;
      for (int k = 0; k < V; ++k) acc[r][k] += xs * w[k];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (b0 + r) * p.n_out + c0, acc[r], sizeof acc[r]);
}

// Rows [b_begin, b_end) of x, kInputRows at a time, for a tile of V vectors of outputs.
template <int I, typename W, int V>
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
template <int R, int V>
TERRA_INLINE void BlockTile(const float* x, int64_t n_in, float* y, int64_t n_out, const Lanes (*w)[V],
                            int64_t n, int64_t i0, int64_t c0, int64_t b0, bool first) {
  Lanes acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) acc[r][k] = first ? Lanes{} : LoadLanes(y + (b0 + r) * n_out + c0 + k * kLanes);
  const float* xr = x + b0 * n_in + i0;
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < R; ++r) {
      const float xi = xr[r * n_in + i];
      for (int k = 0; k < V; ++k) acc[r][k] += xi * w[i][k];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + (b0 + r) * n_out + c0, acc[r], sizeof acc[r]);
}

template <int R, int V>
TERRA_INLINE void BlockRows(const float* x, int64_t n_in, float* y, int64_t n_out, const Lanes (*w)[V], int64_t n,
                            int64_t i0, int64_t c0, int64_t b_begin, int64_t b_end, bool first) {
  int64_t b0 = b_begin;
  for (; b0 + R <= b_end; b0 += R) BlockTile<R, V>(x, n_in, y, n_out, w, n, i0, c0, b0, first);
  if constexpr (R > 1) {
    if (b0 < b_end) {
      // The chunk's last rows: halving R until it fits (R - 1 templates each would bloat the code).
      BlockRows<(R + 1) / 2, V>(x, n_in, y, n_out, w, n, i0, c0, b0, b_end, first);
    }
  }
}

template <int I, typename W, int R, int V>
TERRA_INLINE void InputMajorBlocked(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b_begin,
                                    int64_t b_end) {
  alignas(64) Lanes w[kBlockInputs][V];
  for (int64_t i0 = 0; i0 < p.n_in; i0 += kBlockInputs) {
    const int64_t n = std::min(kBlockInputs, p.n_in - i0);
    for (int64_t i = 0; i < n; ++i) {
      const W* v = p.values + (i0 + i) * p.n_out + c0;
      const float s = p.scale ? p.scale[(i0 + i) * p.groups + g] : 1.0f;
      for (int k = 0; k < V; ++k) w[i][k] = WidenLanes<I>(v + k * kLanes) * s;
    }
    // The next block's weights are on their way while this one is multiplied (its rows are n_out
    // apart: the hardware prefetcher does not follow them when rows are long).
    const int64_t next_end = std::min(p.n_in, i0 + 2 * kBlockInputs);
    for (int64_t i = i0 + kBlockInputs; i < next_end; ++i) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(p.values + i * p.n_out + c0);
      PrefetchLine(first);
      PrefetchLine(first + V * kLanes * sizeof(W) - 1);
    }
    BlockRows<R, V>(p.x, p.n_in, p.y, p.n_out, w, n, i0, c0, b_begin, b_end, i0 == 0);
  }
}

// Fewer than kLanes outputs (a group's last ones): plain loops, for rows [b_begin, b_end) of x.
template <int I, typename W>
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
TERRA_INLINE int64_t InputMajorRowChunks(const InputMajorProduct<W>& p) {
  return (p.batch + kRowChunk - 1) / kRowChunk;
}

// Vectors of V * kLanes outputs from c0, rows [b_begin, b_end): blocked when the rows are many.
template <int I, typename W, int R, int V>
TERRA_INLINE void InputMajorVectors(const InputMajorProduct<W>& p, int64_t g, int64_t c0, int64_t b_begin,
                                    int64_t b_end) {
  if (b_end - b_begin > kInputRows) return InputMajorBlocked<I, W, R, V>(p, g, c0, b_begin, b_end);
  InputMajorRows<I, W, V>(p, g, c0, b_begin, b_end);
}

// Tile `tile` of scale group g's outputs, for rows [b_begin, b_end) of x.
template <int I, typename W, int R>
TERRA_INLINE void InputMajorTileRows(const InputMajorProduct<W>& p, int64_t g, int64_t tile, int64_t b_begin,
                                     int64_t b_end) {
  const int64_t group = p.n_out / p.groups, c0 = g * group + tile * kTile;
  const int64_t width = std::min(kTile, (g + 1) * group - c0);
  if (width == kTile) return InputMajorVectors<I, W, R, 2>(p, g, c0, b_begin, b_end);
  int64_t c = c0;
  if (width >= kLanes) InputMajorVectors<I, W, R, 1>(p, g, c, b_begin, b_end), c += kLanes;
  if (c < c0 + width) InputMajorNarrowTile<I>(p, g, c, c0 + width - c, b_begin, b_end);
}

// Work item `t` of InputMajorItems: a tile of outputs inside one scale group, for a chunk of rows
// of x. R: the blocked path's register tile of rows.
template <int I, typename W, int R>
TERRA_INLINE void InputMajorItem(const InputMajorProduct<W>& p, int64_t t) {
  const int64_t chunks = InputMajorRowChunks(p), chunk = t % chunks;
  const int64_t b_begin = chunk * kRowChunk, b_end = std::min(p.batch, b_begin + kRowChunk);
  t /= chunks;
  const int64_t tiles_per_group = (p.n_out / p.groups + kTile - 1) / kTile;
  InputMajorTileRows<I, W, R>(p, t / tiles_per_group, t % tiles_per_group, b_begin, b_end);
}

// Every output for rows [b_begin, b_end) of x.
template <int I, typename W, int R>
TERRA_INLINE void InputMajorRowRange(const InputMajorProduct<W>& p, int64_t b_begin, int64_t b_end) {
  const int64_t tiles_per_group = (p.n_out / p.groups + kTile - 1) / kTile;
  for (int64_t g = 0; g < p.groups; ++g)
    for (int64_t tile = 0; tile < tiles_per_group; ++tile) InputMajorTileRows<I, W, R>(p, g, tile, b_begin, b_end);
}

template <typename W>
int64_t InputMajorItems(const InputMajorProduct<W>& p) {
  return p.groups * ((p.n_out / p.groups + kTile - 1) / kTile) * InputMajorRowChunks(p);
}

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

// Selected rows are anywhere in the table, each in its own DRAM page, so reading one row after
// another waits on memory for each: the kernels ask for all the lines of the row kAheadRows ahead
// (in the columns they read) while they read the current one.
constexpr int64_t kAheadRows = 8;

template <typename W>
TERRA_INLINE void PrefetchRow(const GatheredRows<W>& p, int64_t b, int64_t j, int64_t c0, int64_t c1) {
  const W* row = p.Row(p.Index(b, j));
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + c1);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(row + c0) & ~uintptr_t{63}; a < end; a += 64) PrefetchLine(a);
}

// dot for entries [j0, j1) of every row of x. Four accumulators: one would wait on its own
// multiply-add's latency at every step (4 cycles on Zen 4, twice the widening's cost).
template <int I, typename W>
TERRA_INLINE void GatheredDotRange(const GatheredRows<W>& p, int64_t j0, int64_t j1) {
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* x = p.x + b * p.d;
    for (int64_t j = j0; j < std::min(j1, j0 + kAheadRows); ++j) PrefetchRow(p, b, j, 0, p.d);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = p.Index(b, j);
      const W* v = p.Row(r);
      if (j + kAheadRows < j1) PrefetchRow(p, b, j + kAheadRows, 0, p.d);
      Lanes acc[4] = {};
      int64_t i = 0;
      for (; i + 4 * kLanes <= p.d; i += 4 * kLanes)
        for (int u = 0; u < 4; ++u) acc[u] += LoadLanes(x + i + u * kLanes) * WidenLanes<I>(v + i + u * kLanes);
      for (; i + kLanes <= p.d; i += kLanes) acc[0] += LoadLanes(x + i) * WidenLanes<I>(v + i);
      float total = 0.0f;
      for (; i < p.d; ++i) total += x[i] * Widen(v[i]);
      const Lanes sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      for (int64_t l = 0; l < kLanes; ++l) total += sum[l];
      p.y[b * p.k + j] = total * p.Scale(r);
    }
  }
}

// sum for outputs [c0, c1) of every row of x: the selected rows four at a time, so that each
// vector of y is loaded and stored once per four rows.
template <int I, typename W>
TERRA_INLINE void GatheredSumRange(const GatheredRows<W>& p, int64_t c0, int64_t c1) {
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
        Lanes acc = LoadLanes(y + c);
        for (int u = 0; u < kRows; ++u) acc += coefficient[u] * WidenLanes<I>(v[u] + c);
        std::memcpy(y + c, &acc, sizeof acc);
      }
      for (; c < c1; ++c)
        for (int u = 0; u < kRows; ++u) y[c] += coefficient[u] * Widen(v[u][c]);
    }
  }
}

// The three bodies above, compiled for each instruction set.
#define TERRA_BODIES(SUFFIX, ISA, TARGET, ROWS)                                                             \
  template <typename W>                                                                                 \
  TARGET void InputMajorItems##SUFFIX(const InputMajorProduct<W>& p, int64_t t0, int64_t t1) {            \
    for (int64_t t = t0; t < t1; ++t) InputMajorItem<ISA, W, ROWS>(p, t);                                    \
  }                                                                                                     \
  template <typename W>                                                                                 \
  TARGET void GatheredDot##SUFFIX(const GatheredRows<W>& p, int64_t j0, int64_t j1) {                    \
    GatheredDotRange<ISA>(p, j0, j1);                                                                      \
  }                                                                                                     \
  template <typename W>                                                                                 \
  TARGET void GatheredSum##SUFFIX(const GatheredRows<W>& p, int64_t c0, int64_t c1) {                    \
    GatheredSumRange<ISA>(p, c0, c1);                                                                      \
  }

// The blocked input-major product's rows per register tile: 2 * ROWS accumulators of 16 lanes
// are 2 * ROWS of AVX-512's 32 registers, 4 * ROWS of AVX2's 16.
TERRA_BODIES(Scalar, kScalar, , 2)
#if TERRA_X86
TERRA_BODIES(Avx2, kAvx2, TERRA_AVX2, 3)
TERRA_BODIES(Avx512, kAvx512, TERRA_AVX512, 8)
#define TERRA_DISPATCH(NAME, ...)                                    \
  do {                                                               \
    const int isa = g_isa.load(std::memory_order_relaxed);           \
    if (isa == kAvx512) return NAME##Avx512(__VA_ARGS__);            \
    if (isa == kAvx2) return NAME##Avx2(__VA_ARGS__);                \
    return NAME##Scalar(__VA_ARGS__);                                \
  } while (0)
#else
#define TERRA_DISPATCH(NAME, ...) return NAME##Scalar(__VA_ARGS__)
#endif

template <typename W>
void InputMajor(ffi::ThreadPool& pool, const InputMajorProduct<W>& p) {
  const int64_t items = InputMajorItems(p);
  // A tile reads n_in x kTile weights once per call and does batch multiply-adds with each: its
  // work is the weights times the rows (float32 multiply-adds cost about a streamed byte each).
  const int64_t work = p.n_in * p.n_out * (static_cast<int64_t>(sizeof(W)) + p.batch);
  const int64_t rows = std::min(p.batch, kRowChunk);  // an item's rows
  const int64_t per_item = std::max<int64_t>(1, p.n_in * kTile * (static_cast<int64_t>(sizeof(W)) + rows));
  Chunked(pool, items, std::max<int64_t>(1, kChunkBytes / per_item), work,
          [&](int64_t t0, int64_t t1) { TERRA_DISPATCH(InputMajorItems, p, t0, t1); });
}

template <typename W>
void GatheredDot(ffi::ThreadPool& pool, const GatheredRows<W>& p) {
  const int64_t row_bytes = std::max<int64_t>(1, p.d * static_cast<int64_t>(sizeof(W)) * p.batch);
  Chunked(pool, p.k, std::max<int64_t>(1, kChunkBytes / row_bytes), p.k * row_bytes,
          [&](int64_t j0, int64_t j1) { TERRA_DISPATCH(GatheredDot, p, j0, j1); });
}

template <typename W>
void GatheredSum(ffi::ThreadPool& pool, const GatheredRows<W>& p) {
  // Columns in whole cache lines of float32 outputs, each chunk about kChunkBytes of weights.
  const int64_t column_bytes = std::max<int64_t>(1, p.k * static_cast<int64_t>(sizeof(W)) * p.batch);
  const int64_t columns = std::max<int64_t>(16, kChunkBytes / column_bytes / 16 * 16);
  Chunked(pool, p.d, columns, p.d * column_bytes,
          [&](int64_t c0, int64_t c1) { TERRA_DISPATCH(GatheredSum, p, c0, c1); });
}

// ---------------------------------------------------------------------------------------------
// A sparse feed-forward layer's decode step in one call (terra/layers/sparse_feedforward.py):
//
//   low     = x C1ᵀ                                    C1 [L, d], output-major
//   logits  = low C2ᵀ + c_bias                         C2 [F, L] (the decode tree stores it output-major)
//   idx[k]  = first argmax of logits[k N : (k + 1) N]  block k of N units
//   mid[k]  = relu(W1[k N + idx[k]] . x)
//   y       = sum_k mid[k] W2[k N + idx[k]] + b2
//
// Each phase is the same loop as the product the unfused layer calls (OutputMajorRange, the
// gathered dot and sum), so both give the same floats. While a chunk of the controller picks its
// blocks' rows, it asks for their lines of W1, and a chunk of the dot asks for its rows of W2: by
// the time a phase needs its rows they are on their way, where the unfused products could only
// prefetch a few rows ahead of their own reading.
template <typename W>
struct SparseFeedForwardStep {
  Product<W> down, up;         // x -> low, low -> logits (before the bias)
  const float* up_bias;        // [F]
  GatheredRows<W> w1, w2;      // rows: the selected rows, [B, F / N]
  const float* out_bias;       // [d]
  int32_t* indices;            // [B, F / N], in block
  int32_t* rows;               // [B, F / N], in W1 and W2
  int64_t n_units;             // N

  // The first index of the maximum, or N where it is NaN (as block_argmax's max and min compute it).
  int32_t BlockArgmax(const float* logits) const {
    float top = logits[0];
    bool nan = false;
    for (int64_t j = 0; j < n_units; ++j) {
      nan |= logits[j] != logits[j];
      top = logits[j] > top ? logits[j] : top;
    }
    if (nan) return static_cast<int32_t>(n_units);
    for (int64_t j = 0; j < n_units; ++j)
      if (logits[j] == top) return static_cast<int32_t>(j);
    return static_cast<int32_t>(n_units);
  }
};

template <typename W>
void SparseFeedForwardDecode(ffi::ThreadPool& pool, const SparseFeedForwardStep<W>& s) {
  const int isa = g_isa.load(std::memory_order_relaxed);
  const int64_t batch = s.down.batch, d = s.down.n_in, low_rows = s.down.n_out;
  const int64_t n_blocks = s.w1.k, width = static_cast<int64_t>(sizeof(W));
  // Chunks of about kChunkBytes of weights (whole blocks of the controller, whole lines of outputs).
  const int64_t down_rows = std::max<int64_t>(4, kChunkBytes / std::max<int64_t>(1, d * width) / 4 * 4);
  const int64_t up_blocks = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, s.n_units * low_rows * width));
  const int64_t dot_rows = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, d * width * batch));
  const int64_t columns = std::max<int64_t>(16, kChunkBytes / std::max<int64_t>(1, n_blocks * width * batch) / 16 * 16);
  const int64_t bytes = (low_rows * d + s.up.n_out * low_rows + 2 * n_blocks * d * batch) * width;
  auto count = [](int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; };
  RunPhases(pool, bytes >= kParallelBytes,
            {count(low_rows, down_rows), count(n_blocks, up_blocks), count(n_blocks, dot_rows), count(d, columns)},
            [&](int phase, int64_t c) {
              if (phase == 0) {
                OutputMajorRange(isa, s.down, c * down_rows, std::min(low_rows, (c + 1) * down_rows));
              } else if (phase == 1) {
                const int64_t k0 = c * up_blocks, k1 = std::min(n_blocks, k0 + up_blocks);
                OutputMajorRange(isa, s.up, k0 * s.n_units, k1 * s.n_units);
                for (int64_t b = 0; b < batch; ++b) {
                  float* logits = s.up.y + b * s.up.n_out;
                  for (int64_t k = k0; k < k1; ++k) {
                    float* block = logits + k * s.n_units;
                    for (int64_t j = 0; j < s.n_units; ++j) block[j] += s.up_bias[k * s.n_units + j];
                    const int32_t index = s.BlockArgmax(block);
                    s.indices[b * n_blocks + k] = index;
                    s.rows[b * n_blocks + k] = static_cast<int32_t>(k * s.n_units + index);
                    PrefetchRow(s.w1, b, k, 0, d);
                  }
                }
              } else if (phase == 2) {
                const int64_t j0 = c * dot_rows, j1 = std::min(n_blocks, j0 + dot_rows);
                for (int64_t b = 0; b < batch; ++b)
                  for (int64_t j = j0; j < j1; ++j) PrefetchRow(s.w2, b, j, 0, d);
                [&] { TERRA_DISPATCH(GatheredDot, s.w1, j0, j1); }();
                for (int64_t b = 0; b < batch; ++b)
                  for (int64_t j = j0; j < j1; ++j) {
                    float& m = s.w1.y[b * n_blocks + j];
                    m = m < 0.0f ? 0.0f : m;  // relu, NaN kept as jnp.maximum keeps it
                  }
              } else {
                const int64_t c0 = c * columns, c1 = std::min(d, c0 + columns);
                [&] { TERRA_DISPATCH(GatheredSum, s.w2, c0, c1); }();
                for (int64_t b = 0; b < batch; ++b)
                  for (int64_t i = c0; i < c1; ++i) s.w2.y[b * d + i] += s.out_bias[i];
              }
            });
}

// ---------------------------------------------------------------------------------------------
// A sparse QKV layer's decode-step projections in one call (terra/layers/sparse_qkv.py, decode with
// its cache set up: one new position per row of x):
//
//   gated[b, s]  = x[b] * gate[s]                              gate [S, d]
//   u[b, s]      = gated[b, s] E + mult_bias[s]                E [d, M], input-major
//   window[b]    = (conv rows [b, F - 1, S, M], u[b])           new conv rows: window[b, 1:]
//   out_c[b, s]  = unfold_k(window[b])[s] K_c + bias_c        K_c [F, k_c, M, M_out], input-major
//
// for C = 3 convolutions (Q, K with k = 3 and V with k = 1, in self-attention) or 1 (the query of
// encoder-decoder attention); unfold_k(window)[s] is the window's F x k_c modules around s,
// zero-padded at the ends of the module axis, flattened as the layer's unfolded product is. The
// products are the input-major kernel's loops (the same floats as the unfused layer's calls). The
// rows b * S + s are shared out in chunks, each computed through by one thread in two phases: its
// gated rows and their multiplicative product, then (once every u is known: a window reads the
// modules on either side) its windows and convolutions. Split by rows, a thread reads only rows it
// wrote itself; split by tiles of outputs (the unfused products' work items), both threads read
// every row of gated and windows, half of them from the other core's cache, and each reads half of
// every line of the weights (the 800M self-attention layer: 56-65 against 51-58 us).
constexpr int kMaxConvolutions = 3;

template <typename W>
struct Convolution {
  InputMajorProduct<W> product;  // x: the unfolded windows [B * S, F * k * M]; y [B * S, M_out]
  const float* bias;             // [M_out]
  int64_t k;                     // modules per window
};

// The attention of a decode step's one query per head over its keys and values (terra/layers/
// attention.py), for layers whose S modules are the heads (M = d_head), so that row b * S + s of
// the convolutions' outputs is head s of batch row b and the thread that computed a row attends
// with it. kSelf: causal self-attention over the KV cache [B, H, L, Dh], positions < index visible
// (and key_mask, where a prefill padded them), plus the new key and value, which are then written at
// position min(index, L - 1) after the reads (the aliased cache is updated in place); kCross: over
// the encoder's keys and values with an additive bias [B, L]. Masked positions are skipped: their
// probability is exactly 0 in the layer's softmax too (exp(-1e9 - max) underflows), and a causal
// query always sees its own key.
struct DecodeAttention {
  enum Mode : int64_t { kNone = 0, kSelf = 1, kCross = 2 };
  int64_t mode = kNone;
  float* keys = nullptr;     // [B, H, L, Dh]
  float* values = nullptr;   // [B, H, L, Dh]
  int64_t length = 0;        // L
  int64_t index = 0;         // kSelf: the new position
  const bool* key_mask = nullptr;  // kSelf: [B, L]
  const float* bias = nullptr;     // kCross: [B, L]
  float* y = nullptr;        // [B, H * Dh]
};

TERRA_INLINE float Dot(const float* a, const float* b, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += LoadLanes(a + i) * LoadLanes(b + i);
  float total = 0.0f;
  for (; i < n; ++i) total += a[i] * b[i];
  for (int64_t l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// Head row r (batch b = r / H, head h = r % H) of query q, new key k and value v (self only), each [Dh].
TERRA_INLINE void AttendRow(const DecodeAttention& a, int64_t r, int64_t heads, int64_t dh, const float* q,
                            const float* k, const float* v) {
  const int64_t b = r / heads, length = a.length;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dh)));  // as the layer's q.shape[-1] ** -0.5
  float* keys = a.keys + r * length * dh;
  float* values = a.values + r * length * dh;
  const int64_t past = a.mode == DecodeAttention::kSelf ? std::min(a.index, length) : length;
  thread_local std::vector<float> scaled_buffer, logit_buffer;
  thread_local std::vector<int64_t> seen_buffer;
  scaled_buffer.resize(static_cast<size_t>(dh));
  logit_buffer.resize(static_cast<size_t>(past + 1));
  seen_buffer.resize(static_cast<size_t>(past + 1));
  float* scaled = scaled_buffer.data();
  float* logits = logit_buffer.data();
  int64_t* seen = seen_buffer.data();
  for (int64_t d = 0; d < dh; ++d) scaled[d] = q[d] * scale;
  int64_t n = 0;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < past; ++l) {
    if (a.key_mask && !a.key_mask[b * length + l]) continue;
    float logit = Dot(scaled, keys + l * dh, dh);
    if (a.bias) logit += a.bias[b * length + l];
    seen[n] = l, logits[n] = logit, top = std::max(top, logit), ++n;
  }
  const bool self = a.mode == DecodeAttention::kSelf;
  if (self) logits[n] = Dot(scaled, k, dh), top = std::max(top, logits[n]);
  float total = 0.0f;
  for (int64_t j = 0; j < n + self; ++j) total += (logits[j] = std::exp(logits[j] - top));
  float* y = a.y + r * dh;
  std::fill(y, y + dh, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float p = logits[j] / total;
    const float* value = values + seen[j] * dh;
    for (int64_t d = 0; d < dh; ++d) y[d] += p * value[d];
  }
  if (self) {
    const float p = logits[n] / total;
    for (int64_t d = 0; d < dh; ++d) y[d] += p * v[d];
    const int64_t position = std::max<int64_t>(0, std::min(a.index, length - 1));
    std::memcpy(keys + position * dh, k, dh * sizeof(float));
    std::memcpy(values + position * dh, v, dh * sizeof(float));
  }
}

template <typename W>
struct SparseAttentionStep {
  const float* x;           // [B, d]
  const W* gate;            // [S, d]
  const float* gate_scale;  // [S] (nullptr: bfloat16)
  InputMajorProduct<W> mult;  // x: gated [B * S, d]; values E [d, M]; y: u [B * S, M]
  const float* mult_bias;   // [S * M]
  const float* rows;        // [B, F - 1, S, M]
  float* new_rows;          // [B, F - 1, S, M]
  int64_t batch, d, n_modules, module, length;  // B, d, S, M, F
  Convolution<W> convs[kMaxConvolutions];
  int n_convs;
  float* gated;                       // mult.x
  float* windows[kMaxConvolutions];  // convs[c].product.x
  DecodeAttention attention;          // after the convolutions, for the same rows (heads)

  // Rows b * S + s per chunk: whole register tiles of the blocked product (kernel R <= 8), one
  // chunk per thread that runs the call (ShareRows). Each chunk widens every weight of E once: at
  // the 17B widths (S = 64, E [9216, 144]) chunks of 8 rows widened E eight times per call.
  static constexpr int64_t kRowTile = 8;
  int64_t rows_per_chunk = kRowTile;
  void ShareRows(int64_t threads) {
    const int64_t per_thread = (batch * n_modules + threads - 1) / threads;
    rows_per_chunk = std::max(kRowTile, (per_thread + kRowTile - 1) / kRowTile * kRowTile);
  }
  int64_t RowChunks() const { return (batch * n_modules + rows_per_chunk - 1) / rows_per_chunk; }
};

template <int I, typename W, int R>
TERRA_INLINE void SparseAttentionChunk(const SparseAttentionStep<W>& s, int phase, int64_t chunk) {
  const int64_t rows = s.batch * s.n_modules, m = s.module, f = s.length;
  const int64_t r0 = chunk * s.rows_per_chunk, r1 = std::min(rows, r0 + s.rows_per_chunk);
  if (phase == 0) {
    // Gated rows r = b * S + module: x[b] * (gate[module] widened with its scale), as the layer's
    // x * widen(gate) computes them; then u = gated E + bias for these rows.
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = s.x + (r / s.n_modules) * s.d;
      const W* gate = s.gate + (r % s.n_modules) * s.d;
      const float scale = s.gate_scale ? s.gate_scale[r % s.n_modules] : 1.0f;
      float* gated = s.gated + r * s.d;
      int64_t i = 0;
      for (; i + kLanes <= s.d; i += kLanes) {
        const Lanes g = LoadLanes(x + i) * (WidenLanes<I>(gate + i) * scale);
        std::memcpy(gated + i, &g, sizeof g);
      }
      for (; i < s.d; ++i) gated[i] = x[i] * (Widen(gate[i]) * scale);
    }
    InputMajorRowRange<I, W, R>(s.mult, r0, r1);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < m; ++c) s.mult.y[r * m + c] += s.mult_bias[(r % s.n_modules) * m + c];
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {  // the windows and new conv rows of rows [r0, r1)
    const int64_t b = r / s.n_modules, module = r % s.n_modules;
    // Window row t of module j: the cached rows, then u.
    auto window = [&](int64_t t, int64_t j) -> const float* {
      return t < f - 1 ? s.rows + ((b * (f - 1) + t) * s.n_modules + j) * m : s.mult.y + (b * s.n_modules + j) * m;
    };
    for (int64_t t = 1; t < f; ++t)
      std::memcpy(s.new_rows + ((b * (f - 1) + t - 1) * s.n_modules + module) * m, window(t, module),
                  m * sizeof(float));
    for (int c = 0; c < s.n_convs; ++c) {
      const Convolution<W>& conv = s.convs[c];
      float* out = s.windows[c] + r * conv.product.n_in;
      for (int64_t t = 0; t < f; ++t)
        for (int64_t j = 0; j < conv.k; ++j, out += m) {
          const int64_t source = module + j - (conv.k - 1) / 2;
          if (source < 0 || source >= s.n_modules)
            std::fill(out, out + m, 0.0f);
          else
            std::memcpy(out, window(t, source), m * sizeof(float));
        }
    }
  }
  for (int c = 0; c < s.n_convs; ++c) {
    const Convolution<W>& conv = s.convs[c];
    InputMajorRowRange<I, W, R>(conv.product, r0, r1);
    const int64_t n_out = conv.product.n_out;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < n_out; ++o) conv.product.y[r * n_out + o] += conv.bias[o];
  }
  if (s.attention.mode == DecodeAttention::kNone) return;
  const bool self = s.attention.mode == DecodeAttention::kSelf;
  for (int64_t r = r0; r < r1; ++r) {
    const float* q = s.convs[0].product.y + r * m;
    AttendRow(s.attention, r, s.n_modules, m, q, self ? s.convs[1].product.y + r * m : nullptr,
              self ? s.convs[2].product.y + r * m : nullptr);
  }
}

#define TERRA_ATTENTION_BODY(SUFFIX, ISA, TARGET, ROWS)                                          \
  template <typename W>                                                                          \
  TARGET void SparseAttentionChunk##SUFFIX(const SparseAttentionStep<W>& s, int phase, int64_t c) { \
    SparseAttentionChunk<ISA, W, ROWS>(s, phase, c);                                             \
  }
TERRA_ATTENTION_BODY(Scalar, kScalar, , 2)
#if TERRA_X86
TERRA_ATTENTION_BODY(Avx2, kAvx2, TERRA_AVX2, 3)
TERRA_ATTENTION_BODY(Avx512, kAvx512, TERRA_AVX512, 8)
#endif

template <typename W>
void SparseAttentionDecode(ffi::ThreadPool& pool, SparseAttentionStep<W>& s) {
  int64_t work = s.mult.n_in * s.mult.n_out * s.mult.batch;  // multiply-adds
  for (int c = 0; c < s.n_convs; ++c) work += s.convs[c].product.n_in * s.convs[c].product.n_out * s.convs[c].product.batch;
  const bool parallel = work >= kParallelBytes;
  s.ShareRows(parallel ? Workers(pool) : 1);
  RunPhases(pool, parallel, {s.RowChunks(), s.RowChunks()},
            [&](int phase, int64_t c) { TERRA_DISPATCH(SparseAttentionChunk, s, phase, c); });
}

// ---------------------------------------------------------------------------------------------
// Handlers.

constexpr int64_t kMaxRows = 8;  // rows of x: decoding's batch or beams (kernels.MAX_ROWS)
constexpr int64_t kMaxInputMajorRows = 256;  // kernels.MAX_INPUT_MAJOR_ROWS

// x [B, in], values [out, in] (output-major) or [in, out] (input-major), y [B, out].
ffi::Error CheckShapes(bool input_major, ffi::Span<const int64_t> x, ffi::Span<const int64_t> values,
                       ffi::Span<const int64_t> y) {
  if (x.size() != 2 || values.size() != 2 || y.size() != 2)
    return ffi::Error::InvalidArgument("narrow product: x, values and y must be 2-D");
  const int64_t n_in = values[input_major ? 0 : 1], n_out = values[input_major ? 1 : 0];
  if (x[1] != n_in || y[0] != x[0] || y[1] != n_out)
    return ffi::Error::InvalidArgument(input_major
                                           ? "input-major product: x [B, in], values [in, out] and y [B, out] disagree"
                                           : "narrow product: x [B, in], values [out, in] and y [B, out] disagree");
  if (x[0] > (input_major ? kMaxInputMajorRows : kMaxRows))
    return ffi::Error::InvalidArgument(input_major ? "input-major product: at most 256 rows of x"
                                                   : "narrow product: at most 8 rows of x");
  return ffi::Error::Success();
}

// int8 scales: one per row of values, or [rows, groups] with groups dividing the row's length.
ffi::Error ScaleGroups(ffi::Span<const int64_t> scale, ffi::Span<const int64_t> values, int64_t* groups) {
  *groups = scale.size() == 2 ? scale[1] : 1;
  if (scale.size() < 1 || scale.size() > 2 || scale[0] != values[0] || *groups < 1 || values[1] % *groups != 0)
    return ffi::Error::InvalidArgument("narrow product: scale must be [rows] or [rows, groups] of values, groups "
                                       "dividing a row");
  return ffi::Error::Success();
}

template <typename W>
void RunProduct(ffi::ThreadPool& pool, bool input_major, const float* x, const W* values, const float* scale,
                float* y, ffi::Span<const int64_t> x_shape, ffi::Span<const int64_t> values_shape, int64_t groups) {
  const int64_t batch = x_shape[0], n_in = x_shape[1], n_out = values_shape[input_major ? 1 : 0];
  if (input_major)
    InputMajor<W>(pool, {x, values, scale, y, batch, n_in, n_out, groups});
  else
    OutputMajor<W>(pool, {x, values, scale, y, batch, n_in, n_out, groups});
}

template <bool kInputMajor>
ffi::Error ProductInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                           ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  int64_t groups = 1;
  if (auto error = CheckShapes(kInputMajor, x.dimensions(), values.dimensions(), y->dimensions()); error.failure())
    return error;
  if (auto error = ScaleGroups(scale.dimensions(), values.dimensions(), &groups); error.failure()) return error;
  RunProduct<int8_t>(pool, kInputMajor, x.typed_data(), values.typed_data(), scale.typed_data(), y->typed_data(),
                     x.dimensions(), values.dimensions(), groups);
  return ffi::Error::Success();
}

template <bool kInputMajor>
ffi::Error ProductBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> values,
                           ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(kInputMajor, x.dimensions(), values.dimensions(), y->dimensions()); error.failure())
    return error;
  RunProduct<uint16_t>(pool, kInputMajor, x.typed_data(), values.typed_data(), nullptr, y->typed_data(),
                       x.dimensions(), values.dimensions(), 1);
  return ffi::Error::Success();
}

// x, values [n_rows, d], rows [B, k]; `dot`: x [B, d] -> y [B, k]; else x [B, k] -> y [B, d].
template <typename W>
ffi::Error Gathered(ffi::ThreadPool& pool, bool dot, const float* x, ffi::Span<const int64_t> x_shape,
                    const W* values, ffi::Span<const int64_t> values_shape, const float* scale,
                    ffi::Span<const int64_t> scale_shape, const int32_t* rows, ffi::Span<const int64_t> rows_shape,
                    float* y, ffi::Span<const int64_t> y_shape) {
  if (x_shape.size() != 2 || values_shape.size() != 2 || rows_shape.size() != 2 || y_shape.size() != 2)
    return ffi::Error::InvalidArgument("gathered rows: x, values, rows and y must be 2-D");
  const int64_t batch = rows_shape[0], k = rows_shape[1], n_rows = values_shape[0], d = values_shape[1];
  const int64_t x_width = dot ? d : k, y_width = dot ? k : d;
  if (x_shape[0] != batch || y_shape[0] != batch || x_shape[1] != x_width || y_shape[1] != y_width || n_rows < 1)
    return ffi::Error::InvalidArgument("gathered rows: x, values [rows, d], rows [B, k] and y disagree");
  if (batch > kMaxRows) return ffi::Error::InvalidArgument("gathered rows: at most 8 rows of x");
  if (scale && (scale_shape.size() != 1 || scale_shape[0] != n_rows))
    return ffi::Error::InvalidArgument("gathered rows: scale must be [rows]");
  const GatheredRows<W> p{x, values, scale, rows, y, batch, k, d, n_rows};
  if (dot)
    GatheredDot(pool, p);
  else
    GatheredSum(pool, p);
  return ffi::Error::Success();
}

template <bool kDot>
ffi::Error GatheredInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  return Gathered<int8_t>(pool, kDot, x.typed_data(), x.dimensions(), values.typed_data(), values.dimensions(),
                          scale.typed_data(), scale.dimensions(), rows.typed_data(), rows.dimensions(),
                          y->typed_data(), y->dimensions());
}

template <bool kDot>
ffi::Error GatheredBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> values,
                            ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  return Gathered<uint16_t>(pool, kDot, x.typed_data(), x.dimensions(), values.typed_data(), values.dimensions(),
                            nullptr, {}, rows.typed_data(), rows.dimensions(), y->typed_data(), y->dimensions());
}

// x [B, d]; the controller's C1 [L, d] and C2 [F, L] with its bias [F / N, N]; W1, W2 [F, d]; b2 [d].
// Results: y [B, d], the block choices [B, F / N], and the intermediates low [B, L], logits
// [B, F], mid [B, F / N] and the selected rows [B, F / N] (XLA's buffers: nothing outlives the call).
template <typename W>
ffi::Error SparseFeedForwardImpl(ffi::ThreadPool& pool, const float* x, ffi::Span<const int64_t> x_shape,
                                 const W* down, ffi::Span<const int64_t> down_shape, const float* down_scale,
                                 const W* up, ffi::Span<const int64_t> up_shape, const float* up_scale,
                                 const float* up_bias, ffi::Span<const int64_t> bias_shape, const W* w1,
                                 const float* w1_scale, const W* w2, const float* w2_scale,
                                 ffi::Span<const int64_t> w_shape, ffi::Span<const int64_t> w2_shape,
                                 const float* out_bias, int64_t out_bias_size, float* y, int32_t* indices,
                                 float* low, float* logits, float* mid, int32_t* rows) {
  if (x_shape.size() != 2 || down_shape.size() != 2 || up_shape.size() != 2 || bias_shape.size() != 2 ||
      w_shape.size() != 2)
    return ffi::Error::InvalidArgument("sparse feed-forward: x, C1, C2, the controller bias and W1/W2 must be 2-D");
  const int64_t batch = x_shape[0], d = x_shape[1], n_low = down_shape[0];
  const int64_t n_blocks = bias_shape[0], n_units = bias_shape[1], n_ff = n_blocks * n_units;
  if (down_shape[1] != d || up_shape[0] != n_ff || up_shape[1] != n_low || w_shape[0] != n_ff || w_shape[1] != d ||
      w2_shape.size() != 2 || w2_shape[0] != n_ff || w2_shape[1] != d || out_bias_size != d || n_ff < 1)
    return ffi::Error::InvalidArgument(
        "sparse feed-forward: x [B, d], C1 [L, d], C2 [F, L], bias [F / N, N], W1, W2 [F, d] and b2 [d] disagree");
  if (batch > kMaxRows) return ffi::Error::InvalidArgument("sparse feed-forward: at most 8 rows of x");
  const SparseFeedForwardStep<W> step{
      {x, down, down_scale, low, batch, d, n_low, 1},
      {low, up, up_scale, logits, batch, n_low, n_ff, 1},
      up_bias,
      {x, w1, w1_scale, rows, mid, batch, n_blocks, d, n_ff},
      {mid, w2, w2_scale, rows, y, batch, n_blocks, d, n_ff},
      out_bias,
      indices,
      rows,
      n_units};
  SparseFeedForwardDecode(pool, step);
  return ffi::Error::Success();
}

#define TERRA_FF_RESULTS                                                                                    \
  ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::S32> indices, ffi::ResultBuffer<ffi::F32> low,      \
      ffi::ResultBuffer<ffi::F32> logits, ffi::ResultBuffer<ffi::F32> mid, ffi::ResultBuffer<ffi::S32> rows
#define TERRA_FF_RESULT_DATA                                                                                 \
  y->typed_data(), indices->typed_data(), low->typed_data(), logits->typed_data(), mid->typed_data(),        \
      rows->typed_data()

ffi::Error SparseFeedForwardInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> down,
                                 ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S8> up,
                                 ffi::Buffer<ffi::F32> up_scale, ffi::Buffer<ffi::F32> up_bias,
                                 ffi::Buffer<ffi::S8> w1, ffi::Buffer<ffi::F32> w1_scale, ffi::Buffer<ffi::S8> w2,
                                 ffi::Buffer<ffi::F32> w2_scale, ffi::Buffer<ffi::F32> out_bias, TERRA_FF_RESULTS) {
  return SparseFeedForwardImpl<int8_t>(pool, x.typed_data(), x.dimensions(), down.typed_data(), down.dimensions(),
                                       down_scale.typed_data(), up.typed_data(), up.dimensions(),
                                       up_scale.typed_data(), up_bias.typed_data(), up_bias.dimensions(),
                                       w1.typed_data(), w1_scale.typed_data(), w2.typed_data(), w2_scale.typed_data(),
                                       w1.dimensions(), w2.dimensions(), out_bias.typed_data(),
                                       static_cast<int64_t>(out_bias.element_count()), TERRA_FF_RESULT_DATA);
}

ffi::Error SparseFeedForwardBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> down,
                                 ffi::Buffer<ffi::U16> up, ffi::Buffer<ffi::F32> up_bias, ffi::Buffer<ffi::U16> w1,
                                 ffi::Buffer<ffi::U16> w2, ffi::Buffer<ffi::F32> out_bias, TERRA_FF_RESULTS) {
  return SparseFeedForwardImpl<uint16_t>(pool, x.typed_data(), x.dimensions(), down.typed_data(),
                                         down.dimensions(), nullptr, up.typed_data(), up.dimensions(), nullptr,
                                         up_bias.typed_data(), up_bias.dimensions(), w1.typed_data(), nullptr,
                                         w2.typed_data(), nullptr, w1.dimensions(), w2.dimensions(),
                                         out_bias.typed_data(), static_cast<int64_t>(out_bias.element_count()),
                                         TERRA_FF_RESULT_DATA);
}

// The sparse attention call's operands, all from the remaining arguments and results: the kind of
// weights (int8 with a scale after each weight, or bfloat16 bits) is the gate's element type, and
// the number of convolutions follows from the number of arguments.
//   args: x [B, d], gate [S, d] (+ scale [S]), E [d, M] (+ scale [d]), mult_bias [S * M],
//         conv rows [B, F - 1, S, M], then per convolution: kernel [F, k, M, M_out] (+ scale
//         [F, k, M]), bias [M_out]
//   rets: per convolution out [B, S, M_out]; new conv rows [B, F - 1, S, M]; then scratch: gated
//         [B * S, d], u [B * S, M], per convolution windows [B * S, F * k * M]
template <typename W>
ffi::Error SparseAttentionImpl(ffi::ThreadPool& pool, int64_t mode, ffi::RemainingArgs args, ffi::RemainingRets rets,
                               bool scaled) {
  if (mode < DecodeAttention::kNone || mode > DecodeAttention::kCross)
    return ffi::Error::InvalidArgument("sparse attention: attention must be 0 (none), 1 (self) or 2 (cross)");
  const size_t per_weight = scaled ? 2 : 1;
  const size_t fixed = 1 + 2 * per_weight + 2;
  const size_t attention_args = mode == DecodeAttention::kSelf ? 4 : mode == DecodeAttention::kCross ? 3 : 0;
  const size_t attention_rets = mode == DecodeAttention::kSelf ? 3 : mode == DecodeAttention::kCross ? 1 : 0;
  if (args.size() < fixed + attention_args + per_weight + 1 ||
      (args.size() - fixed - attention_args) % (per_weight + 1) != 0)
    return ffi::Error::InvalidArgument("sparse attention: wrong number of operands");
  const int n_convs = static_cast<int>((args.size() - fixed - attention_args) / (per_weight + 1));
  if (n_convs > kMaxConvolutions || rets.size() != static_cast<size_t>(2 * n_convs + 3) + attention_rets)
    return ffi::Error::InvalidArgument("sparse attention: at most 3 convolutions, with one result and one window each");
  if (n_convs != (mode == DecodeAttention::kSelf ? 3 : 1) && mode != DecodeAttention::kNone)
    return ffi::Error::InvalidArgument("sparse attention: self-attention takes Q, K and V, cross-attention Q alone");
  for (size_t i = 0; i < args.size(); ++i)
    if (!args.get<ffi::AnyBuffer>(i).has_value()) return ffi::Error::InvalidArgument("sparse attention: unreadable operand");
  for (size_t i = 0; i < rets.size(); ++i)
    if (!rets.get<ffi::AnyBuffer>(i).has_value()) return ffi::Error::InvalidArgument("sparse attention: unreadable result");
  size_t next = 0;
  auto arg = [&]() { return *args.get<ffi::AnyBuffer>(next++); };
  auto data_of = [&](size_t i) { return static_cast<float*>((*rets.get<ffi::AnyBuffer>(i))->untyped_data()); };
  const auto x = arg(), gate = arg();
  const auto* gate_scale = scaled ? static_cast<const float*>(arg().untyped_data()) : nullptr;
  const auto e = arg();
  const auto* e_scale = scaled ? static_cast<const float*>(arg().untyped_data()) : nullptr;
  const auto mult_bias = arg(), rows = arg();
  const auto xd = x.dimensions(), gd = gate.dimensions(), ed = e.dimensions(), rd = rows.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || ed.size() != 2 || rd.size() != 4)
    return ffi::Error::InvalidArgument("sparse attention: x, gate, E must be 2-D and the conv rows 4-D");
  const int64_t batch = xd[0], d = xd[1], n_modules = gd[0], module = ed[1], length = rd[1] + 1;
  if (gd[1] != d || ed[0] != d || rd[0] != batch || rd[2] != n_modules || rd[3] != module ||
      static_cast<int64_t>(mult_bias.element_count()) != n_modules * module || batch * n_modules > kMaxInputMajorRows)
    return ffi::Error::InvalidArgument(
        "sparse attention: x [B, d], gate [S, d], E [d, M], bias [S * M] and conv rows [B, F - 1, S, M] disagree");
  SparseAttentionStep<W> s{};
  s.x = static_cast<const float*>(x.untyped_data());
  s.gate = static_cast<const W*>(gate.untyped_data());
  s.gate_scale = gate_scale;
  s.gated = data_of(n_convs + 1);
  s.mult = {s.gated, static_cast<const W*>(e.untyped_data()), e_scale, data_of(n_convs + 2),
            batch * n_modules, d, module, 1};
  s.mult_bias = static_cast<const float*>(mult_bias.untyped_data());
  // The new conv rows are written over the old ones (the result aliases the operand), which the
  // windows read first: they read a copy (F - 1 rows of S x M floats).
  thread_local std::vector<float> old_rows;
  old_rows.assign(static_cast<const float*>(rows.untyped_data()),
                  static_cast<const float*>(rows.untyped_data()) + rows.element_count());
  s.rows = old_rows.data();
  s.new_rows = data_of(n_convs);
  s.batch = batch, s.d = d, s.n_modules = n_modules, s.module = module, s.length = length, s.n_convs = n_convs;
  for (int c = 0; c < n_convs; ++c) {
    const auto kernel = arg();
    const auto* scale = scaled ? static_cast<const float*>(arg().untyped_data()) : nullptr;
    const auto bias = arg();
    const auto kd = kernel.dimensions();
    if (kd.size() != 4 || kd[0] != length || kd[2] != module || kd[1] % 2 == 0 || static_cast<int64_t>(bias.element_count()) != kd[3])
      return ffi::Error::InvalidArgument(
          "sparse attention: a convolution kernel must be [F, k (odd), M, M_out] with a bias [M_out]");
    s.windows[c] = data_of(n_convs + 3 + c);
    s.convs[c] = {{s.windows[c], static_cast<const W*>(kernel.untyped_data()), scale, data_of(c), batch * n_modules,
                   length * kd[1] * module, kd[3], 1},
                  static_cast<const float*>(bias.untyped_data()), kd[1]};
  }
  if (mode != DecodeAttention::kNone) {
    // self: keys, values [B, H, L, Dh], index s32[], key_mask pred [B, L]; cross: keys, values, bias
    // f32 [B, L]. Results: y [B, H * Dh], and for self the keys and values (aliased to the operands).
    const auto keys = arg(), values = arg();
    const auto kd = keys.dimensions();
    for (int c = 0; c < n_convs; ++c)
      if (s.convs[c].product.n_out != module)
        return ffi::Error::InvalidArgument("sparse attention: fused attention needs convolutions of M outputs");
    if (kd.size() != 4 || kd[0] != batch || kd[1] != n_modules || kd[3] != module || values.dimensions().size() != 4 ||
        values.element_count() != keys.element_count() || kd[2] < 1)
      return ffi::Error::InvalidArgument("sparse attention: keys and values must be [B, S, L, M] (S heads of M)");
    DecodeAttention& a = s.attention;
    a.mode = mode, a.length = kd[2], a.y = data_of(2 * n_convs + 3);
    if (mode == DecodeAttention::kSelf) {
      const auto index = arg(), key_mask = arg();
      if (index.element_type() != ffi::DataType::S32 || index.element_count() != 1 ||
          key_mask.element_type() != ffi::DataType::PRED || static_cast<int64_t>(key_mask.element_count()) != batch * kd[2])
        return ffi::Error::InvalidArgument("sparse attention: the cache index must be s32[] and the key mask pred [B, L]");
      a.index = *static_cast<const int32_t*>(index.untyped_data());
      a.key_mask = static_cast<const bool*>(key_mask.untyped_data());
      a.keys = data_of(2 * n_convs + 4), a.values = data_of(2 * n_convs + 5);
      // The results alias the operands; where XLA could not alias them it copied them in first.
      if (a.keys != keys.untyped_data()) std::memcpy(a.keys, keys.untyped_data(), keys.size_bytes());
      if (a.values != values.untyped_data()) std::memcpy(a.values, values.untyped_data(), values.size_bytes());
    } else {
      const auto bias = arg();
      if (static_cast<int64_t>(bias.element_count()) != batch * kd[2])
        return ffi::Error::InvalidArgument("sparse attention: the encoder bias must be [B, L]");
      a.keys = static_cast<float*>(keys.untyped_data()), a.values = static_cast<float*>(values.untyped_data());
      a.bias = static_cast<const float*>(bias.untyped_data());
    }
  }
  SparseAttentionDecode(pool, s);
  return ffi::Error::Success();
}

ffi::Error SparseAttention(ffi::ThreadPool pool, int64_t attention, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() < 2) return ffi::Error::InvalidArgument("sparse attention: wrong number of operands");
  auto gate = args.get<ffi::AnyBuffer>(1);
  if (!gate.has_value()) return ffi::Error::InvalidArgument("sparse attention: unreadable gate");
  if (gate->element_type() == ffi::DataType::S8) return SparseAttentionImpl<int8_t>(pool, attention, args, rets, true);
  if (gate->element_type() == ffi::DataType::U16)
    return SparseAttentionImpl<uint16_t>(pool, attention, args, rets, false);
  return ffi::Error::InvalidArgument("sparse attention: weights must be int8 or bfloat16 bits (uint16)");
}

}  // namespace

// The library is built with hidden visibility (no header internals exported); these are its API.
#pragma GCC visibility push(default)

// Every handler: the pool, x f32, the values (s8 or u16), then `EXTRA` arguments (an int8 scale
// f32, gathered rows s32), returning y f32.
#define TERRA_HANDLER(SYMBOL, IMPL, VALUES, EXTRA)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, IMPL,                                                     \
                                ffi::Ffi::Bind()                                                  \
                                    .Ctx<ffi::ThreadPool>()                                       \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                 \
                                    .Arg<ffi::Buffer<VALUES>>() EXTRA                             \
                                    .Ret<ffi::Buffer<ffi::F32>>());
#define TERRA_SCALE .Arg<ffi::Buffer<ffi::F32>>()
#define TERRA_ROWS .Arg<ffi::Buffer<ffi::S32>>()

TERRA_HANDLER(terra_output_major_int8, ProductInt8Impl<false>, ffi::S8, TERRA_SCALE)
TERRA_HANDLER(terra_output_major_bf16, ProductBf16Impl<false>, ffi::U16, )
TERRA_HANDLER(terra_input_major_int8, ProductInt8Impl<true>, ffi::S8, TERRA_SCALE)
TERRA_HANDLER(terra_input_major_bf16, ProductBf16Impl<true>, ffi::U16, )
TERRA_HANDLER(terra_gathered_dot_int8, GatheredInt8Impl<true>, ffi::S8, TERRA_SCALE TERRA_ROWS)
TERRA_HANDLER(terra_gathered_sum_int8, GatheredInt8Impl<false>, ffi::S8, TERRA_SCALE TERRA_ROWS)
TERRA_HANDLER(terra_gathered_dot_bf16, GatheredBf16Impl<true>, ffi::U16, TERRA_ROWS)
TERRA_HANDLER(terra_gathered_sum_bf16, GatheredBf16Impl<false>, ffi::U16, TERRA_ROWS)

#define TERRA_F32 .Arg<ffi::Buffer<ffi::F32>>()
#define TERRA_FF_RETS                                                                                    \
  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer< \
      ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_feed_forward_int8, SparseFeedForwardInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>() TERRA_F32
                                  .Arg<ffi::Buffer<ffi::S8>>() TERRA_F32
                                  .Arg<ffi::Buffer<ffi::S8>>() TERRA_F32 TERRA_F32
                                  .Arg<ffi::Buffer<ffi::S8>>() TERRA_F32
                                  .Arg<ffi::Buffer<ffi::S8>>() TERRA_F32 TERRA_F32 TERRA_FF_RETS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_feed_forward_bf16, SparseFeedForwardBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>() TERRA_F32
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>() TERRA_F32
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>() TERRA_F32 TERRA_FF_RETS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_attention, SparseAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("attention")
                                  .RemainingArgs()
                                  .RemainingRets());

// The instruction set the handlers use: 0 portable C++, 1 AVX2+FMA, 2 AVX-512. request < 0 only
// asks; otherwise the handlers switch to min(request, the best this CPU supports), so that one
// machine can check every variant. Returns the set now in use.
extern "C" int terra_narrow_products_isa(int request) {
  if (request >= 0) g_isa.store(std::min(request, kSupportedIsa));
  return g_isa.load();
}

#pragma GCC visibility pop

// The instruction sets the kernels are compiled for, and the one mechanism that compiles them.
//
// Every kernel is written once, as a template over an instruction-set tag (Portable, Avx2, Avx512
// below: the vector width, widening, loads, multiply-adds, reductions and tails of that set). The
// tag's operations carry the set's target attribute; the kernel bodies carry none and are always
// inlined, so that WithIsa can compile a body inside a function with the set's target attribute,
// once per set. The set is chosen at run time (__builtin_cpu_supports), never by -march=native,
// so one build runs on any x86-64 machine.

#ifndef TERRA_BACKENDS_NATIVE_ISA_H_
#define TERRA_BACKENDS_NATIVE_ISA_H_

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 reports its own intrinsics' deliberately undefined lanes (_mm512_undefined_*) as
// uninitialized wherever they are inlined: false positives that would bury real warnings.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The vector operations below are always inlined into a function of their own instruction set:
// no vector crosses a call boundary, so the ABI note on vector arguments does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#include <immintrin.h>
#define TERRA_X86 1
#endif

#define TERRA_INLINE inline __attribute__((always_inline))
// For a lambda handed to WithIsa: its body is compiled inside the instruction set's function.
#define TERRA_INLINE_LAMBDA __attribute__((always_inline))
#define TERRA_AVX2 __attribute__((target("avx2,fma")))
#define TERRA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

namespace terra::native {

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The best instruction set this CPU supports.
int SupportedIsa();
// What the handlers use: the best supported, or a lower one asked for (terra_cpu_kernels_isa).
extern std::atomic<int> g_isa;
inline int ActiveIsa() { return g_isa.load(std::memory_order_relaxed); }

// Asks for the line at `address` into L2 (any address: a prefetch never faults). An asm statement,
// because GCC 12 drops __builtin_prefetch and _mm_prefetch from some of the kernels' loops.
TERRA_INLINE void PrefetchLine(uintptr_t address) {
#if TERRA_X86
  asm volatile("prefetcht1 (%0)" ::"r"(address));
#else
  __builtin_prefetch(reinterpret_cast<const void*>(address), 0, 2);
#endif
}

// One narrow weight as float32: int8 as its value, bfloat16 (its bits as uint16) as the float32
// with the same upper half.
inline float Widen(int8_t v) { return static_cast<float>(v); }
inline float Widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 lanes of float32 as a GCC/Clang vector: one AVX-512 register, two AVX2 ones, four SSE ones,
// whichever the target attribute of the function it is inlined into allows (plain loops over a
// float[16] were vectorised only 4 lanes wide). The kernels whose loops the compiler vectorises
// (input-major, gathered, attention) are written over these lanes.
constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int8_t Int8Lanes __attribute__((vector_size(kLanes)));
typedef uint16_t Uint16Lanes __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef int16_t Int16Lanes __attribute__((vector_size(kLanes * sizeof(int16_t))));
typedef int32_t Int32Lanes __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Uint32Lanes __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// N lanes of float32 and of int32 for code that compares and selects (a ? b : c over a vector
// comparison): GCC compiles such selects to vector instructions only at a width the target's
// registers hold, and one lane at a time through the stack beyond it (16 lanes under AVX2 made the
// LSH chunk attention's masks and softmax slower than its products: docs/architecture.md,
// "Decisions taken from measurements"). Each tag's kSelectLanes is its register width.
template <int64_t N>
struct SelectLanes {
  typedef float Float __attribute__((vector_size(N * sizeof(float))));
  typedef int32_t Int32 __attribute__((vector_size(N * sizeof(int32_t))));
};

TERRA_INLINE Lanes LoadLanes(const float* x) {
  Lanes lanes;
  std::memcpy(&lanes, x, sizeof lanes);
  return lanes;
}
TERRA_INLINE void StoreLanes(float* y, const Lanes& lanes) { std::memcpy(y, &lanes, sizeof lanes); }

// Generic widening: GCC 12 widens int8 lanes straight to int32 or float one lane at a time, so
// through int16 and int32.
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
// float32 weights (the output-major product of a batch): read as they are.
TERRA_INLINE Lanes GenericWidenLanes(const float* v) { return LoadLanes(v); }

// A row of float32, int8 or bfloat16 bits as float32 lanes, and its dot with and scaled sum into a
// float32 vector: the generic forms the attention kernels read their cache rows with.
inline float Widen(float v) { return v; }
TERRA_INLINE Lanes RowLanes(const float* row) { return LoadLanes(row); }
TERRA_INLINE Lanes RowLanes(const int8_t* row) { return GenericWidenLanes(row); }
TERRA_INLINE Lanes RowLanes(const uint16_t* row) { return GenericWidenLanes(row); }

// x . row over n elements (an int8 row's scale is the caller's).
template <typename T>
TERRA_INLINE float RowDot(const float* x, const T* row, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += LoadLanes(x + i) * RowLanes(row + i);
  float total = 0.0f;
  for (; i < n; ++i) total += x[i] * Widen(row[i]);
  for (int64_t l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// y += w * row over n elements.
template <typename T>
TERRA_INLINE void AddScaledRow(float* y, float w, const T* row, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) StoreLanes(y + i, LoadLanes(y + i) + w * RowLanes(row + i));
  for (; i < n; ++i) y[i] += w * Widen(row[i]);
}

// 16 float32 lanes as two halves of 8: what the AVX2 kernels hold where the others hold Lanes.
// GCC has no register for a 16-lane vector under AVX2 and keeps one in memory, so kernels written
// over Lanes ran their accumulators through the stack there, slower than the portable build
// (docs/architecture.md, "Decisions taken from measurements"); each half is one register.
// The operations are the same lane by lane, so the results are the same as over Lanes.
typedef float HalfLanes __attribute__((vector_size(kLanes / 2 * sizeof(float))));
struct SplitLanes {
  HalfLanes lo, hi;
};
TERRA_INLINE SplitLanes operator+(const SplitLanes& a, const SplitLanes& b) { return {a.lo + b.lo, a.hi + b.hi}; }
TERRA_INLINE SplitLanes operator*(const SplitLanes& a, const SplitLanes& b) { return {a.lo * b.lo, a.hi * b.hi}; }
TERRA_INLINE SplitLanes operator*(float s, const SplitLanes& a) { return {s * a.lo, s * a.hi}; }
TERRA_INLINE SplitLanes operator*(const SplitLanes& a, float s) { return {a.lo * s, a.hi * s}; }
TERRA_INLINE SplitLanes& operator+=(SplitLanes& a, const SplitLanes& b) {
  a.lo += b.lo, a.hi += b.hi;
  return a;
}

// 16 float32 lanes as four quarters of 4, for the portable build: a 128-bit register (SSE2, NEON)
// holds one quarter, as an AVX2 register holds one half of SplitLanes.
typedef float QuarterLanes __attribute__((vector_size(kLanes / 4 * sizeof(float))));
struct QuarteredLanes {
  QuarterLanes q0, q1, q2, q3;
};
TERRA_INLINE QuarteredLanes operator+(const QuarteredLanes& a, const QuarteredLanes& b) {
  return {a.q0 + b.q0, a.q1 + b.q1, a.q2 + b.q2, a.q3 + b.q3};
}
TERRA_INLINE QuarteredLanes operator*(const QuarteredLanes& a, const QuarteredLanes& b) {
  return {a.q0 * b.q0, a.q1 * b.q1, a.q2 * b.q2, a.q3 * b.q3};
}
TERRA_INLINE QuarteredLanes operator*(float s, const QuarteredLanes& a) { return {s * a.q0, s * a.q1, s * a.q2, s * a.q3}; }
TERRA_INLINE QuarteredLanes operator*(const QuarteredLanes& a, float s) { return {a.q0 * s, a.q1 * s, a.q2 * s, a.q3 * s}; }
TERRA_INLINE QuarteredLanes& operator+=(QuarteredLanes& a, const QuarteredLanes& b) {
  a.q0 += b.q0, a.q1 += b.q1, a.q2 += b.q2, a.q3 += b.q3;
  return a;
}
// Four narrow weights as one quarter: widened through int32, as GenericWidenLanes widens 16.
TERRA_INLINE QuarterLanes WidenQuarter(const int8_t* v) {
  typedef int8_t Narrow __attribute__((vector_size(4)));
  typedef int32_t Wide32 __attribute__((vector_size(16)));
  Narrow narrow;
  std::memcpy(&narrow, v, sizeof narrow);
  return __builtin_convertvector(__builtin_convertvector(narrow, Wide32), QuarterLanes);
}
TERRA_INLINE QuarterLanes WidenQuarter(const uint16_t* v) {
  typedef uint16_t Narrow __attribute__((vector_size(8)));
  typedef uint32_t Wide32 __attribute__((vector_size(16)));
  Narrow narrow;
  std::memcpy(&narrow, v, sizeof narrow);
  return reinterpret_cast<QuarterLanes>(__builtin_convertvector(narrow, Wide32) << 16);
}
TERRA_INLINE QuarterLanes LoadQuarter(const float* x) {
  QuarterLanes q;
  std::memcpy(&q, x, sizeof q);
  return q;
}

// ---------------------------------------------------------------------------------------------
// The instruction-set tags. Each has:
//   Vec, kWidth          its float32 vector and lanes per vector
//   kAccumulators        the accumulator vectors a row kernel keeps in registers beside its
//                        weights and one vector of x
//   kBlockRows           rows of x per register tile of the blocked input-major product
//   kTransposedSums      whether SumsOfWidth (kWidth vectors' sums as one vector) is cheaper than
//                        kWidth reductions
//   kSelectLanes         the lanes of SelectLanes that compile to the set's vector selects
//   Zero, Broadcast, Load(x[, m]), Store, Widen(w[, m]), Fma, Mul, Sum: m = the lanes of a tail
//   Wide, LoadWide, StoreWide, SumWide
//                        16 float32 lanes as the set keeps them in registers (Lanes under AVX-512,
//                        SplitLanes under AVX2, QuarteredLanes portably), loaded, stored, and
//                        added to a total lane 0 first
//   WidenLanes           16 narrow weights as Wide, with the set's own conversions: the generic
//                        conversion takes 8 instructions for 16 int8 weights where AVX-512 takes 2
//                        (vpmovsxbd, vcvtdq2ps), and the gathered and input-major kernels are bound
//                        by widening, not by memory, when their weights are in cache.

// Portable C++ (any machine): the 16 generic lanes.
struct Portable {
  static constexpr int kIsa = kPortable;
  using Vec = Lanes;
  static constexpr int64_t kWidth = kLanes;
  static constexpr int kAccumulators = 2;
  static constexpr int kBlockRows = 2;
  static constexpr bool kTransposedSums = false;
  static constexpr int64_t kSelectLanes = 4;

  static TERRA_INLINE Vec Zero() { return Vec{}; }
  static TERRA_INLINE Vec Broadcast(float s) { return Vec{} + s; }
  static TERRA_INLINE Vec Load(const float* x) { return LoadLanes(x); }
  static TERRA_INLINE Vec Load(const float* x, int64_t m) {
    float padded[kWidth] = {};
    std::memcpy(padded, x, m * sizeof(float));
    return LoadLanes(padded);
  }
  static TERRA_INLINE void Store(float* y, const Vec& v) { StoreLanes(y, v); }
  template <typename W>
  static TERRA_INLINE Vec Widen(const W* v) {
    return GenericWidenLanes(v);
  }
  template <typename W>
  static TERRA_INLINE Vec Widen(const W* v, int64_t m) {
    W padded[kWidth] = {};
    std::memcpy(padded, v, m * sizeof(W));
    return GenericWidenLanes(padded);
  }
  // By reference: a 64-byte vector by value in a function without AVX-512 draws GCC's ABI note.
  static TERRA_INLINE Vec Fma(const Vec& a, const Vec& b, const Vec& c) { return a * b + c; }
  static TERRA_INLINE Vec Mul(const Vec& a, const Vec& b) { return a * b; }
  static TERRA_INLINE float Sum(const Vec& v) {
    float total = 0.0f;
    for (int64_t l = 0; l < kWidth; ++l) total += v[l];
    return total;
  }
  using Wide = QuarteredLanes;
  static TERRA_INLINE Wide LoadWide(const float* x) {
    return {LoadQuarter(x), LoadQuarter(x + 4), LoadQuarter(x + 8), LoadQuarter(x + 12)};
  }
  static TERRA_INLINE void StoreWide(float* y, const Wide& v) {
    std::memcpy(y, &v.q0, sizeof v.q0);
    std::memcpy(y + 4, &v.q1, sizeof v.q1);
    std::memcpy(y + 8, &v.q2, sizeof v.q2);
    std::memcpy(y + 12, &v.q3, sizeof v.q3);
  }
  static TERRA_INLINE float SumWide(const Wide& v, float total = 0.0f) {
    for (int64_t l = 0; l < kLanes / 4; ++l) total += v.q0[l];
    for (int64_t l = 0; l < kLanes / 4; ++l) total += v.q1[l];
    for (int64_t l = 0; l < kLanes / 4; ++l) total += v.q2[l];
    for (int64_t l = 0; l < kLanes / 4; ++l) total += v.q3[l];
    return total;
  }
  template <typename W>
  static TERRA_INLINE Wide WidenLanes(const W* v) {
    return {WidenQuarter(v), WidenQuarter(v + 4), WidenQuarter(v + 8), WidenQuarter(v + 12)};
  }
};

#if TERRA_X86

// AVX2 + FMA: 8 lanes per vector, 16 vector registers. Tails go through zero-padded buffers.
struct Avx2 {
  static constexpr int kIsa = kAvx2;
  using Vec = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr int kAccumulators = 8;
  // 2 * 3 accumulators of 16 lanes: 12 of the 16 registers.
  static constexpr int kBlockRows = 3;
  static constexpr bool kTransposedSums = false;
  static constexpr int64_t kSelectLanes = 8;

  TERRA_AVX2 static inline Vec Zero() { return _mm256_setzero_ps(); }
  TERRA_AVX2 static inline Vec Broadcast(float s) { return _mm256_set1_ps(s); }
  TERRA_AVX2 static inline Vec Load(const float* x) { return _mm256_loadu_ps(x); }
  TERRA_AVX2 static inline Vec Load(const float* x, int64_t m) {
    float padded[kWidth] = {};
    std::memcpy(padded, x, m * sizeof(float));
    return _mm256_loadu_ps(padded);
  }
  TERRA_AVX2 static inline void Store(float* y, Vec v) { _mm256_storeu_ps(y, v); }
  TERRA_AVX2 static inline Vec Widen(const int8_t* v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
  }
  TERRA_AVX2 static inline Vec Widen(const uint16_t* v) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  TERRA_AVX2 static inline Vec Widen(const float* v) { return _mm256_loadu_ps(v); }
  template <typename W>
  TERRA_AVX2 static inline Vec Widen(const W* v, int64_t m) {
    W padded[kWidth] = {};
    std::memcpy(padded, v, m * sizeof(W));
    return Widen(padded);
  }
  TERRA_AVX2 static inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  TERRA_AVX2 static inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  TERRA_AVX2 static inline float Sum(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  using Wide = SplitLanes;
  TERRA_AVX2 static inline Wide LoadWide(const float* x) {
    return {reinterpret_cast<HalfLanes>(_mm256_loadu_ps(x)), reinterpret_cast<HalfLanes>(_mm256_loadu_ps(x + 8))};
  }
  TERRA_AVX2 static inline void StoreWide(float* y, const Wide& v) {
    _mm256_storeu_ps(y, reinterpret_cast<__m256>(v.lo));
    _mm256_storeu_ps(y + 8, reinterpret_cast<__m256>(v.hi));
  }
  TERRA_AVX2 static inline float SumWide(const Wide& v, float total = 0.0f) {
    for (int64_t l = 0; l < kLanes / 2; ++l) total += v.lo[l];
    for (int64_t l = 0; l < kLanes / 2; ++l) total += v.hi[l];
    return total;
  }
  template <typename W>
  TERRA_AVX2 static inline Wide WidenLanes(const W* v) {
    return {reinterpret_cast<HalfLanes>(Widen(v)), reinterpret_cast<HalfLanes>(Widen(v + 8))};
  }
};

// AVX-512 (F, BW, VL): 16 lanes per vector, 32 vector registers. Tails by masked loads.
struct Avx512 {
  static constexpr int kIsa = kAvx512;
  using Vec = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr int kAccumulators = 16;
  // 2 * 8 accumulators: 16 of the 32 registers.
  static constexpr int kBlockRows = 8;
  static constexpr bool kTransposedSums = true;
  static constexpr int64_t kSelectLanes = 16;

  TERRA_AVX512 static inline __mmask16 Mask(int64_t m) { return static_cast<__mmask16>((1u << m) - 1u); }
  TERRA_AVX512 static inline Vec Zero() { return _mm512_setzero_ps(); }
  TERRA_AVX512 static inline Vec Broadcast(float s) { return _mm512_set1_ps(s); }
  TERRA_AVX512 static inline Vec Load(const float* x) { return _mm512_loadu_ps(x); }
  TERRA_AVX512 static inline Vec Load(const float* x, int64_t m) { return _mm512_maskz_loadu_ps(Mask(m), x); }
  TERRA_AVX512 static inline void Store(float* y, Vec v) { _mm512_storeu_ps(y, v); }
  TERRA_AVX512 static inline Vec Widen(const int8_t* v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
  }
  TERRA_AVX512 static inline Vec Widen(const uint16_t* v) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  TERRA_AVX512 static inline Vec Widen(const float* v) { return _mm512_loadu_ps(v); }
  TERRA_AVX512 static inline Vec Widen(const float* v, int64_t m) { return _mm512_maskz_loadu_ps(Mask(m), v); }
  TERRA_AVX512 static inline Vec Widen(const int8_t* v, int64_t m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(Mask(m), v)));
  }
  TERRA_AVX512 static inline Vec Widen(const uint16_t* v, int64_t m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(Mask(m), v)), 16));
  }
  TERRA_AVX512 static inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  TERRA_AVX512 static inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  TERRA_AVX512 static inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
  using Wide = Lanes;
  TERRA_AVX512 static inline Wide LoadWide(const float* x) { return reinterpret_cast<Lanes>(_mm512_loadu_ps(x)); }
  TERRA_AVX512 static inline void StoreWide(float* y, const Wide& v) { _mm512_storeu_ps(y, reinterpret_cast<__m512>(v)); }
  TERRA_AVX512 static inline float SumWide(const Wide& v, float total = 0.0f) {
    for (int64_t l = 0; l < kLanes; ++l) total += v[l];
    return total;
  }
  template <typename W>
  TERRA_AVX512 static inline Wide WidenLanes(const W* v) {
    return reinterpret_cast<Lanes>(Widen(v));
  }

  // The 16 sums of v[0..16) as one vector (sum r = lane r): a transpose-and-add tree of 45
  // instructions, against about 10 for each Sum.
  TERRA_AVX512 static inline Vec SumsOfWidth(const Vec (&v)[kWidth]) {
    __m512 pairs[8], quads[4];
    for (int k = 0; k < 8; ++k)  // per 128-bit lane: [r0 r1 r0 r1] partial sums of rows 2k, 2k + 1
      pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {  // per 128-bit lane: [r0 r1 r2 r3] of rows 4k..4k + 3
      const __m512d a = _mm512_castps_pd(pairs[2 * k]), b = _mm512_castps_pd(pairs[2 * k + 1]);
      quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // Across the four 128-bit lanes: [q0 (lanes 0+1), q0 (2+3), q1 (0+1), q1 (2+3)], then whole sums.
    const __m512 h0 =
        _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 h1 =
        _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h0, h1, 0x88), _mm512_shuffle_f32x4(h0, h1, 0xdd));
  }
};

#endif  // TERRA_X86

// ---------------------------------------------------------------------------------------------
// Compiling a body once per instruction set: `body` is a generic lambda taking the tag, marked
// TERRA_INLINE_LAMBDA, whose kernels (TERRA_INLINE templates over the tag) are inlined into these
// functions and so compiled with their target attribute.

template <typename Body>
void OnPortable(const Body& body) {
  body(Portable{});
}
#if TERRA_X86
template <typename Body>
TERRA_AVX2 void OnAvx2(const Body& body) {
  body(Avx2{});
}
template <typename Body>
TERRA_AVX512 void OnAvx512(const Body& body) {
  body(Avx512{});
}
#endif

// Runs `body` compiled for instruction set `isa` (kPortable, kAvx2 or kAvx512).
template <typename Body>
void WithIsa(int isa, const Body& body) {
#if TERRA_X86
  if (isa == kAvx512) return OnAvx512(body);
  if (isa == kAvx2) return OnAvx2(body);
#endif
  OnPortable(body);
}

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_ISA_H_

// The XLA FFI handlers: the products' and the fused layers' custom calls, registered by
// terra/backends/native_kernels.py, for B = 1..64 rows of x:
//   terra_output_major_int8  x f32[B, in], values s8[out, in], scale f32[out, G] (or f32[out], G = 1)
//                            -> y f32[B, out], y[b, o] = sum_g scale[o, g] * sum_{i in group g} x[b, i] * values[o, i]
//                            with groups of in / G consecutive inputs (one scale per output row and head).
//   terra_output_major_bf16  x f32[B, in], values u16[out, in] (bfloat16 bits) -> y f32[B, out].
//   terra_output_major_f32   x f32[B, in], values f32[out, in] -> y f32[B, out]: float32 weights
//                            read once for the B rows.
// and, for the sparse layers (any B up to 256 for the input-major product, up to 64 for the others):
//   terra_input_major_{int8,bf16}   x f32[B, in], values [in, out], scale f32[in, G] (int8; G groups
//                                   of out / G consecutive outputs) -> y f32[B, out]
//   terra_gathered_dot_{int8,bf16}  x f32[B, d], values [n, d], scale f32[n] (int8), rows s32[B, k]
//                                   -> y f32[B, k], y[b, j] = values[rows[b, j]] . x[b]
//   terra_gathered_sum_{int8,bf16}  x f32[B, k], values [n, d], scale f32[n] (int8), rows s32[B, k]
//                                   -> y f32[B, d], y[b] = sum_j x[b, j] values[rows[b, j]]
//   terra_sparse_feed_forward_{int8,bf16}  a sparse feed-forward layer's decode step (sparse_feedforward.h)
//   terra_lsh_decode_attention_{f32,int8,bf16}   an LSH layer's decode-step attention over its
//                                          cache stored as float32, int8 or bfloat16 (lsh_attention.h)
//   terra_cache_attention_{f32,int8,bf16}  a decode step's attention over a whole KV cache stored as
//                                          float32, int8 or bfloat16 (cache_attention.h)
//   terra_blocked_attention{,_causal}      softmax attention over a whole input, blocks of queries
//                                          against tiles of keys (prefill_attention.h)
//   terra_lsh_chunk_attention              an LSH layer's attention over its sorted chunks, each
//                                          with its adjacent ones (prefill_attention.h)
//   terra_lsh_hash                         an LSH layer's bucket ids for a whole sequence (lsh_hash.h)
//   terra_module_convolution               a sparse-QKV convolution over a whole sequence
//                                          (module_convolution.h)
//   terra_sparse_attention_{projections1,projections2,projections3,self,cross}_{int8,bf16}
//                                          a sparse QKV layer's decode step (with one to three
//                                          convolutions) or with its self- or cross-attention too
//                                          (attention.h names the operands, attention.cc runs it)
// and terra_cpu_kernels_isa, which reads or lowers the instruction set the handlers use.

#include <algorithm>
#include <cstdint>

#include "attention.h"
#include "cache_attention.h"
#include "isa.h"
#include "lsh_attention.h"
#include "lsh_hash.h"
#include "module_convolution.h"
#include "prefill_attention.h"
#include "products.h"
#include "sparse_feedforward.h"
#include "xla/ffi/api/ffi.h"

namespace terra::native {
namespace {

// x [B, in], values [out, in] (output-major) or [in, out] (input-major), y [B, out].
ffi::Error CheckShapes(bool input_major, ffi::Span<const int64_t> x, ffi::Span<const int64_t> values,
                       ffi::Span<const int64_t> y) {
  if (x.size() != 2 || values.size() != 2 || y.size() != 2)
    return ffi::Error::InvalidArgument("product: x, values and y must be 2-D");
  const int64_t n_in = values[input_major ? 0 : 1], n_out = values[input_major ? 1 : 0];
  if (x[1] != n_in || y[0] != x[0] || y[1] != n_out)
    return ffi::Error::InvalidArgument(input_major
                                           ? "input-major product: x [B, in], values [in, out] and y [B, out] disagree"
                                           : "output-major product: x [B, in], values [out, in] and y [B, out] disagree");
  if (x[0] > (input_major ? kMaxInputMajorRows : kMaxRows))
    return ffi::Error::InvalidArgument(input_major ? "input-major product: at most 256 rows of x"
                                                   : "output-major product: at most 64 rows of x");
  return ffi::Error::Success();
}

// int8 scales: one per row of values, or [rows, groups] with groups dividing the row's length.
ffi::Error ScaleGroups(ffi::Span<const int64_t> scale, ffi::Span<const int64_t> values, int64_t* groups) {
  *groups = scale.size() == 2 ? scale[1] : 1;
  if (scale.size() < 1 || scale.size() > 2 || scale[0] != values[0] || *groups < 1 || values[1] % *groups != 0)
    return ffi::Error::InvalidArgument("int8 product: scale must be [rows] or [rows, groups] of values, groups "
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

ffi::Error OutputMajorF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> values,
                              ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(false, x.dimensions(), values.dimensions(), y->dimensions()); error.failure())
    return error;
  const int64_t batch = x.dimensions()[0], n_in = x.dimensions()[1], n_out = values.dimensions()[0];
  OutputMajor<float>(pool, {x.typed_data(), values.typed_data(), nullptr, y->typed_data(), batch, n_in, n_out, 1});
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
  if (batch > kMaxRows) return ffi::Error::InvalidArgument("gathered rows: at most 64 rows of x");
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

#define TERRA_FF_RESULTS ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::S32> indices
#define TERRA_FF_RESULT_DATA y->typed_data(), indices->typed_data()

ffi::Error SparseFeedForwardInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> down,
                                 ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S8> up,
                                 ffi::Buffer<ffi::F32> up_scale, ffi::Buffer<ffi::F32> up_bias,
                                 ffi::Buffer<ffi::S8> w1, ffi::Buffer<ffi::F32> w1_scale, ffi::Buffer<ffi::S8> w2,
                                 ffi::Buffer<ffi::F32> w2_scale, ffi::Buffer<ffi::F32> out_bias, TERRA_FF_RESULTS) {
  return SparseFeedForward<int8_t>(pool, x.typed_data(), x.dimensions(), down.typed_data(), down.dimensions(),
                                       down_scale.typed_data(), up.typed_data(), up.dimensions(),
                                       up_scale.typed_data(), up_bias.typed_data(), up_bias.dimensions(),
                                       w1.typed_data(), w1_scale.typed_data(), w2.typed_data(), w2_scale.typed_data(),
                                       w1.dimensions(), w2.dimensions(), out_bias.typed_data(),
                                       static_cast<int64_t>(out_bias.element_count()), TERRA_FF_RESULT_DATA);
}

ffi::Error SparseFeedForwardBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> down,
                                 ffi::Buffer<ffi::U16> up, ffi::Buffer<ffi::F32> up_bias, ffi::Buffer<ffi::U16> w1,
                                 ffi::Buffer<ffi::U16> w2, ffi::Buffer<ffi::F32> out_bias, TERRA_FF_RESULTS) {
  return SparseFeedForward<uint16_t>(pool, x.typed_data(), x.dimensions(), down.typed_data(),
                                         down.dimensions(), nullptr, up.typed_data(), up.dimensions(), nullptr,
                                         up_bias.typed_data(), up_bias.dimensions(), w1.typed_data(), nullptr,
                                         w2.typed_data(), nullptr, w1.dimensions(), w2.dimensions(),
                                         out_bias.typed_data(), static_cast<int64_t>(out_bias.element_count()),
                                         TERRA_FF_RESULT_DATA);
}

// The sparse attention handlers: one per weight store, attention mode and number of convolutions,
// each binding its operands by position and handing them on by name (SparseAttentionOperands).
template <ffi::DataType D>
Operand<const ffi::NativeType<D>> Read(const ffi::Buffer<D>& buffer) {
  return {buffer.typed_data(), buffer.dimensions(), static_cast<int64_t>(buffer.element_count())};
}

template <ffi::DataType D>
Operand<ffi::NativeType<D>> ReadWritable(const ffi::Buffer<D>& buffer) {
  return {buffer.typed_data(), buffer.dimensions(), static_cast<int64_t>(buffer.element_count())};
}

// A narrow weight in a handler's parameters and as an operand: int8 values and their scale, or
// bfloat16 bits.
#define TERRA_WEIGHT_PARAMS_int8(NAME) ffi::Buffer<ffi::S8> NAME, ffi::Buffer<ffi::F32> NAME##_scale
#define TERRA_WEIGHT_PARAMS_bf16(NAME) ffi::Buffer<ffi::U16> NAME
#define TERRA_WEIGHT_int8(NAME) NarrowWeight<int8_t>{Read(NAME), Read(NAME##_scale)}
#define TERRA_WEIGHT_bf16(NAME) NarrowWeight<uint16_t>{Read(NAME), {}}
#define TERRA_CONV_PARAMS(KIND, C) TERRA_WEIGHT_PARAMS_##KIND(conv##C), ffi::Buffer<ffi::F32> conv##C##_bias
#define TERRA_CONV(KIND, C) o.conv_kernels[C] = TERRA_WEIGHT_##KIND(conv##C), o.conv_biases[C] = Read(conv##C##_bias)
#define TERRA_ATTENTION_PARAMS(KIND)                                                                           \
  ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, TERRA_WEIGHT_PARAMS_##KIND(gate), TERRA_WEIGHT_PARAMS_##KIND(kernel), \
      ffi::Buffer<ffi::F32> mult_bias, ffi::Buffer<ffi::F32> conv_rows
#define TERRA_ATTENTION_OPERANDS(KIND, W, MODE, N_CONVS)                              \
  SparseAttentionOperands<W> o;                                                       \
  o.mode = SparseAttentionOperands<W>::MODE, o.n_convs = N_CONVS, o.x = Read(x);      \
  o.gate = TERRA_WEIGHT_##KIND(gate), o.kernel = TERRA_WEIGHT_##KIND(kernel);         \
  o.mult_bias = Read(mult_bias), o.conv_rows = Read(conv_rows)
using Out = ffi::ResultBuffer<ffi::F32>;

// The projections alone (mode none) with one, two or three convolutions; self-attention with Q, K
// and V over the KV cache (keys and values aliased to the new ones); cross-attention with Q over
// the encoder's keys and values.
#define TERRA_ATTENTION_HANDLERS(KIND, W)                                                                  \
  ffi::Error SparseProjections1_##KIND(TERRA_ATTENTION_PARAMS(KIND), TERRA_CONV_PARAMS(KIND, 0), Out out0,   \
                                       Out new_rows) {                                                      \
    TERRA_ATTENTION_OPERANDS(KIND, W, kNone, 1);                                                            \
    TERRA_CONV(KIND, 0);                                                                                    \
    o.outs[0] = out0->typed_data(), o.new_rows = new_rows->typed_data();                                    \
    return SparseAttention<W>(pool, o);                                                                     \
  }                                                                                                         \
  ffi::Error SparseProjections2_##KIND(TERRA_ATTENTION_PARAMS(KIND), TERRA_CONV_PARAMS(KIND, 0),             \
                                       TERRA_CONV_PARAMS(KIND, 1), Out out0, Out out1, Out new_rows) {      \
    TERRA_ATTENTION_OPERANDS(KIND, W, kNone, 2);                                                            \
    TERRA_CONV(KIND, 0), TERRA_CONV(KIND, 1);                                                               \
    o.outs[0] = out0->typed_data(), o.outs[1] = out1->typed_data(), o.new_rows = new_rows->typed_data();    \
    return SparseAttention<W>(pool, o);                                                                     \
  }                                                                                                         \
  ffi::Error SparseProjections3_##KIND(TERRA_ATTENTION_PARAMS(KIND), TERRA_CONV_PARAMS(KIND, 0),             \
                                       TERRA_CONV_PARAMS(KIND, 1), TERRA_CONV_PARAMS(KIND, 2), Out out0,      \
                                       Out out1, Out out2, Out new_rows) {                                  \
    TERRA_ATTENTION_OPERANDS(KIND, W, kNone, 3);                                                            \
    TERRA_CONV(KIND, 0), TERRA_CONV(KIND, 1), TERRA_CONV(KIND, 2);                                          \
    o.outs[0] = out0->typed_data(), o.outs[1] = out1->typed_data(), o.outs[2] = out2->typed_data();         \
    o.new_rows = new_rows->typed_data();                                                                    \
    return SparseAttention<W>(pool, o);                                                                     \
  }                                                                                                         \
  ffi::Error SparseSelfAttention_##KIND(TERRA_ATTENTION_PARAMS(KIND), TERRA_CONV_PARAMS(KIND, 0),            \
                                        TERRA_CONV_PARAMS(KIND, 1), TERRA_CONV_PARAMS(KIND, 2),               \
                                        ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,             \
                                        ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::PRED> key_mask,         \
                                        Out out0, Out out1, Out out2, Out new_rows, Out y, Out new_keys,      \
                                        Out new_values) {                                                   \
    TERRA_ATTENTION_OPERANDS(KIND, W, kSelf, 3);                                                            \
    TERRA_CONV(KIND, 0), TERRA_CONV(KIND, 1), TERRA_CONV(KIND, 2);                                          \
    o.keys = ReadWritable(keys), o.values = ReadWritable(values);                                           \
    o.index = Read(index), o.key_mask = Read(key_mask);                                                     \
    o.outs[0] = out0->typed_data(), o.outs[1] = out1->typed_data(), o.outs[2] = out2->typed_data();         \
    o.new_rows = new_rows->typed_data(), o.y = y->typed_data();                                             \
    o.new_keys = new_keys->typed_data(), o.new_values = new_values->typed_data();                           \
    return SparseAttention<W>(pool, o);                                                                     \
  }                                                                                                         \
  ffi::Error SparseCrossAttention_##KIND(TERRA_ATTENTION_PARAMS(KIND), TERRA_CONV_PARAMS(KIND, 0),           \
                                         ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,            \
                                         ffi::Buffer<ffi::F32> bias, Out out0, Out new_rows, Out y) {         \
    TERRA_ATTENTION_OPERANDS(KIND, W, kCross, 1);                                                           \
    TERRA_CONV(KIND, 0);                                                                                    \
    o.keys = ReadWritable(keys), o.values = ReadWritable(values), o.bias = Read(bias);                      \
    o.outs[0] = out0->typed_data(), o.new_rows = new_rows->typed_data(), o.y = y->typed_data();             \
    return SparseAttention<W>(pool, o);                                                                     \
  }

TERRA_ATTENTION_HANDLERS(int8, int8_t)
TERRA_ATTENTION_HANDLERS(bf16, uint16_t)

// The LSH decode attention: shapes checked here (lsh_attention.h names them), then by name.
using S32 = ffi::Buffer<ffi::S32>;
template <typename T, ffi::DataType D>
ffi::Error LshDecode(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<D>& keys,
                     const ffi::Buffer<ffi::F32>* key_scale, const ffi::Buffer<D>& values,
                     const ffi::Buffer<ffi::F32>* value_scale, const S32& buckets, const S32& lists,
                     const S32& counts, const S32& recent, const S32& recent_count, const S32& q_buckets,
                     Out& out, Out& top, Out& total) {
  const auto qs = q.dimensions(), ks = keys.dimensions(), bs = buckets.dimensions(), ls = lists.dimensions();
  if (qs.size() != 3 || ks.size() != 4 || bs.size() != 4 || ls.size() != 5)
    return ffi::Error::InvalidArgument("LSH decode attention: q [B, H, Dh], keys [B, H, L, Dh], buckets "
                                       "[B, H, R, L] and lists [B, H, R, NB, C] expected");
  LshDecodeOperands<T> o;
  o.batch = qs[0], o.heads = qs[1], o.dh = qs[2], o.length = ks[2], o.rounds = bs[2];
  o.n_buckets = ls[3], o.capacity = ls[4];
  const int64_t B = o.batch, H = o.heads, L = o.length, R = o.rounds, NB = o.n_buckets, C = o.capacity;
  auto is = [](ffi::Span<const int64_t> shape, std::initializer_list<int64_t> want) {
    return std::equal(shape.begin(), shape.end(), want.begin(), want.end());
  };
  const bool scales_ok = !key_scale || (is(key_scale->dimensions(), {B, H, L}) && value_scale &&
                                        is(value_scale->dimensions(), {B, H, L}));
  if (!is(ks, {B, H, L, o.dh}) || !is(values.dimensions(), {B, H, L, o.dh}) || !is(bs, {B, H, R, L}) ||
      !is(ls, {B, H, R, NB, C}) || !is(counts.dimensions(), {B, H, R, NB}) || !is(recent.dimensions(), {B, C}) ||
      !is(recent_count.dimensions(), {B}) || !is(q_buckets.dimensions(), {B, H, R}) ||
      !is(out->dimensions(), {B, H, o.dh}) || !is(top->dimensions(), {B, H}) || !is(total->dimensions(), {B, H}) ||
      !scales_ok)
    return ffi::Error::InvalidArgument("LSH decode attention: operand shapes disagree (lsh_attention.h)");
  if (R < 1 || R > kMaxLshRounds || C < 1)
    return ffi::Error::InvalidArgument("LSH decode attention: 1 to 8 hash rounds and a list capacity >= 1");
  o.q = q.typed_data(), o.keys = keys.typed_data(), o.values = values.typed_data();
  o.key_scale = key_scale ? key_scale->typed_data() : nullptr;
  o.value_scale = value_scale ? value_scale->typed_data() : nullptr;
  o.buckets = buckets.typed_data(), o.lists = lists.typed_data(), o.counts = counts.typed_data();
  o.recent = recent.typed_data(), o.recent_count = recent_count.typed_data(), o.q_buckets = q_buckets.typed_data();
  o.out = out->typed_data(), o.top = top->typed_data(), o.total = total->typed_data();
  return LshDecodeAttention<T>(pool, o);
}

#define TERRA_LSH_LISTS S32 buckets, S32 lists, S32 counts, S32 recent, S32 recent_count, S32 q_buckets
#define TERRA_LSH_RESULTS Out out, Out top, Out total
#define TERRA_LSH_PASS buckets, lists, counts, recent, recent_count, q_buckets, out, top, total
ffi::Error LshDecodeF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                        ffi::Buffer<ffi::F32> values, TERRA_LSH_LISTS, TERRA_LSH_RESULTS) {
  return LshDecode<float>(pool, q, keys, nullptr, values, nullptr, TERRA_LSH_PASS);
}
ffi::Error LshDecodeInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> keys,
                         ffi::Buffer<ffi::F32> key_scale, ffi::Buffer<ffi::S8> values,
                         ffi::Buffer<ffi::F32> value_scale, TERRA_LSH_LISTS, TERRA_LSH_RESULTS) {
  return LshDecode<int8_t>(pool, q, keys, &key_scale, values, &value_scale, TERRA_LSH_PASS);
}
ffi::Error LshDecodeBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> keys,
                         ffi::Buffer<ffi::U16> values, TERRA_LSH_LISTS, TERRA_LSH_RESULTS) {
  return LshDecode<uint16_t>(pool, q, keys, nullptr, values, nullptr, TERRA_LSH_PASS);
}

// The cache attention: shapes checked here (cache_attention.h names them) before anything is read.
template <typename T, ffi::DataType D>
ffi::Error CacheAttentionImpl(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<D>& keys,
                              const ffi::Buffer<ffi::F32>* key_scale, const ffi::Buffer<D>& values,
                              const ffi::Buffer<ffi::F32>* value_scale, const ffi::Buffer<ffi::F32>& bias,
                              const S32& visible, Out& out, Out& top, Out& total) {
  const auto qs = q.dimensions(), ks = keys.dimensions();
  if (qs.size() != 3 || ks.size() != 4)
    return ffi::Error::InvalidArgument("cache attention: q [B, H, Dh] and keys [B, H, L, Dh] expected");
  CacheAttentionOperands<T> o;
  o.batch = qs[0], o.heads = qs[1], o.dh = qs[2], o.length = ks[2];
  const int64_t B = o.batch, H = o.heads, L = o.length, dh = o.dh;
  auto is = [](ffi::Span<const int64_t> shape, std::initializer_list<int64_t> want) {
    return std::equal(shape.begin(), shape.end(), want.begin(), want.end());
  };
  const bool scales_ok = !key_scale || (is(key_scale->dimensions(), {B, H, L}) && value_scale &&
                                        is(value_scale->dimensions(), {B, H, L}));
  if (!is(ks, {B, H, L, dh}) || !is(values.dimensions(), {B, H, L, dh}) || !is(bias.dimensions(), {B, L}) ||
      visible.element_count() != 1 || !is(out->dimensions(), {B, H, dh}) || !is(top->dimensions(), {B, H}) ||
      !is(total->dimensions(), {B, H}) || !scales_ok)
    return ffi::Error::InvalidArgument("cache attention: operand shapes disagree (cache_attention.h)");
  if (dh < 1 || dh > kMaxCacheHeadSize)
    return ffi::Error::InvalidArgument("cache attention: a head size of 1 to 512");
  o.q = q.typed_data(), o.keys = keys.typed_data(), o.values = values.typed_data();
  o.key_scale = key_scale ? key_scale->typed_data() : nullptr;
  o.value_scale = value_scale ? value_scale->typed_data() : nullptr;
  o.bias = bias.typed_data(), o.visible = *visible.typed_data();
  o.out = out->typed_data(), o.top = top->typed_data(), o.total = total->typed_data();
  return CacheAttention<T>(pool, o);
}

#define TERRA_CACHE_RESULTS Out out, Out top, Out total
ffi::Error CacheAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                             ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::F32> bias, S32 visible,
                             TERRA_CACHE_RESULTS) {
  return CacheAttentionImpl<float>(pool, q, keys, nullptr, values, nullptr, bias, visible, out, top, total);
}
ffi::Error CacheAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> keys,
                              ffi::Buffer<ffi::F32> key_scale, ffi::Buffer<ffi::S8> values,
                              ffi::Buffer<ffi::F32> value_scale, ffi::Buffer<ffi::F32> bias, S32 visible,
                              TERRA_CACHE_RESULTS) {
  return CacheAttentionImpl<int8_t>(pool, q, keys, &key_scale, values, &value_scale, bias, visible, out, top, total);
}
ffi::Error CacheAttentionBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> keys,
                              ffi::Buffer<ffi::U16> values, ffi::Buffer<ffi::F32> bias, S32 visible,
                              TERRA_CACHE_RESULTS) {
  return CacheAttentionImpl<uint16_t>(pool, q, keys, nullptr, values, nullptr, bias, visible, out, top, total);
}

// The blocked attention: q [B, H, Lq, Dh], kt [B, H, T, Dh, K], v [B, H, Lk, Dh], bias [B, Lk]
// -> out [B, H, Lq, Dh] (prefill_attention.h); checked here before anything is read.
template <bool kCausal>
ffi::Error BlockedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> bias, Out out) {
  const auto qs = q.dimensions(), ks = kt.dimensions(), vs = v.dimensions();
  if (qs.size() != 4 || ks.size() != 5 || vs.size() != 4 || bias.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("blocked attention: q [B, H, Lq, Dh], kt [B, H, T, Dh, K], v [B, H, Lk, Dh] "
                                       "and bias [B, Lk] expected (prefill_attention.h)");
  BlockedAttentionOperands o;
  o.batch = qs[0], o.heads = qs[1], o.q_length = qs[2], o.dh = qs[3], o.k_length = vs[2];
  o.tiles = ks[2], o.tile = ks[4], o.causal = kCausal;
  const int64_t B = o.batch, H = o.heads, Lk = o.k_length, dh = o.dh;
  auto is = [](ffi::Span<const int64_t> shape, std::initializer_list<int64_t> want) {
    return std::equal(shape.begin(), shape.end(), want.begin(), want.end());
  };
  if (!is(ks, {B, H, o.tiles, dh, o.tile}) || !is(vs, {B, H, Lk, dh}) || !is(bias.dimensions(), {B, Lk}) ||
      !is(out->dimensions(), {B, H, o.q_length, dh}))
    return ffi::Error::InvalidArgument("blocked attention: operand shapes disagree (prefill_attention.h)");
  if (o.tile < 64 || o.tile % 64 != 0 || o.tiles != (Lk + o.tile - 1) / o.tile || dh < 16 || dh % 16 != 0 ||
      (kCausal && o.q_length != Lk))
    return ffi::Error::InvalidArgument("blocked attention: key tiles of a multiple of 64 covering the keys, Dh a "
                                       "multiple of 16, and as many queries as keys when causal");
  o.q = q.typed_data(), o.kt = kt.typed_data(), o.v = v.typed_data(), o.bias = bias.typed_data();
  o.out = out->typed_data();
  return BlockedAttention(pool, o);
}

// The LSH chunk attention: q, v [B, H, N, C, Dh], kt [B, H, N, Dh, C], pos and valid s32 [B, H, N, C]
// -> out [B, H, N, C, Dh], lse [B, H, N, C]; the window and causality as attributes
// (prefill_attention.h).
ffi::Error LshChunkAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> valid,
                                 Out out, Out lse, int64_t before, int64_t after, bool causal) {
  const auto qs = q.dimensions();
  if (qs.size() != 5)
    return ffi::Error::InvalidArgument("LSH chunk attention: q [B, H, N, C, Dh] expected (prefill_attention.h)");
  auto is = [](ffi::Span<const int64_t> shape, ffi::Span<const int64_t> want) {
    return std::equal(shape.begin(), shape.end(), want.begin(), want.end());
  };
  const ffi::Span<const int64_t> entries(qs.begin(), 4);
  const int64_t transposed[] = {qs[0], qs[1], qs[2], qs[4], qs[3]};
  if (!is(kt.dimensions(), ffi::Span<const int64_t>(transposed, 5)) || !is(v.dimensions(), qs) || !is(out->dimensions(), qs) ||
      !is(pos.dimensions(), entries) || !is(valid.dimensions(), entries) || !is(lse->dimensions(), entries))
    return ffi::Error::InvalidArgument("LSH chunk attention: operand shapes disagree (prefill_attention.h)");
  LshChunkOperands o;
  o.rows = qs[0] * qs[1], o.chunks = qs[2], o.chunk = qs[3], o.dh = qs[4];
  o.before = before, o.after = after, o.causal = causal;
  if (o.dh < 16 || o.dh % 16 != 0 || o.chunk % 16 != 0 || before < 0 || after < 0 || before + after + 1 > o.chunks)
    return ffi::Error::InvalidArgument("LSH chunk attention: Dh a multiple of 16, chunks of a multiple of 16 "
                                       "entries, and at most as many adjacent chunks as there are chunks");
  o.q = q.typed_data(), o.kt = kt.typed_data(), o.v = v.typed_data();
  o.pos = pos.typed_data(), o.valid = valid.typed_data();
  o.out = out->typed_data(), o.lse = lse->typed_data();
  return LshChunkAttention(pool, o);
}

// The LSH hash: vecs [B, H, L, D], rotations [H, D, W] -> buckets s32 [B, H, R, L], the factors as
// an attribute (lsh_hash.h); checked here before anything is read.
ffi::Error LshHashImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> vecs, ffi::Buffer<ffi::F32> rotations,
                       ffi::ResultBuffer<ffi::S32> buckets, ffi::Span<const int64_t> factors) {
  const auto vs = vecs.dimensions(), rs = rotations.dimensions(), bs = buckets->dimensions();
  if (vs.size() != 4 || rs.size() != 3 || bs.size() != 4)
    return ffi::Error::InvalidArgument("LSH hash: vecs [B, H, L, D], rotations [H, D, W] and buckets [B, H, R, L] "
                                       "expected (lsh_hash.h)");
  LshHashOperands o;
  o.batch = vs[0], o.heads = vs[1], o.length = vs[2], o.depth = vs[3], o.width = rs[2], o.rounds = bs[2];
  if (factors.size() == 0 || static_cast<int64_t>(factors.size()) > kMaxLshFactors)
    return ffi::Error::InvalidArgument("LSH hash: 1 to 4 bucket factors expected");
  int64_t half_sum = 0, n_buckets = 1;
  for (const int64_t f : factors) {
    if (f < 2 || f % 2 != 0 || n_buckets > (int64_t{1} << 30) / f)
      return ffi::Error::InvalidArgument("LSH hash: bucket factors must be even, positive and multiply to under 2^30");
    o.factors[o.n_factors++] = f, half_sum += f / 2, n_buckets *= f;
  }
  if (rs[0] != o.heads || rs[1] != o.depth || bs[0] != o.batch || bs[1] != o.heads || bs[3] != o.length)
    return ffi::Error::InvalidArgument("LSH hash: operand shapes disagree (lsh_hash.h)");
  if (o.width % 16 != 0 || o.width < o.rounds * half_sum || o.depth < 1)
    return ffi::Error::InvalidArgument("LSH hash: rotations need a width of a multiple of 16 holding every round's "
                                       "columns");
  o.vecs = vecs.typed_data(), o.rotations = rotations.typed_data(), o.buckets = buckets->typed_data();
  return LshHash(pool, o);
}

// The module convolution: u [B, L, S, M], kernel [F, k, M, N], bias [N] -> out [B, L, S, N]
// (module_convolution.h); checked here before anything is read.
ffi::Error ModuleConvolutionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> kernel,
                                 ffi::Buffer<ffi::F32> bias, Out out) {
  const auto us = u.dimensions(), ks = kernel.dimensions();
  if (us.size() != 4 || ks.size() != 4 || bias.dimensions().size() != 1 || out->dimensions().size() != 4)
    return ffi::Error::InvalidArgument("module convolution: u [B, L, S, M], kernel [F, k, M, N], bias [N] and out "
                                       "[B, L, S, N] expected (module_convolution.h)");
  ModuleConvolutionOperands o;
  o.batch = us[0], o.length = us[1], o.modules = us[2], o.depth = us[3];
  o.length_kernel = ks[0], o.module_kernel = ks[1], o.features = ks[3];
  const auto os = out->dimensions();
  if (ks[2] != o.depth || bias.dimensions()[0] != o.features || os[0] != o.batch || os[1] != o.length ||
      os[2] != o.modules || os[3] != o.features)
    return ffi::Error::InvalidArgument("module convolution: operand shapes disagree (module_convolution.h)");
  if (o.features % 16 != 0 || o.module_kernel % 2 == 0 || o.length_kernel < 1)
    return ffi::Error::InvalidArgument("module convolution: outputs of a multiple of 16 features, an odd module "
                                       "kernel and a positive length kernel expected");
  o.u = u.typed_data(), o.kernel = kernel.typed_data(), o.bias = bias.typed_data(), o.out = out->typed_data();
  return ModuleConvolution(pool, o);
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
TERRA_HANDLER(terra_output_major_f32, OutputMajorF32Impl, ffi::F32, )
TERRA_HANDLER(terra_input_major_int8, ProductInt8Impl<true>, ffi::S8, TERRA_SCALE)
TERRA_HANDLER(terra_input_major_bf16, ProductBf16Impl<true>, ffi::U16, )
TERRA_HANDLER(terra_gathered_dot_int8, GatheredInt8Impl<true>, ffi::S8, TERRA_SCALE TERRA_ROWS)
TERRA_HANDLER(terra_gathered_sum_int8, GatheredInt8Impl<false>, ffi::S8, TERRA_SCALE TERRA_ROWS)
TERRA_HANDLER(terra_gathered_dot_bf16, GatheredBf16Impl<true>, ffi::U16, TERRA_ROWS)
TERRA_HANDLER(terra_gathered_sum_bf16, GatheredBf16Impl<false>, ffi::U16, TERRA_ROWS)

#define TERRA_F32 .Arg<ffi::Buffer<ffi::F32>>()
#define TERRA_FF_RETS .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>()
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

// The sparse attention bindings, in the order of the handlers' parameters above.
#define TERRA_WEIGHT_BIND_int8 .Arg<ffi::Buffer<ffi::S8>>() TERRA_F32
#define TERRA_WEIGHT_BIND_bf16 .Arg<ffi::Buffer<ffi::U16>>()
#define TERRA_CONV_BIND(KIND) TERRA_WEIGHT_BIND_##KIND TERRA_F32
#define TERRA_OUT .Ret<ffi::Buffer<ffi::F32>>()
#define TERRA_ATTENTION_BIND(KIND) \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_WEIGHT_BIND_##KIND TERRA_WEIGHT_BIND_##KIND TERRA_F32 TERRA_F32
#define TERRA_ATTENTION_SYMBOLS(KIND)                                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_attention_projections1_##KIND, SparseProjections1_##KIND,           \
                                TERRA_ATTENTION_BIND(KIND) TERRA_CONV_BIND(KIND) TERRA_OUT TERRA_OUT);          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                               \
      terra_sparse_attention_projections2_##KIND, SparseProjections2_##KIND,                                   \
      TERRA_ATTENTION_BIND(KIND) TERRA_CONV_BIND(KIND) TERRA_CONV_BIND(KIND) TERRA_OUT TERRA_OUT TERRA_OUT);   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_attention_projections3_##KIND, SparseProjections3_##KIND,           \
                                TERRA_ATTENTION_BIND(KIND) TERRA_CONV_BIND(KIND) TERRA_CONV_BIND(KIND)          \
                                    TERRA_CONV_BIND(KIND) TERRA_OUT TERRA_OUT TERRA_OUT TERRA_OUT);             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_attention_self_##KIND, SparseSelfAttention_##KIND,                  \
                                TERRA_ATTENTION_BIND(KIND) TERRA_CONV_BIND(KIND) TERRA_CONV_BIND(KIND)          \
                                    TERRA_CONV_BIND(KIND) TERRA_F32 TERRA_F32 .Arg<ffi::Buffer<ffi::S32>>()     \
                                        .Arg<ffi::Buffer<ffi::PRED>>() TERRA_OUT TERRA_OUT TERRA_OUT TERRA_OUT  \
                                            TERRA_OUT TERRA_OUT TERRA_OUT);                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_sparse_attention_cross_##KIND, SparseCrossAttention_##KIND,                \
                                TERRA_ATTENTION_BIND(KIND) TERRA_CONV_BIND(KIND) TERRA_F32 TERRA_F32 TERRA_F32  \
                                    TERRA_OUT TERRA_OUT TERRA_OUT);
TERRA_ATTENTION_SYMBOLS(int8)
TERRA_ATTENTION_SYMBOLS(bf16)

#define TERRA_S32 .Arg<ffi::Buffer<ffi::S32>>()
#define TERRA_LSH_BIND TERRA_S32 TERRA_S32 TERRA_S32 TERRA_S32 TERRA_S32 TERRA_S32 TERRA_OUT TERRA_OUT TERRA_OUT
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_lsh_decode_attention_f32, LshDecodeF32,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_F32 TERRA_F32 TERRA_LSH_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_lsh_decode_attention_int8, LshDecodeInt8,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_WEIGHT_BIND_int8
                                  TERRA_WEIGHT_BIND_int8 TERRA_LSH_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_lsh_decode_attention_bf16, LshDecodeBf16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_WEIGHT_BIND_bf16
                                  TERRA_WEIGHT_BIND_bf16 TERRA_LSH_BIND);

#define TERRA_CACHE_BIND TERRA_F32 TERRA_S32 TERRA_OUT TERRA_OUT TERRA_OUT
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_cache_attention_f32, CacheAttentionF32,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_F32 TERRA_F32 TERRA_CACHE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_cache_attention_int8, CacheAttentionInt8,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_WEIGHT_BIND_int8
                                  TERRA_WEIGHT_BIND_int8 TERRA_CACHE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_cache_attention_bf16, CacheAttentionBf16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_WEIGHT_BIND_bf16
                                  TERRA_WEIGHT_BIND_bf16 TERRA_CACHE_BIND);

#define TERRA_BLOCKED_BIND ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_F32 TERRA_F32 TERRA_F32 TERRA_OUT
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_blocked_attention, BlockedAttentionImpl<false>, TERRA_BLOCKED_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_blocked_attention_causal, BlockedAttentionImpl<true>, TERRA_BLOCKED_BIND);

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_lsh_chunk_attention, LshChunkAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_F32 TERRA_F32 TERRA_S32 TERRA_S32 TERRA_OUT
                                      TERRA_OUT.Attr<int64_t>("before")
                                      .Attr<int64_t>("after")
                                      .Attr<bool>("causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_lsh_hash, LshHashImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_F32
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<ffi::Span<const int64_t>>("factors"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_module_convolution, ModuleConvolutionImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() TERRA_F32 TERRA_F32 TERRA_F32 TERRA_OUT);

// The instruction set the handlers use: 0 portable C++, 1 AVX2+FMA, 2 AVX-512. request < 0 only
// asks; otherwise the handlers switch to min(request, the best this CPU supports), so that one
// machine can check every variant. Returns the set now in use.
extern "C" int terra_cpu_kernels_isa(int request) {
  if (request >= 0) g_isa.store(std::min(request, SupportedIsa()));
  return g_isa.load();
}

#pragma GCC visibility pop

}  // namespace terra::native

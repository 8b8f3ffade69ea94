// The XLA FFI handlers: the products' and the fused layers' custom calls, registered by
// terra/quantization/kernels.py, for B = 1..8 rows of x:
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
//   terra_sparse_feed_forward_{int8,bf16}  a sparse feed-forward layer's decode step (sparse_feedforward.h)
//   terra_sparse_attention                 a sparse QKV layer's decode step and its attention (attention.cc)
// and terra_narrow_products_isa, which reads or lowers the instruction set the handlers use.

#include <algorithm>
#include <cstdint>

#include "attention.h"
#include "isa.h"
#include "products.h"
#include "sparse_feedforward.h"
#include "xla/ffi/api/ffi.h"

namespace terra::native {
namespace {

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
  if (request >= 0) g_isa.store(std::min(request, SupportedIsa()));
  return g_isa.load();
}

#pragma GCC visibility pop

}  // namespace terra::native

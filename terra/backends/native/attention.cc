// The sparse attention handler: a sparse QKV layer's projections and its softmax attention over the
// KV cache (or the encoder's keys and values) in one call per decode step.

#include "attention.h"
#include "cache_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "isa.h"
#include "product_kernels.h"
#include "products.h"
#include "threads.h"

namespace terra::native {

namespace {

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
// every line of the weights.

template <typename W>
struct Convolution {
  InputMajorProduct<W> product;  // x: the unfolded windows [B * S, F * k * M]; y [B * S, M_out]
  const float* bias;             // [M_out]
  int64_t k;                     // modules per window
};

// The attention of a decode step's one query per head over its keys and values
// (terra/layers/attention.py), for layers whose S modules are the heads (M = d_head), so that row b * S + s of
// the convolutions' outputs is head s of batch row b and the thread that computed a row attends
// with it. kSelf: causal self-attention over the KV cache [B, H, L, Dh], positions < index visible
// (and key_mask, where a prefill padded them), plus the new key and value, which are then written at
// position min(index, L - 1) after the reads (the aliased cache is updated in place); kCross: over
// the encoder's keys and values with an additive bias [B, L]. A position the key mask hides gets the
// layer's -1e9 added, as the XLA form adds it: its probability is exactly 0 (exp(-1e9 - max)
// underflows), since a causal query always sees its own key.
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

// Head row r (batch b = r / H, head h = r % H) of query q, new key k and value v (self only), each
// [Dh]: the visible cache rows by the shared core (cache_attention.h), then, for self-attention, the
// query's own key joined into the softmax and the new key and value written.
template <typename I>
TERRA_INLINE void AttendRow(const DecodeAttention& a, int64_t r, int64_t heads, int64_t dh, const float* q,
                            const float* k, const float* v) {
  const int64_t b = r / heads, length = a.length;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dh)));  // as the layer's q.shape[-1] ** -0.5
  float* keys = a.keys + r * length * dh;
  float* values = a.values + r * length * dh;
  const bool self = a.mode == DecodeAttention::kSelf;
  thread_local std::vector<float> scaled_buffer, logit_buffer;
  scaled_buffer.resize(static_cast<size_t>(dh));
  float* scaled = scaled_buffer.data();
  for (int64_t d = 0; d < dh; ++d) scaled[d] = q[d] * scale;
  CachedRows<float> cache;
  cache.keys = keys, cache.values = values, cache.dh = dh;
  cache.visible = self ? std::min(a.index, length) : length;
  cache.key_mask = a.key_mask ? a.key_mask + b * length : nullptr;
  cache.bias = a.bias ? a.bias + b * length : nullptr;
  float* y = a.y + r * dh;
  const SoftmaxTerms past = AttendCachedRows<I>(scaled, cache, y, logit_buffer);
  if (!self) {
    const float inverse = 1.0f / past.total;
    for (int64_t d = 0; d < dh; ++d) y[d] *= inverse;
    return;
  }
  const float own = RowDot(scaled, k, dh);
  const float top = std::max(past.top, own);
  const float past_weight = std::exp(past.top - top), own_weight = std::exp(own - top);
  const float inverse = 1.0f / (past.total * past_weight + own_weight);
  for (int64_t d = 0; d < dh; ++d) y[d] = (y[d] * past_weight + own_weight * v[d]) * inverse;
  const int64_t position = std::max<int64_t>(0, std::min(a.index, length - 1));
  std::memcpy(keys + position * dh, k, dh * sizeof(float));
  std::memcpy(values + position * dh, v, dh * sizeof(float));
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

template <typename I, typename W>
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
        I::StoreWide(gated + i, I::LoadWide(x + i) * (I::WidenLanes(gate + i) * scale));
      }
      for (; i < s.d; ++i) gated[i] = x[i] * (Widen(gate[i]) * scale);
    }
    InputMajorRowRange<I, W>(s.mult, r0, r1);
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
    InputMajorRowRange<I, W>(conv.product, r0, r1);
    const int64_t n_out = conv.product.n_out;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < n_out; ++o) conv.product.y[r * n_out + o] += conv.bias[o];
  }
  if (s.attention.mode == DecodeAttention::kNone) return;
  const bool self = s.attention.mode == DecodeAttention::kSelf;
  for (int64_t r = r0; r < r1; ++r) {
    const float* q = s.convs[0].product.y + r * m;
    AttendRow<I>(s.attention, r, s.n_modules, m, q, self ? s.convs[1].product.y + r * m : nullptr,
              self ? s.convs[2].product.y + r * m : nullptr);
  }
}

template <typename W>
void SparseAttentionDecode(ffi::ThreadPool& pool, SparseAttentionStep<W>& s) {
  const int isa = ActiveIsa();
  int64_t work = s.mult.n_in * s.mult.n_out * s.mult.batch;  // multiply-adds
  for (int c = 0; c < s.n_convs; ++c) work += s.convs[c].product.n_in * s.convs[c].product.n_out * s.convs[c].product.batch;
  const bool parallel = work >= kParallelBytes;
  s.ShareRows(parallel ? Workers(pool) : 1);
  RunPhases(pool, parallel, {s.RowChunks(), s.RowChunks()},
            [&](int phase, int64_t c) {
              WithIsa(isa, [&](auto tag) TERRA_INLINE_LAMBDA { SparseAttentionChunk<decltype(tag)>(s, phase, c); });
            });
}

}  // namespace

// The operands arrive by name (SparseAttentionOperands, bound by the handlers in handlers.cc); the
// checks here are of their shapes, which the bindings do not fix.
template <typename W>
ffi::Error SparseAttention(ffi::ThreadPool& pool, const SparseAttentionOperands<W>& o) {
  using Mode = typename SparseAttentionOperands<W>::Mode;
  const int64_t mode = o.mode;
  const int n_convs = o.n_convs;
  if (n_convs < 1 || n_convs > kMaxConvolutions)
    return ffi::Error::InvalidArgument("sparse attention: one to three convolutions");
  if (n_convs != (mode == Mode::kSelf ? 3 : 1) && mode != Mode::kNone)
    return ffi::Error::InvalidArgument("sparse attention: self-attention takes Q, K and V, cross-attention Q alone");
  const auto xd = o.x.shape, gd = o.gate.values.shape, ed = o.kernel.values.shape, rd = o.conv_rows.shape;
  if (xd.size() != 2 || gd.size() != 2 || ed.size() != 2 || rd.size() != 4)
    return ffi::Error::InvalidArgument("sparse attention: x, gate, E must be 2-D and the conv rows 4-D");
  const int64_t batch = xd[0], d = xd[1], n_modules = gd[0], module = ed[1], length = rd[1] + 1;
  if (gd[1] != d || ed[0] != d || rd[0] != batch || rd[2] != n_modules || rd[3] != module ||
      o.mult_bias.count != n_modules * module || batch * n_modules > kMaxInputMajorRows)
    return ffi::Error::InvalidArgument(
        "sparse attention: x [B, d], gate [S, d], E [d, M], bias [S * M] and conv rows [B, F - 1, S, M] disagree");
  // The scratch is the calling thread's, grown to the largest layer it has run and reused by its
  // later calls: a fresh allocation per call would be new pages to zero on every decode step, and
  // XLA need not hold it as results. The pool's threads reach it only within this call.
  thread_local std::vector<float> gated_scratch, u_scratch, window_scratch[kMaxConvolutions];
  gated_scratch.resize(static_cast<size_t>(batch * n_modules * d));
  u_scratch.resize(static_cast<size_t>(batch * n_modules * module));
  SparseAttentionStep<W> s{};
  s.x = o.x.data;
  s.gate = o.gate.values.data;
  s.gate_scale = o.gate.scale.data;
  s.gated = gated_scratch.data();
  s.mult = {s.gated, o.kernel.values.data, o.kernel.scale.data, u_scratch.data(), batch * n_modules, d, module, 1};
  s.mult_bias = o.mult_bias.data;
  // The new conv rows are written over the old ones (the result aliases the operand), which the
  // windows read first: they read a copy (F - 1 rows of S x M floats).
  thread_local std::vector<float> old_rows;
  old_rows.assign(o.conv_rows.data, o.conv_rows.data + o.conv_rows.count);
  s.rows = old_rows.data();
  s.new_rows = o.new_rows;
  s.batch = batch, s.d = d, s.n_modules = n_modules, s.module = module, s.length = length, s.n_convs = n_convs;
  for (int c = 0; c < n_convs; ++c) {
    const NarrowWeight<W>& kernel = o.conv_kernels[c];
    const auto kd = kernel.values.shape;
    if (kd.size() != 4 || kd[0] != length || kd[2] != module || kd[1] % 2 == 0 || o.conv_biases[c].count != kd[3])
      return ffi::Error::InvalidArgument(
          "sparse attention: a convolution kernel must be [F, k (odd), M, M_out] with a bias [M_out]");
    window_scratch[c].resize(static_cast<size_t>(batch * n_modules * length * kd[1] * module));
    s.windows[c] = window_scratch[c].data();
    s.convs[c] = {{s.windows[c], kernel.values.data, kernel.scale.data, o.outs[c], batch * n_modules,
                   length * kd[1] * module, kd[3], 1},
                  o.conv_biases[c].data, kd[1]};
  }
  if (mode != Mode::kNone) {
    const auto kd = o.keys.shape;
    for (int c = 0; c < n_convs; ++c)
      if (s.convs[c].product.n_out != module)
        return ffi::Error::InvalidArgument("sparse attention: fused attention needs convolutions of M outputs");
    if (kd.size() != 4 || kd[0] != batch || kd[1] != n_modules || kd[3] != module || o.values.shape.size() != 4 ||
        o.values.count != o.keys.count || kd[2] < 1)
      return ffi::Error::InvalidArgument("sparse attention: keys and values must be [B, S, L, M] (S heads of M)");
    DecodeAttention& a = s.attention;
    a.mode = mode, a.length = kd[2], a.y = o.y;
    if (mode == Mode::kSelf) {
      if (o.index.count != 1 || o.key_mask.count != batch * kd[2])
        return ffi::Error::InvalidArgument("sparse attention: the cache index must be s32[] and the key mask pred [B, L]");
      a.index = *o.index.data;
      a.key_mask = o.key_mask.data;
      a.keys = o.new_keys, a.values = o.new_values;
      // The results alias the operands; where XLA could not alias them it copied them in first.
      const size_t bytes = static_cast<size_t>(o.keys.count) * sizeof(float);
      if (a.keys != o.keys.data) std::memcpy(a.keys, o.keys.data, bytes);
      if (a.values != o.values.data) std::memcpy(a.values, o.values.data, bytes);
    } else {
      if (o.bias.count != batch * kd[2])
        return ffi::Error::InvalidArgument("sparse attention: the encoder bias must be [B, L]");
      a.keys = o.keys.data, a.values = o.values.data;
      a.bias = o.bias.data;
    }
  }
  SparseAttentionDecode(pool, s);
  return ffi::Error::Success();
}

template ffi::Error SparseAttention<int8_t>(ffi::ThreadPool&, const SparseAttentionOperands<int8_t>&);
template ffi::Error SparseAttention<uint16_t>(ffi::ThreadPool&, const SparseAttentionOperands<uint16_t>&);

}  // namespace terra::native

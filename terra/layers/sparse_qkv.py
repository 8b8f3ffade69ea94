"""Sparse QKV attention (paper §3.2; reference ``MultiplicativeConvCausalAttention``,
``docs/design/reference_code.md`` §2.2–§2.6).

The dense Q, K, V and output projections of the decoder self-attention are replaced by

  u = mult(x)                      one multiplicative layer shared by Q, K and V: [.., S, M]
  Q = conv_q(u), K = conv_k(u)     convolution over (length F, modules k=3), causal in length
  V = conv_v(u)                    the same with a module kernel of 1 (F x 1)
  out = attention(Q, K, V)         no output projection

With ``S = n_heads`` each module is one head. In decode mode the last ``F - 1`` rows of ``u``
are kept in the cache (one cache shared by the three convolutions, which all read ``u``), and
keys/values of past tokens in the usual KV cache. Ablation variants ('mult': multiplicative
Q, K, V and output; 'conv': convolutions on the raw modules, output convolution over modules
only) and a sparse query path for encoder-decoder attention are in this module too.
"""

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra import backends
from terra.backends import (
    ConvolutionRows,
    KVCache,
    as_float,
    cached_attention,
    get_state,
    has_state,
    input_major_product,
    module_convolution,
    put_state,
)
from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.attention import AttentionBase
from terra.layers.dense import BIAS_INIT
from terra.layers.multiplicative import MultiplicativeDense

VARIANTS = ("multconv", "mult", "conv")


class ModuleConvolution(nn.Module):
    """Convolution over (length, modules) with weights shared across modules.

    ``u``: ``[batch, length, S, M_in]`` -> ``[batch, length', S, features]``. The module axis
    is zero-padded by ``(k - 1) / 2`` on each side. With ``causal_pad`` the length axis is
    left-padded with ``F - 1`` zero rows (output length = input length); without it the input
    carries ``F - 1`` rows of history (decode) and the output has ``F - 1`` fewer rows.
    Kernel ``[F, k, M_in, features]`` ~ N(0, 2/(M_in + features)) (the reference's
    GlorotNormal with channel fans), bias ``[features]`` ~ N(0, 1e-6).
    """

    features: int
    length_kernel_size: int = 3
    module_kernel_size: int = 3
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, u: jax.Array, *, causal_pad: bool = True) -> jax.Array:
        f, k = self.length_kernel_size, self.module_kernel_size
        if k % 2 == 0 or k <= 0 or f <= 0:
            raise ConfigError(
                f"ModuleConvolution: module kernel {k} must be odd and positive, length kernel {f} positive."
            )
        m_in = u.shape[-1]
        std = (2.0 / (m_in + self.features)) ** 0.5
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(
                nn.initializers.normal(std), (axes.CONV_LENGTH, axes.CONV_MODULES, axes.KV_IN, axes.KV)
            ),
            (f, k, m_in, self.features),
        )
        bias = self.param("bias", nn.with_logical_partitioning(BIAS_INIT, (axes.KV,)), (self.features,))
        if causal_pad:
            return convolve_modules(u, kernel, bias, self.dtype)
        u = jnp.pad(u.astype(self.dtype), ((0, 0), (0, 0), ((k - 1) // 2, (k - 1) // 2), (0, 0)))
        return self._unfolded(u, kernel) + jnp.asarray(bias, self.dtype)

    def _unfolded(self, u: jax.Array, kernel) -> jax.Array:
        """The same convolution as one matrix product over unfolded windows. Used in decode,
        where the input is a few rows and XLA:CPU runs this faster than its convolution op
        (figures in ``docs/architecture.md``, "Decisions taken from measurements"); a decode
        tree's narrow kernel is read by the input-major product."""
        f, k, m_in, m_out = kernel.shape
        batch, length, padded_modules, _ = u.shape
        n_modules, out_length = padded_modules - (k - 1), length - (f - 1)
        windows = jnp.stack(
            [jnp.stack([u[:, t : t + out_length, j : j + n_modules] for j in range(k)], axis=3) for t in range(f)],
            axis=3,
        )  # [batch, out_length, S, F, k, M_in]
        windows = windows.reshape(batch, out_length, n_modules, f * k * m_in)
        return input_major_product(windows, kernel.reshape(f * k * m_in, m_out))

    def stored_weights(self):
        """``(kernel, bias)`` as the parameters store them (float, or a decode tree's narrow
        weights), for a layer that hands its weights to a backend's fused decode step; ``None`` for
        any not yet created."""
        return tuple(nn.unbox(self.get_variable("params", name)) for name in ("kernel", "bias"))


def convolve_modules(u: jax.Array, kernel, bias, dtype=jnp.float32) -> jax.Array:
    """:class:`ModuleConvolution` over a whole sequence (causal in length, output length = input
    length): ``u`` ``[batch, length, S, M_in]``, ``kernel`` ``[F, k, M_in, features]`` (float or a
    decode tree's narrow weights, widened here), ``bias`` ``[features]`` -> ``[batch, length, S,
    features]``. Linear in ``(kernel, bias)``: the sum of two convolutions of one input is one
    convolution with the summed weights (``LSHSelfAttention``'s shared QK)."""
    f, k = kernel.shape[:2]

    def unfused(u, kernel, bias):
        u = jnp.pad(u, ((0, 0), (f - 1, 0), ((k - 1) // 2, (k - 1) // 2), (0, 0)))
        y = jax.lax.conv_general_dilated(u, kernel, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + bias

    # A backend may convolve in one call (XLA:CPU's convolution op runs this shape well below its
    # small products' rate; docs/architecture.md, "The LSH prefill's bookkeeping").
    return module_convolution(
        u.astype(dtype), as_float(kernel, dtype), jnp.asarray(as_float(bias, dtype), dtype), unfused
    )


def attention_sparsity_modules(d_model: int, n_heads: int, attention_sparsity: Optional[int], who: str) -> int:
    s = n_heads if attention_sparsity is None else attention_sparsity
    if s <= 0 or d_model % s:
        raise ConfigError(
            f"{who}: d_model={d_model} is not divisible by attention_sparsity S={s}; choose S dividing d_model "
            f"(the paper uses S = n_heads = {n_heads})."
        )
    return s


class ConvolutionCacheMixin:
    """The last ``F - 1`` rows of a convolution's input, kept in the cache for decoding."""

    def conv_window(self, u: jax.Array, length_kernel_size: int, decode: bool, prefix_mask=None):
        """Returns ``(window, causal_pad)`` for convolutions over ``u`` ``[b, l, S, M]``.

        A cache-creating call given ``prefix_mask`` ``[b, l]`` (a prefill whose real tokens
        come first) keeps the ``F - 1`` rows just before each row's first padded position,
        zeros where the prefix is shorter (the reference's ``_RememberPad`` with the portal
        mask, §2.4, here per row).
        """
        if not decode or length_kernel_size == 1:
            return u, True
        history = length_kernel_size - 1
        if not has_state(self, ConvolutionRows):
            rows = jnp.zeros((u.shape[0], history) + u.shape[2:], u.dtype)
            if prefix_mask is not None:
                n_real = jnp.sum(prefix_mask.astype(jnp.int32), axis=1)
                padded = jnp.pad(u, ((0, 0), (history, 0)) + ((0, 0),) * (u.ndim - 2))
                take = lambda t, n: jax.lax.dynamic_slice_in_dim(t, n, history, axis=0)  # noqa: E731
                rows = jax.vmap(take)(padded, n_real)
            put_state(self, ConvolutionRows(rows))
            return u, True
        window = jnp.concatenate([get_state(self, ConvolutionRows).rows, u], axis=1)
        put_state(self, ConvolutionRows(window[:, -history:]))
        return window, False

    def fused_decode(
        self,
        x: jax.Array,
        mult: MultiplicativeDense,
        convolutions: Sequence[ModuleConvolution],
        decode: bool,
        deterministic: bool,
        attention=None,
    ):
        """A decode step of the multiplicative layer ``mult``, its convolution window and the
        convolutions ``convolutions``, and with ``attention`` the attention too, as one backend call
        (``backends.sparse_attention_step``; one native call when the weights are narrow and the
        step runs on the CPU): the same computation as the layers one by one, in one call instead
        of about twenty operations (``docs/decode_speed.md``).

        ``attention``: ``None`` returns each convolution's output ``[b, 1, S, M]``; ``"self"``
        (Q, K, V) attends causally over this module's :class:`KVCache` and a ``KVCache`` (the
        encoder's keys and values) over it, each returning ``y [b, 1, d_model]``, where the S
        modules are the heads (otherwise the convolutions' outputs are returned and the caller
        attends).
        Returns ``None`` where the fused call does not apply (training, prefill, no backend fusing
        these weights: float32 weights, a batch past the kernel's rows), and the caller computes
        the layers one by one."""
        batch, length_kernel_size = x.shape[0], convolutions[0].length_kernel_size
        if not decode or length_kernel_size < 2 or x.ndim != 3 or x.shape[1] != 1 or self.dtype != jnp.float32:
            return None
        gate, kernel, bias = mult.stored_weights()
        if not has_state(self, ConvolutionRows) or gate is None:
            return None
        mode, cache = self._fused_attention(attention, gate.shape[0], deterministic)
        weights = backends.SparseAttentionWeights(
            gate, kernel, bias, tuple(convolution.stored_weights() for convolution in convolutions)
        )

        def unfused(x, conv_rows, cache):
            window = jnp.concatenate([conv_rows, mult(x)], axis=1)
            outs = [convolution(window, causal_pad=False) for convolution in convolutions]
            if mode is None:
                return outs, window[:, 1:], None
            heads = [self._heads_first(o.reshape(batch, 1, self.n_heads, -1)) for o in outs]
            written = None
            if mode == "self":
                y, written = cached_attention(*heads, cache)
            else:
                y = self._attend_encoder(heads[0], cache, True)
            return self._heads_first(y).reshape(batch, 1, -1), window[:, 1:], written

        conv_rows = get_state(self, ConvolutionRows).rows
        result = backends.sparse_attention_step(x, weights, conv_rows, mode, cache, unfused)
        if result is None:
            return None
        out, new_rows, written = result
        put_state(self, ConvolutionRows(new_rows))
        if written is not None:
            put_state(self, written)
        return out

    def _fused_attention(self, attention, n_modules: int, deterministic: bool):
        """``(mode, cache)`` of the attention a fused step includes: ``("self", this layer's
        KVCache)``, ``("cross", the encoder's)``, or ``(None, None)`` where it cannot (modules that
        are not the heads, attention dropout, a self-attention cache not yet made)."""
        if attention is None or n_modules != self.n_heads or not (deterministic or self.dropout_rate == 0):
            return None, None
        if attention == "self":
            return ("self", get_state(self, KVCache)) if has_state(self, KVCache) else (None, None)
        return "cross", attention


class SparseQKVAttention(AttentionBase, ConvolutionCacheMixin):
    """Decoder causal self-attention with sparse Q, K, V (the paper's "Sparse QKV").

    Same contract as ``CausalSelfAttention``; ``[batch, length, d_model] -> same``.

    Attributes:
      attention_sparsity: S modules (default ``n_heads``; the paper's 800M model uses 16).
      length_kernel_size: F, the causal window along the sequence (3).
      module_kernel_size: k of the Q and K convolutions along the modules (3).
      value_module_kernel_size: k of the V convolution (1, i.e. F x 1, as the reference).
      variant: 'multconv' (the paper's), 'mult' (multiplicative Q, K, V and output) or
        'conv' (convolutions on the raw modules, output convolution over modules only).
    """

    attention_sparsity: Optional[int] = None
    length_kernel_size: int = 3
    module_kernel_size: int = 3
    value_module_kernel_size: int = 1
    variant: str = "multconv"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
        max_decode_length: Optional[int] = None,
        prefix_mask: Optional[jax.Array] = None,
    ) -> jax.Array:
        if self.variant not in VARIANTS:
            raise ConfigError(f"SparseQKVAttention.variant={self.variant!r}; use one of {VARIANTS}.")
        s = attention_sparsity_modules(self.d_model, self.n_heads, self.attention_sparsity, "SparseQKVAttention")
        m = self.d_model // s
        batch, length = x.shape[:2]

        def heads(t):  # [b, l, S, M] or [b, l, d] -> [b, h, l, d_head]
            return self._heads_first(t.reshape(batch, -1, self.n_heads, self.d_head))

        if self.variant == "mult":
            q, k, v = (
                heads(MultiplicativeDense(self.d_model, s, dtype=self.dtype, name=name)(x)) for name in ("q", "k", "v")
            )
        else:
            mult = None
            if self.variant == "multconv":
                mult = MultiplicativeDense(self.d_model, s, split_modules=True, dtype=self.dtype, name="mult")
            convolutions = self._qkv_convolutions(m)
            fused = None
            if mult is not None:
                fused = self.fused_decode(x, mult, convolutions, decode, deterministic, attention="self")
                if fused is not None and not isinstance(fused, list):  # the attention is in the call too
                    return fused
            if fused is None:
                u = x.reshape(batch, length, s, m) if mult is None else mult(x)
                window, causal_pad = self.conv_window(u, self.length_kernel_size, decode, prefix_mask)
                fused = [convolution(window, causal_pad=causal_pad) for convolution in convolutions]
            q, k, v = (heads(t) for t in fused)
        y = self._causal_attend(
            q,
            k,
            v,
            deterministic=deterministic,
            decode=decode,
            max_decode_length=max_decode_length,
            prefix_mask=prefix_mask,
        )
        y = self._heads_first(y).reshape(batch, -1, self.d_model)
        if self.variant == "mult":
            return MultiplicativeDense(self.d_model, s, dtype=self.dtype, name="out")(y)
        if self.variant == "conv":
            y = y.reshape(batch, -1, s, m)
            return ModuleConvolution(m, 1, self.module_kernel_size, dtype=self.dtype, name="out_conv")(y).reshape(
                batch, -1, self.d_model
            )
        return y  # the paper removes the output projection

    def _qkv_convolutions(self, m: int):
        """The Q, K and V convolutions over modules of ``m`` features (F x k, F x k, F x k_v)."""
        return [
            ModuleConvolution(m, self.length_kernel_size, k, dtype=self.dtype, name=name)
            for name, k in (
                ("q_conv", self.module_kernel_size),
                ("k_conv", self.module_kernel_size),
                ("v_conv", self.value_module_kernel_size),
            )
        ]


class SparseQueryCrossAttention(AttentionBase, ConvolutionCacheMixin):
    """Encoder-decoder attention with a sparse query path (the reference's
    ``enc_dec_attention_sparsity``, §2.6): ``Q = conv(mult(x))`` (causal over decoder
    positions, F x k), keys and values dense from the encoder output and cached, and no
    output projection. Same contract as ``CrossAttention``.
    """

    attention_sparsity: Optional[int] = None
    length_kernel_size: int = 3
    module_kernel_size: int = 3

    @nn.compact
    def __call__(self, x, encoded, encoder_mask, *, deterministic: bool = True, decode: bool = False):
        s = attention_sparsity_modules(self.d_model, self.n_heads, self.attention_sparsity, "SparseQueryCrossAttention")
        m = self.d_model // s
        batch = x.shape[0]
        mult = MultiplicativeDense(self.d_model, s, split_modules=True, dtype=self.dtype, name="mult")
        q_conv = ModuleConvolution(m, self.length_kernel_size, self.module_kernel_size, dtype=self.dtype, name="q_conv")
        fused = None
        if decode and has_state(self, KVCache):
            cached = self._encoder_keys_values(encoded, encoder_mask, decode=decode)
            fused = self.fused_decode(x, mult, [q_conv], decode, deterministic, cached)
            if fused is not None and not isinstance(fused, list):  # the attention is in the call too
                return fused
        if fused is not None:
            q = fused[0]
        else:
            window, causal_pad = self.conv_window(mult(x), self.length_kernel_size, decode)
            q = q_conv(window, causal_pad=causal_pad)
        q = self._heads_first(q.reshape(batch, -1, self.n_heads, self.d_head))
        y = self._attend_encoder(q, self._encoder_keys_values(encoded, encoder_mask, decode=decode), deterministic)
        return self._heads_first(y).reshape(batch, -1, self.d_model)


def sparse_qkv_param_count(d_model: int, n_heads: int, attention_sparsity: int, length_kernel_size: int = 3) -> int:
    """The paper's count for the default ('multconv') layer:
    ``S·d + d·M + d`` (shared multiplicative layer) ``+ 2·(F·3·M² + M) + (F·1·M² + M)``."""
    s, f = attention_sparsity, length_kernel_size
    m = d_model // s
    return s * d_model + d_model * m + d_model + 2 * (f * 3 * m * m + m) + (f * m * m + m)

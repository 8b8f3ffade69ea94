"""Attention caches stored narrow for decoding: the sibling of ``weights_dtype``
(``terra.quantization``) for the keys and values a decode step reads.

At long inputs a decode step reads its attention caches (the decoder's self-attention cache and the
cross-attention's encoder keys/values) more than its weights, so their bytes set the step time.
``cache_dtype`` stores them as:

- ``float32``: unchanged (the default; the cache pytree is exactly as before).
- ``bfloat16``: the values rounded to bfloat16, no scale (relative error <= 2^-9 per element), kept
  as their 16 bits in a ``uint16`` array, as the weights' bfloat16 store keeps them
  (``terra/quantization/quantized.py``): XLA:CPU slices and widens a ``bfloat16`` array through a
  float32 copy of all of it (a 16 x 8192 x 64 cache step measured 8-11 ms against 2.3 ms for
  float32), while ``bitcast(uint32(bits) << 16)`` widens the bits exactly inside the fused loop
  (2.3-2.5 ms).
- ``int8``: symmetric int8 with one float32 scale per row of ``d_head`` values (per batch, head and
  position): ``scale = max|row| / 127`` (1 for an all-zero row), ``values = round(row / scale)``;
  the error per element is at most ``scale / 2 = max|row| / 254``.

Plain jax (no flax, no gin) so every attention layer can use it. A per-position scale factors out
of the attention products, so a step never widens a whole cache: ``q . (s_k K_k) = s_k (q . K_k)``
scales the ``[..., max_len]`` logits and ``sum_k p_k s_k V_k = (p * s) . V`` the probabilities
(``terra.backends.cache_attention``; on the CPU each row is widened in registers as it is read).
"""

from typing import Optional

import jax
import jax.numpy as jnp

from terra.errors import ConfigError

CACHE_DTYPES = ("float32", "bfloat16", "int8")
INT8_MAX = 127.0


def check_cache_dtype(name: str) -> str:
    """``name`` if it names a cache store, else a :class:`ConfigError` listing them."""
    if name not in CACHE_DTYPES:
        raise ConfigError(
            f"cache_dtype '{name}' is not one of {', '.join(CACHE_DTYPES)} "
            "(bfloat16 and int8 store the attention caches narrow for decoding)."
        )
    return name


def storage_dtype(cache_dtype: str, dtype=jnp.float32):
    """The array dtype a cache of ``cache_dtype`` holds its values in: ``dtype`` (the compute
    dtype) for float32, ``uint16`` (bfloat16 bits) for bfloat16, ``int8``."""
    check_cache_dtype(cache_dtype)
    return {"float32": dtype, "bfloat16": jnp.uint16, "int8": jnp.int8}[cache_dtype]


def is_narrow(cache_dtype: str) -> bool:
    """Whether ``cache_dtype`` stores the cache in other than the compute dtype."""
    return check_cache_dtype(cache_dtype) != "float32"


def narrow(x: jax.Array, cache_dtype: str) -> tuple[jax.Array, Optional[jax.Array]]:
    """``x [..., d]`` (float) as a cache stores it.

    Returns:
      ``(values, scales)``: ``values [..., d]`` as the cache stores them (``x`` unchanged for
      float32, ``uint16`` bfloat16 bits, int8); ``scales [...]`` float32 (``max|row| / 127``, 1 for an all-zero row) for
      int8, ``None`` otherwise.
    """
    check_cache_dtype(cache_dtype)
    if cache_dtype == "float32":
        return x, None
    if cache_dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), None
    x = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1)
    scales = jnp.where(peak > 0, peak / INT8_MAX, 1.0).astype(jnp.float32)
    values = jnp.clip(jnp.round(x / scales[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scales


def widen(values: jax.Array, scales: Optional[jax.Array], dtype=jnp.float32) -> jax.Array:
    """``values [..., d]`` (and ``scales [...]`` for int8, else ``None``) back to ``dtype [..., d]``.

    Widens the whole array: for prefill and small caches; a decode step's products apply the scale
    to their logits and probabilities instead (``terra.backends.primitives``). ``uint16`` values
    are bfloat16 bits.
    """
    if values.dtype == jnp.uint16:
        values = jax.lax.bitcast_convert_type(values.astype(jnp.uint32) << 16, jnp.float32)
    x = values.astype(dtype)
    if scales is not None:
        x = x * scales[..., None].astype(dtype)
    return x


def empty(shape, cache_dtype: str, dtype=jnp.float32) -> tuple[jax.Array, Optional[jax.Array]]:
    """A cache of ``shape [..., d]`` before anything is written: ``(values, scales)`` with values
    zeros in the cache's storage dtype (:func:`storage_dtype`; ``dtype`` for float32) and scales
    ``ones [...]`` float32 for int8, ``None`` otherwise."""
    values = jnp.zeros(shape, storage_dtype(cache_dtype, dtype))
    scales = jnp.ones(tuple(shape)[:-1], jnp.float32) if cache_dtype == "int8" else None
    return values, scales

"""An LSH decode step's attention over the cache rows it keeps: the rows read from a cache stored
as float32, bfloat16 or int8 (``terra.backends.decode_state``) and widened, only those, then one
softmax over them and the token's own key (no per-round combination, as the reference).
"""

from typing import Optional

import jax
import jax.numpy as jnp

from terra.backends import widen_rows
from terra.layers.attention import MASK_VALUE


def read_rows(values: jax.Array, scales: Optional[jax.Array], rows: jax.Array, dtype) -> jax.Array:
    """Rows ``rows [batch, heads, n]`` (−1: any row, masked by the caller) of a cache stored as
    ``values [batch, heads, max_len, d]`` (with int8's ``scales [batch, heads, max_len]``), widened
    to ``dtype``: ``[batch, heads, n, d]``. Only these rows are widened."""
    safe = jnp.maximum(rows, 0)
    values = jnp.take_along_axis(values, safe[..., None], axis=2, mode="clip")
    scales = None if scales is None else jnp.take_along_axis(scales, safe, axis=2, mode="clip")
    return widen_rows(values, scales, dtype)


def attend_with_self(q, self_logit, v, keys, values, valid, dropout) -> jax.Array:
    """One decode query's softmax over past ``keys``/``values`` ``[b, h, n, d]`` (``valid [b, h,
    n]``) and its own key (``self_logit [b, h, 1, 1]``, value ``v [b, h, 1, d]``); ``q [b, h, 1, d]``
    scaled by ``d ** -0.5``; ``dropout`` applied to the probabilities. Returns ``[b, h, 1, d]``."""
    past_logits = jnp.einsum("bhqd,bhkd->bhqk", q, keys.astype(q.dtype)).astype(jnp.float32)
    past_logits = past_logits + jnp.where(valid, 0.0, MASK_VALUE)[:, :, None, :].astype(jnp.float32)
    probs = jax.nn.softmax(jnp.concatenate([past_logits, self_logit], axis=-1), axis=-1)
    probs = dropout(probs).astype(v.dtype)
    past_values = jnp.einsum("bhqk,bhkd->bhqd", probs[..., :-1], values.astype(v.dtype))
    return past_values + probs[..., -1:] * v

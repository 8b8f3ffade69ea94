"""Trainable positional embeddings initialised with sin/cos (reference ``tl.PositionalEncoding``).

``docs/design/reference_code.md`` §4.6: ``pos_type=None`` gives a trainable ``[max_len, d_model]`` table
initialised with ``sin/cos(pos * exp(-ln(10000) * 2i / d))``. In decode mode the next
position is kept in the ``cache`` collection.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from terra.backends import DecodePosition, as_float, get_state, has_state, put_state, slice_rows
from terra.layers import axes


@functools.lru_cache(maxsize=4)
def sinusoid_table(max_len: int, d_model: int) -> np.ndarray:
    """``[max_len, d_model]`` table; even features are sin, odd features are cos. Read-only, and
    computed once per shape: the encoder's and the decoder's tables are one, and a model built
    again (each build traces its initializer) reuses it."""
    position = np.arange(max_len, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * -(np.log(10000.0) / d_model))
    angle = position * div  # computed in float64 once, each value rounded to float32 when stored
    table = np.empty((max_len, d_model), dtype=np.float32)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    table.flags.writeable = False
    return table


class TrainablePositionalEmbedding(nn.Module):
    """Adds a learned positional vector: ``[batch, length, d_model] -> same``.

    In decode mode (one token per call) the position comes from the cache variable
    ``position``, created at 0 on the first (cache-creating) call and advanced per step.

    Random start offsets (the reference's ``pos_start_from_zero_prob`` and
    ``pos_max_offset_to_add``, ``docs/design/reference_code.md`` §4.6 and §7): in training
    (``deterministic=False``), with probability ``1 - start_from_zero_prob`` the batch's
    positions start at a uniform offset in ``[0, max_offset)`` instead of 0 (drawn from the
    ``dropout`` rng), so rows beyond the training lengths get trained too; the length
    generalisation of Table 4 relies on it. Evaluation and decoding start at 0.
    """

    max_len: int
    dtype: jnp.dtype = jnp.float32
    start_from_zero_prob: float = 1.0
    max_offset: int = 0

    def _start(self, length: int, deterministic: bool):
        if deterministic or self.max_offset <= 0 or self.start_from_zero_prob >= 1.0:
            return 0
        offset_key, coin_key = jax.random.split(self.make_rng("dropout"))
        offset = jax.random.randint(offset_key, (), 0, self.max_offset)
        offset = jnp.where(jax.random.uniform(coin_key) < self.start_from_zero_prob, 0, offset)
        return jnp.minimum(offset, self.max_len - length)  # stay inside the table

    @nn.compact
    def __call__(self, x: jax.Array, *, decode: bool = False, deterministic: bool = True) -> jax.Array:
        length, d_model = x.shape[-2], x.shape[-1]

        def init(key, shape, dtype=jnp.float32):
            del key
            return jnp.asarray(sinusoid_table(*shape), dtype)

        table = self.param(
            "pos_embedding",
            nn.with_logical_partitioning(init, (axes.POSITIONS, axes.EMBED)),
            (self.max_len, d_model),
        )
        if not decode:
            table = as_float(table, self.dtype)
            if length > self.max_len:
                raise ValueError(
                    f"Sequence length {length} exceeds the positional table (max_len="
                    f"{self.max_len}); raise TransformerConfig.max_len or truncate the inputs."
                )
            start = self._start(length, deterministic)
            return x + lax.dynamic_slice_in_dim(table, start, length, axis=0)[None]
        if not has_state(self, DecodePosition):
            # Cache-creating call: the output is discarded by the caller.
            put_state(self, DecodePosition(jnp.zeros((), jnp.int32)))
            return x + slice_rows(table, 0, length).astype(self.dtype)[None]
        pos = get_state(self, DecodePosition).index
        put_state(self, DecodePosition(pos + length))
        # A decode tree's table may be narrow: only the rows read are widened.
        return x + slice_rows(table, pos, length).astype(self.dtype)[None]

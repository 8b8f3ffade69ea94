"""Terraformer's LengthConcat: encoder vectors and decoder embeddings in one sequence.

Paper §4.2; reference ``transformer2.py:_ConcatWithPadding`` and
``StripFromConcatenateWithPadding`` (``docs/design/reference_code.md`` §4.1 item 4). Per row, the
decoder runs over ``[n real encoder vectors, the L2 decoder vectors, zeros]`` (length
``L1 + L2``): the encoder padding moves to the end, so the decoder block starts right after
the row's last real encoder token and causal attention alone (no padding mask) keeps every
position away from the padding.

The reference slices ``enc[:, :n]`` and so assumes padding only at the end; here the real
encoder positions are gathered in order wherever they are (a stable sort of the mask), so
any padding pattern gives the same result as the real tokens packed first.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LengthConcat:
    """One batch's layout, computed once from the encoder mask and applied to every stream.

    ``order`` ``[b, L1]``: encoder positions, real ones first in order (a stable sort);
    ``n_real`` ``[b, 1]``: real encoder tokens per row; ``source`` ``[b, L1 + L2]``: for each
    concatenated position, its row in ``[encoded (L1), decoded (L2), one zero row]``;
    ``decoder_length``: L2.
    """

    order: jax.Array
    n_real: jax.Array
    source: jax.Array
    decoder_length: int

    @classmethod
    def from_mask(cls, encoder_mask: jax.Array, decoder_length: int) -> "LengthConcat":
        real = encoder_mask.astype(bool)
        batch, l1 = real.shape
        l2 = decoder_length
        order = jnp.argsort(~real, axis=1, stable=True)
        n_real = jnp.sum(real.astype(jnp.int32), axis=1, keepdims=True)
        j = jnp.arange(l1 + l2)[None, :]
        from_encoder = jnp.take_along_axis(order, jnp.minimum(j, l1 - 1).repeat(batch, 0), axis=1)
        source = jnp.where(j < n_real, from_encoder, jnp.where(j < n_real + l2, l1 + j - n_real, l1 + l2))
        return cls(order=order, n_real=n_real, source=source, decoder_length=decoder_length)

    def pack_real_first(self, x: jax.Array) -> jax.Array:
        """``[b, L1, d]`` -> the same vectors with the real positions first."""
        return jnp.take_along_axis(x, self.order[..., None], axis=1)

    def packed_mask(self) -> jax.Array:
        """``[b, L1]`` bool: the mask of ``pack_real_first``'s output."""
        return jnp.arange(self.order.shape[1])[None, :] < self.n_real

    def concat(self, encoded: jax.Array, decoded: jax.Array) -> jax.Array:
        """``[b, L1, d]`` encoder vectors, ``[b, L2, d]`` decoder vectors -> ``[b, L1 + L2, d]``:
        the real encoder vectors, the decoder vectors, then zeros."""
        batch, _, d = encoded.shape
        table = jnp.concatenate(
            [encoded, decoded.astype(encoded.dtype), jnp.zeros((batch, 1, d), encoded.dtype)], axis=1
        )
        return jnp.take_along_axis(table, self.source[..., None], axis=1)

    def strip(self, concatenated: jax.Array) -> jax.Array:
        """``[b, L1 + L2, d]`` -> the ``[b, L2, d]`` decoder positions (from each row's ``n_real``)."""
        positions = self.n_real + jnp.arange(self.decoder_length)[None, :]
        return jnp.take_along_axis(concatenated, positions[..., None], axis=1)


def concat_with_padding(encoded: jax.Array, encoder_mask: jax.Array, decoded: jax.Array) -> jax.Array:
    """``LengthConcat`` for one stream: ``[b, L1, d]``, ``[b, L1]``, ``[b, L2, d]`` -> ``[b, L1 + L2, d]``."""
    return LengthConcat.from_mask(encoder_mask, decoded.shape[1]).concat(encoded, decoded)


def strip_to_decoder(concatenated: jax.Array, encoder_mask: jax.Array, decoder_length: int) -> jax.Array:
    """``[b, L1 + L2, d]`` -> the ``[b, L2, d]`` decoder positions."""
    return LengthConcat.from_mask(encoder_mask, decoder_length).strip(concatenated)

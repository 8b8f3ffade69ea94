"""Terraformer's LengthConcat: encoder vectors and decoder embeddings in one sequence.

Paper §4.2; reference ``transformer2.py:_ConcatWithPadding`` and
``StripFromConcatenateWithPadding`` (``trax_reference.md`` §4.1 item 4). Per row, the
decoder runs over ``[n real encoder vectors, the L2 decoder vectors, zeros]`` (length
``L1 + L2``): the encoder padding moves to the end, so the decoder block starts right after
the row's last real encoder token and causal attention alone (no padding mask) keeps every
position away from the padding.

The reference slices ``enc[:, :n]`` and so assumes padding only at the end; here the real
encoder positions are gathered in order wherever they are (a stable sort of the mask), so
any padding pattern gives the same result as the real tokens packed first.
"""

import jax
import jax.numpy as jnp


def real_first_order(mask: jax.Array) -> jax.Array:
    """``[batch, length]`` mask -> ``[batch, length]`` positions, real ones first, in order."""
    return jnp.argsort(~mask.astype(bool), axis=1, stable=True)


def pack_real_first(x: jax.Array, mask: jax.Array):
    """``x`` ``[batch, length, d]`` and its mask -> both with the real positions first."""
    order = real_first_order(mask)
    return jnp.take_along_axis(x, order[..., None], axis=1), jnp.take_along_axis(mask.astype(bool), order, axis=1)


def concat_with_padding(encoded: jax.Array, encoder_mask: jax.Array, decoded: jax.Array) -> jax.Array:
    """``[b, L1, d]`` encoder vectors, ``[b, L1]`` mask, ``[b, L2, d]`` decoder vectors ->
    ``[b, L1 + L2, d]``: the ``n`` real encoder vectors, the decoder vectors, ``L1 - n`` zeros."""
    batch, l1, d = encoded.shape
    l2 = decoded.shape[1]
    n = jnp.sum(encoder_mask.astype(jnp.int32), axis=1, keepdims=True)  # [b, 1]
    order = real_first_order(encoder_mask)
    j = jnp.arange(l1 + l2)[None, :]
    from_encoder = jnp.take_along_axis(order, jnp.minimum(j, l1 - 1).repeat(batch, 0), axis=1)
    source = jnp.where(j < n, from_encoder, jnp.where(j < n + l2, l1 + j - n, l1 + l2))
    table = jnp.concatenate([encoded, decoded.astype(encoded.dtype), jnp.zeros((batch, 1, d), encoded.dtype)], axis=1)
    return jnp.take_along_axis(table, source[..., None], axis=1)


def strip_to_decoder(concatenated: jax.Array, encoder_mask: jax.Array, decoder_length: int) -> jax.Array:
    """``[b, L1 + L2, d]`` -> the ``[b, L2, d]`` decoder positions (starting at each row's ``n``)."""
    n = jnp.sum(encoder_mask.astype(jnp.int32), axis=1, keepdims=True)
    positions = n + jnp.arange(decoder_length)[None, :]
    return jnp.take_along_axis(concatenated, positions[..., None], axis=1)

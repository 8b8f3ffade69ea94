"""Discrete block selection shared by the sparse feed-forward layers (the Scaling Transformer's
controller and the mixture-of-experts router): choose one entry per block, train the choice
with a straight-through estimator. Decoding reads only the chosen rows
(``terra.backends.take_rows``, for float32 and narrow weights alike).
"""

import jax
import jax.numpy as jnp


def block_argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum along the last axis, int32 (``jnp.argmax``'s result, NaN
    counting as the maximum), computed as a max and a min: XLA:CPU's variadic argmax reduction
    is the slower of the two (docs/architecture.md, decisions), and decoding runs one per block
    per sparse layer and one over the vocabulary per token."""
    n = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def gumbel_block_argmax(logits: jax.Array, temperature: float, rng: jax.Array) -> jax.Array:
    """Training choice: ``argmax(log_softmax(logits) + temperature * Gumbel)``; the temperature
    scales the noise, it does not divide the logits (``docs/design/reference_code.md`` §1.2)."""
    gumbel = jax.random.gumbel(rng, logits.shape, jnp.float32)
    return block_argmax(jax.nn.log_softmax(logits) + temperature * gumbel)


def straight_through_mask(logits: jax.Array, indices: jax.Array, hard_prob: float, rng: jax.Array) -> jax.Array:
    """Training mask over the last axis: with probability ``hard_prob`` (one draw per call, for
    the whole call) the one-hot of ``indices`` with the softmax's gradient (straight-through),
    otherwise the softmax itself (arXiv:1801.09797 §2.1, as the reference)."""
    soft = jax.nn.softmax(logits, axis=-1)
    hard = jax.nn.one_hot(indices, logits.shape[-1], dtype=soft.dtype)
    hard = jax.lax.stop_gradient(hard) + soft - jax.lax.stop_gradient(soft)
    return jnp.where(jax.random.uniform(rng, ()) < hard_prob, hard, soft)


def expected_distinct_choices(n: int, batch: int) -> float:
    """Expected number of distinct entries among ``batch`` independent, uniform choices of one
    of ``n``: ``n * (1 - (1 - 1/n) ** batch)`` (each entry is missed by all of them with
    probability ``(1 - 1/n) ** batch``). A batched decode step reads the union of the rows its
    sequences select, once; exactly 1 for one choice."""
    if batch <= 1:
        return float(batch)
    return n * (1.0 - (1.0 - 1.0 / n) ** batch)

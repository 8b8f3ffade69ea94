"""Choosing the next token from logits (pure functions)."""

import jax
import jax.numpy as jnp


def sample_next_token(logits: jax.Array, rng: jax.Array, temperature: jax.Array) -> jax.Array:
    """``[batch, vocab]`` logits -> ``[batch]`` int32 tokens.

    ``temperature == 0`` is greedy (argmax). ``temperature > 0`` samples from
    ``softmax(logits / temperature)``, which is what the reference's
    ``argmax(log_softmax + T * Gumbel)`` does (``trax_reference.md`` §5.4: the paper's
    "temperature 0.5" is sampling, not greedy). ``temperature`` may be a traced scalar, so
    one compiled function serves every temperature.
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    sampled = jax.random.categorical(rng, scaled, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

"""Autoregressive generation: the Python loop over tokens around the jitted ``step``."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from terra.decoding.decode_step import IncrementalDecoder
from terra.decoding.sampling import sample_next_token


@dataclasses.dataclass
class Generation:
    """``tokens``: ``[batch, n]`` int32 (EOS included, pad after it); ``lengths``: ``[batch]``
    tokens up to and including EOS (or ``n`` when a row did not stop)."""

    tokens: np.ndarray
    lengths: np.ndarray


@jax.jit
def _select(logits, rng, done, temperature, eos_id, pad_id):
    rng, sample_rng = jax.random.split(rng)
    token = sample_next_token(logits, sample_rng, temperature)
    token = jnp.where(done, pad_id, token)
    return token, done | (token == eos_id), rng


def generate(
    decoder: IncrementalDecoder,
    params,
    encoder_input_tokens,
    *,
    encoder_mask=None,
    max_new_tokens: Optional[int] = None,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int = 1,
    pad_id: int = 0,
) -> Generation:
    """Decode up to ``max_new_tokens`` (default: the decoder's cache length) for a batch.

    Greedy when ``temperature == 0``; otherwise samples with ``jax.random.key(seed)``, so a
    seed reproduces its output. Each row stops at its first EOS (later positions are
    ``pad_id``); the loop ends when every row has stopped.
    """
    max_new_tokens = decoder.max_decode_length if max_new_tokens is None else max_new_tokens
    if not 0 < max_new_tokens <= decoder.max_decode_length:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} must be in [1, {decoder.max_decode_length}] "
            "(the decoder's max_decode_length)."
        )
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy).")
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    cache = decoder.prefill(params, inputs, encoder_mask)
    batch = inputs.shape[0]
    token = jnp.full((batch,), pad_id, jnp.int32)  # start token, as the reference's ShiftRight
    done = jnp.zeros((batch,), bool)
    rng = jax.random.key(seed)
    temperature = jnp.float32(temperature)
    out = []
    for _ in range(max_new_tokens):
        logits, cache = decoder.step(params, cache, token)
        token, done, rng = _select(logits, rng, done, temperature, eos_id, pad_id)
        out.append(token)
        if bool(done.all()):
            break
    tokens = np.asarray(jnp.stack(out, axis=1))
    is_eos = tokens == eos_id
    lengths = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, tokens.shape[1])
    return Generation(tokens=tokens, lengths=lengths.astype(np.int32))

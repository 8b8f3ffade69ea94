"""Autoregressive generation: prefill, then every token inside one jitted ``while_loop``
(``IncrementalDecoder.generate_tokens``)."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from terra.decoding.decode_step import IncrementalDecoder


@dataclasses.dataclass
class Generation:
    """``tokens``: ``[batch, n]`` int32 (EOS included, pad after it); ``lengths``: ``[batch]``
    tokens up to and including EOS (or ``n`` when a row did not stop)."""

    tokens: np.ndarray
    lengths: np.ndarray


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
    start = jnp.full((inputs.shape[0],), pad_id, jnp.int32)  # as the reference's ShiftRight
    tokens, steps, _ = decoder.generate_tokens(
        params, cache, start, jax.random.key(seed), max_new_tokens, temperature, eos_id, pad_id
    )
    tokens = np.asarray(tokens)[:, : int(steps)]
    is_eos = tokens == eos_id
    lengths = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, tokens.shape[1])
    return Generation(tokens=tokens, lengths=lengths.astype(np.int32))

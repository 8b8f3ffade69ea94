"""Autoregressive generation: prefill, then every token inside one jitted ``while_loop``
(``IncrementalDecoder.generate_tokens``)."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from terra.decoding import streaming
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
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    stream: Optional[streaming.Receiver] = None,
) -> Generation:
    """Decode up to ``max_new_tokens`` (default: the decoder's cache length) for a batch.

    Greedy when ``temperature == 0``; otherwise samples with ``jax.random.key(seed)``, so a
    seed reproduces its output, optionally from only the ``top_k`` most likely tokens and/or
    the ``top_p`` nucleus (``None``: no filter; see ``sampling.filter_logits``). The filters
    act on the sampling distribution, so greedy decoding ignores them. Each row stops at its
    first EOS (later positions are ``pad_id``); the loop ends when every row has stopped.
    ``stream``: called in the loop with each step's tokens as they are chosen, ``(step,
    tokens [batch]) -> stop`` (``terra.decoding.streaming``); True ends the loop after that step.
    """
    max_new_tokens = decoder.checked_new_tokens(max_new_tokens)
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (None keeps every token).")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (None keeps every token).")
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    cache = decoder.prefill(params, inputs, encoder_mask)
    start = jnp.full((inputs.shape[0],), pad_id, jnp.int32)  # as the reference's ShiftRight
    opened = None if stream is None else streaming.open_stream(stream, inputs.shape[0])
    try:
        tokens, steps, _ = decoder.generate_tokens(
            params,
            cache,
            start,
            jax.random.key(seed),
            max_new_tokens,
            temperature,
            eos_id,
            pad_id,
            top_k=0 if top_k is None else top_k,  # 0 and 1.0 are the traced loop's "off"
            top_p=1.0 if top_p is None else top_p,
            stream_id=None if opened is None else opened.operand,
        )
        tokens = jax.block_until_ready(tokens)
    finally:
        if opened is not None:
            opened.close()
    tokens = np.asarray(tokens)[:, : int(steps)]
    is_eos = tokens == eos_id
    lengths = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, tokens.shape[1])
    return Generation(tokens=tokens, lengths=lengths.astype(np.int32))

"""Autoregressive generation: prefill, then every token inside one jitted ``while_loop``
(``IncrementalDecoder.generate_tokens``)."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from terra.decoding import streaming
from terra.decoding.decode_step import Controls, IncrementalDecoder
from terra.decoding.sampling import MAX_NO_REPEAT_NGRAM


@dataclasses.dataclass
class Generation:
    """``tokens``: ``[batch, n]`` int32 (EOS included, pad after it); ``lengths``: ``[batch]``
    tokens up to and including EOS (or ``n`` when a row did not stop); ``scores``: ``[batch, n]``
    float32 log-probability of each token under the model (0 after EOS), where asked for."""

    tokens: np.ndarray
    lengths: np.ndarray
    scores: Optional[np.ndarray] = None


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
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    return_scores: bool = False,
) -> Generation:
    """Decode up to ``max_new_tokens`` (default: the decoder's cache length) for a batch.

    Greedy when ``temperature == 0``; otherwise samples with ``jax.random.key(seed)``, so a
    seed reproduces its output, optionally from only the ``top_k`` most likely tokens and/or
    the ``top_p`` nucleus (``None``: no filter; see ``sampling.filter_logits``). The filters
    act on the sampling distribution, so greedy decoding ignores them. Each row stops at its
    first EOS (later positions are ``pad_id``); the loop ends when every row has stopped.
    ``stream``: called in the loop with each step's tokens as they are chosen, ``(step,
    tokens [batch]) -> stop`` (``terra.decoding.streaming``); True ends the loop after that step.
    ``repetition_penalty`` (> 0; 1 is off) and ``no_repeat_ngram_size`` (0 is off, at most
    ``sampling.MAX_NO_REPEAT_NGRAM``) change each step's logits before the choice, greedy or
    sampled, as Hugging Face's processors of those names do; ``return_scores`` fills
    ``Generation.scores``. All of them run inside the same jitted loop.
    """
    max_new_tokens = decoder.checked_new_tokens(max_new_tokens)
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (None keeps every token).")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (None keeps every token).")
    controls = checked_controls(repetition_penalty, no_repeat_ngram_size, return_scores)
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    cache = decoder.prefill(params, inputs, encoder_mask)
    start = jnp.full((inputs.shape[0],), pad_id, jnp.int32)  # as the reference's ShiftRight
    opened = None if stream is None else streaming.open_stream(stream, inputs.shape[0])
    try:
        out = decoder.generate_tokens(
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
            controls=controls,
        )
        out = jax.block_until_ready(out)
    finally:
        if opened is not None:
            opened.close()
    return finished(out, eos_id, with_scores=controls is not None)


def checked_controls(repetition_penalty=1.0, no_repeat_ngram_size=0, return_scores=False) -> Optional[Controls]:
    """The loop's :class:`Controls` for these options (None when none is asked for: the loop
    without them), each checked."""
    if not isinstance(repetition_penalty, (int, float)) or not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty={repetition_penalty!r} must be a number > 0 (1 is off).")
    if not isinstance(no_repeat_ngram_size, int) or not 0 <= no_repeat_ngram_size <= MAX_NO_REPEAT_NGRAM:
        raise ValueError(
            f"no_repeat_ngram_size={no_repeat_ngram_size!r} must be a whole number from 0 (off) to "
            f"{MAX_NO_REPEAT_NGRAM}."
        )
    if repetition_penalty == 1 and no_repeat_ngram_size == 0 and not return_scores:
        return None
    return Controls(float(repetition_penalty), int(no_repeat_ngram_size))


def finished(out, eos_id: int, with_scores: bool) -> Generation:
    """A :class:`Generation` from what ``generate_tokens`` returned: the generated columns, each
    row's length up to its first EOS, and its tokens' log-probabilities where the loop had controls."""
    tokens, steps = np.asarray(out[0])[:, : int(out[1])], int(out[1])
    is_eos = tokens == eos_id
    lengths = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int32)
    scores = np.asarray(out[3])[:, :steps] if with_scores else None
    return Generation(tokens=tokens, lengths=lengths, scores=scores)

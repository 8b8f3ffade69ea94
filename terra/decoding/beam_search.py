"""Beam search over the decode contract (``IncrementalDecoder``'s prefill/step), in one jitted
``while_loop``.

Each input row is repeated ``num_beams`` times (batch-major: row ``b * num_beams + k`` is beam
``k`` of input ``b``) and prefilled once. Every step then scores all ``num_beams * vocab``
one-token extensions of the alive beams and keeps, per input row:

- alive hypotheses: the ``num_beams`` best extensions not ending in EOS, ranked by their
  summed log-probability (all alive beams have the same length, so the length penalty does not
  change their order). The decode cache is gathered along its batch axis to follow each new
  beam's parent.
- finished hypotheses: the ``num_beams`` best complete sequences seen so far, ranked by
  ``length_normalized_score``. As in Hugging Face's ``BeamSearchScorer``, an extension ending
  in EOS is finished only when it ranks among the step's ``num_beams`` best extensions; this
  is what makes ``num_beams=1`` exactly greedy decoding (an EOS that is not the argmax is not a
  finished hypothesis). At the ``max_new_tokens``-th step the best ``num_beams`` extensions
  are finished whatever their last token, so hypotheses that never emit EOS compete too.

A row is done when no alive beam can beat the worst of its finished hypotheses: an alive
beam's log-probability only falls as it grows, and the length penalty is at most
``length_penalty_divisor(max_new_tokens)``, so ``best alive log-prob / that divisor`` bounds
every score it can still reach (T5X's bound). The bound is exact, so stopping early never
changes the result. The loop ends when every row is done or after ``max_new_tokens`` steps.

The cache's batch axes are found from the contract alone: ``jax.eval_shape`` of ``prefill``
at two batch sizes shows which leaves, and which axis of each, depend on the batch; a leaf
that does not (e.g. a scalar position index shared by all rows) is carried as it is.
"""

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from terra.decoding.decode_step import Cache, IncrementalDecoder


@dataclasses.dataclass
class BeamSearchResult:
    """The best finished hypothesis per input row.

    ``tokens``: ``[batch, n]`` int32, EOS included and ``pad_id`` after it, ``n`` the longest
    row's length; ``lengths``: ``[batch]`` tokens up to and including EOS (``max_new_tokens``
    for a hypothesis without EOS); ``scores``: ``[batch]`` float32, the summed token
    log-probabilities divided by ``length_penalty_divisor(length, length_penalty)``.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    scores: np.ndarray


def length_penalty_divisor(length, length_penalty):
    """GNMT's length penalty ``((5 + length) / 6) ** length_penalty`` (Wu et al. 2016, as in
    T5X); ``1`` when ``length_penalty == 0``. ``length`` counts tokens including EOS."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** jnp.asarray(length_penalty, jnp.float32)


def length_normalized_score(log_prob, length, length_penalty):
    """A hypothesis' ranking score: its summed log-probability over ``length_penalty_divisor``.
    ``length_penalty > 0`` raises long hypotheses' scores (log-probabilities are negative), so
    larger values favour longer outputs."""
    return jnp.asarray(log_prob, jnp.float32) / length_penalty_divisor(length, length_penalty)


def cache_batch_axes(decoder: IncrementalDecoder, params, encoder_input_tokens, encoder_mask=None) -> Tuple:
    """Per cache leaf (in ``jax.tree.leaves`` order), the axis that is the batch, or ``None``
    for a leaf whose shape does not depend on it.

    Compares the abstract caches that ``decoder.prefill`` returns for ``batch`` and
    ``batch + 1`` rows; nothing is computed. Raises ``ValueError`` for a leaf in which the batch
    is not exactly one axis (e.g. folded into another), which a beam gather could not follow.
    """

    def abstract_cache(rows):
        tokens = jax.ShapeDtypeStruct((rows,) + encoder_input_tokens.shape[1:], jnp.int32)
        mask = (
            None if encoder_mask is None else jax.ShapeDtypeStruct((rows,) + encoder_mask.shape[1:], encoder_mask.dtype)
        )
        return jax.eval_shape(decoder.prefill, params, tokens, mask)

    batch = encoder_input_tokens.shape[0]
    leaves, more = jax.tree.leaves(abstract_cache(batch)), jax.tree.leaves(abstract_cache(batch + 1))
    axes = []
    for leaf, grown in zip(leaves, more):
        differ = [axis for axis, (a, b) in enumerate(zip(leaf.shape, grown.shape)) if a != b]
        if not differ:
            axes.append(None)
        elif len(differ) == 1 and (leaf.shape[differ[0]], grown.shape[differ[0]]) == (batch, batch + 1):
            axes.append(differ[0])
        else:
            raise ValueError(
                f"A decode cache leaf has shape {leaf.shape} for {batch} rows and {grown.shape} for "
                f"{batch + 1}: beam search needs the batch to be exactly one axis of it."
            )
    return tuple(axes)


def beam_search(
    decoder: IncrementalDecoder,
    params,
    encoder_input_tokens,
    *,
    encoder_mask=None,
    num_beams: int,
    max_new_tokens: Optional[int] = None,
    eos_id: int = 1,
    pad_id: int = 0,
    length_penalty: float = 0.0,
) -> BeamSearchResult:
    """The best hypothesis per row of ``encoder_input_tokens`` (``[batch, input_length]``) by
    beam search with ``num_beams`` beams (see the module docstring).

    Decodes up to ``max_new_tokens`` (default: the decoder's cache length) from the start
    token ``pad_id``. Hypotheses are ranked by ``length_normalized_score``; ``length_penalty
    == 0`` ranks by summed log-probability. ``num_beams=1`` is greedy decoding. Rows are
    independent: a row's result does not depend on the others in the batch.
    """
    max_new_tokens = decoder.checked_new_tokens(max_new_tokens)
    if num_beams < 1:
        raise ValueError(f"num_beams={num_beams} must be >= 1.")
    if length_penalty < 0:
        # A negative exponent would shrink long hypotheses' divisors, and the early stop's
        # bound (the divisor at max_new_tokens is the largest) would no longer hold.
        raise ValueError(f"length_penalty={length_penalty} must be >= 0 (0 ranks by log-probability).")
    inputs = jnp.repeat(jnp.asarray(encoder_input_tokens, jnp.int32), num_beams, axis=0)
    mask = None if encoder_mask is None else jnp.repeat(jnp.asarray(encoder_mask), num_beams, axis=0)
    tokens, lengths, scores = _search(
        decoder,
        num_beams,
        cache_batch_axes(decoder, params, inputs, mask),
        params,
        inputs,
        mask,
        jnp.int32(max_new_tokens),
        jnp.int32(eos_id),
        jnp.int32(pad_id),
        jnp.float32(length_penalty),
    )
    lengths = np.asarray(lengths)
    return BeamSearchResult(
        tokens=np.asarray(tokens)[:, : int(lengths.max())], lengths=lengths, scores=np.asarray(scores)
    )


def _gather_beams(cache: Cache, batch_axes: Tuple, rows: jax.Array) -> Cache:
    """Every batched cache leaf reindexed to ``rows`` (``[batch * num_beams]``) along its batch axis."""
    leaves, treedef = jax.tree.flatten(cache)
    leaves = [leaf if axis is None else jnp.take(leaf, rows, axis=axis) for leaf, axis in zip(leaves, batch_axes)]
    return jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _search(
    decoder: IncrementalDecoder,
    num_beams: int,
    batch_axes: Tuple,
    params,
    inputs: jax.Array,
    mask: Optional[jax.Array],
    max_new_tokens,
    eos_id,
    pad_id,
    length_penalty,
):
    """Prefill and the search loop, in one jitted function: the prefilled cache feeds the loop
    directly rather than crossing a jit boundary. ``inputs`` and ``mask`` hold ``batch *
    num_beams`` rows, each input repeated once per beam. The scalars are traced, so one compilation per decoder,
    beam count and shape serves every value of them.

    Returns ``(tokens [batch, max_decode_length] int32, lengths [batch] int32, scores [batch]
    float32)``: the best finished hypothesis per row.
    """
    k = num_beams
    batch = inputs.shape[0] // k
    cache = decoder.prefill_fn(params, inputs, mask)
    neg_inf = jnp.float32(-jnp.inf)
    # Parent beam p of row b sits at cache row b * k + p.
    row_offsets = jnp.arange(batch, dtype=jnp.int32)[:, None] * k

    def keep_going(carry):
        i, done = carry[0], carry[-1]
        return (i < max_new_tokens) & ~jnp.all(done)

    def one_token(carry):
        i, cache, last, alive_tokens, alive_logp, fin_tokens, fin_scores, fin_lengths, done = carry
        logits, cache = decoder.step_fn(params, cache, last)
        vocab = logits.shape[-1]
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(batch, k, vocab)
        extensions = (alive_logp[:, :, None] + log_probs).reshape(batch, k * vocab)

        # 2k extensions always hold k that do not end in EOS (each parent has one EOS token).
        n_candidates = min(2 * k, k * vocab)
        cand_logp, cand_index = jax.lax.top_k(extensions, n_candidates)  # [batch, n], best first
        cand_parent, cand_token = cand_index // vocab, cand_index % vocab
        cand_tokens = jnp.take_along_axis(alive_tokens, cand_parent[:, :, None], axis=1)
        cand_tokens = cand_tokens.at[:, :, i].set(cand_token)  # [batch, n, max_decode_length]
        is_eos = cand_token == eos_id

        # Finished: EOS extensions among the step's k best (all k best at the last step). The
        # old finished hypotheses come first, so on a tie the earlier one is kept.
        last_step = i + 1 >= max_new_tokens
        finishing = (jnp.arange(n_candidates) < k) & (is_eos | last_step)
        cand_scores = jnp.where(finishing, length_normalized_score(cand_logp, i + 1, length_penalty), neg_inf)
        pool_scores = jnp.concatenate([fin_scores, cand_scores], axis=1)
        new_fin_scores, best = jax.lax.top_k(pool_scores, k)
        pool_tokens = jnp.concatenate([fin_tokens, cand_tokens], axis=1)
        pool_lengths = jnp.concatenate([fin_lengths, jnp.full_like(cand_token, i + 1)], axis=1)
        # A done row's finished hypotheses are final (nothing can beat them; freezing them
        # just keeps the float rounding of later, irrelevant steps out).
        frozen = done[:, None]
        fin_scores = jnp.where(frozen, fin_scores, new_fin_scores)
        fin_tokens = jnp.where(
            frozen[:, :, None], fin_tokens, jnp.take_along_axis(pool_tokens, best[:, :, None], axis=1)
        )
        fin_lengths = jnp.where(frozen, fin_lengths, jnp.take_along_axis(pool_lengths, best, axis=1))

        # Alive: the k best extensions that do not end in EOS; the cache follows their parents.
        alive_logp, chosen = jax.lax.top_k(jnp.where(is_eos, neg_inf, cand_logp), k)
        alive_tokens = jnp.take_along_axis(cand_tokens, chosen[:, :, None], axis=1)
        parents = jnp.take_along_axis(cand_parent, chosen, axis=1)
        cache = _gather_beams(cache, batch_axes, (row_offsets + parents).reshape(-1))
        last = jnp.take_along_axis(cand_token, chosen, axis=1).reshape(-1)

        best_reachable = jnp.max(alive_logp, axis=1) / length_penalty_divisor(max_new_tokens, length_penalty)
        done = done | last_step | (best_reachable <= jnp.min(fin_scores, axis=1))
        return i + 1, cache, last, alive_tokens, alive_logp, fin_tokens, fin_scores, fin_lengths, done

    length = decoder.max_decode_length
    # All beams start identical, so only beam 0 is expanded at the first step: the others
    # start at -inf, which keeps their copies of the same extensions out of the top k.
    alive_logp = jnp.broadcast_to(jnp.where(jnp.arange(k) == 0, 0.0, neg_inf), (batch, k))
    start = (
        jnp.int32(0),
        cache,
        jnp.full((batch * k,), pad_id, jnp.int32),  # the start token, as in generate
        jnp.full((batch, k, length), pad_id, jnp.int32),
        alive_logp,
        jnp.full((batch, k, length), pad_id, jnp.int32),
        jnp.full((batch, k), neg_inf),
        jnp.zeros((batch, k), jnp.int32),
        jnp.zeros((batch,), bool),
    )
    carry = jax.lax.while_loop(keep_going, one_token, start)
    fin_tokens, fin_scores, fin_lengths = carry[5:8]
    # The pool is sorted best first.
    return fin_tokens[:, 0], fin_lengths[:, 0], fin_scores[:, 0]

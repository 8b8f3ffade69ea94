"""Choosing the next token from logits (pure functions): greedy, temperature sampling, and
top-k / top-p (nucleus) filtering.

Every knob (``temperature``, ``top_k``, ``top_p``) may be a traced scalar, so one compiled
decode loop serves all their values: nothing branches in Python on them, and top-k is a rank
comparison after a sort rather than ``lax.top_k`` (whose ``k`` must be static).
"""

import jax
import jax.numpy as jnp

from terra.layers.selection import block_argmax

# Cumulative probabilities are float32 sums, so a ``top_p`` that lands on the boundary between
# two nucleus sizes in exact arithmetic can miss it by a few ulps either way. A ``top_p`` within
# this much of a boundary counts as on it (the smaller nucleus), which makes the boundary case
# well defined; it is far below any ``top_p`` resolution anyone asks for.
TOP_P_TOLERANCE = 1e-6


def filter_logits(logits: jax.Array, top_k=0, top_p=1.0) -> jax.Array:
    """``[batch, vocab]`` logits -> the same logits with the excluded tokens set to ``-inf``.

    Args:
      logits: ``[batch, vocab]``; the result is float32.
      top_k: keep the ``top_k`` largest logits per row; ``0`` (or less) keeps all. A ``top_k``
        above ``vocab`` keeps all.
      top_p: keep the nucleus: the fewest most-probable tokens whose cumulative probability
        reaches ``top_p`` (the most probable token always); ``>= 1`` keeps all. With ``top_k``
        also set, the nucleus is taken in the renormalised top-k distribution (top-k first,
        as Hugging Face's warpers apply them). A ``top_p`` within ``TOP_P_TOLERANCE`` of a
        cumulative boundary counts as landing on it.

    Both may be traced scalars (int32 / float32).

    Ties: tokens are ranked by a stable descending sort, so among equal logits the lower token
    id ranks first. The kept set is always a prefix of that ranking: exactly ``min(top_k,
    vocab)`` tokens for top-k, even when the k-th largest logit is tied with the next one.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)

    order = jnp.argsort(logits, axis=-1, descending=True, stable=True)  # [batch, vocab] token ids
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    position = jnp.arange(vocab, dtype=jnp.int32)  # a token's rank, in sorted order

    in_top_k = position < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_logits, -jnp.inf), axis=-1)
    # The probability of the tokens ranked before each one: a token is needed for the nucleus
    # exactly when those have not yet reached top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = (position == 0) | (mass_before < top_p - TOP_P_TOLERANCE) | (top_p >= 1.0)
    # A prefix of the ranking survives both filters; its length is the number of tokens kept.
    n_kept = jnp.sum(in_top_k & in_nucleus, axis=-1, keepdims=True)  # [batch, 1]

    rank = jnp.argsort(order, axis=-1)  # the inverse permutation: each token id's rank
    return jnp.where(rank < n_kept, logits, -jnp.inf)


def sample_next_token(logits: jax.Array, rng: jax.Array, temperature, top_k=0, top_p=1.0) -> jax.Array:
    """``[batch, vocab]`` logits -> ``[batch]`` int32 tokens.

    ``temperature == 0`` is greedy (argmax of the unfiltered logits). ``temperature > 0``
    samples from ``softmax(filter_logits(logits / temperature, top_k, top_p))``; unfiltered,
    that is what the reference's ``argmax(log_softmax + T * Gumbel)`` does
    (``docs/design/reference_code.md`` §5.4: the paper's "temperature 0.5" is sampling, not greedy).
    ``temperature``, ``top_k`` and ``top_p`` may be traced scalars, so one compiled function
    serves every value; ``top_k=0`` and ``top_p=1`` turn the filters off.
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)

    def sample(logits):
        scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
        # Filtering sorts the vocabulary twice; a traced cond runs it only when a filter is on.
        filtering = (top_k > 0) | (top_p < 1.0)
        scaled = jax.lax.cond(filtering, lambda x: filter_logits(x, top_k, top_p), lambda x: x, scaled)
        # jax.random.categorical's own draw (the argmax of logits plus Gumbel noise), same samples.
        return block_argmax(scaled + jax.random.gumbel(rng, scaled.shape, scaled.dtype))

    # Greedy decoding draws no noise: the Gumbel draw and its argmax over the vocabulary are a
    # sizeable share of a fully sparse step (docs/decode_speed.md). Under vmap both branches run.
    token = jax.lax.cond(temperature > 0, sample, block_argmax, logits)
    return token.astype(jnp.int32)


# The longest n-gram ``no_repeat_ngram_size`` may ban: the loop compares this many shifted copies
# of the generated tokens whatever the (traced) size, so one compiled loop serves every size.
MAX_NO_REPEAT_NGRAM = 8


def penalize_repetitions(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
    """The CTRL repetition penalty as Hugging Face applies it: the logit of each token a row has
    generated already (``seen`` ``[batch, vocab]`` bool) divided by ``penalty`` where positive,
    multiplied by it where negative; ``penalty == 1`` changes nothing. ``penalty`` may be traced."""
    logits = logits.astype(jnp.float32)
    penalty = jnp.asarray(penalty, jnp.float32)
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalized, logits)


def banned_ngram_tokens(tokens: jax.Array, step, n, vocab: int) -> jax.Array:
    """``[batch, vocab]`` bool: the tokens that would repeat an ``n``-gram the row has generated.

    ``tokens`` ``[batch, L]`` are the row's tokens so far (positions ``< step`` generated); the
    candidate at ``step`` is banned when it and the ``n - 1`` tokens before it equal an earlier
    ``n``-gram (Hugging Face's ``no_repeat_ngram_size``). ``n`` may be traced, from 0 (nothing
    banned) to :data:`MAX_NO_REPEAT_NGRAM`; ``step`` is traced."""
    batch, length = tokens.shape
    n = jnp.asarray(n, jnp.int32)
    padded = jnp.concatenate([tokens, jnp.zeros((batch, MAX_NO_REPEAT_NGRAM), tokens.dtype)], axis=1)
    start = jnp.arange(length, dtype=jnp.int32)  # where an earlier n-gram starts
    # It must end before the candidate: its last token at start + n - 1 <= step - 1.
    match = (start <= step - n)[None, :] & (n > 0)
    for k in range(MAX_NO_REPEAT_NGRAM - 1):  # the n - 1 tokens before the candidate
        before = jax.lax.dynamic_index_in_dim(padded, jnp.maximum(step - n + 1 + k, 0), axis=1, keepdims=False)
        match &= (k >= n - 1) | (padded[:, k : k + length] == before[:, None])
    completing = jnp.take_along_axis(padded, jnp.broadcast_to(start + jnp.maximum(n - 1, 0), (batch, length)), axis=1)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    return jnp.zeros((batch, vocab), bool).at[rows, completing].max(match)

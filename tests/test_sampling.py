"""Top-k and top-p (nucleus) filtering and sampling, checked against their definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.decoding import filter_logits, sample_next_token, sampling

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB = 13


def _kept(filtered) -> np.ndarray:
    return np.isfinite(np.asarray(filtered))


def _nucleus_reference(logits: np.ndarray, top_p: float) -> np.ndarray:
    """The fewest most-probable tokens whose probability sums to at least ``top_p`` (float64)."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-logits, kind="stable")
    n = min(int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1, logits.size)
    kept = np.zeros(logits.size, bool)
    kept[order[:n]] = True
    return kept


def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = jax.random.normal(jax.random.key(0), (4, VOCAB))
    for k in (1, 3, 7, VOCAB, VOCAB + 5):
        filtered = filter_logits(logits, top_k=k)
        expected = np.zeros((4, VOCAB), bool)
        np.put_along_axis(expected, np.argsort(-np.asarray(logits), axis=-1)[:, :k], True, axis=-1)
        np.testing.assert_array_equal(_kept(filtered), expected)
        np.testing.assert_array_equal(np.asarray(filtered)[expected], np.asarray(logits)[expected])
    np.testing.assert_array_equal(filter_logits(logits, top_k=0), logits)  # 0 is off


def test_top_k_ties_keep_the_lower_token_ids():
    logits = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0]])
    np.testing.assert_array_equal(_kept(filter_logits(logits, top_k=2)), [[False, True, True, False, False]])


def test_top_p_keeps_the_minimal_nucleus():
    logits = np.asarray(jax.random.normal(jax.random.key(1), (3, VOCAB)) * 2.0, np.float64)
    for row in logits:
        probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        cumulative = np.cumsum(np.sort(probs)[::-1])
        # Two values landing exactly on a cumulative boundary: the nucleus is the tokens up to it.
        on_boundary = [cumulative[2], cumulative[5]]
        off_boundary = [0.3, 0.5, 0.9, 0.99]
        assert np.min(np.abs(cumulative[:, None] - np.array(off_boundary))) > 1e-4
        for top_p in on_boundary + off_boundary:
            kept = _kept(filter_logits(row[None], top_p=top_p))[0]
            np.testing.assert_array_equal(kept, _nucleus_reference(row, top_p), err_msg=f"top_p={top_p}")
        assert _kept(filter_logits(row[None], top_p=on_boundary[0]))[0].sum() == 3
        assert _kept(filter_logits(row[None], top_p=1e-6))[0].tolist() == (np.arange(VOCAB) == row.argmax()).tolist()


def test_top_p_one_keeps_every_token_even_those_without_probability_mass():
    logits = jnp.array([[0.0, -1e4, 2.0, -jnp.inf, 1.0]])
    np.testing.assert_array_equal(filter_logits(logits, top_p=1.0), logits)


def test_top_p_is_taken_in_the_renormalised_top_k_distribution():
    logits = np.log(np.array([[0.4, 0.3, 0.1, 0.1, 0.1]]))
    # Top-2 renormalised is (4/7, 3/7): 0.5 needs only the first token, 0.6 both.
    assert _kept(filter_logits(logits, top_k=2, top_p=0.5)).tolist() == [[True, False, False, False, False]]
    assert _kept(filter_logits(logits, top_k=2, top_p=0.6)).tolist() == [[True, True, False, False, False]]
    # Without top-k, 0.75 needs the third token.
    assert _kept(filter_logits(logits, top_p=0.75)).tolist() == [[True, True, True, False, False]]


def test_sampling_with_top_k_one_is_greedy():
    logits = jax.random.normal(jax.random.key(2), (5, VOCAB))
    for seed in range(3):
        for temperature in (1.0, 5.0):
            np.testing.assert_array_equal(
                sample_next_token(logits, jax.random.key(seed), temperature, top_k=1), jnp.argmax(logits, -1)
            )


def test_greedy_ignores_the_filters():
    logits = jax.random.normal(jax.random.key(3), (5, VOCAB))
    np.testing.assert_array_equal(
        sample_next_token(logits, jax.random.key(0), 0.0, top_k=2, top_p=0.1), jnp.argmax(logits, -1)
    )


@pytest.mark.parametrize("top_k, top_p, allowed", [(3, 1.0, {0, 1, 2}), (0, 0.6, {0, 1}), (3, 0.75, {0, 1})])
def test_samples_only_ever_hit_the_allowed_tokens(top_k, top_p, allowed):
    probs = np.array([0.35, 0.25, 0.15, 0.1, 0.08, 0.07])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None]
    draws = jax.jit(jax.vmap(lambda key: sample_next_token(logits, key, 1.0, top_k, top_p)[0]))(
        jax.random.split(jax.random.key(0), 20000)
    )
    freq = np.bincount(np.asarray(draws), minlength=probs.size) / draws.shape[0]
    assert set(np.flatnonzero(freq)) == allowed
    expected = np.where(np.isin(np.arange(probs.size), list(allowed)), probs, 0.0)
    np.testing.assert_allclose(freq, expected / expected.sum(), atol=0.015)


def test_one_compilation_serves_every_top_k_and_top_p():
    logits = jax.random.normal(jax.random.key(4), (2, VOCAB))
    traces = []

    @jax.jit
    def sample(logits, key, temperature, top_k, top_p):
        traces.append(1)
        return sample_next_token(logits, key, temperature, top_k, top_p), filter_logits(logits, top_k, top_p)

    kept = []
    for top_k, top_p in [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (4, 0.3)]:
        _, filtered = sample(logits, jax.random.key(0), jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p))
        kept.append(_kept(filtered).sum(axis=-1).tolist())
    assert len(traces) == 1 and sample._cache_size() == 1
    assert kept[:3] == [[VOCAB, VOCAB], [1, 1], [5, 5]]


def test_greedy_is_jnp_argmax_with_its_ties_infinities_and_nans():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 37)).astype(np.float32)
    logits[1, [3, 20]] = 9.0  # a tie: the lower id
    logits[2, :] = -np.inf  # every token excluded: token 0, as jnp.argmax
    logits[3, 11] = np.nan  # a NaN is the maximum, as in jnp.argmax
    logits[4, [5, 30]] = np.nan
    logits[5, 36] = np.inf
    logits = jnp.asarray(logits)
    greedy = jax.jit(lambda x: sample_next_token(x, jax.random.key(0), 0.0))(logits)
    assert greedy.dtype == jnp.int32
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, axis=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_unfiltered_sampling_draws_what_jax_random_categorical_draws(temperature):
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 50)), jnp.float32)
    sample = jax.jit(lambda x, key: sample_next_token(x, key, temperature))
    for seed in range(20):
        key = jax.random.key(seed)
        expected = jax.random.categorical(key, logits / temperature, axis=-1)
        np.testing.assert_array_equal(sample(logits, key), expected)


def _banned_by_hand(row, step, n, vocab):
    """The tokens that would repeat an n-gram of ``row[:step]``, by enumeration."""
    banned = np.zeros(vocab, bool)
    if n == 0 or step < n:
        return banned
    prefix = tuple(row[step - n + 1 : step])
    for start in range(step - n + 1):
        if tuple(row[start : start + n - 1]) == prefix:
            banned[row[start + n - 1]] = True
    return banned


def test_the_ngram_ban_is_every_token_that_would_repeat_an_ngram_of_the_row():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, size=(3, 12)).astype(np.int32)  # few ids: many repeated n-grams
    ban = jax.jit(sampling.banned_ngram_tokens, static_argnums=3)
    for n in range(sampling.MAX_NO_REPEAT_NGRAM + 1):
        for step in (0, 1, 5, 12):
            got = np.asarray(ban(jnp.asarray(tokens), step, n, 7))
            for b in range(3):
                np.testing.assert_array_equal(
                    got[b], _banned_by_hand(list(tokens[b]), step, n, 7), f"n={n} step={step}"
                )
    assert ban._cache_size() == 1  # one program for every n and step


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = jnp.array([[2.0, -2.0, 3.0, 0.0]])
    seen = jnp.array([[True, True, False, True]])
    np.testing.assert_allclose(np.asarray(sampling.penalize_repetitions(logits, seen, 2.0)), [[1.0, -4.0, 3.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(sampling.penalize_repetitions(logits, seen, 1.0)), np.asarray(logits))

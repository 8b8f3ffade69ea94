"""Beam search over the decode contract: one beam is greedy, enough beams is exhaustive search,
rows are independent, and the length penalty ranks as defined."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.decoding import IncrementalDecoder, beam_search, generate
from terra.decoding.beam_search import cache_batch_axes, length_normalized_score, length_penalty_divisor
from terra.models import EncoderDecoderTransformer, Terraformer, shift_right

from cheap_init_prng import init_key
from helpers import tiny_config

pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB = 8
EOS = 1
FAMILIES = {"encoder_decoder": EncoderDecoderTransformer, "terraformer": Terraformer}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request):
    """A tiny random-init network of each family, its parameters, and a decoder for 6 tokens."""
    cfg = tiny_config(
        vocab_size=VOCAB, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_len=16
    )
    module = FAMILIES[request.param](cfg)
    # Jitted, the key made inside too: run op by op, init and the key's seeding compile each of
    # their operations as its own program; from a key whose initializer compiles cheaply
    # (cheap_init_prng).
    encoder, decoder = jnp.ones((1, 4), jnp.int32), jnp.ones((1, 3), jnp.int32)
    params = jax.jit(lambda: module.init(init_key(0), encoder, decoder))()["params"]
    return module, params, IncrementalDecoder(module, 6)


def _inputs(seed=0, rows=3, length=6):
    """Encoder inputs with a different amount of padding (id 0) per row."""
    tokens = np.random.default_rng(seed).integers(2, VOCAB, size=(rows, length))
    for row, n in enumerate([length, 3, 1, 4][:rows]):
        tokens[row, n:] = 0
    return jnp.asarray(tokens, jnp.int32)


@functools.partial(jax.jit, static_argnums=0)  # one program for every row of a family
def _teacher_forced_log_probs(module, params, encoder_row, sequences):
    """``[n, length]`` per-token log-probabilities of ``sequences`` (``[n, length]``, padded with
    0 after their end) given one encoder row, from the teacher-forced forward pass. Positions
    after a sequence's end do not change earlier ones (the decoder is causal)."""
    tokens = jnp.asarray(sequences, jnp.int32)
    encoder = jnp.broadcast_to(encoder_row, (tokens.shape[0], encoder_row.shape[0]))
    logits = module.apply({"params": params}, encoder, shift_right(tokens))
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]


@pytest.mark.slow
def test_one_beam_is_greedy_decoding(tiny):
    _, params, decoder = tiny
    inputs = _inputs()
    # A random network seldom emits EOS greedily; taking a token it does emit as the EOS id
    # makes rows stop early, so beam search's EOS and early-stop paths are compared too.
    emitted = int(generate(decoder, params, inputs, temperature=0.0, eos_id=-1).tokens[0, 1])
    for eos_id, max_new_tokens in [(EOS, 6), (EOS, 3), (emitted, 6)]:
        greedy = generate(decoder, params, inputs, max_new_tokens=max_new_tokens, temperature=0.0, eos_id=eos_id)
        beam = beam_search(decoder, params, inputs, num_beams=1, max_new_tokens=max_new_tokens, eos_id=eos_id)
        np.testing.assert_array_equal(beam.tokens, greedy.tokens)
        np.testing.assert_array_equal(beam.lengths, greedy.lengths)
    assert beam.lengths.min() < 6


@pytest.mark.slow
def test_enough_beams_find_the_exhaustive_best_and_fewer_score_what_they_return(tiny):
    module, params, decoder = tiny
    inputs = _inputs(seed=1, rows=2)
    new_tokens = 3
    # Every sequence of at most 3 tokens: it ends at its first EOS or after the third token.
    sequences = [[EOS]] + [[a, EOS] for a in range(VOCAB) if a != EOS]
    sequences += [[a, b, c] for a, b, c in itertools.product(range(VOCAB), repeat=3) if EOS not in (a, b)]
    lengths = np.array([len(s) for s in sequences])
    padded = np.array([s + [0] * (new_tokens - len(s)) for s in sequences])
    real = np.arange(new_tokens)[None] < lengths[:, None]
    for row in range(inputs.shape[0]):
        per_token = np.asarray(_teacher_forced_log_probs(module, params, inputs[row], padded), np.float64)
        log_probs = np.where(real, per_token, 0.0).sum(axis=1)
        by_sequence = {tuple(s): lp for s, lp in zip(sequences, log_probs)}
        for length_penalty in (0.0, 1.0):
            scores = log_probs / ((5.0 + lengths) / 6.0) ** length_penalty
            best = np.argsort(-scores)
            assert scores[best[0]] - scores[best[1]] > 1e-4  # a unique optimum, so the check is sharp
            result = beam_search(
                decoder,
                params,
                inputs[row : row + 1],
                num_beams=VOCAB**2,
                max_new_tokens=new_tokens,
                eos_id=EOS,
                length_penalty=length_penalty,
            )
            assert result.tokens[0, : result.lengths[0]].tolist() == sequences[best[0]]
            np.testing.assert_allclose(result.scores[0], scores[best[0]], atol=1e-5)
        # 3 beams of 64: the program test_rows_are_independent_of_the_rest_of_the_batch runs alone.
        result = beam_search(decoder, params, inputs[row : row + 1], num_beams=3, max_new_tokens=new_tokens, eos_id=EOS)
        returned = tuple(result.tokens[0, : result.lengths[0]].tolist())
        assert result.scores[0] <= log_probs.max() + 1e-5
        np.testing.assert_allclose(result.scores[0], by_sequence[returned], atol=1e-5)


@pytest.mark.slow
def test_rows_are_independent_of_the_rest_of_the_batch(tiny):
    _, params, decoder = tiny
    inputs = _inputs(seed=2, rows=3)
    together = beam_search(decoder, params, inputs, num_beams=3, eos_id=EOS)
    assert together.tokens.shape[0] == 3
    for row in range(3):
        alone = beam_search(decoder, params, inputs[row : row + 1], num_beams=3, eos_id=EOS)
        n = int(alone.lengths[0])
        assert together.lengths[row] == n
        np.testing.assert_array_equal(together.tokens[row, :n], alone.tokens[0, :n])
        assert (together.tokens[row, n:] == 0).all()  # pad after the row's end
        np.testing.assert_allclose(together.scores[row], alone.scores[0], atol=1e-5)


def test_the_cache_batch_axes_come_from_the_prefill_shapes(tiny):
    _, params, decoder = tiny
    inputs = _inputs()
    axes = cache_batch_axes(decoder, params, inputs)
    shapes = jax.tree.leaves(jax.eval_shape(decoder.prefill, params, inputs))
    assert axes == tuple(None if shape.ndim == 0 else 0 for shape in shapes)  # position indices are scalars
    assert None in axes and 0 in axes


def test_length_penalty_divisor_and_ranking():
    np.testing.assert_allclose(length_penalty_divisor(7, 1.0), 2.0)
    np.testing.assert_allclose(length_penalty_divisor(7, 0.0), 1.0)
    short, long = (np.log(0.5), 1), (np.log(0.5 * 0.99), 2)
    # Without the penalty the higher log-probability wins; with it the longer hypothesis' score
    # is divided by (7 / 6) against 1 and overtakes.
    assert length_normalized_score(*short, 0.0) > length_normalized_score(*long, 0.0)
    assert length_normalized_score(*short, 1.0) < length_normalized_score(*long, 1.0)


class _ScriptedDecoder(IncrementalDecoder):
    """The next-token distribution depends only on the step: at step 0, EOS and token 2 have
    probability 0.5 each; later EOS has 0.99 and token 2 0.01. The cache is the step count, a
    scalar without a batch axis."""

    def __init__(self, max_decode_length=4):
        super().__init__(module=None, max_decode_length=max_decode_length)

    def prefill_fn(self, params, inputs, mask=None):
        return jnp.zeros((), jnp.int32)

    def step_fn(self, params, cache, token):
        first = jnp.log(jnp.array([1e-9, 0.5, 0.5, 1e-9]))
        later = jnp.log(jnp.array([1e-9, 0.99, 0.01, 1e-9]))
        logits = jnp.where(cache == 0, first, later)
        return jnp.broadcast_to(logits, (token.shape[0], 4)), cache + 1


def test_length_penalty_changes_which_hypothesis_beam_search_returns():
    decoder = _ScriptedDecoder()
    inputs = jnp.ones((2, 3), jnp.int32)
    plain = beam_search(decoder, None, inputs, num_beams=2, eos_id=EOS)
    assert plain.tokens.tolist() == [[EOS], [EOS]]
    np.testing.assert_allclose(plain.scores, np.log(0.5), rtol=1e-6)
    penalised = beam_search(decoder, None, inputs, num_beams=2, eos_id=EOS, length_penalty=1.0)
    assert penalised.tokens.tolist() == [[2, EOS], [2, EOS]] and penalised.lengths.tolist() == [2, 2]
    np.testing.assert_allclose(penalised.scores, np.log(0.5 * 0.99) / (7 / 6), rtol=1e-5)


def test_invalid_arguments_are_errors():
    decoder, inputs = _ScriptedDecoder(), jnp.ones((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="num_beams"):
        beam_search(decoder, None, inputs, num_beams=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        beam_search(decoder, None, inputs, num_beams=2, max_new_tokens=5)
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(decoder, None, inputs, num_beams=2, length_penalty=-0.5)


def test_a_cache_with_the_batch_folded_into_an_axis_is_rejected():
    class Folded(_ScriptedDecoder):
        def prefill_fn(self, params, inputs, mask=None):
            return jnp.zeros((inputs.shape[0] * 2,))

    with pytest.raises(ValueError, match="exactly one axis"):
        beam_search(Folded(), None, jnp.ones((1, 3), jnp.int32), num_beams=2)

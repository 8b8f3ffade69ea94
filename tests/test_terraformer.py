"""Terraformer: LengthConcat, decode = teacher forcing, reversible = plain gradients, memory."""

import functools

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.benchmarks import reversible_memory
from terra.decoding.decode_step import IncrementalDecoder
from terra.errors import ConfigError
from terra.gin_config import parsing
from terra.layers import LSHSelfAttention, SparseFeedForward, SparseLossLogits, SparseQKVAttention
from terra.layers.length_concat import concat_with_padding, strip_to_decoder
from terra.models import Terraformer, TerraformerModel
from terra.models.terraformer import shared_qk_from_dense_attention

from cheap_init_prng import init_key, initialised_once
from helpers import dropout_calls, tiny_config

VOCAB = 64

SPARSE = dict(
    # Chunks of 8 tokens, as the shipped configs' 512 (every call here has more than 8 tokens).
    feed_forward=functools.partial(SparseFeedForward, ff_sparsity=8, ff_chunk_size=8),
    decoder_attention=functools.partial(SparseQKVAttention, attention_sparsity=4),
    logits_layer=functools.partial(SparseLossLogits, loss_sparsity=4),
)
LSH = dict(
    encoder_attention=functools.partial(LSHSelfAttention, causal=False, n_chunks_after=1, chunk_len=16, n_hashes=2),
    decoder_attention=functools.partial(
        LSHSelfAttention, weights_format="sparse", attention_sparsity=4, chunk_len=32, n_hashes=2
    ),
)
VARIANTS = {
    "fully_sparse": SPARSE,
    "lsh": LSH,
    "dense_merged_encoder": dict(reversible_encoder=False, sru_units=8),
}


pytestmark = pytest.mark.usefixtures("fast_compile")


def _model(config=None, **kwargs):
    return TerraformerModel(Terraformer(config or tiny_config(vocab_size=VOCAB), **kwargs))


# One block each side: the encoder block inverts an attention half and a feed-forward half, the
# decoder block two attention halves and a feed-forward, each with its own cache; a second block
# repeats those halves at the cost of tracing and compiling them again.
ONE_BLOCK = dict(vocab_size=VOCAB, n_encoder_layers=1, n_decoder_layers=1)


@pytest.fixture(scope="module")
def built():
    """``variant -> (model, params)``, each built and initialised once for the module (the tests
    only read the parameters), from a key whose initializer compiles cheaply (cheap_init_prng)."""
    return initialised_once(lambda variant: _model(tiny_config(**ONE_BLOCK), **VARIANTS[variant]), seed=1)


@functools.cache
def _teacher_forced(model):
    """The jitted teacher-forced logits of one model, shared by the tests that read them: each
    passes a batch of ``_explicit`` (one tree, so one program per model)."""
    return jax.jit(model.logits)


def _explicit(model, batch):
    """``batch`` with the encoder mask and the decoder inputs the model would derive, given."""
    mask = batch["encoder_input_tokens"] != 0
    return dict(batch, encoder_mask=mask, decoder_input_tokens=model.decoder_input_tokens(batch))


def _batch(batch=2, inputs=7, targets=6, seed=0):
    rng = np.random.RandomState(seed)
    enc = rng.randint(2, VOCAB, (batch, inputs))
    for row, n in enumerate([5, 3, 7, 1][:batch]):
        enc[row, n:] = 0  # different padding per row
    return {
        "encoder_input_tokens": jnp.asarray(enc, jnp.int32),
        "decoder_target_tokens": jnp.asarray(rng.randint(2, VOCAB, (batch, targets)), jnp.int32),
    }


def test_length_concat_puts_real_encoder_tokens_then_decoder_then_zeros():
    enc = np.arange(1, 6, dtype=np.float32).reshape(1, 5, 1) * np.ones((2, 5, 1), np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 0, 1]], bool)  # the second row has holes
    dec = -np.arange(1, 4, dtype=np.float32).reshape(1, 3, 1) * np.ones((2, 3, 1), np.float32)

    @jax.jit  # one program, where op by op each of their operations compiles on its own
    def concat_then_strip(enc, mask, dec):
        out = concat_with_padding(enc, mask, dec)
        return out[..., 0], strip_to_decoder(out, mask, 3)[..., 0]

    out, stripped = concat_then_strip(enc, mask, dec)
    np.testing.assert_array_equal(out[0], [1, 2, 3, -1, -2, -3, 0, 0])
    np.testing.assert_array_equal(out[1], [1, 3, 5, -1, -2, -3, 0, 0])
    np.testing.assert_array_equal(stripped, [[-1, -2, -3]] * 2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.slow
def test_incremental_decode_matches_teacher_forced_forward(built, variant):
    model, params = built(variant)
    batch = _batch()
    teacher_forced = _teacher_forced(model)(params, _explicit(model, batch))
    decoder = IncrementalDecoder(model.module, 8)
    decoder_inputs = np.asarray(model.decoder_input_tokens(batch))

    def decode_all(rows):
        cache = decoder.prefill(params, batch["encoder_input_tokens"][rows])
        steps = []
        for t in range(decoder_inputs.shape[1]):
            logits, cache = decoder.step(params, cache, jnp.asarray(decoder_inputs[rows, t]))
            steps.append(logits)
        return jnp.stack(steps, axis=1)

    np.testing.assert_allclose(decode_all(slice(None)), teacher_forced, atol=2e-5)
    if variant == "fully_sparse":  # batch 1 compiles its own prefill/step
        np.testing.assert_allclose(decode_all(slice(1, 2)), teacher_forced[1:2], atol=2e-5)


@pytest.mark.slow
def test_outputs_ignore_encoder_padding_and_future_decoder_tokens(built):
    model, params = built("fully_sparse")
    batch = _explicit(model, _batch())
    mask = batch["encoder_mask"]
    forward = _teacher_forced(model)  # one compilation: the three batches have the same shapes
    logits = forward(params, batch)
    garbage = jnp.where(mask, batch["encoder_input_tokens"], 7)  # padded positions hold real ids
    np.testing.assert_allclose(forward(params, dict(batch, encoder_input_tokens=garbage)), logits, atol=1e-5)
    changed = dict(batch, decoder_input_tokens=batch["decoder_input_tokens"].at[:, 4].set(9))
    after = forward(params, changed)
    np.testing.assert_allclose(after[:, :4], logits[:, :4], atol=1e-5)
    assert float(jnp.max(jnp.abs(after[:, 4:] - logits[:, 4:]))) > 1e-3


# Every kind of discrete decision at once: sparse-FF indices and LSH buckets (several chunks and
# buckets, so the replayed hashing matters), on the sparse-QKV projections, with a sparse loss.
REPLAYING = dict(
    encoder_attention=functools.partial(LSHSelfAttention, causal=False, n_chunks_after=1, chunk_len=4, n_buckets=4),
    decoder_attention=functools.partial(
        LSHSelfAttention, weights_format="sparse", attention_sparsity=4, chunk_len=4, n_buckets=4, n_hashes=2
    ),
    feed_forward=SPARSE["feed_forward"],
    logits_layer=SPARSE["logits_layer"],
)


@pytest.mark.slow
def test_reversible_gradients_equal_plain_autodiff():
    layers = REPLAYING
    batch = _batch()
    key = jax.random.key(3)  # training mode: Gumbel noise, straight-through masks, hashes, same keys
    # One block each (ONE_BLOCK): each kind of half replays its own decisions.
    config = tiny_config(**ONE_BLOCK)
    reversible = _model(config, **layers)
    plain = _model(config, reversible=False, **layers)
    params = reversible.init_params(init_key(4))
    loss_r, grads_r = jax.jit(jax.value_and_grad(lambda p: reversible.loss_fn(p, batch, key)[0]))(params)
    loss_p, grads_p = jax.jit(jax.value_and_grad(lambda p: plain.loss_fn(p, batch, key)[0]))(params)
    np.testing.assert_allclose(loss_r, loss_p, rtol=1e-6)
    grads_r, grads_p = jax.device_get((grads_r, grads_p))  # NumPy: no program per leaf shape
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads_p))
    for (path, g_r), g_p in zip(jax.tree_util.tree_leaves_with_path(grads_r), jax.tree.leaves(grads_p)):
        # 1e-4 relative to the gradient's scale (a few leaves, e.g. key biases, are ~0 exactly).
        np.testing.assert_allclose(g_r, g_p, rtol=1e-4, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_reversible_training_memory_grows_far_less_than_plain_autodiff(capsys):
    rows = reversible_memory.measure((1, 2), d_model=32, d_ff=128, batch=2, inputs=48, targets=16, vocab_size=VOCAB)
    with capsys.disabled():
        print("\n" + reversible_memory.markdown(rows))
    by = {(r["depth"], r["reversible"]): r["temp_bytes"] for r in rows}
    reversible_growth = by[(2, True)] - by[(1, True)]
    plain_growth = by[(2, False)] - by[(1, False)]
    assert plain_growth > 0
    assert reversible_growth < plain_growth / 4


@pytest.mark.slow
def test_terraformer_has_no_attention_output_dropout_by_default(built):
    # Residual dropout 0.5, attention-probability dropout 0: an attention half-residual is
    # random in training only through an output dropout.
    config = tiny_config(dropout=0.5, **ONE_BLOCK)
    _, params = built("fully_sparse")  # dropout adds no parameters: the same tree

    @functools.partial(jax.jit, static_argnums=0)  # one program per option, not one per operation
    def train_and_eval_outputs(attention_output_dropout, params):
        """``[(training output, eval output)]`` of the encoder's and the decoder's attention halves."""
        x = jax.random.normal(jax.random.key(0), (2, 5, config.d_model))
        mask = jnp.ones((2, 5), bool)
        module = Terraformer(config, **SPARSE, attention_output_dropout=attention_output_dropout)
        bound = module.bind({"params": params}, rngs={"dropout": jax.random.key(2)})
        halves = [(bound.encoder_stack.layers[0], (x, mask)), (bound.decoder_stack.layers[0], (x,))]
        return [(half(*args, deterministic=False)[0], half(*args, deterministic=True)[0]) for half, args in halves]

    # NumPy from here: no program per check.
    for train, eval_out in jax.device_get(train_and_eval_outputs(False, params)):  # the reference: no output dropout
        np.testing.assert_array_equal(train, eval_out)
    for train, eval_out in jax.device_get(train_and_eval_outputs(True, params)):  # the option: dropout 0.5
        assert 0.3 < float(np.mean(train == 0)) < 0.7
        np.testing.assert_allclose(np.where(train == 0, 0.0, eval_out * 2), train, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("share", [None, True, False])
@pytest.mark.parametrize("attention_output_dropout", [False, True])
@pytest.mark.slow
def test_terraformer_dropouts_follow_the_reference_configurable_terraformer(share, attention_output_dropout):
    # One block each side (ONE_BLOCK): a second one repeats the same dropouts, at the cost of tracing them again.
    config = tiny_config(dropout=0.1, attention_dropout=0.3, share_dropout_over_length=share, **ONE_BLOCK)
    model = TerraformerModel(Terraformer(config, attention_output_dropout=attention_output_dropout, **SPARSE))
    batch = _batch()
    calls = dropout_calls(lambda p: model.logits(p, batch, dropout_rng=jax.random.key(1)), model.abstract_params())
    shared = (-2,) if share in (None, True) else ()  # None: the family's reference choice, shared
    expected = {("Terraformer", 0.1, shared), ("SparseFeedForward", 0.1, shared)}  # embedding, FF output
    if attention_output_dropout:
        expected.add(("HalfResidual", 0.1, shared))
    assert {c for c in calls if c[1] == 0.1} == expected
    assert all(dims == () for _, rate, dims in calls if rate == 0.3)  # attention probabilities


@pytest.mark.parametrize("gin_file", ["models/terraformer_800m.gin", "models/terraformer_lsh_800m.gin"])
def test_terraformer_configs_chunk_the_feed_forward_and_share_dropout_as_the_reference(gin_file):
    # terraformer_c4_medium.gin: ff_chunk_size=512; ConfigurableTerraformer: dropout_shared_axes=[-2].
    # The model alone: the data layer (TensorFlow's import, most of this test's time) binds none of it.
    model = parsing.parse_model([gin_file, "sizes/tiny.gin"])
    assert gin.query_parameter("SparseFeedForward.ff_chunk_size") == 512
    assert model.config.share_dropout_over_length is True
    assert model.module.attention_output_dropout is False


def test_bad_block_counts_fail_when_the_model_is_configured():
    with pytest.raises(ConfigError, match="n_decoder_attention_layers"):
        _model(n_decoder_attention_layers=0)


@pytest.mark.slow
def test_dense_attention_checkpoint_maps_onto_lsh_encoder_attention():
    dense = _model()
    lsh = _model(encoder_attention=LSH["encoder_attention"])
    # The mapping only reshapes and averages arrays: random values of the checkpoint's shapes
    # (no initializer to compile).
    rng = np.random.default_rng(5)
    dense_params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), dense.abstract_params())
    mapped = shared_qk_from_dense_attention(dense_params)
    expected = jax.tree.map(lambda x: x.shape, lsh.abstract_params())
    assert jax.tree.map(lambda x: x.shape, mapped) == expected
    qkv = dense_params["encoder_stack"]["layer_0"]["layer"]["qkv"]["kernel"]
    qv = mapped["encoder_stack"]["layer_0"]["layer"]["qv"]["kernel"]
    np.testing.assert_allclose(qv[:, 0], (qkv[:, 0] + qkv[:, 1]) / 2)
    np.testing.assert_allclose(qv[:, 1], qkv[:, 2])

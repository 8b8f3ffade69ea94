"""Weight-only quantization for decoding (terra/quantization): the int8 and bfloat16 stores, their
error bounds, and the products that read them equal float32 products of the dequantized weights."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from terra import backends
from terra.backends import native_kernels, xla
from terra.errors import ConfigError
from terra.gin_config import parsing
from terra.layers.dense import Dense
from terra.layers.embedding import TokenEmbedding
from terra.quantization import (
    QuantizedTensor,
    dequantize,
    dequantize_params,
    quantize_compiled,
    quantize_params,
)

from cheap_init_prng import init_key
from helpers import quantize_params_for_setup

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile); each side of
# every comparison below is compiled alike.
pytestmark = pytest.mark.usefixtures("fast_compile")


# Compiled whole: run op by op, a model compiles each of its hundreds of operations alone (and a
# store and its widening some ten programs each).
_dequantize_params = jax.jit(dequantize_params)
_dequantize = jax.jit(dequantize)


def _weights(shape, seed=0):
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w[..., 0] *= 40  # an outlier per row: the scale must follow each row's own range
    return jnp.asarray(w)


def test_int8_dequantization_error_is_at_most_half_a_step_per_row():
    w = _weights((5, 7, 33))
    q = quantize_compiled(w, "int8")
    assert q.values.dtype == jnp.int8 and q.scale.shape == (5, 7)
    step = np.asarray(q.scale)[..., None]
    error = np.abs(np.asarray(_dequantize(q)) - np.asarray(w))
    assert np.all(error <= step / 2 * (1 + 1e-6))
    np.testing.assert_allclose(np.asarray(q.scale), np.max(np.abs(np.asarray(w)), axis=-1) / 127, rtol=1e-6)


def test_bfloat16_store_is_bfloat16_rounding_kept_as_its_bits():
    w = _weights((9, 17))
    q = quantize_compiled(w, "bfloat16")
    assert q.values.dtype == jnp.uint16
    expected = np.asarray(jax.jit(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32))(w))
    np.testing.assert_array_equal(np.asarray(_dequantize(q)), expected)
    assert np.all(np.abs(expected - np.asarray(w)) <= np.abs(np.asarray(w)) * 2.0**-8)


def test_an_all_zero_row_quantizes_to_zero():
    q = quantize_compiled(np.zeros((2, 8), np.float32), "int8")
    np.testing.assert_array_equal(np.asarray(_dequantize(q)), 0.0)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("block_elements", [1 << 20, 5 * 24])  # one block; 5-row blocks and a tail
def test_blocked_product_equals_the_float32_product_of_the_dequantized_weights(kind, block_elements, monkeypatch):
    monkeypatch.setattr(xla, "BLOCK_ELEMENTS", block_elements)
    q = quantize_compiled(_weights((37, 24)), kind)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2, 24)).astype(np.float32))
    with native_kernels.disabled():  # the XLA path (the native kernel has its own tests)
        # Its own trace: the block size is read at tracing (jax.jit of the function itself would
        # reuse another case's trace).
        got = jax.jit(functools.partial(backends.output_major_product))(x, q)
    want = jax.jit(lambda x, q: x @ dequantize(q).T)(x, q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("block_elements", [1 << 20, 4 * 19])  # one block; 4-row blocks and a tail
def test_input_major_product_folds_the_row_scales_into_x(kind, block_elements, monkeypatch):
    monkeypatch.setattr(xla, "BLOCK_ELEMENTS", block_elements)
    q = quantize_compiled(_weights((30, 19)), kind)  # [in, out]: one scale per input row
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2, 30)).astype(np.float32))
    # Its own trace: the block size is read at tracing (jax.jit of the function itself would reuse
    # another case's trace).
    got = jax.jit(functools.partial(backends.input_major_product))(x, q)
    want = jax.jit(lambda x, q: x @ dequantize(q))(x, q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


def test_a_transposed_weight_has_one_scale_per_output_and_dequantizes_to_its_own_layout():
    w = np.asarray(_weights((7, 5, 33))).transpose(2, 0, 1)  # input-major [in=33, 7, 5]; an outlier per output
    q = quantize_compiled(w, "int8", transposed=True)
    assert q.shape == (33, 7, 5) and q.scale.shape == (7, 5)  # Flax checks the parameter's shape
    np.testing.assert_array_equal(
        np.asarray(jax.jit(QuantizedTensor.output_major)(q).values),
        np.asarray(quantize_compiled(w.transpose(1, 2, 0), "int8").values),
    )
    step = np.asarray(q.scale)[None]
    assert np.all(np.abs(np.asarray(_dequantize(q)) - w) <= step / 2 * (1 + 1e-6))
    with pytest.raises(ValueError, match="transposed"):
        q.reshape(33, 35)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("batch", [(1, 1), (19,)])  # one row; 3 chunks of the output-major kernel's rows
def test_input_major_product_of_a_transposed_kernel_is_its_output_major_product(kind, native, batch):
    """The decode tree's controller: ``[in, blocks, N]`` stored ``[blocks, N, in]``, read by the
    output-major kernel or XLA's blocked product, equal to the dequantized product."""
    q = quantize_compiled(_weights((11, 6, 4)), kind, transposed=True)
    x = jnp.asarray(np.random.default_rng(1).normal(size=batch + (11,)).astype(np.float32))
    with contextlib.nullcontext() if native else native_kernels.disabled():
        product = functools.partial(backends.input_major_product)  # its own trace: the path is chosen at tracing
        jaxpr = str(jax.make_jaxpr(product)(x, q))
        got = jax.jit(product)(x, q)
    assert ("terra_output_major" in jaxpr) == (native and native_kernels.available())
    assert "terra_input_major" not in jaxpr
    want = jax.jit(lambda x, q: x @ dequantize(q).reshape(11, 24))(x, q)
    # float32 rounding of sums taken in another order (the kernel scales each row's sum, XLA
    # multiplies by the dequantized weights): up to 3e-5 at outputs of about 6 under AVX2.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("features, n_contract, in_shape", [(19, 1, (24,)), ((3, 5), 1, (16,)), (11, 2, (4, 6))])
@pytest.mark.slow
def test_dense_reading_a_quantized_kernel_equals_dense_on_the_dequantized_kernel(
    kind, features, n_contract, in_shape, monkeypatch
):
    monkeypatch.setattr(xla, "BLOCK_ELEMENTS", 4 * 24)
    n_out = 1 if isinstance(features, int) else len(features)
    layer = Dense(features, kernel_axes=("a",) * n_out + ("b",) * n_contract, n_contract=n_contract)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3) + in_shape).astype(np.float32))
    # Each step jitted: op by op, every operation compiles as a program of its own.
    params = jax.jit(layer.init)(init_key(0), x)["params"]  # a key whose initializer compiles cheaply
    params = jax.tree.map(
        lambda p: p.value if hasattr(p, "value") else p, params, is_leaf=lambda p: hasattr(p, "value")
    )
    narrow = quantize_params_for_setup(params, kind)
    assert isinstance(narrow["kernel"], QuantizedTensor) and not isinstance(narrow["bias"], QuantizedTensor)
    want = jax.jit(layer.apply)({"params": _dequantize_params(narrow)}, x)

    def in_a_loop(p, x):  # as the decode loop reads it: under jit, inside a while_loop
        return lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, layer.apply({"params": p}, x)), (0, want * 0))[1]

    got = jax.jit(in_a_loop)(narrow, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_gathered_rows_are_widened_with_their_own_scales(kind):
    q = quantize_compiled(_weights((12, 4, 10)), kind)
    rows = np.array([0, 11, 5, 5])
    np.testing.assert_allclose(
        np.asarray(jax.jit(backends.take_rows)(q, rows)), np.asarray(_dequantize(q))[rows], rtol=1e-6
    )


def test_quantize_params_converts_matrices_keeps_vectors_and_rejects_unknown_dtypes():
    params = {
        "layer": {"kernel": _weights((4, 6)), "bias": jnp.ones(4), "scale": jnp.ones(6)},
        "table": _weights((8, 6)),
    }
    assert quantize_params(params, "float32") is params
    narrow = quantize_params(params, "int8")
    assert isinstance(narrow["table"], QuantizedTensor) and narrow["layer"]["bias"] is params["layer"]["bias"]
    assert sum(x.nbytes for x in jax.tree.leaves(narrow)) < sum(x.nbytes for x in jax.tree.leaves(params)) / 2
    with pytest.raises(ConfigError, match="int4.*float32, bfloat16, int8"):
        quantize_params(params, "int4")


def test_the_controller_and_the_sparse_loss_kernel_are_stored_output_major():
    params = {
        "ff": {"controller_up": _weights((4, 3, 2))},
        "logits": {"multiplicative": {"kernel": _weights((6, 5))}},
        "attention": {"multiplicative": {"kernel": _weights((6, 5))}},  # a sparse QKV kernel: 16+ rows
    }
    narrow = jax.jit(quantize_params, static_argnums=1)(params, "int8")
    assert narrow["ff"]["controller_up"].transposed and narrow["logits"]["multiplicative"]["kernel"].transposed
    assert not narrow["attention"]["multiplicative"]["kernel"].transposed
    for got, want in zip(jax.tree.leaves(_dequantize_params(narrow)), jax.tree.leaves(params)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=float(np.max(np.abs(want))) / 127)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_token_embedding_reading_a_quantized_table_equals_the_dequantized_table(kind):
    layer = TokenEmbedding(vocab_size=13, d_model=10)
    tokens = jnp.array([[0, 12, 3], [3, 3, 7]])
    params = jax.tree.map(  # jitted: op by op, every operation compiles alone
        lambda p: p.value if hasattr(p, "value") else p,
        jax.jit(layer.init)(jax.random.key(0), tokens)["params"],
        is_leaf=lambda p: hasattr(p, "value"),
    )
    narrow = quantize_params_for_setup(params, kind)
    assert isinstance(narrow["embedding"], QuantizedTensor)
    apply = jax.jit(layer.apply)  # one program per parameter tree
    got = apply({"params": narrow}, tokens)
    want = apply({"params": _dequantize_params(narrow)}, tokens)
    assert got.shape == (2, 3, 10)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.slow
def test_sparse_feedforward_reading_quantized_weights_equals_the_dequantized_weights(kind):
    from terra.layers import SparseFeedForward

    layer = SparseFeedForward(d_model=12, d_ff=32, ff_sparsity=4, d_lowrank=4)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 1, 12)).astype(np.float32))
    params = jax.tree.map(  # jitted (op by op, every operation compiles alone), from a cheap key
        lambda p: p.value if hasattr(p, "value") else p,
        jax.jit(layer.init)(init_key(0), x)["params"],
        is_leaf=lambda p: hasattr(p, "value"),
    )
    narrow = quantize_params_for_setup(params, kind)
    assert isinstance(narrow["wi"], QuantizedTensor) and isinstance(narrow["wo"], QuantizedTensor)
    assert narrow["controller_up"].transposed and narrow["controller_up"].shape == params["controller_up"].shape
    wide = _dequantize_params(narrow)
    for decode in (True, False):  # the gathered rows (decode) and the masked product (eval)
        apply = jax.jit(functools.partial(layer.apply, decode=decode))  # one program per parameter tree
        got = apply({"params": narrow}, x)
        want = apply({"params": wide}, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# Every layer kind a decode step reads: dense attention and logits, sparse FF rows and controller,
# the multiplicative layer and Q/K/V convolutions, the sparse loss, MoE experts, the Terraformer's
# SRU branch and LSH attention, the encoder and encoder-decoder attention, the positional table.
MODEL_FAMILIES = [
    "models/tiny.gin",
    "models/tiny_fully_sparse.gin",
    "models/tiny_moe_ff.gin",
    "models/tiny_terraformer.gin",
    "models/tiny_terraformer_lsh.gin",
]


def _tiny_family(gin_file):
    # One layer of each stack reads every layer kind the stack has (the count of narrow leaves is
    # checked below); each further layer would only repeat them at the cost of compiling them.
    sizes = ["vocab_size = 96", "max_len = 32", "n_encoder_layers = 1", "n_decoder_layers = 1"]
    # Unlocked: the model alone, without registering the data layer (which imports TensorFlow).
    parsing.parse_gin([gin_file], [f"TransformerConfig.{size}" for size in sizes], finalize=False)
    return parsing.build_model()


BATCH_ROWS = 10  # more than a pass of the native kernels (8 rows): a pass of 8 and one of 2


def _batch():
    """``BATCH_ROWS`` rows, two of them padded: every decode below steps a batch of this shape
    (or one row of it), so the decoders of a family and store compile once for all the tests."""
    rng = np.random.default_rng(1)
    inputs = rng.integers(2, 96, size=(BATCH_ROWS, 9)).astype(np.int32)
    inputs[1, -3:] = inputs[3, -4:] = 0
    targets = rng.integers(2, 96, size=(BATCH_ROWS, 6)).astype(np.int32)
    return {"encoder_input_tokens": jnp.asarray(inputs), "decoder_target_tokens": jnp.asarray(targets)}


def _decode_logits(model, params, batch):
    decoder = model.decoder(8)
    cache = decoder.prefill(params, batch["encoder_input_tokens"])
    steps = []
    for token in np.asarray(model.decoder_input_tokens(batch)).T:
        logits, cache = decoder.step(params, cache, jnp.asarray(token))
        steps.append(logits)
    return np.stack(steps, axis=1)  # numpy: jnp.stack would compile a program per batch shape


@pytest.fixture(scope="module")
def families():
    """``{gin file: (model, batch, float32 parameters, jitted teacher-forced logits)}``, built once
    for both stores and both decode tests: the model is frozen when built (gin's later configs do
    not reach it), and the float32 trees the two stores dequantize to have the same shapes as the
    float32 parameters, so the reference's compiled decoder (cached by the model) and logits serve
    both stores, and a store's decoder of ``BATCH_ROWS`` rows serves both tests."""
    return {}


def _family(families, gin_file):
    if gin_file not in families:
        model, batch = _tiny_family(gin_file), _batch()
        # A key whose initializer compiles cheaply (cheap_init_prng): any parameters prove it.
        families[gin_file] = model, batch, model.init_params(init_key(0)), jax.jit(model.logits)
    return families[gin_file]


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("gin_file", MODEL_FAMILIES)
@pytest.mark.slow
def test_quantized_decode_equals_float32_decode_of_the_dequantized_weights(gin_file, kind, families):
    model, batch, params, logits = _family(families, gin_file)
    narrow = quantize_params_for_setup(params, kind)
    wide = _dequantize_params(narrow)
    quantized_leaves = [leaf for leaf in jax.tree.leaves(narrow, is_leaf=_is_quantized) if _is_quantized(leaf)]
    assert len(quantized_leaves) >= 8
    reference = _decode_logits(model, wide, batch)
    np.testing.assert_allclose(_decode_logits(model, narrow, batch), reference, atol=1e-5, rtol=1e-5)
    # The teacher-forced pass (evaluation) reads the same narrow tree.
    np.testing.assert_allclose(logits(narrow, batch), logits(wide, batch), atol=1e-5, rtol=1e-5)


def _is_quantized(leaf):
    return isinstance(leaf, QuantizedTensor)


@pytest.mark.slow  # builds the tiny family, which the batched decode test below shares
def test_a_batched_float32_decode_step_reads_its_dense_weights_through_the_kernel(families):
    # Float32 weights: a batch's step takes the output-major kernel (which the test below then
    # proves row by row against XLA's product of one row), one row's step XLA's product.
    model, batch, params, _ = _family(families, "models/tiny.gin")
    decoder = model.decoder(8)

    def step_program(rows):
        cache = jax.eval_shape(decoder.prefill, params, batch["encoder_input_tokens"][:rows])
        return str(jax.make_jaxpr(decoder.step_fn)(params, cache, jnp.zeros((rows,), jnp.int32)))

    assert "terra_output_major_f32" in step_program(BATCH_ROWS)
    assert "terra_output_major_f32" not in step_program(1)


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("gin_file", MODEL_FAMILIES)
@pytest.mark.slow
def test_batched_decode_equals_each_row_decoded_alone(gin_file, kind, families):
    # A batch takes the same kernels as one row (native_kernels.MAX_ROWS rows of them; float32
    # weights the output-major kernel where one row takes XLA's product): every row of a batch of 10
    # steps to the logits its sequence gets alone, so greedy decoding picks the same tokens whatever
    # else is in the batch.
    model, batch, params, _ = _family(families, gin_file)
    params = params if kind == "float32" else quantize_params_for_setup(params, kind)
    together = _decode_logits(model, params, batch)
    for row in range(BATCH_ROWS):
        alone = _decode_logits(model, params, {name: np.asarray(rows)[row : row + 1] for name, rows in batch.items()})
        np.testing.assert_allclose(together[row], alone[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.argmax(together[row], -1), np.argmax(alone[0], -1))

"""A decode step's attention over a whole KV cache (``backends.cache_attention``): the native call
(``cache_attention.h``: the visible rows read where they lie, float32, int8 or bfloat16) equals the
XLA form on the same caches in every instruction set this CPU has, with the query's own key joined
or not, hidden and masked positions, and head sizes off the vector width; the dense layers' decode
steps and a sparse QKV step over a narrow cache run it; mismatched operands are one error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import MASK_VALUE, cache_attention, cached_attention, decode_state, native_kernels, xla
from terra.backends.decode_state import KVCache
from terra.decoding.decode_step import IncrementalDecoder
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer
from terra.quantization import quantize_params

from helpers import tiny_config

pytestmark = pytest.mark.usefixtures("fast_compile", "native_kernels_on")

CACHE_DTYPES = ("float32", "int8", "bfloat16")


def _cache(cache_dtype, batch, heads, length, dh, seed):
    """Keys and values ``[batch, heads, length, dh]`` as ``cache_dtype`` stores them, with their
    scales (``None`` but for int8); the rows of different sizes, as trained keys have."""
    rng = np.random.default_rng(seed)
    spread = np.exp(rng.normal(size=(batch, heads, length, 1)))
    keys, values = (jnp.asarray(rng.normal(size=(batch, heads, length, dh)) * spread, jnp.float32) for _ in range(2))
    (keys, key_scale), (values, value_scale) = _narrow_rows((keys, values), cache_dtype)
    return keys, values, key_scale, value_scale


@functools.partial(jax.jit, static_argnums=1)
def _narrow_rows(tensors, cache_dtype):
    """``decode_state.narrow_rows`` of each tensor in one program (op by op, each of its operations
    compiles on its own)."""
    return [decode_state.narrow_rows(t, cache_dtype) for t in tensors]


def _query(batch, heads, dh, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, heads, 1, dh)), jnp.float32) for _ in range(3))
    return q * dh**-0.5, k, v


def _bias(batch, length, visible, seed):
    """``[batch, length]``: every position from ``visible`` on hidden, and some before it masked."""
    rng = np.random.default_rng(seed)
    hidden = (np.arange(length)[None, :] >= visible) | (rng.random((batch, length)) < 0.2)
    return jnp.asarray(np.where(hidden, MASK_VALUE, 0.0), jnp.float32)


@functools.partial(jax.jit, static_argnames="native")
def _attend(q, keys, values, bias, key_scale, value_scale, visible, own, native):
    if native:
        return cache_attention(q, keys, values, bias, key_scale, value_scale, visible, own)
    return xla.cache_attention(q, keys, values, bias, key_scale, value_scale, visible, own)


# Every instruction set at the 800M models' head size; the other head sizes in the best one.
CASES = [(isa, 64, 53) for isa in native_kernels.ISAS] + [
    (native_kernels.ISAS[-1], dh, length) for dh, length in ((16, 16), (24, 40), (96, 7))
]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("isa,dh,length", CASES)
def test_native_cache_attention_equals_its_xla_form(isa, dh, length, cache_dtype):
    """Blocks of a vector width of rows and their tails, head sizes of whole vectors (64, 16, 96)
    and with a tail of lanes (24), a visible prefix with masked positions in it, with and without
    the query's own key, against XLA's softmax over the same stored cache."""
    native_kernels.use_isa(isa)
    batch, heads = 2, 3
    keys, values, key_scale, value_scale = _cache(cache_dtype, batch, heads, length, dh, seed=dh + length)
    q, k, v = _query(batch, heads, dh, seed=length)
    visible = jnp.asarray(length - 3, jnp.int32)
    bias = _bias(batch, length, length - 3, seed=dh)
    for own in ((k, v), None):
        got = _attend(q, keys, values, bias, key_scale, value_scale, visible, own, native=True)
        want = _attend(q, keys, values, bias, key_scale, value_scale, visible, own, native=False)
        assert got.shape == (batch, heads, 1, dh) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)


def test_native_cache_attention_is_in_the_lowered_program_and_reads_no_hidden_row():
    """The CPU program calls the kernel; positions from ``visible`` on are not read: NaN there
    changes nothing, where the XLA form (which reads them and masks) turns NaN."""
    keys, values, _, _ = _cache("float32", 1, 2, 20, 16, seed=1)
    q, k, v = _query(1, 2, 16, seed=2)
    bias = _bias(1, 20, 12, seed=3)
    lowered = _attend.lower(q, keys, values, bias, None, None, jnp.int32(12), (k, v), native=True).as_text()
    assert native_kernels.TARGETS["cache_attention", "float32"] in lowered
    poisoned = [t.at[:, :, 12:].set(jnp.nan) for t in (keys, values)]
    clean = _attend(q, keys, values, bias, None, None, jnp.int32(12), (k, v), native=True)
    got = _attend(q, *poisoned, bias, None, None, jnp.int32(12), (k, v), native=True)
    np.testing.assert_array_equal(got, clean)
    assert np.isnan(np.asarray(_attend(q, *poisoned, bias, None, None, jnp.int32(12), (k, v), native=False))).all()


def test_every_position_hidden_averages_them_as_the_xla_softmax_does():
    """A query whose every key is masked (an encoder row of padding) weighs them as XLA's softmax
    over logits that all carry the mask; with no visible position the own value alone remains."""
    keys, values, _, _ = _cache("float32", 1, 2, 9, 16, seed=4)
    q, k, v = _query(1, 2, 16, seed=5)
    bias = jnp.full((1, 9), MASK_VALUE, jnp.float32)
    for visible, own in ((9, None), (9, (k, v)), (0, (k, v))):
        got = _attend(q, keys, values, bias, None, None, jnp.int32(visible), own, native=True)
        want = _attend(q, keys, values, bias, None, None, jnp.int32(visible), own, native=False)
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)
    alone = _attend(q, keys, values, bias, None, None, jnp.int32(0), (k, v), native=True)
    np.testing.assert_allclose(alone, v, atol=1e-7)


def test_native_cache_attention_refuses_operands_that_disagree():
    """Shapes are checked before anything is read: one error naming the header that lists them."""
    keys, values, _, _ = _cache("float32", 1, 2, 8, 16, seed=6)
    q = jnp.ones((1, 2, 16))
    out, top, total = native_kernels.cache_attention(q, keys, None, values, None, jnp.zeros((1, 8)), 8)
    assert out.shape == (1, 2, 16) and top.shape == total.shape == (1, 2)
    with pytest.raises(Exception, match="cache attention: operand shapes disagree"):
        jax.block_until_ready(native_kernels.cache_attention(q, keys, None, values, None, jnp.zeros((1, 9)), 8))
    with pytest.raises(Exception, match="cache attention: operand shapes disagree"):
        jax.block_until_ready(
            native_kernels.cache_attention(q, keys, None, values[:, :, :7], None, jnp.zeros((1, 8)), 8)
        )


def test_cached_attention_step_writes_the_same_cache_with_either_read():
    """The self-attention step (read, then the new key and value written after it): the native read
    and XLA's give the same outputs and write the same narrow cache."""
    keys, values, key_scale, value_scale = _cache("int8", 2, 3, 12, 16, seed=7)
    q, k, v = _query(2, 3, 16, seed=8)
    key_mask = jnp.asarray(np.arange(12)[None, :] != np.array([[3], [5]]))

    cache = KVCache(keys, key_scale, values, value_scale, index=jnp.int32(9), key_mask=key_mask)

    def step(attend):
        return jax.jit(lambda *a: xla.cached_attention(*a, attend=attend))(q, k, v, cache)

    (native, native_cache), (reference, reference_cache) = step(cache_attention), step(xla.cache_attention)
    np.testing.assert_allclose(native, reference, atol=2e-6, rtol=2e-5)
    assert jax.tree.structure(native_cache) == jax.tree.structure(cache)
    for got, want in zip(jax.tree.leaves(native_cache), jax.tree.leaves(reference_cache)):
        np.testing.assert_array_equal(got, want)
    direct, _ = jax.jit(cached_attention)(q, k, v, cache)
    np.testing.assert_allclose(direct, reference, atol=2e-6, rtol=2e-5)


@pytest.fixture(scope="module")
def narrow_params(tiny_model):
    """The suite's tiny encoder-decoder's parameters (``cache_dtype`` changes no parameter) as the
    int8 decode tree, quantized in one compiled call."""
    return jax.jit(quantize_params, static_argnums=1)(tiny_model[1], "int8")


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_dense_decode_step_runs_the_native_cache_attention(cache_dtype, narrow_params):
    """An encoder-decoder's step (self- and cross-attention over caches of ``cache_dtype``) lowers
    to the kernel, and decodes as with it switched off (XLA's reads) within float32 rounding."""
    model = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config(cache_dtype=cache_dtype)))
    params = narrow_params
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(2, 61, (2, 9)), jnp.int32).at[1, 6:].set(0)
    tokens = jnp.asarray(rng.integers(2, 61, (2, 4)), jnp.int32)

    def decode():
        decoder = IncrementalDecoder(model.module, 8)  # traced afresh: the kernels' choice is made then
        cache = decoder.prefill(params, inputs)
        lowered = decoder.step.lower(params, cache, tokens[:, 0]).as_text()
        logits = []
        for t in range(tokens.shape[1]):
            step_logits, cache = decoder.step(params, cache, tokens[:, t])
            logits.append(np.asarray(step_logits))
        return np.stack(logits), lowered

    native, lowered = decode()
    target = native_kernels.TARGETS["cache_attention", jnp.dtype(decode_state.storage_dtype(cache_dtype)).name]
    assert lowered.count(target) == 2 * tiny_config().n_decoder_layers  # self and cross, every layer
    with native_kernels.disabled():
        reference, lowered = decode()
    assert "terra_cache_attention" not in lowered
    np.testing.assert_allclose(native, reference, atol=1e-5, rtol=1e-5)

"""Attention caches stored narrow (``cache_dtype``): the int8/bfloat16 store and its error bound,
the backend's products over narrow caches, decoding with narrow caches against float32 caches,
float32 leaving everything as before, and the routing of sparse QKV's fused step."""

import functools
import re

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import cache_logits, cache_weighted_values, cached_attention, decode_state, native_kernels, xla
from terra.backends.decode_state import KVCache
from terra.errors import ConfigError
from terra.gin_config import parsing
from terra.layers import CausalSelfAttention, SparseQKVAttention
from terra.layers.sparse_qkv import SparseQueryCrossAttention
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer, Terraformer, TerraformerModel
from terra.models.config import TransformerConfig
from terra.quantization import quantize_params

from cheap_init_prng import init_key
from helpers import tiny_config

pytestmark = pytest.mark.usefixtures("fast_compile")

# Max |logit difference| against float32 caches, relative to max |logit|, over six decode steps of
# the tiny models (observed at most 6.2e-3 for int8 and 3.6e-3 for bfloat16, both the Terraformer's).
TOLERANCE = {"int8": 1.5e-2, "bfloat16": 5e-3}


def test_int8_round_trip_is_within_half_a_step_of_each_row_and_zero_rows_are_exact():
    @jax.jit  # one program: op by op, every operation compiles as a program of its own
    def round_trip(key):
        x = jax.random.normal(key, (2, 3, 5, 16)) * jnp.arange(1, 6)[:, None]
        x = x.at[0, 1, 2].set(0.0)
        values, scales = decode_state.narrow_rows(x, "int8")
        error = jnp.abs(decode_state.widen_rows(values, scales, jnp.float32) - x)
        bound = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 254  # scale / 2, scale = max|row| / 127
        return values, scales, error, bound, decode_state.widen_rows(values, scales)

    values, scales, error, bound, widened = jax.device_get(round_trip(jax.random.key(0)))
    assert values.dtype == jnp.int8 and scales.dtype == jnp.float32 and scales.shape == (2, 3, 5)
    assert np.all(error <= bound * (1 + 1e-6))
    assert float(scales[0, 1, 2]) == 1.0 and not np.any(values[0, 1, 2])
    assert not np.any(widened[0, 1, 2])


def test_bfloat16_round_trip_and_float32_unchanged():
    @jax.jit  # one program: op by op, every operation compiles as a program of its own
    def round_trip(key):
        x = jax.random.normal(key, (2, 4, 8))
        values, scales = decode_state.narrow_rows(x, "bfloat16")
        as_bfloat16 = jax.lax.bitcast_convert_type(values, jnp.bfloat16)
        return x, values, scales, as_bfloat16, x.astype(jnp.bfloat16), decode_state.widen_rows(values, None)

    x, values, scales, as_bfloat16, rounded, widened = round_trip(jax.random.key(1))
    # Kept as the bfloat16's bits (XLA:CPU reads a bfloat16 array through a float32 copy).
    assert values.dtype == jnp.uint16 and scales is None
    np.testing.assert_array_equal(as_bfloat16, rounded)
    assert np.all(np.abs(np.asarray(widened) - np.asarray(x)) <= np.abs(np.asarray(x)) * 2.0**-8)
    same, none = decode_state.narrow_rows(x, "float32")
    assert same is x and none is None
    zeros, ones = jax.jit(decode_state.empty_rows, static_argnums=(0, 1))((2, 4, 8), "int8")
    assert zeros.dtype == jnp.int8 and ones.shape == (2, 4) and float(ones.min()) == 1.0
    empty = jax.eval_shape(lambda: decode_state.empty_rows((2, 4, 8), "float32", jnp.bfloat16))
    assert empty[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("cache_dtype", ["int8", "bfloat16"])
def test_products_over_a_narrow_cache_equal_the_widened_cache(cache_dtype, monkeypatch):
    """The scale folded into the logits and probabilities, in blocks of positions with a shorter
    last block, gives the float32 products of the widened cache."""
    monkeypatch.setattr(xla, "CACHE_BLOCK_ELEMENTS", 2 * 4 * 8 * 3)  # blocks of 3 positions, 11 = 3 * 3 + 2

    # One program, traced here (the block size is read at tracing): op by op, every operation
    # compiles as a program of its own.
    @jax.jit
    def products(seeds):
        shapes = [(2, 4, 11, 8), (2, 4, 11, 8), (2, 4, 1, 8)]
        keys_f, values_f, q = (jax.random.normal(jax.random.key(seeds[i]), shape) for i, shape in enumerate(shapes))
        (keys, key_scale), (values, value_scale) = (
            decode_state.narrow_rows(t, cache_dtype) for t in (keys_f, values_f)
        )
        wide_k, wide_v = decode_state.widen_rows(keys, key_scale), decode_state.widen_rows(values, value_scale)
        logits = cache_logits(q, keys, key_scale)
        probs = jax.nn.softmax(logits, axis=-1)
        weighted = cache_weighted_values(probs, values, value_scale)

        k, v = (jax.random.normal(jax.random.key(seeds[5 + i]), (2, 4, 1, 8)) for i in range(2))
        index = jnp.asarray(7)
        y, written = cached_attention(q, k, v, KVCache(keys, key_scale, values, value_scale, index=index))
        want, _ = cached_attention(q, k, v, KVCache(wide_k, None, wide_v, None, index=index))
        written_k = decode_state.widen_rows(written.key, written.key_scale)[:, :, 7:8]
        return {
            "logits": (logits, jnp.einsum("bhqd,bhkd->bhqk", q, wide_k)),
            "weighted values": (weighted, jnp.einsum("bhqk,bhkd->bhqd", probs, wide_v)),
            "attention": (y, want),
            "written key": (written_k, decode_state.widen_rows(*decode_state.narrow_rows(k, cache_dtype))),
            "stored key": keys,
            "written": written,
        }

    got = products(jnp.arange(7))
    for name in ("logits", "weighted values", "attention"):
        np.testing.assert_allclose(*got[name], atol=1e-5, rtol=1e-5, err_msg=name)
    written = got["written"]
    assert written.key.dtype == got["stored key"].dtype and (written.key_scale is not None) == (cache_dtype == "int8")
    assert int(written.index) == 8
    np.testing.assert_allclose(*got["written key"], atol=1e-6)


def _encoder_decoder(cache_dtype=None):
    overrides = {} if cache_dtype is None else {"cache_dtype": cache_dtype}
    return EncoderDecoderModel(EncoderDecoderTransformer(tiny_config(**overrides)))


def _terraformer(cache_dtype=None):
    overrides = {} if cache_dtype is None else {"cache_dtype": cache_dtype}
    sparse = functools.partial(SparseQKVAttention, attention_sparsity=4)
    return TerraformerModel(Terraformer(tiny_config(**overrides), decoder_attention=sparse))


def _sparse_encoder_decoder(cache_dtype=None):
    overrides = {} if cache_dtype is None else {"cache_dtype": cache_dtype}
    return EncoderDecoderModel(
        EncoderDecoderTransformer(
            tiny_config(**overrides),
            decoder_self_attention=functools.partial(SparseQKVAttention, attention_sparsity=4),
            encoder_decoder_attention=functools.partial(SparseQueryCrossAttention, attention_sparsity=4),
        )
    )


MODELS = {"encoder_decoder": _encoder_decoder, "terraformer": _terraformer}


def _decode(model, params, steps: int = 6):
    rng = np.random.default_rng(0)  # numpy: eager jnp operations would each compile a program
    inputs = rng.integers(2, 61, (2, 9)).astype(np.int32)
    inputs[1, 6:] = 0
    tokens = rng.integers(2, 61, (2, steps)).astype(np.int32)
    decoder = model.decoder(8)
    cache = decoder.prefill(params, inputs)
    logits = []
    for t in range(steps):
        step_logits, cache = decoder.step(params, cache, tokens[:, t])
        logits.append(np.asarray(step_logits))
    return np.stack(logits), cache


def _leaves(cache) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(cache)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def float32_decode(request):
    make = MODELS[request.param]
    if request.param == "encoder_decoder":  # the suite's shared tiny model: the same config and key
        params = request.getfixturevalue("tiny_model")[1]
    else:  # from a key whose initializer compiles cheaply (cheap_init_prng)
        params = make().init_params(init_key(0))
    return make, params, _decode(make(), params)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", ["int8", "bfloat16"])
def test_narrow_caches_decode_close_to_float32_caches(float32_decode, cache_dtype):
    make, params, (reference, _) = float32_decode
    logits, cache = _decode(make(cache_dtype), params)
    assert np.max(np.abs(logits - reference)) <= TOLERANCE[cache_dtype] * np.max(np.abs(reference))
    leaves = _leaves(cache)
    # A KVCache's fields (``.key``), an LSH layer's variables (``['cached_key']``).
    caches = {k: v for k, v in leaves.items() if re.search(r"(\.(key|value)|'cached_(key|value)'\])$", k)}
    assert caches and {v.dtype for v in caches.values()} == {jnp.dtype(decode_state.storage_dtype(cache_dtype))}
    scales = {k: v for k, v in leaves.items() if k.endswith(("_scale']", "_scale"))}
    if cache_dtype == "int8":
        assert len(scales) == len(caches)
        for name, cached in caches.items():
            scale = leaves[name + "_scale" if name.endswith(("key", "value")) else name[:-2] + "_scale']"]
            assert scale.dtype == jnp.float32 and scale.shape == cached.shape[:3]
    else:
        assert not scales


def test_float32_caches_are_exactly_as_without_the_setting(float32_decode):
    make, params, (reference, reference_cache) = float32_decode
    logits, cache = _decode(make("float32"), params)
    np.testing.assert_array_equal(logits, reference)
    leaves, reference_leaves = _leaves(cache), _leaves(reference_cache)
    assert leaves.keys() == reference_leaves.keys() and not any("_scale" in k for k in leaves)
    for name, leaf in leaves.items():
        assert leaf.dtype == reference_leaves[name].dtype
        np.testing.assert_array_equal(leaf, reference_leaves[name])


def test_a_bad_cache_dtype_is_one_config_error_naming_the_allowed_values():
    with pytest.raises(ConfigError, match="float32, bfloat16, int8"):
        TransformerConfig(cache_dtype="fp8")
    layer = CausalSelfAttention(d_model=8, n_heads=2, cache_dtype="int4")
    with pytest.raises(ConfigError, match="'int4' is not one of float32, bfloat16, int8"):
        # Traced only: the layer refuses while it builds its cache (run, each operation of its
        # initializer would compile first).
        jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.zeros((1, 1, 8)), decode=True, max_decode_length=4))


def test_the_setting_is_a_gin_binding():
    # Unlocked: the model alone, without registering the data layer (which imports TensorFlow).
    parsing.parse_gin(["models/tiny.gin"], ["TransformerConfig.cache_dtype = 'int8'"], finalize=False)
    try:
        assert parsing.build_model().module.config.cache_dtype == "int8"
    finally:
        gin.clear_config()


@pytest.mark.slow
@pytest.mark.skipif(not native_kernels.fused_available(), reason="native kernels not built")
def test_narrow_caches_keep_the_native_projections_of_sparse_qkv():
    """The fused native step reads float32 caches only: over narrow caches the backend runs the
    native projections and XLA's attention (one custom call per layer either way). The program's
    calls depend on shapes and dtypes alone: it is lowered from abstract parameters and cache."""
    targets = {}
    for cache_dtype in ("float32", "int8"):
        model = _sparse_encoder_decoder(cache_dtype)
        params = jax.eval_shape(lambda p: quantize_params(p, "int8"), model.abstract_params())
        decoder = model.decoder(4)
        cache = jax.eval_shape(decoder.prefill, params, jax.ShapeDtypeStruct((1, 5), jnp.int32))
        text = decoder.step.lower(params, cache, jax.ShapeDtypeStruct((1,), jnp.int32)).as_text()
        targets[cache_dtype] = set(re.findall(r"terra_sparse_attention_[a-z0-9]+_int8", text))
    assert targets["float32"] == {"terra_sparse_attention_self_int8", "terra_sparse_attention_cross_int8"}
    assert targets["int8"] == {"terra_sparse_attention_projections3_int8", "terra_sparse_attention_projections1_int8"}

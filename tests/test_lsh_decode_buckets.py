"""LSH decode reads only what it attends to: the bucket-list candidates of a decode step
(``select_from_bucket_lists``) choose the same keys as the reference's rule over the whole
cache (``select_from_whole_cache``; ``docs/design/reference_code.md`` §4.5), and narrow K/V
caches stay close to float32."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import decode_state, native_kernels
from terra.decoding.decode_step import IncrementalDecoder
from terra.layers.lsh_attention import LSHSelfAttention
from terra.layers.lsh_bucket_lists import (
    append_position,
    latest_positions,
    select_from_bucket_lists,
    select_from_whole_cache,
)
from terra.models import Terraformer

from cheap_init_prng import init_key
from helpers import tiny_config

pytestmark = pytest.mark.usefixtures("fast_compile")

D, H = 16, 2
PREFIX, MAX_LEN, STEPS = 40, 64, 6
# chunk_len 4, one chunk before, 2 rounds: n_keep = 2·4·2 - 1 = 15 of up to 45 past keys.
N_KEEP = 15


def _layer(**kw):
    return LSHSelfAttention(**{"d_model": D, "n_heads": H, "chunk_len": 4, "n_hashes": 2, "n_buckets": 4, **kw})


@functools.lru_cache(maxsize=None)
def _params():
    # The key made inside the program too: op by op its seeding compiles each operation apart.
    return jax.jit(lambda: _layer().init(init_key(0), jnp.zeros((1, 4, D))))()["params"]  # cheap_init_prng


def _decode(layer, x, prefix_mask, step_mask):
    """Prefill ``x[:, :PREFIX]`` then decode ``x[:, PREFIX:]`` token by token -> the steps'
    outputs ``[batch, STEPS, D]`` and the final ``LSHCache``."""
    return _compiled_decode(layer, _params(), x, prefix_mask, step_mask)


@functools.partial(jax.jit, static_argnums=0)
def _compiled_decode(layer, params, x, prefix_mask, step_mask):
    variables = {"params": params}
    _, cache = layer.apply(
        variables, x[:, :PREFIX], decode=True, max_decode_length=MAX_LEN, prefix_mask=prefix_mask, mutable=["cache"]
    )

    def step(cache, token_and_mask):  # one decode step; scanned, so the program holds it once
        y, cache = layer.apply({**variables, **cache}, *token_and_mask, decode=True, mutable=["cache"])
        return cache, y

    # [STEPS, batch, 1, D] tokens and [STEPS, batch, 1] masks, one of each per step.
    tokens, masks = jnp.swapaxes(x[:, PREFIX:, None], 0, 1), jnp.swapaxes(step_mask[:, :, None], 0, 1)
    cache, outputs = jax.lax.scan(step, cache, (tokens, masks))
    return jnp.swapaxes(outputs[:, :, 0], 0, 1), cache["cache"]["lsh"]


def _inputs(seed, padded):
    x = jax.random.normal(jax.random.key(seed), (2, PREFIX + STEPS, D))
    prefix_mask = np.ones((2, PREFIX), np.float32)
    step_mask = np.ones((2, STEPS), np.float32)
    if padded:
        prefix_mask[0, 31:] = 0  # 9 padded positions, fewer than n_keep
        prefix_mask[1, 12:] = 0  # 28 padded positions: the latest n_keep positions are padding
        step_mask[1, 2] = 0  # a padded decode token joins no list
    return x, jnp.asarray(prefix_mask), jnp.asarray(step_mask)


@pytest.mark.parametrize("n_buckets,seed,padded", [(4, 0, False), (4, 1, True), (2, 2, False), (2, 3, True)])
def test_bucket_restricted_decode_equals_full_cache_decode(n_buckets, seed, padded):
    """n_buckets 2 puts more than n_keep same-bucket keys in a bucket, so the bucket lists
    wrap; the padded prefixes leave fewer than n_keep real keys among the latest positions."""
    x, prefix_mask, step_mask = _inputs(seed, padded)
    fast, cache = _decode(_layer(n_buckets=n_buckets), x, prefix_mask, step_mask)
    slow, _ = _decode(_layer(n_buckets=n_buckets, decode_candidates="all"), x, prefix_mask, step_mask)
    np.testing.assert_allclose(fast, slow, atol=1e-6, rtol=1e-6)
    if n_buckets == 2:
        assert int(cache.bucket_counts.max()) > N_KEEP


def test_bucket_lists_choose_the_whole_cache_choice():
    """Random buckets (few, with padding and empty slots): the prefill's lists, extended one
    position at a time, give exactly the whole-cache choice for every query bucket."""
    rng = np.random.default_rng(0)
    batch, heads, rounds, n_real, n_keep, length, written = 2, 3, 2, 3, 5, 30, 24
    buckets = rng.integers(0, n_real, (batch, heads, rounds, length)).astype(np.int32)
    buckets[0, :, :, 10:16] = -1  # padding
    buckets[..., written:] = -1  # not written yet
    cached = jnp.asarray(buckets)

    @jax.jit  # one program, where op by op each operation compiles on its own
    def fill(cached):
        lists, counts = latest_positions(cached[..., :18], n_real, n_keep)
        recent, recent_counts = latest_positions(jnp.where(cached[:, 0, 0, :18] >= 0, 0, -1), 1, n_keep)

        def append(position, carry):  # one position at a time, as a decode step appends it
            lists, counts, recent, recent_counts = carry
            column = jax.lax.dynamic_index_in_dim(cached, position, axis=-1, keepdims=False)
            lists, counts = append_position(lists, counts, column, position)
            real = jnp.where(column[:, 0, :1] >= 0, 0, -1)
            return (lists, counts, *append_position(recent, recent_counts, real, position))

        lists, counts, recent, _ = jax.lax.fori_loop(18, written, append, (lists, counts, recent, recent_counts))
        return (lists, counts), recent[:, 0], latest_positions(cached, n_real, n_keep)

    @jax.jit  # one program for every query bucket (traced)
    def select(lists, recent, cached, q):
        q_buckets = jnp.broadcast_to(q, (batch, heads, rounds))
        own = jnp.take_along_axis(lists, q_buckets[..., None, None], axis=3)[..., 0, :]
        fast = select_from_bucket_lists(own, recent, cached, q_buckets, n_keep)
        return fast, select_from_whole_cache(cached, q_buckets, n_keep)

    (lists, counts), recent, (once, once_counts) = fill(cached)
    np.testing.assert_array_equal(lists, once)  # appending equals the prefill's all-at-once fill
    np.testing.assert_array_equal(counts, once_counts)
    for q in np.ndindex(*(n_real,) * rounds):
        fast, slow = select(lists, recent, cached, np.asarray(q, np.int32))
        np.testing.assert_array_equal(np.sort(fast, -1), np.sort(slow, -1))


def test_prefill_attends_with_the_buckets_it_caches():
    """The prefill hashes its prefix once: its own output is the layer's forward with the
    buckets it writes to the cache, also with an ``lsh`` rng (whose second draw, for a second
    hash, would give other rotations)."""
    layer = _layer()
    x, prefix_mask, _ = _inputs(1, padded=True)
    prefix = x[:, :PREFIX]
    rngs = {"lsh": jax.random.key(7)}

    @jax.jit
    def prefill_and_forward(params):
        y, cache = layer.apply(
            {"params": params},
            prefix,
            decode=True,
            max_decode_length=MAX_LEN,
            prefix_mask=prefix_mask,
            mutable=["cache"],
            rngs=rngs,
        )
        cached = cache["cache"]["lsh"].buckets[..., :PREFIX]
        return y, layer.apply({"params": params}, prefix, prefix_mask, buckets=cached)

    y, replayed = prefill_and_forward(_params())
    real = np.asarray(prefix_mask, bool)
    np.testing.assert_allclose(np.asarray(y)[real], np.asarray(replayed)[real], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype,atol", [("bfloat16", 1e-2), ("int8", 1e-2)])
def test_narrow_caches_stay_close_to_float32(cache_dtype, atol):
    x, prefix_mask, step_mask = _inputs(4, True)
    wide, _ = _decode(_layer(), x, prefix_mask, step_mask)
    narrow, cache = _decode(_layer(cache_dtype=cache_dtype), x, prefix_mask, step_mask)
    assert cache.key.dtype == jnp.dtype(decode_state.storage_dtype(cache_dtype))
    assert (cache.value_scale is not None) == (cache_dtype == "int8")
    np.testing.assert_allclose(narrow, wide, atol=atol)


def _fresh_decode():
    """``_compiled_decode`` under a new function, so that jit traces it again (the backend's
    choice is made when tracing)."""
    return jax.jit(lambda *args: _compiled_decode.__wrapped__(*args), static_argnums=0)


native = pytest.mark.skipif(not native_kernels.available(), reason="terra's native kernels are not built")


@native
@pytest.mark.parametrize(
    "cache_dtype,n_buckets,seed,padded",
    [("float32", 4, 5, True), ("float32", 2, 6, False), ("int8", 2, 7, True), ("bfloat16", 4, 8, True)],
)
def test_native_bucket_attention_equals_its_xla_form(cache_dtype, n_buckets, seed, padded):
    """The one-call native step (the keys chosen by merging the bucket lists, their rows read in
    place) against the XLA step (ranking the candidates, gathering the rows), on the same stored
    caches: wrapping lists, padded prefixes and a padded decode token."""
    x, prefix_mask, step_mask = _inputs(seed, padded)
    layer = _layer(n_buckets=n_buckets, cache_dtype=cache_dtype)
    # The module's jit, traced with the native kernels on (as every other test here), so a layer an
    # earlier test decoded is not compiled again; the lowered text proves which form it holds.
    step = _compiled_decode
    lowered = step.lower(layer, _params(), x, prefix_mask, step_mask).as_text()
    assert (
        native_kernels.TARGETS["lsh_decode_attention", jnp.dtype(decode_state.storage_dtype(cache_dtype)).name]
        in lowered
    )
    fast, fast_cache = step(layer, _params(), x, prefix_mask, step_mask)
    with native_kernels.unfused():  # chosen at trace time: a new jit traces the XLA form
        xla_step = _fresh_decode()
        assert "terra_lsh_decode_attention" not in xla_step.lower(layer, _params(), x, prefix_mask, step_mask).as_text()
        slow, slow_cache = xla_step(layer, _params(), x, prefix_mask, step_mask)
    np.testing.assert_allclose(fast, slow, atol=2e-6, rtol=2e-6)
    assert jax.tree.structure(fast_cache) == jax.tree.structure(slow_cache)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(fast_cache), jax.tree.leaves(slow_cache)):
        # the same keys, values, buckets and lists written
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))


@native
def test_native_bucket_attention_refuses_operands_that_disagree():
    """Shapes are checked before anything is read: one error naming the header that lists them."""
    b, h, length, d, rounds, n_buckets, capacity = 1, 2, 8, 4, 2, 3, 5
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    keys = jnp.zeros((b, h, length, d))
    args = [i32(b, h, rounds, length), i32(b, h, rounds, n_buckets, capacity), i32(b, h, rounds, n_buckets)]
    args += [i32(b, capacity), i32(b), i32(b, h, rounds)]
    out, top, total = native_kernels.lsh_decode_attention(jnp.ones((b, h, d)), keys, None, keys, None, *args)
    np.testing.assert_array_equal(total, 0.0)  # nothing appended: no key kept
    with pytest.raises(Exception, match="operand shapes disagree"):
        bad = args[:3] + [i32(b, capacity + 1)] + args[4:]  # a recent list longer than the bucket lists
        jax.block_until_ready(native_kernels.lsh_decode_attention(jnp.ones((b, h, d)), keys, None, keys, None, *bad))


@pytest.mark.slow
def test_terraformer_decode_with_bucket_lists_equals_whole_cache_selection():
    """Through a Terraformer's decoder, whose LSH cache is prefilled with ``[encoder, padding,
    decoder]`` (padding inside the prefix): chunk_len 2 keeps 7 of up to 17 past keys."""

    def network(candidates):
        attention = functools.partial(
            LSHSelfAttention, chunk_len=2, n_buckets=4, n_hashes=2, decode_candidates=candidates
        )
        return Terraformer(
            tiny_config(vocab_size=32, n_encoder_layers=1, n_decoder_layers=1), decoder_attention=attention
        )

    networks = {candidates: network(candidates) for candidates in ("buckets", "all")}
    # decode_candidates only changes how a step chooses its keys: one parameter tree for both.
    # The network's own init, jitted with the key made inside (cheap_init_prng): a TerraformerModel
    # would trace the initializer twice more (its abstract tree, then for this key's PRNG).
    ones = jnp.ones((1, 8), jnp.int32)
    params = nn.unbox(jax.jit(lambda: networks["buckets"].init(init_key(1), ones, ones))()["params"])

    def decode(candidates):
        encoder = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 0, 0, 0, 0, 0, 0]], jnp.int32)
        decoder = IncrementalDecoder(networks[candidates], 8)
        cache = decoder.prefill(params, encoder)
        steps = []
        for token in [1, 7, 9, 11, 2, 4, 6, 8]:
            logits, cache = decoder.step(params, cache, jnp.full((2,), token, jnp.int32))
            steps.append(logits)
        names = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(cache)[0]}
        return jnp.stack(steps, axis=1), any("bucket_positions" in name for name in names)

    (fast, lists), (slow, no_lists) = decode("buckets"), decode("all")
    assert lists and not no_lists
    np.testing.assert_allclose(fast, slow, atol=1e-5, rtol=1e-5)

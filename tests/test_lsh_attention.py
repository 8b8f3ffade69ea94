"""LSH self-attention (paper §4, ``docs/design/reference_code.md`` §4.5 and §2.5b)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import lsh_chunk_attention, native_kernels
from terra.errors import ConfigError
from terra.layers import SparseQKVAttention, axes
from terra.layers.lsh_attention import LSHSelfAttention
from terra.layers.lsh_chunked_attention import (
    attention_in_chunks,
    full_shared_qk_attention,
    inverse_permutation,
    length_normalized,
    lsh_attention,
    stable_order,
)
from terra.layers.lsh_hashing import _buckets, bucket_factors, hash_vectors, signed_argmax
from terra.layers.multiplicative import MultiplicativeDense
from terra.layers.selection import block_argmax
from terra.layers.sparse_qkv import ModuleConvolution

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

D, H = 32, 4  # d_head = 8
CHUNK = 8


def _layer(**kw):
    return LSHSelfAttention(**{"d_model": D, "n_heads": H, "chunk_len": CHUNK, **kw})


def _x(length, batch=2, seed=0):
    return jax.random.normal(jax.random.key(seed), (batch, length, D))


def _init(layer):
    """Parameters for ``layer`` (they depend only on the sizes and the weights format)."""
    return _canonical_params(layer.weights_format)


@functools.lru_cache(maxsize=None)
def _canonical_params(weights_format):
    """The layer's parameter tree (shapes and logical names from its own init, traced but not
    compiled) filled with seeded N(0, 1/last-axis) values (biases N(0, 0.01)). These tests check the attention, not
    the initialisers (``Dense``'s and the sparse layers' are tested with them); compiling
    every initialiser's threefry draws would cost seconds of XLA:CPU time per format."""
    return _filled_params(
        LSHSelfAttention(d_model=D, n_heads=H, weights_format=weights_format), jnp.zeros((1, CHUNK, D))
    )


def _filled_params(layer, x, seed=1):
    """``layer``'s parameter tree for inputs like ``x``, filled with seeded N(0, 1/last-axis)
    values (biases N(0, 0.01)) on the host: nothing compiled."""
    shapes = _shapes(layer, x)
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        scale = 0.1 if "bias" in jax.tree_util.keystr(path) else leaf.shape[-1] ** -0.5
        # Cast on the host: a device-side cast would compile a program per leaf shape.
        return jnp.asarray((scale * rng.normal(size=leaf.shape)).astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(fill, shapes)


def _shapes(layer, x, **kwargs):
    """The variables' shapes and logical names, without computing them."""
    return jax.eval_shape(lambda x: layer.init(jax.random.key(0), x, **kwargs), x)


@functools.partial(
    jax.jit, static_argnums=0, static_argnames=("deterministic", "decode", "max_decode_length", "mutable")
)
def _apply(
    layer,
    variables,
    x,
    mask=None,
    buckets=None,
    rngs=None,
    *,
    deterministic=True,
    decode=False,
    max_decode_length=None,
    mutable=False,
):
    """``layer.apply``, compiled once per configuration and signature and shared by the tests
    (op-by-op dispatch would compile every small op of the sort-and-chunk path separately)."""
    return layer.apply(
        variables,
        x,
        mask,
        deterministic=deterministic,
        decode=decode,
        max_decode_length=max_decode_length,
        buckets=buckets,
        rngs=rngs,
        mutable=mutable,
    )


@functools.partial(jax.jit, static_argnums=0)
def _step(layer, variables, cache, token):
    """One compiled decode step."""
    return layer.apply({**variables, **cache}, token, decode=True, mutable=["cache"])


def _no_padding(x):
    """An all-real mask (passed where it lets tests share one compiled signature), made on the
    host (jnp.ones would compile a program per shape)."""
    return np.ones(x.shape[:2], np.float32)


def _full(layer):
    """The same layer computing full shared-QK attention with the same masks."""
    return layer.clone(std_length=10**9)


def _reference_forward_unbatched(q, v, buckets, n_total, mask, chunk_len, n_before, n_after, causal):
    """A line-by-line NumPy port of the reference's ``forward_unbatched`` for one example and
    head after the projections (``efficient_attention.py``: ``hash_vectors`` offsets,
    ``buckets_and_t`` sort, ``attend`` with ``look_adjacent`` and 1-indexed
    ``mask_self_attention`` info, negative ``kv_info`` for padding, ``logsumexp`` rounds)."""
    length = q.shape[0]
    n_hashes = buckets.shape[0]
    buckets = (buckets + np.arange(n_hashes)[:, None] * n_total).reshape(-1)
    ticker = np.arange(n_hashes * length)
    buckets_and_t = length * buckets + (ticker % length)
    sticker = np.argsort(buckets_and_t, kind="stable")
    undo_sort = np.argsort(sticker, kind="stable")
    st = sticker % length
    sq, sv = q[st], v[st]
    q_info = st + 1
    kv_info = q_info * np.where(mask[st], 1, -1)
    sq = sq.reshape(-1, chunk_len, q.shape[-1])
    sk = sq / np.sqrt(np.mean(sq**2, axis=-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    sv = sv.reshape(-1, chunk_len, v.shape[-1])
    q_info = q_info.reshape(-1, chunk_len)
    kv_info = kv_info.reshape(-1, chunk_len)

    def look_adjacent(x):
        slices = [x if i == 0 else np.concatenate([x[i:], x[:i]], axis=0) for i in range(-n_before, n_after + 1)]
        return np.concatenate(slices, axis=1)

    sk, sv, kv_info = look_adjacent(sk), look_adjacent(sv), look_adjacent(kv_info)
    dots = sq @ np.swapaxes(sk, -1, -2)
    qi, ki = q_info[..., :, None].astype(np.float64), kv_info[..., None, :].astype(np.float64)
    if causal:
        dots = dots - 1e9 * (qi < ki)
    dots = dots - 1e5 * (qi == ki)
    dots = dots - 1e9 * (ki < 0)
    m = dots.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(dots - m).sum(axis=-1, keepdims=True))
    so = (np.exp(dots - lse) @ sv).reshape(-1, v.shape[-1])
    slogits = lse.reshape(-1)
    o, logits = so[undo_sort], slogits[undo_sort]
    o = o.reshape(n_hashes, length, -1)
    logits = logits.reshape(n_hashes, length, 1)
    probs = np.exp(logits - logits.max(0) - np.log(np.exp(logits - logits.max(0)).sum(0)))
    return (o * probs).sum(0)


@pytest.mark.parametrize("n_hashes,n_before,n_after,causal", [(2, 1, 0, True), (3, 2, 1, False)])
def test_sort_and_chunk_attention_matches_a_port_of_the_reference(n_hashes, n_before, n_after, causal):
    rng = np.random.default_rng(0)
    batch, heads, length, d, n_buckets = 2, 2, 32, 8, 6
    q = rng.normal(size=(batch, heads, length, d)).astype(np.float32)
    v = rng.normal(size=(batch, heads, length, d)).astype(np.float32)
    mask = rng.random((batch, length)) > 0.2
    buckets = rng.integers(0, n_buckets, (batch, heads, n_hashes, length)).astype(np.int32)
    buckets = np.where(mask[:, None, None, :], buckets, n_buckets)  # padding -> the extra bucket
    attend = functools.partial(
        lsh_attention,
        n_total_buckets=n_buckets + 1,
        chunk_len=CHUNK,
        n_chunks_before=n_before,
        n_chunks_after=n_after,
        causal=causal,
    )
    got = jax.jit(attend)(q, v, buckets, key_mask=mask)
    for b in range(batch):
        for h in range(heads):
            q_bh, v_bh = q[b, h].astype(np.float64), v[b, h].astype(np.float64)
            want = _reference_forward_unbatched(
                q_bh, v_bh, buckets[b, h], n_buckets + 1, mask[b], CHUNK, n_before, n_after, causal
            )
            # Padded queries see only masked keys (logits near -1e9, below float32 resolution):
            # their outputs are meaningless in both, so only real positions are compared.
            np.testing.assert_allclose(np.asarray(got[b, h])[mask[b]], want[mask[b]], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("length,n_hashes", [(CHUNK, 2), (CHUNK - 3, 4)])
@pytest.mark.slow
def test_one_chunk_lsh_equals_full_shared_qk_attention(length, n_hashes):
    layer = _layer(n_hashes=n_hashes)
    x = _x(length)
    mask = np.ones((2, length), np.float32)
    mask[1, -2:] = 0
    variables = _init(layer)
    y = _apply(layer, variables, x, mask)
    np.testing.assert_allclose(y, _apply(_full(layer), variables, x, mask), atol=1e-5, rtol=1e-5)

    # and the dense path is the textbook formula: causal, exclude-self (-1e5), padding
    @jax.jit  # one program, where op by op each operation compiles on its own
    def textbook():
        q = jax.random.normal(jax.random.key(2), (1, 1, 4, 8))
        v = jax.random.normal(jax.random.key(3), (1, 1, 4, 8))
        k = q / jnp.sqrt(jnp.mean(q**2, -1, keepdims=True) + 1e-6) / jnp.sqrt(8.0)
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k) - 1e5 * jnp.eye(4) - 1e9 * jnp.triu(jnp.ones((4, 4)), 1)
        return q, v, jax.nn.softmax(logits, -1) @ v

    q, v, want = textbook()
    np.testing.assert_allclose(jax.jit(full_shared_qk_attention)(q, v), want, atol=1e-6)
    np.testing.assert_allclose(want[0, 0, 0], v[0, 0, 0], atol=1e-6)  # only itself to attend to


@pytest.mark.slow
def test_lsh_is_causal():
    """Queries never see later keys. The sort-and-chunk assignment depends on every
    position's bucket (as in the reference), so the hashing decisions are held fixed when
    later tokens change; within one chunk causality holds with fresh hashing too."""
    layer = _layer(n_hashes=2)
    x = _x(4 * CHUNK)
    variables = _init(layer)
    y, state = _apply(layer, variables, x, rngs={"lsh": jax.random.key(5)}, mutable=("intermediates",))
    (buckets,) = state["intermediates"]["buckets"]
    y = np.asarray(y)  # sliced on the host: op by op each slice compiles on its own
    rng = np.random.default_rng(5)
    for t in (1, CHUNK + 3, 3 * CHUNK):
        changed = np.array(x)
        changed[:, t:] = 10.0 * rng.normal(size=changed[:, t:].shape)
        y_changed = np.asarray(_apply(layer, variables, changed, buckets=buckets, rngs={"lsh": jax.random.key(t)}))
        np.testing.assert_allclose(y_changed[:, :t], y[:, :t], atol=1e-6, rtol=1e-6)
        assert not np.allclose(y_changed[:, t:], y[:, t:], atol=1e-3)

    short = np.asarray(x)[:, :CHUNK]
    changed = short.copy()
    changed[:, 5:] = -3.0
    y_short, y_changed = (np.asarray(_apply(layer, variables, t, _no_padding(t))) for t in (short, changed))
    np.testing.assert_allclose(y_changed[:, :5], y_short[:, :5], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_padding_is_never_attended(causal):
    layer = _layer(n_hashes=2, causal=causal)
    length = 4 * CHUNK
    x = _x(length)
    mask = np.ones((2, length), np.float32)
    mask[0, -5:] = 0  # trailing padding
    mask[1, 10:14] = 0  # a gap, as the Terraformer's [encoder, padding, decoder] input
    variables = _init(layer)
    y = _apply(layer, variables, x, mask)
    garbage = jnp.where(mask[..., None] > 0, x, 1e3 * jax.random.normal(jax.random.key(9), x.shape))
    y_garbage = _apply(layer, variables, garbage, mask)
    real = mask > 0
    np.testing.assert_allclose(np.asarray(y_garbage)[real], np.asarray(y)[real], atol=1e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(y_garbage)).all()


def test_buckets_are_reused_when_given():
    layer = _layer(n_hashes=2)
    x = _x(4 * CHUNK)
    variables = _init(layer)

    def hashed(key):
        return _apply(layer, variables, x, rngs={"lsh": key}, mutable=("intermediates",))

    y, state = hashed(jax.random.key(5))
    (buckets,) = state["intermediates"]["buckets"]
    assert buckets.shape == (2, H, 2, 4 * CHUNK) and buckets.dtype == jnp.int32
    assert int(buckets.max()) < bucket_factors(None, 4 * CHUNK, CHUNK)[0]  # no padding here
    # A different hash draw changes the output; replaying the sown buckets restores it.
    y_other, _ = hashed(jax.random.key(6))
    assert not np.allclose(y_other, y, atol=1e-3)
    replayed = _apply(layer, variables, x, buckets=buckets, rngs={"lsh": jax.random.key(6)})
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(y))
    different = jnp.roll(buckets, 3, axis=-1)
    y_different = _apply(layer, variables, x, buckets=different, rngs={"lsh": jax.random.key(5)})
    assert not np.allclose(y_different, y, atol=1e-3)


def test_training_draws_a_fresh_hash_per_step_and_eval_is_deterministic():
    layer = _layer(n_hashes=2)
    x = _x(4 * CHUNK)
    variables = _init(layer)
    mask = _no_padding(x)
    np.testing.assert_array_equal(_apply(layer, variables, x, mask), _apply(layer, variables, x, mask))
    train = [_apply(layer, variables, x, rngs={"dropout": jax.random.key(s)}, deterministic=False) for s in range(2)]
    assert not np.allclose(train[0], train[1], atol=1e-3)


@pytest.mark.slow
def test_more_hash_rounds_approach_full_attention():
    """With L = 4 chunks, the mean relative error against full shared-QK attention (same
    parameters and masks), averaged over 6 hash draws, falls as rounds are added. Measured
    here: 0.68, 0.43, 0.28, 0.19 for 1, 2, 4, 8 rounds; over 3 inputs x 3 draw seeds the
    means ranged 0.68-0.85, 0.42-0.54, 0.28-0.35, 0.20-0.24, with per-draw spread <= 0.05."""
    layer = _layer(n_hashes=1)
    x = _x(4 * CHUNK)
    variables = _init(layer)
    rounds = (1, 2, 4, 8)

    @jax.jit  # one program for every round count and the errors, where op by op each op compiles
    def relative_errors():
        full = _full(layer).apply(variables, x)
        keys = jax.random.split(jax.random.key(7), 6)
        errors = []
        for r in rounds:
            ys = jax.vmap(lambda key, r=r: layer.clone(n_hashes=r).apply(variables, x, rngs={"lsh": key}))(keys)
            errors.append(jnp.mean(jnp.abs(ys - full)) / jnp.mean(jnp.abs(full)))
        return jnp.stack(errors)

    errors = dict(zip(rounds, relative_errors().tolist()))
    assert errors[1] > errors[2] > errors[4] > errors[8], errors
    assert errors[8] < 0.5 * errors[1], errors


@pytest.mark.parametrize(
    "weights_format,n_hashes,max_len",
    [("model", 2, 64), ("sparse", 1, CHUNK)],
)
def test_incremental_decode_matches_full_forward_within_one_chunk(weights_format, n_hashes, max_len):
    """For at most ``chunk_len`` tokens the full forward attends to every earlier key, and so
    does the decode step, which keeps the top n_hashes·chunk_len·(1 + n_chunks_before) - 1 past
    keys (max_len 64 > 31 exercises that selection; with one round and max_len 8 the whole
    cache is kept)."""
    layer = _layer(n_hashes=n_hashes, weights_format=weights_format)
    x = _x(CHUNK)
    variables = _init(layer)
    full = _apply(layer, variables, x, _no_padding(x))
    _, cache = _apply(layer, variables, x[:, :1], decode=True, max_decode_length=max_len, mutable=("cache",))
    assert cache["cache"]["lsh"].key.shape == (2, H, max_len, D // H)  # head-major
    assert int(cache["cache"]["lsh"].index) == 0  # the cache-creating call writes nothing
    outputs = []
    for t in range(CHUNK):
        y, cache = _step(layer, variables, cache, x[:, t : t + 1])
        outputs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, atol=1e-5, rtol=1e-5)
    assert int(cache["cache"]["lsh"].index) == CHUNK
    assert (np.asarray(cache["cache"]["lsh"].buckets)[..., :CHUNK] >= 0).all()


def test_sparse_shared_qk_is_one_convolution_with_the_averaged_weights():
    """Over a whole sequence the 'sparse' format's shared QK, the reference's average of the Q and
    K convolutions, is computed as one convolution with the averaged weights: the same attention
    as the two convolutions computed one by one and averaged."""
    layer = _layer(weights_format="sparse", std_length=4 * CHUNK)  # full attention over the projections
    x = _x(2 * CHUNK)
    variables = _init(layer)

    @jax.jit  # one program, where op by op each operation compiles on its own
    def two_convolutions(params, x):
        u = MultiplicativeDense(D, H, split_modules=True).apply({"params": params["mult"]}, x)

        def conv(name, module_kernel):
            return ModuleConvolution(D // H, 3, module_kernel).apply({"params": params[name]}, u)

        heads = lambda t: jnp.swapaxes(t.reshape(2, -1, H, D // H), 1, 2)  # noqa: E731
        q = heads((conv("q_conv", 3) + conv("k_conv", 3)) / 2)
        return jnp.swapaxes(full_shared_qk_attention(q, heads(conv("v_conv", 1))), 1, 2).reshape(x.shape)

    want = two_convolutions(variables["params"], x)
    np.testing.assert_allclose(_apply(layer, variables, x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_keys", [5, 2**30])  # one combined-key sort; past int32, the argsort
def test_stable_order_and_its_inverse_equal_the_stable_argsort(n_keys):
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 5, (2, 3, 40)).astype(np.int32)  # many ties: stability is visible
    order, sorted_keys = jax.jit(stable_order, static_argnums=1)(jnp.asarray(keys), n_keys)
    want = np.argsort(keys, axis=-1, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(sorted_keys, np.take_along_axis(keys, want, axis=-1))
    undo = jax.jit(inverse_permutation)(order)
    np.testing.assert_array_equal(undo, np.argsort(want, axis=-1))
    identity = np.broadcast_to(np.arange(40), keys.shape)
    np.testing.assert_array_equal(np.take_along_axis(want, np.asarray(undo), axis=-1), identity)


def test_signed_argmax_is_the_argmax_of_the_value_and_its_negation():
    """The hash's bucket, argmax([xR, -xR]), without the concatenation: equal on random rows,
    ties between the maximum and the negated minimum, repeated extremes and NaN."""
    rng = np.random.default_rng(4)
    rows = [rng.normal(size=8) for _ in range(50)]
    rows += [[1.0, -1.0, 0.5, 0.0], [-2.0, 0.5, 2.0, -2.0], [0.0, -0.0, 0.0, 0.0], [1.0, np.nan, -3.0, np.nan]]
    rows += [[0.5, 3.0, 3.0, -1.0], [-4.0, 1.0, -4.0, 2.0]]
    both = jax.jit(lambda x: (signed_argmax(x), block_argmax(jnp.concatenate([x, -x], axis=-1))))
    for row in rows:
        got, want = both(jnp.asarray(np.asarray(row, np.float32)[None]))
        assert int(got[0]) == int(want[0]), row


def test_decode_beyond_one_chunk_prefers_same_bucket_keys():
    """Past one chunk the step keeps the reference's choice of keys: same bucket in any round
    first, then the most recent. Here n_hashes·chunk_len·(1 + n_chunks_before) - 1 = 3 of
    12 past keys are kept, plus the token itself at -1e5 (exclude-self)."""
    layer = _layer(chunk_len=2, n_chunks_before=0, n_hashes=2, n_buckets=4)
    x = _x(13, batch=1)
    variables = _init(layer)
    _, cache = _apply(layer, variables, x[:, :1], decode=True, max_decode_length=16, mutable=("cache",))
    for t in range(12):
        _, cache = _step(layer, variables, cache, x[:, t : t + 1])
    y, _ = _step(layer, variables, cache, x[:, 12:13])

    c = jax.tree.map(np.asarray, cache["cache"]["lsh"])
    p = jax.tree.map(np.asarray, nn.unbox(variables["params"]))
    qv = np.einsum("hsed,d->hse", p["qv"]["kernel"], np.asarray(x[0, 12])) + p["qv"]["bias"]  # [h, 2, 8]
    q, v = qv[:, 0], qv[:, 1]
    rotated = np.einsum("hd,hrkd->hrk", q, c.rotations)  # stored [heads, rounds, n_buckets / 2, d]
    q_buckets = np.argmax(np.concatenate([rotated, -rotated], -1), -1)  # [h, rounds]
    q_norm = q / np.sqrt(np.mean(q**2, -1, keepdims=True) + 1e-6)
    heads, distant = [], False
    for h in range(H):
        same = (c.buckets[0, h, :, :12] == q_buckets[h][:, None]).any(0)
        kept = np.argsort(np.arange(12) + 12 * same)[-3:]
        distant |= set(kept.tolist()) != {9, 10, 11}
        logits = np.append(c.key[0, h, kept] @ q[h], q_norm[h] @ q[h] - 1e5 * np.sqrt(8)) / np.sqrt(8)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        heads.append(probs[:-1] @ c.value[0, h, kept] + probs[-1] * v[h])
    want = np.einsum("ehd,hd->e", p["out"]["kernel"], np.stack(heads)) + p["out"]["bias"]
    np.testing.assert_allclose(np.asarray(y)[0, 0], want, atol=1e-4, rtol=1e-4)
    assert distant  # some head keeps a same-bucket key older than the 3 most recent


def test_parameters_have_logical_axis_names():
    rules = {name for name, _ in axes.default_axis_rules()}
    x = _x(CHUNK)
    params = _shapes(_layer(), x)["params"]
    leaves = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)
    for leaf in leaves:
        assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= rules
    assert params["qv"]["kernel"].names == (axes.HEADS, axes.QKV, axes.KV, axes.EMBED)
    assert params["out"]["kernel"].names == (axes.EMBED, axes.HEADS, axes.KV)
    sparse = _shapes(_layer(weights_format="sparse"), x)["params"]
    for leaf in jax.tree.leaves(sparse, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned)):
        assert isinstance(leaf, nn.LogicallyPartitioned) and set(leaf.names) <= rules


def test_sparse_weights_format_has_the_sparse_qkv_parameter_tree():
    """§2.5b: the 'sparse' projections are SparseQKVAttention's, so a model trained with
    full sparse-QKV attention can be fine-tuned with LSH attention."""
    x = _x(CHUNK)
    lsh = nn.unbox(_shapes(_layer(weights_format="sparse"), x)["params"])
    dense = nn.unbox(_shapes(SparseQKVAttention(d_model=D, n_heads=H), x)["params"])
    assert jax.tree.map(jnp.shape, lsh) == jax.tree.map(jnp.shape, dense)


def test_gradients_reach_every_parameter_with_attention_dropout():
    layer = _layer(n_hashes=2, attention_dropout=0.2)
    x = _x(2 * CHUNK)
    params = _init(layer)["params"]

    def loss(p):
        y = layer.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
        return jnp.mean(y**2)

    grads = jax.jit(jax.grad(loss))(params)
    for g in jax.tree.leaves(nn.unbox(grads)):
        g = np.asarray(g)  # checked on the host: op by op each reduction compiles on its own
        assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_bad_configurations_are_config_errors():
    x = _x(CHUNK)
    with pytest.raises(ConfigError, match="even"):
        _shapes(_layer(n_buckets=5), x)
    with pytest.raises(ConfigError, match="causal"):
        _shapes(_layer(causal=False), x, decode=True, max_decode_length=8)
    with pytest.raises(ConfigError, match="n_chunks_after"):
        _shapes(_layer(n_chunks_after=1), x, decode=True, max_decode_length=8)
    assert bucket_factors(None, 64 * 128, 128) == (128,)
    assert bucket_factors(None, 512 * 128, 128) == (32, 32)  # factorised above 128, as the reference


native = pytest.mark.skipif(not native_kernels.available(), reason="terra's native kernels are not built")


def _sorted_chunks(seed, batch=2, heads=2, n_chunks=4, chunk=64, d=16):
    """Random sorted entries as lsh_attention hands them to its chunk attention: positions repeat
    across rounds, some keys are padding."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, n_chunks, chunk)
    # Cast on the host and normalised in one program: op by op each operation compiles on its own.
    q, k, v = (jnp.asarray(rng.normal(size=shape + (d,)).astype(np.float32)) for _ in range(3))
    k = jax.jit(lambda k: length_normalized(k) * d**-0.5)(k)
    positions = jnp.asarray(rng.integers(0, n_chunks * chunk // 2, size=shape).astype(np.int32))
    valid = jnp.asarray(rng.random(shape) > 0.1)
    return q, k, v, positions, valid


@native
@pytest.mark.parametrize(
    "before,after,causal,chunk",
    [(1, 0, True, 64), (1, 1, False, 64), (0, 0, True, 64), (2, 1, True, 64), (1, 0, True, 48)],
)
def test_native_chunk_attention_equals_its_xla_form(before, after, causal, chunk):
    """The native LSH chunk attention (each chunk against its adjacent ones, with the self, causal and
    padding masks) against the XLA form, outputs and logsumexps, in every instruction set; chunks of
    a multiple of 16 entries take the register tiles' narrower tails."""
    operands = _sorted_chunks(before * 3 + after, chunk=chunk)
    xla = functools.partial(attention_in_chunks, before=before, after=after, causal=causal)
    attend = jax.jit(lambda *a: lsh_chunk_attention(*a, before=before, after=after, causal=causal, unfused=xla))
    assert native_kernels.TARGETS["lsh_chunk_attention", "float32"] in attend.lower(*operands).as_text()
    want_out, want_lse = jax.jit(xla)(*operands)
    try:
        for isa in native_kernels.ISAS:  # read at run time: every variant this CPU can run
            native_kernels.use_isa(isa)
            out, lse = attend(*operands)
            np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=0, err_msg=native_kernels.isa())
            np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=0, err_msg=native_kernels.isa())
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


@native
def test_native_chunk_attention_gradient_is_the_xla_forms():
    q, k, v, positions, valid = _sorted_chunks(9)
    xla = functools.partial(attention_in_chunks, before=1, after=0, causal=True)
    weights = jnp.asarray(np.random.default_rng(10).normal(size=q.shape), jnp.float32)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v, positions, valid)[0] * weights)

    native_loss = loss(lambda *a: lsh_chunk_attention(*a, before=1, after=0, causal=True, unfused=xla))
    # Jitted: op by op each operation of the backward pass compiles on its own.
    native_grads, xla_grads = (jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v) for f in (native_loss, loss(xla)))
    for fast, slow in zip(native_grads, xla_grads):
        np.testing.assert_allclose(fast, slow, atol=1e-5, rtol=1e-5)


@native
def test_deterministic_lsh_layer_runs_the_native_chunk_attention_with_the_same_outputs():
    """A deterministic LSH forward (a prefill, an evaluation) with heads of 16 and chunks of 64 runs
    the native chunk attention; with the kernels off, the XLA form: the same outputs."""
    layer = LSHSelfAttention(d_model=32, n_heads=2, chunk_len=64, n_hashes=2, causal=True)
    x = jax.random.normal(jax.random.key(11), (1, 200, 32))
    params = _filled_params(layer, x, seed=12)
    native_forward = jax.jit(lambda p, x: layer.apply(p, x))
    assert "terra_lsh_chunk_attention" in native_forward.lower(params, x).as_text()
    with native_kernels.disabled():
        xla_forward = jax.jit(lambda p, x: layer.apply(p, x))
        assert "terra_lsh_chunk_attention" not in xla_forward.lower(params, x).as_text()
        want = xla_forward(params, x)
    np.testing.assert_allclose(native_forward(params, x), want, atol=2e-6, rtol=1e-5)


@native
def test_native_chunk_attention_refuses_operands_that_disagree():
    q, k, v, positions, valid = _sorted_chunks(13)
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(native_kernels.lsh_chunk_attention(q, k, v, positions[..., :32], valid, 1, 0, True))
    with pytest.raises(Exception, match="at most as many adjacent chunks"):
        jax.block_until_ready(native_kernels.lsh_chunk_attention(q, k, v, positions, valid, 4, 0, True))


@native
@pytest.mark.parametrize("factors,rounds,d", [((8,), 2, 16), ((4, 6), 3, 8), ((128,), 2, 64), ((2,), 1, 5)])
def test_native_hash_equals_its_xla_form(factors, rounds, d):
    """The native LSH hash against the XLA form's buckets, exactly, in every instruction set: small
    integer vectors and rotations make every product exact, so ties (zero vectors, repeated values)
    and NaNs test the rule itself (the first index of the maximum of ``[xR, -xR]``, NaN the
    maximum); widths that are not whole vectors take the padded columns."""
    rng = np.random.default_rng(len(factors) * 10 + rounds)
    batch, heads, length = 2, 3, 70
    vecs = rng.integers(-2, 3, size=(batch, heads, length, d)).astype(np.float32)
    vecs[0, 0, :5] = 0.0  # every rotated value ties
    vecs[1, 2, 7, 0] = np.nan
    rotations = jnp.asarray(rng.integers(-3, 4, size=(heads, d, rounds, sum(factors) // 2)), jnp.float32)
    vecs = jnp.asarray(vecs)
    xla = jax.jit(lambda v, r: _buckets(jnp.einsum("bhld,hdrk->bhrlk", v, r), factors))
    hashed = jax.jit(lambda v, r: hash_vectors(v, r, factors))
    assert native_kernels.TARGETS["lsh_hash", "float32"] in hashed.lower(vecs, rotations).as_text()
    want = np.asarray(xla(vecs, rotations))
    assert len(np.unique(want)) > 1
    try:
        for isa in native_kernels.ISAS:
            native_kernels.use_isa(isa)
            np.testing.assert_array_equal(hashed(vecs, rotations), want, err_msg=native_kernels.isa())
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


@native
def test_native_hash_refuses_bad_factors_and_shapes():
    vecs = jnp.zeros((1, 2, 8, 4), jnp.float32)
    rotations = jnp.zeros((2, 4, 1, 2), jnp.float32)
    with pytest.raises(Exception, match="bucket factors must be even"):
        jax.block_until_ready(native_kernels.lsh_hash(vecs, jnp.zeros((2, 4, 1, 1)), (3,)))
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(native_kernels.lsh_hash(vecs, jnp.zeros((3, 4, 1, 2)), (4,)))
    with pytest.raises(Exception, match="1 to 4 bucket factors"):
        jax.block_until_ready(native_kernels.lsh_hash(vecs, rotations, (2, 2, 2, 2, 2)))

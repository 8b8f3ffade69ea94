"""The native products of the sparse layers' narrow weights (terra/backends/native_kernels.py): the
input-major product (multiplicative layers, convolutions, the controller's up-projection, with one
scale per input row or per input and group of outputs) and the gathered-row products (the rows of
W1 and W2 a sparse feed-forward layer selects). Each equals the float64 product of the stored
weights in every instruction set this CPU has, on odd shapes and in the threads' split, and is
chosen by the primitives of ``terra.backends`` only where it applies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from terra import backends
from terra.backends import native_kernels
from terra.quantization import dequantize

from helpers import quantize_for_setup

# These tests read optimized programs or compare hand-written kernels with XLA's optimized
# products (conftest.optimized_compile).
pytestmark = pytest.mark.usefixtures("optimized_compile", "native_kernels_on")

KINDS = ("int8", "bfloat16")


def _use_isa(isa):
    native_kernels.use_isa(isa)
    # A CPU without ``isa`` runs the best set below it, and the test checks that one.
    assert native_kernels.ISAS.index(native_kernels.isa()) <= native_kernels.ISAS.index(isa)


def _normal(shape, seed):
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    if len(shape) > 1:
        w[..., 0] *= 40  # an outlier per row, as trained weights have
    return jnp.asarray(w)


def _stored(q) -> np.ndarray:
    """The float64 weights ``q`` stores (the same shape)."""
    values = np.asarray(q.values)
    if q.kind == "int8":
        return values.astype(np.float64) * np.asarray(q.scale, np.float64)[..., None]
    return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _assert_within_rounding(got, want, size):
    """``got`` equals the float64 ``want`` within 1e-6 of ``size``, the sum of the absolute terms of
    each output: what float32 rounding in any order leaves, so one wrong weight, scale, row or tail
    element fails."""
    worst = np.max(np.abs(np.asarray(got, np.float64) - want) / (1e-6 * size + 1e-30))
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


@functools.partial(jax.jit, static_argnums=3)
def _input_major_products(xs, values, scale, kind):
    """The input-major kernel's product of each of ``xs`` with the stored kernel (flattened to
    ``[in, out]``): one program for them all, where op by op each call and shape compiles its own;
    the instruction set is read when it runs."""
    n_in = values.shape[0]
    scale = scale.reshape(n_in, -1) if kind == "int8" else scale
    return [native_kernels.input_major(x, values.reshape(n_in, -1), scale, kind) for x in xs]


def _check_input_major(xs, q):
    """Each of ``xs`` times the stored kernel ``q``."""
    w = _stored(q).reshape(q.values.shape[0], -1)
    for x, got in zip(xs, _input_major_products(xs, q.values, q.scale, q.kind)):
        x64 = np.asarray(x, np.float64)
        _assert_within_rounding(got, x64 @ w, np.abs(x64) @ np.abs(w))


# [in, out] kernels (a scale per input row) and [in, groups, out / groups] ones (a scale per input
# and group): widths below, at and past a vector of 16 and a tile of 32, groups not a multiple of 16,
# and inputs past one and several of the 64 that many rows widen at a time (and below and past the 32
# a tile asks for ahead).
INPUT_MAJOR_KERNELS = [
    (1, 1),
    (17, 15),
    (3, 16),
    (300, 33),
    (5, 70),
    (40, 144),
    (5, 3, 19),
    (32, 8, 16),
    (7, 2, 40),
    (130, 3, 40),
]


@functools.cache
def _input_major_weights(kind):
    """The kernels above stored as ``kind``, shared by the instruction sets' tests."""
    return [quantize_for_setup(_normal(shape, index), kind) for index, shape in enumerate(INPUT_MAJOR_KERNELS)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", native_kernels.ISAS)
@pytest.mark.slow
def test_input_major_kernel_equals_the_stored_product_on_odd_shapes_in_every_instruction_set(kind, isa):
    # 1..7 rows leave every remainder of the 6 rows a pass takes; past 6 rows the widened blocks are
    # multiplied in register tiles of 8 (AVX-512), 3 (AVX2) or 2 rows, in chunks of 24 rows: 7, 29
    # and 64 leave remainders of each; 64 is a multiplicative layer's S.
    _use_isa(isa)
    for shape, q in zip(INPUT_MAJOR_KERNELS, _input_major_weights(kind)):
        _check_input_major([_normal((rows, shape[0]), 100 + rows) for rows in (1, 5, 7, 29, 64)], q)


@pytest.mark.parametrize("kind", KINDS)
def test_a_large_input_major_product_split_between_threads_equals_the_stored_product(kind):
    # 2048 x 300 weights and 8 or 64 rows (chunks of rows and tiles of outputs): above the work run
    # on the calling thread alone.
    q = quantize_for_setup(_normal((2048, 300), 0), kind)
    _check_input_major([_normal((8, 2048), 1), _normal((64, 2048), 4)], q)
    grouped = quantize_for_setup(_normal((64, 64, 64), 2), kind)  # the controller's layout: 4096 outputs
    _check_input_major([_normal((1, 64), 3)], grouped)


def _check_gathered(kind, n, d, k, batch, seed=0):
    q = quantize_for_setup(_normal((n, d), seed), kind)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, n, size=(batch, k)).astype(np.int32)
    w = _stored(q)[rows]  # [batch, k, d]
    x = _normal((batch, d), seed + 1)
    x64 = np.asarray(x, np.float64)
    h = _normal((batch, k), seed + 2)
    h64 = np.asarray(h, np.float64)
    dot, summed = _gathered_products(x, h, q.values, q.scale, jnp.asarray(rows), kind)
    _assert_within_rounding(dot, np.einsum("bd,bkd->bk", x64, w), np.einsum("bd,bkd->bk", np.abs(x64), np.abs(w)))
    _assert_within_rounding(summed, np.einsum("bk,bkd->bd", h64, w), np.einsum("bk,bkd->bd", np.abs(h64), np.abs(w)))


@functools.partial(jax.jit, static_argnums=5)
def _gathered_products(x, h, values, scale, rows, kind):
    """Both gathered-row kernels in one program, where op by op each call and shape compiles its
    own; the instruction set is read when it runs."""
    return (
        native_kernels.gathered_dot(x, values, scale, rows, kind),
        native_kernels.gathered_sum(h, values, scale, rows, kind),
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", native_kernels.ISAS)
def test_gathered_row_kernels_equal_the_stored_products_on_odd_shapes_in_every_instruction_set(kind, isa):
    # Rows shorter than a vector, with a tail, and repeated selections; fewer and more selected rows
    # than the kernels ask for ahead (8); up to MAX_ROWS rows of x.
    _use_isa(isa)
    for n, d, k, batch in ((1, 1, 1, 1), (50, 17, 7, 3), (9, 1029, 5, 8), (64, 40, 64, 2), (30, 40, 3, 64)):
        _check_gathered(kind, n, d, k, batch)


@pytest.mark.parametrize("kind", KINDS)
def test_large_gathered_row_products_split_between_threads_equal_the_stored_products(kind):
    # 256 rows of 2048 selected from 4096, as a sparse FF layer's blocks: above the single-thread size.
    _check_gathered(kind, 4096, 2048, 256, 1, seed=5)
    _check_gathered(kind, 512, 1000, 64, 4, seed=6)


def test_gathered_rows_out_of_range_are_clipped_as_the_xla_gather_clips_them():
    q = quantize_for_setup(_normal((6, 20), 0), "int8")
    rows = jnp.asarray([[-3, 0, 5, 9]], jnp.int32)
    x, h = _normal((1, 20), 1), _normal((1, 4), 2)
    with native_kernels.disabled():
        want_dot = jax.jit(backends.gathered_rows_product)(x, q, rows)
        want_sum = jax.jit(backends.gathered_rows_sum)(h, q, rows)
    np.testing.assert_allclose(native_kernels.gathered_dot(x, q.values, q.scale, rows, "int8"), want_dot, rtol=1e-6)
    np.testing.assert_allclose(native_kernels.gathered_sum(h, q.values, q.scale, rows, "int8"), want_sum, rtol=1e-6)


def _jaxpr(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def test_the_products_use_the_kernels_only_where_they_apply():
    q = quantize_for_setup(_normal((24, 16), 0), "int8")  # input-major [in, out]
    assert "terra_input_major" in _jaxpr(backends.input_major_product, jnp.ones((4, 64, 24)), q)  # 256 rows
    assert "terra_input_major" not in _jaxpr(backends.input_major_product, jnp.ones((257, 24)), q)
    assert "terra_input_major" not in _jaxpr(backends.input_major_product, jnp.ones((2, 24), jnp.bfloat16), q)
    assert "terra_input_major" not in _jaxpr(backends.input_major_product, jnp.ones((2, 24)), dequantize(q))
    table = quantize_for_setup(_normal((40, 16), 1), "bfloat16")
    rows = jnp.zeros((8, 1, 5), jnp.int32)
    for fn, width in ((backends.gathered_rows_product, 16), (backends.gathered_rows_sum, 5)):
        assert "terra_gathered" in _jaxpr(fn, jnp.ones((8, 1, width)), table, rows)  # 8 rows of x
        most = native_kernels.MAX_ROWS
        assert "terra_gathered" in _jaxpr(fn, jnp.ones((most, width)), table, jnp.zeros((most, 5), jnp.int32))
        assert "terra_gathered" not in _jaxpr(
            fn, jnp.ones((most + 1, width)), table, jnp.zeros((most + 1, 5), jnp.int32)
        )
        assert "terra_gathered" not in _jaxpr(fn, jnp.ones((8, 1, width)), dequantize(table), rows)


@pytest.mark.parametrize("kind", KINDS)
def test_the_products_equal_their_xla_paths_inside_a_while_loop_as_decoding_does(kind):
    # A sparse FF step's shape of work: the controller's grouped up-projection chooses rows, W1's
    # selected rows are dotted with x and W2's summed, three dependent steps in a while loop.
    up = quantize_for_setup(_normal((4, 3, 8), 0), kind)  # [d_lowrank, blocks, N]
    down = _normal((16, 4), 1)
    wi, wo = (quantize_for_setup(_normal((24, 16), seed), kind) for seed in (2, 3))

    def decode(x):
        def step(carry):
            i, x = carry
            logits = backends.input_major_product(x @ down, up).reshape(x.shape[0], 3, 8)
            rows = jnp.argmax(logits, axis=-1) + jnp.arange(3) * 8
            mid = jax.nn.relu(backends.gathered_rows_product(x, wi, rows))
            return i + 1, x + 0.1 * backends.gathered_rows_sum(mid, wo, rows)

        return lax.while_loop(lambda c: c[0] < 3, step, (0, x))[1]

    x = _normal((2, 16), 4)
    text = _jaxpr(decode, x)
    assert all(name in text for name in ("terra_input_major", "terra_gathered_dot", "terra_gathered_sum"))
    got = jax.jit(decode)(x)
    with native_kernels.disabled():
        want = jax.jit(lambda x: decode(x))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_products_reject_operands_whose_shapes_disagree_naming_them():
    q = quantize_for_setup(_normal((40, 24), 0), "int8")  # input-major [in 40, out 24]; output-major [out 40, in 24]
    with pytest.raises(Exception, match="values \\[in, out\\] and y \\[B, out\\] disagree"):
        native_kernels.input_major(_normal((2, 41), 1), q.values, q.scale, "int8").block_until_ready()
    with pytest.raises(Exception, match="at most 256 rows"):
        native_kernels.input_major(_normal((257, 40), 1), q.values, q.scale, "int8").block_until_ready()
    with pytest.raises(Exception, match="values \\[out, in\\] and y \\[B, out\\] disagree"):
        native_kernels.output_major(_normal((2, 40), 1), q.values, q.scale, "int8").block_until_ready()
    with pytest.raises(Exception, match="scale must be"):
        native_kernels.output_major(_normal((2, 24), 1), q.values, q.scale[:39], "int8").block_until_ready()
    np.testing.assert_allclose(  # the same operands with their shapes right
        native_kernels.output_major(_normal((2, 24), 1), q.values, q.scale, "int8"),
        np.asarray(_normal((2, 24), 1), np.float64) @ _stored(q).T,
        rtol=1e-5,
        atol=1e-5,
    )

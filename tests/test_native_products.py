"""The native products (terra/backends/native_kernels.py and its C++ library): built and loaded
wherever a compiler is, equal to the XLA product of the same stored weights on odd shapes in every
instruction set this CPU has (narrow weights, and float32 weights for a batch of a few rows),
chosen by ``output_major_product`` only where they apply, and replaced by the XLA path, with one
warning, when the library cannot be loaded."""

import functools
import importlib.machinery
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from terra import backends
from terra.backends import native_kernels, xla
from terra.quantization import QuantizedTensor, dequantize, quantize

from helpers import quantize_for_setup, xla_optimizations

# These tests read optimized programs or compare hand-written kernels with XLA's optimized
# products (conftest.optimized_compile).
pytestmark = pytest.mark.usefixtures("optimized_compile")

KINDS = ("int8", "bfloat16")


@pytest.fixture(autouse=True)
def kernels_switched_on(monkeypatch):
    """The kernels as a default install has them, whatever ``TERRA_NATIVE_KERNELS`` the shell sets
    (the switch is honoured again after each test)."""
    switched = native_kernels.ENV_SWITCH in os.environ
    monkeypatch.delenv(native_kernels.ENV_SWITCH, raising=False)
    if switched:
        native_kernels._library.cache_clear()
    yield
    if switched:
        native_kernels._library.cache_clear()


@pytest.fixture
def reloaded():
    """The library state loaded afresh for the test, and again (the real library) after it."""
    native_kernels._library.cache_clear()
    yield
    native_kernels._library.cache_clear()


def _weights(shape, seed=0):
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w[..., 0] *= 40  # an outlier per row, as trained weights have
    return jnp.asarray(w)


def _inputs(rows, n_in, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, n_in)).astype(np.float32))


ODD_SHAPES = [(n_out, n_in, rows) for n_out in (1, 7, 33, 1000) for n_in in (1, 3, 17, 1025) for rows in (1, 3)]


@functools.cache
def _odd_cases(kind):
    """``[(x, q, the XLA product)]`` for every odd shape, shared by the instruction sets' tests
    (quantized and multiplied by XLA in one compiled function each: one per shape takes seconds)."""
    inputs = [_inputs(rows, n_in) for _, n_in, rows in ODD_SHAPES]
    weights = [_weights((n_out, n_in)) for n_out, n_in, _ in ODD_SHAPES]
    with xla_optimizations(False):  # set-up, not under test
        narrow = jax.jit(lambda ws: [quantize(w, kind) for w in ws])(weights)
    with native_kernels.disabled():
        xla = jax.jit(lambda xs, qs: [backends.output_major_product(x, q) for x, q in zip(xs, qs)])(inputs, narrow)
    return list(zip(inputs, narrow, xla))


def _xla(x, q):
    """The XLA product of the same stored weights (the kernels off while it is traced)."""
    with native_kernels.disabled():
        return jax.jit(lambda x, q: backends.output_major_product(x, q))(x, q)


def _assert_close(got, x, q, want=None):
    """``got`` equals ``want`` (by default the float64 product of the stored weights ``q``, narrow
    or float32) within 1e-6 of the size of each sum, ``sum_i |x_i w_i|``: what float32 rounding in
    any summation order leaves, so a wrong weight, scale or tail element fails."""
    values = np.asarray(q.values if isinstance(q, QuantizedTensor) else q)
    if not isinstance(q, QuantizedTensor):
        w = values.astype(np.float64)
    elif q.kind == "int8":
        w = values.astype(np.float64) * np.asarray(q.scale, np.float64)[..., None]
    else:  # bfloat16 bits are the high half of a float32
        w = (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    w = w.reshape(values.shape[0], -1)
    x = np.asarray(x, np.float64).reshape(-1, w.shape[1])
    want = x @ w.T if want is None else np.asarray(want, np.float64).reshape(x.shape[0], w.shape[0])
    got = np.asarray(got).reshape(x.shape[0], w.shape[0])
    bound = 1e-6 * (np.abs(x) @ np.abs(w).T) + 1e-30
    worst = np.max(np.abs(got - want) / bound)
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


def _product():
    """A jitted ``output_major_product`` of its own: jit's trace cache is keyed by the function, and
    the path is chosen when tracing, so each test traces its products afresh."""
    return jax.jit(lambda x, q: backends.output_major_product(x, q))


@functools.cache
def _odd_product():
    """The odd shapes' kernel products, traced and compiled once for every instruction set (the
    kernels read the set at run time)."""
    return _product()


def _uses_kernel(x, q, target="terra_output_major") -> bool:
    return target in str(jax.make_jaxpr(lambda x, q: backends.output_major_product(x, q))(x, q))


@jax.jit
def _kernel_products(xs, qs):
    """The output-major kernel's product of each ``x`` and stored ``q`` (narrow, or float32
    weights): one program for them all,
    where op by op each call and shape compiles its own; the instruction set is read when it runs."""
    return [
        native_kernels.output_major(x, q.values, q.scale, q.kind)
        if isinstance(q, QuantizedTensor)
        else native_kernels.output_major(x, q, None, "float32")
        for x, q in zip(xs, qs)
    ]


def _use_isa(isa):
    if not native_kernels.available():
        pytest.fail(f"the native kernels are not available: {native_kernels.REBUILD}")
    native_kernels.use_isa(isa)
    # A CPU without ``isa`` runs the best set below it, and the test checks that one.
    assert native_kernels.ISAS.index(native_kernels.isa()) <= native_kernels.ISAS.index(isa)


def test_the_kernels_are_built_and_load_where_there_is_a_compiler(reloaded):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        # The install skips the kernels without a compiler: no library, and the XLA path is used.
        with pytest.warns(RuntimeWarning, match="not built"):
            assert native_kernels.library_path() is None and not native_kernels.available()
        return
    assert native_kernels.library_path() is not None, f"not built: {native_kernels.REBUILD}"
    assert native_kernels.available()
    assert native_kernels.isa() in native_kernels.ISAS


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", native_kernels.ISAS)
@pytest.mark.slow
def test_kernel_equals_the_xla_product_on_odd_shapes_in_every_instruction_set(kind, isa):
    _use_isa(isa)
    product = _odd_product()
    try:
        for x, q, xla in _odd_cases(kind):
            _assert_close(product(x, q), x, q, want=xla)
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


@pytest.mark.parametrize("isa", native_kernels.ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 64])
@pytest.mark.slow
def test_every_row_count_with_remainders_of_rows_inputs_and_threads(rows, isa):
    # The kernels read 4 (or 2) output rows at a time: 3, 37 and 301 outputs leave a remainder, in
    # the last chunk of the threads' split for 301 x 1024 (above the size run on one thread);
    # 4100 and 1029 inputs leave a tail shorter than a vector. Past 8 rows of x the kernel makes
    # passes of 8 over each chunk of weights: 13 rows leave a pass of 5, 64 (MAX_ROWS) none.
    _use_isa(isa)
    try:
        shapes = [(n_out, n_in) for n_out, n_in in ((3, 4100), (37, 1029), (301, 1024)) for _ in KINDS]
        xs = [_inputs(rows, n_in) for _, n_in in shapes]
        qs = [quantize_for_setup(_weights(shape), kind) for shape, kind in zip(shapes, KINDS * 3)]
        for x, q, got in zip(xs, qs, _kernel_products(xs, qs)):
            _assert_close(got, x, q)
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


def test_a_large_product_split_between_threads_equals_the_xla_product():
    # 2 MiB of int8 weights: above the size the kernel runs on the calling thread alone.
    q = quantize_for_setup(_weights((2048, 1024)), "int8")
    x = _inputs(2, 1024)
    assert _uses_kernel(x, q)
    _assert_close(_product()(x, q), x, q, want=_xla(x, q))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", native_kernels.ISAS)
def test_a_kernel_with_several_input_axes_uses_one_scale_per_head(kind, isa):
    # [out, heads, d_head]: int8 keeps a scale per (output, head), which the kernel applies per group
    # of d_head inputs; short rows and long (interleaved) ones, groups not a multiple of a vector.
    _use_isa(isa)
    try:
        for shape in ((33, 3, 17), (9, 4, 1100)):
            q = quantize_for_setup(_weights(shape), kind)
            x = _inputs(2, shape[1] * shape[2]).reshape(2, 1, -1)
            assert _uses_kernel(x, q)
            got = _product()(x, q)
            assert got.shape == (2, 1, shape[0])
            _assert_close(got, x, q, want=_xla(x, q))
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_elements", [1 << 20, 5 * 24])  # one block; 5-row blocks and a 2-row tail
@pytest.mark.slow
def test_the_xla_path_equals_the_stored_product_in_blocks_with_a_tail(kind, block_elements, monkeypatch):
    # The path the kernels fall back to, and the one for more than MAX_ROWS rows.
    monkeypatch.setattr(xla, "BLOCK_ELEMENTS", block_elements)
    for shape in ((37, 24), (37, 2, 12)):
        q = quantize_for_setup(_weights(shape), kind)
        for x in (_inputs(3, 24), _inputs(12, 24).reshape(3, 4, 24)):
            _assert_close(_xla(x, q), x, q)


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_runs_under_jit_inside_a_while_loop_as_decoding_does(kind):
    q = quantize_for_setup(_weights((40, 24)), kind)
    x = _inputs(3, 24)

    def decode(q, x):  # three dependent steps, the output feeding the next input
        def step(carry):
            i, x = carry
            return i + 1, x + 1e-3 * backends.output_major_product(x, q)[:, :24]

        return lax.while_loop(lambda c: c[0] < 3, step, (0, x))[1]

    assert "terra_output_major" in str(jax.make_jaxpr(decode)(q, x))
    got = jax.jit(decode)(q, x)
    with native_kernels.disabled():
        want = jax.jit(lambda q, x: decode(q, x))(q, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_the_kernel_is_used_only_where_it_applies():
    q = quantize_for_setup(_weights((16, 8)), "int8")
    assert _uses_kernel(jnp.ones((2, 4, 8)), q)  # 8 rows
    assert _uses_kernel(jnp.ones((4, 16, 8)), q)  # MAX_ROWS rows: a batch of 64 decoding
    assert not _uses_kernel(jnp.ones((65, 8)), q)  # beyond MAX_ROWS
    assert not _uses_kernel(jnp.ones((2, 8), jnp.bfloat16), q)
    assert not _uses_kernel(jnp.ones((1, 8)), dequantize(q))  # a float32 kernel and one row
    _assert_close(_product()(_inputs(65, 8), q), _inputs(65, 8), q)  # the XLA path


def _uses_float_kernel(x, w) -> bool:
    return _uses_kernel(x, w, target="terra_output_major_f32")


def test_float32_weights_take_the_kernel_for_a_batch_of_a_few_rows():
    # One row stays XLA's product (it streams the weights at the memory's pace); 2 to
    # MAX_FLOAT_ROWS take the kernel, which reads them once for all rows; more, XLA's blocked product.
    w = _weights((16, 8))
    assert not _uses_float_kernel(jnp.ones((1, 1, 8)), w)
    assert _uses_float_kernel(jnp.ones((2, 1, 8)), w)
    assert _uses_float_kernel(jnp.ones((4, 4, 8)), w)  # MAX_FLOAT_ROWS
    assert not _uses_float_kernel(jnp.ones((17, 8)), w)
    # Past FLOAT_ROWS_ANY_WIDTH rows, only while x holds at most MAX_FLOAT_ACTIVATIONS values.
    wide = jnp.ones((2, native_kernels.MAX_FLOAT_ACTIVATIONS // 4))
    assert _uses_float_kernel(jnp.ones((native_kernels.FLOAT_ROWS_ANY_WIDTH, 4 * wide.shape[1])), jnp.tile(wide, 4))
    assert not _uses_float_kernel(jnp.ones((5, wide.shape[1])), wide)
    assert _uses_float_kernel(jnp.ones((5, wide.shape[1] // 2)), wide[:, : wide.shape[1] // 2])
    assert not _uses_float_kernel(jnp.ones((4, 8), jnp.bfloat16), w)
    with native_kernels.disabled():
        assert not _uses_float_kernel(jnp.ones((4, 8)), w)


@pytest.mark.parametrize("isa", native_kernels.ISAS)
def test_the_float32_kernel_equals_the_product_for_every_row_count_in_every_instruction_set(isa):
    # 3, 37 and 301 outputs leave a remainder of the rows read together (301 x 1024 is split between
    # threads); 4100 and 1029 inputs a tail shorter than a vector; 13 rows of x a pass of 5.
    _use_isa(isa)
    try:
        shapes = [(3, 4100), (37, 1029), (301, 1024)]
        ws = [_weights(shape, seed=i) for i, shape in enumerate(shapes)]
        for rows in (2, 3, 8, 13, 16):
            xs = [_inputs(rows, n_in) for _, n_in in shapes]
            for x, w, got in zip(xs, ws, _kernel_products(xs, ws)):
                _assert_close(got, x, w)
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


def test_the_float32_kernel_refuses_operands_that_disagree_in_one_line():
    # As the narrow kernels: x [B, in] against values [out, in], at most MAX_ROWS rows, checked before
    # anything is read.
    product = jax.jit(lambda x, w: native_kernels.output_major(x, w, None, "float32"))
    cases = [
        ((3, 8), (5, 9), "output-major product: x \\[B, in\\], values \\[out, in\\] and y \\[B, out\\] disagree"),
        ((native_kernels.MAX_ROWS + 1, 8), (5, 8), "output-major product: at most 64 rows of x"),
    ]
    for x_shape, w_shape, message in cases:
        with pytest.raises(Exception, match=message) as raised:
            product(jnp.ones(x_shape), jnp.ones(w_shape))
        assert len(str(raised.value).splitlines()) == 1


def test_the_float32_kernel_is_differentiated_as_the_xla_product():
    # A training step of a few rows runs the kernel forward; its gradients are XLA's product's.
    w, x = _inputs(24, 40, seed=0) / 6, _inputs(6, 40)

    def loss(x, w):
        return 0.5 * jnp.sum(backends.output_major_product(x, w) ** 2)

    assert _uses_float_kernel(x, w)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    with native_kernels.disabled():
        want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


def test_vmap_over_the_rows_gives_the_unbatched_products():
    q = quantize_for_setup(_weights((21, 10)), "int8")
    xs = _inputs(12, 10).reshape(4, 3, 10)
    assert "terra_output_major" in str(jax.make_jaxpr(jax.vmap(lambda x: backends.output_major_product(x, q)))(xs))
    got = jax.jit(jax.vmap(lambda x: backends.output_major_product(x, q)))(xs)
    _assert_close(got, xs, q, want=_xla(xs, q))


def test_the_switch_turns_the_kernels_off_without_a_warning(reloaded, monkeypatch):
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "0")
    q = quantize_for_setup(_weights((33, 17)), "int8")
    x = _inputs(1, 17)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native_kernels.available()
        assert not _uses_kernel(x, q)
        got = _product()(x, q)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_xla(x, q)))


@pytest.mark.parametrize("broken", [False, True], ids=["missing", "unloadable"])
def test_a_library_that_cannot_be_loaded_falls_back_with_one_warning(broken, reloaded, monkeypatch, tmp_path):
    monkeypatch.setattr(native_kernels, "LIBRARY_DIR", str(tmp_path))
    if broken:  # a file where the library should be that is not one
        (tmp_path / (native_kernels.LIBRARY_STEM + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not ELF")
    q = quantize_for_setup(_weights((7, 3)), "bfloat16")
    x = _inputs(3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert not native_kernels.available()
            got = _product()(x, q)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert ("could not be loaded" if broken else "not built") in message
    assert "XLA" in message and "make install" in message and native_kernels.ENV_SWITCH in message
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_xla(x, q)))


@pytest.mark.slow
def test_the_products_benchmark_times_every_path_streamed_and_in_cache(monkeypatch):
    """``terra-bench products``: one row per shape and path, bytes at the stored width, and the
    in-cache rows (the arithmetic rate) held to no memory floor."""
    from terra.benchmarks import quantized_products

    # The fewest copies and loop calls that still take both timing paths (a chain of products over
    # several copies, a loop over one): 64 copies and 1000 calls time a product, not the table.
    monkeypatch.setattr(quantized_products, "MAX_COPIES", 2)
    monkeypatch.setattr(quantized_products, "LOOP_CALLS", 10)
    shapes = (("streamed", 64, 96, False), ("in cache", 64, 32, True))
    # Two rows: a batch, where float32 weights take their kernel too.
    results, bandwidth = quantized_products.measure(rows=2, repeats=1, shapes=shapes, bandwidth=10e9)
    paths = [name for name, _, native in quantized_products.VARIANTS if native_kernels.available() or not native]
    assert [(r["shape_name"], r["variant"]) for r in results] == [(s[0], p) for s in shapes for p in paths]
    assert "kernel float32" not in [name for name, _, _ in quantized_products.timed_variants(1, 64)]
    by = {(r["shape_name"], r["variant"]): r for r in results}
    assert by["streamed", "float32"]["bytes"] == by["streamed", "kernel float32"]["bytes"] == 64 * 96 * 4
    assert by["streamed", "XLA int8"]["bytes"] == 64 * 96 + 96 * 4  # values and one scale per row
    assert by["streamed", "XLA bfloat16"]["bytes"] == 64 * 96 * 2 + 4  # and its scalar scale of 1
    for r in results:
        assert r["seconds"] > 0 and (r["over_floor"] is None) == (r["shape_name"] == "in cache")
        assert r["speedup"] == pytest.approx(by[r["shape_name"], "float32"]["seconds"] / r["seconds"])
    table = quantized_products.format_table(results, bandwidth)
    assert len(table.splitlines()) == 4 + len(results) and "in cache" in table

"""The fused native decode steps of the sparse layers (terra/backends/cpu.py over
terra/backends/native_kernels.py): a sparse feed-forward layer (controller, block choice, the
selected rows of W1 and W2) and a sparse QKV layer's projections (multiplicative layer, convolution
window, convolutions) each in one call. Each equals the same layer computed product by product, on
odd shapes, in every instruction set, in the threads' split and inside the generation loop, and the
decode step of a narrow model uses them."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import native_kernels
from terra.gin_config import parsing
from terra.layers import SparseFeedForward, SparseQKVAttention, SparseQueryCrossAttention

from cheap_init_prng import init_key
from helpers import quantize_for_setup, quantize_params_for_setup, xla_optimizations

# The fused and the product-by-product paths both call native kernels, whatever XLA's
# optimization level (conftest.fast_compile); the one optimized program read here is compiled with
# XLA's optimizations on, as decoding compiles it.
pytestmark = pytest.mark.usefixtures("fast_compile", "native_kernels_on")

KINDS = ("int8", "bfloat16")


def _use_isa(isa):
    native_kernels.use_isa(isa)
    assert native_kernels.ISAS.index(native_kernels.isa()) <= native_kernels.ISAS.index(isa)


def _assert_close(got, want):
    """Equal within float32 rounding of sums of a few hundred terms (the fused and unfused calls
    group rows differently in a few cases, never the order of a sum)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(np.abs(want)))))


def _targets(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


# --- sparse feed-forward -------------------------------------------------------------------------

# (d_model, d_ff, N): widths below, at and past a vector; 4 rows of x; C1, C2 and the rows together
# past the size split between threads (320 KiB of int8).
FEED_FORWARD_SHAPES = [(40, 120, 8), (17, 96, 32), (1024, 2048, 32)]


@functools.cache
def _float_feed_forward(d_model, d_ff, n_units):
    """The layer and its float32 parameters, shared by both stores."""
    layer = SparseFeedForward(d_model=d_model, d_ff=d_ff, ff_sparsity=n_units)
    x = jnp.ones((1, 1, d_model))
    params = nn.unbox(jax.jit(layer.init)(init_key(0), x)["params"])
    # A controller bias large enough that the choice depends on it as well.
    params["controller_bias"] = jax.random.normal(jax.random.key(1), params["controller_bias"].shape)
    return layer, params


@functools.cache
def _feed_forward(d_model, d_ff, n_units, kind):
    layer, params = _float_feed_forward(d_model, d_ff, n_units)
    return layer, quantize_params_for_setup(params, kind)


def _feed_forward_step(layer, narrow, x):
    y, state = layer.apply({"params": narrow}, x, decode=True, mutable=["intermediates"])
    return y, state["intermediates"]["indices"][0]


def _traced_feed_forward_step(layer, narrow, x) -> jax.stages.Traced:
    """The decode step traced anew: jit's trace cache is keyed by the function (a new partial
    each time), and the fused or unfused path is chosen when tracing."""
    return jax.jit(functools.partial(_feed_forward_step, layer)).trace(narrow, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", FEED_FORWARD_SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.slow
def test_fused_sparse_feed_forward_equals_the_layer_product_by_product(kind, shape, rows):
    layer, narrow = _feed_forward(*shape, kind)
    x = jax.random.normal(jax.random.key(rows), (rows, 1, shape[0]))
    # Each path traced once (the path is chosen when tracing): its jaxpr is read and its program
    # compiled from the same trace.
    with native_kernels.unfused():
        unfused = _traced_feed_forward_step(layer, narrow, x)
        assert "terra_sparse_feed_forward" not in str(unfused.jaxpr)
        want_y, want_indices = unfused.lower().compile()(narrow, x)
    fused = _traced_feed_forward_step(layer, narrow, x)
    assert native_kernels.TARGETS["sparse_feed_forward", kind] in str(fused.jaxpr)
    step = fused.lower().compile()
    for isa in native_kernels.ISAS:
        _use_isa(isa)
        y, indices = step(narrow, x)  # the instruction set is read at run time
        np.testing.assert_array_equal(indices, want_indices)
        _assert_close(y, want_y)


@pytest.mark.slow
def test_fused_sparse_feed_forward_applies_only_to_narrow_weights_in_decoding():
    layer, narrow = _feed_forward(40, 120, 8, "int8")
    x = jnp.ones((2, 1, 40))
    float_params = _float_feed_forward(40, 120, 8)[1]
    assert "terra_sparse_feed_forward" not in _targets(functools.partial(_feed_forward_step, layer), float_params, x)
    masked = SparseFeedForward(d_model=40, d_ff=120, ff_sparsity=8, gathered_inference=False)
    assert "terra_sparse_feed_forward" not in _targets(jax.jit(lambda p, x: masked.apply({"params": p}, x)), narrow, x)
    too_many = jnp.ones((native_kernels.MAX_ROWS + 1, 1, 40))  # more rows than the kernels take
    assert "terra_sparse_feed_forward" not in _targets(functools.partial(_feed_forward_step, layer), narrow, too_many)


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_deterministic_call_runs_the_fused_step_over_chunks_with_the_masked_outputs(kind):
    """Evaluation or a prefill with narrow weights computes each token's chosen units only, by the
    fused decode step over chunks of 8 tokens (42 tokens: 6 chunks, the last padded): the same
    choices and outputs as every unit computed and masked."""
    layer, narrow = _feed_forward(40, 120, 8, kind)
    masked = SparseFeedForward(d_model=40, d_ff=120, ff_sparsity=8, gathered_inference=False)
    x = jax.random.normal(jax.random.key(3), (2, 21, 40))

    def run(module):
        def apply(p, x):
            y, state = module.apply({"params": p}, x, mutable=["intermediates"])
            return y, state["intermediates"]["indices"][0]

        return apply

    assert native_kernels.TARGETS["sparse_feed_forward", kind] in _targets(run(layer), narrow, x)
    y, chosen = jax.jit(run(layer))(narrow, x)
    want_y, want_chosen = jax.jit(run(masked))(narrow, x)
    np.testing.assert_array_equal(chosen, want_chosen)
    _assert_close(y, want_y)


def test_the_fused_feed_forward_rejects_operands_whose_shapes_disagree():
    q = quantize_for_setup(jnp.ones((12, 40)), "int8")
    up = quantize_for_setup(jnp.ones((96, 12)), "int8")
    rows = quantize_for_setup(jnp.ones((96, 40)), "int8")
    wrong = quantize_for_setup(jnp.ones((95, 40)), "int8")
    with pytest.raises(Exception, match="sparse feed-forward"):
        native_kernels.sparse_feed_forward(
            jnp.ones((1, 40)),
            (q.values, q.scale),
            (up.values, up.scale),
            jnp.zeros((12, 8)),
            (rows.values, rows.scale),
            (wrong.values, wrong.scale),
            jnp.zeros((40,)),
            "int8",
        )[0].block_until_ready()


# --- sparse QKV projections ----------------------------------------------------------------------

# (d_model, heads): modules M of 8, 24, 32 and 18 (a vector and a narrow tail, a whole tile); d_model
# not a multiple of 16; the last two past the multiply-adds split between threads, the last with 64
# rows (2 x 32 modules) shared out as one chunk of four register tiles per thread.
ATTENTION_SHAPES = [(40, 5), (96, 4), (512, 16), (576, 32)]


@functools.cache
def _float_attentions():
    """``{(layer class, d_model, heads): (layer, float32 parameters, the cross-attention's encoder
    arguments)}`` for every case, shared by both stores; the layers initialised (each from the same
    key) in one compiled call, a fraction of what they cost one by one."""
    layers = {}
    for layer_class in (SparseQKVAttention, SparseQueryCrossAttention):
        for d_model, heads in ATTENTION_SHAPES:
            args = (jnp.ones((2, 5, d_model)), jnp.ones((2, 5))) if layer_class is SparseQueryCrossAttention else ()
            layers[layer_class, d_model, heads] = layer_class(d_model=d_model, n_heads=heads), args

    def init(key):
        return [
            nn.unbox(layer.init(key, jnp.ones((2, 3, d_model)), *args))["params"]
            for (_, d_model, _), (layer, args) in layers.items()
        ]

    params = jax.jit(init)(init_key(0))
    return {
        # Biases that count.
        case: (layer, jax.tree.map(lambda a: a + 0.1 if a.ndim == 1 else a, case_params), args)
        for (case, (layer, args)), case_params in zip(layers.items(), params)
    }


@functools.cache
def _attention(layer_class, d_model, heads, kind):
    layer, params, args = _float_attentions()[layer_class, d_model, heads]
    return layer, quantize_params_for_setup(params, kind), args


def _decoding(layer, args):
    """The layer's cache-creating first call and its decode step, each jitted anew: the fused or
    unfused path is chosen when they are traced (at their first call), the instruction set when
    they run."""
    first = {} if args else {"max_decode_length": 8}
    step_args = (None, None) if args else ()
    create = jax.jit(lambda p, x: layer.apply({"params": p}, x, *args, decode=True, mutable=["cache"], **first)[1])
    step = jax.jit(lambda p, c, x: layer.apply({"params": p, **c}, x, *step_args, decode=True, mutable=["cache"]))
    return create, step


def _decode_outputs(decoding, narrow, xs):
    """The layer's decode outputs for each position of ``xs`` (host arrays: slicing them compiles
    nothing) after a cache-creating first call, and the step's program."""
    create, step = decoding
    cache = create(narrow, xs[:, :1])
    outs = []
    for t in range(xs.shape[1]):
        out, cache = step(narrow, cache, xs[:, t : t + 1])
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1), str(jax.make_jaxpr(step)(narrow, cache, xs[:, :1]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("layer_class", [SparseQKVAttention, SparseQueryCrossAttention])
@pytest.mark.slow
def test_fused_sparse_attention_equals_the_layer_product_by_product(kind, shape, layer_class):
    layer, narrow, args = _attention(layer_class, *shape, kind)
    xs = np.asarray(jax.random.normal(jax.random.key(3), (2, 5, shape[0])))  # 5 steps: the window fills and slides
    with native_kernels.unfused():
        want, jaxpr = _decode_outputs(_decoding(layer, args), narrow, xs)
    assert "terra_sparse_attention" not in jaxpr
    fused = _decoding(layer, args)  # traced once: the instruction set is read at run time
    for isa in native_kernels.ISAS:
        _use_isa(isa)
        got, jaxpr = _decode_outputs(fused, narrow, xs)
        assert "terra_sparse_attention" in jaxpr
        _assert_close(got, want)


def test_the_fused_attention_rejects_operands_whose_shapes_disagree():
    gate, kernel = quantize_for_setup(jnp.ones((4, 40)), "int8"), quantize_for_setup(jnp.ones((40, 10)), "int8")
    conv = quantize_for_setup(jnp.ones((3, 3, 9, 10)), "int8")  # M_in 9, not the multiplicative layer's 10
    with pytest.raises(Exception, match="sparse attention"):
        outs, _ = native_kernels.sparse_attention(
            jnp.ones((1, 40)),
            (gate.values, gate.scale),
            (kernel.values, kernel.scale),
            jnp.zeros((40,)),
            jnp.zeros((1, 2, 4, 10)),
            [((conv.values, conv.scale), jnp.zeros((10,)))],
            "int8",
        )
        outs[0].block_until_ready()


def _ffi_results(function, *args):
    """The result shapes of each FFI call ``function`` traces, by target."""
    eqns = jax.make_jaxpr(function)(*args).eqns
    return {
        eqn.params["target_name"]: [v.aval.shape for v in eqn.outvars] for eqn in eqns if "target_name" in eqn.params
    }


def test_the_fused_calls_return_only_what_the_layer_uses():
    q, up, rows = (quantize_for_setup(jnp.ones(shape), "int8") for shape in ((12, 40), (96, 12), (96, 40)))
    feed_forward = _ffi_results(
        lambda x: native_kernels.sparse_feed_forward(
            x,
            (q.values, q.scale),
            (up.values, up.scale),
            jnp.zeros((12, 8)),
            (rows.values, rows.scale),
            (rows.values, rows.scale),
            jnp.zeros((40,)),
            "int8",
        ),
        jnp.ones((2, 40)),
    )
    assert feed_forward == {native_kernels.TARGETS["sparse_feed_forward", "int8"]: [(2, 40), (2, 12)]}
    gate, kernel = quantize_for_setup(jnp.ones((4, 40)), "int8"), quantize_for_setup(jnp.ones((40, 10)), "int8")
    conv = quantize_for_setup(jnp.ones((3, 1, 10, 10)), "int8")
    cache = jnp.zeros((2, 4, 6, 10))
    attention = _ffi_results(
        lambda x: native_kernels.sparse_attention(
            x,
            (gate.values, gate.scale),
            (kernel.values, kernel.scale),
            jnp.zeros((40,)),
            jnp.zeros((2, 2, 4, 10)),
            [((conv.values, conv.scale), jnp.zeros((10,)))] * 3,
            "int8",
            ("self", cache, cache, 0, jnp.ones((2, 6), bool)),
        ),
        jnp.ones((2, 40)),
    )
    outs, new_rows, attended = [(2, 4, 10)] * 3, [(2, 2, 4, 10)], [(2, 40), (2, 4, 6, 10), (2, 4, 6, 10)]
    assert attention == {native_kernels.TARGETS["sparse_attention_self", "int8"]: outs + new_rows + attended}


# --- in a model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fully_sparse():
    """A tiny fully sparse model (one layer in each stack: each has every fused layer kind) and its
    float32 parameters, shared by both stores; the model is frozen when built, so gin's later
    configs do not reach it."""
    # Unlocked: the model alone, without registering the data layer (which imports TensorFlow).
    bindings = ["vocab_size = 96", "n_encoder_layers = 1", "n_decoder_layers = 1"]
    parsing.parse_gin(["models/tiny_fully_sparse.gin"], [f"TransformerConfig.{b}" for b in bindings], finalize=False)
    model = parsing.build_model()
    return model, model.init_params(init_key(0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_a_narrow_fully_sparse_model_decodes_with_the_fused_layers_inside_the_generation_loop(kind, fully_sparse):
    model, params = fully_sparse
    narrow = quantize_params_for_setup(params, kind)
    decoder = model.decoder(37)  # a length no other array in the step has
    inputs = jnp.asarray(np.random.default_rng(0).integers(2, 96, size=(2, 7)), jnp.int32)
    start = jnp.zeros((2,), jnp.int32)

    def generate():
        cache = decoder.prefill(narrow, inputs)
        tokens, _, _ = decoder.generate_tokens(narrow, cache, start, jax.random.key(0), 10, 0.0, -1, 0)
        return np.asarray(tokens)

    cache = decoder.prefill(narrow, inputs)
    step = str(jax.make_jaxpr(decoder.step)(narrow, cache, start))
    assert "terra_sparse_feed_forward" in step and "terra_sparse_attention" in step
    # The fused calls write the KV caches and the convolution rows in place: the donated cache is
    # never copied inside the step.
    with xla_optimizations(True):
        hlo = decoder.step.lower(narrow, cache, start).compile().as_text()
    conv_rows = jax.tree.leaves(cache["decoder_0"]["self_attention"]["conv_rows"])[0].shape
    cache_shapes = (",37,", "[" + ",".join(map(str, conv_rows)) + "]")
    entry = hlo[hlo.index("ENTRY") :].splitlines()
    copies = [line for line in entry if re.search(r"\bcopy\(", line) and any(s in line for s in cache_shapes)]
    assert not copies, "a donated cache is copied inside the step:\n" + "\n".join(copies)
    fused = generate()
    with native_kernels.unfused():
        # Another decoder: the choice is made when tracing, so the model keeps one per choice.
        decoder = model.decoder(37)
        np.testing.assert_array_equal(generate(), fused)
        unfused_step = str(jax.make_jaxpr(decoder.step)(narrow, decoder.prefill(narrow, inputs), start))
    assert "terra_sparse_feed_forward" not in unfused_step and "terra_sparse_attention" not in unfused_step

"""What the tests share besides fixtures: the repository's root, tiny configs, set-up helpers.

``tests/conftest.py`` imports this module before JAX starts (it sets JAX's flags and device count
from the environment first), so everything here imports JAX, Flax and terra inside the function
that needs them.
"""

import contextlib
import functools
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny encoder-decoder for the copy task's byte vocabulary (259 ids), as gin bindings.
TINY_COPY_MODEL = [
    "TransformerConfig.vocab_size = 259",
    "TransformerConfig.d_model = 32",
    "TransformerConfig.d_ff = 64",
    "TransformerConfig.n_heads = 4",
    "TransformerConfig.n_encoder_layers = 1",
    "TransformerConfig.n_decoder_layers = 1",
    "TransformerConfig.max_len = 64",
]

# A study's smoke batches of 4 train on one device whatever the process has.
ONE_DEVICE = "--gin.terra.training.ParallelSettings.num_devices=1"


def without_device_count(flags: str) -> str:
    """``XLA_FLAGS`` less any forced host device count (a test or session sets its own)."""
    return " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))


def xla_flags_with_devices(count: int) -> str:
    """This process's ``XLA_FLAGS`` (the suite's compile flags, tests/conftest.py) for a
    subprocess that forces ``count`` host devices of its own."""
    return f"{without_device_count(os.environ.get('XLA_FLAGS', ''))} --xla_force_host_platform_device_count={count}"


def is_png(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def tiny_config(**overrides):
    """A tiny encoder-decoder's ``TransformerConfig`` (two layers each side, no dropout)."""
    from terra.models import TransformerConfig

    values = dict(
        vocab_size=61,
        d_model=32,
        d_ff=64,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        max_len=64,
        dropout=0.0,
        ff_dropout=0.0,
        attention_dropout=0.0,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def dropout_calls(apply, *args) -> set:
    """``(parent module class name, rate, broadcast_dims)`` of every ``nn.Dropout`` with a
    non-zero rate that ``apply(*args)`` calls; traced with abstract ``args``, not run."""
    import flax.linen as nn
    import jax

    calls = set()

    def record(next_fun, fn_args, fn_kwargs, context):
        module = context.module
        if isinstance(module, nn.Dropout) and context.method_name == "__call__" and module.rate > 0:
            calls.add((type(module.parent).__name__, module.rate, tuple(module.broadcast_dims)))
        return next_fun(*fn_args, **fn_kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(apply, *args)
    return calls


@contextlib.contextmanager
def xla_optimizations(enabled: bool):
    """XLA's optimizations on or off for what is compiled inside the block."""
    import jax

    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not enabled)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


def quantize_for_setup(w, kind: str, transposed: bool = False):
    """Narrow weights for a test's set-up, not under test (a module under ``optimized_compile``):
    ``quantize`` as one program per shape, compiled without XLA's optimizations."""
    from terra.quantization import quantize_compiled

    with xla_optimizations(False):
        return quantize_compiled(w, kind, transposed=transposed)


@functools.cache
def _quantize_params_compiled():
    import jax

    from terra.quantization import quantize_params

    return jax.jit(quantize_params, static_argnums=1)


def quantize_params_for_setup(params, kind: str):
    """A parameter tree narrowed for a test's set-up: ``quantize_params`` compiled whole (leaf by
    leaf it compiles one program per weight shape), without XLA's optimizations."""
    with xla_optimizations(False):
        return _quantize_params_compiled()(params, kind)


def full_and_stepped_logits(model, decoder, params, inputs, targets):
    """``(full, stepped)`` logits ``[batch, target_length, vocab]`` of ``model`` on ``targets``
    shifted right: the whole teacher-forced pass, and ``decoder``'s prefill then its step over the
    same tokens one at a time, as one jitted program (the step scanned, not a call per token)."""
    import jax
    import jax.numpy as jnp

    from terra.models import shift_right

    @jax.jit
    def run(params, inputs, targets):
        decoder_inputs = shift_right(targets)
        full = model.module.apply({"params": params}, inputs, decoder_inputs)

        def step(cache, token):
            logits, cache = decoder.step(params, cache, token)
            return cache, logits

        _, stepped = jax.lax.scan(step, decoder.prefill(params, inputs), decoder_inputs.T)
        return full, jnp.swapaxes(stepped, 0, 1)

    return run(params, inputs, targets)

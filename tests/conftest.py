"""Test set-up: several CPU devices before JAX starts, a clean gin config per test."""

import os
import tempfile

# Sharding tests need several devices; this must happen before JAX initialises its backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The embedded corpus and its vocabulary are built once per test session, not in the user's cache.
if "TERRA_CACHE_DIR" not in os.environ:
    os.environ["TERRA_CACHE_DIR"] = tempfile.mkdtemp(prefix="terra-test-cache-")
# XLA compilation is most of the suite's time, and many tests compile the same tiny programs (each
# Trainer, model and subprocess jits its own functions): one persistent compilation cache per
# session, shared by the xdist workers and the subprocesses the tests start (they inherit the
# environment), compiles each program once. It starts empty and is removed when the session ends,
# so every run compiles from scratch.
_OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="terra-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import flax.linen as nn  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from terra.models import EncoderDecoderModel, EncoderDecoderTransformer, TransformerConfig  # noqa: E402

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


def pytest_unconfigure(config):
    # The process that made the compilation cache (the xdist controller, or pytest without xdist).
    if _OWN_COMPILATION_CACHE is not None and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def tiny_config(**overrides) -> TransformerConfig:
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
    calls = set()

    def record(next_fun, fn_args, fn_kwargs, context):
        module = context.module
        if isinstance(module, nn.Dropout) and context.method_name == "__call__" and module.rate > 0:
            calls.add((type(module.parent).__name__, module.rate, tuple(module.broadcast_dims)))
        return next_fun(*fn_args, **fn_kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(apply, *args)
    return calls


@pytest.fixture(scope="module")
def fast_compile():
    """XLA's optimizations off for a test module: at test sizes they only cost compile time.
    Use with ``pytestmark = pytest.mark.usefixtures("fast_compile")``."""
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny dense encoder-decoder and its random parameters, shared by the suite."""
    model = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config()))
    return model, model.init_params(jax.random.key(0))


# The suite has 8 CPU devices (above); a study's smoke batches of 4 train on one of them.
ONE_DEVICE = "--gin.terra.training.ParallelSettings.num_devices=1"


def is_png(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"

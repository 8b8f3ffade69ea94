"""scripts/decode_step_profile.py names each operation of an optimized program by its kind (a native
kernel by its FFI target, a fusion by its kind) and sums a trace's time per kind and step."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import native_kernels
from terra.quantization.quantized import QuantizedTensor

from helpers import REPO_ROOT, quantize_for_setup


@pytest.fixture(scope="module")
def script():
    path = os.path.join(REPO_ROOT, "scripts", "decode_step_profile.py")
    spec = importlib.util.spec_from_file_location("decode_step_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _product(x, q: QuantizedTensor):
    from terra import backends

    return jnp.tanh(backends.output_major_product(x, q)) * 2.0


@pytest.mark.skipif(not native_kernels.available(), reason="the native kernels are not built")
def test_a_programs_operations_are_named_by_their_kernel_or_fusion_kind(script):
    q = quantize_for_setup(np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32), "int8")
    hlo = jax.jit(_product).lower(jnp.ones((2, 8)), q).compile().as_text()
    kinds = script.operation_kinds(hlo)
    assert native_kernels.TARGETS["output_major", "int8"] in kinds.values()
    assert any(kind.startswith("fusion k") for kind in kinds.values())
    # Every name is an instruction of the program: the trace's events are looked up by it.
    assert all(f"{name} = " in hlo for name in kinds)


@pytest.mark.slow
def test_the_profile_sums_each_kinds_traced_time_per_step(script, tmp_path):
    from terra.decoding.decode_step import IncrementalDecoder
    from terra.gin_config import parsing

    parsing.parse_gin(
        ["models/tiny_fully_sparse.gin"],
        ["TransformerConfig.n_encoder_layers = 1", "TransformerConfig.n_decoder_layers = 1"],
        finalize=False,
    )
    model = parsing.build_model()
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), model.abstract_params())
    decoder = IncrementalDecoder(model.module, 16)
    step, kinds = script.profile(decoder, params, np.full((2, 5), 3), steps=4, repeats=1)
    assert step is None or step > 0  # a tiny model's step may be lost in the loops' jitter
    per_step = {kind: count for kind, (_, count) in kinds.items()}
    # Float32 weights: XLA's fusions, each step's own (the loop holding them is left out).
    assert sum(count for kind, count in per_step.items() if kind.startswith("fusion")) >= 4
    assert all(ms >= 0 for ms, _ in kinds.values()) and "while" not in kinds

"""scripts/decode_step_hlo.py compares decode programs as computations: the tracer's names, source
locations and how the cache is grouped and named do not count, every operation and edge does."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from terra.backends.decode_state import KVCache

from helpers import REPO_ROOT

pytestmark = pytest.mark.usefixtures("optimized_compile")


@pytest.fixture(scope="module")
def hlo():
    spec = importlib.util.spec_from_file_location(
        "decode_step_hlo", os.path.join(REPO_ROOT, "scripts", "decode_step_hlo.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _program(hlo, fn, *args) -> str:
    return hlo._canonical(jax.jit(fn).lower(*args).compile().as_text())


def test_the_same_computation_written_apart_compares_equal_and_another_differs(hlo):
    x, y = jnp.ones((4, 8)), jnp.ones((8,))

    def first(x, y):
        return jnp.tanh(x * y).sum(axis=0) + jnp.where(y < 0, jnp.sum(x), 0.0)

    def second(a, b):  # other names, other lines, a helper in between
        scaled = a * b
        dependency = jnp.where(b < 0, jnp.sum(a), 0.0)
        return jnp.tanh(scaled).sum(axis=0) + dependency

    def other(x, y):  # the sums' order changed: another computation
        return jnp.where(y < 0, jnp.sum(x), 0.0) + jnp.tanh(x * y).sum(axis=0)

    assert _program(hlo, first, x, y) == _program(hlo, second, x, y)
    assert _program(hlo, first, x, y) != _program(hlo, other, x, y)
    assert "metadata" not in _program(hlo, first, x, y)


def test_a_cache_compares_by_path_whatever_its_grouping_and_names(hlo):
    key, scale, index = jnp.zeros((1, 2, 4, 8), jnp.int8), jnp.ones((1, 2, 4)), jnp.zeros((), jnp.int32)
    typed = {"layer": {"kv": KVCache(key, scale, key + 1, scale, index=index), "conv_rows": jnp.ones(3)}}
    named = {
        "layer": {
            "cached_key": key,
            "cached_key_scale": scale,
            "cached_value": key + 1,
            "cached_value_scale": scale,
            "cache_index": index,
            "conv_rows": jnp.ones(3),
        }
    }
    assert sorted(hlo.flat(typed)) == sorted(hlo.flat(named))
    for path, leaf in hlo.flat(named).items():
        assert (hlo.flat(typed)[path] == leaf).all(), path
    rebuilt = hlo.nested(hlo.flat(named), typed)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(typed)
    assert int(rebuilt["layer"]["kv"].value[0, 0, 0, 0]) == 1

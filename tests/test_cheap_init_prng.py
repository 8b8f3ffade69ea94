"""The test suite's cheap parameter keys (tests/cheap_init_prng.py) draw usable random numbers."""

import jax
import numpy as np

from cheap_init_prng import init_key


def test_cheap_init_keys_draw_independent_standard_normals():
    """Tests draw parameters from these keys: their bits make standard normals,
    and split and folded-in keys draw other values."""
    key = init_key(0)
    x = np.asarray(jax.random.normal(key, (20000,)))
    assert abs(x.mean()) < 0.03 and abs(x.std() - 1) < 0.03 and abs(np.corrcoef(x[1:], x[:-1])[0, 1]) < 0.03
    keys = [*jax.random.split(key), jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)]
    draws = [jax.random.normal(k, (8,)) for k in keys]
    assert all(not np.allclose(draws[i], draws[j]) for i in range(4) for j in range(i))

"""Random parameters whose initializer compiles in a fraction of the time, for tests whose property
holds for any parameter values (decode equals the teacher-forced pass, reversible gradients equal
plain autodiff, training lowers the loss...).

A model's initializer draws every parameter with threefry: a fold-in of the parameter's name, then
its random bits. XLA:CPU compiles each threefry call as a loop of its own, so compiling
``init_params`` of a tiny Terraformer (some 70 parameters) costs 6-10 CPU-s, several times its
forward pass. A key of ``HASH_PRNG`` gives the same initializers (the same distributions, fans and
scales) bits from a counter hash, murmur3's 32-bit finalizer applied twice, which compiles to a few
operations per draw: the same initializer compiles in about a third of the time.

Use it for parameters only: the keys a model meets in training (dropout, Gumbel noise, LSH
rotations) stay threefry's, as in the library.
"""

from typing import Any, Callable, Hashable, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl


def _fmix32(h):
    """murmur3's finalizer: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(key, counter):
    return _fmix32(_fmix32(counter * jnp.uint32(0x9E3779B9) ^ key[0]) ^ key[1])


def _seed(seed):
    seed = jnp.asarray(seed)
    low = seed.astype(jnp.uint32)
    high = (seed >> 32).astype(jnp.uint32) if seed.dtype.itemsize == 8 else jnp.uint32(0)
    return jnp.stack([_fmix32(high ^ jnp.uint32(0x3C6EF372)), _fmix32(low ^ jnp.uint32(0xA54FF53A))])


def _split(key, shape):
    n = int(np.prod(shape))
    return _hash(key, jnp.arange(2 * n, dtype=jnp.uint32)).reshape(*shape, 2)


def _fold_in(key, data):
    data = jnp.asarray(data).astype(jnp.uint32)
    return jnp.stack(
        [_fmix32(key[0] ^ _fmix32(data ^ jnp.uint32(0x68E31DA4))), _fmix32(key[1] + data * jnp.uint32(0xB5297A4D))]
    )


def _random_bits(key, bit_width, shape):
    n = int(np.prod(shape))
    if bit_width == 64:
        bits = _hash(key, jnp.arange(2 * n, dtype=jnp.uint32)).astype(jnp.uint64)
        return ((bits[:n] << 32) | bits[n:]).reshape(shape)
    dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width]
    return _hash(key, jnp.arange(n, dtype=jnp.uint32)).astype(dtype).reshape(shape)


HASH_PRNG = define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in, name="hash", tag="hsh"
)


def init_key(seed: int) -> jax.Array:
    """A key for ``Model.init_params`` / ``module.init`` whose initializer compiles cheaply."""
    return jax.random.key(seed, impl=HASH_PRNG)


def initialised_once(build: Callable[[Hashable], Any], seed: int) -> Callable[[Hashable], Tuple[Any, Any]]:
    """``variant -> (model, params)``: ``build(variant)`` and its parameters from
    ``init_key(seed)``, each made at the first call for that variant (a module's fixture returns
    it, so its tests share them)."""
    built = {}

    def get(variant):
        if variant not in built:
            model = build(variant)
            built[variant] = model, model.init_params(init_key(seed))
        return built[variant]

    return get

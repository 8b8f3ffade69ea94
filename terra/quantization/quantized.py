"""Narrow weights for decoding: a float32 tensor stored as int8 (symmetric, one float32 scale per
row of its last axis) or as bfloat16's 16 bits.

Batch-1 decoding on a CPU streams every weight it reads from memory once per token, so its time is
bytes ÷ bandwidth (``docs/decode_speed.md``): int8 reads a quarter of float32's bytes, bfloat16
half. Activations, accumulation and caches stay float32.

*Per row of the last axis* is the granularity for every weight: it is the output channel of a
dense kernel stored output-major (``[*out, in]``, ``terra/layers/dense.py``), and the row a sparse
feed-forward layer or an embedding gathers, which then carries its own scale. A kernel that
contracts two input axes (the attention output, ``[d_model, heads, d_head]``) gets one scale per
head of each output channel: finer, never coarser, than per channel.

Two input-major weights are stored transposed for decoding (:data:`STORED_OUTPUT_MAJOR`): the
sparse feed-forward controller's up-projection ``[d_lowrank, d_ff / N, N]`` and the sparse loss's
multiplicative kernel ``[d_model, vocab / S]``. Read by a few rows of activations (one; S), an
input-major product reads each tile of outputs from one line per input, each line in its own DRAM
page, while output-major (``[*out, in]``, one scale per output) they stream: the fully sparse
int8 800M step is faster (``docs/architecture.md``, decisions).

bfloat16 is kept as ``uint16`` bits because XLA:CPU converts a bfloat16 matrix to float32 whole
before a product (several times slower than float32), while ``bitcast(uint32(bits) << 16)`` widens it
exactly in a fused loop (``docs/design/cpu_decoding.md``).
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from terra.errors import ConfigError

WEIGHTS_DTYPES = ("float32", "bfloat16", "int8")
# Input-major weights that the decode tree stores output-major, by the last names of their path.
STORED_OUTPUT_MAJOR = ("controller_up", "logits/multiplicative/kernel")
INT8_MAX = 127.0


class QuantizedTensor(flax.struct.PyTreeNode):
    """A float32 tensor ``[..., n]`` stored narrow.

    Attributes:
      values: ``int8 [..., n]`` (round(w / scale)) or ``uint16 [..., n]`` (bfloat16 bits).
      scale: ``float32 [...]`` for int8 (max |w| of the row / 127; 1 for an all-zero row);
        ``float32 []`` (unused, 1) for bfloat16.
      kind: ``"int8"`` or ``"bfloat16"``.
      transposed: the tensor is an input-major weight ``[in, *out]`` stored output-major: the bytes
        of ``values`` are the array ``[*out, in]`` (each output's inputs contiguous, one int8 scale
        per output, ``scale [*out]``), kept in an array of the weight's own shape because Flax
        checks a parameter's shape against its initializer's. :meth:`output_major` reads it.
    """

    values: jax.Array
    scale: jax.Array
    kind: str = flax.struct.field(pytree_node=False)
    transposed: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self):
        return self.values.shape

    def output_major(self) -> "QuantizedTensor":
        """A transposed tensor's stored weights ``[*out, in]`` as an untransposed tensor (a reshape:
        no copy)."""
        if not self.transposed:
            raise ValueError(f"the QuantizedTensor {self.shape} is not stored transposed")
        shape = self.shape[1:] + self.shape[:1]
        return QuantizedTensor(self.values.reshape(shape), self.scale, self.kind)

    @property
    def nbytes(self) -> int:
        return int(self.values.size * self.values.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    def reshape(self, *shape: int) -> "QuantizedTensor":
        """The same weights as ``[*rows, n]``: only the row axes may change (scales follow them)."""
        if self.transposed:
            raise ValueError(f"a transposed QuantizedTensor {self.shape} is read whole, not reshaped")
        if shape[-1] != self.values.shape[-1]:
            raise ValueError(f"a QuantizedTensor keeps its last axis: {self.values.shape} -> {shape}")
        scale = self.scale if self.kind == "bfloat16" else self.scale.reshape(shape[:-1])
        return QuantizedTensor(self.values.reshape(shape), scale, self.kind)


def _bfloat16_bits(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(w, jnp.float32).astype(jnp.bfloat16), jnp.uint16)


def widen(values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """float32 weights from a block of stored ones (``values [..., n]``, ``scale [...]``)."""
    if kind == "bfloat16":
        return jax.lax.bitcast_convert_type(values.astype(jnp.uint32) << 16, jnp.float32)
    return values.astype(jnp.float32) * scale[..., None]


def quantize(w: jax.Array, kind: str, transposed: bool = False) -> QuantizedTensor:
    """``w [..., n]`` (float) -> its :class:`QuantizedTensor` of ``kind`` (``int8``, ``bfloat16``);
    ``transposed``: ``w [n, *out]`` stored as ``[*out, n]``, one int8 scale per output."""
    w = jnp.asarray(w, jnp.float32)
    if transposed:
        q = quantize(jnp.moveaxis(w, 0, -1), kind)
        return QuantizedTensor(q.values.reshape(w.shape), q.scale, kind, transposed=True)
    if kind == "bfloat16":
        return QuantizedTensor(_bfloat16_bits(w), jnp.ones((), jnp.float32), kind)
    if kind != "int8":
        raise ConfigError(f"cannot quantize to '{kind}'; weights_dtype is one of {', '.join(WEIGHTS_DTYPES)}.")
    peak = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(peak > 0, peak / INT8_MAX, 1.0).astype(jnp.float32)
    values = jnp.clip(jnp.round(w / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedTensor(values, scale, kind)


# ``quantize`` as one program per shape, kind and layout: run op by op on concrete weights (a
# parameter tree, random timing weights), it would compile each of its operations for each weight
# shape. Inside a caller's trace it is inlined like ``quantize``.
quantize_compiled = jax.jit(quantize, static_argnames=("kind", "transposed"))


def dequantize(q: QuantizedTensor) -> jax.Array:
    """The float32 tensor ``q`` stands for."""
    if q.transposed:
        return jnp.moveaxis(dequantize(q.output_major()), -1, 0)
    return widen(q.values, q.scale, q.kind)


def as_float(w, dtype=jnp.float32) -> jax.Array:
    """``w`` as a ``dtype`` array, dequantizing a :class:`QuantizedTensor` whole: for small weights
    and for paths that are not the decode step's hot loop (training, eval, prefill)."""
    return dequantize(w).astype(dtype) if isinstance(w, QuantizedTensor) else jnp.asarray(w, dtype)


def _name(path) -> str:
    """The parameter's own name, the last key of its ``jax.tree_util`` path."""
    return str(getattr(path[-1], "key", path[-1])) if path else ""


def _stored_output_major(path) -> bool:
    """Whether the parameter at ``path`` is one of :data:`STORED_OUTPUT_MAJOR` (matched on the
    last names of its path: ``"multiplicative/kernel"`` is any ``.../multiplicative/kernel``)."""
    names = [str(getattr(key, "key", key)) for key in path]
    return any(names[-len(parts) :] == parts for parts in (suffix.split("/") for suffix in STORED_OUTPUT_MAJOR))


def _is_weight(path, leaf: Any) -> bool:
    """A matrix or higher that is not a bias: what a decode step streams. Biases (of any rank, e.g.
    ``[heads, d_head]``) and vectors (norm scales) stay float32: a negligible share of the bytes,
    added rather than multiplied, so their rounding would not be spread over a row."""
    name = _name(path)
    floating = hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    return floating and np.ndim(leaf) >= 2 and "bias" not in name


def check_weights_dtype(weights_dtype: str) -> str:
    """``weights_dtype`` if it names a decode store, else a :class:`ConfigError` listing them."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ConfigError(
            f"weights_dtype '{weights_dtype}' is not one of {', '.join(WEIGHTS_DTYPES)} "
            "(int8 and bfloat16 store the weights narrow for decoding; training stays float32)."
        )
    return weights_dtype


def quantize_leaf(path, leaf: Any, weights_dtype: str) -> Any:
    """One leaf of a parameter tree (``path`` as ``jax.tree_util`` gives it) as the decode tree
    stores it: a weight matrix quantized (those named in :data:`STORED_OUTPUT_MAJOR` transposed),
    anything else unchanged."""
    if weights_dtype == "float32" or not _is_weight(path, leaf):
        return leaf
    return quantize_compiled(leaf, weights_dtype, transposed=_stored_output_major(path))


def quantize_params(params: Any, weights_dtype: str) -> Any:
    """A trained float32 parameter tree -> the decode tree of ``weights_dtype``: every weight
    matrix a :class:`QuantizedTensor`, everything else unchanged (``float32`` returns ``params``)."""
    if check_weights_dtype(weights_dtype) == "float32":
        return params
    return jax.tree_util.tree_map_with_path(lambda path, leaf: quantize_leaf(path, leaf, weights_dtype), params)


def weights_dtype_of(params: Any) -> str:
    """How a parameter tree stores its weights: the kind of its :class:`QuantizedTensor` leaves
    (``int8``, ``bfloat16``), or ``float32`` where it has none."""
    leaves = jax.tree.leaves(params, is_leaf=lambda leaf: isinstance(leaf, QuantizedTensor))
    kinds = {leaf.kind for leaf in leaves if isinstance(leaf, QuantizedTensor)}
    if len(kinds) > 1:
        raise ValueError(f"a parameter tree mixes {sorted(kinds)} weights; terra stores one kind per tree.")
    return kinds.pop() if kinds else "float32"


def dequantize_params(params: Any) -> Any:
    """A decode tree -> float32 (each :class:`QuantizedTensor` replaced by what it stands for)."""
    return jax.tree.map(
        lambda leaf: dequantize(leaf) if isinstance(leaf, QuantizedTensor) else leaf,
        params,
        is_leaf=lambda leaf: isinstance(leaf, QuantizedTensor),
    )

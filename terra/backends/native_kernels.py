"""The native CPU kernels (the C++ of ``terra/backends/native/``, built as ``_cpu_kernels``) as XLA
FFI custom calls on the CPU: what the CPU backend (``terra/backends/cpu.py``) calls.

The shared library is built by the package's install (``setup.py``, an optional extension placed
next to its source). It is loaded with ctypes on first use and its handlers registered with
``jax.ffi``; when it is missing or cannot be loaded, one warning says so and :func:`available`
is false, so the primitives (``terra/backends/primitives.py``) keep their XLA forms.
``TERRA_NATIVE_KERNELS=0`` turns the kernels off without a warning (to compare both paths, or to
rule the kernels out).

Four products and three fused layer steps: the output-major matrix-vector product of the dense
layers (:func:`output_major`), the input-major one of the small sparse-layer kernels
(:func:`input_major`), the dot and the weighted sum of the rows a sparse feed-forward layer selects
(:func:`gathered_dot`, :func:`gathered_sum`), a sparse feed-forward layer's and a sparse QKV
layer's decode step in one call each (:func:`sparse_feed_forward`, :func:`sparse_attention`), and
an LSH layer's decode-step attention over the keys its buckets keep (:func:`lsh_decode_attention`),
a decode step's attention over a whole KV cache stored float32, int8 or bfloat16
(:func:`cache_attention`), and softmax attention over a whole input, a prefill's
(:func:`blocked_attention`). Beside them, a decode session's hand-off of tokens and logits
between its running loop and the host (:func:`session_library`, ``session_exchange.cc``), and a
generation loop's stream of tokens to the host (``token_stream.cc``).

The output-major and gathered kernels take at most :data:`MAX_ROWS` rows of activations per call
(decoding's batch or beams; the input-major one :data:`MAX_INPUT_MAJOR_ROWS`, a multiplicative
layer's modules times the batch): each weight is widened once per pass of 8 rows and multiplied
into each of them, and the passes after the first over a chunk of weights read it from cache, so a
batch streams the weights from memory once. Their arithmetic grows with the rows (int8 turns
compute-bound from a few rows), and up to 64 rows they are still as fast as XLA's blocked product
or faster (docs/design/cpu_decoding.md, ``terra-bench products --rows 64``); larger products,
prefill and training keep XLA's products, which are real matrix products. The output-major kernel
also reads float32 weights, for a batch of a few rows (:func:`float_kernel_applies`).
"""

import contextlib
import ctypes
import functools
import importlib.machinery
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

ENV_SWITCH = "TERRA_NATIVE_KERNELS"
MAX_ROWS = 64
# Rows of x an input-major product takes (a multiplicative layer's batch x S modules): each weight
# is widened once and used by every row, so its arithmetic grows with them; past this, XLA's matrix
# product is the faster one.
MAX_INPUT_MAJOR_ROWS = 256
# Rows of x the output-major product of float32 weights takes: XLA:CPU's product of one row streams
# the weights at the memory's pace, but of 2 to 16 rows it reads them several times over, and from a
# few dozen rows its blocked product's arithmetic outruns the kernel's. The kernel reads all rows of
# x again for each few rows of weights: up to FLOAT_ROWS_ANY_WIDTH rows it is the faster product at
# any width, and beyond only while x holds at most MAX_FLOAT_ACTIVATIONS values (64 KiB: 16 rows of
# d_model 1024), which stay in L1 (docs/decode_speed.md, "Batched decoding").
MIN_FLOAT_ROWS, MAX_FLOAT_ROWS = 2, 16
FLOAT_ROWS_ANY_WIDTH = 4
MAX_FLOAT_ACTIVATIONS = 16 << 10


def float_kernel_applies(rows: int, n_in: int) -> bool:
    """Whether the output-major kernel is the faster product of ``rows`` rows of ``n_in`` float32
    activations with float32 weights."""
    if not MIN_FLOAT_ROWS <= rows <= MAX_FLOAT_ROWS:
        return False
    return rows <= FLOAT_ROWS_ANY_WIDTH or rows * n_in <= MAX_FLOAT_ACTIVATIONS


# The library is built next to its source, in this package's native/ (setup.py's extension path).
LIBRARY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
LIBRARY_STEM = "_cpu_kernels"  # the extension module setup.py builds: terra.backends.native._cpu_kernels
REBUILD = (
    "rebuild it with `make install` (after `rm .venv/.terra-installed`) or "
    "`.venv/bin/python -m pip install --no-deps --no-build-isolation -e .` (needs a C++17 compiler)"
)
# The instruction sets the library chooses between, in its numbering.
ISAS = ("portable", "avx2", "avx512")
# The FFI targets, by product and weight store.
PRODUCTS = ("output_major", "input_major", "gathered_dot", "gathered_sum")
TARGETS = {
    (product, kind): f"terra_{product}_{suffix}"
    for product in PRODUCTS
    for kind, suffix in (("int8", "int8"), ("bfloat16", "bf16"))
}
# float32 weights: the output-major product of a batch of rows, read once for all of them.
TARGETS[("output_major", "float32")] = "terra_output_major_f32"
# Fused layers: one call for a sparse layer's decode step (the attention's takes either store).
TARGETS.update(
    {
        ("sparse_feed_forward", kind): f"terra_sparse_feed_forward_{suffix}"
        for kind, suffix in (("int8", "int8"), ("bfloat16", "bf16"))
    }
)
# The sparse attention: one target per store and variant (the projections with one to three
# convolutions, or with the self- or cross-attention), each with its operands fixed by position.
ATTENTION_VARIANTS = ("projections1", "projections2", "projections3", "self", "cross")
TARGETS.update(
    {
        (f"sparse_attention_{variant}", kind): f"terra_sparse_attention_{variant}_{suffix}"
        for variant in ATTENTION_VARIANTS
        for kind, suffix in (("int8", "int8"), ("bfloat16", "bf16"))
    }
)

# The attention caches a decode kernel reads, by dtype: float32, int8 with row scales, bfloat16 bits.
# The LSH decode attention: one target per cache store.
CACHE_KINDS = {"float32": "f32", "int8": "int8", "uint16": "bf16"}
TARGETS.update(
    {("lsh_decode_attention", kind): f"terra_lsh_decode_attention_{suffix}" for kind, suffix in CACHE_KINDS.items()}
)
# A decode step's attention over a whole KV cache: one target per cache store, as the LSH one's.
TARGETS.update({("cache_attention", kind): f"terra_cache_attention_{suffix}" for kind, suffix in CACHE_KINDS.items()})
# The largest head size the cache attention takes (cache_attention.h, kMaxCacheHeadSize).
MAX_CACHE_HEAD_SIZE = 512
# Hash rounds the LSH kernel takes (lsh_attention.h, kMaxLshRounds).
MAX_LSH_ROUNDS = 8
# Softmax attention over a whole input (prefill): blocks of queries against tiles of keys.
TARGETS.update(
    {
        ("blocked_attention", False): "terra_blocked_attention",
        ("blocked_attention", True): "terra_blocked_attention_causal",
    }
)
# An LSH layer's attention over its sorted chunks (a prefill's, an evaluation's).
TARGETS[("lsh_chunk_attention", "float32")] = "terra_lsh_chunk_attention"
# An LSH layer's bucket ids for a whole sequence, and the most bucket factors it takes (lsh_hash.h).
TARGETS[("lsh_hash", "float32")] = "terra_lsh_hash"
MAX_LSH_FACTORS = 4
# A sparse-QKV convolution over a whole sequence (module_convolution.h).
TARGETS[("module_convolution", "float32")] = "terra_module_convolution"
# A decode session's hand-off between its running loop and the host (session_exchange.cc).
TARGETS[("session_first_token", "int32")] = "terra_session_first_token"
TARGETS[("session_hand_over", "float32")] = "terra_session_hand_over"
# A generation loop's tokens handed to the host as they are chosen (token_stream.cc).
TARGETS[("stream_push", "int32")] = "terra_stream_push"
# Keys per tile of the blocked attention's transposed keys (a multiple of 64: prefill_attention.h).
ATTENTION_KEY_TILE = 256


def library_path():
    """The built library next to its source, or ``None`` when the install did not build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(LIBRARY_DIR, LIBRARY_STEM + suffix)
        if os.path.isfile(path):
            return path
    return None


@functools.cache
def _library():
    """The loaded library with its targets registered, or ``None`` (after one warning when the
    kernels were wanted but could not be had)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    path = library_path()
    if path is None:
        reason = f"terra's native kernels are not built (no {LIBRARY_STEM}*.so in {LIBRARY_DIR})"
    else:
        try:
            library = ctypes.CDLL(path)
            for target in sorted(set(TARGETS.values())):
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
            library.terra_cpu_kernels_isa.argtypes = [ctypes.c_int]
            library.terra_cpu_kernels_isa.restype = ctypes.c_int
            library.terra_session_open.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]
            library.terra_session_open.restype = ctypes.c_int
            library.terra_session_step.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
            library.terra_session_step.restype = ctypes.c_int
            library.terra_stream_open.argtypes = [ctypes.c_int32, ctypes.c_int64]
            library.terra_stream_open.restype = ctypes.c_int
            library.terra_stream_next.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
            library.terra_stream_next.restype = ctypes.c_int
            for name in (
                "terra_session_stop",
                "terra_session_end",
                "terra_stream_stop",
                "terra_stream_end",
                "terra_stream_close",
            ):
                getattr(library, name).argtypes = [ctypes.c_int32]
                getattr(library, name).restype = None
            return library
        except Exception as error:  # an optional speed-up: whatever fails, the XLA path remains
            reason = f"terra's native kernels could not be loaded from {path} ({error})"
    warnings.warn(
        f"{reason}: int8/bfloat16 decoding uses the slower XLA products; {REBUILD}. "
        f"Set {ENV_SWITCH}=0 to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


_disabled = 0  # depth of `disabled()` blocks being traced


def available() -> bool:
    """Whether the native products can be used (built, loaded, and not turned off)."""
    return not _disabled and _library() is not None


@contextlib.contextmanager
def disabled():
    """Products traced inside this block use the XLA path (to compare both in one process); the
    choice is made when a function is traced, so a function jitted inside keeps it."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


_unfused = 0  # depth of `unfused()` blocks being traced


def fused_available() -> bool:
    """Whether a sparse layer's decode step may run as one fused call (:func:`sparse_feed_forward`,
    :func:`sparse_attention`): the kernels are available and not turned off by :func:`unfused`."""
    return not _unfused and available()


@contextlib.contextmanager
def unfused():
    """Sparse layers traced inside this block call their products one by one (each still a native
    kernel): to compare the fused layers with their parts, or to time them."""
    global _unfused
    _unfused += 1
    try:
        yield
    finally:
        _unfused -= 1


def traced_choice() -> tuple:
    """What a function traced now would call: ``(native products, fused sparse layers)``, as
    :func:`disabled` and :func:`unfused` leave them. A cache of traced functions keys on it."""
    return available(), fused_available()


def session_library():
    """The library, whose ``terra_session_*`` functions hand a decode session's tokens and logits
    between its loop and the host (session_exchange.cc; ctypes releases Python's lock while they
    wait) and ``terra_stream_*`` a generation loop's tokens to the host (token_stream.cc), or
    ``None`` where the kernels are not available (:func:`available`)."""
    return _library() if available() else None


def stream_library():
    """The loaded library whatever :func:`disabled` says (a loop traced with the kernels on may run
    after they were switched off: its stream must still be read), or ``None`` where it is not
    built or not loaded."""
    return _library()


def isa() -> str:
    """The instruction set the kernels run with: ``avx512``, ``avx2`` or ``portable``."""
    library = _library()
    if library is None:
        raise RuntimeError("terra's native kernels are not available")
    return ISAS[library.terra_cpu_kernels_isa(-1)]


def use_isa(name: str) -> str:
    """Run the kernels with instruction set ``name`` (or the best this CPU has below it), e.g. to
    check every variant on one machine; takes effect at the next call, traced or not. Returns the
    set in use before."""
    library = _library()
    if library is None:
        raise RuntimeError("terra's native kernels are not available")
    before = ISAS[library.terra_cpu_kernels_isa(-1)]
    library.terra_cpu_kernels_isa(ISAS.index(name))
    return before


def output_major(x: jax.Array, values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """``x f32 [rows, in]`` times output-major weights -> ``f32 [rows, out]``, ``rows`` <=
    :data:`MAX_ROWS`.

    ``values``: ``int8 [out, in]`` with ``scale f32 [out]`` or ``f32 [out, groups]`` (``groups``
    dividing ``in``: each run of ``in / groups`` consecutive inputs has its own scale per output,
    as a kernel ``[out, heads, d_head]`` stores it); ``uint16 [out, in]`` bfloat16 bits or, with
    ``kind`` ``"float32"``, ``f32 [out, in]`` (``scale`` unused).
    """
    return _call("output_major", kind, (x.shape[0], values.shape[0]), x, values, scale)


def input_major(x: jax.Array, values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """``x f32 [rows, in]`` times input-major narrow weights -> ``f32 [rows, out]``, ``rows`` <=
    :data:`MAX_INPUT_MAJOR_ROWS`.

    ``values``: ``int8 [in, out]`` with ``scale f32 [in]`` or ``f32 [in, groups]`` (``groups``
    dividing ``out``: each run of ``out / groups`` consecutive outputs has its own scale per input,
    as a kernel ``[in, groups, out / groups]`` quantized per row of its last axis stores it); or
    ``uint16 [in, out]`` bfloat16 bits (``scale`` unused).
    """
    return _call("input_major", kind, (x.shape[0], values.shape[1]), x, values, scale)


def gathered_dot(x: jax.Array, values: jax.Array, scale: jax.Array, rows: jax.Array, kind: str) -> jax.Array:
    """``y [b, j] = values[rows[b, j]] . x[b]`` with the row's int8 scale: ``x f32 [batch, d]``,
    ``values [n, d]`` (``scale f32 [n]``), ``rows int32 [batch, k]`` (clipped to ``[0, n)``, as
    ``jnp.take(mode='clip')``) -> ``f32 [batch, k]``; ``batch`` <= :data:`MAX_ROWS`."""
    return _call("gathered_dot", kind, rows.shape, x, values, scale, rows)


def gathered_sum(x: jax.Array, values: jax.Array, scale: jax.Array, rows: jax.Array, kind: str) -> jax.Array:
    """``y [b] = sum_j x[b, j] values[rows[b, j]]`` (each row with its int8 scale): ``x f32 [batch,
    k]``, ``values [n, d]`` (``scale f32 [n]``), ``rows int32 [batch, k]`` -> ``f32 [batch, d]``."""
    return _call("gathered_sum", kind, (rows.shape[0], values.shape[1]), x, values, scale, rows)


def sparse_feed_forward(x: jax.Array, down, up, up_bias: jax.Array, w1, w2, out_bias: jax.Array, kind: str):
    """A sparse feed-forward layer's decode step (``terra/layers/sparse_feedforward.py``) in one call:
    ``x f32 [batch, d]`` (``batch`` <= :data:`MAX_ROWS`); ``down``, ``up``, ``w1``, ``w2`` are
    ``(values, scale)`` pairs of output-major narrow weights (``scale`` ``None`` for bfloat16):
    the controller's C1 ``[L, d]`` and C2 ``[F, L]`` (scales ``[L]``, ``[F]``), W1 and W2 ``[F, d]``
    (scales ``[F]``); ``up_bias f32 [F / N, N]``; ``out_bias f32 [d]``. Returns ``(y f32 [batch, d],
    block choices int32 [batch, F / N])``."""
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    batch, d = x.shape
    n_blocks = up_bias.shape[0]
    results = [jax.ShapeDtypeStruct((batch, d), jnp.float32), jax.ShapeDtypeStruct((batch, n_blocks), jnp.int32)]
    call = jax.ffi.ffi_call(TARGETS["sparse_feed_forward", kind], results, vmap_method="sequential")
    if kind == "int8":
        operands = (x, *down, *up, up_bias, *w1, *w2, out_bias)
    else:
        operands = (x, down[0], up[0], up_bias, w1[0], w2[0], out_bias)
    y, indices = call(*operands)
    return y, indices


def sparse_attention(
    x: jax.Array, gate, kernel, mult_bias: jax.Array, conv_rows: jax.Array, convolutions, kind: str, attention=None
):
    """A sparse QKV layer's decode step (``terra/layers/sparse_qkv.py``) in one call: the
    multiplicative layer, the convolution window and its convolutions, and optionally the attention.

    ``x f32 [batch, d]``, one new position per row (``batch * S`` <= :data:`MAX_INPUT_MAJOR_ROWS`);
    ``gate`` D ``[S, d]`` and ``kernel`` E ``[d, M]`` as ``(values, scale)`` pairs (``scale``
    ``None`` for bfloat16; int8 scales ``[S]``, ``[d]``); ``mult_bias f32 [S * M]``; ``conv_rows
    f32 [batch, F - 1, S, M]`` (the cached rows of ``u``); ``convolutions``: one to three
    ``((values, scale), bias)``, each kernel ``[F, k, M, M_out]`` (int8 scale ``[F, k, M]``), ``k``
    odd. Returns ``([each convolution's f32 [batch, S, M_out]], new conv rows, attention)``.

    ``attention`` (the S modules being the heads, M = d_head): ``("self", keys, values, index,
    key_mask)`` with the KV cache ``f32 [batch, S, L, M]``, the write position ``int32 []`` and
    ``bool [batch, L]`` (Q, K, V the three convolutions), or ``("cross", keys, values, bias)`` with
    the encoder's keys and values and an additive ``f32 [batch, L]`` bias (Q the one convolution).
    The third result is then ``y f32 [batch, S * M]``, plus for ``"self"`` the updated keys and
    values (the cache operands aliased, so a donated cache is written in place); else ``None``.
    """
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    batch = x.shape[0]
    n_modules, module = gate[0].shape[0], kernel[0].shape[1]
    f32 = jnp.float32
    outputs = [jax.ShapeDtypeStruct((batch, n_modules, values.shape[3]), f32) for (values, _), _ in convolutions]
    results = outputs + [jax.ShapeDtypeStruct(conv_rows.shape, f32)]

    def weight(pair):
        return pair if kind == "int8" else pair[:1]

    operands = [x, *weight(gate), *weight(kernel), mult_bias, conv_rows]
    # The new conv rows are written over the cached ones (a donated cache is updated in place).
    aliases = {len(operands) - 1: len(convolutions)}
    for pair, bias in convolutions:
        operands += [*weight(pair), bias]
    variant = f"projections{len(convolutions)}"
    if attention is not None:
        name, keys, values, *rest = attention
        variant = name
        results.append(jax.ShapeDtypeStruct((batch, n_modules * module), f32))
        if name == "self":
            index, key_mask = rest
            aliases.update({len(operands): len(results), len(operands) + 1: len(results) + 1})
            results += [jax.ShapeDtypeStruct(keys.shape, f32), jax.ShapeDtypeStruct(values.shape, f32)]
            operands += [keys, values, jnp.asarray(index, jnp.int32), key_mask.astype(bool)]
        else:
            (bias,) = rest
            operands += [keys, values, bias.reshape(batch, keys.shape[2])]
    call = jax.ffi.ffi_call(
        TARGETS[f"sparse_attention_{variant}", kind], results, vmap_method="sequential", input_output_aliases=aliases
    )
    out = call(*operands)
    n = len(convolutions)
    return list(out[:n]), out[n], (tuple(out[n + 1 :]) or None)


def lsh_decode_attention(
    q, keys, key_scale, values, value_scale, buckets, lists, counts, recent, recent_count, q_buckets
):
    """An LSH layer's decode-step attention over the past keys it keeps (``terra/layers/lsh_bucket_lists.py``,
    ``select_from_bucket_lists``), in one call that reads each kept row of the cache where it lies.

    ``q f32 [B, H, Dh]`` scaled by ``Dh ** -0.5``; ``keys``, ``values`` ``[B, H, L, Dh]`` float32,
    int8 (with ``key_scale``, ``value_scale`` ``f32 [B, H, L]``) or uint16 bfloat16 bits (scales
    ``None``); ``buckets s32 [B, H, R, L]`` (−1: none); ``lists s32 [B, H, R, NB, C]`` and ``counts
    s32 [B, H, R, NB]``, the per-bucket ring buffers; ``recent s32 [B, C]``, ``recent_count s32 [B]``;
    ``q_buckets s32 [B, H, R]`` (−1: a padded query). ``R`` <= :data:`MAX_LSH_ROUNDS`. Returns
    ``(out f32 [B, H, Dh], top f32 [B, H], total f32 [B, H])``: over the kept keys j with logits
    ``l_j``, ``top = max l_j`` (−1e30 if none), ``total = sum exp(l_j - top)`` and ``out = sum
    exp(l_j - top) v_j``, for the caller to join with the query's own key."""
    i32 = lambda t: jnp.asarray(t, jnp.int32)  # noqa: E731
    lists_and_buckets = (buckets, lists, counts, recent, recent_count, q_buckets)
    return _softmax_terms_call(
        "lsh_decode_attention", q, keys, key_scale, values, value_scale, *map(i32, lists_and_buckets)
    )


def cache_attention(q, keys, key_scale, values, value_scale, bias, visible):
    """A decode step's attention over a whole KV cache (``cache_attention.h``) in one call: each
    (batch row, head)'s query against the cache's first ``visible`` positions, each row widened in
    registers as it is read, the heads shared between the pool's threads.

    ``q f32 [B, H, Dh]`` scaled by ``Dh ** -0.5``; ``keys``, ``values`` ``[B, H, L, Dh]`` float32,
    int8 (with ``key_scale``, ``value_scale`` ``f32 [B, H, L]``) or uint16 bfloat16 bits (scales
    ``None``); ``bias f32 [B, L]`` added to every head's logits (``MASK_VALUE`` for a hidden
    position); ``visible int32 []``: positions ``>= visible`` are neither read nor attended to.
    ``Dh`` <= :data:`MAX_CACHE_HEAD_SIZE`. Returns ``(out f32 [B, H, Dh], top f32 [B, H], total f32
    [B, H])`` over the visible positions j with logits ``l_j``: ``top = max l_j`` (−1e30 if none),
    ``total = sum exp(l_j - top)``, ``out = sum exp(l_j - top) v_j``, for the caller to join with
    the query's own key and normalise."""
    rest = (bias.astype(jnp.float32), jnp.asarray(visible, jnp.int32))
    return _softmax_terms_call("cache_attention", q, keys, key_scale, values, value_scale, *rest)


def _softmax_terms_call(kernel: str, q, keys, key_scale, values, value_scale, *rest):
    """A decode attention over a cache stored as ``keys.dtype`` (:data:`CACHE_KINDS`; the scales
    passed for int8 only), its results the softmax's terms ``(out [B, H, Dh], top [B, H], total
    [B, H])``: :func:`lsh_decode_attention`'s and :func:`cache_attention`'s call."""
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    kind = str(keys.dtype)
    batch, heads, dh = q.shape
    f32 = jnp.float32
    results = [jax.ShapeDtypeStruct((batch, heads, dh), f32)] + [jax.ShapeDtypeStruct((batch, heads), f32)] * 2
    scaled = (keys, key_scale, values, value_scale) if kind == "int8" else (keys, values)
    call = jax.ffi.ffi_call(TARGETS[kernel, kind], results, vmap_method="sequential")
    out, top, total = call(q.astype(f32), *scaled, *rest)
    return out, top, total


def blocked_attention(q, k, v, bias, causal: bool):
    """Softmax attention over a whole input in one call: each of the pool's threads takes blocks of
    64 queries of one head against tiles of :data:`ATTENTION_KEY_TILE` keys with an online softmax,
    its scores never leaving the core's cache (``prefill_attention.h``).

    ``q f32 [B, H, Lq, Dh]`` scaled by ``Dh ** -0.5``, ``k``, ``v`` ``f32 [B, H, Lk, Dh]``, ``bias f32
    [B, Lk]`` added to every query's logits; ``causal`` (``Lq == Lk``): query ``i`` sees keys ``j <= i``.
    ``Dh`` a multiple of 16. Returns ``f32 [B, H, Lq, Dh]``."""
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    batch, heads, length, dh = k.shape
    tile = ATTENTION_KEY_TILE
    tiles = -(-length // tile)
    # Keys transposed per tile, [B, H, T, Dh, K]: a tile's keys are contiguous along the vector lanes.
    padded = jnp.pad(k, ((0, 0), (0, 0), (0, tiles * tile - length), (0, 0)))
    kt = jnp.swapaxes(padded.reshape(batch, heads, tiles, tile, dh), 3, 4)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGETS["blocked_attention", bool(causal)], out, vmap_method="sequential")
    return call(q, kt, v, bias)


def lsh_chunk_attention(q, k, v, positions, valid, before: int, after: int, causal: bool):
    """An LSH layer's attention over its sorted entries in one call (``terra/layers/lsh_chunked_attention.py``,
    ``lsh_attention``): each chunk of ``C`` entries against its own and its ``before`` previous and
    ``after`` next chunks (cyclically), with the layer's masks (its own position −1e5, a later
    position when ``causal`` and a padding key −1e9), softmax over the window.

    ``q``, ``k``, ``v`` ``f32 [B, H, N, C, Dh]`` (``k`` length-normalised and scaled by ``Dh **
    -0.5``), ``positions`` and ``valid`` ``[B, H, N, C]`` (each entry's position, and 1 for a real
    key). ``Dh`` and ``C`` multiples of 16. Returns ``(out f32 [B, H, N, C, Dh], lse f32 [B, H, N, C])``."""
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    f32 = jnp.float32
    results = [jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct(q.shape[:-1], f32)]
    call = jax.ffi.ffi_call(TARGETS["lsh_chunk_attention", "float32"], results, vmap_method="sequential")
    i32 = lambda t: jnp.asarray(t, jnp.int32)  # noqa: E731
    # Each chunk's keys transposed, [B, H, N, Dh, C]: a chunk's keys lie along the vector lanes.
    kt = jnp.swapaxes(k, -1, -2)
    return call(q, kt, v, i32(positions), i32(valid), before=int(before), after=int(after), causal=bool(causal))


def lsh_hash(vecs, rotations, factors) -> jax.Array:
    """An LSH layer's angular hash in one call (``terra/layers/lsh_hashing.py``, ``hash_vectors``):
    ``vecs f32 [B, H, L, D]``, ``rotations f32 [H, D, R, sum(factors) / 2]`` -> buckets ``s32 [B, H,
    R, L]``, per round ``sum_f radix_f · argmax([x R_f, -x R_f])`` (the first index of the maximum,
    NaN counting as the maximum). At most ``MAX_LSH_FACTORS`` even factors."""
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    batch, heads, length, _ = vecs.shape
    rotation_heads, depth, rounds, half = rotations.shape
    # The rounds' columns side by side, padded to whole vectors of 16 (lsh_hash.h).
    columns = jnp.asarray(rotations, jnp.float32).reshape(rotation_heads, depth, rounds * half)
    width = -(-(rounds * half) // 16) * 16
    columns = jnp.pad(columns, ((0, 0), (0, 0), (0, width - rounds * half)))
    out = jax.ShapeDtypeStruct((batch, heads, rounds, length), jnp.int32)
    call = jax.ffi.ffi_call(TARGETS["lsh_hash", "float32"], out, vmap_method="sequential")
    return call(jnp.asarray(vecs, jnp.float32), columns, factors=np.asarray(factors, np.int64))


def module_convolution(u, kernel, bias) -> jax.Array:
    """A sparse-QKV layer's convolution over a whole sequence in one call (``terra/layers/sparse_qkv.py``,
    ``convolve_modules``): ``u f32 [B, L, S, M]``, ``kernel f32 [F, k, M, N]`` (``k`` odd, ``N`` a
    multiple of 16), ``bias f32 [N]`` -> ``f32 [B, L, S, N]``, causal in length (``F - 1`` zero rows
    before the start) with the module axis zero-padded by ``(k - 1) / 2`` on each side."""
    if _library() is None:
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    f32 = jnp.float32
    out = jax.ShapeDtypeStruct(tuple(u.shape[:3]) + (kernel.shape[-1],), f32)
    call = jax.ffi.ffi_call(TARGETS["module_convolution", "float32"], out, vmap_method="sequential")
    return call(jnp.asarray(u, f32), jnp.asarray(kernel, f32), jnp.asarray(bias, f32))


def _call(product: str, kind: str, out_shape, x, values, scale, *rest) -> jax.Array:
    if _library() is None:  # loads and registers the targets on first use
        raise RuntimeError("terra's native kernels are not available; check kernels.available() first")
    out = jax.ShapeDtypeStruct(tuple(out_shape), jnp.float32)
    # "sequential": under vmap, one call per batch element, each the unbatched product; correct
    # whichever operands are batched. Nothing in terra vmaps these products.
    call = jax.ffi.ffi_call(TARGETS[product, kind], out, vmap_method="sequential")
    return call(x, values, scale, *rest) if kind == "int8" else call(x, values, *rest)

"""Sparse feed-forward block (paper §3.1; reference behaviour in ``docs/design/reference_code.md`` §1).

A low-rank controller picks one unit in every block of ``N`` feed-forward units; only those
``d_ff / N`` units are active, so decoding reads ``d_ff / N`` rows of each weight matrix:

  logits = reshape(x·C1·C2 + b_c, [..., d_ff/N, N])          (no nonlinearity between C1, C2)
  train:  idx = argmax(log_softmax(logits) + temperature·Gumbel)
          m   = straight-through one-hot(idx) on a fraction quant_prob of calls, softmax otherwise
  eval:   m   = one-hot(argmax(logits))
  out     = relu((x·W1) ⊙ m) · W2 + b2                         (no first-layer bias)
  decode: gather the d_ff/N selected rows of W1 and W2 and multiply only those.

W1 and W2 are both stored as ``[d_ff/N, N, d_model]``: unit ``(block i, element j)`` is row
``(i, j)`` of each, so a decode gather reads ``d_ff/N`` contiguous rows of ``d_model`` floats.

``ff_chunk_size`` (the reference's, §1.1; 512 in its Terraformer configs, §5.2) cuts the
flattened tokens into chunks of at most that many and runs them one after another in a scan
whose body is rematerialised, so the ``[tokens, d_ff]`` activations exist one chunk at a time
in the forward and the backward pass (what bounds memory on 16k-token inputs). Each chunk
draws its own Gumbel noise, its own hard/soft straight-through coin and its own dropout mask;
evaluation and decoding compute the same per-token function either way.
"""

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from terra import backends
from terra.backends import (
    as_float,
    gathered_rows_product,
    gathered_rows_sum,
    input_major_product,
    output_major_product,
    take_rows,
)
from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.dense import BIAS_INIT, Dense
from terra.layers.initializers import glorot_uniform
from terra.layers.selection import (
    block_argmax,
    expected_distinct_choices,
    gumbel_block_argmax,
    straight_through_mask,
)


def sparse_ff_sizes(d_ff: int, ff_sparsity: int, d_lowrank: Optional[int]):
    """``(n_blocks, d_lowrank)``, validated; ``d_lowrank`` defaults to ``d_ff // N`` as the
    reference (the paper says "usually d_model/N")."""
    if ff_sparsity <= 0 or d_ff % ff_sparsity:
        raise ConfigError(
            f"SparseFeedForward: d_ff={d_ff} is not divisible by ff_sparsity={ff_sparsity}; pick N dividing "
            f"d_ff (e.g. {[n for n in (16, 32, 64, 128, 256) if d_ff % n == 0]}) or change TransformerConfig.d_ff."
        )
    n_blocks = d_ff // ff_sparsity
    d_lowrank = n_blocks if d_lowrank is None else d_lowrank
    if d_lowrank <= 0:
        raise ConfigError(f"SparseFeedForward: d_lowrank={d_lowrank} must be positive.")
    return n_blocks, d_lowrank


def chunk_layout(n_tokens: int, ff_chunk_size: int):
    """``(n_chunks, chunk_len)`` for ``n_tokens`` flattened tokens: ``ceil(n_tokens /
    ff_chunk_size)`` chunks of equal length (at most ``ff_chunk_size``; the tokens are padded by
    fewer than ``n_chunks`` to fill them). The reference runs the whole call as one chunk when
    the size does not divide the tokens; equal padded chunks keep the memory bound instead."""
    n_chunks = max(1, math.ceil(n_tokens / ff_chunk_size))
    return n_chunks, max(1, math.ceil(n_tokens / n_chunks))


def to_chunks(a: jax.Array, n_chunks: int, chunk_len: int) -> jax.Array:
    """``[tokens, ...] -> [n_chunks, chunk_len, ...]``, zero-padded; chunk ``j`` holds tokens
    ``j, j + n_chunks, j + 2·n_chunks, ...``. Striding (rather than cutting contiguous runs)
    keeps the batch's data-parallel shards on the within-chunk axis, so every device works on
    every chunk instead of the scan walking over one device's tokens at a time."""
    pad = n_chunks * chunk_len - a.shape[0]
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape((chunk_len, n_chunks) + a.shape[1:]).swapaxes(0, 1)


def from_chunks(a: jax.Array, n_tokens: int) -> jax.Array:
    """Inverse of :func:`to_chunks`: ``[n_chunks, chunk_len, ...] -> [n_tokens, ...]``."""
    a = a.swapaxes(0, 1)
    return a.reshape((-1,) + a.shape[2:])[:n_tokens]


class SparseFeedForward(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]`` (the feed-forward swap point).

    Attributes (paper/reference names):
      ff_sparsity: N, units per block; one per block is active.
      d_lowrank: controller bottleneck; ``None`` means ``d_ff // N``.
      temperature: scale of the Gumbel noise in training (0 gives the eval choice).
      quant_prob: probability that a training call uses the hard straight-through mask.
      paper_formula: use the paper's ``max(0, x·W1 + b1) ⊙ m`` (first-layer bias, mask after
        the ReLU) instead of the reference's ``relu(x·W1 ⊙ m)``.
      ff_chunk_size: 0 (default) computes the whole call at once with one straight-through
        coin; ``C > 0`` scans over chunks of at most ``C`` flattened tokens, each with its own
        coin, Gumbel noise and dropout mask, its activations rematerialised in the backward
        pass (the reference's ``ff_chunk_size``; the Terraformer configs use 512). Evaluation
        and decoding give the same outputs for any value.
      gathered_inference: a deterministic call (evaluation, a prefill) whose narrow weights a
        backend's fused decode step takes (int8 or bfloat16 on the CPU) runs that step over chunks
        of as many tokens as it takes, computing each token's chosen unit per block only (a
        1/N of the masked form's products; the same choices and outputs within float32
        rounding); False keeps the masked form.
      inference_chunk_size: a deterministic call (evaluation, a prefill) over more flattened
        tokens than this, with ``ff_chunk_size`` 0, runs in chunks of at most this many (the same
        outputs: nothing is drawn), so that a 15,360-token prefill holds one chunk's ``[tokens,
        d_ff]`` activations and masks, not the whole input's (hundreds of MB each); 0 never chunks.
      share_dropout_over_length: the output dropout draws one mask for all the tokens of a
        chunk (of the call when ``ff_chunk_size`` is 0) if True, as the reference's
        ``Dropout(shared_axes=[-2])`` over the flattened ``[tokens, d_model]`` chunk, or one
        mask per token if False (the reference layer's default ``dropout_shared_axes=None``).

    ``__call__(x, *, deterministic, decode, indices=None)``: ``indices`` ``[batch, length,
    d_ff/N]`` forces the block choices (a reversible layer replays its forward decisions);
    the choices made are sown as ``intermediates/indices``.
    """

    d_model: int
    d_ff: int
    dropout_rate: float = 0.0
    ff_dropout_rate: float = 0.0  # unused: the reference applies only the block dropout here
    dtype: jnp.dtype = jnp.float32
    ff_sparsity: int = 64
    d_lowrank: Optional[int] = None
    temperature: float = 0.1
    quant_prob: float = 0.3
    paper_formula: bool = False
    ff_chunk_size: int = 0
    share_dropout_over_length: bool = False
    inference_chunk_size: int = 512
    gathered_inference: bool = True

    def setup(self):
        n_blocks, d_lowrank = sparse_ff_sizes(self.d_ff, self.ff_sparsity, self.d_lowrank)
        for name in ("ff_chunk_size", "inference_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(
                    f"SparseFeedForward: {name}={value!r} must be a non-negative integer "
                    "(0 = the whole call at once; the reference's Terraformer uses ff_chunk_size = 512)."
                )
        shape = (n_blocks, self.ff_sparsity, self.d_model)
        names = (axes.MLP, axes.SPARSE_ELEMENTS, axes.EMBED)
        self.controller_down = Dense(
            d_lowrank, kernel_axes=(axes.LOWRANK, axes.EMBED), use_bias=False, dtype=self.dtype, name="controller_down"
        )
        # C2 is stored input-major, [d_lowrank, d_ff/N, N]: with its short contraction
        # (d_lowrank) XLA:CPU reads it faster than output-major (docs/architecture.md).
        self.controller_up = self.param(
            "controller_up",
            nn.with_logical_partitioning(
                glorot_uniform(d_lowrank, self.d_ff), (axes.LOWRANK, axes.MLP, axes.SPARSE_ELEMENTS)
            ),
            (d_lowrank, n_blocks, self.ff_sparsity),
        )
        self.controller_bias = self.param(
            "controller_bias",
            nn.with_logical_partitioning(BIAS_INIT, (axes.MLP, axes.SPARSE_ELEMENTS)),
            (n_blocks, self.ff_sparsity),
        )
        self.wi = self.param("wi", nn.with_logical_partitioning(glorot_uniform(self.d_model, self.d_ff), names), shape)
        self.wo = self.param("wo", nn.with_logical_partitioning(glorot_uniform(self.d_ff, self.d_model), names), shape)
        self.wo_bias = self.param("wo_bias", nn.with_logical_partitioning(BIAS_INIT, (axes.EMBED,)), (self.d_model,))
        if self.paper_formula:
            self.wi_bias = self.param("wi_bias", nn.with_logical_partitioning(BIAS_INIT, names[:2]), shape[:2])
        # Applied to the flattened [tokens, d_model] chunk as the reference, so a shared mask
        # serves every token of the chunk.
        self.dropout = nn.Dropout(
            self.dropout_rate, broadcast_dims=axes.dropout_broadcast_dims(self.share_dropout_over_length)
        )

    def controller_logits(self, x: jax.Array) -> jax.Array:
        """``[..., d_model] -> [..., d_ff/N, N]`` float32."""
        low = self.controller_down(x)
        up = self.controller_up  # [d_lowrank, d_ff/N, N], input-major
        logits = input_major_product(low.astype(self.dtype), up).reshape(low.shape[:-1] + up.shape[1:])
        return (logits + self.controller_bias).astype(jnp.float32)

    def __call__(
        self,
        x: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
        indices: Optional[jax.Array] = None,
    ) -> jax.Array:
        train = not deterministic
        if decode:  # one token per row: nothing to chunk
            y, indices = self.forward_tokens(x, indices, train, decode=True)
        else:
            # The reference flattens the tokens (BatchLeadingAxes) before chunking and dropout.
            tokens = x.reshape(-1, x.shape[-1])
            given = None if indices is None else indices.reshape(tokens.shape[0], -1)
            chunk, gathered = self._chunking(tokens, given, train)
            if chunk:
                y, indices = self._chunked(tokens, given, train, chunk, decode=gathered)
            else:
                y, indices = self.forward_tokens(tokens, given, train, decode=gathered)
            y = y.reshape(x.shape[:-1] + y.shape[-1:])
            indices = indices.reshape(x.shape[:-1] + indices.shape[-1:])
        self.sow("intermediates", "indices", indices)
        return y

    def _chunking(self, tokens, given, train: bool):
        """``(chunk size, 0 for the whole call; whether each chunk runs the decode step)`` for a
        full-sequence call on ``tokens [n, d_model]``: the fused step's rows for a deterministic
        call it takes (``gathered_inference``), else ``ff_chunk_size``, else for a deterministic
        call ``inference_chunk_size`` when the tokens outnumber it."""
        n = tokens.shape[0]
        if not train and given is None and self.gathered_inference:
            rows = self._fused_rows(tokens)
            if rows:
                return (rows if n > rows else 0), True
        if train or self.ff_chunk_size:
            return self.ff_chunk_size, False
        return (self.inference_chunk_size if 0 < self.inference_chunk_size < n else 0), False

    def forward_tokens(self, x, indices, train: bool, decode: bool = False):
        """``[tokens, d_model]`` (``[..., d_model]`` in decode) -> (output after dropout, block
        choices ``[tokens, d_ff/N]``): one call's (or one chunk's) worth, with one
        straight-through coin."""
        if decode and indices is None and not train:
            fused = self._fused_decode(x)
            if fused is not None:
                return fused
        logits = self.controller_logits(x)
        # The Gumbel key is drawn even when indices are given, so that the later draws (the
        # straight-through coin, dropout) see the same keys in a reversible layer's recomputation
        # with stored indices as in its forward pass.
        gumbel_rng = self.make_rng("dropout") if train and self.temperature > 0 else None
        if indices is None:
            if gumbel_rng is not None:
                indices = gumbel_block_argmax(logits, self.temperature, gumbel_rng)
            else:
                indices = block_argmax(logits)
        if decode:
            y = self._gathered(x, indices)
        else:
            y = self._masked(x, logits, indices, train)
        return self.dropout(y.astype(self.dtype), deterministic=not train), indices

    def _chunked(self, x, indices, train: bool, chunk_size: int, decode: bool = False):
        """``forward_tokens`` over chunks of at most ``chunk_size`` tokens (see :func:`to_chunks`),
        in a scan whose body is rematerialised: one chunk's ``[chunk, d_ff]`` activations live
        at a time, forward and backward (the reference's ``tl.Chunk``: a ``Scan`` with
        ``remat=True``). The parameters are shared by the chunks; the ``dropout`` rng is split
        per chunk, so each draws its own noise, coin and mask. ``decode``: each chunk runs the
        decode step (the chosen units only; deterministic calls)."""
        n_tokens = x.shape[0]
        n_chunks, chunk_len = chunk_layout(n_tokens, chunk_size)
        xs = nn.with_logical_constraint(to_chunks(x, n_chunks, chunk_len), (None, axes.BATCH, axes.EMBED))
        given = None if indices is None else to_chunks(indices, n_chunks, chunk_len)
        if not train:
            y, chosen = self._chunked_in_place(xs, given, n_chunks, decode)
            return from_chunks(y, n_tokens), from_chunks(chosen, n_tokens)

        def body(module, carry, chunk):
            return carry, module.forward_tokens(*chunk, train, decode=decode)

        scan = nn.scan(
            nn.remat(body, prevent_cse=False),
            variable_broadcast="params",
            split_rngs={"params": False, "dropout": True},
            length=n_chunks,
        )
        _, (y, chosen) = scan(self, None, (xs, given))
        return from_chunks(y, n_tokens), from_chunks(chosen, n_tokens)

    def _chunked_in_place(self, xs, given, n_chunks: int, decode: bool):
        """A deterministic ``_chunked``: each chunk's output overwrites its input chunk in the
        scan's carry ``[n_chunks, chunk_len, d_model]``, which starts as a copy of ``xs``. A scan's
        stacked output starts as zeros that XLA shares between the layers and copies for each,
        early in the program: a 15,360-token prefill of 24 such layers held 24 of those 63 MB
        copies at once (1.5 GB); a copy of ``xs`` is made only when the layer runs."""

        def body(module, ys, chunk):
            j, chunk_given = chunk
            chunk_x = lax.dynamic_index_in_dim(ys, j, keepdims=False)
            y, chosen = module.forward_tokens(chunk_x, chunk_given, False, decode)
            return lax.dynamic_update_index_in_dim(ys, y.astype(ys.dtype), j, 0), chosen

        scan = nn.scan(body, variable_broadcast="params", split_rngs={"params": False}, length=n_chunks)
        return scan(self, xs.astype(self.dtype), (jnp.arange(n_chunks), given))

    def _masked(self, x, logits, indices, train: bool):
        """Every unit computed, inactive ones zeroed by the mask (training and eval)."""
        if train:  # softmax at temperature 1, one hard/soft draw per call (§1.3)
            mask = straight_through_mask(logits, indices, self.quant_prob, self.make_rng("dropout"))
        else:
            mask = jax.nn.one_hot(indices, self.ff_sparsity, dtype=jnp.float32)
        # 2-D products over the row-major [d_ff, d_model] views (free reshapes; see dense.py).
        wi = as_float(self.wi, self.dtype).reshape(self.d_ff, self.d_model)
        mid = output_major_product(x.astype(self.dtype), wi)
        mid = mid.reshape(mid.shape[:-1] + mask.shape[-2:])
        if self.paper_formula:
            h = nn.relu(mid + self.wi_bias) * mask.astype(self.dtype)
        else:
            h = nn.relu(mid * mask.astype(self.dtype))
        # x is [tokens, d_model] (flattened; a chunk's in to_chunks' layout): the batch's shards.
        tokens = (axes.BATCH, axes.LENGTH)[: h.ndim - 2]
        h = nn.with_logical_constraint(h, tokens + (axes.MLP, axes.SPARSE_ELEMENTS))
        h = h.reshape(h.shape[:-2] + (self.d_ff,))
        return h @ as_float(self.wo, self.dtype).reshape(self.d_ff, self.d_model) + self.wo_bias

    def _fused_weights(self):
        return backends.SparseFeedForwardWeights(
            self.controller_down.stored_weights(),
            self.controller_up,
            self.controller_bias,
            self.wi,
            self.wo,
            self.wo_bias,
        )

    def _fused_rows(self, x):
        """Tokens per call of a backend's fused step for these weights, 0 where none applies."""
        if self.paper_formula or self.dtype != jnp.float32:
            return 0
        return backends.fused_feed_forward_rows(x, self._fused_weights())

    def _fused_decode(self, x):
        """Decode as one backend call where a backend fuses this layer's weights (narrow weights on
        the CPU: ``backends.sparse_feed_forward_step``), the same floats as the controller, the
        choice and the gathered products computed one by one; ``None`` where it does not apply
        (float32 weights, more rows than the kernels take), and for the paper's first-layer bias
        or a narrower compute dtype, which the fused step does not compute."""
        if self.paper_formula or self.dtype != jnp.float32:
            return None
        weights = self._fused_weights()

        def unfused(x):
            chosen = block_argmax(self.controller_logits(x))
            return self._gathered(x, chosen).astype(self.dtype), chosen

        return backends.sparse_feed_forward_step(x, weights, unfused)

    def _gathered(self, x, indices):
        """Decode: read only the selected row of every block of W1 and W2."""
        n_blocks = self.d_ff // self.ff_sparsity
        flat = indices + jnp.arange(n_blocks) * self.ff_sparsity  # [..., n_blocks] rows of [d_ff, d]
        mid = gathered_rows_product(x.astype(self.dtype), self.wi.reshape(self.d_ff, self.d_model), flat)
        if self.paper_formula:
            mid = mid + take_rows(self.wi_bias.reshape(self.d_ff), flat)
        return gathered_rows_sum(nn.relu(mid), self.wo.reshape(self.d_ff, self.d_model), flat) + self.wo_bias

    @staticmethod
    def params_read_per_token(params, batch: int = 1) -> int:
        """Parameters one decode step of ``batch`` sequences reads: the controller, the output
        bias, and of W1 and W2 (``[n_blocks, N, d_model]``) the rows the sequences select — one
        per block each, their union read once: ``expected_distinct_choices(N, batch)`` rows per
        block for sequences choosing independently and uniformly (one row at batch 1), and as
        many of the selected first-layer biases. Rounded to a whole parameter."""
        n_blocks, n, d_model = params["wi"].shape
        controller = sum(
            x.size
            for x in jax.tree.leaves([params["controller_down"], params["controller_up"], params["controller_bias"]])
        )
        rows = n_blocks * expected_distinct_choices(n, batch)  # of W1, and as many of W2
        read = controller + 2 * rows * d_model + params["wo_bias"].size
        return round(read + (rows if "wi_bias" in params else 0))

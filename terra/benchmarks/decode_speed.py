"""Decode speed of the paper's models on this CPU (batch 1, or batches of sequences), against its
memory bandwidth.

  terra-bench decode --preset paper_800m --out out/decode_speed
  terra-bench decode --preset paper_17b_block --out out/decode_17b
  terra-bench decode --gin_file=models/fully_sparse_800m.gin      # one config
  ... --config.tokens=20 --config.repeats=5                        # override a preset's field

Protocol (the reference's, ``docs/design/reference_code.md`` §6): random weights; prefill a 16-token
encoder input; warm up (compiles and runs a few steps); then, per repetition, prefill again and
time ``tokens`` single-token calls, each returning the logits to the host, which picks the next
token (``DecodeSession.step``: the step inside a jitted loop that takes each token from the
host), the first two not counted. The same tokens are also timed inside one jitted
``while_loop`` (``IncrementalDecoder.generate_tokens``, what generation runs): per repetition,
the loop for ``tokens`` steps minus the loop for the first two, per step, which leaves out the
round trip to the host for each token. Reports the median
and minimum seconds per token (step protocol), the in-loop seconds per token, seconds per
decoder block, the FLOPs of a step (XLA's count) and the bytes
each token must read (the parameters the decode step touches, by layer, plus every cache it
reads), the achieved GB/s and the fraction of the machine's measured read bandwidth. Writes
``decode_speed.{json,md,png}`` and ``machine.json`` to ``--out``.

With ``--config.baseline_beside`` (the quantized presets) the dense row is timed first and kept,
and its generation loop is timed again right after each repetition of every other row's: the
speed-up "dense beside" is the ratio of two loops that ran in the same minutes, which a shared
machine's drifting bandwidth does not move the way it moves rows timed minutes apart.

With ``--config.input_lengths`` (the ``long_document`` preset) every row is timed at each of those
encoder input lengths: per row and length the prefill seconds, the in-loop ms per generated token,
the bytes each token reads from the weights and from the caches (``cache_reads_per_token``: what
the step really reads, e.g. only the kept rows of an LSH cache) with the floor each sets, and the
row's peak resident memory. A row whose estimated memory (``estimate_memory``) exceeds what the
machine has, or that runs out of memory, is recorded as ``skipped`` with the reason and the run
goes on. ``--config.time_calls=False`` leaves out the per-call step protocol (the in-loop time
stands; one prefill per repetition, timed, whose cache both of its loops continue).

With ``--config.batch_sizes`` (the ``batched_800m`` preset; e.g. ``--config.batch_sizes=1,16``)
every row is timed at each batch size B, decoding B sequences at once from random (seeded) inputs
``[B, input_length]``. Every result carries ``batch_size`` (1 without batch sizes); a batched
row's step fields (``seconds_per_token_median`` per call, ``seconds_per_token_loop`` in the loop,
``*bytes_per_token``, ``flops_per_token``, the floors) are those of one step of all B rows, and
``batched_fields`` adds the in-loop step per sequence and tokens per second. A step reads each
weight once, except the rows a sparse layer selects per sequence: their expected union over B
sequences choosing independently and uniformly (``Model.params_read_per_token(batch)``); each
sequence reads its own caches. Speed-ups compare rows at the same batch size. Batch sizes are
refused beside ``input_lengths``, ``baseline_beside`` and block_mode 'difference'.

The decoder's self-attention cache is sized from the tokens decoded (``decoder_cache_length``;
at least the reference's 32 slots in the paper presets), never from the input: an
encoder-decoder's does not grow with the input, and a Terraformer's caches add the input's
positions themselves. An input or a decode longer than the model's positional table
(``TransformerConfig.max_len``) is one ``ConfigError`` naming the binding to raise.
"""

import dataclasses
import gc
import json
import math
import os
import time
import types
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from terra import errors, process_memory
from terra.backends import native_kernels
from terra.backends.decode_state import LSHCache
from terra.benchmarks import report
from terra.benchmarks.bandwidth import describe_machine, measure_product_gflops, measure_read_bandwidth
from terra.decoding.decode_session import DecodeSession
from terra.decoding.decode_step import IncrementalDecoder
from terra.gin_config import parsing
from terra.quantization import check_weights_dtype, quantize_leaf, quantize_params


def measured_difference(long_s: Sequence[float], short_s: Sequence[float], steps: int) -> Optional[float]:
    """Seconds per step from paired timings of a loop over more steps (``long_s``) and over
    fewer (``short_s``), ``steps`` apart: the median of the per-repetition differences, or
    None when noise dominates it — the median is not positive, or the differences scatter
    around it by more than half of it (their median absolute deviation, which one slow
    repetition does not move)."""
    differences = [(a - b) / steps for a, b in zip(long_s, short_s)]
    median = float(np.median(differences))
    scatter = float(np.median([abs(d - median) for d in differences]))
    if median <= 0 or scatter > median / 2:
        return None
    return median


@dataclasses.dataclass
class DecodeTiming:
    """Seconds of each timed call. ``loop_s`` holds, per repetition, the generation loop over
    all the tokens and over the first ``skip`` of them; their difference is the in-loop time."""

    prefill_s: List[float]
    token_s: List[float]
    loop_s: List[Tuple[float, float]] = dataclasses.field(default_factory=list)
    loop_steps: int = 1
    # The baseline's loops over the same step counts, timed right after each repetition's own.
    beside_loop_s: List[Tuple[float, float]] = dataclasses.field(default_factory=list)

    @property
    def median_token_s(self) -> Optional[float]:
        """Median seconds of one jitted ``step`` call; None where calls were not timed."""
        return float(np.median(self.token_s)) if self.token_s else None

    @property
    def min_token_s(self) -> Optional[float]:
        return float(np.min(self.token_s)) if self.token_s else None

    def _per_step(self, pairs: List[Tuple[float, float]]) -> Optional[float]:
        if not pairs:
            return None
        return measured_difference([a for a, _ in pairs], [b for _, b in pairs], self.loop_steps)

    @property
    def median_loop_token_s(self) -> Optional[float]:
        """In-loop seconds per token, or None when the loop's jitter hides it (tiny models)."""
        return self._per_step(self.loop_s)

    @property
    def median_beside_loop_token_s(self) -> Optional[float]:
        """The baseline's in-loop seconds per token timed beside this row (None: not timed, or
        lost in jitter)."""
        return self._per_step(self.beside_loop_s)

    def summary(self) -> dict:
        return {
            "prefill_median_s": float(np.median(self.prefill_s)),
            "token_median_s": self.median_token_s,
            "token_min_s": self.min_token_s,
            "loop_token_median_s": self.median_loop_token_s,
            "timed_tokens": len(self.token_s),
        }


PER_CALL = "DecodeSession.step"


def measure_decode(
    decoder: IncrementalDecoder,
    params,
    encoder_input_tokens,
    *,
    n_tokens: int = 12,
    n_skip: int = 2,
    n_warmup: int = 4,
    repeats: int = 3,
    beside: Optional[Callable[[int], float]] = None,
    time_calls: bool = True,
) -> DecodeTiming:
    """Times ``prefill``, each greedy ``step`` (``n_tokens`` per repetition, the first
    ``n_skip`` of each not counted) and the in-loop time per token of ``generate_tokens``
    (one value per repetition: the loop over ``n_tokens`` minus the loop over ``n_skip``).
    ``beside``: another model's ``generation_loop``, timed over the same step counts right after
    each repetition's own loops, so that a ratio of the two compares the same minutes of a
    shared machine. ``time_calls=False``: no ``step`` calls (``token_s`` stays empty: at long
    inputs they would take as long again) and one prefill per repetition (timed) whose cache the
    loop over ``n_skip`` steps and then the loop over ``n_tokens`` continue (``chained_loops``; the
    decoder needs ``n_skip + n_tokens`` slots), instead of a prefill for each loop; no ``beside``."""
    if n_tokens <= n_skip:
        raise ValueError(f"n_tokens={n_tokens} must exceed the {n_skip} untimed tokens.")
    needed = n_tokens if time_calls else n_tokens + n_skip
    if needed > decoder.max_decode_length:
        raise ValueError(f"{needed} steps per prefill exceed max_decode_length={decoder.max_decode_length}.")
    if beside is not None and not time_calls:
        raise ValueError("beside is timed with each loop's own prefill: leave time_calls on.")
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    batch = inputs.shape[0]
    timing = DecodeTiming([], [], loop_steps=n_tokens - n_skip)
    if not time_calls:
        chained_loops(decoder, params, inputs, [n_skip])  # compiles prefill and loop
        for _ in range(repeats):
            prefill, (short, long) = chained_loops(decoder, params, inputs, [n_skip, n_tokens])
            timing.prefill_s.append(prefill)
            timing.loop_s.append((long, short))
        return timing

    def run(n: int, timed: bool, timing: DecodeTiming):
        t0 = time.perf_counter()
        cache = jax.block_until_ready(decoder.prefill(params, inputs))
        if timed:
            timing.prefill_s.append(time.perf_counter() - t0)
        # One call per token, the host choosing each token (the paper's protocol), through the
        # session API terra offers for it (terra.decoding.decode_session).
        with DecodeSession(decoder, params, cache) as session:
            token = np.zeros((batch,), np.int32)
            for i in range(n):
                t0 = time.perf_counter()
                logits = session.step(token)
                if timed and i >= n_skip:
                    timing.token_s.append(time.perf_counter() - t0)
                token = logits.argmax(-1)

    loop = generation_loop(decoder, params, inputs)
    run(min(n_warmup, decoder.max_decode_length), False, timing)
    loop(n_skip)  # compiles; the step count is traced, so both lengths share it
    for _ in range(repeats):
        run(n_tokens, True, timing)
        timing.loop_s.append((loop(n_tokens), loop(n_skip)))
        if beside is not None:
            timing.beside_loop_s.append((beside(n_tokens), beside(n_skip)))
    return timing


def generation_loop(decoder: IncrementalDecoder, params, encoder_input_tokens) -> Callable[[int], float]:
    """A function of ``n`` that prefills and times ``n`` greedy steps of the jitted generation
    loop (``generate_tokens``), in seconds; the prefill is not timed."""
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    start = jnp.zeros((inputs.shape[0],), jnp.int32)

    def loop(n: int) -> float:
        cache = jax.block_until_ready(decoder.prefill(params, inputs))
        t0 = time.perf_counter()
        # Greedy (temperature 0) with an EOS id no token has, so every one of the n steps runs.
        tokens, _, _ = decoder.generate_tokens(params, cache, start, jax.random.key(0), n, 0.0, -1, 0)
        tokens.block_until_ready()
        return time.perf_counter() - t0

    return loop


def chained_loops(decoder: IncrementalDecoder, params, encoder_input_tokens, counts: Sequence[int]):
    """One prefill, then greedy generation loops of ``counts`` steps each, every one continuing
    the cache the one before left (``sum(counts)`` must fit ``max_decode_length``). Returns
    ``(prefill seconds, [seconds of each loop])``. A step's work does not depend on how many
    tokens came before it in the cache (dense attention reads all its slots, LSH its kept rows),
    so a loop continued from step ``n`` costs what one from step 0 would."""
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    start = jnp.zeros((inputs.shape[0],), jnp.int32)
    t0 = time.perf_counter()
    cache = jax.block_until_ready(decoder.prefill(params, inputs))
    prefill = time.perf_counter() - t0
    seconds = []
    for n in counts:
        t0 = time.perf_counter()
        tokens, _, cache = decoder.generate_tokens(params, cache, start, jax.random.key(0), n, 0.0, -1, 0)
        tokens.block_until_ready()
        seconds.append(time.perf_counter() - t0)
    del cache
    return prefill, seconds


def bytes_per_weight(weights_dtype: str, d_model: int) -> float:
    """Bytes a decode step reads per weight stored as ``weights_dtype``: 4, 2, or for int8 one
    byte plus its row's float32 scale shared by a row of about ``d_model`` weights (rows of the
    small multiplicative kernels are shorter, the logits' and FF rows as long; biases and norm
    scales stay float32 but are under 1% of the weights)."""
    return {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / d_model}[check_weights_dtype(weights_dtype)]


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def lsh_layers(decoder: IncrementalDecoder, params, cache, batch: int = 1) -> Dict[Tuple[str, ...], dict]:
    """The LSH attention layers one ``step`` runs, by their path in the cache tree, with the
    settings that fix how many past rows each keeps: ``n_hashes``, ``chunk_len``,
    ``n_chunks_before``, ``std_length`` (read from the modules while the step is traced
    abstractly for ``batch`` rows, the cache's; nothing is compiled)."""
    return _traced_step(decoder, params, cache, batch)[0]


def _traced_step(
    decoder: IncrementalDecoder, params, cache, batch: int
) -> Tuple[Dict[Tuple[str, ...], dict], jax.stages.Traced]:
    """``(lsh_layers, the step's trace)``: one trace of ``step_fn`` for ``batch`` rows serves both
    the LSH layers it runs and XLA's cost analysis of the lowered step (``decode_cost_per_token``)."""
    from flax import linen as nn

    from terra.layers.lsh_attention import LSHSelfAttention

    found: Dict[Tuple[str, ...], dict] = {}

    def record(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, LSHSelfAttention):
            found[tuple(module.path)] = {
                "n_hashes": module.n_hashes,
                "chunk_len": module.chunk_len,
                "n_chunks_before": module.n_chunks_before,
                "std_length": getattr(module, "std_length", None),
            }
        return next_fun(*args, **kwargs)

    token = jax.ShapeDtypeStruct((batch,), jnp.int32)
    # XLA's forms of every primitive: a native kernel's custom call has no count.
    with nn.intercept_methods(record), native_kernels.disabled():
        # A new function each time: a traced step from the jit cache would not run the modules.
        traced = jax.jit(lambda p, c, t: decoder.step_fn(p, c, t)).trace(params, cache, token)
    return found, traced


def lsh_kept_rows(settings: dict, max_len: int) -> int:
    """Past rows an LSH decode step attends to in a cache of ``max_len`` positions:
    ``n_hashes * chunk_len * (1 + n_chunks_before) - 1`` (all of them when fewer, or when the
    cache is no longer than ``std_length``)."""
    keep = settings["n_hashes"] * settings["chunk_len"] * (1 + settings["n_chunks_before"]) - 1
    if settings.get("std_length") is not None and max_len <= settings["std_length"]:
        keep = max_len
    return min(keep, max_len)


def cache_reads_per_token(cache, lsh: Optional[Dict[Tuple[str, ...], dict]] = None) -> dict:
    """Bytes of the cache pytree one decode step reads, the caches of every sequence it holds
    (one sequence's at batch 1: what a decoded token reads), each array at its own itemsize (a
    bfloat16 or int8 cache, and an int8 cache's per-row scales, count as stored).

    The model, per layer type:

    - every cache but an LSH layer's is read whole: dense self-attention reads all
      ``max_decode_length`` key/value slots (written or not: the product spans them), the
      encoder-decoder attention every encoder key/value and its padding bias, a convolution its
      rows, the counters themselves;
    - an LSH layer's ``LSHCache`` (``terra/backends/decode_state.py``) reads of its keys and
      values, and of an int8 cache's scales, only the ``lsh_kept_rows`` rows it keeps per head,
      not the whole cache; plus its bucket bookkeeping: with whole-cache selection (no bucket
      lists) every position's buckets (the ranking reads them all); with bucket lists the
      token's own list and count per round, the recent-positions list whole, and the buckets of
      the candidates those lists name (at most ``(n_hashes + 1) * n_keep`` positions); its hash
      rotations and index whole.

    ``lsh``: ``lsh_layers``'s settings by the layer's path; an LSH cache whose layer it does not
    name is counted whole (an upper bound). Returns ``total`` (bytes read), ``lsh`` (of which LSH
    layers), ``stored`` (all the cache's bytes: what it occupies in memory).
    """
    lsh = lsh or {}
    totals = {"total": 0, "lsh": 0, "stored": sum(_nbytes(x) for x in jax.tree.leaves(cache))}

    def lsh_read(cache: LSHCache, settings) -> int:
        max_len = cache.max_length
        kept = lsh_kept_rows(settings, max_len)
        rows = [x for x in (cache.key, cache.key_scale, cache.value, cache.value_scale) if x is not None]
        read = sum(_nbytes(x) * kept // max_len for x in rows)  # the kept rows
        candidates = min(max_len, (settings["n_hashes"] + 1) * kept) if cache.has_lists else max_len
        read += _nbytes(cache.buckets) * candidates // max_len
        if cache.has_lists:
            read += _nbytes(cache.bucket_positions) // cache.bucket_positions.shape[3]  # the token's own bucket
            read += _nbytes(cache.bucket_counts) // cache.bucket_counts.shape[-1]
            read += sum(_nbytes(x) for x in (cache.recent_positions, cache.recent_counts) if x is not None)
        return read + _nbytes(cache.rotations) + _nbytes(cache.index)

    def walk(node, path) -> int:
        if isinstance(node, LSHCache) and tuple(path[:-1]) in lsh:  # the layer holds it as one entry
            read = lsh_read(node, lsh[tuple(path[:-1])])
            totals["lsh"] += read
            return read
        if hasattr(node, "shape"):
            return _nbytes(node)
        if hasattr(node, "items"):
            return sum(walk(child, (*path, name)) for name, child in node.items())
        return sum(_nbytes(x) for x in jax.tree.leaves(node))

    totals["total"] = walk(cache, ())
    return totals


def decode_cost_per_token(
    model, decoder: IncrementalDecoder, input_length: int, weights_itemsize: float = 4, batch: int = 1
) -> dict:
    """What one decode step of ``batch`` sequences (inputs ``[batch, input_length]``) costs, from
    shapes alone (nothing is compiled); at batch 1 (the default) what one decoded token costs:

    - ``weights``, ``caches``, ``total``: bytes read — the parameters the step touches at
      ``weights_itemsize`` bytes each (``bytes_per_weight``; ``Model.params_read_per_token(batch)``:
      every weight once per step, and of the rows a sparse layer selects per sequence their
      expected union over the batch) and the caches it reads (``cache_reads_per_token``:
      self-attention K/V of ``max_decode_length`` slots, encoder keys/values, conv rows, an LSH
      layer's kept rows and bucket bookkeeping), each at its stored itemsize; the cache is the
      prefill's evaluated abstractly at ``batch`` rows and counted, so each sequence's own cache
      counts (about ``batch`` times the batch-1 bytes; counters the rows share, once);
      ``cache_stored``: the caches' whole size;
    - ``flops``: XLA's cost analysis of the float32 ``step`` lowered at ``batch`` rows with XLA's
      form of every primitive (2 per multiply-add of every product, 1 per elementwise op; a
      gather counts none): the arithmetic is the same whatever width the weights are stored at
      or whichever path runs it (a native kernel's custom call has no count).
    """
    unboxed = model.abstract_params()
    cache = jax.eval_shape(decoder.prefill, unboxed, jax.ShapeDtypeStruct((batch, input_length), jnp.int32))
    weights = int(model.params_read_per_token(batch)["total"] * weights_itemsize)
    lsh, step = _traced_step(decoder, unboxed, cache, batch)
    reads = cache_reads_per_token(cache, lsh)
    caches = reads["total"]
    analysis = step.lower().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {
        "weights": weights,
        "caches": caches,
        "total": weights + caches,
        "cache_stored": reads["stored"],
        "flops": float(analysis["flops"]),
    }


# --- whether a row fits: the positional tables and the machine's memory ---------------------


class RowSkipped(Exception):
    """A row that cannot run on this machine; the message is the reason its result records."""


def decoder_cache_length(config) -> int:
    """The decoder's ``max_decode_length``: ``decoder_cache_length`` (the reference's 32 slots for
    the paper presets, see ``presets.timing_config``), or more where the tokens decoded need it
    (``tokens``, the warm-up's steps; ``skip + tokens`` without step calls, whose two loops
    continue one cache, see ``measure_decode``). The input does not enter: an encoder-decoder's
    self-attention cache holds only decoded tokens, and a Terraformer's caches add the input's
    positions themselves."""
    decoded = int(config.skip) + int(config.tokens) if not config.get("time_calls", True) else int(config.tokens)
    return max(int(config.get("decoder_cache_length", 0)), decoded, int(config.warmup))


def check_fits(cfg, input_length: int, decode_length: int, where: str = "", input_field: str = "input_length") -> None:
    """One ``ConfigError`` where the input or the decode is longer than the model's positional
    tables (``TransformerConfig.max_len``), naming the binding that fixes it."""
    for what, length, field in (("an input", input_length, input_field), ("a decode", decode_length, "tokens")):
        if length > cfg.max_len:
            raise errors.ConfigError(
                f"{where}{what} of {length} positions (--config.{field}) exceeds the model's positional table "
                f"(TransformerConfig.max_len={cfg.max_len}); shorten it or raise the table, e.g. "
                f"--gin.TransformerConfig.max_len={length}."
            )


def estimate_memory(model, decoder: IncrementalDecoder, input_length: int, weights_dtype: str = "float32") -> dict:
    """A row's peak memory before it is built, in bytes, from shapes alone: ``params`` (the decode
    tree as ``weights_dtype`` stores it), ``caches`` (the prefilled cache, at its dtypes) and
    ``activation`` (the prefill's largest: a dense attention's float32 scores, logits and
    probabilities, of one query chunk of 512 over every key — ``attention_in_query_chunks``,
    which an input longer than that always takes — or the feed-forward's hidden ``[L, d_ff]``,
    whichever is larger, plus four ``[L, d_model]`` float32 streams); ``total`` their sum."""
    cfg = model.config
    unboxed = model.abstract_params()
    stored = jax.eval_shape(lambda p: quantize_params(p, weights_dtype), unboxed)
    params = sum(_nbytes(x) for x in jax.tree.leaves(stored))
    cache = jax.eval_shape(decoder.prefill, unboxed, jax.ShapeDtypeStruct((1, input_length), jnp.int32))
    caches = sum(_nbytes(x) for x in jax.tree.leaves(cache))
    length = input_length
    scores = 2 * cfg.n_heads * min(length, 512) * length * 4
    activation = max(scores, length * cfg.d_ff * 4) + 4 * length * cfg.d_model * 4
    return {"params": params, "caches": caches, "activation": activation, "total": params + caches + activation}


def available_memory_bytes() -> Tuple[int, str]:
    """Memory a row may use now and where the figure comes from: ``MemAvailable`` of
    ``/proc/meminfo``, else the machine's physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"


def is_out_of_memory(error: BaseException) -> bool:
    """A ``MemoryError`` or XLA's resource-exhausted error (an allocation it could not make)."""
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def random_params(model, seed: int, weights_dtype: str = "float32"):
    """Random weights for timing, one leaf at a time: uniform with the variance of N(0, 1/fan_in),
    drawn by numpy, each weight matrix stored as ``weights_dtype`` as soon as it is drawn (so a
    17B-wide block never holds both widths). Timing does not depend on the distribution (the
    in-loop times agree with the real initialisers' within noise); the real initialisers are one
    large jitted program, slow to compile at the 800M widths and, at the 17B widths, larger than
    the machine's memory (docs/architecture.md)."""
    rng = np.random.default_rng(seed)

    def leaf(path, spec):
        limit = math.sqrt(3.0 / spec.shape[-1]) if spec.shape else 1.0
        values = rng.random(spec.shape, dtype=np.float32)
        values *= 2 * limit
        values -= limit
        return quantize_leaf(path, jnp.asarray(values, spec.dtype), weights_dtype)

    return jax.tree_util.tree_map_with_path(leaf, model.abstract_params())


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _time_model(
    gin_files,
    bindings,
    config,
    weights_dtype: str,
    seed: int = 0,
    beside=None,
    keep: bool = False,
    input_length: Optional[int] = None,
    memory_limit: Optional[Tuple[int, str]] = None,
    where: str = "",
    batch_size: int = 1,
):
    """Builds one model with random weights stored as ``weights_dtype`` and times it (with
    ``beside``'s loops after each repetition's, see ``measure_decode``) at ``input_length``
    (default ``config.input_length``), decoding ``batch_size`` sequences at once from random
    (seeded) encoder inputs ``[batch_size, input_length]``; its costs are those of one step of
    that many rows (``decode_cost_per_token``). Frees the model, or with ``keep`` returns its
    ``generation_loop`` as well, which holds it for timing beside others. ``memory_limit``
    ``(bytes, what they are)``: first estimate the row's memory (``estimate_memory``) and raise
    ``RowSkipped`` where it exceeds them, before any weight is drawn."""
    input_length = int(config.input_length if input_length is None else input_length)
    model = parsing.parse_model(gin_files, bindings)
    cfg = model.config
    decode_length = decoder_cache_length(config)
    check_fits(cfg, input_length, decode_length, where)
    decoder = IncrementalDecoder(model.module, decode_length)
    estimate = None
    if memory_limit is not None:
        estimate = estimate_memory(model, decoder, input_length, weights_dtype)
        limit, source = memory_limit
        if estimate["total"] > limit:
            raise RowSkipped(
                f"estimated {_gb(estimate['total'])} GB (parameters {_gb(estimate['params'])} + caches "
                f"{_gb(estimate['caches'])} + prefill activation {_gb(estimate['activation'])}) exceeds "
                f"{source} {_gb(limit)} GB"
            )
    params = random_params(model, seed, weights_dtype)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params()))
    inputs = np.random.default_rng(seed).integers(2, cfg.vocab_size, size=(batch_size, input_length))
    timing = measure_decode(
        decoder,
        params,
        inputs,
        n_tokens=config.tokens,
        n_skip=config.skip,
        n_warmup=config.warmup,
        repeats=config.repeats,
        beside=beside,
        time_calls=config.get("time_calls", True),
    )
    itemsize = bytes_per_weight(weights_dtype, cfg.d_model)
    reads = decode_cost_per_token(model, decoder, input_length, itemsize, batch=batch_size)
    n_layers = cfg.n_decoder_layers
    loop = generation_loop(decoder, params, inputs) if keep else None
    del params, decoder
    gc.collect()
    return timing, reads, n_params, n_layers, loop, estimate


def _ratio_or_none(numerator, denominator):
    return None if numerator is None or not denominator else numerator / denominator


def row_bindings(row, config) -> Tuple[List[str], str, str]:
    """A row's gin bindings (the preset's, the row's, its cache store's), weights and cache dtypes.
    A narrow cache is the binding ``TransformerConfig.cache_dtype``, added only where it is not
    float32."""
    bindings = list(config.common_bindings) + list(row.bindings)
    # Weights stored narrow for decoding (terra.quantization); activations stay float32.
    weights_dtype = row.get("weights_dtype") or config.weights_dtype
    cache_dtype = row.get("cache_dtype") or config.get("cache_dtype", "float32") or "float32"
    if cache_dtype != "float32":
        bindings.append(f"TransformerConfig.cache_dtype = '{cache_dtype}'")
    return bindings, weights_dtype, cache_dtype


def run_row(
    row,
    config,
    bandwidth: float,
    product_gflops: float,
    beside=None,
    keep: bool = False,
    input_length: Optional[int] = None,
    memory_limit: Optional[Tuple[int, str]] = None,
    batch_size: int = 1,
):
    """Times one row (at ``input_length``, default ``config.input_length``) decoding
    ``batch_size`` sequences at once. Returns its result and, with ``keep`` ('divide' block
    mode only), its ``generation_loop`` for timing beside the rows after it (``beside``: such a
    loop). ``memory_limit``: see ``_time_model``. The result's times, bytes, FLOPs and floors
    are those of one step (per token at batch 1; of all ``batch_size`` rows otherwise, see
    ``batched_fields``)."""
    bindings, weights_dtype, cache_dtype = row_bindings(row, config)
    input_length = int(config.input_length if input_length is None else input_length)
    where = f"row '{row.name}': "
    reset = process_memory.reset_peak_resident()
    resident_before = process_memory.resident_bytes()
    estimate = None
    if config.block_mode == "difference":
        one, two = (bindings + [f"TransformerConfig.n_decoder_layers = {n}"] for n in (1, 2))
        # Each row is two models timed one after the other: run_preset refuses baseline_beside.
        t1, r1, _, _, _, _ = _time_model(
            row.gin_files, one, config, weights_dtype, input_length=input_length, where=where
        )
        timing, reads, n_params, _, loop, estimate = _time_model(
            row.gin_files,
            two,
            config,
            weights_dtype,
            input_length=input_length,
            memory_limit=memory_limit,
            where=where,
        )
        per_block = timing.median_token_s - t1.median_token_s
        # The 2-block model's loops against the 1-block model's, repetition by repetition.
        per_block_loop = measured_difference(
            [a - b for a, b in timing.loop_s], [a - b for a, b in t1.loop_s], timing.loop_steps
        )
        block_bytes = reads["total"] - r1["total"]
        flops = reads["flops"] - r1["flops"]
        extra = {
            "bytes_per_block": int(block_bytes),
            "flops_per_block": flops,
            "seconds_per_token_one_block": t1.median_token_s,
        }
        achieved = block_bytes / max(per_block, 1e-9)
        floor = block_bytes / bandwidth
    else:
        timing, reads, n_params, n_layers, loop, estimate = _time_model(
            row.gin_files,
            bindings,
            config,
            weights_dtype,
            beside=beside,
            keep=keep,
            input_length=input_length,
            memory_limit=memory_limit,
            where=where,
            batch_size=batch_size,
        )
        loop_token = timing.median_loop_token_s
        per_block = _ratio_or_none(timing.median_token_s, n_layers)
        per_block_loop = _ratio_or_none(loop_token, n_layers)
        # Without step calls (time_calls=False) the in-loop time is the step's time.
        step = timing.median_token_s if timing.token_s else loop_token
        achieved = _ratio_or_none(reads["total"], step)
        floor = reads["total"] / bandwidth
        flops = reads["flops"]
        extra = {}
    peak, peak_source = process_memory.peak_resident(reset)
    result = {
        **row_identity(row, config, bindings, weights_dtype, cache_dtype, input_length, batch_size),
        "params": int(n_params),
        # None: step calls not timed (time_calls=False).
        "seconds_per_token_median": timing.median_token_s,
        "seconds_per_token_min": timing.min_token_s,
        "prefill_seconds": float(np.median(timing.prefill_s)),
        "seconds_per_block": None if per_block is None else float(per_block),
        # None: the generation loop's jitter was larger than the difference it measures.
        "seconds_per_token_loop": timing.median_loop_token_s,
        "seconds_per_block_loop": per_block_loop,
        "bytes_per_token": int(reads["total"]),
        "weight_bytes_per_token": int(reads["weights"]),
        "cache_bytes_per_token": int(reads["caches"]),
        # Every cache's whole size (an LSH step reads only part of it).
        "cache_bytes_stored": int(reads["cache_stored"]),
        "achieved_gbps": None if achieved is None else achieved / 1e9,
        "bandwidth_gbps": bandwidth / 1e9,
        "fraction_of_bandwidth": None if achieved is None else achieved / bandwidth,
        "floor_seconds": float(floor),
        # The floor the weights' and the caches' bytes each set at the measured bandwidth.
        "weight_floor_seconds": reads["weights"] / bandwidth,
        "cache_floor_seconds": reads["caches"] / bandwidth,
        "flops_per_token": reads["flops"],
        "product_gflops": product_gflops,
        # The step's arithmetic at the small-product rate. A step that overlapped its products
        # with its reads perfectly would need max(floor, this); one that overlapped nothing,
        # floor + this. Dense steps sit near the first (matrix-vector products hide their
        # arithmetic behind the reads), sparse ones beyond the second.
        "arithmetic_seconds": flops / (product_gflops * 1e9),
        "timed_tokens": len(timing.token_s),
        # How each per-call token was timed: a DecodeSession call (the host picks each token of a
        # running loop). Runs stored without the field timed IncrementalDecoder.step calls.
        "per_call": PER_CALL,
        # The preset's dense row's in-loop time measured right after this row's (baseline_beside).
        "dense_loop_beside_seconds": timing.median_beside_loop_token_s,
        # The process's peak resident memory over the row (build, weights, prefill, decode).
        "peak_resident_bytes": peak,
        "peak_resident_source": peak_source,
        # The process's resident memory as the row started (the libraries, earlier rows' compiled
        # programs and freed memory the allocator kept): the peak less this is what the row added.
        "resident_before_bytes": resident_before,
        **extra,
    }
    if estimate is not None:
        result["estimated_memory_bytes"] = int(estimate["total"])
        # What the decode must hold (the stored weights and the filled caches): the prefill's
        # peak is measured against it.
        result["params_and_caches_bytes"] = int(estimate["params"] + estimate["caches"])
    return result, loop


def row_memory_limit(config) -> Tuple[int, str]:
    """What a row's estimated memory is held against: ``--config.memory_limit_gb`` where set, else
    the memory available now (``available_memory_bytes``)."""
    if config.get("memory_limit_gb", 0):
        return int(config.memory_limit_gb * 1e9), "--config.memory_limit_gb"
    limit, source = available_memory_bytes()
    return limit, f"the machine's {source}"


def skipped_row(row, config, input_length: int, reason: str) -> dict:
    """The result of a row that did not run: its identity and ``skipped`` (why)."""
    bindings, weights_dtype, cache_dtype = row_bindings(row, config)
    return {**row_identity(row, config, bindings, weights_dtype, cache_dtype, input_length), "skipped": reason}


def row_identity(
    row, config, bindings, weights_dtype: str, cache_dtype: str, input_length: int, batch_size: int = 1
) -> dict:
    """What a row's result says it is (timed or skipped): its name, configs, stores and the
    sequences it decodes at once."""
    return {
        "name": row.name,
        "baseline": row.baseline,
        "paper_seconds": row.paper,
        "paper_note": row.paper_note,
        "gin_files": list(row.gin_files),
        "bindings": bindings,
        "weights_dtype": weights_dtype,
        "cache_dtype": cache_dtype,
        "input_length": int(input_length),
        "batch_size": int(batch_size),
        "series": row.series,
        "sparsity": row.sparsity,
        "block_mode": config.block_mode,
    }


def _preflight(config, lengths: Sequence[int]) -> None:
    """Every row's gin config parses and fits the longest length (``check_fits``), before hours
    of timing: one error otherwise. Parses only (building an 800M model takes seconds)."""
    seen = set()
    decode_length = decoder_cache_length(config)
    for row in config.rows:
        bindings, _, _ = row_bindings(row, config)
        key = (tuple(row.gin_files), tuple(bindings))
        if key in seen:
            continue
        seen.add(key)
        parsing.parse_gin(row.gin_files, bindings, finalize=False)
        try:
            import gin

            max_len = gin.query_parameter("TransformerConfig.max_len")
        except ValueError:  # not bound: the model's default
            max_len = parsing.build_model().config.max_len
        cfg = types.SimpleNamespace(max_len=max_len)
        check_fits(cfg, max(lengths), decode_length, f"row '{row.name}': ", "input_lengths")


def _log_line(result: dict) -> str:
    name = f"  {result['name']:<40}"
    if "input_length" in result and result.get("long_document"):
        name += f" {result['input_length']:>6} tokens"
    if result.get("skipped"):
        return f"{name}  skipped: {result['skipped']}"
    if result.get("batched"):
        rate = result["tokens_per_second"]
        return (
            f"{name} batch {result['batch_size']:>3}  {report.milliseconds(result['seconds_per_token_median'])} "
            f"per step ({report.milliseconds(result['seconds_per_step_loop'])} in loop, "
            f"{report.milliseconds(result['seconds_per_sequence_loop'])} per sequence, "
            f"{'—' if rate is None else f'{rate:,.0f}'} tokens/s)  "
            f"weights {result['weight_bytes_per_token'] / 1e6:.1f} MB + "
            f"caches {result['cache_bytes_per_token'] / 1e6:.1f} MB  floor {result['floor_seconds'] * 1e3:.2f} ms"
        )
    if result.get("long_document"):
        peak = result.get("peak_resident_bytes")
        return (
            f"{name}  prefill {result['prefill_seconds']:.3f} s  "
            f"{report.milliseconds(result['seconds_per_token_loop'])} per token in loop  "
            f"weights {result['weight_bytes_per_token'] / 1e6:.1f} MB + "
            f"caches {result['cache_bytes_per_token'] / 1e6:.1f} MB"
            f"  floor {result['floor_seconds'] * 1e3:.2f} ms  peak {'—' if peak is None else _gb(peak)} GB"
        )
    fraction = result["fraction_of_bandwidth"]
    return (
        f"{name} {report.milliseconds(result['seconds_per_token_median'])} per token  "
        f"({report.milliseconds(result['seconds_per_token_loop'])} in loop)  "
        f"{report.milliseconds(result['seconds_per_block'])} per block  {result['bytes_per_token'] / 1e6:9.1f} MB  "
        + ("" if fraction is None else f"{100 * fraction:5.1f}% of bandwidth")
    )


def check_batch_sizes(config) -> List[int]:
    """``config.batch_sizes`` as integers (empty: batch 1, the presets' protocol), or one
    ``ValueError`` where they cannot be timed: a size below 1, or beside ``input_lengths`` (one
    axis per run), ``baseline_beside`` (the dense loop is held at one batch) or block_mode
    'difference' (two slices per row)."""
    sizes = [int(b) for b in config.get("batch_sizes", ()) or ()]
    if not sizes:
        return sizes
    if min(sizes) < 1:
        raise ValueError(f"batch_sizes={tuple(sizes)}: every batch size must be at least 1.")
    for field, clash in (
        ("input_lengths", bool(config.get("input_lengths", ()))),
        ("baseline_beside", bool(config.get("baseline_beside", False))),
        ("block_mode='difference'", config.block_mode == "difference"),
    ):
        if clash:
            raise ValueError(
                f"batch_sizes times every row at each batch size at one input length, whole models in the "
                f"'divide' block mode; it cannot be combined with {field}: drop one of them."
            )
    return sizes


NO_OUT_NOTE = "note: no --out: nothing was written (--out DIR writes decode_speed.{json,md,png} and machine.json)."


def run_preset(config: ml_collections.ConfigDict, out_dir: Optional[str], title: str, log=print) -> List[dict]:
    beside_dense = config.get("baseline_beside", False)
    lengths = [int(n) for n in config.get("input_lengths", ()) or ()]
    batch_sizes = check_batch_sizes(config)
    if beside_dense and config.block_mode != "divide":
        raise ValueError(
            f"baseline_beside times whole models beside each other; set it False for block_mode='{config.block_mode}'."
        )
    if beside_dense and lengths:
        raise ValueError("baseline_beside times rows at one input length; set it False with input_lengths.")
    if config.block_mode == "difference" and not config.get("time_calls", True):
        raise ValueError("block_mode='difference' subtracts step-call times; leave time_calls True.")
    if lengths:
        _preflight(config, lengths)
    # Each row's memory as a process that returns its large buffers sees it (terra's commands do).
    process_memory.return_large_buffers_to_system()
    machine = describe_machine()
    bandwidth = measure_read_bandwidth(config.bandwidth_buffer_mb << 20)
    product_gflops = measure_product_gflops()
    log(
        f"{title}: {machine['cpu']}, {machine['cores']} cores, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"small products {product_gflops:.0f} GFLOP/s"
    )
    machine["bandwidth_before_gbps"] = bandwidth / 1e9
    machine["product_gflops"] = product_gflops
    # Each row collects garbage two or three times, so that its peak memory is its own. Nothing
    # that existed before the rows is freed by a row, so the collections skip it (with JAX loaded,
    # a full collection otherwise walks every object the process ever made).
    gc.freeze()
    try:
        if lengths:
            rows = _run_lengths(config, lengths, bandwidth, product_gflops, log, out_dir)
        elif batch_sizes:
            rows = _run_batches(config, batch_sizes, bandwidth, product_gflops, log)
        else:
            rows = _run_rows(config, bandwidth, product_gflops, beside_dense, log)
    finally:
        gc.unfreeze()
    # Bandwidth on a shared machine drifts; measure again and note both, so a reader can
    # tell whether the rows ran on a quiet or a busy machine.
    after = measure_read_bandwidth(config.bandwidth_buffer_mb << 20)
    machine["bandwidth_after_gbps"] = after / 1e9
    log(f"read bandwidth after the rows: {after / 1e9:.1f} GB/s")
    report.add_speedups(rows, config.dense_row)
    if out_dir:
        log(report.write_outputs(out_dir, rows, machine, bandwidth / 1e9, title))
        if os.path.exists(os.path.join(out_dir, PARTIAL)):
            os.remove(os.path.join(out_dir, PARTIAL))  # the whole run is in decode_speed.json
    else:
        log(report.markdown_table(rows, machine, bandwidth / 1e9, title))
        log(NO_OUT_NOTE)
    return rows


def _run_rows(config, bandwidth: float, product_gflops: float, beside_dense: bool, log) -> List[dict]:
    """Every row at ``config.input_length``, in the preset's order (the dense row first with
    ``baseline_beside``)."""
    # With baseline_beside the dense row is timed first and held, and its generation loop runs
    # again after each repetition of every other row's: a shared VM's bandwidth drifts by tens
    # of percent within minutes, and a ratio of two timings from the same minutes cancels it.
    order = list(range(len(config.rows)))
    if beside_dense:
        order.remove(config.dense_row)
        order.insert(0, config.dense_row)
    results, dense_loop = {}, None
    for index in order:
        row = config.rows[index]
        keep = beside_dense and index == config.dense_row
        result, loop = run_row(row, config, bandwidth, product_gflops, beside=dense_loop, keep=keep)
        if keep:
            dense_loop = loop
            result["dense_loop_beside_seconds"] = result["seconds_per_token_loop"]
        results[index] = result
        log(_log_line(result))
    del dense_loop
    gc.collect()
    return [results[index] for index in range(len(config.rows))]


def _run_lengths(
    config, lengths: Sequence[int], bandwidth: float, product_gflops: float, log, out_dir: Optional[str] = None
) -> List[dict]:
    """Every row at each of ``lengths`` (row by row, each row's lengths in order). A row whose
    estimated memory exceeds ``row_memory_limit``, or that runs out of memory, is recorded as
    ``skipped`` with the reason, and the run goes on. With ``out_dir`` the rows so far are kept
    in ``decode_speed.partial.json`` after each one (a long run that stops keeps them)."""
    rows = []
    for row in config.rows:
        for length in lengths:
            try:
                result, _ = run_row(
                    row, config, bandwidth, product_gflops, input_length=length, memory_limit=row_memory_limit(config)
                )
            except RowSkipped as e:
                result = skipped_row(row, config, length, str(e))
            except Exception as e:  # noqa: BLE001 - only running out of memory is a row's own outcome
                if not is_out_of_memory(e):
                    raise
                first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
                result = skipped_row(row, config, length, f"out of memory: {first_line[:300]}")
            result["long_document"] = True
            gc.collect()
            rows.append(result)
            log(_log_line(result))
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, PARTIAL), "w") as f:
                    json.dump(rows, f, indent=2)
    return rows


def batched_fields(result: dict) -> dict:
    """The times of a step of ``result['batch_size']`` sequences per sequence and as a rate:
    ``seconds_per_step_loop`` (the in-loop step, ``seconds_per_token_loop``),
    ``seconds_per_sequence_loop`` (the step over the batch: what each sequence's token costs), ``tokens_per_second``
    (tokens all sequences decode in a second of the loop); None where the in-loop time is."""
    batch, step = result["batch_size"], result["seconds_per_token_loop"]
    return {
        "seconds_per_step_loop": step,
        "seconds_per_sequence_loop": None if step is None else step / batch,
        "tokens_per_second": None if step is None else batch / step,
    }


def _run_batches(config, batch_sizes: Sequence[int], bandwidth: float, product_gflops: float, log) -> List[dict]:
    """Every row at each of ``batch_sizes`` (row by row, each row's sizes in order), each a
    model built and timed anew (``run_row``) decoding that many sequences at once; each result
    also carries ``batched_fields``. Its step fields (``seconds_per_token_*``, ``*bytes_per_token``,
    floors, FLOPs) are those of one step of all the rows."""
    rows = []
    for row in config.rows:
        for batch in batch_sizes:
            result, _ = run_row(row, config, bandwidth, product_gflops, batch_size=batch)
            result.update(batched_fields(result), batched=True)
            gc.collect()
            rows.append(result)
            log(_log_line(result))
    return rows


PARTIAL = "decode_speed.partial.json"

"""Batch-1 decode speed of the paper's models on this CPU, against its memory bandwidth.

  terra-bench decode --preset paper_800m --out out/decode_speed
  terra-bench decode --preset paper_17b_block --out out/decode_17b
  terra-bench decode --gin_file=models/fully_sparse_800m.gin      # one config
  ... --config.tokens=20 --config.repeats=5                        # override a preset's field

Protocol (the reference's, ``docs/design/reference_code.md`` §6): random weights; prefill a 16-token
encoder input; warm up (compiles and runs a few steps); then, per repetition, prefill again and
time ``tokens`` single-token ``step`` calls with ``block_until_ready``, the first two not
counted. The same tokens are also timed inside one jitted ``while_loop``
(``IncrementalDecoder.generate_tokens``, what generation runs): per repetition, the loop for
``tokens`` steps minus the loop for the first two, per step, which leaves out the host's work of
each jitted call (argument handling and the round trip for the next token). Reports the median
and minimum seconds per token (step protocol), the in-loop seconds per token, seconds per
decoder block, the FLOPs of a step (XLA's count) and the bytes
each token must read (the parameters the decode step touches, by layer, plus every cache it
reads), the achieved GB/s and the fraction of the machine's measured read bandwidth. Writes
``decode_speed.{json,md,png}`` and ``machine.json`` to ``--out``.

With ``--config.baseline_beside`` (the quantized presets) the dense row is timed first and kept,
and its generation loop is timed again right after each repetition of every other row's: the
speed-up "dense beside" is the ratio of two loops that ran in the same minutes, which a shared
machine's drifting bandwidth does not move the way it moves rows timed minutes apart.
"""

import dataclasses
import gc
import math
import time
from typing import Callable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from terra import gin_utils
from terra.benchmarks import report
from terra.benchmarks.bandwidth import describe_machine, measure_product_gflops, measure_read_bandwidth
from terra.decoding.decode_step import IncrementalDecoder
from terra.quantization import check_weights_dtype, quantize_leaf


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
    def median_token_s(self) -> float:
        return float(np.median(self.token_s))

    @property
    def min_token_s(self) -> float:
        return float(np.min(self.token_s))

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


_next_token = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))


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
) -> DecodeTiming:
    """Times ``prefill``, each greedy ``step`` (``n_tokens`` per repetition, the first
    ``n_skip`` of each not counted) and the in-loop time per token of ``generate_tokens``
    (one value per repetition: the loop over ``n_tokens`` minus the loop over ``n_skip``).
    ``beside``: another model's ``generation_loop``, timed over the same step counts right after
    each repetition's own loops, so that a ratio of the two compares the same minutes of a
    shared machine."""
    if n_tokens > decoder.max_decode_length:
        raise ValueError(f"n_tokens={n_tokens} exceeds max_decode_length={decoder.max_decode_length}.")
    if n_tokens <= n_skip:
        raise ValueError(f"n_tokens={n_tokens} must exceed the {n_skip} untimed tokens.")
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    batch = inputs.shape[0]

    def run(n: int, timed: bool, timing: DecodeTiming):
        t0 = time.perf_counter()
        cache = jax.block_until_ready(decoder.prefill(params, inputs))
        if timed:
            timing.prefill_s.append(time.perf_counter() - t0)
        token = jnp.zeros((batch,), jnp.int32)
        for i in range(n):
            t0 = time.perf_counter()
            logits, cache = decoder.step(params, cache, token)
            logits.block_until_ready()
            if timed and i >= n_skip:
                timing.token_s.append(time.perf_counter() - t0)
            token = _next_token(logits)

    loop = generation_loop(decoder, params, inputs)
    timing = DecodeTiming([], [], loop_steps=n_tokens - n_skip)
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


def bytes_per_weight(weights_dtype: str, d_model: int) -> float:
    """Bytes a decode step reads per weight stored as ``weights_dtype``: 4, 2, or for int8 one
    byte plus its row's float32 scale shared by a row of about ``d_model`` weights (rows of the
    small multiplicative kernels are shorter, the logits' and FF rows as long; biases and norm
    scales stay float32 but are under 1% of the weights)."""
    return {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / d_model}[check_weights_dtype(weights_dtype)]


def decode_cost_per_token(model, decoder: IncrementalDecoder, input_length: int, weights_itemsize: float = 4) -> dict:
    """What one batch-1 decode step costs, from shapes alone (nothing is compiled):

    - ``weights``, ``caches``, ``total``: bytes read — the parameters the step touches at
      ``weights_itemsize`` bytes each (``bytes_per_weight``) and every cache array
      (self-attention K/V of ``max_decode_length`` slots, encoder keys/values, conv rows);
    - ``flops``: XLA's cost analysis of the lowered float32 ``step`` (2 per multiply-add of every
      product, 1 per elementwise op; a gather counts none): the arithmetic is the same whatever
      width the weights are stored at, and a native kernel's custom call has no count.
    """
    unboxed = model.abstract_params()
    cache = jax.eval_shape(decoder.prefill, unboxed, jax.ShapeDtypeStruct((1, input_length), jnp.int32))
    weights = int(model.params_read_per_token()["total"] * weights_itemsize)
    caches = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    analysis = decoder.step.lower(unboxed, cache, jax.ShapeDtypeStruct((1,), jnp.int32)).cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {"weights": weights, "caches": caches, "total": weights + caches, "flops": float(analysis["flops"])}


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


def _build(gin_files, bindings):
    gin_utils.parse_gin(gin_files, bindings)
    return gin_utils.build_model()


def _time_model(gin_files, bindings, config, weights_dtype: str, seed: int = 0, beside=None, keep: bool = False):
    """Builds one model with random weights stored as ``weights_dtype`` and times it (with
    ``beside``'s loops after each repetition's, see ``measure_decode``). Frees the model, or with
    ``keep`` returns its ``generation_loop`` as well, which holds it for timing beside others."""
    model = _build(gin_files, bindings)
    cfg = model.config
    params = random_params(model, seed, weights_dtype)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params()))
    inputs = np.random.default_rng(seed).integers(2, cfg.vocab_size, size=(1, config.input_length))
    decoder = IncrementalDecoder(model.module, max(2 * config.input_length, config.tokens))
    timing = measure_decode(
        decoder,
        params,
        inputs,
        n_tokens=config.tokens,
        n_skip=config.skip,
        n_warmup=config.warmup,
        repeats=config.repeats,
        beside=beside,
    )
    itemsize = bytes_per_weight(weights_dtype, cfg.d_model)
    reads = decode_cost_per_token(model, decoder, config.input_length, itemsize)
    n_layers = cfg.n_decoder_layers
    loop = generation_loop(decoder, params, inputs) if keep else None
    del params, decoder
    gc.collect()
    return timing, reads, n_params, n_layers, loop


def run_row(row, config, bandwidth: float, product_gflops: float, beside=None, keep: bool = False):
    """Times one row. Returns its result and, with ``keep`` ('divide' block mode only), its
    ``generation_loop`` for timing beside the rows after it (``beside``: such a loop)."""
    bindings = list(config.common_bindings) + list(row.bindings)
    # Weights stored narrow for decoding (terra.quantization); activations and caches stay float32.
    weights_dtype = row.get("weights_dtype") or config.weights_dtype
    if config.block_mode == "difference":
        one, two = (bindings + [f"TransformerConfig.n_decoder_layers = {n}"] for n in (1, 2))
        # Each row is two models timed one after the other: run_preset refuses baseline_beside.
        t1, r1, _, _, _ = _time_model(row.gin_files, one, config, weights_dtype)
        timing, reads, n_params, _, loop = _time_model(row.gin_files, two, config, weights_dtype)
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
        timing, reads, n_params, n_layers, loop = _time_model(
            row.gin_files, bindings, config, weights_dtype, beside=beside, keep=keep
        )
        per_block = timing.median_token_s / n_layers
        loop_token = timing.median_loop_token_s
        per_block_loop = None if loop_token is None else loop_token / n_layers
        achieved = reads["total"] / timing.median_token_s
        floor = reads["total"] / bandwidth
        flops = reads["flops"]
        extra = {}
    result = {
        "name": row.name,
        "baseline": row.baseline,
        "paper_seconds": row.paper,
        "paper_note": row.paper_note,
        "gin_files": list(row.gin_files),
        "bindings": bindings,
        "weights_dtype": weights_dtype,
        "series": row.series,
        "sparsity": row.sparsity,
        "block_mode": config.block_mode,
        "params": int(n_params),
        "seconds_per_token_median": timing.median_token_s,
        "seconds_per_token_min": timing.min_token_s,
        "prefill_seconds": float(np.median(timing.prefill_s)),
        "seconds_per_block": float(per_block),
        # None: the generation loop's jitter was larger than the difference it measures.
        "seconds_per_token_loop": timing.median_loop_token_s,
        "seconds_per_block_loop": per_block_loop,
        "bytes_per_token": int(reads["total"]),
        "weight_bytes_per_token": int(reads["weights"]),
        "cache_bytes_per_token": int(reads["caches"]),
        "achieved_gbps": achieved / 1e9,
        "bandwidth_gbps": bandwidth / 1e9,
        "fraction_of_bandwidth": achieved / bandwidth,
        "floor_seconds": float(floor),
        "flops_per_token": reads["flops"],
        "product_gflops": product_gflops,
        # The step's arithmetic at the small-product rate. A step that overlapped its products
        # with its reads perfectly would need max(floor, this); one that overlapped nothing,
        # floor + this. Dense steps sit near the first (matrix-vector products hide their
        # arithmetic behind the reads), sparse ones beyond the second.
        "arithmetic_seconds": flops / (product_gflops * 1e9),
        "timed_tokens": len(timing.token_s),
        # The preset's dense row's in-loop time measured right after this row's (baseline_beside).
        "dense_loop_beside_seconds": timing.median_beside_loop_token_s,
        **extra,
    }
    return result, loop


def run_preset(config: ml_collections.ConfigDict, out_dir: Optional[str], title: str, log=print) -> List[dict]:
    beside_dense = config.get("baseline_beside", False)
    if beside_dense and config.block_mode != "divide":
        raise ValueError(
            f"baseline_beside times whole models beside each other; set it False for block_mode='{config.block_mode}'."
        )
    machine = describe_machine()
    bandwidth = measure_read_bandwidth(config.bandwidth_buffer_mb << 20)
    product_gflops = measure_product_gflops()
    log(
        f"{title}: {machine['cpu']}, {machine['cores']} cores, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"small products {product_gflops:.0f} GFLOP/s"
    )
    machine["bandwidth_before_gbps"] = bandwidth / 1e9
    machine["product_gflops"] = product_gflops
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
        log(
            f"  {row.name:<40} {result['seconds_per_token_median'] * 1e3:9.3f} ms/token  "
            f"({report.milliseconds(result['seconds_per_token_loop'])} in loop)  "
            f"{result['seconds_per_block'] * 1e3:8.3f} ms/block  {result['bytes_per_token'] / 1e6:9.1f} MB  "
            f"{100 * result['fraction_of_bandwidth']:5.1f}% of bandwidth"
        )
    del dense_loop
    gc.collect()
    rows = [results[index] for index in range(len(config.rows))]
    # Bandwidth on a shared machine drifts; measure again and note both, so a reader can
    # tell whether the rows ran on a quiet or a busy machine.
    after = measure_read_bandwidth(config.bandwidth_buffer_mb << 20)
    machine["bandwidth_after_gbps"] = after / 1e9
    log(f"read bandwidth after the rows: {after / 1e9:.1f} GB/s")
    report.add_speedups(rows, config.dense_row)
    if out_dir:
        log(report.write_outputs(out_dir, rows, machine, bandwidth / 1e9, title))
    return rows

"""What both studies share: one ordinary training run (as ``terra-train``) per (variant, seed), its curves,
teacher-forced evaluation on any split, mean ± spread over seeds, and the study's output files.

Every run is a real training run in ``<out>/runs/<variant>/seed<k>`` (checkpoints,
``metrics.jsonl``, TensorBoard events, ``config.gin``), so a study that is stopped resumes
where it was, and any run can be inspected or evaluated again with ``terra-evaluate``.
"""

import dataclasses
import itertools
import json
import os
import time
from typing import Dict, List, Sequence

import jax
import numpy as np

from terra.data import pipeline, tasks
from terra.errors import ConfigError
from terra.files import write_atomically
from terra.gin_config import parsing
from terra.training import metrics as metrics_lib
from terra.training import trainer
from terra.training.settings import LoggingSettings
from terra.training.train_step import evaluate_batches


@dataclasses.dataclass
class RunResult:
    """One finished training run: its final parameters and the metrics it logged."""

    name: str
    seed: int
    model_dir: str
    params: object
    params_count: int
    curves: Dict[str, List[List[float]]]  # metric -> [[step, value], ...]
    seconds: float


def parse_seeds(text) -> List[int]:
    """``"0,1,2"`` or ``3`` (meaning seeds 0..2) -> ``[0, 1, 2]``."""
    if isinstance(text, int):
        seeds = list(range(text))
    else:
        try:
            seeds = [int(s) for s in str(text).split(",") if s.strip()]
        except ValueError:
            raise ConfigError(f"seeds={text!r}: give a comma-separated list of integers such as 0,1,2.") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"seeds={text!r}: give distinct non-negative integers, e.g. 0,1,2.")
    return seeds


def read_curves(model_dir: str) -> Dict[str, List[List[float]]]:
    """``metrics.jsonl`` as ``{metric: [[step, value], ...]}`` (later rows win on a resumed run;
    non-finite values, stored as strings, are left out)."""
    if not os.path.exists(os.path.join(model_dir, metrics_lib.METRICS_FILE)):
        return {}
    curves: Dict[str, Dict[int, float]] = {}
    for row in metrics_lib.read_metrics(model_dir):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                curves.setdefault(key, {})[int(row["step"])] = float(value)
    return {k: [[s, v] for s, v in sorted(points.items())] for k, points in curves.items()}


def train_run(
    name: str, seed: int, model_dir: str, gin_files: Sequence[str], bindings: Sequence[str], log=print
) -> RunResult:
    """Parses the run's gin config (files, then bindings, then the seed and model_dir) and trains."""
    parsing.parse_gin(
        list(gin_files),
        [*bindings, f"MODEL_DIR = {os.path.abspath(model_dir)!r}", f"terra.training.Trainer.seed = {seed}"],
    )
    start = time.perf_counter()
    result = trainer.Trainer(logging=LoggingSettings(progress=False)).run()
    # Training time summed over the invocations that trained this run (a resumed or finished
    # run adds only what this call spent), kept next to its checkpoints.
    seconds_path = os.path.join(model_dir, "study_seconds.json")
    seconds = time.perf_counter() - start
    if os.path.exists(seconds_path):
        with open(seconds_path) as f:
            seconds += float(json.load(f)["seconds"])
    write_json(seconds_path, {"seconds": seconds})
    params_count = int(sum(x.size for x in jax.tree.leaves(result.params)))
    curves = read_curves(model_dir)
    final = {k: v[-1][1] for k, v in curves.items() if k.startswith("eval/")}
    log(
        f"  {name} seed {seed}: {params_count:,} parameters, {result.step} steps in {seconds:.0f} s; "
        + ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()))
    )
    return RunResult(name, seed, model_dir, result.params, params_count, curves, seconds)


def read_split_batches(
    provider: tasks.Provider,
    split: str,
    feature_lengths: Dict[str, int],
    batch_size: int,
    num_batches: int,
    feature_converter=None,
    seed: int = 0,
) -> List[dict]:
    """The first ``num_batches`` batches of ``split`` of a seqio Task or Mixture as the trainer
    reads its eval batches: unshuffled from the split's start, so the same examples every time; a
    split with no full batch is a ``ConfigError``."""
    batches = pipeline.batch_iterator(
        provider,
        split,
        feature_lengths=feature_lengths,
        batch_size=batch_size,
        feature_converter=feature_converter,
        seed=seed,
        shuffle=False,
        num_epochs=1 if split != "train" else None,
    )
    batches = list(itertools.islice(batches, num_batches))
    if not batches:
        raise ConfigError(f"the {split!r} split of {provider.name!r} gave no batch of {batch_size} examples.")
    return batches


def evaluate_split(
    model,
    params,
    provider: tasks.Provider,
    split: str,
    feature_lengths: Dict[str, int],
    batch_size: int,
    num_batches: int,
    feature_converter=None,
    seed: int = 0,
) -> Dict[str, float]:
    """Teacher-forced log-perplexity, token and sequence accuracy (the trainer's evaluation)
    on the first ``num_batches`` batches of ``split`` (:func:`read_split_batches`)."""
    batches = read_split_batches(provider, split, feature_lengths, batch_size, num_batches, feature_converter, seed)
    return evaluate_batches(jax.jit(model.eval_metrics), params, batches)


def mean_and_spread(values: Sequence[float]) -> Dict[str, float]:
    """Mean, sample standard deviation (0 for one seed), min and max of per-seed values."""
    values = [float(v) for v in values]
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return {"mean": float(np.mean(values)), "std": std, "min": min(values), "max": max(values), "n": len(values)}


def format_mean(stats: Dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    """``1.234 ± 0.010`` (± the standard deviation over seeds), or ``1.234`` for one seed."""
    mean = f"{stats['mean'] * scale:.{digits}f}"
    return mean if stats["n"] < 2 else f"{mean} ± {stats['std'] * scale:.{digits}f}"


def write_json(path: str, payload: dict) -> None:
    """Atomically: a study interrupted while writing leaves the previous file intact."""
    write_atomically(path, json.dumps(payload, indent=2, default=_jsonable))


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")

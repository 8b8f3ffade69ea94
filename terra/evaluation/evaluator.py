"""What ``terra-evaluate`` runs: decode a task split from a checkpoint and score it as the paper does.

Loads the parameters of a training run (latest checkpoint or a given step), decodes every
example of the split with the jitted single-token decode loop (greedy by default; the paper's
abstracts were sampled at temperature 0.5, ``docs/design/reference_code.md`` §5.4), scores the summaries
with ``rouge-score`` (``terra.evaluation.rouge``) and the targets' log-perplexity, and writes

  OUTPUT_DIR/predictions.jsonl   one line per example: id, input excerpt, target, prediction
  OUTPUT_DIR/metrics.json        ROUGE (F1, precision, recall, 95% interval), log-perplexity,
                                 the checkpoint, step and decoding settings

Both files are written to a temporary name and renamed, so an interrupted evaluation never
leaves a half-written file in place of an earlier one. Single-process (one host).
"""

import dataclasses
import datetime
import json
import os
import time
from typing import Dict, List, Mapping, Optional

import gin

from terra import evaluation_table
from terra.data import tasks
from terra.errors import ConfigError
from terra.evaluation import rouge as rouge_lib
from terra.evaluation import summaries
from terra.files import read_regular_file, write_atomically
from terra.quantization import check_weights_dtype, quantize_params, weights_dtype_of
from terra.training import checkpointing


@dataclasses.dataclass
class EvaluationResult:
    """``metrics`` and ``predictions`` as written; ``examples`` the scored task examples."""

    metrics: Dict
    predictions: List[Dict]
    examples: List[summaries.Example]
    output_dir: Optional[str]


def decode_and_score(
    model,
    params,
    examples: List[summaries.Example],
    vocabulary,
    *,
    feature_lengths: Mapping[str, int],
    batch_size: int,
    max_decode_length: int,
    temperature: float = 0.0,
    seed: int = 0,
    bootstrap_samples: int = 1000,
    progress: bool = False,
):
    """``(rouge, predicted texts)`` for ``examples``: decoded in batches (``progress``: with a
    bar on standard error), scored against their target texts."""
    tokens = summaries.generate_summaries(
        model,
        params,
        [e.inputs for e in examples],
        input_length=feature_lengths["inputs"],
        batch_size=batch_size,
        max_decode_length=max_decode_length,
        temperature=temperature,
        seed=seed,
        progress=progress,
    )
    predictions = [vocabulary.decode(t) for t in tokens]
    rouge = rouge_lib.corpus_rouge([e.target_text for e in examples], predictions, bootstrap_samples=bootstrap_samples)
    return rouge, predictions


def default_output_dir(
    model_dir: str,
    split: str,
    step: int,
    *,
    weights_dtype: str = "float32",
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 8,
    num_examples: Optional[int] = None,
    max_decode_length: Optional[int] = None,
    default_length: Optional[int] = None,
) -> str:
    """``<model_dir>/eval/<split>_step<step>`` followed by each setting that changes the results,
    where it is not the default: the weights' dtype (``_int8``), sampling (``_t0.5_seed1_batch8``:
    each batch samples with its own seed), the first examples only (``_first100``) and another
    decode length (``_len64``). Two evaluations that could differ never share a folder."""
    parts = [f"{split}_step{step}"]
    if weights_dtype != "float32":
        parts.append(weights_dtype)
    if temperature:
        parts.append(f"t{temperature:g}_seed{seed}_batch{batch_size}")
    if num_examples is not None:
        parts.append(f"first{num_examples}")
    if max_decode_length is not None and max_decode_length != default_length:
        parts.append(f"len{max_decode_length}")
    return os.path.join(model_dir, "eval", "_".join(parts))


def check_not_evaluated(output_dir: str, overwrite: bool) -> None:
    """A folder that holds an evaluation's ``metrics.json`` is not written over unless asked."""
    path = os.path.join(output_dir, "metrics.json")
    if overwrite or not os.path.lexists(path):
        return
    try:  # the earlier evaluation's date; a file that is not one (a FIFO, a huge file) is not read
        when = json.loads(read_regular_file(path, 1 << 20, ValueError, "metrics file")).get("date")
    except (ValueError, AttributeError):
        when = None
    when = " ".join(when.split())[:40] if isinstance(when, str) and when.strip() else "an earlier run"
    raise ConfigError(
        f"{output_dir} holds an evaluation already ({when}): pass --overwrite to replace it (gin: "
        "terra.evaluation.evaluate.overwrite = True), or --output_dir to write elsewhere; "
        "terra-evaluate --list MODEL_DIR shows the run's evaluations."
    )


def check_writable(output_dir: str) -> None:
    """Create ``output_dir`` and write a file there now: a read-only or full disk, or a file in
    the way, is reported before decoding rather than after it."""
    probe = os.path.join(output_dir, f".write-check-{os.getpid()}")
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ConfigError(
            f"cannot write the evaluation to {output_dir}: {error.strerror or error}. Choose a writable folder "
            "with --output_dir (gin: terra.evaluation.evaluate.output_dir)."
        ) from None


@gin.configurable(module="terra.evaluation")
def evaluate(
    *,
    model,
    task,
    feature_lengths: Mapping[str, int],
    model_dir: str,
    step: Optional[int] = None,
    split: str = "validation",
    batch_size: int = 8,
    max_decode_length: Optional[int] = None,
    temperature: float = 0.0,
    seed: int = 0,
    num_examples: Optional[int] = None,
    output_dir: Optional[str] = None,
    bootstrap_samples: int = 1000,
    excerpt_chars: int = 300,
    force: bool = False,
    weights_dtype: str = "float32",
    progress: bool = True,
    overwrite: bool = False,
    log=print,
) -> EvaluationResult:
    """Decode and score ``split`` of ``task`` with the checkpoint in ``model_dir``.

    Args:
      model, task, feature_lengths: as in ``terra-train`` (gin: ``%MODEL``, ``%TASK``,
        ``%TASK_FEATURE_LENGTHS``); inputs are truncated to ``feature_lengths['inputs']``.
      model_dir: the training run (or a checkpoints folder / one step directory).
      step: which checkpoint (default: the latest).
      max_decode_length: most tokens per summary (default: ``feature_lengths['targets']``).
      temperature, seed: 0 is greedy; otherwise sampling, reproducible for a seed.
      num_examples: evaluate only the first ones (default: the whole split).
      output_dir: where to write (default ``<model_dir>/eval/<split>_step<step>``, followed by
        every setting that changes the results: see :func:`default_output_dir`). A folder that
        holds an evaluation already is refused unless ``overwrite``.
      force: score a task that is not a summarization task anyway (its ROUGE means little).
      weights_dtype: 'float32', or 'int8' / 'bfloat16' to decode and score with the weights stored
        narrow (``terra.quantization``; activations and caches stay float32).
      progress: a bar on standard error over the examples while they decode, with their rate
        and the time left.
    """
    check_weights_dtype(weights_dtype)
    if batch_size <= 0:
        raise ConfigError(f"batch_size={batch_size} must be positive.")
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 is greedy).")
    if num_examples is not None and num_examples <= 0:
        raise ConfigError(f"num_examples={num_examples} must be positive (or None for the whole split).")
    provider = tasks.resolve(task)  # the entry point of terra-evaluate: gin gives a name
    if not force and not tasks.is_summarization(provider):
        raise ConfigError(
            f"task '{provider.name}' is a {tasks.task_objective(provider)} task, not summarization: its decoded "
            "outputs have no reference summaries to score with ROUGE. Evaluate a run fine-tuned on a summarization "
            "task (e.g. experiments/finetune_arxiv_terraformer.gin), or pass --force to score it anyway."
        )
    tasks.check_vocabulary_and_lengths(
        provider, feature_lengths, vocab_size=model.config.vocab_size, max_len=model.config.max_len
    )
    max_decode_length = max_decode_length or feature_lengths["targets"]
    params, step = checkpointing.load_params(model, model_dir, step)  # fails before anything is written
    stored = weights_dtype_of(params)
    if stored == "float32":
        params = quantize_params(params, weights_dtype)
    elif weights_dtype in ("float32", stored):  # a quantized model saved from Python: its own weights
        weights_dtype = stored
    else:
        raise ConfigError(
            f"{model_dir} stores {stored} weights (a quantized model saved from Python): evaluate it with "
            f"--weights_dtype={stored} (or without --weights_dtype)."
        )
    examples = summaries.read_examples(provider, split, feature_lengths, num_examples)
    if not examples:
        raise ConfigError(f"split '{split}' of task '{provider.name}' has no examples.")
    output_dir = output_dir or default_output_dir(
        model_dir,
        split,
        step,
        weights_dtype=weights_dtype,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
        num_examples=num_examples,
        max_decode_length=max_decode_length,
        default_length=feature_lengths["targets"],
    )
    check_not_evaluated(output_dir, overwrite)
    check_writable(output_dir)  # before hours of decoding, not after
    vocabulary = provider.output_features["targets"].vocabulary

    log(
        f"evaluate: {len(examples)} examples of {provider.name}/{split}, checkpoint step {step}, "
        f"{weights_dtype} weights, "
        f"{'greedy' if temperature == 0 else f'temperature {temperature}, seed {seed}'}"
    )
    start = time.perf_counter()
    rouge, predictions = decode_and_score(
        model,
        params,
        examples,
        vocabulary,
        feature_lengths=feature_lengths,
        batch_size=batch_size,
        max_decode_length=max_decode_length,
        temperature=temperature,
        seed=seed,
        bootstrap_samples=bootstrap_samples,
        progress=progress,
    )
    decode_seconds = time.perf_counter() - start
    log_ppl = summaries.target_log_perplexity(
        model, params, examples, batch_size=batch_size, feature_lengths=feature_lengths
    )

    rows = [
        {
            "id": e.id,
            "input": e.input_text[:excerpt_chars] + ("..." if len(e.input_text) > excerpt_chars else ""),
            "target": e.target_text,
            "prediction": p,
        }
        for e, p in zip(examples, predictions)
    ]
    metrics = {
        "task": provider.name,
        "split": split,
        "n_examples": len(examples),
        "checkpoint": os.path.abspath(model_dir),
        "step": step,
        "temperature": temperature,
        "seed": seed,
        "max_decode_length": max_decode_length,
        "weights_dtype": weights_dtype,
        "feature_lengths": dict(feature_lengths),
        "rouge": rouge,
        "log_perplexity": log_ppl,
        "decode_seconds": decode_seconds,
    }
    metrics["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    metrics["batch_size"] = batch_size
    write_atomically(os.path.join(output_dir, "predictions.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    write_atomically(os.path.join(output_dir, "metrics.json"), json.dumps(metrics, indent=1) + "\n")
    evaluation_table.record(model_dir, output_dir, metrics)
    log(rouge_lib.markdown_table(rouge, label=f"step {step}"))
    log(f"target log-perplexity {log_ppl:.3f} nats/token; {decode_seconds:.1f} s decoding; written to {output_dir}")
    return EvaluationResult(metrics=metrics, predictions=rows, examples=examples, output_dir=output_dir)

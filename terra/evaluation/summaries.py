"""Decoding summaries in batches and scoring them: the pieces ``terra-evaluate``, the trainer's
ROUGE evaluation and ``terra-summarize`` share.

Examples come straight from the seqio task (``inputs``/``targets`` token ids, already truncated
with EOS by the task, and the ``*_pretokenized`` texts), so the reference a prediction is scored
against is the task's own target text, not a detokenized copy of it. Each example carries the
``id`` its source gives the document (see :class:`Example`).
"""

import dataclasses
import sys
from typing import Iterable, List, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from terra.data import graph_functions, json_lines, tasks


@dataclasses.dataclass
class Example:
    """One evaluation example: token ids (1-D int32, EOS included), the untokenized texts and
    the document's ``id`` in its source: the arXiv ``article_id`` (Cohan files), TFDS's record id
    (a prepared TFDS directory), the embedded pair's origin (``"module:json/__init__.py"``), or,
    where the source names nothing (the synthetic tasks), the example's index in the split as a
    string."""

    inputs: np.ndarray
    targets: np.ndarray
    input_text: str
    target_text: str
    id: str


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def read_examples(
    provider: tasks.Provider, split: str, feature_lengths: Mapping[str, int], num_examples: Optional[int] = None
) -> List[Example]:
    """The first ``num_examples`` (default: all) examples of ``split`` of a seqio Task or
    Mixture, in order, unshuffled, each with the ``id`` feature the task keeps from its source
    (its index, as a string, where the source gives none or an empty one)."""
    tasks.check_task_data(provider, split)
    ds = graph_functions.build(
        lambda: provider.get_dataset(
            sequence_length=dict(feature_lengths), split=split, shuffle=False, num_epochs=1, try_in_mem_cache=False
        )
    )
    if num_examples is not None:
        ds = ds.take(num_examples)
    return [
        Example(
            inputs=np.asarray(ex["inputs"], np.int32),
            targets=np.asarray(ex["targets"], np.int32),
            input_text=_text(ex.get("inputs_pretokenized", b"")),
            target_text=_text(ex.get("targets_pretokenized", b"")),
            id=_text(ex["id"]) if ex.get("id") else str(i),
        )
        for i, ex in enumerate(json_lines.checked(ds.as_numpy_iterator(), **tasks.read_checks(provider, split)))
    ]


def pad_batch(rows: Sequence[np.ndarray], batch_size: int, length: int) -> np.ndarray:
    """``[batch_size, length]`` int32: the rows (truncated to ``length``), then pad rows (0)."""
    out = np.zeros((batch_size, length), np.int32)
    for i, row in enumerate(rows):
        row = row[:length]
        out[i, : len(row)] = row
    return out


def strip_special(tokens: Iterable[int], eos_id: int = 1, pad_id: int = 0) -> List[int]:
    """Token ids up to (not including) the first EOS, without padding."""
    out = []
    for t in tokens:
        t = int(t)
        if t == eos_id:
            break
        if t != pad_id:
            out.append(t)
    return out


def generate_summaries(
    model,
    params,
    inputs: Sequence[np.ndarray],
    *,
    input_length: int,
    batch_size: int,
    max_decode_length: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> List[List[int]]:
    """Decoded token ids (EOS and padding removed) for each input, ``batch_size`` at a time.

    Every batch has the same shape (the last one is filled with pad rows), so the prefill and
    the step compile once. Batch ``b`` samples with seed ``seed + b``: the same seed gives the
    same summaries. Greedy when ``temperature == 0``. ``progress``: a bar on standard error over
    the inputs, with their rate and the time left (a test split decodes for hours).
    """
    from tqdm import tqdm

    results: List[List[int]] = []
    bar = tqdm(
        total=len(inputs), desc="summaries", unit="doc", file=sys.stderr, dynamic_ncols=True, disable=not progress
    )
    with bar:
        for b, start in enumerate(range(0, len(inputs), batch_size)):
            rows = inputs[start : start + batch_size]
            encoder_input = pad_batch(rows, batch_size, input_length)
            out = model.generate(
                params, encoder_input, max_decode_length=max_decode_length, temperature=temperature, seed=seed + b
            )
            for i in range(len(rows)):
                results.append(strip_special(out.tokens[i, : out.lengths[i]], model.config.eos_id, model.config.pad_id))
            bar.update(len(rows))
    return results


def target_log_perplexity(
    model, params, examples: Sequence[Example], *, batch_size: int, feature_lengths: Mapping[str, int]
) -> float:
    """Mean negative log-likelihood (nats) per target token over ``examples``, teacher-forced."""
    loss_sum = weight_sum = 0.0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = {
            "encoder_input_tokens": jnp.asarray(
                pad_batch([e.inputs for e in chunk], batch_size, feature_lengths["inputs"])
            ),
            "decoder_target_tokens": jnp.asarray(
                pad_batch([e.targets for e in chunk], batch_size, feature_lengths["targets"])
            ),
        }
        metrics = model.loss_sums(params, batch)  # pad rows have no target weight
        loss_sum += metrics["loss_sum"]
        weight_sum += metrics["weight_sum"]
    return loss_sum / max(weight_sum, 1.0)

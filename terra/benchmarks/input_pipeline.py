"""Tokens per second of the C4 and
arXiv input pipelines (JSON-lines and TFDS), so a reader can see whether input keeps up with
training.

Each row runs a full task pipeline — read, parse, tokenize, span corruption or summarization
truncation, feature conversion, batching — and counts the non-padding tokens (inputs + targets)
it delivers per second after a warm-up. Without data flags the rows read datasets written to a
temporary directory from the embedded corpus in every on-disk format (a prepared TFDS ``c4/en``
directory, allenai/c4 JSON shards, Cohan ``arxiv-dataset`` files and a TFDS ``scientific_papers``
directory made by the real builder); with ``--c4_json`` / ``--arxiv_cohan`` / ``--tfds_data_dir``
they read the user's data instead. Writes ``input_pipeline.{json,md}``. Run by ``terra-bench input``.
"""

import os
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from terra.benchmarks import report
from terra.gin_config import parsing


def _write_local_datasets(root: str, copies: int) -> Dict[str, str]:
    """Every format, from the embedded corpus: ``copies`` passes over its documents (C4) and
    its module-level pairs as papers, one sentence per line (arXiv)."""
    from terra.data import embedded, fixtures

    texts = list(embedded.corpus_texts(split="train"))
    c4_docs = {"train": texts * copies, "validation": texts[:64]}
    fixtures.write_c4_json(os.path.join(root, "c4json"), c4_docs, shards=4)
    fixtures.write_c4_tfds(os.path.join(root, "tfds"), c4_docs)
    pairs = [
        (ex["article"].decode(), ex["abstract"].decode())
        for ex in embedded.summarization_source().get_dataset("train", shuffle=False).as_numpy_iterator()
        if ex["kind"] == b"module"
    ]
    papers = [fixtures.cohan_record(i, a.split("\n"), [s]) for i, (a, s) in enumerate(pairs * copies)]
    splits = {"train": papers, "validation": papers[:8], "test": papers[:8]}
    fixtures.write_cohan(os.path.join(root, "raw"), splits)
    fixtures.write_arxiv_tfds(os.path.join(root, "tfds"), splits)
    return {
        "c4_json": os.path.join(root, "c4json"),
        "arxiv_cohan": os.path.join(root, "raw"),
        "tfds_data_dir": os.path.join(root, "tfds"),
    }


ROWS = (
    # (name, task, source binding key, feature lengths)
    ("C4 span corruption, JSON shards", "c4_span_corruption", "c4_json", {"inputs": 512, "targets": 114}),
    ("C4 span corruption, TFDS", "c4_span_corruption", "tfds_data_dir", {"inputs": 512, "targets": 114}),
    ("arXiv summarization, Cohan JSON lines", "arxiv_summarization", "arxiv_cohan", {"inputs": 4096, "targets": 256}),
    ("arXiv summarization, TFDS", "arxiv_summarization", "tfds_data_dir", {"inputs": 4096, "targets": 256}),
)


def measure(
    task: str, feature_lengths: Dict[str, int], *, batch_size: int, seconds: float, warmup_batches: int = 3
) -> dict:
    from terra.data import pipeline, tasks

    it = pipeline.BatchIterator(
        pipeline.get_dataset(tasks.get_task(task), feature_lengths=feature_lengths, batch_size=batch_size, seed=0)
    )
    for _ in range(warmup_batches):
        next(it)
    tokens = examples = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(it)
        tokens += pipeline.count_tokens(batch)
        examples += batch_size
    elapsed = time.perf_counter() - start
    return {"tokens_per_second": tokens / elapsed, "examples_per_second": examples / elapsed, "seconds": elapsed}


def markdown(rows: Sequence[dict], note: str) -> str:
    lines = [
        "### input pipeline throughput",
        "",
        note,
        "",
        "| pipeline | feature lengths | tokens/s | examples/s |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lengths = f"{r['feature_lengths']['inputs']}/{r['feature_lengths']['targets']}"
        lines.append(f"| {r['name']} | {lengths} | {r['tokens_per_second']:,.0f} | {r['examples_per_second']:,.1f} |")
    return "\n".join(lines) + "\n"


def run(
    out_dir: str,
    *,
    data: Mapping[str, Optional[str]],
    bindings_for: Callable[[Mapping[str, Optional[str]]], List[str]],
    batch_size: int = 8,
    seconds: float = 10.0,
    copies: int = 3,
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
) -> List[dict]:
    """Times every row; writes ``input_pipeline.{json,md}`` to ``out_dir``. ``data`` holds the
    data locations given (``c4_json``, ``arxiv_cohan``, ``tfds_data_dir``, ``vocabulary``; None
    when absent) and ``bindings_for`` turns such a mapping into gin bindings."""
    given = {k: data.get(k) for k in ("c4_json", "arxiv_cohan", "tfds_data_dir")}
    with tempfile.TemporaryDirectory() as tmp:
        if not all(given.values()):
            written = _write_local_datasets(tmp, copies)
            note = (
                "Data written from the embedded corpus to a temporary directory ("
                + ", ".join(f"{k}: {'given' if v else 'written'}" for k, v in given.items())
                + ")."
            )
            given = {k: v or written[k] for k, v in given.items()}
        else:
            note = "Data given on the command line."
        vocab = f"; vocabulary {data.get('vocabulary')}" if data.get("vocabulary") else "; embedded-corpus vocabulary"
        note += (
            f" Batch {batch_size}, {seconds:.0f} s per row after 3 warm-up batches{vocab}; "
            "tokens = non-padding inputs + targets."
        )
        results: List[dict] = []
        for name, task, key, lengths in ROWS:
            # The row's source: the JSON-lines files when the row names them, else the TFDS directory.
            row_data = {
                "tfds_data_dir": given["tfds_data_dir"],
                "vocabulary": data.get("vocabulary"),
                "c4_json": given["c4_json"] if key == "c4_json" else None,
                "arxiv_cohan": given["arxiv_cohan"] if key == "arxiv_cohan" else None,
            }
            parsing.parse_gin(list(gin_files), bindings_for(row_data) + list(gin_bindings))
            row = {
                "name": name,
                "task": task,
                "feature_lengths": lengths,
                "batch_size": batch_size,
                **measure(task, lengths, batch_size=batch_size, seconds=seconds),
            }
            print(
                f"{name:42s} {row['tokens_per_second']:>12,.0f} tokens/s "
                f"{row['examples_per_second']:>8,.1f} examples/s",
                flush=True,
            )
            results.append(row)
    report.write_rows(out_dir, "input_pipeline", results, note, markdown(results, note))
    return results

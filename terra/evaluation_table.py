"""A run's evaluations, one line each: ``<model_dir>/eval/results.jsonl``, appended by every
``terra-evaluate`` (``terra.evaluation.evaluate``) and printed by ``terra-evaluate --list
MODEL_DIR``. Each line holds the settings that change the results, the ROUGE F1 scores, the
target log-perplexity, the date and where the predictions are. Outside ``terra.evaluation``
(whose package loads the data layer, TensorFlow included): ``--list`` imports nothing heavy.
"""

import json
import os
import stat
from typing import Dict, List

from terra.errors import InputError
from terra.files import read_regular_file

RESULTS_FILE = "results.jsonl"
# About 500 bytes an evaluation: room for tens of thousands of them.
MAX_RESULTS_BYTES = 16 << 20
ROUGE_COLUMNS = (("rouge1", "R-1"), ("rouge2", "R-2"), ("rougeLsum", "R-LSum"), ("rougeL", "R-LSent"))
SETTING_COLUMNS = ("split", "step", "weights_dtype", "temperature", "seed", "n_examples", "max_decode_length")


def results_path(model_dir: str) -> str:
    return os.path.join(model_dir, "eval", RESULTS_FILE)


def record(model_dir: str, output_dir: str, metrics: Dict) -> None:
    """Appends one evaluation (its ``metrics.json`` fields) to the run's table. One ``write`` in
    append mode: evaluations that end at once each add their whole line."""
    line = {key: metrics.get(key) for key in ("date", *SETTING_COLUMNS, "batch_size", "task")}
    line["rouge_f1"] = {name: metrics["rouge"][name]["f1"] for name, _ in ROUGE_COLUMNS if name in metrics["rouge"]}
    line["log_perplexity"] = metrics.get("log_perplexity")
    line["output_dir"] = os.path.abspath(output_dir)
    path = results_path(model_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Appended only to a regular file of the run's own: a link or FIFO planted there is refused.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as error:
        raise InputError(f"cannot add the evaluation to {path}: {error.strerror} (a link or not a file?).") from None
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InputError(f"{path} is not a regular file; the evaluation was not added to it.")
        f.write(json.dumps(line) + "\n")


def read(model_dir: str) -> List[Dict]:
    """The run's evaluations, oldest first; a line that is not a JSON object (a write cut short) is
    skipped. An ``InputError`` naming the file when the run has none."""
    path = results_path(model_dir)
    if not os.path.lexists(path):
        raise InputError(
            f"{path} does not exist: {model_dir} has no evaluation recorded yet "
            f"(terra-evaluate --checkpoint {model_dir} writes one)."
        )
    data = read_regular_file(path, MAX_RESULTS_BYTES, InputError, "the run's table of evaluations")
    rows = []
    for text in data.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(text)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def markdown(model_dir: str) -> str:
    """The run's evaluations as a Markdown table, one row each (ROUGE F1 x 100)."""
    rows = read(model_dir)
    header = ["date", "split", "step", "weights", "temperature", "seed", "examples", "length"]
    header += [label for _, label in ROUGE_COLUMNS] + ["log-ppl", "folder"]
    lines = [f"Evaluations of {model_dir} ({results_path(model_dir)}):", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    for row in rows:
        scores = row.get("rouge_f1") if isinstance(row.get("rouge_f1"), dict) else {}
        cells = [_cell(row.get("date"))] + [_cell(row.get(k)) for k in SETTING_COLUMNS]
        cells += [_number(scores.get(name), 100, ".2f") for name, _ in ROUGE_COLUMNS]
        cells += [_number(row.get("log_perplexity"), 1, ".3f"), _cell(_folder(model_dir, row.get("output_dir")))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value, scale: float, form: str) -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return format(scale * value, form) if ok else "—"


def _cell(value) -> str:
    """A value of the file as one table cell: on one line, without the table's bars, short."""
    if value is None:
        return "—"
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return " ".join(text.split()).replace("|", "/")[:120] or "—"


def _folder(model_dir: str, output_dir) -> str:
    if not isinstance(output_dir, str):
        return "—"
    inside = os.path.relpath(output_dir, os.path.abspath(model_dir))
    return output_dir if inside.startswith("..") else inside

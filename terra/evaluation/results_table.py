"""A run's evaluations, one line each: ``<model_dir>/eval/results.jsonl``, appended by every
``terra-evaluate`` (``terra.evaluation.evaluate``) and printed by ``terra-evaluate --list
MODEL_DIR``. Each line holds the settings that change the results, the ROUGE F1 scores, the
target log-perplexity, the date and where the predictions are. Reading it imports nothing heavy.
"""

import json
import os
from typing import Dict, List

from terra.errors import InputError

RESULTS_FILE = "results.jsonl"
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
    os.makedirs(os.path.dirname(results_path(model_dir)), exist_ok=True)
    with open(results_path(model_dir), "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def read(model_dir: str) -> List[Dict]:
    """The run's evaluations, oldest first; a line that is not a JSON object (a write cut short) is
    skipped. An ``InputError`` naming the file when the run has none."""
    path = results_path(model_dir)
    if not os.path.isfile(path):
        raise InputError(
            f"{path} does not exist: {model_dir} has no evaluation recorded yet "
            f"(terra-evaluate --checkpoint {model_dir} writes one)."
        )
    rows = []
    with open(path, encoding="utf-8") as f:
        for text in f:
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
        scores = row.get("rouge_f1") or {}
        cells = [row.get("date") or "—"] + [_cell(row.get(k)) for k in SETTING_COLUMNS]
        cells += [f"{100 * scores[name]:.2f}" if name in scores else "—" for name, _ in ROUGE_COLUMNS]
        ppl = row.get("log_perplexity")
        cells += [f"{ppl:.3f}" if isinstance(ppl, (int, float)) else "—", _folder(model_dir, row.get("output_dir"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    return "—" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _folder(model_dir: str, output_dir) -> str:
    if not isinstance(output_dir, str):
        return "—"
    inside = os.path.relpath(output_dir, os.path.abspath(model_dir))
    return output_dir if inside.startswith("..") else inside

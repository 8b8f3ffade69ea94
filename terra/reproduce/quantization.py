"""The quality cost of quantized weights (issue 19): each trained run's eval log-perplexity and
greedy outputs with its weights stored as float32, bfloat16 and int8.

  terra-reproduce quantization --runs runs/quickstart,runs/quickstart_finetune --out DIR
  terra-reproduce quantization --study out/reproduce/sparsity --out DIR      # every runs/<variant>/seed<k>

For every run (a terra MODEL_DIR: its ``config.gin`` gives the model, task and lengths; its latest
checkpoint the float32 parameters) and every width in ``--config.weights``:

* **eval log-perplexity**: the trainer's teacher-forced evaluation (``train_step.evaluate_batches``
  over ``Model.eval_metrics``) of the first ``eval_batches`` batches of the split, unshuffled, read
  as the run's trainer read them (its feature converter, evaluation lengths, batch size and data
  seed; a random preprocessor such as span corruption draws the same noise), with the narrow
  decode tree (``terra.quantization.quantize_params``), which every layer reads in this pass too.
  Δ is against float32 on the same batches, so it is paired: no sampling noise in it.
* **greedy agreement** with float32's greedy output on the first ``decode_examples`` inputs of
  those batches, ``max_new_tokens`` tokens each (:func:`agreement` defines it).
* **bytes**: the whole decode tree as stored (int8 values and their float32 scales, bfloat16 bits,
  and the float32 biases and norm scales that stay wide).

Writes ``quantization.json`` (every row and the settings) and ``quantization.md`` (the table) to
``--out``. The bars the issue sets are checked against |Δ|: int8 within 0.01 nats, bfloat16
within 0.002.
"""

import glob
import os
from typing import Dict, List, Optional, Sequence

import jax
import ml_collections
import numpy as np

from terra import api
from terra.errors import ConfigError
from terra.files import write_atomically
from terra.gin_config import parsing
from terra.quantization import QuantizedTensor, check_weights_dtype
from terra.reproduce import runs
from terra.reproduce.presets import quantization_config as config  # noqa: F401  (the study's settings, by preset)
from terra.training.train_step import evaluate_batches

# |Δ eval log-perplexity| (nats per target token) each width must stay within (issue 19, item 3).
BARS = {"float32": 0.0, "bfloat16": 0.002, "int8": 0.01}


def find_runs(run_dirs: Sequence[str] = (), study_dir: Optional[str] = None) -> Dict[str, str]:
    """``{label: model_dir}``: the given run directories (labelled by their folder name, or their
    path where two share one) or every ``<study_dir>/runs/<variant>/seed<k>`` (labelled
    ``variant/seed<k>``); a :class:`ConfigError` naming the folder when there is none."""
    run_dirs = [d for d in run_dirs if d]  # --runs a,b, gives a trailing ''
    if bool(run_dirs) == bool(study_dir):
        raise ConfigError("give either run directories (--runs DIR[,DIR...]) or a study folder (--study OUT).")
    if study_dir:
        found = sorted(
            d for d in glob.glob(os.path.join(study_dir, "runs", "*", "seed*")) if os.path.isfile(f"{d}/config.gin")
        )
        if not found:
            raise ConfigError(
                f"{os.path.abspath(study_dir)} holds no trained runs: expected runs/<variant>/seed<k>/config.gin "
                "under it, as terra-reproduce sparsity or length_generalization write them."
            )
        return {os.path.relpath(d, os.path.join(study_dir, "runs")): d for d in found}
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    unique = len(set(names)) == len(names)
    found = {}
    for name, d in zip(names, run_dirs):
        api.run_config_path(d)  # every run checked before any is measured
        found[name if unique else os.path.normpath(d)] = d
    return found


def agreement(reference: np.ndarray, other: np.ndarray, eos_id: int) -> Dict[str, int]:
    """Token-by-token agreement of two greedy outputs ``[batch, n]`` int (EOS included).

    Each row is compared at positions ``0 .. min(Lr, Lo) - 1``, where ``L`` is a row's length up
    to and including its first EOS (``n`` if it has none): every position of the reference up
    to its EOS, except those after the other row's EOS, where it has no token left. So a row
    that stops early disagrees once (its EOS against a token) rather than once per missing
    token, and one that runs on disagrees once (a token against the reference's EOS). A row is
    identical when every compared position is: then both stop at the same EOS (or neither stops).

    Returns ``{"tokens": compared positions, "identical_tokens", "sequences", "identical_sequences"}``.
    """
    reference, other = np.asarray(reference), np.asarray(other)
    if reference.shape != other.shape:
        raise ValueError(f"outputs of different shapes: {reference.shape} and {other.shape}")

    def lengths(tokens):
        is_eos = tokens == eos_id
        return np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, tokens.shape[1])

    compared = np.minimum(lengths(reference), lengths(other))  # [batch]
    within = np.arange(reference.shape[1])[None, :] < compared[:, None]  # [batch, n]
    same = (reference == other) & within
    return {
        "tokens": int(within.sum()),
        "identical_tokens": int(same.sum()),
        "sequences": len(reference),
        "identical_sequences": int((same.sum(axis=1) == compared).sum()),
    }


def distinct_outputs(tokens: np.ndarray, eos_id: int) -> int:
    """How many different rows ``[batch, n]`` holds, each read up to and including its first EOS."""
    rows = [list(row) for row in np.asarray(tokens)]
    return len({tuple(row[: row.index(eos_id) + 1] if eos_id in row else row) for row in rows})


def tree_bytes(params) -> int:
    """Bytes of a parameter tree as stored (a :class:`QuantizedTensor` counts its values and scales)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedTensor))
    return int(sum(x.nbytes if isinstance(x, QuantizedTensor) else np.asarray(x).nbytes for x in leaves))


def _read_batches(run: api.InteractiveModel, cfg, count: int):
    """The first ``count`` batches of ``cfg.split`` as the run's trainer reads its eval batches
    (``Trainer.read_eval_batches``): unshuffled, its evaluation lengths, batch size, feature
    converter and data seed. Must be called while the run's config is the parsed gin config
    (right after ``api.load``)."""
    lengths = dict(parsing.bound_value("terra.training.EvaluationSettings.feature_lengths") or run.feature_lengths)
    batch_size = cfg.eval_batch_size or int(parsing.bound_value("%BATCH_SIZE"))
    seed = parsing.bound_value("terra.training.Trainer.data_seed")
    seed = parsing.bound_value("terra.training.Trainer.seed", 0) if seed is None else seed
    converter = parsing.build_macro("FEATURE_CONVERTER", "building the run's feature converter")
    batches = runs.read_split_batches(run.task, cfg.split, lengths, batch_size, count, converter, seed)
    return batches, {"feature_lengths": lengths, "batch_size": batch_size, "data_seed": seed}


def measure_run(label: str, model_dir: str, cfg, weights: Sequence[str], bindings: Sequence[str] = (), log=print):
    """One row per width of ``weights`` (float32 first) for the run in ``model_dir``."""
    wide = api.load(model_dir, bindings=bindings)
    decode_batches = -(-cfg.decode_examples // (cfg.eval_batch_size or int(parsing.bound_value("%BATCH_SIZE"))))
    batches, reading = _read_batches(wide, cfg, max(cfg.eval_batches, decode_batches))
    eval_batches = batches[: cfg.eval_batches]
    inputs = np.concatenate([b["encoder_input_tokens"] for b in batches])[: cfg.decode_examples]  # [N, inputs]
    curves = runs.read_curves(model_dir)
    log(
        f"{label}: step {wide.step}, {len(eval_batches)} eval batches of {reading['batch_size']} "
        f"({wide.task.name}/{cfg.split}), {len(inputs)} inputs decoded greedily to {cfg.max_new_tokens} tokens"
    )
    rows, reference = [], None
    for weights_dtype in weights:
        run = wide.quantized(weights_dtype)
        metrics = evaluate_batches(jax.jit(run.model.eval_metrics), run.params, eval_batches)
        outputs = run.generate(inputs, max_new_tokens=cfg.max_new_tokens)  # [N, max_new_tokens]
        if reference is None:
            reference = {"loss": metrics["loss"], "outputs": outputs}
        agree = agreement(reference["outputs"], outputs, run.config.eos_id)
        delta = metrics["loss"] - reference["loss"]
        row = {
            "run": label,
            "model_dir": os.path.abspath(model_dir),
            "step": wide.step,
            "task": wide.task.name,
            "weights": weights_dtype,
            "eval_log_perplexity": metrics["loss"],
            "delta_vs_float32": delta,
            "bar": BARS[weights_dtype],
            "within_bar": abs(delta) <= BARS[weights_dtype],
            "eval_token_accuracy": metrics["token_accuracy"],
            "token_agreement": agree["identical_tokens"] / max(agree["tokens"], 1),
            "sequence_agreement": agree["identical_sequences"] / max(agree["sequences"], 1),
            **{f"agreement_{k}": v for k, v in agree.items()},
            # Few distinct outputs (an undertrained model repeating sentinels and frequent
            # pieces whatever the input) make the agreement say little: kept beside it.
            "float32_distinct_outputs": distinct_outputs(reference["outputs"], run.config.eos_id),
            "weight_bytes": tree_bytes(run.params),
            "eval_batches": len(eval_batches),
            **reading,
            # The trainer's own last eval/loss (its EvaluationSettings.steps batches), for reference.
            "run_final_eval_loss": curves["eval/loss"][-1][1] if curves.get("eval/loss") else None,
        }
        log(
            f"  {weights_dtype:>8}: eval log-ppl {row['eval_log_perplexity']:.4f} (Δ {delta:+.5f}), tokens "
            f"{100 * row['token_agreement']:.1f}% / sequences {100 * row['sequence_agreement']:.1f}% as float32, "
            f"{row['weight_bytes'] / 1e6:.2f} MB"
        )
        rows.append(row)
    return rows


def parse_weights(text: str) -> List[str]:
    """``"float32,bfloat16,int8"`` -> the widths, float32 first (every Δ and agreement is against it)."""
    weights = [check_weights_dtype(w.strip()) for w in str(text).split(",") if w.strip()]
    if len(set(weights)) != len(weights):
        raise ConfigError(f"weights={text!r}: give each width once.")
    if "float32" not in weights:
        raise ConfigError(f"weights={text!r} needs float32: every difference is measured against it.")
    return ["float32", *(w for w in weights if w != "float32")]


def _check(cfg) -> None:
    for name in ("eval_batches", "decode_examples", "max_new_tokens"):
        if cfg[name] <= 0:
            raise ConfigError(f"{name}={cfg[name]} must be positive.")
    if cfg.eval_batch_size < 0:
        raise ConfigError(f"eval_batch_size={cfg.eval_batch_size} must be positive (or 0: the run's batch size).")


def run(
    cfg: ml_collections.ConfigDict,
    out_dir: str,
    run_dirs: Sequence[str] = (),
    study_dir: Optional[str] = None,
    bindings: Sequence[str] = (),
    log=print,
) -> dict:
    """Measures every run at every width and writes quantization.{json,md} to ``out_dir``."""
    weights = parse_weights(cfg.weights)
    _check(cfg)
    found = find_runs(run_dirs, study_dir)
    os.makedirs(out_dir, exist_ok=True)
    log(f"quantization study: {len(found)} runs x {', '.join(weights)} -> {out_dir}")
    rows = [row for label, d in found.items() for row in measure_run(label, d, cfg, weights, bindings, log)]
    payload = {"study": "quantization", "config": cfg.to_dict(), "bars": BARS, "rows": rows}
    table = markdown(rows, cfg)
    runs.write_json(os.path.join(out_dir, "quantization.json"), payload)
    write_atomically(os.path.join(out_dir, "quantization.md"), table)
    log(table)
    return payload


def markdown(rows: Sequence[dict], cfg) -> str:
    wide = [r for r in rows if r["weights"] == "float32"]
    lines = [
        "### Quality of quantized weights: eval log-perplexity and greedy agreement with float32",
        "",
        f"Teacher-forced eval log-perplexity (nats per target token) on the {cfg.split} split, read as each run's "
        "trainer reads it; Δ is paired (the same batches). Greedy decoding of the first "
        f"{cfg.decode_examples} inputs to {cfg.max_new_tokens} tokens: token agreement is the share of positions "
        "where the output equals float32's, each row compared up to and including the first EOS of both (the "
        "positions after either EOS are left out); sequence agreement the share of rows identical through EOS. "
        "Bytes: the parameters as stored for decoding. Bars: |Δ| ≤ 0.002 (bfloat16), ≤ 0.01 (int8).",
        "",
        "| run | weights | eval log-ppl | Δ vs float32 | token agreement | sequence agreement | bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = "—" if r["weights"] == "float32" else f"{r['delta_vs_float32']:+.5f}"
        flag = "" if r["within_bar"] else " (outside the bar)"
        lines.append(
            f"| {r['run']} | {r['weights']} | {r['eval_log_perplexity']:.4f} | {delta}{flag} | "
            f"{100 * r['token_agreement']:.1f}% | {100 * r['sequence_agreement']:.1f}% | "
            f"{r['weight_bytes'] / 1e6:.2f} MB |"
        )
    lines += [
        "",
        "Runs: "
        + "; ".join(
            f"{r['run']}: {r['task']} step {r['step']}, {r['eval_batches']} eval batches of {r['batch_size']}, "
            f"{r['agreement_sequences']} decoded ({r['float32_distinct_outputs']} distinct float32 outputs)"
            for r in wide
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"

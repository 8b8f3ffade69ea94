""" "Sparse is enough" at a size a CPU can train: the dense baseline against every sparse layer.

  terra-reproduce sparsity --out out/reproduce/sparsity
  terra-reproduce sparsity --out DIR --config.seeds=0,1,2           # mean ± spread
  terra-reproduce sparsity --out DIR --c4_json=/data/c4/en          # C4 instead

Trains the dense encoder-decoder and its sparse variants (paper Figures 1, 3, 5 and 7; Table 2's
mixture-of-experts baseline) for the same number of steps on the same data and seeds, each
built from the same gin model configs as the 800M models (``models/*_800m.gin``) with the
widths of the chosen size, and writes to ``--out``:

* ``sparsity.json`` — every run's curves and final metrics, per-variant mean ± spread over seeds,
  gap to dense, parameters and decode time;
* ``sparsity.md`` — the final table;
* ``sparsity.png`` — eval log-perplexity against steps (Figure 1's plot), each variant against
  dense, mean over seeds with a band of ± one standard deviation.

Decode time per token is measured by the decode-speed benchmark (``terra.benchmarks``) at batch 1
for each variant, at the trained size (``--config.decode_at=trained``, default) or at the 800M
widths and 2+24-layer timing shape of ``paper_800m`` (``--config.decode_at=800m``), or skipped (``none``).
"""

import os
from typing import Dict, List, Sequence

import ml_collections

from terra.benchmarks import decode_speed, report
from terra.benchmarks import presets as preset_lib
from terra.benchmarks.bandwidth import describe_machine
from terra.data import tasks
from terra.errors import ConfigError
from terra.files import write_atomically
from terra.gin_config import parsing
from terra.reproduce import runs
from terra.reproduce.presets import SPARSITY_SIZES, VARIANTS, Variant
from terra.reproduce.presets import sparsity_config as config  # noqa: F401  (the study's settings, by preset)


def _size_bindings(size: str, variant: Variant, vocab_size: int, dropout: float) -> List[str]:
    s = SPARSITY_SIZES[size]
    d_ff = int(round(s["d_ff"] * variant.d_ff_scale))
    return [
        f"TransformerConfig.vocab_size = {vocab_size}",
        f"TransformerConfig.d_model = {s['d_model']}",
        f"TransformerConfig.d_ff = {d_ff}",
        f"TransformerConfig.n_heads = {s['n_heads']}",
        f"TransformerConfig.n_encoder_layers = {s['n_encoder_layers']}",
        f"TransformerConfig.n_decoder_layers = {s['n_decoder_layers']}",
        "TransformerConfig.max_len = 512",
        *(f"TransformerConfig.{name} = {dropout}" for name in ("dropout", "ff_dropout", "attention_dropout")),
        f"SparseQKVAttention.attention_sparsity = {s['attention_sparsity']}",
        f"SparseQueryCrossAttention.attention_sparsity = {s['attention_sparsity']}",
    ]


def _checked_task_vocab_size(task_gin: str, data_bindings: Sequence[str]) -> int:
    """The task's vocabulary size, after checking both splits' data are there (a missing
    dataset fails here, naming the path tried, before anything is written)."""
    parsing.parse_gin([task_gin], list(data_bindings))
    task = tasks.get_task(parsing.gin.query_parameter("%TASK"))
    for split in ("train", "validation"):
        tasks.check_task_data(task, split)
    return task.output_features["targets"].vocabulary.vocab_size


def _check_variants(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}.")
    if "dense" not in names:
        raise ConfigError("the study needs the 'dense' variant: every gap is measured against it.")


def run(
    cfg: ml_collections.ConfigDict,
    out_dir: str,
    data_bindings: Sequence[str] = (),
    extra_bindings: Sequence[str] = (),
    log=print,
) -> dict:
    """Trains every (variant, seed), times decoding per variant, writes sparsity.{json,md,png}."""
    names = [n.strip() for n in str(cfg.variants).split(",") if n.strip()]
    seeds = runs.parse_seeds(cfg.seeds)
    if cfg.size not in SPARSITY_SIZES:
        raise ConfigError(f"size={cfg.size!r}: choose from {', '.join(SPARSITY_SIZES)}.")
    if cfg.decode_at not in ("trained", "800m", "none"):
        raise ConfigError(f"decode_at={cfg.decode_at!r}: choose 'trained', '800m' or 'none'.")
    _check_variants(names)
    reads_c4 = any(b.startswith("terra.data.c4_source.") for b in data_bindings)
    task_gin = cfg.c4_task_gin if reads_c4 else cfg.task_gin
    vocab_size = _checked_task_vocab_size(task_gin, data_bindings)
    os.makedirs(out_dir, exist_ok=True)
    log(
        f"sparsity study: {len(names)} variants x seeds {seeds}, {cfg.steps} steps of {cfg.batch_size} on "
        f"{task_gin} ({cfg.size} size) -> {out_dir}"
    )

    results: Dict[str, List[runs.RunResult]] = {}
    for name in names:
        variant = VARIANTS[name]
        bindings = [
            *_size_bindings(cfg.size, variant, vocab_size, cfg.dropout),
            *variant.bindings,
            *data_bindings,
            f"TASK_FEATURE_LENGTHS = {dict(cfg.feature_lengths)!r}",
            f"BATCH_SIZE = {cfg.batch_size}",
            f"TRAIN_STEPS = {cfg.steps}",
            f"terra.training.EvaluationSettings.every = {cfg.eval_every}",
            f"terra.training.EvaluationSettings.steps = {cfg.eval_steps}",
            f"terra.training.LoggingSettings.every = {cfg.eval_every}",
            f"terra.training.CheckpointSettings.every = {cfg.checkpoint_every}",
            "terra.training.CheckpointSettings.keep_last = 1",
            "terra.training.adafactor.learning_rate = @terra.training.rsqrt_schedule()",
            f"terra.training.rsqrt_schedule.warmup_steps = {cfg.warmup_steps}",
            *extra_bindings,
        ]
        results[name] = [
            runs.train_run(
                name,
                seed,
                os.path.join(out_dir, "runs", name, f"seed{seed}"),
                [variant.gin_file, task_gin, "runs/train.gin"],
                bindings,
                log=log,
            )
            for seed in seeds
        ]
    timings = _decode_times(cfg, names, vocab_size, log) if cfg.decode_at != "none" else {}
    rows = _rows(names, results, timings)
    payload = {
        "study": "sparsity",
        "config": cfg.to_dict(),
        "task_gin": task_gin,
        "data_bindings": list(data_bindings),
        "machine": describe_machine(),
        "rows": rows,
        "runs": [
            {
                "variant": n,
                "seed": r.seed,
                "model_dir": r.model_dir,
                "params": r.params_count,
                "seconds": r.seconds,
                "curves": r.curves,
            }
            for n in names
            for r in results[n]
        ],
    }
    table = markdown(rows, cfg, task_gin)
    runs.write_json(os.path.join(out_dir, "sparsity.json"), payload)
    write_atomically(os.path.join(out_dir, "sparsity.md"), table)
    plot(
        {n: [r.curves for r in results[n]] for n in names},
        names,
        os.path.join(out_dir, "sparsity.png"),
        f"{cfg.size} size, {task_gin}",
    )
    log(table)
    return payload


def _decode_times(cfg, names: Sequence[str], vocab_size: int, log) -> Dict[str, dict]:
    """Each variant's decode-speed benchmark row (``run_preset``): batch-1 seconds per token
    and the speed-up over the dense variant."""
    rows = []
    for name in names:
        variant = VARIANTS[name]
        bindings = list(variant.bindings)
        if cfg.decode_at == "trained":
            bindings = [*_size_bindings(cfg.size, variant, vocab_size, 0.0), *bindings]
        rows.append(preset_lib.make_row(variant.label, variant.gin_file, bindings=bindings))
    common = [] if cfg.decode_at == "trained" else list(preset_lib.TIMING_SHAPE_800M)
    timing = preset_lib.timing_config(
        rows,
        common_bindings=common,
        tokens=cfg.decode_tokens + 2,
        repeats=cfg.decode_repeats,
        warmup=2,
        dense_row=list(names).index("dense"),
        bandwidth_buffer_mb=cfg.bandwidth_buffer_mb,
    )
    measured = decode_speed.run_preset(timing, None, f"decode speed of the study's variants ({cfg.decode_at})", log=log)
    return dict(zip(names, measured))


def _rows(names: Sequence[str], results: Dict[str, List[runs.RunResult]], timings: Dict[str, dict]) -> List[dict]:
    def final(run: runs.RunResult, key: str):
        curve = run.curves.get(key)
        return curve[-1][1] if curve else float("nan")

    dense_losses = {r.seed: final(r, "eval/loss") for r in results["dense"]}
    rows = []
    for name in names:
        losses = [final(r, "eval/loss") for r in results[name]]
        # Gap per seed (same seed, same data order) and then its spread: the dense and sparse
        # runs of one seed share their data stream, so this is the paired difference.
        gaps = [final(r, "eval/loss") - dense_losses[r.seed] for r in results[name]]
        timing = timings.get(name)
        rows.append(
            {
                "variant": name,
                "label": VARIANTS[name].label,
                "params": results[name][0].params_count,
                "seeds": [r.seed for r in results[name]],
                "eval_log_perplexity": runs.mean_and_spread(losses),
                "gap_to_dense": runs.mean_and_spread(gaps),
                "eval_token_accuracy": runs.mean_and_spread([final(r, "eval/token_accuracy") for r in results[name]]),
                "train_seconds": runs.mean_and_spread([r.seconds for r in results[name]]),
                "decode_seconds_per_token": timing["seconds_per_token_median"] if timing else None,
                "decode_params": timing["params"] if timing else None,
                "decode_speedup_vs_dense": timing["speedup_vs_dense"] if timing else None,
            }
        )
    return rows


def markdown(rows: Sequence[dict], cfg, task_gin: str) -> str:
    seeds = runs.parse_seeds(cfg.seeds)
    decode_note = {
        "trained": "at the trained size",
        "800m": "at the 800M widths, 2+24-layer timing shape (2 encoder + 24 decoder layers)",
        "none": "not measured",
    }[cfg.decode_at]
    lines = [
        "### Sparse vs dense: eval log-perplexity at equal steps",
        "",
        f"{cfg.size} size, {cfg.steps} steps of batch {cfg.batch_size}, {task_gin}, seeds {seeds}; eval "
        f"log-perplexity (nats per target token) after the last step, mean ± standard deviation over seeds; "
        f"the gap is paired per seed (same data order). Decode time: batch-1 median per token {decode_note}.",
        "",
        "| model | Params | eval log-ppl | gap to dense | token acc. | train time | decode ms/token "
        "| decode speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        decode = "—" if r["decode_seconds_per_token"] is None else f"{r['decode_seconds_per_token'] * 1e3:.2f}"
        speedup = "—" if r["decode_speedup_vs_dense"] is None else f"{r['decode_speedup_vs_dense']:.2f}x"
        gap = "—" if r["variant"] == "dense" else runs.format_mean(r["gap_to_dense"])
        lines.append(
            f"| {r['label']} | {r['params'] / 1e6:.2f}M | {runs.format_mean(r['eval_log_perplexity'])} | {gap} | "
            f"{runs.format_mean(r['eval_token_accuracy'], 1, 100)}% | {r['train_seconds']['mean']:.0f} s | "
            f"{decode} | {speedup} |"
        )
    return "\n".join(lines) + "\n"


def plot(curves: Dict[str, List[Dict[str, list]]], names: Sequence[str], path: str, title: str) -> None:
    """Eval log-perplexity against step (Figure 1's plot) as small multiples: one panel per
    sparse variant, each against the dense model, as the mean over seeds with a band of ± one
    standard deviation (the spread the table reports). ``curves[name]`` holds each seed's
    ``curves`` (as ``metrics.jsonl`` gives them, and ``sparsity.json`` stores them)."""
    import math

    plt = report.pyplot()

    def mean_and_std(name):
        per_seed = [dict((int(step), v) for step, v in c.get("eval/loss", [])) for c in curves.get(name, [])]
        if not per_seed or not all(per_seed):
            return [], [], []
        steps = sorted(set.intersection(*(set(c) for c in per_seed)))
        stats = [runs.mean_and_spread([c[step] for c in per_seed]) for step in steps]
        return steps, [st["mean"] for st in stats], [st["std"] for st in stats]

    others = [n for n in names if n != "dense"]
    columns = min(4, max(len(others), 1))
    rows_n = math.ceil(max(len(others), 1) / columns)
    fig, axes = plt.subplots(
        rows_n, columns, figsize=(3.4 * columns, 2.9 * rows_n + 0.8), sharex=True, sharey=True, squeeze=False
    )
    dense = mean_and_std("dense")
    seeds = len(curves.get("dense", []))
    for ax, name in zip(axes.flat, others):
        for (steps, mean, std), color, label in (
            (dense, "black", VARIANTS["dense"].label),
            (mean_and_std(name), "tab:blue", VARIANTS[name].label),
        ):
            if not steps:
                continue
            ax.plot(steps, mean, color=color, linewidth=1.6, label=label)
            if seeds > 1:
                ax.fill_between(
                    steps,
                    [m - d for m, d in zip(mean, std)],
                    [m + d for m, d in zip(mean, std)],
                    color=color,
                    alpha=0.15,
                )
        ax.set_title(VARIANTS[name].label, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(others) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    for ax in axes[:, 0]:
        ax.set_ylabel("eval log-perplexity")
    band = f"bands: mean ± one standard deviation over {seeds} seeds" if seeds > 1 else "one seed (no band)"
    fig.suptitle(
        f"Sparse vs dense at equal steps ({title}); black: dense baseline, blue: the panel's variant; {band}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)

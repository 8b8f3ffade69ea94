"""Paper Table 4 at a size a CPU can train: does a model trained on short inputs copy and add
inputs twice as long?

  terra-reproduce length_generalization --out out/reproduce/length
  terra-reproduce length_generalization --out DIR --preset paper      # the paper's sizes

Trains the Transformer and the Terraformer of ``experiments/synthetic_{copy,addition}_*.gin``
(the reference's models: SRU in the Terraformer's feed-forward blocks, random positional start
offsets in both — ``docs/design/reference_code.md`` §7) on inputs up to the training length, then evaluates
on the validation split, whose inputs are 2–2.5x longer, and writes to ``--out``:

* ``length_generalization.json`` — every run's curves, in-distribution and out-of-distribution
  token and sequence accuracy (mean ± spread over seeds);
* ``length_generalization.md`` — the Table 4 analogue next to the paper's figures;
* ``length_generalization.png`` — the accuracies as bars.

Accuracy is teacher-forced, as the reference's ``Accuracy`` and ``SequenceAccuracy`` metrics:
the argmax at each target position given the true prefix; a sequence is right when all its
target tokens (EOS included) are.
"""

import os
from typing import List, Sequence

import ml_collections

from terra.benchmarks import report
from terra.benchmarks.bandwidth import describe_machine
from terra.data import synthetic, tasks
from terra.errors import ConfigError
from terra.files import write_atomically
from terra.gin_config import parsing
from terra.reproduce import runs
from terra.reproduce.presets import LENGTH_MODEL_SIZES, LENGTH_MODELS, LENGTH_TASKS, PAPER_TABLE_4
from terra.reproduce.presets import length_generalization_config as config  # noqa: F401  (the settings, by preset)


def _task_bindings(cfg, task: str) -> List[str]:
    if task == "copy":
        train = {"inputs": cfg.copy_train_length, "targets": cfg.copy_train_length}
        evaluation = {"inputs": cfg.copy_eval_max_length, "targets": cfg.copy_eval_max_length}
        data = [
            f"terra.data.copy_dataset.train_length = {cfg.copy_train_length}",
            f"terra.data.copy_dataset.eval_min_length = {cfg.copy_eval_min_length}",
            f"terra.data.copy_dataset.eval_max_length = {cfg.copy_eval_max_length}",
        ]
    else:
        train = synthetic.addition_feature_lengths(cfg.addition_train_min_length, cfg.addition_train_max_length)
        evaluation = synthetic.addition_feature_lengths(cfg.addition_eval_min_length, cfg.addition_eval_max_length)
        data = [
            f"terra.data.addition_dataset.train_min_length = {cfg.addition_train_min_length}",
            f"terra.data.addition_dataset.train_max_length = {cfg.addition_train_max_length}",
            f"terra.data.addition_dataset.eval_min_length = {cfg.addition_eval_min_length}",
            f"terra.data.addition_dataset.eval_max_length = {cfg.addition_eval_max_length}",
        ]
    return [*data, f"TASK_FEATURE_LENGTHS = {train!r}", f"EVAL_FEATURE_LENGTHS = {evaluation!r}"]


def _model_bindings(cfg, model: str) -> List[str]:
    bindings = [
        f"TransformerConfig.max_len = {cfg.max_len}",
        f"TransformerConfig.position_max_offset = {cfg.position_max_offset}",
    ]
    if cfg.preset in LENGTH_MODEL_SIZES:
        bindings += [f"TransformerConfig.{k} = {v}" for k, v in LENGTH_MODEL_SIZES[cfg.preset][model].items()]
    if cfg.dropout is not None:
        bindings += [
            f"TransformerConfig.{name} = {cfg.dropout}" for name in ("dropout", "ff_dropout", "attention_dropout")
        ]
    return bindings


def _names(text: str, allowed, what: str) -> List[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ConfigError(f"unknown {what} {unknown or text!r}; choose from {', '.join(allowed)}.")
    return names


def run(cfg: ml_collections.ConfigDict, out_dir: str, extra_bindings: Sequence[str] = (), log=print) -> dict:
    """Trains every (task, model, seed), evaluates in and out of distribution, writes the outputs."""
    task_names = _names(cfg.tasks, LENGTH_TASKS, "tasks")
    model_names = _names(cfg.models, LENGTH_MODELS, "models")
    seeds = runs.parse_seeds(cfg.seeds)
    os.makedirs(out_dir, exist_ok=True)
    log(
        f"length generalization: {task_names} x {model_names} x seeds {seeds}, {cfg.steps} steps of "
        f"{cfg.batch_size} ({cfg.preset} preset) -> {out_dir}"
    )
    records = []
    for task in task_names:
        for model_name in model_names:
            gin_file = f"experiments/synthetic_{task}_{model_name}.gin"
            bindings = [
                *_model_bindings(cfg, model_name),
                *_task_bindings(cfg, task),
                f"BATCH_SIZE = {cfg.batch_size}",
                f"TRAIN_STEPS = {cfg.steps}",
                f"terra.training.EvaluationSettings.every = {cfg.eval_every}",
                f"terra.training.EvaluationSettings.steps = {cfg.eval_steps}",
                f"terra.training.LoggingSettings.every = {cfg.eval_every}",
                f"terra.training.CheckpointSettings.every = {cfg.eval_every}",
                "terra.training.CheckpointSettings.keep_last = 1",
                "terra.training.adamw.learning_rate = @terra.training.rsqrt_schedule()",
                f"terra.training.rsqrt_schedule.constant = {cfg.learning_rate_constant}",
                f"terra.training.rsqrt_schedule.warmup_steps = {cfg.warmup_steps}",
                "terra.training.rsqrt_schedule.linear_warmup = True",
                *extra_bindings,
            ]
            for seed in seeds:
                name = f"{task}_{model_name}"
                result = runs.train_run(
                    name, seed, os.path.join(out_dir, "runs", name, f"seed{seed}"), [gin_file], bindings, log=log
                )
                # The run's gin config is still the parsed one: the same model, the train lengths.
                model = parsing.build_model()
                lengths = parsing.gin.query_parameter("%TASK_FEATURE_LENGTHS")
                in_dist = runs.evaluate_split(
                    model,
                    result.params,
                    tasks.get_task(f"synthetic_{task}"),
                    "train",
                    lengths,
                    cfg.batch_size,
                    cfg.in_distribution_batches,
                    seed=seed,
                )
                out_dist = {k.split("/", 1)[1]: v[-1][1] for k, v in result.curves.items() if k.startswith("eval/")}
                log(
                    f"    in distribution: token accuracy {100 * in_dist['token_accuracy']:.1f}%, sequence "
                    f"{100 * in_dist['sequence_accuracy']:.1f}%; "
                    f"2x longer: token {100 * out_dist['token_accuracy']:.1f}%, "
                    f"sequence {100 * out_dist['sequence_accuracy']:.1f}%"
                )
                records.append(
                    {
                        "task": task,
                        "model": model_name,
                        "seed": seed,
                        "model_dir": result.model_dir,
                        "params": result.params_count,
                        "seconds": result.seconds,
                        "in_distribution": in_dist,
                        "out_of_distribution": out_dist,
                        "curves": result.curves,
                    }
                )
    rows = _rows(records, task_names, model_names)
    payload = {
        "study": "length_generalization",
        "config": cfg.to_dict(),
        "machine": describe_machine(),
        "paper_table_4": PAPER_TABLE_4,
        "rows": rows,
        "runs": records,
    }
    table = markdown(rows, cfg, task_names)
    runs.write_json(os.path.join(out_dir, "length_generalization.json"), payload)
    write_atomically(os.path.join(out_dir, "length_generalization.md"), table)
    plot(rows, task_names, os.path.join(out_dir, "length_generalization.png"))
    log(table)
    return payload


def _rows(records: Sequence[dict], task_names: Sequence[str], model_names: Sequence[str]) -> List[dict]:
    rows = []
    for model in model_names:
        row = {"model": model, "label": LENGTH_MODELS[model]}
        for task in task_names:
            mine = [r for r in records if r["model"] == model and r["task"] == task]
            row["params_" + task] = mine[0]["params"]
            row["train_seconds_" + task] = runs.mean_and_spread([r["seconds"] for r in mine])
            for where in ("in_distribution", "out_of_distribution"):
                for metric in ("token_accuracy", "sequence_accuracy"):
                    row[f"{task}_{where}_{metric}"] = runs.mean_and_spread([r[where][metric] for r in mine])
        rows.append(row)
    return rows


def markdown(rows: Sequence[dict], cfg, task_names: Sequence[str]) -> str:
    def lengths(task):
        if task == "copy":
            return (
                f"copy: trained on words of 1–{cfg.copy_train_length - 1} symbols, evaluated on "
                f"{cfg.copy_eval_min_length}–{cfg.copy_eval_max_length - 1}"
            )
        (train_fewest, train_most), _ = synthetic.addition_operand_digits(
            cfg.addition_train_min_length, cfg.addition_train_max_length
        )
        (eval_fewest, eval_most), _ = synthetic.addition_operand_digits(
            cfg.addition_eval_min_length, cfg.addition_eval_max_length
        )
        return (
            f"addition: trained on inputs x+y of at most {cfg.addition_train_max_length} symbols (first operand "
            f"of {train_fewest}–{train_most} digits), "
            f"evaluated on inputs of at most {cfg.addition_eval_max_length} with a "
            f"first operand of {eval_fewest}–{eval_most} digits"
        )

    header = [name for t in task_names for name in (t, f"{t} (seq)")]
    lines = [
        "### Length generalization (paper Table 4): accuracy on inputs 2x longer than in training",
        "",
        f"{cfg.preset} preset, {cfg.steps} steps of batch {cfg.batch_size}, seeds {runs.parse_seeds(cfg.seeds)}; "
        + "; ".join(lengths(t) for t in task_names)
        + ". Teacher-forced token accuracy and whole-sequence accuracy (%), mean ± standard deviation over seeds; "
        "paper Table 4 in the last rows.",
        "",
        "| model | " + " | ".join(header) + " | in distribution (token / seq) |",
        "|---|" + "---|" * (len(header) + 1),
    ]
    for r in rows:
        cells = [
            runs.format_mean(r[f"{t}_out_of_distribution_{metric}"], 1, 100)
            for t in task_names
            for metric in ("token_accuracy", "sequence_accuracy")
        ]
        inside = ", ".join(
            f"{t} {100 * r[f'{t}_in_distribution_token_accuracy']['mean']:.1f} / "
            f"{100 * r[f'{t}_in_distribution_sequence_accuracy']['mean']:.1f}"
            for t in task_names
        )
        lines.append(f"| {r['label']} (terra) | " + " | ".join(cells) + f" | {inside} |")
    for r in rows:
        paper = PAPER_TABLE_4[r["model"]]
        cells = [f"{paper[key]:.1f}" for t in task_names for key in (t, t + "_seq")]
        lines.append(f"| {r['label']} (paper) | " + " | ".join(cells) + " | — |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], task_names: Sequence[str], path: str) -> None:
    """Table 4 as bars: per task (copy, addition), token and whole-sequence accuracy on inputs
    twice the training length for each model, ours (solid) beside the paper's (hatched), and
    ours at the training lengths (outline) for reference."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colors = {"transformer": "tab:blue", "terraformer": "tab:green"}
    width = 0.8 / max(2 * len(rows), 1)
    for ax, metric, suffix, title in zip(
        axes, ("token_accuracy", "sequence_accuracy"), ("", "_seq"), ("token accuracy", "whole-sequence accuracy")
    ):
        for i, r in enumerate(rows):
            color = colors.get(r["model"], None)
            ours_x = [j + 2 * i * width for j in range(len(task_names))]
            paper_x = [x + width for x in ours_x]
            ood = [100 * r[f"{t}_out_of_distribution_{metric}"]["mean"] for t in task_names]
            inside = [100 * r[f"{t}_in_distribution_{metric}"]["mean"] for t in task_names]
            ax.bar(ours_x, ood, width * 0.9, color=color, label=f"{r['label']} (terra), 2x longer")
            ax.bar(
                ours_x,
                inside,
                width * 0.9,
                fill=False,
                edgecolor=color,
                linestyle="--",
                label=f"{r['label']} (terra), training lengths",
            )
            paper = [PAPER_TABLE_4[r["model"]][f"{t}{suffix}"] for t in task_names]
            ax.bar(
                paper_x,
                paper,
                width * 0.9,
                color="white",
                edgecolor=color,
                hatch="///",
                label=f"{r['label']} (paper Table 4), 2x longer",
            )
            for x, value in zip(paper_x, paper):
                ax.text(x, value + 1, f"{value:.0f}", ha="center", fontsize=7)
        ax.set_xticks([j + width * (2 * len(rows) - 1) / 2 for j in range(len(task_names))])
        ax.set_xticklabels(task_names)
        ax.set_title(title)
        ax.set_ylim(0, 110)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("% correct")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7)
    fig.suptitle("Length generalization: accuracy on inputs twice the training length (paper Table 4)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)

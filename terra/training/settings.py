"""The trainer's grouped settings: parallel layout, checkpoints, evaluation and logging.

Each group is a frozen, gin-configurable dataclass that validates itself, so a run names what
it changes by group (``terra.training.EvaluationSettings.every = 500``) and a bad value fails
when the configuration is built, before anything is written. The ``Trainer`` constructs each
group it is not given, which applies the gin bindings of that group.
"""

import dataclasses
from typing import Dict, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import gin
import jax

from terra.errors import ConfigError


@runtime_checkable
class EvaluationHook(Protocol):
    """An extra evaluation the trainer runs every ``every`` steps (0: never), e.g. ROUGE on
    decoded summaries (``terra.evaluation.RougeEvaluation``).

    ``prepare`` is called once before anything is written (validate, read the examples);
    calling the hook returns metrics named without the ``eval/`` prefix.
    """

    every: int
    metric_names: Tuple[str, ...]
    higher_is_better: bool

    def prepare(self, *, model, task, split: str, feature_lengths: Mapping[str, int], batch_size: int) -> None:
        """Validates the hook against the run and reads what it needs."""

    def __call__(self, params) -> Dict[str, float]:
        """Metrics of ``params`` (host values)."""


class StepHook:
    """Code the trainer runs around every optimizer step (the T5X/Flax training-loop hook): a
    study that records or perturbs each step subclasses it instead of the trainer. Both methods
    do nothing by default.

    ``before_step(step, state)`` gets the state about to be trained at 0-based ``step`` and
    returns the state to train (the same one, or a changed one); ``after_step(step, state,
    metrics)`` gets the new state and the step's metrics (device values) once ``step`` steps are
    done. The state passed to a step is donated to it: keep host copies, not the arrays.
    """

    def before_step(self, step: int, state):
        return state

    def after_step(self, step: int, state, metrics: Mapping[str, object]) -> None:
        return None


@gin.configurable(module="terra.training")
@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """Where the state and the batches live.

    Attributes:
      mesh_shape: ``{"data": d, "model": m}`` (default: every device on 'data').
      num_devices: use only the first ``num_devices`` devices (default: all).
      axis_rules: logical-to-mesh rules (default ``terra.layers.axes.default_axis_rules()``).
    """

    mesh_shape: Optional[Mapping[str, int]] = None
    num_devices: Optional[int] = None
    axis_rules: Optional[Sequence[Tuple[str, Optional[str]]]] = None

    def __post_init__(self):
        if self.num_devices is not None and not 0 < self.num_devices <= jax.device_count():
            raise ConfigError(
                f"ParallelSettings.num_devices={self.num_devices}: this run has {jax.device_count()} devices."
            )


@gin.configurable(module="terra.training")
@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Checkpoints in ``<model_dir>/checkpoints``: every ``every`` steps, at the end and on
    preemption; keep the last ``keep_last`` plus the ``keep_best`` best by ``best_metric``
    (``eval/loss``, lower is better, or a metric of an evaluation hook such as
    ``eval/rougeLsum``, in the hook's direction)."""

    every: int = 1000
    keep_last: int = 3
    keep_best: int = 1
    best_metric: str = "eval/loss"

    def __post_init__(self):
        if self.every < 1:
            raise ConfigError(f"CheckpointSettings.every={self.every} must be >= 1.")


@gin.configurable(module="terra.training")
@dataclasses.dataclass(frozen=True)
class EvaluationSettings:
    """Teacher-forced evaluation (log-perplexity, token and sequence accuracy) on the first
    ``steps`` batches of ``split`` every ``every`` steps and at the end (``every = 0``: never),
    at ``feature_lengths`` (default: the training lengths); plus each hook at its own interval."""

    every: int = 1000
    steps: int = 10
    split: str = "validation"
    feature_lengths: Optional[Mapping[str, int]] = None
    hooks: Sequence[EvaluationHook] = ()

    def __post_init__(self):
        if self.every < 0 or self.steps < 0:
            raise ConfigError(f"EvaluationSettings.every={self.every} and steps={self.steps} must be >= 0.")
        for hook in self.hooks:
            if not isinstance(hook, EvaluationHook):
                raise ConfigError(
                    f"EvaluationSettings.hooks: {hook!r} is not an evaluation hook "
                    "(it needs every, metric_names, higher_is_better, prepare() and __call__)."
                )

    @property
    def teacher_forced(self) -> bool:
        return bool(self.every and self.steps)

    def metric_directions(self) -> Dict[str, str]:
        """``{"eval/<name>": "min" | "max"}`` of every metric this evaluation produces."""
        directions = {"eval/loss": "min"}
        for hook in self.hooks:
            directions.update({f"eval/{n}": "max" if hook.higher_is_better else "min" for n in hook.metric_names})
        return directions


@gin.configurable(module="terra.training")
@dataclasses.dataclass(frozen=True)
class LoggingSettings:
    """Train metrics every ``every`` steps to ``metrics.jsonl`` and TensorBoard; a progress bar
    when ``progress``; evaluation results printed to the console when ``print_evaluation``."""

    every: int = 10
    progress: bool = True
    print_evaluation: bool = True

    def __post_init__(self):
        if self.every < 1:
            raise ConfigError(f"LoggingSettings.every={self.every} must be >= 1.")

"""ROUGE during training: an evaluation hook (``terra.training.settings.EvaluationHook``) that
decodes a fixed set of validation examples greedily and scores them as ``terra-evaluate`` does.

  terra.training.EvaluationSettings.hooks = [@terra.evaluation.RougeEvaluation()]
  terra.evaluation.RougeEvaluation.every = 500
  terra.training.CheckpointSettings.best_metric = 'eval/rougeLsum'
"""

from typing import Dict, Mapping, Optional

import gin
import jax

from terra.data import tasks
from terra.errors import ConfigError
from terra.evaluation import rouge as rouge_lib
from terra.evaluation import summaries
from terra.evaluation.evaluator import decode_and_score


@gin.configurable(module="terra.evaluation")
class RougeEvaluation:
    """Every ``every`` steps (and at the end), decode the first ``examples`` examples of the
    evaluation split greedily, up to ``max_decode_length`` tokens (default: the target length),
    and report their ROUGE F1 as ``eval/rouge1``, ``eval/rouge2``, ``eval/rougeLsum`` and
    ``eval/rougeL``. One process only (a multi-host run scores checkpoints with
    ``terra-evaluate``)."""

    metric_names = tuple(rouge_lib.ROUGE_TYPES)
    higher_is_better = True

    def __init__(
        self,
        every: int = 1000,
        examples: int = 16,
        max_decode_length: Optional[int] = None,
        bootstrap_samples: int = 100,
    ):
        if every < 0 or examples <= 0:
            raise ConfigError(f"RougeEvaluation: every={every} must be >= 0 and examples={examples} positive.")
        self.every = every
        self.examples = examples
        self.max_decode_length = max_decode_length
        self.bootstrap_samples = bootstrap_samples
        self._set = None

    def prepare(self, *, model, task, split: str, feature_lengths: Mapping[str, int], batch_size: int) -> None:
        """Checks the run can be scored by ROUGE and reads the fixed examples."""
        if jax.process_count() > 1:
            raise ConfigError(
                "RougeEvaluation decodes on one process; remove it from EvaluationSettings.hooks in a "
                "multi-host run and score checkpoints with terra-evaluate."
            )
        if not tasks.is_summarization(task):
            raise ConfigError(
                f"RougeEvaluation scores summaries, but task '{task.name}' is a "
                f"{tasks.task_objective(task)} task; remove the hook or train a summarization task."
            )
        self._model = model
        self._lengths = dict(feature_lengths)
        self._batch_size = batch_size
        self._set = summaries.read_examples(task, split, feature_lengths, self.examples)
        if not self._set:
            raise ConfigError(f"RougeEvaluation: split '{split}' of task '{task.name}' has no examples.")
        self._vocabulary = task.output_features["targets"].vocabulary

    def __call__(self, params) -> Dict[str, float]:
        if self._set is None:
            raise ConfigError("RougeEvaluation.prepare() must run before the hook is called.")
        scores, _ = decode_and_score(
            self._model,
            params,
            self._set,
            self._vocabulary,
            feature_lengths=self._lengths,
            batch_size=min(len(self._set), self._batch_size),
            max_decode_length=self.max_decode_length or self._lengths["targets"],
            bootstrap_samples=self.bootstrap_samples,
        )
        return {name: r["f1"] for name, r in scores.items()}

"""Evaluation: ROUGE as the paper reports it, batched summary decoding, ``terra.evaluate``."""

from terra.evaluation.evaluator import EvaluationResult, evaluate, load_params
from terra.evaluation.rouge import corpus_rouge, score_examples

__all__ = ["EvaluationResult", "corpus_rouge", "evaluate", "load_params", "score_examples"]

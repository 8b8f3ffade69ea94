"""Evaluation: ROUGE as the paper reports it, batched summary decoding, ``terra-evaluate``'s function and
the in-training ROUGE hook."""

from terra.evaluation.evaluator import EvaluationResult, decode_and_score, evaluate
from terra.evaluation.rouge import corpus_rouge, score_examples
from terra.evaluation.rouge_hook import RougeEvaluation

__all__ = ["EvaluationResult", "RougeEvaluation", "corpus_rouge", "decode_and_score", "evaluate", "score_examples"]

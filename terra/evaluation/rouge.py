"""ROUGE as the paper reports it (Table 5), through Google's ``rouge-score`` package.

The paper scores arXiv abstracts with the open-source ``rouge-score`` scorer and reports F1 of
ROUGE-1, ROUGE-2, ROUGE-LSum (summary level: the longest common subsequence over sentences,
which the scorer splits on newlines) and ROUGE-LSent (sentence level: ``rougeL`` over the whole
text). Stemming is on. Corpus figures come from the library's ``BootstrapAggregator`` (the
mid value of the bootstrap, with a 95% confidence interval). Nothing here re-implements a
score: terra's summaries and references keep one sentence per line, and the scorer does the rest.
"""

import contextlib
from typing import TYPE_CHECKING, Dict, List, Sequence

import numpy as np
from rouge_score import scoring

if TYPE_CHECKING:
    from rouge_score import rouge_scorer

ROUGE_TYPES = ("rouge1", "rouge2", "rougeLsum", "rougeL")
# The paper's column names (Table 5).
DISPLAY_NAMES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeLsum": "ROUGE-LSum", "rougeL": "ROUGE-LSent"}


def scorer() -> "rouge_scorer.RougeScorer":
    """The scorer every terra ROUGE number comes from (stemming on)."""
    # Imported here: rouge_scorer imports all of nltk (and scipy.stats through it), about a
    # second that every console command and training process would pay without scoring ROUGE.
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def score_examples(targets: Sequence[str], predictions: Sequence[str]) -> List[Dict[str, scoring.Score]]:
    """Per example: ``{rouge type: Score(precision, recall, fmeasure)}``."""
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} references but {len(predictions)} predictions.")
    s = scorer()
    return [s.score(target, prediction) for target, prediction in zip(targets, predictions)]


@contextlib.contextmanager
def _numpy_seed(seed: int):
    # BootstrapAggregator resamples with numpy's global generator; seed it for reproducible
    # intervals without disturbing anyone else's stream.
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def corpus_rouge(
    targets: Sequence[str],
    predictions: Sequence[str],
    *,
    bootstrap_samples: int = 1000,
    confidence_interval: float = 0.95,
    seed: int = 0,
) -> Dict[str, Dict[str, float]]:
    """Corpus ROUGE: ``{rouge type: {f1, precision, recall, f1_low, f1_high}}``, in [0, 1].

    ``f1`` (and precision, recall) are the aggregator's mid values; ``f1_low``/``f1_high`` the
    bounds of its ``confidence_interval`` over ``bootstrap_samples`` resamples.
    """
    if not targets:
        raise ValueError("ROUGE of an empty set of examples is undefined.")
    aggregator = scoring.BootstrapAggregator(confidence_interval=confidence_interval, n_samples=bootstrap_samples)
    for scores in score_examples(targets, predictions):
        aggregator.add_scores(scores)
    with _numpy_seed(seed):
        result = aggregator.aggregate()
    return {
        name: {
            "f1": float(result[name].mid.fmeasure),
            "precision": float(result[name].mid.precision),
            "recall": float(result[name].mid.recall),
            "f1_low": float(result[name].low.fmeasure),
            "f1_high": float(result[name].high.fmeasure),
        }
        for name in ROUGE_TYPES
    }


def markdown_table(rouge: Dict[str, Dict[str, float]], *, label: str, interval: bool = True) -> str:
    """One row in the paper's Table 5 layout (F1 x 100)."""
    header = "| model | " + " | ".join(DISPLAY_NAMES[n] for n in ROUGE_TYPES) + " |"
    lines = [header, "|---|" + "---|" * len(ROUGE_TYPES)]
    cells = []
    for name in ROUGE_TYPES:
        r = rouge[name]
        cell = f"{100 * r['f1']:.2f}"
        if interval:
            cell += f" ({100 * r['f1_low']:.2f}–{100 * r['f1_high']:.2f})"
        cells.append(cell)
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

"""Texts as the summarization tasks tokenize them, for inputs that do not come from a task
(``terra-summarize``, the Python API). Pure Python: importing it loads nothing heavy."""

import re
from typing import List, Optional, Tuple


def clean_article(text: str) -> str:
    """The article side of the summarization preprocessing (``preprocessors.summarization``):
    ``<S>``/``</S>`` tags removed, surrounding whitespace stripped."""
    return re.sub(r"</?S>", " ", text).strip()


def encode_text(text: str, vocabulary, length: int, eos_id: int = 1) -> Tuple[List[int], Optional[str]]:
    """One text as the tasks tokenize it: ``<S>`` tags removed, stripped, tokenized, truncated to
    ``length - 1`` tokens and closed with EOS. Returns the ids and a truncation note (or None)."""
    ids = list(vocabulary.encode(clean_article(text)))
    note = None
    if len(ids) > length - 1:
        note = f"{len(ids)} tokens, truncated to the model's input length of {length - 1} (+ EOS)"
        ids = ids[: length - 1]
    return ids + [eos_id], note

"""Texts as the summarization tasks tokenize them, for inputs that do not come from a task
(``terra-summarize``, the Python API). Pure Python: importing it loads nothing heavy."""

import re
from typing import List, Optional, Tuple


def clean_article(text: str) -> str:
    """The article side of the summarization preprocessing (``preprocessors.summarization``):
    ``<S>``/``</S>`` tags removed, surrounding whitespace stripped."""
    return re.sub(r"</?S>", " ", text).strip()


# Characters per token the first slice of a long text is given (SentencePiece pieces average 4–5
# characters of English); a slice that yields too few tokens is widened 4x until it does.
_CHARACTERS_PER_TOKEN = 16


def _usable_ids(text: str, vocabulary, length: int) -> Tuple[List[int], bool]:
    """The ids of ``text`` up to more than ``length`` of them, and whether that is all of the text.
    A long text is encoded in slices that end at whitespace, so a 50 MB file costs what its first
    words do: the pieces of a slice are the first pieces of the whole text (SentencePiece splits
    at whitespace before it segments; a byte vocabulary maps byte to id)."""
    budget = max(64, length * _CHARACTERS_PER_TOKEN)
    while budget < len(text):
        cut = text.rfind(" ", 0, budget)
        cut = budget if cut <= 0 else cut  # no space to cut at: the slice as it is
        ids = list(vocabulary.encode(text[:cut]))
        if len(ids) > length:
            return ids, False
        budget *= 4
    return list(vocabulary.encode(text)), True


def encode_text(
    text: str, vocabulary, length: int, eos_id: int = 1, feature: str = "inputs"
) -> Tuple[List[int], Optional[str]]:
    """One text as the tasks tokenize it: ``<S>`` tags removed, stripped, tokenized, truncated to
    ``length - 1`` tokens and closed with EOS. Returns the ids and a truncation note (or None).
    Only as much of the text is tokenized as can be used (``_usable_ids``)."""
    ids, whole = _usable_ids(clean_article(text), vocabulary, length)
    note = None
    if len(ids) > length - 1:
        count = f"{len(ids)} tokens" if whole else f"more than {length - 1} tokens ({len(text):,} characters)"
        what = "target" if feature == "targets" else "input"
        note = f"{count}, truncated to the model's {what} length of {length - 1} (+ EOS)"
        ids = ids[: length - 1]
    return ids + [eos_id], note

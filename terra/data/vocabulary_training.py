"""The texts a vocabulary is trained on (``terra-vocab``): documents of a UTF-8 file, or the raw
text of a terra task's split. Training itself is :func:`terra.data.vocabularies.train_sentencepiece`.
This module sits above :mod:`terra.data.tasks` and :mod:`terra.data.vocabularies`, which know
nothing of it."""

import re
from typing import List

from terra.data import json_lines, sources, tasks

# The features holding a task source's raw text: C4's ``text``, arXiv's ``article``/``abstract``
# (and the embedded corpus's, which uses the same names).
TASK_TEXT_FEATURES = ("text", "article", "abstract")
ROUND_TRIP_SAMPLE = "first sentence .\nsecond sentence ."

_BLANK_LINES = re.compile(r"\n(?:[ \t]*\n)+")  # one or more blank (or whitespace-only) lines


def read_documents(path: str, *, documents: str = "blocks") -> List[str]:
    """Documents of a UTF-8 text file: blank-line-separated ``"blocks"`` (single newlines are
    kept inside a document) or one per line (``"lines"``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\r\n", "\n")
    parts = _BLANK_LINES.split(text) if documents == "blocks" else text.split("\n")
    return [p.strip("\n") for p in parts if p.strip()]


def task_texts(name: str, *, split: str = "train", max_documents: int = 1_000_000) -> List[str]:
    """The raw text of a task's source (before tokenization), in a fixed shuffled order: up to
    ``max_documents`` examples from each of its sources (a mixture's members in turn)."""
    provider = tasks.get_task(name)
    texts: List[str] = []
    for task in tasks.members(provider):
        sources.check_available(task.source, split)
        examples = task.source.get_dataset(split, shuffle=True, seed=0).take(max_documents).as_numpy_iterator()
        for example in json_lines.checked(examples, **tasks.read_checks(task, split)):
            texts += [example[k].decode("utf-8") for k in TASK_TEXT_FEATURES if k in example and example[k]]
    return texts

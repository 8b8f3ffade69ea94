"""``train_vocab``: train a SentencePiece vocabulary from the command line.

The text comes from one of three places: UTF-8 files (``--input``), the embedded corpus
(``--embedded``, no download) or the raw text of a terra task's split (``--task``, e.g. the
user's C4 through the same data flags as training). The model is trained by
:func:`terra.data.vocabularies.train_sentencepiece` (T5 id layout, newline kept as a piece), and
the command prints the model's path and a round trip of a two-line sample through seqio::

  python -m terra.data.vocabulary_training --embedded --out vocab/spm-8k.model --vocab_size 8000
  python -m terra.data.vocabulary_training --input corpus.txt [--input more.txt] --out my.model
  python -m terra.data.vocabulary_training --task c4_span_corruption --c4_json /data/c4 \\
      --max_documents 200000 --out vocab/c4-32k.model --vocab_size 32000

``scripts/train_vocab.py`` runs the same command. This module sits above
:mod:`terra.data.tasks` and :mod:`terra.data.vocabularies`, which know nothing of it.
"""

import argparse
import os
import re
import sys
from typing import Iterable, List, Optional, Sequence

import seqio

from terra import gin_utils
from terra.data import embedded, sources, tasks, vocabularies

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
    members = provider.tasks if isinstance(provider, seqio.Mixture) else [provider]
    texts: List[str] = []
    for task in members:
        sources.check_available(task.source, split)
        for example in task.source.get_dataset(split, shuffle=True, seed=0).take(max_documents).as_numpy_iterator():
            texts += [example[k].decode("utf-8") for k in TASK_TEXT_FEATURES if k in example and example[k]]
    return texts


def build_arg_parser() -> argparse.ArgumentParser:
    """The command's parser; new text sources join the ``source`` group."""
    parser = argparse.ArgumentParser(
        prog="train_vocab",
        description="Train a SentencePiece vocabulary (T5 id layout, newline kept as a piece).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        action="append",
        metavar="FILE",
        help="UTF-8 text file (repeatable); see --documents for how it is split into documents",
    )
    source.add_argument("--embedded", action="store_true", help="the embedded corpus's train split (no download)")
    source.add_argument("--task", help="the raw text (text, article, abstract) of a terra task's split, e.g. c4_span_corruption")
    parser.add_argument("--split", default="train", help="--task split to read")
    parser.add_argument("--max_documents", type=int, default=1_000_000, help="--task documents to read at most")
    parser.add_argument(
        "--documents",
        choices=("blocks", "lines"),
        default="blocks",
        help="--input documents are blank-line-separated blocks (default; newlines inside are kept) or single lines",
    )
    parser.add_argument("--out", required=True, metavar="PATH.model", help="where to write the model (and .vocab)")
    parser.add_argument("--vocab_size", type=int, default=vocabularies.DEFAULT_EMBEDDED_VOCAB_SIZE)
    parser.add_argument("--model_type", choices=("unigram", "bpe", "char", "word"), default="unigram")
    parser.add_argument("--input_sentence_size", type=int, default=2_000_000, help="most documents sampled")
    parser.add_argument("--num_threads", type=int, default=2)
    parser.add_argument(
        "--hard_vocab_limit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fail when the text cannot fill --vocab_size (--no-hard_vocab_limit: take fewer pieces)",
    )
    parser.add_argument("--cache_dir", default=None, help="embedded corpus cache root (default $TERRA_CACHE_DIR)")
    tasks.add_data_flags(parser)
    return parser


def texts_from_args(args: argparse.Namespace) -> Iterable[str]:
    """The documents the parsed command line names (``--embedded``, ``--task`` or ``--input``)."""
    if args.embedded:
        return embedded.corpus_texts(split="train", cache_dir=args.cache_dir)
    if args.task:
        gin_utils.parse_gin([], tasks.data_flag_bindings(args))
        return task_texts(args.task, split=args.split, max_documents=args.max_documents)
    texts: List[str] = []
    for path in args.input:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"input file not found: {os.path.abspath(path)}")
        texts.extend(read_documents(path, documents=args.documents))
    if not texts:
        raise ValueError(f"no text in {', '.join(args.input)}")
    return texts


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``train_vocab``: trains, prints the model path and a round trip through seqio. Returns 0,
    or 2 after printing ``error: ...`` when the input cannot be used."""
    args = build_arg_parser().parse_args(argv)
    try:
        path = vocabularies.train_sentencepiece(
            texts_from_args(args),
            args.out,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            input_sentence_size=args.input_sentence_size,
            num_threads=args.num_threads,
            hard_vocab_limit=args.hard_vocab_limit,
        )
    except (OSError, ValueError, RuntimeError) as e:  # incl. DataNotFoundError, ConfigError
        # Bad input is the user's to fix; the message is enough, a traceback is noise.
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra_ids = vocabularies.DEFAULT_EXTRA_IDS
    vocab = vocabularies.sentencepiece_vocabulary(path, extra_ids=extra_ids)
    ids = vocab.encode(ROUND_TRIP_SAMPLE)
    decoded = vocab.decode(ids)
    print(f"wrote {path} ({vocab.vocab_size} ids: {vocab.vocab_size - extra_ids} pieces + {extra_ids} extra ids)")
    print(f"  text    {ROUND_TRIP_SAMPLE!r}")
    print(f"  pieces  {[vocab.tokenizer.id_to_piece(i) for i in ids]}")
    print(f"  ids     {ids}")
    print(f"  decoded {decoded!r} ({'round trip ok' if decoded == ROUND_TRIP_SAMPLE else 'ROUND TRIP DIFFERS'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a SentencePiece vocabulary (T5's id layout: pad 0, EOS 1, UNK 2, 100 sentinels on top;
newline kept as a piece, so ROUGE-Lsum sees sentence breaks).

The text comes from UTF-8 files (--input), the embedded corpus (--embedded, no download) or
the raw text of a terra task's split (--task, with the same data flags as training). Prints the
model's path and a round trip of a two-line sample through seqio.

  terra-vocab --embedded --out vocab/spm-8k.model --vocab_size 8000
  terra-vocab --input corpus.txt --input more.txt --out my.model
  terra-vocab --task c4_span_corruption --c4_json /data/c4/en --max_documents 200000 \\
      --out vocab/c4-32k.model --vocab_size 32000          # the paper's size, from your C4
"""

from absl import flags

from terra import errors, tensorflow_setup
from terra.cli import app, flag_groups


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_multi_string("input", [], "UTF-8 text file; see --documents", flag_values=flag_values)
    flags.DEFINE_bool(
        "embedded", False, "train on the embedded corpus's train split (no download)", flag_values=flag_values
    )
    flags.DEFINE_string(
        "task",
        None,
        "train on the raw text (text, article, abstract) of a terra task's split, e.g. c4_span_corruption",
        flag_values=flag_values,
    )
    flags.DEFINE_string("split", "train", "--task split to read", flag_values=flag_values)
    flags.DEFINE_integer("max_documents", 1_000_000, "--task documents to read at most", flag_values=flag_values)
    flags.DEFINE_enum(
        "documents",
        "blocks",
        ["blocks", "lines"],
        "--input documents are blank-line-separated blocks (newlines inside are kept) or single lines",
        flag_values=flag_values,
    )
    flags.DEFINE_string("out", None, "where to write the model (PATH.model, and PATH.vocab)", flag_values=flag_values)
    flags.mark_flag_as_required("out", flag_values=flag_values)
    flags.DEFINE_integer("vocab_size", 4000, "pieces (the ids add 100 sentinels)", flag_values=flag_values)
    flags.DEFINE_enum(
        "model_type", "unigram", ["unigram", "bpe", "char", "word"], "SentencePiece model type", flag_values=flag_values
    )
    flags.DEFINE_integer("input_sentence_size", 2_000_000, "most documents sampled", flag_values=flag_values)
    flags.DEFINE_integer("num_threads", 2, "training threads", flag_values=flag_values)
    flags.DEFINE_bool(
        "hard_vocab_limit",
        True,
        "fail when the text cannot fill --vocab_size (--nohard_vocab_limit: take fewer pieces)",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "cache_dir", None, "embedded corpus cache root (default $TERRA_CACHE_DIR)", flag_values=flag_values
    )
    flag_groups.define_data_flags(flag_values)


def check_sources(flag_values: flags.FlagValues) -> None:
    """Exactly one of --input, --embedded and --task, and every --input a file: checked before
    the data layer (seqio, TensorFlow) loads, so a mistyped path is reported in a second."""
    import os

    chosen = [name for name in ("input", "embedded", "task") if flag_values[name].value]
    if len(chosen) != 1:
        raise errors.UsageError("give exactly one text source: --input FILE, --embedded or --task NAME.")
    for path in flag_values.input:
        if not os.path.exists(path):
            raise errors.InputError(f"input file not found: {os.path.abspath(path)}")
        if not os.path.isfile(path):  # a folder, a FIFO or a device: nothing is read from it
            raise errors.InputError(f"input is not a regular file: {os.path.abspath(path)}")


def texts(flag_values: flags.FlagValues):
    """The documents the command line names (its sources checked by :func:`check_sources`)."""
    if flag_values.embedded:
        from terra.data import embedded

        return embedded.corpus_texts(split="train", cache_dir=flag_values.cache_dir)
    from terra.data import vocabulary_training

    if flag_values.task:
        from terra.gin_config import parsing

        parsing.parse_gin([], flag_groups.data_bindings(flag_values))
        return vocabulary_training.task_texts(
            flag_values.task, split=flag_values.split, max_documents=flag_values.max_documents
        )
    documents = []
    for path in flag_values.input:
        documents.extend(vocabulary_training.read_documents(path, documents=flag_values.documents))
    if not documents:
        raise errors.InputError(f"no text in {', '.join(flag_values.input)}")
    return documents


def run(flag_values: flags.FlagValues, _) -> int:
    check_sources(flag_values)
    tensorflow_setup.before_data_layer()  # the vocabulary is seqio's, the --task text a seqio task's
    from terra.data import vocabularies
    from terra.data.vocabulary_training import ROUND_TRIP_SAMPLE

    try:
        path = vocabularies.train_sentencepiece(
            texts(flag_values),
            flag_values.out,
            vocab_size=flag_values.vocab_size,
            model_type=flag_values.model_type,
            input_sentence_size=flag_values.input_sentence_size,
            num_threads=flag_values.num_threads,
            hard_vocab_limit=flag_values.hard_vocab_limit,
        )
    except RuntimeError as e:  # SentencePiece's own complaints (e.g. too little text for the size)
        raise errors.InputError(f"SentencePiece could not train on this text: {e}") from None
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


COMMAND = app.command("terra-vocab", "terra.cli.vocab", __doc__, define_flags=define_flags, run=run)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

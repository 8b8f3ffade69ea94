"""Summarize your own documents with a trained checkpoint.

Each FILE is a plain-text document, Cohan-format JSON lines (one paper per line with
article_text, as the arXiv release) or - for standard input. The run's own config.gin gives the
model, the vocabulary and the input length; the text goes through the training preprocessing
(<S>/</S> tags removed, tokenized, truncated to the model's input length with a note on standard
error, closed with EOS). Summaries go to standard output, one block per document. Decoding is
greedy unless --temperature is set (the paper sampled its abstracts at 0.5).

  terra-summarize --checkpoint runs/quickstart/finetune my_notes.txt
  cat paper.txt | terra-summarize --checkpoint /runs/terraformer_arxiv --temperature 0.5 -
"""

import sys

from absl import flags

from terra.cli import app, flag_groups


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string(
        "checkpoint", None, "a terra MODEL_DIR (its config.gin and checkpoints); required", flag_values=flag_values
    )
    flags.mark_flag_as_required("checkpoint", flag_values=flag_values)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=flag_values)
    flags.DEFINE_integer(
        "max_decode_length", None, "most tokens per summary (default: the run's target length)", flag_values=flag_values
    )
    flags.DEFINE_float(
        "temperature", 0.0, "0 is greedy; the paper sampled at 0.5", lower_bound=0.0, flag_values=flag_values
    )
    flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=flag_values)
    flags.DEFINE_integer("batch_size", 8, "documents decoded together", lower_bound=1, flag_values=flag_values)
    flags.DEFINE_bool(
        "force", False, "summarize with a run whose task is not a summarization task anyway", flag_values=flag_values
    )
    flag_groups.define_weights_dtype_flag(flag_values)
    flags.DEFINE_multi_string(
        "gin_bindings",
        [],
        "an extra gin binding 'NAME = VALUE'; --gin.NAME=VALUE is the short form",
        flag_values=flag_values,
    )
    flag_groups.define_data_flags(flag_values)


def summarize(flag_values: flags.FlagValues, paths, stdin=None, out=None, err=None) -> int:
    """Reads the documents (failing before the model is loaded), decodes, prints the summaries."""
    from terra.documents import read_documents

    out, err = out or sys.stdout, err or sys.stderr
    docs = read_documents(paths, stdin)
    from terra import api
    from terra.text_encoding import encode_text

    run = api.load(
        flag_values.checkpoint,
        flag_values.step,
        [*flag_groups.data_bindings(flag_values), *flag_values.gin_bindings],
        require_summarization=not flag_values.force,
        weights_dtype=flag_values.weights_dtype,
    )
    lengths = run.feature_lengths
    encoded = []
    for label, text in docs:
        ids, note = encode_text(text, run.vocabulary, lengths["inputs"], run.config.eos_id)
        if note:
            print(f"note: {label}: {note}.", file=err)
        encoded.append(ids)
    tokens = run.generate(
        encoded,
        max_new_tokens=flag_values.max_decode_length or lengths["targets"],
        temperature=flag_values.temperature,
        seed=flag_values.seed,
        batch_size=min(flag_values.batch_size, len(encoded)),
        progress=len(encoded) > flag_values.batch_size,  # a bar on standard error once there are several batches
    )
    for (label, _), summary in zip(docs, tokens):
        print(f"== {label} (step {run.step})", file=out)
        print(
            run.vocabulary.decode([int(t) for t in summary if t not in (run.config.eos_id, run.config.pad_id)]),
            file=out,
        )
        print(file=out)
    return 0


def gin_files(flag_values: flags.FlagValues):
    """The run's own config.gin, which ``terra.load`` parses before the bindings."""
    return flag_groups.run_config_files(flag_values.checkpoint) or None


COMMAND = app.command(
    "terra-summarize",
    "terra.cli.summarize",
    __doc__,
    define_flags=define_flags,
    run=lambda flag_values, paths: summarize(flag_values, paths),
    positional="FILE...",
    gin_files=gin_files,
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

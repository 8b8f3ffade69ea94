"""Summarize your own documents with a trained checkpoint, or time the decode with random weights.

Each FILE is a plain-text document, Cohan-format JSON lines (one paper per line with
article_text, as the arXiv release) or - for standard input. The run's own config.gin gives the
model, the vocabulary and the input length; the text goes through the training preprocessing
(<S>/</S> tags removed, tokenized, truncated to the model's input length with a note on standard
error, closed with EOS). Summaries go to standard output, one block per document. Decoding is
greedy unless --temperature is set (the paper sampled its abstracts at 0.5).

  terra-summarize --checkpoint runs/quickstart/finetune my_notes.txt
  cat paper.txt | terra-summarize --checkpoint /runs/terraformer_arxiv --temperature 0.5 -
  terra-summarize --checkpoint runs/quickstart/finetune --stream my_notes.txt   # words as decoded

--stream prints each summary as the jitted generation loop decodes it (a word once it is whole),
one document at a time: the same text, at the loop's speed (docs/decode_speed.md, "Streaming").

--random_weights builds the model of --gin_file model and task configs with random weights instead
(the decode benchmark's: no checkpoint needed), to time a whole paper's decode at the paper's
sizes. The summaries are noise; every document decodes --max_decode_length tokens (EOS does not
stop it); the timings are printed. The task's vocabulary tokenizes the text: the arXiv tasks' is
the built-in one trained on the embedded corpus (offline) unless --vocabulary names a file.

  terra-summarize --random_weights --gin_file=models/terraformer_lsh_800m.gin \\
      --gin_file=tasks/arxiv_summarization_paper.gin --weights_dtype=int8 --max_decode_length=256 paper.txt

--timing (always on with --random_weights) prints on standard error, per batch: its input tokens
(and the padded length the encoder reads), the prefill's seconds (the encoder and the caches'
fill), the tokens generated per document and the milliseconds per generated token inside the
jitted generation loop (the decode steps and the token choices), the seconds spent compiling
both ahead of them (first batch only; not in the other times), and the process's peak resident
memory so far (VmHWM). The compile and the prefill also get a line as each ends (a paper-size
model takes minutes on each).

A file that cannot be summarized (empty, not text, unreadable) does not stop the others: they are
summarized, then one 'error:' line names every such file (exit status 2).

Exit status: 0 done; 2 a bad command line (e.g. not exactly one of --checkpoint and
--random_weights), configuration, vocabulary, checkpoint or document, with one 'error:' line
saying what to change; 1 a run that cannot continue; 130 interrupted.
"""

import math
import sys

from absl import flags

from terra import errors, process_memory
from terra.cli import app, flag_groups


def _check_model_source(values) -> bool:
    """Exactly one of --checkpoint and --random_weights, and the flags that go with each: a
    ``UsageError`` from the flag parser (before anything heavy is imported), in one line without
    absl's list of the flags' values."""
    checkpoint, random_weights = values["checkpoint"], values["random_weights"]
    if (checkpoint is None) == (not random_weights):
        raise errors.UsageError(
            "give exactly one of --checkpoint=MODEL_DIR (a trained run) and --random_weights with --gin_file "
            "model and task configs (random weights, to time the decode)."
        )
    if random_weights and not values["gin_file"]:
        raise errors.UsageError(
            "--random_weights needs the model and task: --gin_file=models/terraformer_lsh_800m.gin "
            "--gin_file=tasks/arxiv_summarization_paper.gin, for example."
        )
    if checkpoint is not None and values["gin_file"]:
        raise errors.UsageError(
            "--gin_file is for --random_weights: with --checkpoint the run's own config.gin gives the model "
            "(override it with --gin.NAME=VALUE)."
        )
    if random_weights and values["step"] is not None:
        raise errors.UsageError("--step names a checkpoint's step: leave it out with --random_weights.")
    return True


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string(
        "checkpoint",
        None,
        "a terra MODEL_DIR (its config.gin and checkpoints); this or --random_weights",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "random_weights",
        False,
        "random weights for the model of --gin_file (a model and a task config) instead of a checkpoint: "
        "times the decode, the summaries are noise",
        flag_values=flag_values,
    )
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=flag_values)
    flags.DEFINE_integer(
        "max_decode_length", None, "most tokens per summary (default: the run's target length)", flag_values=flag_values
    )
    flags.DEFINE_float(
        "temperature", 0.0, "0 is greedy; the paper sampled at 0.5", lower_bound=0.0, flag_values=flag_values
    )
    flags.DEFINE_integer(
        "seed", 0, "sampling seed (and the random weights' with --random_weights)", flag_values=flag_values
    )
    flags.DEFINE_integer("batch_size", 8, "documents decoded together", lower_bound=1, flag_values=flag_values)
    flags.DEFINE_bool(
        "force", False, "summarize with a run whose task is not a summarization task anyway", flag_values=flag_values
    )
    flags.DEFINE_bool(
        "timing",
        False,
        "print per batch on standard error: input tokens, prefill seconds, tokens generated, ms per generated "
        "token in the generation loop, compile seconds and peak resident memory (on with --random_weights)",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "stream",
        False,
        "print each summary as it is decoded (whole words as they come), one document at a time",
        flag_values=flag_values,
    )
    flag_groups.define_weights_dtype_flag(flag_values, default=None)  # None: as the checkpoint stores them
    flag_groups.define_cache_dtype_flag(flag_values)
    flag_groups.define_gin_flags(
        flag_values,
        files_help="with --random_weights: the model and task gin files (later files override earlier ones); a "
        "relative name is looked up in the working directory, then --gin_search_paths, then terra's shipped "
        "configs (e.g. models/terraformer_lsh_800m.gin)",
    )
    flag_groups.define_data_flags(flag_values)
    flags.register_multi_flags_validator(
        ["checkpoint", "random_weights", "gin_file", "step"], _check_model_source, flag_values=flag_values
    )


def timing_line(times: dict, batches: int) -> str:
    """What one phase of a batch prints on standard error (``InteractiveModel.generate``'s
    ``timing``): the compile and the prefill as they end, then the batch's whole line."""
    rows, (peak, _) = times["rows"], process_memory.peak_resident()
    memory = f"; peak resident memory {peak / 2**30:.2f} GiB" if peak is not None else ""
    head = f"timing: batch {times['batch'] + 1}/{batches}: "
    if times["phase"] == "compiled":
        return f"{head}compiled the prefill and the generation loop in {times['compile_s']:.1f} s{memory}"
    inputs = f"{times['input_tokens']:,} input tokens (padded to {times['input_length']:,} per document)"
    if times["phase"] == "prefilled":
        return f"{head}prefill of {inputs} took {times['prefill_s']:.2f} s{memory}"
    steps = times["steps"]
    parts = [
        f"{head}{rows} document{'s' if rows != 1 else ''}, {inputs}",
        f"prefill {times['prefill_s']:.2f} s",
        f"{steps} tokens generated per document in {times['loop_s']:.2f} s = "
        f"{1000 * times['loop_s'] / max(steps, 1):.1f} ms/token (in the loop)",
    ]
    if times["compile_s"]:
        parts.append(f"compile {times['compile_s']:.1f} s (not included)")
    return "; ".join(parts) + memory


def summarize(flag_values: flags.FlagValues, paths, stdin=None, out=None, err=None) -> int:
    """Reads the documents (failing before the model is loaded), decodes, prints the summaries."""
    from terra.documents import read_documents

    out, err = out or sys.stdout, err or sys.stderr
    # What can be summarized is; the unusable files are reported after the summaries (exit 2).
    docs, problems = read_documents(paths, stdin, partial=True)
    from terra import api
    from terra.text_encoding import encode_text

    bindings = [*flag_groups.data_bindings(flag_values), *flag_values.gin_bindings]
    options = dict(
        require_summarization=not flag_values.force,
        weights_dtype=flag_values.weights_dtype,
        cache_dtype=flag_groups.cache_dtype(flag_values),
    )
    if flag_values.random_weights:
        run = api.build(
            flag_values.gin_file,
            bindings,
            flag_values.seed,
            random_weights=True,
            search_paths=flag_values.gin_search_paths,
            **{**options, "weights_dtype": options["weights_dtype"] or "float32"},
        )
        print(
            "note: --random_weights: the weights are random, so the summaries are noise; every document "
            "decodes --max_decode_length tokens (EOS does not stop it), for the timings.",
            file=err,
        )
    else:
        run = api.load(flag_values.checkpoint, flag_values.step, bindings, **options)
    lengths = run.feature_lengths
    encoded = []
    for label, text in docs:
        ids, note = encode_text(text, run.vocabulary, lengths["inputs"], run.config.eos_id)
        if note:
            print(f"note: {label}: {note}.", file=err)
        encoded.append(ids)
    timed = flag_values.timing or flag_values.random_weights
    options = dict(
        max_new_tokens=flag_values.max_decode_length or lengths["targets"],
        temperature=flag_values.temperature,
        seed=flag_values.seed,
        stop_at_eos=not flag_values.random_weights,
    )
    where = "random weights" if flag_values.random_weights else f"step {run.step}"
    if flag_values.stream:
        for (label, _), ids in zip(docs, encoded):
            print(f"== {label} ({where})", file=out, flush=True)
            _stream_summary(run, ids, out, err, timed, options)
            print(file=out, flush=True)
        return _report_unusable(problems, len(docs))
    batch_size = min(flag_values.batch_size, len(encoded))
    batches = math.ceil(len(encoded) / batch_size)
    tokens = run.generate(
        encoded,
        batch_size=batch_size,
        # a bar on standard error once there are several batches (the timing lines instead, when printed)
        progress=len(encoded) > flag_values.batch_size and not timed,
        timing=(lambda times: print(timing_line(times, batches), file=err, flush=True)) if timed else None,
        **options,
    )
    for (label, _), summary in zip(docs, tokens):
        print(f"== {label} ({where})", file=out)
        print(
            run.vocabulary.decode([int(t) for t in summary if t not in (run.config.eos_id, run.config.pad_id)]),
            file=out,
        )
        print(file=out)
    return _report_unusable(problems, len(docs))


def _report_unusable(problems, summarized: int) -> int:
    """0, or the files that could not be summarized as one ``InputError`` (exit 2), raised after
    the summaries of the others."""
    if not problems:
        return 0
    raise errors.InputError(
        f"{len(problems)} input file(s) could not be summarized ({summarized} document(s) above were): "
        + "; ".join(" ".join(p.split()) for p in problems)
    )


def _stream_summary(run, ids, out, err, timed: bool, options: dict) -> None:
    """One document's summary printed as the generation loop decodes it (whole words), the same
    text the batch path prints (the pad id skipped, as there)."""
    from terra.decoding.streaming import RowText

    text = RowText(run.vocabulary)

    def show(_row, token):
        if token != run.config.pad_id:
            out.write(text.add(token))
            out.flush()

    run.generate(
        [ids],
        streamer=show,
        timing=(lambda times: print(timing_line(times, 1), file=err, flush=True)) if timed else None,
        **options,
    )
    out.write(text.finish() + "\n")
    out.flush()


def gin_files(flag_values: flags.FlagValues):
    """The gin files parsed before the bindings: --gin_file with --random_weights, else the run's
    own config.gin, which ``terra.load`` parses."""
    if flag_values.random_weights:
        return list(flag_values.gin_file) or None
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

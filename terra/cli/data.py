"""Look at a task's data as a model will see it, and prepare the arXiv dataset offline."""

import sys

from absl import flags

from terra.cli import app, flag_groups

SHOW_DOC = """Print a few examples of a task as the model will see them (decoded text and token counts),
to check data locations, vocabulary and lengths before a run.

  terra-data show --task embedded_summarization --n 2
  terra-data show --task arxiv_summarization --arxiv_cohan /data/arxiv-dataset --inputs_length 4096
"""


def define_show_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string(
        "task",
        None,
        "a terra task (terra.data.tasks.task_names(): c4_span_corruption, "
        "arxiv_summarization, embedded_summarization, ...); required",
        flag_values=flag_values,
    )
    flags.mark_flag_as_required("task", flag_values=flag_values)
    flags.DEFINE_string("split", "validation", "split to read", flag_values=flag_values)
    flags.DEFINE_integer("n", 3, "examples to show", lower_bound=1, flag_values=flag_values)
    flags.DEFINE_integer("inputs_length", 512, "input tokens kept", flag_values=flag_values)
    flags.DEFINE_integer("targets_length", 128, "target tokens kept", flag_values=flag_values)
    flags.DEFINE_integer("seed", 0, "seed of the task's random preprocessing", flag_values=flag_values)
    flags.DEFINE_bool(
        "count",
        True,
        "count each split's records (local JSON files are read whole; --nocount for only the files)",
        flag_values=flag_values,
    )
    flag_groups.define_data_flags(flag_values)
    flag_groups.define_gin_flags(flag_values)


def run_show(flag_values: flags.FlagValues, _) -> int:
    from terra.data import json_lines, pipeline, sources, tasks
    from terra.gin_config import parsing

    gin = flag_groups.gin_arguments(flag_values)
    parsing.parse_gin(
        gin["gin_files"], flag_groups.data_bindings(flag_values) + gin["gin_bindings"], search_paths=gin["search_paths"]
    )
    provider = tasks.resolve(flag_values.task)
    source = getattr(provider, "source", None)  # a mixture has its tasks' sources
    if source is not None:
        for split, files, records in sources.split_inventory(source, count_records=flag_values.count):
            found = [f"{n:,d} {what}" for n, what in ((files, "files"), (records, "records")) if n is not None]
            print(f"split {split}: {', '.join(found) or 'no files to count (a built-in or generated source)'}")
    batches = pipeline.batch_iterator(
        provider,
        flag_values.split,
        batch_size=1,
        seed=flag_values.seed,
        shuffle=False,
        num_epochs=1,
        feature_lengths={"inputs": flag_values.inputs_length, "targets": flag_values.targets_length},
    )
    features = provider.output_features
    for i, batch in enumerate(batches):
        if i >= flag_values.n:
            break
        for name, key in (("inputs", "encoder_input_tokens"), ("targets", "decoder_target_tokens")):
            ids = [int(t) for t in batch[key][0] if t != 0]
            print(f"--- example {i} {name} ({len(ids)} tokens)")
            print(features[name].vocabulary.decode(ids))
    for line in json_lines.skip_report(batches.readers):
        print(f"note: {line}", file=sys.stderr)
    return 0


PREPARE_DOC = """Prepare TFDS scientific_papers/arxiv:1.1.1 offline from arxiv-dataset.zip (3.6 GB, from
github.com/armancohan/long-summarization) placed in <data_dir>/downloads/manual/ (or
--manual_dir). TFDS checks the archive's checksum; nothing is downloaded. Prints the prepared
dataset's directory; pass --tfds_data_dir=<data_dir> to training afterwards.

  terra-data prepare-arxiv --data_dir /data/tfds
"""


def define_prepare_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string(
        "data_dir", None, "TFDS data directory to prepare the dataset in; required", flag_values=flag_values
    )
    flags.mark_flag_as_required("data_dir", flag_values=flag_values)
    flags.DEFINE_string(
        "manual_dir",
        None,
        "folder holding arxiv-dataset.zip (default <data_dir>/downloads/manual)",
        flag_values=flag_values,
    )


def run_prepare(flag_values: flags.FlagValues, _) -> int:
    from terra.data import sources

    print(sources.prepare_arxiv(flag_values.data_dir, manual_dir=flag_values.manual_dir))
    return 0


COMMAND = app.group(
    "terra-data",
    "terra.cli.data",
    __doc__,
    {
        "show": app.command(
            "terra-data show",
            "terra.cli.data",
            SHOW_DOC,
            define_flags=define_show_flags,
            run=run_show,
            gin_files=lambda f: f.gin_file,
            reads_data=True,
        ),
        "prepare-arxiv": app.command(
            "terra-data prepare-arxiv",
            "terra.cli.data",
            PREPARE_DOC,
            define_flags=define_prepare_flags,
            run=run_prepare,
            reads_data=True,
        ),
    },
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

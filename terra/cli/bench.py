"""Benchmarks: decode speed (the paper's tables), training throughput, input pipelines, the
memory of reversible training and the accelerator check. Each prints a table and writes JSON
(and a plot for decode)."""

from absl import flags

from terra import errors
from terra.cli import app, flag_groups

DECODE_DOC = """Decode speed of the paper's models on this CPU (batch 1, or batches of sequences), against
its memory bandwidth.

Each model is built from its gin config with random weights; a 16-token input is prefilled, then
single-token steps are timed one jitted call at a time (the paper's protocol) and inside one
jitted while_loop (how generation runs). Reports ms per token (or per block), bytes read per
token, the floor those bytes set at the bandwidth measured before the rows, and the step's FLOPs.
Writes decode_speed.{md,json,png} and machine.json to --out. The long_document preset times each
row at inputs of 1,024, 4,096 and 15,360 tokens (prefill, in-loop ms per token, weight and cache
bytes per token, peak memory; rows the memory cannot hold are skipped with the reason). The
batched_800m preset times each row decoding 1, 4, 16 and 64 sequences at once (ms per step and
per sequence, tokens/s, the bytes of a step with the rows sparse layers select counted as their
union over the batch, the floor).

  terra-bench decode --preset paper_800m --out out/paper_800m        # Tables 1, 2, 7
  terra-bench decode --preset long_document --config.input_lengths=15360 --rows=float32 --out out/long
  terra-bench decode --preset paper_17b_block --out out/17b          # per block at 17B widths
  terra-bench decode --preset batched_800m --out out/batched         # batch 1, 4, 16 and 64
  terra-bench decode --preset batched_800m --rows="fully sparse" --config.batch_sizes=1,16
  terra-bench decode --preset sparsity_sweep --out out/sweep         # ms/token against N and S
  terra-bench decode --preset tiny                                   # seconds: a smoke run
  terra-bench decode --gin_file=models/fully_sparse_800m.gin         # one config
  terra-bench decode --preset paper_800m --config.tokens=20 --config.weights_dtype=bfloat16
  terra-bench decode --preset quantized_17b_block --rows="fully sparse"   # these rows and their baseline
  terra-bench decode --replot out/paper_800m                         # redraw table and plot only
"""


def define_decode_flags(flag_values: flags.FlagValues, argv) -> None:
    from terra.benchmarks import presets

    flag_groups.define_preset_flags(flag_values, argv, presets.PRESETS, "paper_800m", "decode-speed")
    flag_groups.define_gin_flags(
        flag_values, files_help="time this one model config instead of a preset's rows (the files are parsed together)"
    )
    flags.DEFINE_string(
        "out", None, "directory for decode_speed.{json,md,png} and machine.json", flag_values=flag_values
    )
    flags.DEFINE_multi_string(
        "rows",
        [],
        "time only the preset's rows whose names contain one of these (case-insensitive), with the rows "
        "they are measured against",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "replot",
        None,
        "redraw decode_speed.{md,png} from the decode_speed.json and machine.json in this directory, timing nothing",
        flag_values=flag_values,
    )


def run_decode(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import decode_speed, presets

    if flag_values.replot:
        from terra.benchmarks import report

        print(report.rerender(flag_values.replot))
        return 0
    gin = flag_groups.gin_arguments(flag_values)
    config = flag_values.config
    if gin["gin_files"]:
        if flag_values["preset"].present:
            raise errors.UsageError("give either --preset or --gin_file, not both.")
        single = presets.single_model(gin["gin_files"], gin["gin_bindings"])
        config.rows, config.common_bindings = single.rows, single.common_bindings
        title = f"decode speed, {' + '.join(gin['gin_files'])}"
    else:
        config.common_bindings = list(config.common_bindings) + gin["gin_bindings"]
        title = config.title or f"decode speed, preset {flag_values.preset}"
        if flag_values.rows:
            try:
                config = presets.select_rows(config, flag_values.rows)
            except ValueError as e:
                raise errors.UsageError(str(e)) from None
            title += " (selected rows)"
    decode_speed.run_preset(config, flag_values.out, title)
    return 0


TRAIN_DOC = """Training throughput (tokens per second) and compiled memory of the jitted train step,
dense against sparse, at a small size (6+6 layers, d_model 512), on fixed random batches: it
reads no data and needs no TensorFlow. Sparse layers train with their masks over all units
(paper §3), so training is not expected to be faster. Writes train_speed.{json,md}.

  terra-bench train --out out/train_speed
  terra-bench train --rows=dense --rows=terraformer --gin.TransformerConfig.dropout=0.0
"""


def define_train_flags(flag_values: flags.FlagValues, argv) -> None:
    from terra.benchmarks.presets import TRAIN_SPEED_ROWS

    flags.DEFINE_string("out", "out/train_speed", "output directory", flag_values=flag_values)
    flags.DEFINE_integer("batch_size", 8, "examples per step", flag_values=flag_values)
    flags.DEFINE_integer("inputs", 256, "input tokens per example", flag_values=flag_values)
    flags.DEFINE_integer("targets", 64, "target tokens per example", flag_values=flag_values)
    flags.DEFINE_integer("steps", 5, "timed steps per row (median reported)", flag_values=flag_values)
    flags.DEFINE_bool("small", False, "a tiny size, for a smoke test", flag_values=flag_values)
    flags.DEFINE_multi_enum("rows", [], list(TRAIN_SPEED_ROWS), "rows to run (default all)", flag_values=flag_values)
    flag_groups.define_gin_flags(flag_values, files_help="gin file parsed after each row's own model config")


def run_train(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import train_speed

    gin = flag_groups.gin_arguments(flag_values)
    train_speed.run(
        flag_values.out,
        rows=flag_values.rows,
        batch_size=flag_values.batch_size,
        inputs=flag_values.inputs,
        targets=flag_values.targets,
        steps=flag_values.steps,
        small=flag_values.small,
        gin_files=gin["gin_files"],
        gin_bindings=gin["gin_bindings"],
    )
    return 0


INPUT_DOC = """Tokens per second of the C4 and arXiv input pipelines (JSON lines and TFDS), to see whether
input keeps up with training. Without data flags the rows read datasets written to a temporary
directory from the embedded corpus in every on-disk format; with --c4_json, --arxiv_cohan and
--tfds_data_dir they read yours. Writes input_pipeline.{json,md}.

  terra-bench input --out out/input_pipeline
"""


def define_input_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string("out", "out/input_pipeline", "output directory", flag_values=flag_values)
    flags.DEFINE_integer("batch_size", 8, "examples per batch", flag_values=flag_values)
    flags.DEFINE_float("seconds", 10.0, "timed seconds per row", flag_values=flag_values)
    flags.DEFINE_integer(
        "copies", 3, "passes over the embedded corpus in the written datasets", flag_values=flag_values
    )
    flag_groups.define_data_flags(flag_values)
    flag_groups.define_gin_flags(flag_values)


def run_input(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import input_pipeline

    gin = flag_groups.gin_arguments(flag_values)
    data = {name: flag_values[name].value for name in flag_groups.DATA_FLAGS}
    input_pipeline.run(
        flag_values.out,
        data=data,
        bindings_for=flag_groups.data_bindings,
        batch_size=flag_values.batch_size,
        seconds=flag_values.seconds,
        copies=flag_values.copies,
        gin_files=gin["gin_files"],
        gin_bindings=gin["gin_bindings"],
    )
    return 0


MEMORY_DOC = """Compiled training-step memory of a Terraformer against its depth, with the reversible
backward pass and with plain autodiff (paper §4.2): reversible layers store no activations
between layers. Compiles only; prints a table and writes reversible_memory.json with --out.

  terra-bench memory --depths=1,2,4,8
"""


def define_memory_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string("out", None, "directory for reversible_memory.json", flag_values=flag_values)
    flags.DEFINE_list("depths", ["1", "2", "4", "8"], "encoder and decoder layers of each row", flag_values=flag_values)
    flags.DEFINE_integer("d_model", 256, "model width (d_ff is 4x)", flag_values=flag_values)
    flags.DEFINE_integer("batch", 4, "examples per step", flag_values=flag_values)
    flags.DEFINE_integer("inputs", 256, "input tokens per example", flag_values=flag_values)
    flags.DEFINE_integer("targets", 64, "target tokens per example", flag_values=flag_values)


def run_memory(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import reversible_memory

    try:
        depths = [int(d) for d in flag_values.depths]
    except ValueError:
        raise errors.UsageError(f"--depths={','.join(flag_values.depths)}: give integers, e.g. 1,2,4,8.") from None
    reversible_memory.run(
        flag_values.out,
        depths=depths,
        d_model=flag_values.d_model,
        batch=flag_values.batch,
        inputs=flag_values.inputs,
        targets=flag_values.targets,
    )
    return 0


PRODUCTS_DOC = """Narrow-weight matrix-vector products (float32, int8, bfloat16; XLA and the native kernels)
at the decode step's shapes, beside the read bandwidth measured in the same run.

  terra-bench products
  terra-bench products --rows 8        # beams: up to 8 rows take the native kernel
"""


def define_products_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_integer(
        "rows", 1, "rows of x (1 = batch-1 decoding; at most 8 take the kernel)", lower_bound=1, flag_values=flag_values
    )
    flags.DEFINE_integer(
        "repeats", 15, "timed calls per product (the median is reported)", lower_bound=1, flag_values=flag_values
    )


def run_products(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import quantized_products

    quantized_products.run(flag_values.rows, flag_values.repeats)
    return 0


ACCELERATOR_DOC = """The dense and fully sparse 800M models on whatever accelerator JAX sees (one chip): the
train step in bfloat16 (tokens/s, and MFU against the chip's peak bfloat16 FLOP/s where the chip
is known) and batch-1 greedy decode. Minutes on a GPU or TPU; scripts/accelerator_check.sh runs
it under an 8-minute limit. Needs no TensorFlow. Writes accelerator_check.{json,md} to --out.

  terra-bench accelerator --out out/accelerator
  terra-bench accelerator --smoke --out /tmp/check     # the smallest sizes: seconds, on a CPU too
"""


def define_accelerator_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string("out", "out/accelerator", "directory for accelerator_check.{json,md}", flag_values=flag_values)
    flags.DEFINE_bool(
        "smoke", False, "the smallest sizes (terra-bench train's smoke size), for a CPU", flag_values=flag_values
    )


def run_accelerator(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import accelerator_check

    size = accelerator_check.SMOKE if flag_values.smoke else accelerator_check.FULL
    accelerator_check.run(flag_values.out, size=size)
    return 0


def _sub(name, doc, define, run, **kwargs):
    return app.command(f"terra-bench {name}", "terra.cli.bench", doc, define_flags=define, run=run, **kwargs)


COMMAND = app.group(
    "terra-bench",
    "terra.cli.bench",
    __doc__,
    {
        "decode": _sub("decode", DECODE_DOC, define_decode_flags, run_decode, gin_files=lambda f: f.gin_file or None),
        "train": _sub("train", TRAIN_DOC, define_train_flags, run_train),
        "input": _sub("input", INPUT_DOC, define_input_flags, run_input, reads_data=True),
        "memory": _sub("memory", MEMORY_DOC, define_memory_flags, run_memory),
        "products": _sub("products", PRODUCTS_DOC, define_products_flags, run_products),
        "accelerator": _sub("accelerator", ACCELERATOR_DOC, define_accelerator_flags, run_accelerator),
    },
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

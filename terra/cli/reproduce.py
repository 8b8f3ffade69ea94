"""Reproduce the paper's claims at a size a CPU trains: the sparsity study and the
length-generalization study (Table 4); check that parallel layouts train the same model; and
measure what quantized weights cost trained runs in quality.

Each study trains ordinary terra-train runs under OUT/runs/<variant>/seed<k>, writes
<study>.{json,md,png} to OUT, and resumes when run again into the same --out.
--config.FIELD=VALUE changes a study setting (--help lists them with the preset's values);
--gin.NAME=VALUE is added to every run.
"""

from absl import flags

from terra import errors
from terra.cli import app, flag_groups
from terra.reproduce import presets

SPARSITY_DOC = """Sparse is enough: the dense model against every sparse layer at equal steps.

Trains the dense encoder-decoder and its sparse variants (Sparse FF N=16/32/64, Sparse QKV,
Sparse FF+QKV, + sparse loss, the MoE baseline) from their 800M gin configs at small widths, on
the same data and seeds, and reports eval log-perplexity, the gap to dense and each variant's
batch-1 decode time. The embedded corpus by default; --c4_json or --tfds_data_dir for C4.

  terra-reproduce sparsity --out out/reproduce/sparsity
  terra-reproduce sparsity --out DIR --config.seeds=0,1,2 --config.steps=2000
  terra-reproduce sparsity --out DIR --c4_json=/data/c4/en
"""

LENGTH_DOC = """Paper Table 4: do Transformer and Terraformer trained on short inputs copy and add inputs
twice as long? Trains both on the synthetic copy and addition tasks and reports token and
whole-sequence accuracy at 2x the training length, next to the paper's figures.

  terra-reproduce length_generalization --out out/reproduce/length
  terra-reproduce length_generalization --out DIR --preset paper              # the paper's sizes
"""


def _define_out_gin_and_data_flags(flag_values: flags.FlagValues, out_help: str, gin_help: str) -> None:
    """``--out`` (required), ``--gin_bindings`` (``--gin.NAME=VALUE``) and the data flags."""
    flags.DEFINE_string("out", None, out_help, flag_values=flag_values)
    flags.mark_flag_as_required("out", flag_values=flag_values)
    flags.DEFINE_multi_string(
        "gin_bindings", [], f"{gin_help} (--gin.NAME=VALUE is the short form)", flag_values=flag_values
    )
    flag_groups.define_data_flags(flag_values)


def _define(study_presets, what):
    def define_flags(flag_values: flags.FlagValues, argv) -> None:
        flag_groups.define_preset_flags(flag_values, argv, study_presets, "small", what)
        _define_out_gin_and_data_flags(
            flag_values, "directory for the study's JSON, Markdown, PNG and runs/", "a gin binding added to every run"
        )

    return define_flags


def run_sparsity(flag_values: flags.FlagValues, _) -> int:
    from terra.reproduce import sparsity

    sparsity.run(
        flag_values.config,
        flag_values.out,
        data_bindings=flag_groups.data_bindings(flag_values),
        extra_bindings=flag_values.gin_bindings,
    )
    return 0


def run_length(flag_values: flags.FlagValues, _) -> int:
    from terra.reproduce import length_generalization

    if flag_groups.given_data_flags(flag_values):
        raise errors.UsageError(
            f"length_generalization generates its data; "
            f"{', '.join(flag_groups.given_data_flags(flag_values))} does not apply."
        )
    length_generalization.run(flag_values.config, flag_values.out, extra_bindings=flag_values.gin_bindings)
    return 0


LAYOUTS_DOC = """Do parallel layouts train the same model? Trains one run on one device and on each
data x model mesh (forced CPU devices) and prints, per step, the relative difference of the loss
and of all parameters from the one-device run. --perturb adds a one-device run from parameters
moved by one float32 ulp, the smallest possible change (docs/training.md, "Parallel layouts
train the same model").

  terra-reproduce layouts --steps 30 --perturb                       # the quick start, 8x1, 4x2, 2x4
  terra-reproduce layouts --gin.terra.training.rsqrt_schedule.warmup_steps=10000
"""


def define_layouts_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_integer("steps", 30, "training steps of every run", lower_bound=1, flag_values=flag_values)
    flags.DEFINE_string("layouts", "8x1,4x2,2x4", "data x model meshes, comma-separated", flag_values=flag_values)
    flags.DEFINE_boolean("perturb", False, "add a one-device run from parameters one ulp away", flag_values=flag_values)
    flag_groups.define_gin_flags(flag_values)


def _parse_layouts(text: str):
    try:
        layouts = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        layouts = []
    if not layouts or any(len(layout) != 2 or min(layout) < 1 for layout in layouts):
        raise errors.UsageError(f"--layouts={text}: give data x model meshes like 8x1,4x2,2x4.")
    return layouts


def run_layouts(flag_values: flags.FlagValues, _) -> int:
    import os

    layouts = _parse_layouts(flag_values.layouts)
    needed = max(d * m for d, m in layouts)
    # Before JAX starts: the CPU backend reads the device count once.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={needed}"
    from terra.reproduce import layouts as layouts_lib

    gin = flag_groups.gin_arguments(flag_values)
    table = layouts_lib.compare(
        gin["gin_files"] or ["experiments/quickstart.gin"],
        gin["gin_bindings"],
        steps=flag_values.steps,
        layouts=layouts,
        perturb=flag_values.perturb,
    )
    print(layouts_lib.format_table(table))
    return 0


QUANTIZATION_DOC = """The quality cost of quantized weights: each trained run's eval log-perplexity and greedy
outputs with its weights stored as float32, bfloat16 and int8 (bars: |Δ| <= 0.002 nats for
bfloat16, <= 0.01 for int8). Reads runs trained before (each MODEL_DIR's config.gin gives the task
and its data); writes quantization.{json,md} to --out.

  terra-reproduce quantization --runs runs/quickstart/pretrain,runs/quickstart/finetune --out DIR
  terra-reproduce quantization --study out/reproduce/sparsity --out DIR   # every runs/<variant>/seed<k>
  terra-reproduce quantization --runs DIR --out DIR --config.decode_examples=128 --config.eval_batches=32
"""


def define_quantization_flags(flag_values: flags.FlagValues, argv) -> None:
    flag_groups.define_preset_flags(flag_values, argv, presets.QUANTIZATION_PRESETS, "default", "quantization")
    flags.DEFINE_list(
        "runs", [], "trained run directories (terra MODEL_DIRs), comma-separated", flag_values=flag_values
    )
    flags.DEFINE_string(
        "study", None, "a study's --out folder: measure every runs/<variant>/seed<k> in it", flag_values=flag_values
    )
    _define_out_gin_and_data_flags(
        flag_values,
        "directory for quantization.json and quantization.md",
        "a gin binding added to every run's config.gin",
    )


def run_quantization(flag_values: flags.FlagValues, _) -> int:
    from terra.reproduce import quantization

    quantization.run(
        flag_values.config,
        flag_values.out,
        run_dirs=flag_values.runs,
        study_dir=flag_values.study,
        bindings=[*flag_groups.data_bindings(flag_values), *flag_values.gin_bindings],
    )
    return 0


def _study(name, doc, study_presets, run):
    return app.command(
        f"terra-reproduce {name}",
        "terra.cli.reproduce",
        doc,
        define_flags=_define(study_presets, name),
        run=run,
        reads_data=True,
    )


COMMAND = app.group(
    "terra-reproduce",
    "terra.cli.reproduce",
    __doc__,
    {
        "sparsity": _study("sparsity", SPARSITY_DOC, presets.SPARSITY_PRESETS, run_sparsity),
        "length_generalization": _study("length_generalization", LENGTH_DOC, presets.LENGTH_PRESETS, run_length),
        "layouts": app.command(
            "terra-reproduce layouts",
            "terra.cli.reproduce",
            LAYOUTS_DOC,
            define_flags=define_layouts_flags,
            run=run_layouts,
            gin_files=lambda f: f.gin_file or ["experiments/quickstart.gin"],
            reads_data=True,
        ),
        "quantization": app.command(
            "terra-reproduce quantization",
            "terra.cli.reproduce",
            QUANTIZATION_DOC,
            define_flags=define_quantization_flags,
            run=run_quantization,
            reads_data=True,
        ),
    },
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

"""Reproduce the paper's claims at a size a CPU trains: the sparsity study and the
length-generalization study (Table 4).

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

  terra-reproduce sparsity --out out/reproduce/sparsity                       # about 40 min on 2 cores
  terra-reproduce sparsity --out DIR --config.seeds=0,1,2 --config.steps=2000
  terra-reproduce sparsity --out DIR --c4_json=/data/c4/en
"""

LENGTH_DOC = """Paper Table 4: do Transformer and Terraformer trained on short inputs copy and add inputs
twice as long? Trains both on the synthetic copy and addition tasks and reports token and
whole-sequence accuracy at 2x the training length, next to the paper's figures.

  terra-reproduce length_generalization --out out/reproduce/length            # about 40 min on 2 cores
  terra-reproduce length_generalization --out DIR --preset paper              # the paper's sizes
"""


def _define(study_presets, what):
    def define_flags(flag_values: flags.FlagValues, argv) -> None:
        flag_groups.define_preset_flags(flag_values, argv, study_presets, "small", what)
        flags.DEFINE_string(
            "out", None, "directory for the study's JSON, Markdown, PNG and runs/", flag_values=flag_values
        )
        flags.mark_flag_as_required("out", flag_values=flag_values)
        flags.DEFINE_multi_string(
            "gin_bindings",
            [],
            "a gin binding added to every run (--gin.NAME=VALUE is the short form)",
            flag_values=flag_values,
        )
        flag_groups.define_data_flags(flag_values)

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


def _study(name, doc, study_presets, run):
    return app.command(
        f"terra-reproduce {name}", "terra.cli.reproduce", doc, define_flags=_define(study_presets, name), run=run
    )


COMMAND = app.group(
    "terra-reproduce",
    "terra.cli.reproduce",
    __doc__,
    {
        "sparsity": _study("sparsity", SPARSITY_DOC, presets.SPARSITY_PRESETS, run_sparsity),
        "length_generalization": _study("length_generalization", LENGTH_DOC, presets.LENGTH_PRESETS, run_length),
    },
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

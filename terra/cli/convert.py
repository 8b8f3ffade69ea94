"""Convert checkpoints of other frameworks into terra run directories (also ``python -m terra.cli.convert``).

terra-convert trax --checkpoint model.pkl.gz --trax_config ARGS.json --out runs/from_trax
terra-convert trax --checkpoint model.pkl.gz --gin_file models/sparse_ff_qkv_loss4_800m.gin --out runs/st
"""

from absl import flags

from terra.cli import app, flag_groups

TRAX_DOC = """Convert a checkpoint of the paper's own code (Trax ConfigurableTransformer or
ConfigurableTerraformer, model.pkl.gz) into a terra run directory (config.gin + an orbax
checkpoint at step 0) that terra-evaluate, terra-summarize, terra.load, fine-tuning
(--gin.INIT_FROM) and terra-bench decode --gin_file OUT/config.gin accept. The architecture comes
from the Trax constructor arguments (--trax_config ARGS.json) or a terra model config of the
same architecture (--gin_file); add a task config (--gin_file tasks/NAME.gin) so the run knows
its data. Every array is checked; nothing is written on error.

  terra-convert trax --checkpoint model.pkl.gz --trax_config ARGS.json --out runs/from_trax
  python -m terra.cli.convert trax --checkpoint model.pkl.gz --trax_config ARGS.json \\
      --gin_file tasks/c4_span_corruption.gin --out runs/from_trax
"""


def define_trax_flags(flag_values: flags.FlagValues, argv) -> None:
    flag_groups.define_gin_flags(
        flag_values,
        files_help="a terra model config of the checkpoint's architecture (instead of --trax_config), and/or "
        "task configs (tasks/NAME.gin) recorded in the run's config.gin",
    )
    flags.DEFINE_string("checkpoint", None, "the Trax weight file (model.pkl.gz)", flag_values=flag_values)
    flags.DEFINE_string(
        "trax_config",
        None,
        "JSON of the Trax model's constructor arguments ({'trax_constructor': ..., 'constructor_kwargs': {...}})",
        flag_values=flag_values,
    )
    flags.DEFINE_string("out", None, "the terra run directory to create (must not exist)", flag_values=flag_values)
    flags.mark_flags_as_required(["checkpoint", "out"], flag_values=flag_values)


def run_trax(flag_values: flags.FlagValues, _) -> int:
    from terra.convert import convert_trax_checkpoint

    gin = flag_groups.gin_arguments(flag_values)
    out = convert_trax_checkpoint(
        flag_values.checkpoint,
        flag_values.out,
        trax_config=flag_values.trax_config,
        gin_files=gin["gin_files"],
        gin_bindings=gin["gin_bindings"],
        search_paths=gin["search_paths"],
    )
    print(f"wrote {out}: config.gin and checkpoints/0 (terra-evaluate --checkpoint {out})")
    return 0


COMMAND = app.group(
    "terra-convert",
    "terra.cli.convert",
    __doc__,
    {
        "trax": app.command(
            "terra-convert trax",
            "terra.cli.convert",
            TRAX_DOC,
            define_flags=define_trax_flags,
            run=run_trax,
            gin_files=lambda f: f.gin_file or None,
        ),
    },
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m terra.reproduce {sparsity,length_generalization} --out DIR [--preset P] [--config.F=V] [--gin.X=Y]``

  python -m terra.reproduce sparsity --out runs/reproduce/sparsity
  python -m terra.reproduce sparsity --out DIR --config.seeds=0,1,2 --config.steps=2000
  python -m terra.reproduce sparsity --out DIR --tfds_data_dir=/data/tfds      # C4 instead of the embedded corpus
  python -m terra.reproduce length_generalization --out runs/reproduce/length
  python -m terra.reproduce length_generalization --out DIR --preset paper      # the paper's sizes (accelerator)

``--config.FIELD=VALUE`` changes a study setting (``--help`` lists them with the preset's values);
``--gin.NAME=VALUE`` is applied to every training run after the study's own bindings. Running a
study again into the same ``--out`` resumes its runs (finished runs are not retrained).
"""

import argparse
import sys
from typing import List, Optional

from terra import gin_utils
from terra.benchmarks import presets
from terra.data import tasks


def main(argv: Optional[List[str]] = None) -> int:
    from terra.reproduce import length_generalization, sparsity

    studies = {"sparsity": sparsity, "length_generalization": length_generalization}
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m terra.reproduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=sorted(studies))
    parser.add_argument("--out", required=True, help="directory for the study's JSON, Markdown, PNG and runs/")
    parser.add_argument("--preset", default=None,
                        help="sparsity: small (default) or smoke; length_generalization: small (default), smoke or paper")
    tasks.add_data_flags(parser)
    overrides = [a for a in argv if a.startswith("--config.")]
    extra, rest = gin_utils.split_gin_args([a for a in argv if not a.startswith("--config.")])
    args = parser.parse_args(rest)
    study = studies[args.study]
    cfg = study.config(args.preset or "small")
    presets.apply_overrides(cfg, overrides)
    data = tasks.data_flag_bindings(args)
    if args.study == "sparsity":
        sparsity.run(cfg, args.out, data_bindings=data, extra_bindings=extra)
    else:
        if data:
            raise gin_utils.GinConfigError("length_generalization generates its data; the data flags do not apply.")
        length_generalization.run(cfg, args.out, extra_bindings=extra)
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)

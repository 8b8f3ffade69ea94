"""Parameter counts and the weights one decoded token reads, from abstract shapes.

  python -m terra.benchmarks.param_count --gin_file=models/dense_800m.gin   # one config, by group
  python -m terra.benchmarks.param_count --all                              # every model config

Nothing is allocated (``jax.eval_shape``). "Read per token" is what a batch-1 decode step must
stream from memory (``Model.params_read_per_token``): the decoder's weights, minus what the
injected layers skip (sparse feed-forward reads one row per block, encoder-decoder keys/values
are cached), plus one embedding row and one positional row.
"""

import argparse
import glob
import os

from terra import gin_utils
from terra.models.param_count import closed_form_param_count


def _model_summary(gin_file: str, bindings=()):
    gin_utils.parse_gin([gin_file], bindings)
    model = gin_utils.build_model()
    return model.param_count(), model.params_read_per_token()


def print_all(bindings=()) -> None:
    files = sorted(glob.glob(os.path.join(gin_utils.CONFIGS_DIR, "models", "*.gin")))
    print(f"{'config':<36} {'params':>14} {'read / token':>14} {'float32 MB / token':>19}")
    for path in files:
        name = os.path.relpath(path, gin_utils.CONFIGS_DIR)
        counts, reads = _model_summary(name, bindings)
        print(f"{name:<36} {counts['total']:>14,d} {reads['total']:>14,d} {reads['total'] * 4 / 1e6:>19.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gin_utils.add_gin_flags(parser)
    parser.add_argument("--all", action="store_true", help="Summarise every config in configs/models/.")
    args = gin_utils.parse_flags(parser, argv)
    if args.all:
        print_all(args.gin_bindings)
        return 0
    if not args.gin_file:
        args.gin_file = ["models/dense_800m.gin"]
        gin_utils.parse_gin(args.gin_file, args.gin_bindings)
    model = gin_utils.build_model()
    counts = model.param_count()
    print(f"Parameters of {', '.join(args.gin_file)} (from abstract shapes, nothing allocated):")
    for name, n in counts.items():
        print(f"  {name:<28} {n:>15,d}")
    closed = closed_form_param_count(model.config)
    verdict = "matches" if closed == counts["total"] else "differs: the closed form is for the dense baseline"
    print(f"  {'dense closed form':<28} {closed:>15,d}  ({verdict})")
    print(f"  float32 bytes: {counts['total'] * 4 / 2**30:.2f} GiB")
    print("Read per decoded token (batch 1):")
    for name, n in model.params_read_per_token().items():
        print(f"  {name:<28} {n:>15,d}")
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)

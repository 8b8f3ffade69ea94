"""``python -m terra.data --task NAME``: print a few examples of a task as the model will see
them (decoded text and token counts), to check data locations, vocabulary and lengths before a
run. Accepts the same data flags and gin flags as training."""

import argparse
import sys
from typing import Optional, Sequence

from terra import gin_utils


def main(argv: Optional[Sequence[str]] = None) -> int:
    from terra.data import pipeline, tasks

    parser = argparse.ArgumentParser(prog="python -m terra.data", description=__doc__)
    parser.add_argument("--task", required=True, help=f"one of: {', '.join(tasks.task_names())}")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--n", type=int, default=3, help="examples to show")
    parser.add_argument("--inputs_length", type=int, default=512)
    parser.add_argument("--targets_length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    tasks.add_data_flags(parser)
    gin_utils.add_gin_flags(parser)
    args = gin_utils.parse_flags(parser, argv, flag_bindings=tasks.data_flag_bindings)
    provider = tasks.get_task(args.task)
    ds = pipeline.get_dataset(
        provider, split=args.split, batch_size=1, seed=args.seed, shuffle=False, num_epochs=1,
        feature_lengths={"inputs": args.inputs_length, "targets": args.targets_length})
    features = provider.output_features
    for i, batch in enumerate(pipeline.BatchIterator(ds)):
        if i >= args.n:
            break
        for name, key in (("inputs", "encoder_input_tokens"), ("targets", "decoder_target_tokens")):
            ids = [int(t) for t in batch[key][0] if t != 0]
            print(f"--- example {i} {name} ({len(ids)} tokens)")
            print(features[name].vocabulary.decode(ids))
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))

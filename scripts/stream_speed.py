"""What streaming costs: ms per generated token of ``generate`` with a text streamer against
``generate`` without one, the same model and inputs, the repetitions interleaved.

    python scripts/stream_speed.py --out docs/benchmarks/stream_speed
    python scripts/stream_speed.py --gin_file=models/dense_800m.gin --weights=float32

The model is built as ``terra-bench decode`` builds it (random weights stored as ``--weights``, the
2+24-layer timing shape at the 800M widths); each decode runs ``--tokens`` steps of one sequence
(EOS does not stop it) from random 16-token inputs. Both decodes are the jitted generation loop
(``InteractiveModel.generate`` with ``timing``); the streamed one also hands every step's token to
the host, where it is detokenized into whole words (``terra.decoding.streaming.RowText``, the
arXiv tasks' SentencePiece vocabulary) as ``terra-summarize --stream`` prints them. Prints a
Markdown table with the machine's CPU and instruction set; ``--out`` writes
``stream_speed.{json,md}``.
"""

import argparse
import json
import os
import statistics

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", default="models/fully_sparse_800m.gin")
    parser.add_argument("--weights", default="int8", choices=("float32", "bfloat16", "int8"))
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for stream_speed.{json,md}")
    args = parser.parse_args(argv)

    import terra
    from terra.benchmarks.bandwidth import describe_machine
    from terra.benchmarks.presets import TIMING_SHAPE_800M
    from terra.benchmarks.report import cpu_description
    from terra.decoding.streaming import RowText

    run = terra.build(
        [args.gin_file, "tasks/arxiv_summarization_paper.gin"],
        [*TIMING_SHAPE_800M, "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': %d}" % args.tokens],
        random_weights=True,
        weights_dtype=args.weights,
    )
    inputs = np.random.default_rng(0).integers(2, run.config.vocab_size, size=(1, 16)).astype(np.int32)
    ms_per_token = {"generate": [], "stream": []}

    def decode(streamed: bool) -> None:
        text, times = RowText(run.vocabulary), {}
        run.generate(
            inputs,
            max_new_tokens=args.tokens,
            stop_at_eos=False,
            timing=lambda t: times.update(t),
            streamer=(lambda row, token: text.add(token)) if streamed else None,
        )
        ms_per_token["stream" if streamed else "generate"].append(1000 * times["loop_s"] / times["steps"])

    decode(False), decode(True)  # compiles both loops
    for times in ms_per_token.values():
        times.clear()
    for _ in range(args.repeats):
        decode(False)
        decode(True)
    machine = describe_machine()
    medians = {name: statistics.median(times) for name, times in ms_per_token.items()}
    lines = [
        f"### Streaming against generate: {args.gin_file}, {args.weights} weights, 2+24-layer timing shape",
        "",
        f"CPU: {cpu_description(machine)}; {args.tokens} tokens of one sequence per decode, "
        f"median of {args.repeats} interleaved repetitions (`python scripts/stream_speed.py --gin_file={args.gin_file} "
        f"--weights={args.weights} --tokens={args.tokens} --repeats={args.repeats}`).",
        "",
        "| decode | ms per token (median) | all repetitions |",
        "|---|---|---|",
    ]
    for name, label in (("generate", "`generate`"), ("stream", "`generate(streamer=...)`, text detokenized")):
        lines.append(f"| {label} | {medians[name]:.2f} | {', '.join(f'{t:.2f}' for t in ms_per_token[name])} |")
    lines += ["", f"Stream / generate: {medians['stream'] / medians['generate']:.3f}"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = dict(
            gin_file=args.gin_file, weights=args.weights, tokens=args.tokens, repeats=args.repeats,
            machine=machine, ms_per_token=ms_per_token, medians=medians,
        )  # fmt: skip
        with open(os.path.join(args.out, "stream_speed.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "stream_speed.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What streaming costs: ms per step of ``generate`` with a text streamer against ``generate``
without one, the same model and inputs, the repetitions interleaved, at each batch size.

    python scripts/stream_speed.py --out docs/benchmarks/stream_speed
    python scripts/stream_speed.py --gin_file=models/dense_800m.gin --weights=float32 --batch_sizes=1

The model is built as ``terra-bench decode`` builds it (random weights stored as ``--weights``, the
2+24-layer timing shape at the 800M widths); each decode runs ``--tokens`` steps (EOS does not stop
it) from random 16-token inputs, ``--batch_sizes`` sequences at a time. Both decodes are the jitted
generation loop (``InteractiveModel.generate`` with ``timing``); the streamed one also hands every
step's tokens to the host, where each row is detokenized into whole words
(``terra.decoding.streaming.RowText``, the arXiv tasks' SentencePiece vocabulary) as
``terra-summarize --stream`` prints them. Prints a Markdown table with the machine's CPU and
instruction set; ``--out`` writes ``stream_speed.{json,md}``.
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
    parser.add_argument("--batch_sizes", default="1,4,16", help="sequences decoded together, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for stream_speed.{json,md}")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

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

    def decode(inputs, streamed: bool) -> float:
        """ms per step of the generation loop, with a text streamer (a RowText per row) or without."""
        texts, times = [RowText(run.vocabulary) for _ in inputs], {}
        run.generate(
            inputs,
            max_new_tokens=args.tokens,
            stop_at_eos=False,
            timing=times.update,
            streamer=(lambda row, token: texts[row].add(token)) if streamed else None,
        )
        return 1000 * times["loop_s"] / times["steps"]

    rows = []
    for batch in batch_sizes:
        inputs = np.random.default_rng(0).integers(2, run.config.vocab_size, size=(batch, 16)).astype(np.int32)
        decode(inputs, False), decode(inputs, True)  # compiles both loops
        ms = {"generate": [], "stream": []}
        for _ in range(args.repeats):
            ms["generate"].append(decode(inputs, False))
            ms["stream"].append(decode(inputs, True))
        medians = {name: statistics.median(times) for name, times in ms.items()}
        rows.append(dict(batch_size=batch, ms_per_step=ms, medians=medians))
    machine = describe_machine()
    lines = [
        f"### Streaming against generate: {args.gin_file}, {args.weights} weights, 2+24-layer timing shape",
        "",
        f"CPU: {cpu_description(machine)}; {args.tokens} steps per decode, median of {args.repeats} interleaved "
        f"repetitions (`python scripts/stream_speed.py --gin_file={args.gin_file} --weights={args.weights} "
        f"--batch_sizes={args.batch_sizes} --tokens={args.tokens} --repeats={args.repeats}`). ms per step of all "
        "the batch's sequences, in the generation loop.",
        "",
        "| batch | `generate` | `generate(streamer=...)`, text detokenized | stream / generate |",
        "|---|---|---|---|",
    ]
    for r in rows:
        g, st = r["medians"]["generate"], r["medians"]["stream"]
        lines.append(f"| {r['batch_size']} | {g:.2f} | {st:.2f} | {st / g:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = dict(
            gin_file=args.gin_file, weights=args.weights, tokens=args.tokens, repeats=args.repeats,
            machine=machine, rows=rows,
        )  # fmt: skip
        with open(os.path.join(args.out, "stream_speed.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "stream_speed.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

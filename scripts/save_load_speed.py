"""What saving a model from Python and opening it again costs: ``run.save(path)`` and
``terra.load(path)`` for a model at the 800M widths (2+24-layer timing shape, random weights),
with float32 and int8 weights, and the run directory's size on disk.

    python scripts/save_load_speed.py --out docs/benchmarks/save_load_speed

Each weight width is built once (``terra.build(..., random_weights=True)``), saved to a new folder
under ``--dir`` (a temporary folder by default, removed at the end) and loaded back; the loaded
parameters are checked to equal the saved ones. Prints a Markdown table with the machine's CPU;
``--out`` writes ``save_load_speed.{json,md}``.
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", default="models/fully_sparse_800m.gin")
    parser.add_argument("--dir", default=None, help="where the runs are written (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="folder for save_load_speed.{json,md}")
    args = parser.parse_args(argv)

    import jax

    import terra
    from terra.benchmarks.bandwidth import describe_machine
    from terra.benchmarks.presets import TIMING_SHAPE_800M
    from terra.benchmarks.report import cpu_description

    root = args.dir or tempfile.mkdtemp(prefix="terra-save-load-")
    rows = []
    try:
        for dtype in ("float32", "int8"):
            run = terra.build([args.gin_file], list(TIMING_SHAPE_800M), random_weights=True, weights_dtype=dtype)
            path = os.path.join(root, dtype)
            start = time.perf_counter()
            run.save(path)
            saved = time.perf_counter() - start
            start = time.perf_counter()
            loaded = terra.load(path)
            jax.block_until_ready(loaded.params)
            opened = time.perf_counter() - start
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(run.params))
            )
            rows.append(dict(weights=dtype, save_s=saved, load_s=opened, bytes=_folder_bytes(path), equal=same))
            shutil.rmtree(path)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    machine = describe_machine()
    where = "a temporary folder" if args.dir is None else args.dir
    lines = [
        f"### run.save and terra.load: {args.gin_file}, 2+24-layer timing shape, random weights",
        "",
        f"CPU: {cpu_description(machine)}; the run written under {where} "
        f"(`python scripts/save_load_speed.py --gin_file={args.gin_file}`).",
        "",
        "| weights | run.save | terra.load | on disk | loaded = saved |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['bytes'] / 1e6:,.1f} MB"
        lines.append(f"| {r['weights']} | {r['save_s']:.2f} s | {r['load_s']:.2f} s | {size} | {r['equal']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "save_load_speed.json"), "w") as f:
            json.dump(dict(gin_file=args.gin_file, machine=machine, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "save_load_speed.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

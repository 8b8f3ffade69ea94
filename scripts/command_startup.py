"""How soon each terra command answers: the seconds to its first line of output and to its
exit, and whether it imported TensorFlow, for the command lines users start with (errors that
need only flags and files, a parameter count, a small conversion, a summary).

    python scripts/command_startup.py --out docs/benchmarks/command_startup
    python scripts/command_startup.py --tree /path/to/other/checkout   # the same commands there

Each command runs as ``python -m terra.cli.NAME`` in a fresh process (``--repeats`` times; the
fastest is kept), with the checkout given by ``--tree`` first on ``PYTHONPATH``: as a first run
(an empty cache folder, so it compiles what it runs) and run again (it finds the programs the
first one kept: ``terra/compilation_cache.py``); a further run tells whether TensorFlow was
imported. Prints a Markdown table with the
machine's CPU and instruction set, and writes ``command_startup.{json,md}`` under ``--out``.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu() -> str:
    """The CPU model and its widest vector instruction set, from /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "unknown CPU", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    widest = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
    isa = next((name for flag, name in widest if flag in flags), "")
    return f"{model}, {os.cpu_count()} cores, {isa or 'no AVX2'}"


def _fixtures(root: str, tree: str) -> Dict[str, str]:
    """A tiny trained summarization run (2 steps), a document, and a gin file that includes itself."""
    run = os.path.join(root, "run")
    env = _environment(tree, os.path.join(root, "fixture-cache"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "terra.cli.train",
            "--gin_file=experiments/quickstart_finetune.gin",
            f"--gin.MODEL_DIR='{run}'",
            "--gin.TRAIN_STEPS=2",
            "--gin.BATCH_SIZE=2",
            "--gin.INIT_FROM=None",
            "--gin.terra.training.EvaluationSettings.every=0",
        ],
        env=env,
        check=True,
        capture_output=True,
        cwd=root,
    )
    document = os.path.join(root, "doc.txt")
    with open(document, "w") as f:
        f.write("The os module provides a portable way of using operating system dependent functionality.\n")
    loop = os.path.join(root, "loop.gin")
    with open(loop, "w") as f:
        f.write(f"include '{loop}'\n")
    return {"run": run, "document": document, "loop": loop}


def commands(paths: Dict[str, str]) -> List[Dict]:
    fixtures = os.path.join(REPO_ROOT, "tests", "fixtures", "trax", "dense")
    return [
        {"label": "terra-evaluate (no flags: an error)", "module": "evaluate", "args": []},
        {
            "label": "terra-train, MODEL_DIR not set (an error)",
            "module": "train",
            "args": ["--gin_file=experiments/quickstart.gin"],
        },
        {
            "label": "terra-train, a gin include loop (an error)",
            "module": "train",
            "args": [f"--gin_file={paths['loop']}"],
        },
        {
            "label": "terra-vocab, a missing input file (an error)",
            "module": "vocab",
            "args": [f"--input={os.path.join(paths['run'], 'absent.txt')}", "--out={out}/v.model"],
        },
        {"label": "terra-params, 800M dense", "module": "params", "args": ["--gin_file=models/dense_800m.gin"]},
        {
            "label": "terra-params, the quick-start experiment",
            "module": "params",
            "args": ["--gin_file=experiments/quickstart.gin"],
        },
        {
            "label": "terra-convert trax, the dense fixture",
            "module": "convert",
            "args": [
                "trax",
                f"--checkpoint={os.path.join(fixtures, 'model.pkl.gz')}",
                f"--trax_config={os.path.join(fixtures, 'config.json')}",
                "--out={out}",
            ],
        },
        {
            "label": "terra-summarize, a tiny trained run, one document",
            "module": "summarize",
            "args": [f"--checkpoint={paths['run']}", "--max_decode_length=8", paths["document"]],
        },
        {
            # The same command line, timed to the moment its weights are loaded (terra.load
            # returns), before it compiles and runs the decode: its start-up.
            "label": "terra-summarize, the same, to its weights loaded",
            "module": "summarize",
            "args": [f"--checkpoint={paths['run']}", "--max_decode_length=8", paths["document"]],
            "until_loaded": True,
        },
    ]


# Runs a command as ``python -m`` does, printing LOADED_LINE when ``terra.load`` returns.
LOADED_LINE = "terra-startup: weights loaded"
_LOADED_PROBE = """
import runpy, sys
from terra import process_memory
process_memory.restart_with_huge_pages()  # as the command's main does first (then it does not again)
from terra import api
load = api.load
def timed_load(*args, **kwargs):
    run = load(*args, **kwargs)
    print({line!r}, flush=True)
    return run
api.load = timed_load
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
""".format(line=LOADED_LINE)


def _environment(tree: str, cache_dir: str) -> Dict[str, str]:
    """This environment with the checkout first, CPU only, and ``cache_dir`` as the commands'
    cache (the compilation cache a command keeps under it included: ``terra/compilation_cache.py``;
    a ``JAX_COMPILATION_CACHE_DIR`` of the caller's is dropped so that the command picks its own)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=tree, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", TERRA_CACHE_DIR=cache_dir)
    return env


def _run(tree: str, command: Dict, cache_dir: str, workdir: str) -> Dict:
    """One run of ``command``; its first line is the first it prints, or with ``until_loaded``
    the line the probe prints when its weights are loaded."""
    out = tempfile.mkdtemp(prefix="converted-", dir=workdir)
    os.rmdir(out)
    module = f"terra.cli.{command['module']}"
    until_loaded = command.get("until_loaded", False)
    argv = [sys.executable, *(["-c", _LOADED_PROBE] if until_loaded else ["-m"]), module]
    argv += [a.replace("{out}", out) for a in command["args"]]
    env = _environment(tree, cache_dir)
    start = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir)
    first, lines = None, []
    for line in process.stdout:
        if line.startswith("import time:") or not line.strip():
            continue
        if first is None and (not until_loaded or line.strip() == LOADED_LINE):
            first = time.perf_counter() - start
        lines.append(line.rstrip())
    process.wait()
    total = time.perf_counter() - start
    return {"first_line_s": first, "total_s": total, "status": process.returncode, "output": lines}


# Runs a command as ``python -m`` does and records whether TensorFlow was imported when the
# process ends, whichever way it ends (a failed command leaves through os._exit).
_PROBE = """
import os, runpy, sys
record, module = sys.argv[1], sys.argv[2]
def report():
    with open(record, "w") as f:
        f.write("yes" if "tensorflow" in sys.modules else "no")
leave = os._exit
os._exit = lambda status: (report(), leave(status))
sys.argv = [module, *sys.argv[3:]]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    report()
"""


def _imports_tensorflow(tree: str, command: Dict, workdir: str, cache_dir: str) -> bool:
    record = os.path.join(workdir, "imported.txt")
    out = os.path.join(workdir, "converted-probe")
    argv = [sys.executable, "-c", _PROBE, record, f"terra.cli.{command['module']}"]
    argv += [a.replace("{out}", out) for a in command["args"]]
    # No restart under huge pages (terra/process_memory.py): the probe must stay in this process.
    env = _environment(tree, cache_dir)
    env["TERRA_HUGE_PAGES_RESTARTED"] = "1"
    subprocess.run(argv, env=env, capture_output=True, text=True, cwd=workdir)
    with open(record) as f:
        return f.read() == "yes"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=REPO_ROOT, help="the checkout whose commands run (default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for command_startup.json and .md")
    args = parser.parse_args()
    tree = os.path.abspath(args.tree)
    rows = []
    with tempfile.TemporaryDirectory(prefix="terra-startup-") as root:
        paths = _fixtures(root, tree)
        for command in commands(paths):
            # A first run on this machine: each in a cache folder of its own, empty. Then runs
            # that find what the first one compiled in its folder.
            caches = [tempfile.mkdtemp(prefix="cache-", dir=root) for _ in range(args.repeats)]
            runs = [_run(tree, command, cache, root) for cache in caches]
            again = [_run(tree, command, caches[0], root) for _ in range(args.repeats)]
            fastest = "first_line_s" if command.get("until_loaded") else "total_s"
            best = min(runs, key=lambda r: r[fastest])
            best_again = min(again, key=lambda r: r[fastest])
            rows.append(
                {
                    "command": command["label"],
                    "first_line_s": best["first_line_s"],
                    "total_s": best["total_s"],
                    "cached_first_line_s": best_again["first_line_s"],
                    "cached_total_s": best_again["total_s"],
                    "exit_status": best["status"],
                    "imports_tensorflow": _imports_tensorflow(tree, command, root, caches[0]),
                    "first_line": best["output"][0][:120] if best["output"] else "",
                }
            )
    cpu = _cpu()
    lines = [
        f"Command start-up, {tree} ({cpu}; fastest of {args.repeats} runs each way, python -m terra.cli.NAME):",
        "",
        "| command | first line (s) | exit (s) | run again: first line (s) | run again: exit (s) | status "
        "| imports TensorFlow |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        first, again = (f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("first_line_s", "cached_first_line_s"))
        lines.append(
            f"| {row['command']} | {first} | {row['total_s']:.2f} | {again} | {row['cached_total_s']:.2f} "
            f"| {row['exit_status']} | {'yes' if row['imports_tensorflow'] else 'no'} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "command_startup.json"), "w") as f:
            json.dump({"cpu": cpu, "tree": tree, "repeats": args.repeats, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "command_startup.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

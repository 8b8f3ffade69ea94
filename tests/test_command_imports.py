"""Commands and API calls that read no data never import TensorFlow, seqio or TensorFlow
Datasets (their import is most of a command's start-up): ``terra-params``, ``terra-convert trax``
without a task, ``terra-bench decode``, ``terra.build`` of a model config and ``terra.load`` of a
run without a task. One process runs them in turn, as commands do (``main``), and after each one
reports which of those packages are loaded: the first command that loads one fails the test,
named. A command whose config names the data layer still loads it (the last check)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

DENSE = os.path.join(REPO_ROOT, "tests", "fixtures", "trax", "dense")
DATA_PACKAGES = ("tensorflow", "seqio", "tensorflow_datasets")

SCRIPT = """
import json, sys
DATA_PACKAGES = {packages!r}
loaded = lambda: sorted(m for m in sys.modules if m.split(".")[0] in DATA_PACKAGES)
report = []

def step(name, fn):
    status = fn()
    report.append({{"step": name, "status": status, "loaded": loaded()}})

from terra.cli import bench, convert, params
step("terra-params", lambda: params.main(["--gin_file=models/tiny.gin"]))
step(
    "terra-convert trax",
    lambda: convert.main(
        ["trax", "--checkpoint={dense}/model.pkl.gz", "--trax_config={dense}/config.json", "--out={out}"]
    ),
)
step(
    "terra-bench decode",
    lambda: bench.main(
        ["decode", "--preset", "tiny", "--config.tokens=4", "--config.repeats=1", "--rows=baseline", "--out={bench}"]
    ),
)
import numpy as np
import terra
tokens = np.ones((1, 4), np.int32)
generates = lambda run: int(run.generate(tokens, max_new_tokens=2).shape != (1, 2))
step("terra.build", lambda: generates(terra.build("models/tiny.gin")))
step("terra.load without a task", lambda: generates(terra.load("{out}")))
with_task = ["models/tiny.gin", "tasks/synthetic_copy.gin"]
step("terra.build with a task config", lambda: int(terra.build(with_task).task is None))
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_commands_that_read_no_data_never_import_tensorflow(tmp_path):
    script = SCRIPT.format(packages=DATA_PACKAGES, dense=DENSE, out=tmp_path / "converted", bench=tmp_path / "bench")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TERRA_HUGE_PAGES_RESTARTED="1")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    for entry in report[:-1]:
        assert entry["status"] == 0, entry
        assert entry["loaded"] == [], f"{entry['step']} imported {entry['loaded']}"
    last = report[-1]
    assert last["step"] == "terra.build with a task config" and last["status"] == 0
    assert "seqio" in last["loaded"] and "tensorflow" in last["loaded"]

"""The model core runs where TensorFlow is not installed (an accelerator host with jax, flax,
optax, orbax, gin and ml-collections only): building a model from its gin config, a train step,
decoding, ``terra-bench train``/``decode`` and the accelerator check. They run in subprocesses (the
model core and terra-bench in one, the accelerator check's script in its own) whose import system
refuses TensorFlow, seqio, TensorFlow Datasets and TensorFlow Text, as an interpreter without them
installed would."""

import json
import os
import subprocess
import sys

import pytest

from terra.benchmarks import accelerator_check

from helpers import REPO_ROOT

NOT_INSTALLED = ("tensorflow", "seqio", "tensorflow_datasets", "tensorflow_text")
# Installed as sitecustomize, so it is in place before anything else is imported (the script's
# interpreter too): importing a refused package fails, and asking whether it is installed
# (``importlib.util.find_spec``, as etils and terra.tensorflow_setup do) answers no.
REFUSE_IMPORTS = f"""
import importlib.util
import sys

REFUSED = {NOT_INSTALLED!r}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)
        return None


def find_spec(name, package=None, _find_spec=importlib.util.find_spec):
    return None if name.split(".")[0] in REFUSED else _find_spec(name, package)


sys.meta_path.insert(0, NotInstalled())
importlib.util.find_spec = find_spec
"""
# Printed last by each script: the refused packages that got imported anyway (none, or the
# refusal above was bypassed and the test proves nothing).
LOADED = "print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] in {!r}))\n".format(NOT_INSTALLED)


def _run_without_tensorflow(tmp_path, argv, timeout=600, **env):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(REFUSE_IMPORTS)
    environment = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), REPO_ROOT]),
        JAX_PLATFORMS="cpu",
        JAX_DISABLE_MOST_OPTIMIZATIONS="1",  # compile time only, at these sizes
        **env,
    )
    result = subprocess.run(argv, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _python(tmp_path, script):
    return _run_without_tensorflow(tmp_path, [sys.executable, "-c", "import sys\n" + script + LOADED])


def test_the_refusal_makes_tensorflow_unimportable(tmp_path):
    out = _python(
        tmp_path,
        "import importlib.util\n"
        "for name in ('tensorflow', 'seqio', 'tensorflow_datasets', 'tensorflow_text'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        print('refused', name, importlib.util.find_spec(name))\n",
    )
    assert out.count("refused") == 4 and out.count("None") == 4 and "loaded: []" in out


# The fully sparse model at the accelerator check's smoke size (bfloat16), trained a step as the
# check trains it (the state donated, a batch of its shapes): the same program, which the check
# (below) then reads from the session's compilation cache.
SMOKE = accelerator_check.SMOKE
BUILD_TRAIN_DECODE = f"""
import jax, jax.numpy as jnp, numpy as np
from terra.gin_config import parsing
from terra.decoding import IncrementalDecoder, generate
from terra.training import optimizers
from terra.training.train_state import TrainState
from terra.training.train_step import train_step

parsing.parse_gin(["models/fully_sparse_800m.gin"], {list(SMOKE.bindings)!r})
model = parsing.build_model()
tx = optimizers.adafactor().transform
params = model.init_params(jax.random.key(0))
state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
rng = np.random.default_rng(0)
inputs = jnp.asarray(rng.integers(2, model.config.vocab_size, ({SMOKE.batch_size}, {SMOKE.inputs})), jnp.int32)
targets = jnp.asarray(rng.integers(2, model.config.vocab_size, ({SMOKE.batch_size}, {SMOKE.targets})), jnp.int32)
batch = {{
    "encoder_input_tokens": inputs,
    "decoder_target_tokens": targets,
    "decoder_input_tokens": jnp.pad(targets[:, :-1], ((0, 0), (1, 0))),
    "decoder_loss_weights": jnp.ones_like(targets),
}}
step = jax.jit(lambda s, b, r: train_step(model, tx, s, b, r), donate_argnums=(0,))
state, metrics = step(state, batch, jax.random.key(1))
print("step", int(state.step), "loss", float(metrics["loss"]))
out = generate(IncrementalDecoder(model.module, 6), state.params, inputs[:1], max_new_tokens=4, eos_id=-1)
print("decoded", np.asarray(out.tokens).shape)
"""
# terra-bench train's dense row at the accelerator check's smoke size, in its bfloat16: the same
# train step program as the check's dense row, which the check (below) then reads from the
# session's compilation cache.
BENCH_TRAIN = ["--small", "--steps", "1", "--rows", "dense", f"--gin.{accelerator_check.BFLOAT16.replace(' = ', '=')}"]
BENCH_TRAIN += ["--batch_size", str(SMOKE.batch_size), "--inputs", str(SMOKE.inputs), "--targets", str(SMOKE.targets)]
BENCH_DECODE = ["--preset", "tiny", "--rows", "Sparse FF", "--config.repeats=1", "--config.tokens=4"]


@pytest.fixture(scope="module")
def without_tensorflow(tmp_path_factory):
    """``(printed output, folder)`` of one process that cannot import TensorFlow (one start-up
    for both tests below): a model built from gin trains a step and decodes, then ``terra-bench
    train`` and ``decode`` run."""
    folder = tmp_path_factory.mktemp("core")
    bench = (
        "from terra.cli import bench\n"
        f"assert bench.main(['train', '--out', {str(folder / 'train')!r}, *{BENCH_TRAIN!r}]) == 0\n"
        f"assert bench.main(['decode', '--out', {str(folder / 'decode')!r}, *{BENCH_DECODE!r}]) == 0\n"
    )
    return _python(folder, BUILD_TRAIN_DECODE + bench), folder


@pytest.mark.slow
def test_a_model_builds_trains_a_step_and_decodes_without_tensorflow(without_tensorflow):
    out, _ = without_tensorflow
    assert "step 1 loss" in out and "nan" not in out.split("loss", 1)[1].split()[0]
    assert "decoded (1, 4)" in out and "loaded: []" in out


@pytest.mark.slow
def test_terra_bench_train_and_decode_run_without_tensorflow(without_tensorflow):
    out, folder = without_tensorflow
    assert "loaded: []" in out
    train = json.loads((folder / "train" / "train_speed.json").read_text())["rows"]
    assert [r["name"] for r in train] == ["dense"] and train[0]["tokens_per_second"] > 0
    decoded = json.loads((folder / "decode" / "decode_speed.json").read_text())
    assert {r["name"] for r in decoded} == {"baseline Transf.", "+ Sparse FF"}
    assert all(r["seconds_per_token_median"] > 0 for r in decoded)


@pytest.mark.slow
def test_the_accelerator_check_script_runs_its_smoke_size_without_tensorflow(tmp_path):
    script = os.path.join(REPO_ROOT, "scripts", "accelerator_check.sh")
    # The script keeps the session's compilation cache (JAX_COMPILATION_CACHE_DIR, which it uses
    # when set): its train steps are the ones compiled above (the fully sparse model's by the
    # model-core script, the dense one's by terra-bench train).
    out = _run_without_tensorflow(
        tmp_path,
        ["bash", script, str(tmp_path / "check")],
        PYTHON=sys.executable,
        TERRA_ACCELERATOR_CHECK_SMOKE="1",
    )
    record = json.loads((tmp_path / "check" / "accelerator_check.json").read_text())
    assert record["size"]["name"] == "smoke" and record["device"]["platform"] == "cpu"
    rows = {(r["name"], r["measure"]): r for r in record["rows"]}
    assert set(rows) == {(n, m) for n in ("dense", "fully sparse") for m in ("train", "decode")}
    for name in ("dense", "fully sparse"):
        assert rows[name, "train"]["tokens_per_second"] > 0 and rows[name, "train"]["flops_per_step"] > 0
        assert rows[name, "train"]["mfu"] is None  # a CPU has no listed peak
        assert rows[name, "decode"]["seconds_per_token"] > 0
    assert "| fully sparse | batch-1 decode |" in out and "peak bf16 unknown" in out
    assert (tmp_path / "check" / "accelerator_check.md").read_text() in out


@pytest.mark.parametrize(
    "device_kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("TPU v5 lite", 197e12),
        ("TPU v4", 275e12),
        ("cpu", None),
    ],
)
def test_the_accelerator_check_knows_each_chips_peak_bf16_flops_or_says_unknown(device_kind, peak):
    assert accelerator_check.peak_bf16_flops(device_kind) == peak


def test_the_accelerator_checks_mfu_is_the_steps_flops_over_its_time_over_the_peak():
    assert accelerator_check.model_flops_utilization(200e12, 0.5, 989e12) == pytest.approx(400 / 989)
    assert accelerator_check.model_flops_utilization(200e12, 0.5, None) is None  # an unknown chip
    assert accelerator_check.model_flops_utilization(None, 0.5, 989e12) is None  # no FLOP count
    row = {"name": "dense", "measure": "train", "seconds_per_step": 0.5, "tokens_per_second": 1.0}
    row.update(flops_per_step=200e12, mfu=400 / 989)
    device = {"device_kind": "NVIDIA H200", "platform": "gpu", "peak_bf16_flops": 989e12}
    text = accelerator_check.table(device, [row])
    assert "peak bf16 989 TFLOP/s" in text and "| 400 |" in text and "40.4%" in text

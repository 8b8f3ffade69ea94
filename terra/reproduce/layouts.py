"""Train one run on one device and on several ``data x model`` meshes and measure how far apart
they end up, step by step (``docs/training.md``, "Parallel layouts train the same model").

Every run starts from the same seed and reads the same batches (one process, so the host batch is
the global batch). Per step the table gives the one-device loss and, for each layout, the relative
difference of the loss and of all parameters together (``|a - b| / |b|``) from the one-device run.
``perturb`` adds a one-device run whose initial parameters are moved by one float32 ulp: the
smallest possible change, against which a layout's drift is judged.
"""

import shutil
import tempfile
from typing import Dict, List, Sequence, Tuple

import jax
import numpy as np

from terra.errors import ConfigError
from terra.gin_config import parsing
from terra.training import ParallelSettings, StepHook, Trainer

Record = List[Tuple[float, list]]  # per step: (loss, parameter arrays)
ONE_ULP = "1 ulp"


class _StepRecorder(StepHook):
    """Keeps every step's loss and parameters; optionally nudges the first step's parameters."""

    def __init__(self, perturb: bool = False):
        self.perturb = perturb
        self.record: Record = []

    def before_step(self, step, state):
        if not (self.perturb and not self.record):  # only the run's first step
            return state
        ulp = np.float32(2.0**-23)
        keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state.params))))
        params = jax.tree.map(
            lambda p: p * (1 + ulp * jax.random.rademacher(next(keys), p.shape, p.dtype)), state.params
        )
        return state.replace(params=params)

    def after_step(self, step, state, metrics):
        self.record.append((float(metrics["loss"]), jax.tree.leaves(jax.device_get(state.params))))


def _train(gin_files: Sequence[str], bindings: Sequence[str], steps: int, parallel: dict, perturb=False) -> Record:
    model_dir = tempfile.mkdtemp(prefix="terra-layouts-")
    try:
        run_bindings = [
            f"MODEL_DIR = {model_dir!r}",
            f"TRAIN_STEPS = {steps}",
            "terra.training.EvaluationSettings.every = 0",
            "terra.training.LoggingSettings.progress = False",
            *bindings,
        ]
        parsing.parse_gin(list(gin_files), run_bindings)
        recorder = _StepRecorder(perturb=perturb)
        Trainer(parallel=ParallelSettings(**parallel), step_hooks=[recorder]).run()
        return recorder.record
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def relative(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """``|a - b| / |b|`` over all arrays together, in float64."""
    num = sum(np.sum((np.float64(x) - np.float64(y)) ** 2) for x, y in zip(a, b))
    return float(np.sqrt(num / sum(np.sum(np.float64(y) ** 2) for y in b)))


def compare(
    gin_files: Sequence[str],
    bindings: Sequence[str] = (),
    *,
    steps: int = 30,
    layouts: Sequence[Tuple[int, int]] = ((8, 1), (4, 2), (2, 4)),
    perturb: bool = False,
) -> Dict[str, list]:
    """``{"loss": [one-device loss per step], "<d>x<m>" (or "1 ulp"): [(loss, params) relative
    differences per step]}``. Needs ``max(d * m)`` devices (forced CPU devices are fine)."""
    needed = max(d * m for d, m in layouts)
    if len(jax.devices()) < needed:
        raise ConfigError(
            f"the layouts {layouts} need {needed} devices and JAX has {len(jax.devices())}; "
            f"on CPU run in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            "(terra-reproduce layouts sets it itself)."
        )
    reference = _train(gin_files, bindings, steps, {"num_devices": 1})
    runs = {
        f"{d}x{m}": _train(gin_files, bindings, steps, {"mesh_shape": {"data": d, "model": m}, "num_devices": d * m})
        for d, m in layouts
    }
    if perturb:
        runs[ONE_ULP] = _train(gin_files, bindings, steps, {"num_devices": 1}, perturb=True)
    table = {"loss": [loss for loss, _ in reference]}
    for name, record in runs.items():
        table[name] = [
            (abs(loss - ref_loss) / abs(ref_loss), relative(params, ref_params))
            for (loss, params), (ref_loss, ref_params) in zip(record, reference)
        ]
    return table


def format_table(table: Dict[str, list]) -> str:
    names = [name for name in table if name != "loss"]
    lines = [
        "relative difference from one device (loss / parameters)",
        f"{'step':>4}  {'loss':>7}  " + "  ".join(f"{name:>17}" for name in names),
    ]
    for i, loss in enumerate(table["loss"]):
        cells = [f"{table[name][i][0]:8.1e} {table[name][i][1]:8.1e}" for name in names]
        lines.append(f"{i + 1:4d}  {loss:7.4f}  " + "  ".join(cells))
    return "\n".join(lines)

"""Training logs: ``metrics.jsonl`` + TensorBoard scalars, a progress bar, and the start summary.

Only host 0 of a multi-host run writes (the trainer passes ``enabled=jax.process_index() == 0``);
a disabled writer or bar does nothing at all.
"""

import json
import math
import os
import sys
from typing import Mapping, Optional

from terra.files import write_atomically

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _to_float(value) -> float:
    """Python, numpy and (fully addressable, scalar) jax values to a float."""
    try:
        return float(value)
    except TypeError:
        import numpy as np

        return float(np.asarray(value).reshape(()))


def _tensorflow():
    """TensorFlow for its summary writer only, imported on first use with its GPUs hidden so it
    never takes accelerator memory from JAX (``terra.data`` does the same when it loads first)."""
    already = "tensorflow" in sys.modules
    import tensorflow as tf

    if not already:
        try:
            tf.config.set_visible_devices([], "GPU")
        except (RuntimeError, ValueError):  # devices already initialised elsewhere
            pass
    return tf


def _scalar_metadata():
    """TensorBoard's scalar-plugin metadata (``tensorboard.plugins.scalar.metadata``), built from
    TF's own proto so that TensorBoard need not be installed to write the logs."""
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    return metadata


class MetricsWriter:
    """Appends ``{"step": s, "<prefix>/<name>": value, ...}`` lines to ``<model_dir>/metrics.jsonl``
    (flushed per line, so a crash loses nothing written) and the same scalars to TensorBoard
    event files under ``<model_dir>/tensorboard``. Use as a context manager or call ``close()``.

    ``resume_step``: the step the run continues from. Lines of later steps (written before a
    crash, then replayed from the checkpoint) and a line cut short by the crash are dropped
    first, so each step appears once."""

    def __init__(
        self, model_dir: str, *, enabled: bool = True, tensorboard: bool = True, resume_step: Optional[int] = None
    ):
        self.model_dir = model_dir
        self.enabled = bool(enabled)
        self._tensorboard = tensorboard
        self._jsonl = None
        self._tb_writer = None
        if self.enabled:
            os.makedirs(model_dir, exist_ok=True)
            if resume_step is not None:
                truncate_metrics(model_dir, resume_step)
            self._jsonl = open(os.path.join(model_dir, METRICS_FILE), "a", encoding="utf-8")

    @property
    def jsonl_path(self) -> str:
        return os.path.join(self.model_dir, METRICS_FILE)

    def write(self, step: int, metrics: Optional[Mapping[str, float]], prefix: str = "train") -> None:
        if not self.enabled or not metrics:
            return
        if self._jsonl is None:
            raise ValueError(f"MetricsWriter for {self.model_dir} is closed.")
        step = int(step)
        values = {}
        for name, value in metrics.items():
            key = name if not prefix or name.startswith(prefix + "/") else f"{prefix}/{name}"
            values[key] = _to_float(value)
        record = {"step": step, **{k: (v if math.isfinite(v) else repr(v)) for k, v in values.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard:
            tf = _tensorflow()
            if self._tb_writer is None:
                self._tb_writer = tf.summary.create_file_writer(os.path.join(self.model_dir, TENSORBOARD_DIR))
            with self._tb_writer.as_default():
                for key, value in values.items():
                    # What tf.summary.scalar writes, without needing the tensorboard package.
                    tf.summary.write(key, tf.constant(value, tf.float32), step=step, metadata=_scalar_metadata())
            self._tb_writer.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_metrics(model_dir: str, last_step: int) -> int:
    """Keeps the records of ``metrics.jsonl`` up to ``last_step`` (and drops a line that is not
    JSON, what a crash mid-write leaves); rewritten atomically. Returns the records dropped."""
    path = os.path.join(model_dir, METRICS_FILE)
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if int(record.get("step", 0)) <= last_step:
                kept.append(json.dumps(record) + "\n")
            else:
                dropped += 1
    if dropped:
        write_atomically(path, "".join(kept))
    return dropped


def read_metrics(model_dir: str):
    """The records of ``<model_dir>/metrics.jsonl``, in order (non-finite values come back as
    the strings 'nan'/'inf')."""
    with open(os.path.join(model_dir, METRICS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """A tqdm bar on stderr over the optimizer steps: step, loss, steps/s and the ETA."""

    def __init__(self, total_steps: int, initial_step: int = 0, enabled: bool = True):
        self.enabled = bool(enabled)
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=int(total_steps),
                initial=int(initial_step),
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.0,
                smoothing=0.1,
            )
            self._step = int(initial_step)

    def update(self, step: int, loss: float, steps_per_second: Optional[float] = None) -> None:
        if self._bar is None:
            return
        step = int(step)
        postfix = {"loss": f"{_to_float(loss):.4f}"}
        if steps_per_second is not None:
            postfix["steps/s"] = f"{_to_float(steps_per_second):.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(0, step - self._step))
        self._step = max(self._step, step)

    def write(self, line: str) -> None:
        """Prints ``line`` to stdout above the bar (the bar is redrawn below it)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _format_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def summarize_start(*, mesh_description: str, param_count: int, compiled_memory_bytes: Optional[int]) -> str:
    """The one-line start summary, e.g.
    ``mesh data=1 x model=1 over 1 cpu device · 12.3M parameters · compiled train step 45.6 MB``."""
    mesh_description = mesh_description if mesh_description.startswith("mesh ") else f"mesh {mesh_description}"
    parts = [mesh_description, f"{_format_count(int(param_count))} parameters"]
    if compiled_memory_bytes is not None:
        parts.append(f"compiled train step {_format_bytes(int(compiled_memory_bytes))}")
    else:
        parts.append("compiled train step memory unknown")
    return " · ".join(parts)


def compiled_memory_bytes(compiled) -> Optional[int]:
    """Device memory of a compiled computation (``jax.jit(f).lower(...).compile()``), in bytes.

    From ``compiled.memory_analysis()`` (jax 0.10: a ``CompiledMemoryStats`` with
    ``argument/output/alias/temp/generated_code_size_in_bytes``, their ``host_*`` twins and
    ``peak_memory_in_bytes``): XLA's ``peak_memory_in_bytes`` when it is reported (> 0), else
    ``argument + output + temp + generated_code - alias`` (donated arguments reuse their buffers).
    None when the backend gives no analysis.
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:  # pylint: disable=broad-except  # unimplemented on some backends
        return None
    if stats is None:
        return None
    if isinstance(stats, (list, tuple)):  # one entry per device program on some versions
        if not stats:
            return None
        stats = stats[0]
    peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
    if peak > 0:
        return int(peak)
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes")
    if not any(hasattr(stats, f) for f in fields):
        return None
    total = sum(int(getattr(stats, f, 0) or 0) for f in fields) - int(getattr(stats, "alias_size_in_bytes", 0) or 0)
    return total if total > 0 else None

"""Checkpoints: preemption-safe saving, resuming, and parameter-only loading for fine-tuning.

Why this module exists
----------------------
* **Preemption safety.** A training job can be killed at any moment: by preemption, by a crash,
  or by a disk that fills up halfway through a save. Each checkpoint is therefore written by
  orbax into ``<step>.orbax-checkpoint-tmp-<timestamp>/``. Only when every process has finished
  writing does the primary process record the commit time in ``_CHECKPOINT_METADATA``, write
  ``commit_success.txt`` and *rename* the directory to ``<step>/``. That rename is the commit. A
  crash before it leaves only a ``*.orbax-checkpoint-tmp-*`` directory, which orbax never lists
  as a step, so a half-written checkpoint is never the "latest" one. (On GCS, where a rename is
  not atomic, orbax instead treats a step as complete once ``commit_success.txt`` is present.)
  Damage that happens *after* the commit (a truncated or deleted file, a partial copy, a lost
  ``_CHECKPOINT_METADATA``) is caught by :meth:`Checkpointer.restore`. It logs a warning that
  names the step and the error, and falls back to the previous step. Once an older step has
  restored, the damaged steps are moved to ``<model_dir>/corrupt_checkpoints/``, so that later
  saves and the retention policy do not count them. If no step can be read, it raises
  :class:`CheckpointError` and moves nothing, so an outage can never make a run restart from
  scratch.
  :meth:`Checkpointer.reached_preemption` exposes orbax's preemption sync point, and the save
  policy always saves at that point.
* **Exact resumption.** The ``tf.data`` iterator position
  (:class:`terra.data.pipeline.BatchIterator`) is saved as an orbax *item* of the same step, in
  the same temporary directory. It is therefore committed, retained and deleted together with
  the model state, and never drifts from it. Each process saves its own position
  (``state-p<process_index>``) because each process reads its own shard of the data.
* **Fine-tuning initialisation.** :func:`restore_params` loads only the ``params`` subtree of
  another run's checkpoint. It uses orbax's partial restore, so optimizer moments are never read,
  and places the arrays straight onto the target shardings. Structure and shapes are checked
  first against the checkpoint's metadata, and a mismatch names the first bad path.
* **Retention** uses orbax's own preservation policies (0.12.8 has them):
  ``AnyPreservationPolicy([LatestN(keep_last), BestN(metric, n=keep_best)])``. That keeps the
  last ``keep_last`` steps **plus** the ``keep_best`` best steps by ``best_metric``. Metrics are
  stored with each step (``metrics/metrics``), so "best" survives restarts.

On-disk layout (T5X/MaxText-like: one directory per step under the model directory)::

    <model_dir>/
      checkpoints/
        <step>/                        # committed by the atomic rename described above
          _CHECKPOINT_METADATA         # orbax step metadata: item handlers, commit timestamp
          commit_success.txt
          state/                       # the TrainState (step, params, opt_state): OCDBT/zarr
            _METADATA  _sharding  manifest.ocdbt  d/  ocdbt.process_<i>/  array_metadatas/
          input_state/                 # only when a data iterator was passed to ``save``
            state-p<i>.index  state-p<i>.data-00000-of-00001   # one per process
          metrics/metrics              # JSON metrics given to ``save`` (when best_metric is set)
        <step>.orbax-checkpoint-tmp-<ts>/   # a save in progress or one that crashed: never a step,
                                            # removed when the next Checkpointer opens the directory
      corrupt_checkpoints/<step>-<time_ns>/  # steps found unreadable by ``restore``

Multi-host: every process calls ``save`` and ``restore`` (they are collective). orbax writes
each process's array shards and lets only the primary process write metadata and commit. The
only things terra adds are each process's own ``input_state/state-p<i>`` files and the move of
a corrupt step, which only the primary process performs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocp_managers

from terra import files
from terra.errors import (  # CheckpointError is re-exported here
    CheckpointError,
    ConfigError,
    StorageError,
    storage_problem,
)
from terra.training.train_state import TrainState

logger = logging.getLogger(__name__)


def short_cause(error: BaseException, limit: int = 240) -> str:
    """``ErrorType: first line of its message`` (cut at ``limit`` characters): storage errors
    (TensorStore's, orbax's) print their whole status object, dozens of lines, as their message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class _DropMissingMetricsWarning(logging.Filter):
    """orbax warns on every save without metrics once a best metric is tracked; terra passes
    metrics only at the steps that evaluated, so the warning says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in str(record.msg)


logging.getLogger("absl").addFilter(_DropMissingMetricsWarning())


class _DropStorageTracebacks(logging.Filter):
    """orbax's save threads log a full or read-only disk with its traceback (hundreds of lines)
    before the save raises it again; :meth:`Checkpointer.save` reports it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (storage_problem(error) if error else storage_problem(Exception(str(record.msg))))


logging.getLogger("absl").addFilter(_DropStorageTracebacks())

CHECKPOINTS_SUBDIR = "checkpoints"
CORRUPT_SUBDIR = "corrupt_checkpoints"
STATE_ITEM = "state"
INPUT_STATE_ITEM = "input_state"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
# A checkpoint read from a run someone else made (``_check_step_files``): an orbax step holds a few
# dozen entries and metadata of kilobytes to a few megabytes.
MAX_STEP_ENTRIES = 100_000
MAX_METADATA_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------
# The data-iterator position as an orbax item (so it is committed and retained with the step).
# ---------------------------------------------------------------------------------------------


def _input_state_prefix(directory: epath.Path) -> str:
    return str(directory / f"state-p{jax.process_index()}")


class _InputStateHandler(ocp.CheckpointHandler):
    """Saves and restores this process's ``BatchIterator`` position inside an orbax step.

    orbax calls ``save`` on every process with the item's *temporary* directory. Each process
    writes only its own ``state-p<process_index>`` files, and orbax's rename commits them
    together with the arrays.
    """

    def save(self, directory: epath.Path, args: "InputStateSave") -> None:
        args.iterator.save(_input_state_prefix(directory))

    def restore(self, directory: epath.Path, args: "InputStateRestore") -> Any:
        args.iterator.restore(_input_state_prefix(directory))
        return args.iterator

    def metadata(self, directory: epath.Path) -> None:
        return None


@ocp.args.register_with_handler(_InputStateHandler, for_save=True)
@dataclasses.dataclass
class InputStateSave(ocp.args.CheckpointArgs):
    iterator: Any


@ocp.args.register_with_handler(_InputStateHandler, for_restore=True)
@dataclasses.dataclass
class InputStateRestore(ocp.args.CheckpointArgs):
    iterator: Any


# ---------------------------------------------------------------------------------------------
# Tree checks shared by restore and restore_params.
# ---------------------------------------------------------------------------------------------


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _flat_shapes(tree: Any) -> Dict[str, Optional[Tuple[int, ...]]]:
    """``{'params/w': (8, 4), 'opt_state/0/mu/w': ...}``: works for TrainState, dicts,
    optax states and orbax's metadata tree, which spell the same paths the same way."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in flat:
        shape = getattr(leaf, "shape", None)
        if shape is None and isinstance(leaf, (int, float, np.number, bool)):
            shape = ()
        out[_path_str(path)] = tuple(shape) if shape is not None else None
    return out


def _check_compatible(checkpoint_tree: Any, target_tree: Any, where: str) -> None:
    """Raises CheckpointError naming the first path whose presence or shape differs."""
    saved = _flat_shapes(checkpoint_tree)
    target = _flat_shapes(target_tree)
    for path, shape in target.items():
        if path not in saved:
            raise CheckpointError(
                f"{where} does not fit the target: the checkpoint has no entry '{path}' "
                f"(target shape {shape}). Checkpoint entries: {sorted(saved)[:20]}"
            )
        if saved[path] != shape:
            raise CheckpointError(
                f"{where} does not fit the target: first mismatch at '{path}': "
                f"checkpoint shape {saved[path]}, target shape {shape}."
            )
    for path, shape in saved.items():
        if path not in target:
            raise CheckpointError(
                f"{where} does not fit the target: the checkpoint has '{path}' (shape {shape}) "
                f"which the target lacks; pass param_map to restore_params to map between trees."
            )


def _read_tree_metadata(state_dir: epath.Path) -> Any:
    """orbax's tree metadata of a step's ``state`` item, read only after the step's files pass
    ``_check_step_files`` (every reader of a step comes through here: a FIFO or a device among
    them would hang or never end the read)."""
    _check_step_files(state_dir.parent)
    return ocp.StandardCheckpointHandler().metadata(state_dir).tree


def _check_step_files(step_dir: epath.Path) -> None:
    """A checkpoint may come from a stranger: before orbax and TensorStore open anything in it,
    every entry of a local step directory must be a folder or a regular file (a FIFO would hang
    the read, a device would never end it), at most :data:`MAX_STEP_ENTRIES` of them, and the
    metadata orbax reads whole (JSON, manifests) at most :data:`MAX_METADATA_BYTES` each. Array
    data is read by the ranges the metadata names, within the model's shapes."""
    if files.has_scheme(str(step_dir)):  # object stores hold no devices or FIFOs
        return
    seen = 0
    for root, folders, names in os.walk(str(step_dir)):
        for name in folders + names:
            seen += 1
            path = os.path.join(root, name)
            if seen > MAX_STEP_ENTRIES:
                raise CheckpointError(
                    f"checkpoint {step_dir} holds more than {MAX_STEP_ENTRIES:,d} files; an orbax checkpoint holds a "
                    "few dozen, so it was not read."
                )
            if os.path.isdir(path):  # a folder (the walk does not follow a link to one)
                continue
            if os.path.basename(root) == "d":  # TensorStore's chunks: read by range, any size
                files.check_regular_file(path, sys.maxsize, CheckpointError, f"checkpoint {step_dir}: the data file")
            else:
                files.check_regular_file(
                    path, MAX_METADATA_BYTES, CheckpointError, f"checkpoint {step_dir}: the metadata file"
                )


def _check_committed(step_dir: epath.Path) -> None:
    """The step's ``_CHECKPOINT_METADATA`` must exist and carry orbax's commit timestamp."""
    path = step_dir / STEP_METADATA_FILE
    if not path.exists():
        raise CheckpointError(f"{path} is missing (the step was not committed by orbax or was damaged)")
    try:
        meta = json.loads(
            files.read_regular_file(str(path), MAX_METADATA_BYTES, CheckpointError, "the step's metadata")
        )
    except ValueError as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from e
    if not isinstance(meta, dict) or not meta.get("commit_timestamp_nsecs"):
        raise CheckpointError(f"{path} has no commit timestamp (the save never finished)")


def _with_default_sharding(abstract: Any) -> Any:
    """Leaves without a sharding go to the first local device (single-process convenience)."""
    device = jax.local_devices()[0]

    def fix(x):
        if getattr(x, "sharding", None) is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
        return x

    return jax.tree.map(fix, abstract)


def _committed_steps(root: epath.Path) -> List[int]:
    """Finalized steps under ``root``, found the way the CheckpointManager finds them."""
    return sorted(m.step for m in ocp.step.standard_name_format().find_all(root))


def has_checkpoint(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a committed checkpoint (reads only; creates nothing)."""
    root = _absolute(model_dir) / CHECKPOINTS_SUBDIR
    return root.is_dir() and bool(_committed_steps(root))


def _all_processes_agree(ok: bool) -> bool:
    """True only if ``ok`` on every process (restore must pick the same step everywhere)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray(int(ok), dtype=np.int32))
    return bool(np.all(flags))


def _metric_value(metrics: Any, name: str, mode: str) -> float:
    """``metrics[name]`` as a float. The worst possible value if it is absent or NaN."""
    worst = math.inf if mode == "min" else -math.inf
    try:
        value = float(metrics[name])
    except (KeyError, TypeError, ValueError):
        return worst
    return worst if math.isnan(value) else value


def _json_metrics(metrics: Optional[dict]) -> Optional[Dict[str, float]]:
    if metrics is None:
        return None
    out = {}
    for key, value in metrics.items():
        array = np.asarray(value)
        if array.size != 1:
            raise ConfigError(f"checkpoint metric {key!r} must be a scalar; got shape {array.shape}.")
        out[str(key)] = float(array.reshape(()))
    return out


# ---------------------------------------------------------------------------------------------
# The checkpointer.
# ---------------------------------------------------------------------------------------------


def _absolute(path: str) -> epath.Path:
    """orbax's OCDBT writer rejects relative paths (``runs/x`` from the command line); local
    paths are made absolute, URLs (``gs://...``) are left as they are."""
    return epath.Path(files.absolute(path))


@gin.configurable(module="terra.training")
class Checkpointer:
    """One orbax ``CheckpointManager`` over ``<model_dir>/checkpoints``.

    Args:
      model_dir: the run's directory. Checkpoints go to ``<model_dir>/checkpoints``.
      save_interval_steps: ``save`` writes when ``step % save_interval_steps == 0``, at
        orbax's preemption sync point, or when forced.
      keep_last: how many of the most recent checkpoints to keep (``None`` keeps all).
      keep_best: how many of the best checkpoints by ``best_metric`` to keep *in addition*.
      best_metric: metric name (e.g. ``"eval/loss"``) in the ``metrics`` given to ``save``.
        Without it only ``keep_last`` applies.
      best_mode: ``"min"`` or ``"max"``: which direction of ``best_metric`` is better.
      async_save: if True, ``save`` returns once arrays are copied to host memory and the
        write continues in the background (``wait_until_finished``/``close`` wait for it).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        save_interval_steps: int = 1000,
        keep_last: Optional[int] = 3,
        keep_best: int = 1,
        best_metric: Optional[str] = None,
        best_mode: str = "min",
        async_save: bool = False,
    ):
        if save_interval_steps < 1:
            raise ConfigError(f"save_interval_steps must be >= 1; got {save_interval_steps}.")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(
                f"keep_last must be >= 1 (or None to keep every checkpoint); got {keep_last}. "
                "Keeping zero recent checkpoints would delete the one a restart needs."
            )
        if keep_best < 0:
            raise ConfigError(f"keep_best must be >= 0; got {keep_best}.")
        if best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode must be 'min' or 'max'; got {best_mode!r}.")
        self.model_dir = _absolute(model_dir)
        self.directory = self.model_dir / CHECKPOINTS_SUBDIR
        self.save_interval_steps = save_interval_steps
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save

        policies: List[Any] = [ocp_managers.LatestN(n=keep_last)]
        best_fn = None
        if best_metric is not None:
            best_fn = lambda m: _metric_value(m, best_metric, best_mode)  # noqa: E731
            if keep_best > 0:
                policies.append(
                    ocp_managers.BestN(
                        get_metric_fn=best_fn,
                        reverse=best_mode == "min",  # sorted descending: the smallest come last
                        n=keep_best,
                        keep_checkpoints_without_metrics=False,
                    )
                )
        self._options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp_managers.AnySavePolicy(
                [
                    ocp_managers.FixedIntervalPolicy(save_interval_steps),
                    ocp_managers.PreemptionCheckpointingPolicy(),
                ]
            ),
            preservation_policy=ocp_managers.AnyPreservationPolicy(policies),
            best_fn=best_fn,  # also makes orbax store the metrics with each step
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of saves that crashed before their commit
        )
        self._manager = self._open_manager()

    # -- construction ----------------------------------------------------------------------

    def _open_manager(self) -> ocp.CheckpointManager:
        try:
            return ocp.CheckpointManager(self.directory, options=self._options)
        except Exception as first_error:  # orbax reads every step's metrics when it opens
            bad = self._steps_with_unreadable_metrics()
            if not bad:
                raise CheckpointError(
                    f"cannot open the checkpoints in {self.directory}: {first_error}"
                ) from first_error
            for step, error in bad:
                self._set_aside(step, f"its metrics file is unreadable ({error})")
            return ocp.CheckpointManager(self.directory, options=self._options)

    def _steps_with_unreadable_metrics(self) -> List[Tuple[int, str]]:
        bad = []
        for step in _committed_steps(self.directory):
            path = self.directory / str(step) / "metrics" / "metrics"
            if path.exists():
                try:
                    json.loads(path.read_text())
                except ValueError as e:
                    bad.append((step, str(e)))
        return bad

    def _set_aside(self, step: int, reason: str) -> None:
        """Moves a damaged step out of the managed directory (primary process only)."""
        source = self.directory / str(step)
        target = self.model_dir / CORRUPT_SUBDIR / f"{step}-{time.time_ns()}"
        logger.warning("Setting checkpoint step %d aside to %s: %s.", step, target, reason)
        if jax.process_index() == 0 and source.exists():
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                source.rename(target)
            except OSError as e:
                logger.warning(
                    "Could not move %s aside (%s); later saves at or below step %d may be skipped.",
                    source,
                    e,
                    step,
                )
        ocp.multihost.sync_global_processes(f"terra_checkpoint_set_aside_{step}")

    # -- queries -----------------------------------------------------------------------------

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def all_steps(self) -> List[int]:
        return sorted(self._manager.all_steps())

    def best_step(self) -> Optional[int]:
        """The best retained step by ``best_metric`` (None without a best_metric)."""
        return self._manager.best_step() if self.best_metric is not None else None

    def params_only_step(self) -> Optional[int]:
        """The latest step when it holds parameters alone (``save_params``: a model saved from
        Python, with no optimizer state or data position), else None."""
        steps = self.all_steps()
        if not steps:
            return None
        tree = _read_tree_metadata(self.directory / str(max(steps)) / STATE_ITEM)
        if isinstance(tree, dict) and "params" in tree and "opt_state" not in tree:
            return max(steps)
        return None

    def should_save(self, step: int) -> bool:
        return self._manager.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """True once every process has reached orbax's preemption sync point: save and exit."""
        return self._manager.reached_preemption(step)

    def metrics(self, step: int) -> Optional[dict]:
        return self._manager.metrics(step)

    # -- saving ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        metrics: Optional[dict] = None,
        data_iterator: Any = None,
        force: bool = False,
    ) -> bool:
        """Saves ``state`` (and the iterator position) if due or forced. Returns whether it saved.

        Must be called on every process. Without ``async_save``, the checkpoint is committed
        and old steps are pruned before this returns.
        """
        items = {STATE_ITEM: ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items[INPUT_STATE_ITEM] = InputStateSave(data_iterator)
        with self._storage_errors(step):
            saved = self._manager.save(
                int(step),
                args=ocp.args.Composite(**items),
                metrics=_json_metrics(metrics),
                force=force,
            )
            if saved and not self.async_save:
                self._manager.wait_until_finished()
        return saved

    def wait_until_finished(self) -> None:
        with self._storage_errors(None):
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _storage_errors(self, step: Optional[int]):
        """A full or read-only disk as one ``StorageError`` line; other errors as they are."""
        try:
            yield
        except Exception as error:
            problem = storage_problem(error)
            if problem is None:
                raise
            what = f"step {step}" if step is not None else "a checkpoint"
            latest = _committed_steps(self.model_dir / CHECKPOINTS_SUBDIR)
            kept = f"step {latest[-1]}, the last complete checkpoint, is intact" if latest else "no step was saved"
            raise StorageError(
                f"cannot save {what} under {self.model_dir}: {problem}. Free space or make the folder writable, "
                f"then rerun the same command to resume ({kept})."
            ) from None

    # -- restoring ---------------------------------------------------------------------------

    def restore(
        self,
        abstract_state: TrainState,
        data_iterator: Any = None,
        step: Optional[int] = None,
    ) -> Optional[Tuple[TrainState, int]]:
        """Restores the latest (or the given) step onto the shardings of ``abstract_state``.

        ``abstract_state`` is a TrainState of ``jax.ShapeDtypeStruct(shape, dtype,
        sharding=...)``. The arrays come back with those shardings, and with those dtypes
        (orbax casts). If ``data_iterator`` is given, its position is restored too.

        Returns ``(state, step)``, or None when there is no checkpoint (a fresh run). A latest
        step that cannot be read is reported with a warning and the previous step is tried.
        Once an older step restores, the unreadable newer steps are moved to
        ``<model_dir>/corrupt_checkpoints``, so that later saves and retention ignore them. If
        no step is readable, or an explicitly requested ``step`` is not, CheckpointError is
        raised and nothing is moved. A
        checkpoint whose tree or shapes do not match ``abstract_state`` raises CheckpointError
        at once. Falling back would not help there, because the mismatch is in the target.
        """
        self._manager.wait_until_finished()
        steps = sorted(self._manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"no checkpoint for step {step} in {self.directory}; available steps: {sorted(steps)}"
                )
            steps = [step]
        if not steps:
            return None
        failures = []
        for candidate in steps:
            try:
                restored = self._restore_step(candidate, abstract_state, data_iterator)
                error = None
            except _TargetMismatch as mismatch:
                raise mismatch.error from None
            except Exception as e:  # any read failure means this step is damaged
                restored, error = None, e
            if not _all_processes_agree(error is None):
                error = error or CheckpointError("another process could not read this step")
            if error is None:
                if failures:
                    # Only now, with a good step in hand, move the unreadable newer ones aside: if
                    # every read fails (an outage, an incompatible upgrade) nothing is moved.
                    for bad_step, _ in failures:
                        self._set_aside(bad_step, "it could not be read (see the warning above)")
                    self._manager.reload()
                    logger.warning(
                        "Resumed from checkpoint step %d after skipping unreadable step(s) %s.",
                        candidate,
                        [s for s, _ in failures],
                    )
                return restored, candidate
            failures.append((candidate, error))
            logger.warning(
                "Checkpoint step %d (%s) is corrupt or incomplete: %s%s",
                candidate,
                self.directory / str(candidate),
                short_cause(error),
                "; trying the previous checkpoint." if step is None else ".",
            )
        details = "; ".join(f"step {s}: {short_cause(e)}" for s, e in failures)
        raise CheckpointError(
            f"no readable checkpoint in {self.directory} ({details}); nothing was moved or deleted."
        ) from failures[-1][1]

    def _restore_step(self, step: int, abstract_state: TrainState, data_iterator: Any) -> TrainState:
        step_dir = self.directory / str(step)
        _check_committed(step_dir)
        tree = _read_tree_metadata(step_dir / STATE_ITEM)
        try:
            _check_compatible(tree, abstract_state, f"checkpoint step {step} in {self.directory}")
        except CheckpointError as e:
            raise _TargetMismatch(e) from None
        items = {STATE_ITEM: ocp.args.StandardRestore(_with_default_sharding(abstract_state))}
        if data_iterator is not None:
            if (step_dir / INPUT_STATE_ITEM).exists():
                items[INPUT_STATE_ITEM] = InputStateRestore(data_iterator)
            else:
                logger.warning(
                    "Checkpoint step %d has no input-pipeline state (it was saved without a data "
                    "iterator); the data iterator starts from its beginning.",
                    step,
                )
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored[STATE_ITEM]

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TargetMismatch(Exception):
    def __init__(self, error: CheckpointError):
        super().__init__(str(error))
        self.error = error


# ---------------------------------------------------------------------------------------------
# Parameters only, from another run (fine-tuning).
# ---------------------------------------------------------------------------------------------


def _resolve_step_dir(checkpoint_dir: str, step: Optional[int]) -> epath.Path:
    """Accepts a model_dir, its ``checkpoints`` folder, or one step directory."""
    path = _absolute(checkpoint_dir)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist.")
    if (path / STATE_ITEM).is_dir() and (path / STEP_METADATA_FILE).exists():
        if step is not None and path.name != str(step):
            raise CheckpointError(f"{path} is the directory of step {path.name}, but step={step} was requested.")
        return path
    root = path / CHECKPOINTS_SUBDIR if (path / CHECKPOINTS_SUBDIR).is_dir() else path
    steps = _committed_steps(root)
    if not steps:
        raise CheckpointError(
            f"no committed checkpoint under {root}; pass a terra model_dir, its "
            f"'{CHECKPOINTS_SUBDIR}' folder or one step directory."
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} under {root}; available steps: {steps}")
    return root / str(step)


def resolve_step(checkpoint_dir: str, step: Optional[int] = None) -> int:
    """The step a ``restore_params(checkpoint_dir, step=step)`` would load (default: the latest
    committed one). Raises ``CheckpointError`` naming the directory when there is none."""
    return int(_resolve_step_dir(checkpoint_dir, step).name)


def _unreadable(step_dir: epath.Path, what: str, error: Exception) -> CheckpointError:
    """One line for a step that failed to read. A step removed while it was read is the usual
    cause when a training run is still writing the same folder (it keeps only its last steps)."""
    if not step_dir.exists():
        return CheckpointError(
            f"checkpoint {step_dir} was deleted while it was read (a training run writing {step_dir.parent.parent} "
            "keeps only its last steps): run the command again to read the latest step, or pass --step of a kept one."
        )
    return CheckpointError(f"checkpoint {step_dir} {what}: {short_cause(error)}")


def restore_params(
    checkpoint_dir: str,
    abstract_params: Any,
    *,
    step: Optional[int] = None,
    param_map: Optional[Callable[[Any], Any]] = None,
) -> Any:
    """Loads only the ``params`` of a checkpoint written by a :class:`Checkpointer`.

    Args:
      checkpoint_dir: the other run's ``model_dir``, its ``checkpoints`` folder, or one
        ``checkpoints/<step>`` directory.
      abstract_params: the target parameter tree of ``jax.ShapeDtypeStruct`` with shardings.
        The result has its structure, dtypes and shardings.
      step: which step (default: the latest committed one).
      param_map: optional ``fn(checkpoint_params) -> params`` that maps the saved tree onto
        the target's (renaming, dropping, reshaping). When given, the saved params are read to
        host memory as numpy, mapped, and then placed on the target shardings.

    Raises:
      CheckpointError: no such checkpoint, an unreadable one, or a tree or shape mismatch.
        The mismatch message names the first mismatching path and both shapes.
    """
    step_dir = _resolve_step_dir(checkpoint_dir, step)
    return _restore_params_at(step_dir, _checked_tree(step_dir), abstract_params, param_map)


def _checked_tree(step_dir: epath.Path) -> Any:
    """The tree metadata of a committed step whose files pass ``_check_step_files`` (a file that
    does not is that error; any other failure to read, one ``CheckpointError`` naming the step)."""
    _check_step_files(step_dir)
    try:
        _check_committed(step_dir)
        return _read_tree_metadata(step_dir / STATE_ITEM)
    except Exception as e:
        raise _unreadable(step_dir, "is unreadable", e) from e


def _restore_params_at(
    step_dir: epath.Path, tree: Any, abstract_params: Any, param_map: Optional[Callable[[Any], Any]]
) -> Any:
    """``restore_params`` of the step at ``step_dir``, whose tree metadata is ``tree``."""
    state_dir = step_dir / STATE_ITEM
    where = f"checkpoint {step_dir}"
    if not isinstance(tree, dict) or "params" not in tree:
        found = list(tree) if isinstance(tree, dict) else type(tree)
        raise CheckpointError(f"{where} has no 'params' subtree; found {found}.")
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        if param_map is None:
            _check_compatible(tree["params"], abstract_params, where)
            target = _with_default_sharding(abstract_params)
            restored = checkpointer.restore(
                state_dir,
                args=ocp.args.PyTreeRestore(
                    item={"params": target},
                    restore_args={"params": ocp.checkpoint_utils.construct_restore_args(target)},
                    partial_restore=True,
                ),
            )
            return restored["params"]
        host_item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["params"])
        host_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree["params"])
        restored = checkpointer.restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item={"params": host_item}, restore_args={"params": host_args}, partial_restore=True
            ),
        )
    except CheckpointError:
        raise
    except Exception as e:
        raise _unreadable(step_dir, "could not be read", e) from e
    finally:
        checkpointer.close()
    mapped = param_map(restored["params"])
    _check_compatible(mapped, abstract_params, f"{where} (after param_map)")
    return _place_like(mapped, _with_default_sharding(abstract_params))


def _place_like(host_tree: Any, abstract: Any) -> Any:
    """Puts host arrays onto the shardings of ``abstract`` (by path, so container types may differ)."""
    by_path = {_path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(host_tree)[0]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for path, target in flat:
        value = np.asarray(by_path[_path_str(path)], dtype=target.dtype)
        leaves.append(jax.make_array_from_callback(target.shape, target.sharding, lambda index, v=value: v[index]))
    return jax.tree_util.tree_unflatten(treedef, leaves)


__all__: Sequence[str] = (
    "Checkpointer",
    "CheckpointError",
    "restore_params",
    "InputStateSave",
    "InputStateRestore",
)


def load_params(model, checkpoint_dir: str, step: Optional[int] = None) -> Tuple[Any, int]:
    """``(params, step)`` of ``model`` (a ``terra.models.Model``) from a terra checkpoint (a
    model_dir, its checkpoints folder or a step directory; default the latest step), restored
    onto the default device. Weights a checkpoint stores narrow (``save_params`` of a quantized
    model: :func:`stored_weights_dtype`) come back as such, ``QuantizedTensor`` leaves."""
    step_dir = _resolve_step_dir(checkpoint_dir, step)
    tree = _checked_tree(step_dir)  # read once: the stored dtype and the restore both use it
    abstract = model.abstract_params()
    kind = _weights_dtype_of_tree(tree, step_dir)
    if kind != "float32":
        from terra.quantization import quantize_params

        abstract = jax.eval_shape(lambda params: quantize_params(params, kind), abstract)
    return _restore_params_at(step_dir, tree, abstract, None), int(step_dir.name)


# The dtype a narrow weight's stored values have (terra.quantization.QuantizedTensor.values).
_NARROW_VALUES = {"int8": "int8", "uint16": "bfloat16"}


def stored_weights_dtype(checkpoint_dir: str, step: Optional[int] = None) -> str:
    """How a checkpoint stores its weights: ``float32``, or ``int8`` / ``bfloat16`` for the
    parameters of a quantized model (``InteractiveModel.save`` keeps them narrow): read from the
    tree's metadata, a ``values`` leaf of int8 or uint16 beside a ``scale``."""
    step_dir = _resolve_step_dir(checkpoint_dir, step)
    return _weights_dtype_of_tree(_checked_tree(step_dir), step_dir)


def _weights_dtype_of_tree(tree: Any, step_dir: epath.Path) -> str:
    """``stored_weights_dtype`` of the step at ``step_dir``, whose tree metadata is ``tree``."""
    params = tree.get("params") if isinstance(tree, dict) else None
    found = set()

    def visit(node):
        if isinstance(node, dict):
            values = node.get("values")
            if "scale" in node and values is not None and str(getattr(values, "dtype", "")) in _NARROW_VALUES:
                found.add(_NARROW_VALUES[str(values.dtype)])
            for child in node.values():
                visit(child)

    visit(params)
    if len(found) > 1:
        raise CheckpointError(f"checkpoint {step_dir} mixes {sorted(found)} weights; terra writes one kind per run.")
    return found.pop() if found else "float32"


def save_params(model_dir: str, params: Any, step: int) -> None:
    """A checkpoint of ``params`` alone at ``step`` in ``model_dir`` (no optimizer state, no data
    position), laid out as a :class:`Checkpointer` writes one: ``terra.load``, ``terra-evaluate``
    and ``INIT_FROM`` read it as they read a training run's, and ``terra-train`` resumes it with a
    fresh optimizer (:meth:`Checkpointer.params_only_step`). Narrow weights are written as such."""
    with Checkpointer(model_dir, save_interval_steps=1, keep_last=None) as checkpointer:
        checkpointer.save(int(step), {"step": np.int32(step), "params": params}, force=True)

"""The trainer behind ``terra-train``: gin-configured, sharded, resumable.

``Trainer(...)`` validates everything it can before touching ``model_dir`` (settings, data
present, model and task agree, evaluation hooks ready) and builds every piece of a run without
writing anything: the mesh, the logical-axis shardings of the state (parameters from the
model's logical names, optimizer state derived from them), the jitted train and evaluation
steps and the dropout key. :meth:`Trainer.step`, :meth:`Trainer.evaluate` and
:meth:`Trainer.save` therefore work on a state from :meth:`Trainer.init_state` as soon as the
trainer exists (a study drives them itself); the step compiles on its first batch, the
evaluation batches are read on the first evaluation and the checkpoints open on the first save.
``run()`` then:

1. creates the state already sharded, or
2. resumes from the latest good checkpoint in ``model_dir`` (state and data position), or
   initialises parameters from ``init_from`` (fine-tuning: parameters only, fresh optimizer
   and step), or from the seed;
3. writes the operative gin config to ``model_dir/config.gin`` and copies the vocabulary's
   SentencePiece model into the run (``run_directory``);
4. loops over :meth:`Trainer.step` (one jitted train step, state donated), logging,
   :meth:`Trainer.evaluate` and :meth:`Trainer.maybe_save`; on SIGTERM (preemption) or a first
   Ctrl-C (SIGINT) it saves the current step and returns (a second Ctrl-C stops at once). A
   non-finite loss stops the run with :class:`TrainingDiverged`, leaving the last checkpoint as
   it was.

Each host feeds its own shard of the data (``batch_size`` is global); only host 0 writes logs.
The model is anything implementing ``terra.models.Model``. The data layer (``terra.data``, on
TensorFlow and seqio) is imported by the methods that read data, so this module, like the train
step, optimizers and checkpointing beside it, imports where TensorFlow is not installed.
"""

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import signal
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from terra.errors import ConfigError, DataNotFoundError, TrainingError
from terra.layers import axes
from terra.models.protocol import Model
from terra.parallel import mesh as mesh_lib
from terra.parallel import sharding
from terra.training import checkpointing, optimizers, run_directory, run_lock
from terra.training import metrics as metrics_lib
from terra.training.settings import (
    CheckpointSettings,
    EvaluationSettings,
    LoggingSettings,
    ParallelSettings,
    StepHook,
)
from terra.training.train_state import TrainState
from terra.training.train_step import evaluate_batches, train_step


class TrainingDiverged(TrainingError):
    """The loss or gradient norm became NaN or infinite."""


@dataclasses.dataclass
class TrainResult:
    step: int
    params: object
    last_train_metrics: Dict[str, float]
    last_eval_metrics: Dict[str, float]
    preempted: bool = False
    model_dir: str = ""
    # "SIGTERM" (preemption) or "SIGINT" (Ctrl-C) when a signal ended the run after saving its step
    stopped_by: Optional[str] = None


class PreemptionSignal:
    """Turns SIGTERM (preemption) and a first SIGINT (Ctrl-C) into a flag the loop checks at each
    step boundary, where it saves the step and returns. A second Ctrl-C stops at once
    (``KeyboardInterrupt``, nothing saved past the last checkpoint)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: Callable[[str], Any] = lambda line: None):
        self.received = False
        self.signal_name: Optional[str] = None
        self.announce = announce
        self._previous: Dict[int, Any] = {}

    def __enter__(self):
        try:
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: no preemption handling
            self._previous = {}
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C
        if not self.received:
            self.received, self.signal_name = True, signal.Signals(signum).name
            if signum == signal.SIGINT:
                self.announce(
                    "Ctrl-C: saving a checkpoint when this step ends, then stopping (Ctrl-C again stops at once, "
                    "without it)."
                )

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def host_batch_size(batch_size: int) -> int:
    """Each process's share of the global ``batch_size``."""
    n = jax.process_count()
    if batch_size % n:
        raise ConfigError(f"batch_size={batch_size} must be divisible by the {n} processes (each feeds its share).")
    return batch_size // n


@gin.configurable(module="terra.training")
class Trainer:
    """Trains ``model`` on ``task`` for ``steps`` optimizer steps, checkpointing in ``model_dir``.

    Args:
      model: a ``terra.models.Model`` (gin: ``terra.training.Trainer.model = %MODEL``).
      task: a task or mixture name of ``terra.data.catalog.TASKS`` or ``MIXTURES`` (gin:
        ``%TASK``), or a seqio Task or Mixture (``terra.data.tasks.resolve``).
      feature_lengths: task feature lengths (``%TASK_FEATURE_LENGTHS``).
      batch_size: global examples per step (divided among the hosts).
      steps: total optimizer steps; a resumed run continues up to it.
      model_dir: where checkpoints, ``config.gin`` and the logs go.
      optimizer: an ``OptimizerSpec`` (default: the reference's Adafactor with the rsqrt schedule).
      clip_grad_norm / gradient_accumulation_steps: see ``terra.training.optimizers.build_optimizer``.
      feature_converter: the seqio feature converter (default: encoder-decoder).
      seed: parameter initialisation and dropout; data_seed: the data stream (default: seed);
        shuffle: shuffle the training stream (off: every host reads its shard in order).
      init_from: a pretrained model_dir (or its checkpoint) to take the parameters from when
        ``model_dir`` has no checkpoint yet (fine-tuning); ``param_map`` maps its tree.
      parallel, checkpoints, evaluation, logging: the grouped settings
        (``terra.training.settings``); each defaults to its gin-configured construction.
      step_hooks: :class:`~terra.training.settings.StepHook` objects run before and after every
        optimizer step, in order (a study records or perturbs steps with one).
    """

    def __init__(
        self,
        *,
        model: Model = gin.REQUIRED,
        task: Union[str, Any] = gin.REQUIRED,
        feature_lengths: Mapping[str, int] = gin.REQUIRED,
        batch_size: int = gin.REQUIRED,
        steps: int = gin.REQUIRED,
        model_dir: str = gin.REQUIRED,
        optimizer: Optional[optimizers.OptimizerSpec] = None,
        clip_grad_norm: Optional[float] = None,
        gradient_accumulation_steps: int = 1,
        feature_converter=None,
        seed: int = 0,
        data_seed: Optional[int] = None,
        shuffle: bool = True,
        init_from: Optional[str] = None,
        param_map: Optional[Callable] = None,
        parallel: Optional[ParallelSettings] = None,
        checkpoints: Optional[CheckpointSettings] = None,
        evaluation: Optional[EvaluationSettings] = None,
        logging: Optional[LoggingSettings] = None,
        step_hooks: Sequence[StepHook] = (),
    ):
        # ---- validate before anything is written ----------------------------------------
        if steps <= 0 or batch_size <= 0:
            raise ConfigError(f"steps ({steps}) and batch_size ({batch_size}) must be positive.")
        self.model = model
        self.steps = steps
        self.batch_size = batch_size
        self.model_dir = model_dir
        self.feature_lengths = dict(feature_lengths)
        self.feature_converter = feature_converter
        self.seed = seed
        self.data_seed = seed if data_seed is None else data_seed
        self.shuffle = shuffle
        self.init_from = init_from
        self.param_map = param_map
        self.parallel = parallel or ParallelSettings()
        self.checkpoints = checkpoints or CheckpointSettings()
        self.evaluation = evaluation or EvaluationSettings()
        self.logging = logging or LoggingSettings()
        self.step_hooks = tuple(step_hooks)
        from terra.data import catalog, tasks

        self.provider = tasks.resolve(task)
        # Every problem of the config and its evaluation data, in one error: one rerun fixes them all.
        problems = tasks.vocabulary_and_length_problems(
            self.provider,
            self.feature_lengths,
            vocab_size=model.config.vocab_size,
            max_len=model.config.max_len,
            feature_converter=feature_converter,
        )
        directions = self.evaluation.metric_directions()
        if self.checkpoints.best_metric not in directions:
            problems.append(
                f"CheckpointSettings.best_metric={self.checkpoints.best_metric!r} is not a metric this run evaluates; "
                f"use one of {sorted(directions)} (eval/rouge* needs a ROUGE hook in EvaluationSettings.hooks)"
            )
        # The train split is checked when its first batch is read, in run(), still before model_dir.
        if self.evaluation.teacher_forced or self.evaluation.hooks:
            try:
                tasks.check_task_data(self.provider, self.evaluation.split)
            except (DataNotFoundError, ConfigError) as error:
                if not problems:
                    raise
                problems.append(" ".join(str(error).split()))
        catalog.raise_problems(problems)
        self.host_batch = host_batch_size(batch_size)
        self.best_mode = directions[self.checkpoints.best_metric]
        self.eval_feature_lengths = dict(self.evaluation.feature_lengths or self.feature_lengths)
        for hook in self.evaluation.hooks:
            hook.prepare(
                model=model,
                task=self.provider,
                split=self.evaluation.split,
                feature_lengths=self.eval_feature_lengths,
                batch_size=self.host_batch,
            )
        spec = optimizer or optimizers.adafactor()
        self.optimizer = optimizers.build_optimizer(
            spec, clip_grad_norm=clip_grad_norm, gradient_accumulation_steps=gradient_accumulation_steps
        )
        self.rules = self.parallel.axis_rules or axes.default_axis_rules()
        devices = jax.devices()[: self.parallel.num_devices] if self.parallel.num_devices else None
        self.mesh = mesh_lib.make_mesh(**dict(self.parallel.mesh_shape or {}), devices=devices)
        self.is_host0 = jax.process_index() == 0
        # ---- the run's pieces: built here, nothing written or compiled ---------------------
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.abstract_params, self.state_shardings = self._state_shardings()
        self.rng = jax.random.key(self.seed + 1)  # dropout; the parameters start from seed
        tx, batch_sh = self.optimizer.transform, sharding.batch_sharding(self.mesh)
        self.jitted_step = jax.jit(
            lambda s, b, r: train_step(model, tx, s, b, r),
            in_shardings=(self.state_shardings, batch_sh, self.replicated),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=(0,),
        )
        self.eval_fn = jax.jit(
            model.eval_metrics, in_shardings=(self.state_shardings.params, batch_sh), out_shardings=self.replicated
        )
        # The step compiled for the first batch's shapes (by step() or compile_step()).
        self.compiled_step = None
        # Opened by the first save or restore: creating it creates model_dir/checkpoints.
        self._checkpointer: Optional[checkpointing.Checkpointer] = None

    # ----- data ----------------------------------------------------------------------------
    def batches(self, split: str, lengths: Mapping[str, int], num_epochs: Optional[int], shuffle: bool):
        """This host's batches of ``split``: a checkpointable iterator."""
        from terra.data import pipeline

        return pipeline.batch_iterator(
            self.provider,
            split,
            feature_lengths=lengths,
            batch_size=self.host_batch,
            feature_converter=self.feature_converter,
            seed=self.data_seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
        )

    def global_batch(self, host_batch):
        """This host's batch as the global array the compiled steps take (``batch_size`` rows)."""
        return sharding.global_batch(host_batch, self.mesh)

    def read_eval_batches(self) -> List:
        """The first ``EvaluationSettings.steps`` batches of the eval split, unshuffled, as
        global arrays: every evaluation scores the same examples."""
        if not self.evaluation.teacher_forced:
            return []
        hosts = self.batches(self.evaluation.split, self.eval_feature_lengths, 1, False)
        return [self.global_batch(h) for h in itertools.islice(hosts, self.evaluation.steps)]

    @functools.cached_property
    def eval_batches(self) -> List:
        """:meth:`read_eval_batches`, read once, by the first evaluation that needs them."""
        return self.read_eval_batches()

    # ----- state ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def placement(self):
        """The mesh and logical-axis rules the run's functions are traced and run under."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def _state_shardings(self):
        """``(abstract parameters carrying their shardings, the TrainState's shardings)``."""
        abstract_vars = self.model.abstract_variables()
        p_shardings = sharding.param_shardings(abstract_vars, self.mesh, self.rules)
        abstract_params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            sharding.unboxed(abstract_vars)["params"],
            p_shardings,
        )
        o_shardings = sharding.opt_state_shardings(self.optimizer.transform, abstract_params, p_shardings, self.mesh)
        return abstract_params, TrainState(step=self.replicated, params=p_shardings, opt_state=o_shardings)

    def _init_state(self, rng) -> TrainState:
        params = nn.unbox(self.model.init_variables(rng))["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.transform.init(params))

    def abstract_state(self) -> TrainState:
        """``jax.ShapeDtypeStruct`` (with its sharding) of every leaf of the state: the model's
        abstract parameters, taken from its build, and the optimizer state's shapes (tracing the
        model again would cost seconds at the paper's sizes)."""
        state = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params=self.abstract_params,
            opt_state=jax.eval_shape(self.optimizer.transform.init, self.abstract_params),
        )
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, self.state_shardings
        )

    def init_state(self) -> TrainState:
        """A fresh state from ``seed`` at step 0, created already sharded over the mesh."""
        with self.placement():
            return sharding.sharded_init(self._init_state, jax.random.key(self.seed), self.state_shardings)

    @property
    def checkpointer(self) -> checkpointing.Checkpointer:
        """The run's checkpoints in ``model_dir`` (opened, and the folder created, on first use)."""
        if self._checkpointer is None:
            self._checkpointer = checkpointing.Checkpointer(
                self.model_dir,
                save_interval_steps=self.checkpoints.every,
                keep_last=self.checkpoints.keep_last,
                keep_best=self.checkpoints.keep_best,
                best_metric=self.checkpoints.best_metric,
                best_mode=self.best_mode,
            )
        return self._checkpointer

    def close(self) -> None:
        """Waits for and closes the checkpoints, if any were opened (a later save reopens them)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    def _initial_state(self, train_batches, init_params):
        """``(state, start_step, origin)``: restored, fine-tuned from ``init_params`` (read from
        ``init_from`` before anything was written), or fresh. A run saved from Python
        (``InteractiveModel.save``: parameters alone) continues from its step with a fresh
        optimizer and the data from its start."""
        saved = self.checkpointer.params_only_step()
        if saved is not None:
            return self._from_saved_params(saved)
        restored = self.checkpointer.restore(self.abstract_state(), data_iterator=train_batches)
        if restored is not None:
            state, start_step = restored
            return state, start_step, f"resumed from step {start_step}"
        if init_params is None:
            return self.init_state(), 0, "initialised from seed"
        # Fine-tuning: every parameter comes from init_from, so no random ones are drawn (the
        # initializer, compiled and run, would be discarded).
        return self._state_from_params(init_params, 0), 0, f"parameters from {self.init_from}"

    def _state_from_params(self, params, step: int) -> TrainState:
        """A state at ``step`` holding ``params`` (already placed) and a fresh optimizer."""
        with self.placement():
            opt_state = jax.jit(self.optimizer.transform.init, out_shardings=self.state_shardings.opt_state)(params)
            step_array = jax.device_put(jnp.int32(step), self.state_shardings.step)
        return TrainState(step=step_array, params=params, opt_state=opt_state)

    def _from_saved_params(self, step: int):
        kind = checkpointing.stored_weights_dtype(self.model_dir, step)
        if kind != "float32":
            raise ConfigError(
                f"{self.model_dir} holds {kind} weights (a quantized model saved from Python): training updates "
                "float32 weights. Save the float32 model (before .quantized()) and train that."
            )
        abstract = self.abstract_state()
        params = checkpointing.restore_params(self.model_dir, abstract.params, step=step)
        origin = f"parameters saved from Python at step {step} (a fresh optimizer; the data from its start)"
        return self._state_from_params(params, step), step, origin

    # ----- the pieces of one iteration -----------------------------------------------------
    def compile_step(self, state: TrainState, batch):
        """Compiles the train step for the shapes of ``state`` and ``batch`` (arrays or
        ``jax.ShapeDtypeStruct``) and keeps it as ``compiled_step``; returns it."""
        with self.placement():
            self.compiled_step = self.jitted_step.lower(state, batch, self.rng).compile()
        return self.compiled_step

    def step(self, state: TrainState, batch) -> tuple:
        """One compiled optimizer step on a global ``batch``: ``(state, metrics)``; the old state
        is donated. The first call compiles the step for its shapes."""
        compiled = self.compiled_step or self.compile_step(state, batch)
        return compiled(state, batch, self.rng)

    def _due(self, every: int, step: int) -> bool:
        """Every ``every`` steps (0: never) and at the last step."""
        return bool(every) and (step % every == 0 or step == self.steps)

    def _due_evaluations(self, step: int):
        """``(teacher-forced evaluation due, hooks due)`` at ``step``."""
        teacher_forced = self.evaluation.teacher_forced and self._due(self.evaluation.every, step)
        return teacher_forced, [h for h in self.evaluation.hooks if self._due(h.every, step)]

    def evaluate(self, params, step: int) -> Dict[str, float]:
        """Teacher-forced metrics on the eval batches, plus every hook due at ``step``."""
        teacher_forced, hooks = self._due_evaluations(step)
        results: Dict[str, float] = {}
        with self.placement():
            if teacher_forced:
                results.update(evaluate_batches(self.eval_fn, params, self.eval_batches))
            for hook in hooks:
                results.update(hook(params))
        return results

    def evaluation_due(self, step: int) -> bool:
        teacher_forced, hooks = self._due_evaluations(step)
        return teacher_forced or bool(hooks)

    def maybe_save(
        self, step: int, state: TrainState, train_batches=None, *, force: bool = False, metrics: Optional[dict] = None
    ) -> bool:
        """Saves at the checkpoint interval, when forced (end, preemption), or at orbax's
        preemption sync point; ``metrics`` rank the best checkpoints. Called before the next
        batch is read, so the stored data position is ``step``. Returns whether it saved."""
        return self.checkpointer.save(
            step,
            state,
            data_iterator=train_batches,
            force=force,
            metrics={f"eval/{k}": v for k, v in metrics.items()} if metrics else None,
        )

    def save(self, step: int, state: TrainState, train_batches=None, *, metrics: Optional[dict] = None) -> bool:
        """Saves ``state`` as checkpoint ``step`` now (with the data position of
        ``train_batches`` when given), whatever the interval."""
        return self.maybe_save(step, state, train_batches, force=True, metrics=metrics)

    def _raise_if_diverged(self, metrics, last_step: int, to_close) -> None:
        """Raise :class:`TrainingDiverged` naming the first of the steps ``last_step - len + 1 ..
        last_step`` whose loss or gradient norm was not finite."""
        for i, m in enumerate(metrics):
            if int(m["nonfinite"]):
                for resource in to_close:
                    resource.close()
                raise TrainingDiverged(
                    f"step {last_step - len(metrics) + 1 + i}: the loss or gradient norm is not finite "
                    f"(loss={float(m['loss'])}, grad_norm={float(m['grad_norm'])}); training stopped. Non-finite "
                    f"steps left the parameters unchanged, and the last checkpoint in {self.model_dir} is intact. "
                    "Lower the learning rate, enable clip_grad_norm, or check the data."
                )

    # ----- the run -------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to ``steps`` (or to preemption) and return the final state's summary. Every check
        (the data pipeline, a fine-tuning checkpoint's fit) runs before ``model_dir`` is created,
        and the run holds ``model_dir``'s lock (``run_lock``) while it writes there."""
        from terra.data import json_lines

        train_batches = self.batches("train", self.feature_lengths, None, self.shuffle)
        first = next(train_batches)  # fails here, before model_dir exists, if the pipeline cannot run
        with self.placement():
            init_params = None
            if self.init_from and not checkpointing.has_checkpoint(self.model_dir):
                # Read (and checked against this model) before anything is written: a checkpoint
                # of another architecture fails here and leaves model_dir as it was.
                init_params = checkpointing.restore_params(
                    self.init_from, self.abstract_params, param_map=self.param_map
                )
            try:
                with run_lock.RunLock(self.model_dir, enabled=self.is_host0):
                    return self._train(train_batches, first, init_params)
            finally:
                for line in json_lines.skip_report(train_batches.readers):
                    logging.warning(line)

    def _train(self, train_batches, first, init_params) -> TrainResult:
        """Restores or initialises the state, compiles the step and runs the loop (locked)."""
        os.makedirs(self.model_dir, exist_ok=True)  # every process; process 0's lock made it already
        state, start_step, origin = self._initial_state(train_batches, init_params)
        if start_step >= self.steps:  # a finished run: nothing to compile or train
            if self.is_host0:
                print(
                    f"train: {self.model_dir} is already at step {start_step} (TRAIN_STEPS = {self.steps}); "
                    "nothing to do.",
                    flush=True,
                )
            self.close()
            return TrainResult(
                step=start_step,
                params=state.params,
                last_train_metrics={},
                last_eval_metrics={},
                preempted=False,
                model_dir=self.model_dir,
            )
        if start_step:
            first = None  # the restored data position replaces the batch read to check the pipeline
        host_next = first if first is not None else next(train_batches)
        pending = self.global_batch(host_next)
        compiled = self.compile_step(state, pending)
        param_count = int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.abstract_params)))
        summary = metrics_lib.summarize_start(
            mesh_description=mesh_lib.describe_mesh(self.mesh),
            param_count=param_count,
            compiled_memory_bytes=metrics_lib.compiled_memory_bytes(compiled),
        )
        if self.is_host0:
            print(f"train: {summary}; {origin}; {self.model_dir}", flush=True)
            # The run keeps its own vocabulary and config, so that it opens from anywhere.
            run_directory.save_vocabulary(self.model_dir, self.provider.output_features["targets"].vocabulary)
            run_directory.write_config(self.model_dir, gin.operative_config_str())
        return self._loop(state, start_step, train_batches, host_next, pending)

    def _loop(self, state, start_step, train_batches, host_next, pending) -> TrainResult:
        from terra.data import pipeline

        writer = metrics_lib.MetricsWriter(self.model_dir, enabled=self.is_host0, resume_step=start_step)
        bar = metrics_lib.ProgressBar(
            self.steps, initial_step=start_step, enabled=self.is_host0 and self.logging.progress
        )
        last_train: Dict[str, float] = {}
        last_eval: Dict[str, float] = {}
        window: List = []
        unchecked: List = []  # steps whose finiteness the host has not looked at yet
        tokens = 0
        window_start = time.perf_counter()
        log_every = self.logging.every
        step = start_step
        # A Ctrl-C's message is a line of its own above the bar; the bar is closed (its line ended)
        # before an error or a second Ctrl-C's "interrupted" is printed.
        announce = lambda line: bar.write(f"train: {line}") if self.is_host0 else None  # noqa: E731
        with bar, PreemptionSignal(announce=announce) as term:
            while step < self.steps:
                tokens += pipeline.count_tokens(host_next)
                for hook in self.step_hooks:
                    state = hook.before_step(step, state)
                state, m = self.step(state, pending)
                step += 1
                for hook in self.step_hooks:
                    hook.after_step(step, state, m)
                window.append(m)
                unchecked.append(m)
                evaluated = self.evaluation_due(step)
                # The host waits for the device only where it reads results anyway (logging,
                # evaluation, checkpoints), so steps stay asynchronous in between; a non-finite
                # step never changed the state, and nothing is saved after one.
                if (
                    step % log_every == 0
                    or step % self.checkpoints.every == 0
                    or evaluated
                    or step == self.steps
                    or term.received
                ):
                    self._raise_if_diverged(unchecked, step, (writer, bar, self))
                    unchecked = []
                if step % log_every == 0 or step == self.steps:
                    elapsed = time.perf_counter() - window_start
                    loss = float(np.mean([float(x["loss"]) for x in window]))
                    last_train = {
                        "loss": loss,
                        "grad_norm": float(window[-1]["grad_norm"]),
                        "learning_rate": float(self.optimizer.schedule(step - 1)),
                        "steps_per_second": len(window) / elapsed,
                        "tokens_per_second": tokens * jax.process_count() / elapsed,
                    }
                    writer.write(step, last_train, prefix="train")
                    bar.update(step, loss, len(window) / elapsed)
                    window, tokens, window_start = [], 0, time.perf_counter()
                results = self.evaluate(state.params, step) if evaluated else {}
                if results:
                    writer.write(step, results, prefix="eval")
                    if self.is_host0 and self.logging.print_evaluation:
                        bar.write(
                            f"train: step {step} eval: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(results.items()))
                        )
                    last_eval = {**last_eval, **results}
                self.maybe_save(
                    step,
                    state,
                    train_batches,
                    force=step == self.steps or term.received,
                    metrics=last_eval if results else None,
                )
                if term.received:
                    break
                if step < self.steps:
                    host_next = next(train_batches)
                    pending = self.global_batch(host_next)
        writer.close()
        bar.close()
        self.close()
        return TrainResult(
            step=step,
            params=state.params,
            last_train_metrics=last_train,
            last_eval_metrics=last_eval,
            preempted=term.received,
            model_dir=self.model_dir,
            stopped_by=term.signal_name,
        )

"""The training loop behind ``python -m terra.train``: gin-configured, sharded, resumable.

``train(...)`` validates everything it can before touching ``model_dir`` (data present, model
and task agree, bindings complete), then:

1. builds the mesh and the logical-axis shardings of the state (parameters from the model's
   logical names, optimizer state derived from them), and creates the state already sharded;
2. resumes from the latest good checkpoint in ``model_dir`` (state and data position), or
   initialises parameters from ``init_from`` (fine-tuning: parameters only, fresh optimizer
   and step), or from the seed;
3. writes the operative gin config to ``model_dir/config.gin``;
4. runs one jitted train step per batch (state donated, explicit in/out shardings), logs
   metrics to ``metrics.jsonl`` and TensorBoard, evaluates every ``eval_every`` steps,
   checkpoints every ``checkpoint_every`` steps and at the end, and on SIGTERM saves the
   current step and returns. A non-finite loss stops the run with :class:`TrainingDiverged`,
   leaving the last checkpoint as it was.

Each host feeds its own shard of the data (``batch_size`` is global); only host 0 writes logs.
"""

import dataclasses
import itertools
import os
import signal
import time
from typing import Callable, Dict, Mapping, Optional

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from terra.data import pipeline, tasks
from terra.errors import ConfigError, TrainingError
from terra.layers import axes
from terra.parallel import mesh as mesh_lib
from terra.parallel import sharding
from terra.training import checkpointing, optimizers
from terra.training import metrics as metrics_lib
from terra.training.train_state import TrainState
from terra.training.train_step import eval_step, evaluate_batches, train_step


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


class _TermSignal:
    """Turns SIGTERM (preemption) into a flag the loop checks at each step boundary."""

    def __init__(self):
        self.received = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no preemption handling
            self._previous = None
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def check_model_and_task(model, provider, feature_lengths) -> None:
    """A model/task mismatch fails before anything is written."""
    vocab_size = model.config.vocab_size
    for name, feature in provider.output_features.items():
        if feature.vocabulary.vocab_size > vocab_size:
            raise ConfigError(
                f"the task's '{name}' vocabulary has {feature.vocabulary.vocab_size} ids but the model's "
                f"vocab_size is {vocab_size}; bind TransformerConfig.vocab_size = {feature.vocabulary.vocab_size} "
                f"(or a multiple of 128 above it)."
            )
    too_long = {k: v for k, v in feature_lengths.items() if v > model.config.max_len}
    if too_long:
        raise ConfigError(
            f"feature lengths {too_long} exceed the model's max_len={model.config.max_len}; "
            f"bind TransformerConfig.max_len = {max(too_long.values())} or shorten the features."
        )


def _host_batch_size(batch_size: int) -> int:
    n = jax.process_count()
    if batch_size % n:
        raise ConfigError(f"batch_size={batch_size} must be divisible by the {n} processes (each feeds its share).")
    return batch_size // n


def _raise_if_diverged(metrics, last_step: int, model_dir: str, to_close) -> None:
    """Raise :class:`TrainingDiverged` naming the first of the steps ``last_step - len + 1 ..
    last_step`` whose loss or gradient norm was not finite."""
    for i, m in enumerate(metrics):
        if int(m["nonfinite"]):
            for resource in to_close:
                resource.close()
            raise TrainingDiverged(
                f"step {last_step - len(metrics) + 1 + i}: the loss or gradient norm is not finite "
                f"(loss={float(m['loss'])}, grad_norm={float(m['grad_norm'])}); training stopped. Non-finite "
                f"steps left the parameters unchanged, and the last checkpoint in {model_dir} is intact. Lower "
                f"the learning rate, enable clip_grad_norm, or check the data.")


@gin.configurable(module="terra")
def train(
    *,
    model=gin.REQUIRED,
    task: str = gin.REQUIRED,
    feature_lengths: Mapping[str, int] = gin.REQUIRED,
    batch_size: int = gin.REQUIRED,
    steps: int = gin.REQUIRED,
    model_dir: str = gin.REQUIRED,
    optimizer=None,
    clip_grad_norm: Optional[float] = None,
    gradient_accumulation_steps: int = 1,
    feature_converter=None,
    mesh_shape: Optional[Mapping[str, int]] = None,
    num_devices: Optional[int] = None,
    axis_rules=None,
    seed: int = 0,
    data_seed: Optional[int] = None,
    shuffle: bool = True,
    log_every: int = 10,
    checkpoint_every: int = 1000,
    keep_last: int = 3,
    keep_best: int = 1,
    eval_every: int = 1000,
    eval_steps: int = 10,
    eval_split: str = "validation",
    eval_feature_lengths: Optional[Mapping[str, int]] = None,
    init_from: Optional[str] = None,
    param_map: Optional[Callable] = None,
    rouge_every: int = 0,
    rouge_examples: int = 16,
    rouge_max_decode_length: Optional[int] = None,
    best_metric: str = "eval/loss",
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` on ``task`` for ``steps`` optimizer steps, checkpointing in ``model_dir``.

    Args:
      model: an ``EncoderDecoderModel`` (gin: ``train.model = %MODEL``).
      task: a task or mixture name from ``terra.data.tasks`` (gin: ``%TASK``).
      feature_lengths: task feature lengths (``%TASK_FEATURE_LENGTHS``).
      batch_size: global examples per step (divided among the hosts).
      steps: total optimizer steps; a resumed run continues up to it.
      optimizer: an ``OptimizerSpec`` (default: the reference's Adafactor with the rsqrt schedule).
      clip_grad_norm / gradient_accumulation_steps: see ``terra.training.optimizers.build_optimizer``.
      mesh_shape: ``{"data": d, "model": m}`` (default: every device on 'data').
      num_devices: use only the first ``num_devices`` devices (default: all).
      axis_rules: logical-to-mesh rules (default ``terra.layers.axes.default_axis_rules()``).
      seed: parameter initialisation and dropout; data_seed: the data stream (default: seed);
        shuffle: shuffle the training stream (off: every host reads its shard in order).
      checkpoint_every, keep_last, keep_best: checkpoints at that interval and at the end; keep
        the last ``keep_last`` plus the ``keep_best`` with the lowest eval loss.
      eval_every, eval_steps, eval_split, eval_feature_lengths: teacher-forced evaluation
        (log-perplexity, token and sequence accuracy) on ``eval_steps`` batches.
      init_from: a pretrained model_dir (or its checkpoint) to take the parameters from when
        ``model_dir`` has no checkpoint yet (fine-tuning); ``param_map`` maps its tree.
      rouge_every, rouge_examples, rouge_max_decode_length: every ``rouge_every`` steps (0: never)
        decode the first ``rouge_examples`` examples of ``eval_split`` greedily (up to
        ``rouge_max_decode_length`` tokens, default the target length) and log their ROUGE F1
        as ``eval/rouge1``, ``eval/rouge2``, ``eval/rougeLsum``, ``eval/rougeL`` (one process only).
      best_metric: the metric the ``keep_best`` checkpoints are ranked by: ``eval/loss`` (lower
        is better) or an ``eval/rouge*`` score (higher is better).
    """
    # ---- validate before anything is written --------------------------------------------
    if steps <= 0 or batch_size <= 0:
        raise ConfigError(f"steps ({steps}) and batch_size ({batch_size}) must be positive.")
    provider = tasks.get_task(task)
    # The train split is checked when its first batch is read, below, still before model_dir.
    if (eval_every and eval_steps) or rouge_every:
        tasks.check_task_data(provider, eval_split)
    if rouge_every and jax.process_count() > 1:
        raise ConfigError("rouge_every decodes on one process; set terra.train.rouge_every = 0 in a multi-host run "
                          "and score checkpoints with python -m terra.evaluate.")
    if rouge_every and rouge_examples <= 0:
        raise ConfigError(f"rouge_examples={rouge_examples} must be positive when rouge_every is set.")
    if best_metric != "eval/loss" and not (best_metric.startswith("eval/rouge") and rouge_every):
        raise ConfigError(f"best_metric={best_metric!r}: use 'eval/loss', or an 'eval/rouge*' score (eval/rouge1, "
                          "eval/rouge2, eval/rougeLsum, eval/rougeL) together with rouge_every > 0.")
    check_model_and_task(model, provider, feature_lengths)
    host_batch = _host_batch_size(batch_size)
    rules = axis_rules or axes.default_axis_rules()
    devices = jax.devices()[:num_devices] if num_devices else None
    mesh = mesh_lib.make_mesh(**dict(mesh_shape or {}), devices=devices)
    spec = optimizer or optimizers.adafactor()
    spec = optimizers.build_optimizer(spec, clip_grad_norm=clip_grad_norm, gradient_accumulation_steps=gradient_accumulation_steps)
    tx = spec.transform
    data_seed = seed if data_seed is None else data_seed

    def batches(split, lengths, num_epochs, shuffle):
        ds = pipeline.get_dataset(
            provider, split=split, feature_lengths=lengths, batch_size=host_batch, feature_converter=feature_converter,
            seed=data_seed, shuffle=shuffle, num_epochs=num_epochs)
        return pipeline.BatchIterator(ds)

    train_batches = batches("train", feature_lengths, None, shuffle)
    first = next(train_batches)  # fails here, before model_dir exists, if the pipeline cannot run

    os.makedirs(model_dir, exist_ok=True)
    is_host0 = jax.process_index() == 0

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        # ---- state: abstract -> shardings -> sharded init ---------------------------------
        abstract_vars = model.abstract_variables()
        p_shardings = sharding.param_shardings(abstract_vars, mesh, rules)
        abstract_params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sharding.unboxed(abstract_vars)["params"], p_shardings)
        o_shardings = sharding.opt_state_shardings(tx, abstract_params, p_shardings, mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        state_shardings = TrainState(step=replicated, params=p_shardings, opt_state=o_shardings)

        def init_state(rng):
            params = nn.unbox(model._init_variables(rng))["params"]
            return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

        abstract_state = jax.eval_shape(init_state, jax.random.key(seed))
        abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, state_shardings)

        checkpointer = checkpointing.Checkpointer(
            model_dir, save_interval_steps=checkpoint_every, keep_last=keep_last, keep_best=keep_best,
            best_metric=best_metric, best_mode="min" if best_metric == "eval/loss" else "max")
        restored = checkpointer.restore(abstract_state, data_iterator=train_batches)
        if restored is not None:
            state, start_step = restored
            # The restored position replaces the batch read to check the pipeline.
            first = None
            origin = f"resumed from step {start_step}"
        else:
            state = sharding.sharded_init(init_state, jax.random.key(seed), state_shardings)
            start_step = 0
            origin = "initialised from seed"
            if init_from:
                params = checkpointing.restore_params(init_from, abstract_params, param_map=param_map)
                opt_state = jax.jit(tx.init, out_shardings=o_shardings)(params)
                state = TrainState(step=state.step, params=params, opt_state=opt_state)
                origin = f"parameters from {init_from}"

        # ---- compiled steps -----------------------------------------------------------
        batch_sh = sharding.batch_sharding(mesh)
        step_fn = jax.jit(
            lambda s, b, r: train_step(model, tx, s, b, r),
            in_shardings=(state_shardings, batch_sh, replicated),
            out_shardings=(state_shardings, replicated),
            donate_argnums=(0,),
        )
        eval_fn = jax.jit(lambda p, b: eval_step(model, p, b), in_shardings=(p_shardings, batch_sh), out_shardings=replicated)
        rng = jax.random.key(seed + 1)
        # The batch for the next step; after a restore the pipeline's saved position replaces
        # the batch read above to check the data, so the stream continues where it stopped.
        host_next = first if first is not None else next(train_batches)
        pending = sharding.global_batch(host_next, mesh)
        compiled = step_fn.lower(state, pending, rng).compile()
        param_count = int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract_params)))
        summary = metrics_lib.summarize_start(
            mesh_description=mesh_lib.describe_mesh(mesh), param_count=param_count,
            compiled_memory_bytes=metrics_lib.compiled_memory_bytes(compiled))
        if is_host0:
            print(f"terra.train: {summary}; {origin}; {model_dir}", flush=True)
            with open(os.path.join(model_dir, "config.gin"), "w") as f:
                f.write(gin.operative_config_str())

        eval_batches = []  # the same unshuffled batches every evaluation: read them once

        def evaluate(params) -> Dict[str, float]:
            if not eval_batches:
                hosts = batches(eval_split, eval_feature_lengths or feature_lengths, 1, False)
                eval_batches.extend(sharding.global_batch(h, mesh) for h in itertools.islice(hosts, eval_steps))
            return evaluate_batches(eval_fn, params, eval_batches)

        rouge_set = []  # the fixed validation examples ROUGE is measured on: read once

        def rouge_scores(params) -> Dict[str, float]:
            from terra.evaluation import evaluator, summaries  # the evaluator imports this module

            lengths = eval_feature_lengths or feature_lengths
            if not rouge_set:
                rouge_set.extend(summaries.read_examples(provider, eval_split, lengths, rouge_examples))
            rouge, _ = evaluator.decode_and_score(
                model, params, rouge_set, provider.output_features["targets"].vocabulary, feature_lengths=lengths,
                batch_size=min(len(rouge_set), host_batch), max_decode_length=rouge_max_decode_length or lengths["targets"],
                bootstrap_samples=100)
            return {name: r["f1"] for name, r in rouge.items()}

        # ---- the loop -----------------------------------------------------------------
        writer = metrics_lib.MetricsWriter(model_dir, enabled=is_host0)
        bar = metrics_lib.ProgressBar(steps, initial_step=start_step, enabled=is_host0 and progress)
        last_train: Dict[str, float] = {}
        last_eval: Dict[str, float] = {}
        window = []
        unchecked = []  # steps whose finiteness the host has not looked at yet
        tokens = 0
        window_start = time.perf_counter()
        preempted = False
        step = start_step
        with _TermSignal() as term:
            while step < steps:
                tokens += pipeline.count_tokens(host_next)
                state, m = compiled(state, pending, rng)
                step += 1
                window.append(m)
                unchecked.append(m)
                evaluated = bool(eval_every and eval_steps and (step % eval_every == 0 or step == steps))
                # The host waits for the device only where it reads results anyway (logging,
                # evaluation, checkpoints), so steps stay asynchronous in between; a non-finite
                # step never changed the state, and nothing is saved after one.
                if (step % log_every == 0 or step % checkpoint_every == 0 or evaluated or step == steps
                        or term.received):
                    _raise_if_diverged(unchecked, step, model_dir, (writer, bar, checkpointer))
                    unchecked = []
                if step % log_every == 0 or step == steps:
                    elapsed = time.perf_counter() - window_start
                    loss = float(np.mean([float(x["loss"]) for x in window]))
                    last_train = {
                        "loss": loss,
                        "grad_norm": float(window[-1]["grad_norm"]),
                        "learning_rate": float(spec.schedule(step - 1)),
                        "steps_per_second": len(window) / elapsed,
                        "tokens_per_second": tokens * jax.process_count() / elapsed,
                    }
                    writer.write(step, last_train, prefix="train")
                    bar.update(step, loss, len(window) / elapsed)
                    window, tokens, window_start = [], 0, time.perf_counter()
                if evaluated:
                    last_eval = evaluate(state.params)
                    writer.write(step, last_eval, prefix="eval")
                scored = bool(rouge_every and (step % rouge_every == 0 or step == steps))
                if scored:
                    last_rouge = rouge_scores(state.params)
                    writer.write(step, last_rouge, prefix="eval")
                    last_eval = {**last_eval, **last_rouge}
                # Saved before the next batch is read: the stored data position is `step`.
                checkpointer.save(
                    step, state, data_iterator=train_batches, force=step == steps or term.received,
                    metrics={f"eval/{k}": v for k, v in last_eval.items()} if evaluated or scored else None)
                if term.received:
                    preempted = True
                    break
                if step < steps:
                    host_next = next(train_batches)
                    pending = sharding.global_batch(host_next, mesh)
        writer.close()
        bar.close()
        checkpointer.close()
    return TrainResult(step=step, params=state.params, last_train_metrics=last_train, last_eval_metrics=last_eval,
                       preempted=preempted, model_dir=model_dir)

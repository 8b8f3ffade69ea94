"""The trainer end to end on tiny models: sharded equivalence, resume after SIGKILL, SIGTERM,
fine-tuning, divergence, early failures, the written artifacts and multi-host."""

import contextlib
import gzip
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from terra.cli import reproduce as reproduce_cli
from terra.cli import train as train_cli
from terra.errors import ConfigError, UsageError
from terra.gin_config import parsing
from terra.training import checkpointing, trainer
from terra.training import metrics as metrics_lib

from helpers import REPO_ROOT, TINY_COPY_MODEL, xla_flags_with_devices

# A tiny encoder-decoder on the copy task (bytes vocabulary: nothing to train or download).
TINY = TINY_COPY_MODEL + [
    "TASK_FEATURE_LENGTHS = {'inputs': 24, 'targets': 24}",
    "terra.data.copy_dataset.train_length = 20",
    "terra.training.LoggingSettings.every = 1",
    "terra.training.EvaluationSettings.every = 0",
    "terra.training.LoggingSettings.progress = False",
]
FILES = ["models/tiny.gin", "tasks/synthetic_copy.gin", "runs/train.gin"]
# XLA's optimizations only cost compile time at this size; off in this process and in every
# subprocess, so that parameters compare exactly across them.
FAST_COMPILE_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
RUN_LOCK_FILE = os.path.join(REPO_ROOT, "terra", "training", "run_lock.py")


pytestmark = pytest.mark.usefixtures("fast_compile")


def _env(**extra):
    return dict(os.environ, **FAST_COMPILE_ENV, **extra)


def _bindings(model_dir, steps, *extra):
    return TINY + [f"MODEL_DIR = {str(model_dir)!r}", "BATCH_SIZE = 8", f"TRAIN_STEPS = {steps}", *extra]


def _parse(model_dir, steps, *extra):
    parsing.parse_gin(FILES, _bindings(model_dir, steps, *extra))


def _losses(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]


def _cli(model_dir, steps, *extra):
    args = [f"--gin_file={f}" for f in FILES] + [
        f"--gin.{b.replace(' = ', '=', 1)}" for b in _bindings(model_dir, steps, *extra)
    ]
    return [sys.executable, "-m", "terra.cli.train", *args]


def _assert_same_params(a, b, **tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol), a, b)


def _leaf(params, name):
    return [
        leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0] if name in jax.tree_util.keystr(path)
    ][0]


class Recorder(trainer.StepHook):
    """Records every ``before_step`` and ``after_step`` call, with the step's loss."""

    def __init__(self):
        self.calls = []

    def before_step(self, step, state):
        self.calls.append(("before", step, int(state.step)))
        return state

    def after_step(self, step, state, metrics):
        self.calls.append(("after", step, int(state.step), float(metrics["loss"])))


EVALUATE_EVERY_STEP = ("terra.training.EvaluationSettings.every = 1", "terra.training.EvaluationSettings.steps = 1")
# The module's 3-step run reads the training stream in order (unshuffled), as two processes that
# each read their shard in order do: test_two_processes_reach_the_same_loss_as_one compares them.
IN_ORDER = ("terra.training.Trainer.shuffle = False",)
THREE_STEPS = (*EVALUATE_EVERY_STEP, *IN_ORDER)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, fast_compile):
    """``(model_dir, TrainResult, the Recorder's calls)`` of one unshuffled 3-step run evaluated
    after every step, shared by the module (each test only reads it): the pretrained run of the
    fine-tuning tests, and the run the step-hook, direct-step and two-process tests check against."""
    model_dir = tmp_path_factory.mktemp("three") / "run"
    _parse(model_dir, 3, *THREE_STEPS)
    recorder = Recorder()
    result = trainer.Trainer(step_hooks=[recorder]).run()
    return model_dir, result, recorder.calls


SIX_STEPS = (
    "terra.training.CheckpointSettings.every = 3",
    "terra.training.EvaluationSettings.every = 6",
    "terra.training.EvaluationSettings.steps = 1",
)


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, fast_compile):
    """``(model_dir, TrainResult, what it printed)`` of one 6-step run saved every 3 steps and
    evaluated at the end, shared by the module: a test that changes it works on a copy."""
    model_dir = tmp_path_factory.mktemp("six") / "a"
    _parse(model_dir, 6, *SIX_STEPS)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = trainer.Trainer().run()
    return model_dir, result, printed.getvalue()


@pytest.mark.slow
@pytest.mark.multi_device
def test_a_4x2_mesh_gives_the_same_losses_as_one_device(tmp_path):
    assert len(jax.devices()) == 8
    _parse(tmp_path / "mesh", 4, "terra.training.ParallelSettings.mesh_shape = {'data': 4, 'model': 2}")
    sharded = trainer.Trainer().run()
    _parse(tmp_path / "one", 4, "terra.training.ParallelSettings.num_devices = 1")
    single = trainer.Trainer().run()
    np.testing.assert_allclose(_losses(tmp_path / "mesh"), _losses(tmp_path / "one"), rtol=1e-5)
    wi = _leaf(sharded.params, "wi")  # the feed-forward's d_ff axis is split over 'model'
    assert "model" in tuple(wi.sharding.spec) and wi.addressable_shards[0].data.shape != wi.shape
    _assert_same_params(sharded.params, single.params, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_abstract_state_is_the_traced_initial_states_shapes_without_tracing_the_model(tmp_path):
    _parse(tmp_path / "abstract", 1)
    built = trainer.Trainer()
    traced = jax.eval_shape(built._init_state, jax.random.key(0))
    abstract = built.abstract_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(traced)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(traced)
    ]
    shardings = jax.tree.leaves(built.state_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert [x.sharding for x in jax.tree.leaves(abstract)] == shardings


@pytest.mark.slow
def test_training_writes_metrics_events_checkpoints_and_a_reproducing_config(six_steps, tmp_path):
    run, first, out = six_steps
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert {"train/loss", "train/learning_rate", "train/tokens_per_second"} <= set(rows[0])
    assert {"eval/loss", "eval/token_accuracy", "eval/sequence_accuracy"} <= set(rows[-1])
    # Eval metrics reach the console too, with the values written to metrics.jsonl.
    printed = re.search(r"step 6 eval: loss ([0-9.]+), sequence_accuracy", out)
    assert printed and abs(float(printed.group(1)) - rows[-1]["eval/loss"]) < 1e-4
    assert any(name.startswith("events.out.tfevents") for _, _, names in os.walk(run / "tensorboard") for name in names)
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]
    # The written operative config alone reproduces the run.
    parsing.parse_gin(
        [str(run / "config.gin")],
        [f"MODEL_DIR = {str(tmp_path / 'b')!r}", f"terra.training.Trainer.model_dir = {str(tmp_path / 'b')!r}"],
    )
    second = trainer.Trainer().run()
    assert _losses(tmp_path / "b") == _losses(run)
    _assert_same_params(first.params, second.params, rtol=0, atol=0)


@pytest.mark.slow
def test_fine_tuning_starts_from_the_pretrained_parameters_with_a_fresh_optimizer(three_steps, tmp_path):
    pre, pretrained, _ = three_steps
    # Learning rate 0: after one step the parameters are still exactly the pretrained ones.
    _parse(
        tmp_path / "fine",
        1,
        f"INIT_FROM = {str(pre)!r}",
        "terra.training.Trainer.optimizer = @terra.training.sgd()",
        "terra.training.sgd.learning_rate = 0.0",
    )
    fine = trainer.Trainer().run()
    _assert_same_params(fine.params, pretrained.params, rtol=0, atol=0)
    assert fine.step == 1 and checkpointing.Checkpointer(str(tmp_path / "fine")).latest_step() == 1


@pytest.mark.slow
def test_a_non_finite_loss_stops_training_and_leaves_the_last_checkpoint(tmp_path):
    _parse(
        tmp_path / "nan",
        20,
        "terra.training.Trainer.optimizer = @terra.training.sgd()",
        "terra.training.sgd.learning_rate = 1e30",
        "terra.training.CheckpointSettings.every = 1",
    )
    with pytest.raises(trainer.TrainingDiverged, match="not finite") as error:
        trainer.Trainer().run()
    assert "intact" in str(error.value)
    ckpt = checkpointing.Checkpointer(str(tmp_path / "nan"))
    last = ckpt.latest_step()
    assert last is not None and last < 20
    with open(tmp_path / "nan" / "metrics.jsonl") as f:
        assert all(np.isfinite(row["train/loss"]) for row in map(json.loads, f) if row["step"] <= last)


def test_a_model_task_mismatch_fails_before_model_dir_is_written(tmp_path):
    _parse(tmp_path / "bad", 2, "TransformerConfig.vocab_size = 64")
    with pytest.raises(ConfigError, match="vocab_size = 259"):
        trainer.Trainer().run()
    assert not (tmp_path / "bad").exists()


def test_settings_groups_validate_their_values_before_anything_is_written(tmp_path):
    _parse(tmp_path / "bad", 2, "terra.training.CheckpointSettings.every = 0")
    with pytest.raises(ConfigError, match="CheckpointSettings.every=0"):
        trainer.Trainer().run()
    _parse(tmp_path / "bad", 2, "terra.training.CheckpointSettings.best_metric = 'eval/rougeLsum'")
    with pytest.raises(ConfigError, match="not a metric this run evaluates"):
        trainer.Trainer().run()
    # ROUGE scores summaries: the hook refuses the copy task.
    _parse(tmp_path / "bad", 2, "terra.training.EvaluationSettings.hooks = [@terra.evaluation.RougeEvaluation()]")
    with pytest.raises(ConfigError, match="RougeEvaluation scores summaries"):
        trainer.Trainer().run()
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_misspelled_binding_fails_before_model_dir_is_written(tmp_path):
    result = subprocess.run(
        _cli(tmp_path / "typo", 2, "terra.training.CheckpointSettings.evrey = 3"),
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "'every'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "typo").exists()


def _wait_for_checkpoint(model_dir, at_least, process, timeout=240):
    start = time.time()
    while time.time() - start < timeout:
        # Only list committed step folders: opening a Checkpointer here would clean up the
        # running trainer's in-progress save.
        folder = model_dir / "checkpoints"
        steps = [int(n) for n in os.listdir(folder) if n.isdigit()] if folder.exists() else []
        if steps and max(steps) >= at_least:
            return max(steps)
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")


@contextlib.contextmanager
def _sigterm_at_checkpoint(model_dir, at_least, timeout=240):
    """Sends this process SIGTERM, from a watching thread, once a checkpoint of step
    ``at_least`` or later is committed in ``model_dir``. A SIGTERM that arrives after the
    trainer's own handler is gone ends here rather than ending pytest."""
    stop, sent = threading.Event(), []

    def watch():
        start = time.time()
        while not stop.is_set() and time.time() - start < timeout:
            folder = model_dir / "checkpoints"
            steps = [int(n) for n in os.listdir(folder) if n.isdigit()] if folder.exists() else []
            if steps and max(steps) >= at_least:
                sent.append(max(steps))
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield sent
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_sigkill_then_sigterm_then_rerun_ends_with_the_uninterrupted_parameters(tmp_path, capsys):
    steps, run = 60, tmp_path / "run"
    extra = ("terra.training.CheckpointSettings.every = 5", "terra.training.LoggingSettings.every = 5")
    command = _cli(run, steps, *extra)
    first = subprocess.Popen(
        command, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed_after = _wait_for_checkpoint(run, 10, first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    # The same command again, from terra-train's console entry point in this process (one
    # process start less): SIGTERM reaches it as it reaches a preempted process, through the
    # trainer's handler, which saves the step and lets the command end with status 0.
    capsys.readouterr()
    with _sigterm_at_checkpoint(run, killed_after + 5) as sent:
        status = train_cli.main(command[3:])
    out = capsys.readouterr().out
    assert sent and status == 0 and "preempted" in out, out
    resumed_from = re.search(r"resumed from step (\d+)", out)
    assert resumed_from and int(resumed_from.group(1)) >= killed_after, out
    preempted_at = checkpointing.Checkpointer(str(run)).latest_step()
    assert killed_after < preempted_at < steps
    # The same run, resumed in this process, finishes where an uninterrupted one does.
    _parse(run, steps, *extra)
    resumed = trainer.Trainer().run()
    assert resumed.step == steps
    _parse(tmp_path / "straight", steps)  # saving every 5 steps changes no parameter
    straight = trainer.Trainer().run()
    _assert_same_params(resumed.params, straight.params, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_run_saved_from_python_continues_from_its_step_and_initialises_fine_tuning(three_steps, tmp_path, capsys):
    import terra

    model_dir, _, _ = three_steps  # the module's run, trained 3 steps
    run = terra.load(str(model_dir))
    saved = run.save(tmp_path / "saved")
    capsys.readouterr()
    _parse(saved, 5)
    continued = trainer.Trainer().run()
    out = capsys.readouterr().out
    assert continued.step == 5 and "parameters saved from Python at step 3 (a fresh optimizer" in out, out
    assert checkpointing.Checkpointer(saved).all_steps()[-1] == 5
    _parse(tmp_path / "tuned", 1, f"INIT_FROM = {saved!r}")
    tuned = trainer.Trainer().run()
    assert tuned.step == 1 and f"parameters from {saved}" in capsys.readouterr().out
    narrow = run.quantized("int8").save(tmp_path / "narrow")
    _parse(narrow, 5)
    with pytest.raises(ConfigError, match="holds int8 weights .* training updates float32 weights"):
        trainer.Trainer().run()


class _CtrlC:
    """A step hook that presses Ctrl-C (SIGINT to this process) ``times`` times after step ``at``."""

    def __init__(self, at, times=1):
        self.at, self.times = at, times

    def before_step(self, step, state):
        return state

    def after_step(self, step, state, metrics):
        if step == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_says_how_to_resume_and_a_second_one_stops_at_once(tmp_path, capsys):
    handler = signal.getsignal(signal.SIGINT)
    _parse(tmp_path / "run", 4, "terra.training.CheckpointSettings.every = 100")
    result = trainer.Trainer(step_hooks=[_CtrlC(at=2)]).run()
    assert (result.step, result.stopped_by) == (2, "SIGINT")
    assert checkpointing.Checkpointer(str(tmp_path / "run")).latest_step() == 2
    assert "\ntrain: Ctrl-C: saving a checkpoint when this step ends" in "\n" + capsys.readouterr().out
    line = train_cli.finish_line(result, ["experiments/pretrain_c4_dense.gin"])
    assert line.startswith("terra-train: interrupted at step 2, saved in ") and line.endswith("to resume from it.")
    _parse(tmp_path / "again", 4, "terra.training.CheckpointSettings.every = 100")
    with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C: at once, without saving
        trainer.Trainer(step_hooks=[_CtrlC(at=2, times=2)]).run()
    assert checkpointing.Checkpointer(str(tmp_path / "again")).latest_step() in (None, 0)
    assert signal.getsignal(signal.SIGINT) is handler


@pytest.mark.slow
def test_two_processes_reach_the_same_loss_as_one(three_steps, tmp_path):
    # The module's one-process run: the same 3 unshuffled steps (its evaluations leave the
    # training stream and the parameters as they are).
    single, _, _ = three_steps
    env = _env(XLA_FLAGS=xla_flags_with_devices(2), TERRA_LOG_DIR=str(tmp_path / "logs"))
    result = subprocess.run(
        [
            "bash",
            os.path.join(REPO_ROOT, "scripts", "launch_local_multihost.sh"),
            "2",
            *_cli(tmp_path / "multi", 3, *IN_ORDER)[3:],
        ],
        cwd=REPO_ROOT,
        env=dict(env, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "over 4 cpu devices, 2 processes" in result.stdout
    assert len(_losses(tmp_path / "multi")) == 3
    np.testing.assert_allclose(_losses(tmp_path / "multi"), _losses(single), rtol=1e-4)


@pytest.mark.slow
def test_train_speed_benchmark_reports_tokens_per_second_and_memory(tmp_path, capsys):
    from terra.cli import bench

    argv = [
        "train",
        "--out",
        str(tmp_path),
        "--small",
        "--steps",
        "1",
        "--batch_size",
        "2",
        "--inputs",
        "16",
        "--targets",
        "8",
        "--rows",
        "dense",
        "--rows",
        "terraformer",
    ]
    assert bench.call(argv) == 0
    rows = json.loads((tmp_path / "train_speed.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["tokens_per_second"] > 0 and np.isfinite(r["final_loss"]) for r in rows)
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once_and_a_finished_run_exits_without_compiling(six_steps, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(six_steps[0], run)  # the module's 6-step run, saved every 3 steps
    logged = {r["step"]: r["train/loss"] for r in metrics_lib.read_metrics(run) if "train/loss" in r}
    # A crash after step 6 was logged but before it was saved: the run resumes from step 3, with
    # a line cut short at the end of metrics.jsonl.
    shutil.rmtree(run / "checkpoints" / "6")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train/lo')
    _parse(run, 6, *SIX_STEPS)
    resumed = trainer.Trainer().run()
    replayed = [(r["step"], r["train/loss"]) for r in metrics_lib.read_metrics(run) if "train/loss" in r]
    assert [step for step, _ in replayed] == [1, 2, 3, 4, 5, 6]
    assert dict(replayed) == pytest.approx(logged, rel=1e-6)  # the replayed steps are the same steps
    # Run again: already at TRAIN_STEPS, so it returns at once, compiling nothing.
    _parse(run, 6, *SIX_STEPS)
    again = trainer.Trainer()
    finished = again.run()
    assert finished.step == 6 and again.compiled_step is None
    assert "already at step 6" in capsys.readouterr().out
    _assert_same_params(finished.params, resumed.params, rtol=0, atol=0)


@pytest.mark.slow
def test_fine_tuning_from_a_run_of_another_architecture_writes_nothing(three_steps, tmp_path):
    pre, _, _ = three_steps
    _parse(tmp_path / "fine", 1, f"INIT_FROM = {str(pre)!r}", "TransformerConfig.d_ff = 96")
    with pytest.raises(checkpointing.CheckpointError, match="d_ff|shape"):
        trainer.Trainer().run()
    assert not (tmp_path / "fine").exists()  # no checkpoints/, no lock, nothing


@pytest.mark.slow
def test_a_second_trainer_on_a_locked_model_dir_stops_and_a_killed_ones_lock_is_taken_over(tmp_path):
    run = tmp_path / "locked"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # The library's RunLock, loaded from its file: the terra.training package would
            # import JAX first (seconds) for nothing this process does.
            "import importlib.util, time\n"
            f"spec = importlib.util.spec_from_file_location('run_lock', {RUN_LOCK_FILE!r})\n"
            "run_lock = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(run_lock)\n"
            f"run_lock.RunLock({str(run)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(120)\n",
        ],
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        _parse(run, 2)
        with pytest.raises(ConfigError, match=rf"in use by another trainer \(host .*, pid {holder.pid}"):
            trainer.Trainer().run()
        assert sorted(os.listdir(run)) == [".terra.lock"]  # stopped before writing anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The killed holder's lock is released with its process: the next trainer takes it over.
    _parse(run, 2)
    assert trainer.Trainer().run().step == 2


@pytest.mark.slow
def test_a_run_on_shards_without_text_exits_2_naming_them_before_model_dir_is_written(tmp_path, capsys):
    # terra-train's exit status and error line, from its console entry point in this process
    # (the process boundary is not the subject: no subprocess, no second TensorFlow import).
    shards = tmp_path / "c4" / "en"
    shards.mkdir(parents=True)
    with gzip.open(shards / "c4-train.00000-of-00001.json.gz", "wt") as f:
        f.writelines(json.dumps({"url": f"https://example.com/{i}"}) + "\n" for i in range(50))
    files = ["models/tiny.gin", "tasks/c4_lm.gin", "runs/train.gin"]
    bindings = _bindings(tmp_path / "run", 2, "TransformerConfig.vocab_size = 4224")
    bindings = [b for b in bindings if not b.startswith("terra.data.copy_dataset")]
    status = train_cli.main(
        [f"--gin_file={f}" for f in files]
        + [f"--gin.{b.replace(' = ', '=', 1)}" for b in bindings]
        + [f"--c4_json={tmp_path / 'c4'}"]
    )
    stderr = capsys.readouterr().err
    assert status == 2, stderr[-2000:]
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "no full batch" in error[0], stderr[-2000:]
    assert re.search(r"used 0 records, skipped (\d+) \(\1 no 'text' field\)", error[0])
    assert "c4-train.00000-of-00001.json.gz" in error[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.multi_device  # the 2x2 layout
def test_terra_reproduce_layouts_measures_each_layouts_difference_per_step(tmp_path):
    from terra.reproduce import layouts

    bindings = [b for b in _bindings(tmp_path, 2) if not b.startswith(("MODEL_DIR", "TRAIN_STEPS"))]
    table = layouts.compare(FILES, bindings, steps=2, layouts=[(2, 2)], perturb=True)
    assert len(table["loss"]) == 2 and set(table) == {"loss", "2x2", layouts.ONE_ULP}
    for loss_difference, params_difference in table["2x2"]:
        assert loss_difference < 1e-5 and params_difference < 1e-5  # rounding only
    assert table[layouts.ONE_ULP][0][1] > 0  # the perturbed run did move
    assert "2x2" in layouts.format_table(table).splitlines()[1]
    with pytest.raises(ConfigError, match="need 64 devices"):
        layouts.compare(FILES, bindings, steps=1, layouts=[(8, 8)])
    with pytest.raises(UsageError, match="--layouts=8y1"):
        reproduce_cli.call(["layouts", "--layouts=8y1"])


@pytest.mark.slow
def test_step_hooks_run_around_every_step_in_order_and_see_its_metrics(three_steps):
    model_dir, _, calls = three_steps  # the module's 3-step run, a Recorder among its step hooks
    assert [c[:3] for c in calls] == [
        ("before", 0, 0),
        ("after", 1, 1),
        ("before", 1, 1),
        ("after", 2, 2),
        ("before", 2, 2),
        ("after", 3, 3),
    ]
    losses = [c[3] for c in calls if c[0] == "after"]
    np.testing.assert_allclose(losses, _losses(model_dir), rtol=1e-6)


@pytest.mark.slow
def test_a_trainer_steps_evaluates_and_saves_without_run_and_writes_only_when_it_saves(three_steps, tmp_path):
    _parse(tmp_path / "direct", 2, *THREE_STEPS)
    built = trainer.Trainer()
    state = built.init_state()
    batch = built.global_batch(next(built.batches("train", built.feature_lengths, None, built.shuffle)))
    state, metrics = built.step(state, batch)
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
    results = built.evaluate(state.params, 1)
    assert {"loss", "token_accuracy", "sequence_accuracy"} <= set(results)
    assert not (tmp_path / "direct").exists()  # building, stepping and evaluating write nothing
    assert built.save(1, state)
    built.close()
    assert checkpointing.Checkpointer(str(tmp_path / "direct")).latest_step() == 1
    # The step it ran is the first step of the module's run, which evaluates after every step:
    # the same batch, key and loss, and the same evaluation of the parameters it leaves.
    ran, _, _ = three_steps
    np.testing.assert_allclose(float(metrics["loss"]), _losses(ran)[0], rtol=1e-6)
    first_eval = [r for r in metrics_lib.read_metrics(ran) if r["step"] == 1 and "eval/loss" in r]
    assert results == pytest.approx({k[len("eval/") :]: v for k, v in first_eval[0].items() if k != "step"}, rel=1e-5)

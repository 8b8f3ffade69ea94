"""Checkpointer: sharded round trip, retention, corruption fallback, data position, fine-tuning init."""

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf

from terra.data.pipeline import BatchIterator
from terra.training.checkpointing import Checkpointer, CheckpointError, restore_params, short_cause
from terra.training.train_state import TrainState


@pytest.fixture(scope="module")
def mesh():
    # Up to four devices (four in the multi_device session): the test arrays' sharded dimensions
    # (8 and 4) divide by any of 1, 2 or 4.
    devices = np.array(jax.devices()[:4])
    return jax.sharding.Mesh(devices.reshape(len(devices)), ("data",))


def _shardings(mesh):
    # 'w' is split along its first axis over the mesh; everything else is replicated.
    return {
        "w": jax.sharding.NamedSharding(mesh, jax.P("data", None)),
        "b": jax.sharding.NamedSharding(mesh, jax.P()),
    }


def make_state(mesh, seed=0, step=0):
    rng = np.random.default_rng(seed)
    shard = _shardings(mesh)
    params = {
        "w": jax.device_put(jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), shard["w"]),
        "b": jax.device_put(jnp.asarray(rng.normal(size=(4,)), jnp.float32), shard["b"]),
    }
    return TrainState(step=jnp.int32(step), params=params, opt_state=optax.adam(1e-3).init(params))


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def batches():
    return BatchIterator(tf.data.Dataset.range(100).batch(2))


@pytest.mark.multi_device
@pytest.mark.slow  # 8-way programs, in make test's multi_device session
def test_save_and_restore_round_trips_state_with_shardings(tmp_path, mesh):
    assert mesh.size == 4, "a state split over four devices"
    state = make_state(mesh, seed=1, step=7)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        assert ckpt.save(7, state)
        assert ckpt.latest_step() == 7 and ckpt.all_steps() == [7]
    assert (tmp_path / "checkpoints" / "7" / "state").is_dir()
    assert (tmp_path / "checkpoints" / "7" / "_CHECKPOINT_METADATA").is_file()

    # A fresh Checkpointer (a restarted job) restores onto the target's shardings.
    with Checkpointer(str(tmp_path)) as ckpt:
        restored, step = ckpt.restore(abstract_of(state))
    assert step == 7
    assert isinstance(restored, TrainState)
    assert_trees_equal(restored, state)
    assert restored.params["w"].sharding == _shardings(mesh)["w"]
    assert restored.opt_state[0].mu["w"].sharding.spec == jax.P("data", None)


def test_restore_returns_none_for_a_fresh_directory(tmp_path, mesh):
    with Checkpointer(str(tmp_path / "new_run")) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.all_steps() == []
        assert ckpt.restore(abstract_of(make_state(mesh))) is None


def test_keeps_the_last_n_plus_the_best(tmp_path, mesh):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.5, 6: 2.7}  # step 2 is the best
    state = make_state(mesh)
    with Checkpointer(
        str(tmp_path),
        save_interval_steps=1,
        keep_last=2,
        keep_best=1,
        best_metric="eval/loss",
        best_mode="min",
    ) as ckpt:
        for step, loss in losses.items():
            assert ckpt.save(step, state, metrics={"eval/loss": np.float32(loss), "train/loss": 9.0})
        assert ckpt.all_steps() == [2, 5, 6]
        assert ckpt.best_step() == 2
    on_disk = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert on_disk == [2, 5, 6]

    # The metrics are stored with the steps, so a restarted job still knows step 2 is best.
    with Checkpointer(str(tmp_path), save_interval_steps=1, keep_last=2, keep_best=1, best_metric="eval/loss") as ckpt:
        ckpt.save(7, state, metrics={"eval/loss": 3.5})
        assert ckpt.all_steps() == [2, 6, 7]


# When one array read fails, orbax stops waiting for the others. TensorStore then completes those
# reads on a closed asyncio loop and prints "Event loop is closed". That noise comes from orbax,
# not from terra.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_latest_checkpoint_is_skipped_with_a_warning(tmp_path, mesh, caplog):
    good, newer = make_state(mesh, seed=1, step=1), make_state(mesh, seed=2, step=2)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        ckpt.save(1, good)
        ckpt.save(2, newer)
    # Damage after the commit: truncate the array database of step 2.
    manifest = tmp_path / "checkpoints" / "2" / "state" / "manifest.ocdbt"
    data = manifest.read_bytes()
    manifest.write_bytes(data[: len(data) // 2])

    with caplog.at_level(logging.WARNING, logger="terra.training.checkpointing"):
        with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
            restored, step = ckpt.restore(abstract_of(good))
            assert step == 1
            assert_trees_equal(restored, good)
            # The damaged step is set aside, so training can save step 2 again.
            assert ckpt.all_steps() == [1]
            assert ckpt.save(2, newer)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("step 2" in m and "corrupt" in m for m in messages), messages
    # One readable line: the step, its directory and the first line of the cause.
    (warning,) = [m for m in messages if "corrupt or incomplete" in m]
    assert "\n" not in warning and len(warning) < 500 and str(tmp_path / "checkpoints" / "2") in warning
    assert len(os.listdir(tmp_path / "corrupt_checkpoints")) == 1


def test_short_cause_keeps_the_first_line_of_a_long_storage_error():
    error = ValueError('DATA_LOSS: Error reading "manifest.ocdbt"\n' + "  [source locations] x.cc:1\n" * 60)
    assert short_cause(error) == 'ValueError: DATA_LOSS: Error reading "manifest.ocdbt"'
    assert len(short_cause(RuntimeError("y" * 1000))) < 260 and short_cause(OSError()) == "OSError"


def test_a_step_without_commit_metadata_is_skipped_and_none_good_raises(tmp_path, mesh, caplog):
    state = make_state(mesh)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    (tmp_path / "checkpoints" / "2" / "_CHECKPOINT_METADATA").unlink()
    with caplog.at_level(logging.WARNING, logger="terra.training.checkpointing"):
        with Checkpointer(str(tmp_path)) as ckpt:
            assert ckpt.restore(abstract_of(state))[1] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 2" in m and "_CHECKPOINT_METADATA" in m for m in messages), messages

    (tmp_path / "checkpoints" / "1" / "state" / "_METADATA").write_text("{not json")
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(CheckpointError, match="no readable checkpoint.*step 1"):
            ckpt.restore(abstract_of(state))
        assert ckpt.all_steps() == [1]  # with no good step to fall back to, nothing is moved


def test_an_interrupted_save_is_never_the_latest_checkpoint(tmp_path, mesh):
    state = make_state(mesh, seed=1, step=1)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        ckpt.save(1, state)
    # A crash before orbax's commit (the rename) leaves a temporary directory, even a full one.
    leftover = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(tmp_path / "checkpoints" / "1", leftover)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.restore(abstract_of(state))[1] == 1
        assert ckpt.save(2, make_state(mesh, seed=2, step=2))
        assert ckpt.all_steps() == [1, 2]
    assert not leftover.exists()


def test_data_iterator_position_is_restored_with_the_state(tmp_path, mesh):
    state = make_state(mesh)
    it = batches()
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        for step in (1, 2, 3):
            next(it)
            ckpt.save(step, state, data_iterator=it)
    expected_next = next(it)  # what the run would have read after step 3
    np.testing.assert_array_equal(expected_next, [6, 7])
    assert (tmp_path / "checkpoints" / "3" / "input_state" / "state-p0.index").is_file()

    resumed = batches()
    with Checkpointer(str(tmp_path)) as ckpt:
        _, step = ckpt.restore(abstract_of(state), data_iterator=resumed)
    assert step == 3
    np.testing.assert_array_equal(next(resumed), expected_next)

    # An older step restores the older position: the position lives with its step.
    older = batches()
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.restore(abstract_of(state), data_iterator=older, step=1)
    np.testing.assert_array_equal(next(older), [2, 3])


def test_restore_params_loads_only_parameters_by_value(tmp_path, mesh):
    source = make_state(mesh, seed=3, step=5)
    with Checkpointer(str(tmp_path / "pretrain"), save_interval_steps=1) as ckpt:
        ckpt.save(5, source)
        ckpt.save(6, make_state(mesh, seed=4, step=6))
    # The fine-tuning target shards 'w' differently: the loaded arrays take the target's sharding.
    target_sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "data"))
    abstract = {
        "w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=target_sharding),
        "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=_shardings(mesh)["b"]),
    }
    run = tmp_path / "pretrain"
    for where in (run, run / "checkpoints", run / "checkpoints" / "5"):  # every accepted spelling
        params = restore_params(str(where), abstract, step=5)
        assert set(params) == {"w", "b"}
        assert_trees_equal(params, source.params)
        assert params["w"].sharding == target_sharding
    latest = restore_params(str(tmp_path / "pretrain"), abstract)
    assert_trees_equal(latest, make_state(mesh, seed=4).params)

    # param_map maps between compatible trees (here: the target nests the parameters).
    nested = {"dense": abstract}
    mapped = restore_params(str(tmp_path / "pretrain"), nested, step=5, param_map=lambda p: {"dense": p})
    assert_trees_equal(mapped["dense"], source.params)
    assert mapped["dense"]["w"].sharding == target_sharding


def test_restore_params_reports_a_shape_mismatch(tmp_path, mesh):
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        ckpt.save(1, make_state(mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.P())
    abstract = {
        "w": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=replicated),
        "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=replicated),
    }
    with pytest.raises(CheckpointError, match=r"'w'.*checkpoint shape \(8, 4\), target shape \(8, 6\)"):
        restore_params(str(tmp_path), abstract)
    with pytest.raises(CheckpointError, match="no entry 'extra'"):
        w = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=replicated)
        restore_params(str(tmp_path), {"w": w, "b": abstract["b"], "extra": abstract["b"]})
    # The full-state restore checks the same way and names the path.
    wrong_state = abstract_of(make_state(mesh))
    wrong_b = jax.ShapeDtypeStruct((5,), jnp.float32, sharding=replicated)
    wrong_state = wrong_state.replace(params={**wrong_state.params, "b": wrong_b})
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(CheckpointError, match=r"'params/b'.*\(4,\).*\(5,\)"):
            ckpt.restore(wrong_state)
        assert ckpt.all_steps() == [1]  # a mismatch in the target never sets a checkpoint aside


def test_save_only_at_the_interval_unless_forced(tmp_path, mesh):
    state = make_state(mesh)
    with Checkpointer(str(tmp_path), save_interval_steps=5, keep_last=None) as ckpt:
        saved = [step for step in range(1, 12) if ckpt.save(step, state)]
        assert saved == [5, 10]
        assert ckpt.save(12, state, force=True)
        assert not ckpt.save(12, state)  # already there
        assert ckpt.all_steps() == [5, 10, 12]


def test_a_relative_model_dir_is_accepted(tmp_path, mesh, monkeypatch):
    # `--gin.MODEL_DIR="'runs/x'"` is the common spelling; orbax itself needs absolute paths.
    monkeypatch.chdir(tmp_path)
    state = make_state(mesh, seed=3, step=1)
    with Checkpointer("runs/x", save_interval_steps=1) as ckpt:
        assert ckpt.save(1, state, force=True)
    assert (tmp_path / "runs" / "x" / "checkpoints" / "1").is_dir()
    with Checkpointer("runs/x") as ckpt:
        restored, step = ckpt.restore(abstract_of(state))
    assert step == 1
    assert_trees_equal(restored.params, state.params)
    assert_trees_equal(restore_params("runs/x", abstract_of(state).params), state.params)


def test_a_full_disk_during_a_save_is_one_storage_error_and_the_last_checkpoint_stays(tmp_path, mesh, monkeypatch):
    import errno
    import logging as std_logging

    from terra.errors import StorageError
    from terra.training import checkpointing

    state = make_state(mesh, seed=1, step=1)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        assert ckpt.save(1, state)

        def full(*args, **kwargs):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as cause:
                raise ValueError("orbax: writing the state failed") from cause

        monkeypatch.setattr(ckpt._manager, "save", full)
        with pytest.raises(StorageError) as error:
            ckpt.save(2, make_state(mesh, seed=2, step=2))
        assert str(error.value) == (
            f"cannot save step 2 under {tmp_path}: no space left on the device. Free space or make the folder "
            "writable, then rerun the same command to resume (step 1, the last complete checkpoint, is intact)."
        )
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore(abstract_of(state))[1] == 1
    # orbax's threads log the same error with its traceback first: that record is dropped.
    record = std_logging.LogRecord("absl", std_logging.ERROR, "", 0, "thread raised", (), None)
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        import sys

        record.exc_info = sys.exc_info()
    assert not checkpointing._DropStorageTracebacks().filter(record)
    assert checkpointing._DropStorageTracebacks().filter(std_logging.LogRecord("absl", 40, "", 0, "other", (), None))


def test_a_step_deleted_while_it_is_read_is_one_line_saying_so(tmp_path, mesh, monkeypatch):
    from terra.training import checkpointing

    state = make_state(mesh, seed=1, step=3)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        ckpt.save(3, state)
    step_dir = tmp_path / "checkpoints" / "3"
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)

    def pruned_while_reading(path):
        shutil.rmtree(step_dir)  # the training run's keep_last removes the step under the reader
        raise ValueError('NOT_FOUND: Error opening "zarr" driver:\n  ...\n  (60 more lines of TensorStore status)')

    monkeypatch.setattr(checkpointing, "_read_tree_metadata", pruned_while_reading)
    with pytest.raises(CheckpointError) as error:
        restore_params(str(tmp_path), abstract)
    assert str(error.value).startswith(f"checkpoint {step_dir} was deleted while it was read") and (
        "\n" not in str(error.value) and "--step" in str(error.value)
    )


def test_an_unreadable_step_is_one_line_with_the_first_line_of_the_cause(tmp_path, mesh, monkeypatch):
    from terra.training import checkpointing

    state = make_state(mesh, seed=1, step=3)
    with Checkpointer(str(tmp_path), save_interval_steps=1) as ckpt:
        ckpt.save(3, state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)

    def damaged(path):
        raise ValueError("DATA_LOSS: bad manifest\n  at tensorstore/kvstore/ocdbt/...\n  (more lines)")

    monkeypatch.setattr(checkpointing, "_read_tree_metadata", damaged)
    with pytest.raises(CheckpointError) as error:
        restore_params(str(tmp_path), abstract)
    assert str(error.value) == (
        f"checkpoint {tmp_path / 'checkpoints' / '3'} is unreadable: ValueError: DATA_LOSS: bad manifest"
    )

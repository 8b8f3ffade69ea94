"""Every parallel layout trains the same model (docs/training.md, "Parallel layouts train the same
model").

A Scaling Transformer with every random draw of a train step switched on (dropout everywhere, the
sparse feed-forward controller's Gumbel noise and straight-through coin, random position offsets)
trains for a few steps with the trainer's step function (terra.training.train_step, Adafactor)
on one device, on the 8x1, 4x2 and 2x4 ``data x model`` meshes of the eight forced CPU devices
(tests/conftest.py) and in two processes joined through gloo (which first check that they form one
mesh, feeding one global batch). The random draws are the same bits
on every layout (threefry keys are ``fold_in(seed, step)`` then Flax's per-module folds, and the
bits of a draw depend only on the key and the global shape, not on how the result is sharded);
the rest differs only by the order of float reductions, a few ulps per step.

This module must not import conftest: the gloo workers import it, and conftest forces eight
devices per process.
"""

import functools
import os
import socket
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from terra.layers import SparseFeedForward, SparseQKVAttention
from terra.layers.axes import default_axis_rules
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer, TransformerConfig
from terra.parallel.mesh import make_mesh
from terra.parallel.sharding import batch_sharding, global_batch, opt_state_shardings, param_shardings
from terra.training import adafactor
from terra.training.train_state import TrainState
from terra.training.train_step import train_step

from helpers import xla_flags_with_devices

LAYOUTS = [(8, 1), (4, 2), (2, 4)]
STEPS = 3
BATCH, INPUT_LENGTH, TARGET_LENGTH = 8, 16, 12
SEED = 1
TX = adafactor()  # the trainer's default: the reference's Adafactor, lr 0.01 for 10k steps
# Loss and parameter agreement after STEPS steps. Measured: <= 5e-7 relative (a few float32
# ulps); another seed moves the loss by 1-3% (checked below).
RTOL = 1e-5
# A key bias has an exactly zero gradient (softmax ignores a shift shared by every key), so its
# computed gradient is rounding noise (~1e-9) whose sign follows the reduction order. Adafactor
# normalises each element's update to at most 1, then scales it by the learning rate (0.01, the
# default rsqrt schedule's plateau) and by max(epsilon2 = 1e-3, RMS(param)) (docs/training.md,
# "Parallel layouts train the same model"): two layouts can move such a zero-initialised
# parameter apart by at most 2 * STEPS * lr * epsilon2.
PARAM_ATOL = 2 * STEPS * 0.01 * 1e-3


def equivalence_model() -> EncoderDecoderModel:
    """A one-layer Scaling Transformer whose training step draws every kind of randomness terra
    has: dropout (embeddings, residuals, attention probabilities, the feed-forward block), the
    controller's Gumbel noise and straight-through coin (paper §3.1), random position offsets."""
    config = TransformerConfig(
        vocab_size=64,  # divisible by model=2 and 4, so the logits' vocabulary axis is sharded
        d_model=32,
        d_ff=64,
        n_heads=4,
        n_encoder_layers=1,
        n_decoder_layers=1,
        max_len=32,
        dropout=0.1,
        ff_dropout=0.1,
        attention_dropout=0.1,
        position_start_from_zero_prob=0.5,
        position_max_offset=8,
    )
    module = EncoderDecoderTransformer(
        config,
        feed_forward=functools.partial(SparseFeedForward, ff_sparsity=16, quant_prob=0.5),
        decoder_self_attention=functools.partial(SparseQKVAttention, attention_sparsity=4),
    )
    return EncoderDecoderModel(module)


def host_batches(process_index: int = 0, process_count: int = 1) -> List[Dict[str, np.ndarray]]:
    """``STEPS`` global batches (with padding), each cut to this process's rows."""
    rng = np.random.default_rng(0)
    rows = BATCH // process_count
    batches = []
    for _ in range(STEPS):
        inputs = rng.integers(2, 64, (BATCH, INPUT_LENGTH), dtype=np.int32)
        targets = rng.integers(2, 64, (BATCH, TARGET_LENGTH), dtype=np.int32)
        inputs[::3, -4:] = 0
        targets[::2, -3:] = 0
        mine = slice(process_index * rows, (process_index + 1) * rows)
        batches.append({"encoder_input_tokens": inputs[mine], "decoder_target_tokens": targets[mine]})
    return batches


def _state_shardings(model, tx, mesh) -> TrainState:
    """The trainer's state layout: parameters by their logical names, optimizer state derived."""
    p_shardings = param_shardings(model.abstract_variables(), mesh)
    o_shardings = opt_state_shardings(tx, model.abstract_variables()["params"], p_shardings, mesh)
    return TrainState(step=NamedSharding(mesh, P()), params=p_shardings, opt_state=o_shardings)


def _init_fn(model, tx):
    """``rng -> TrainState`` as the trainer builds it: unboxed parameters, fresh optimizer state."""

    def init(rng) -> TrainState:
        params = nn.unbox(model.init_variables(rng))["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return init


@functools.lru_cache(maxsize=1)
def initial_state(model) -> TrainState:
    """The initial state as host arrays, computed once per process (the gloo workers read the
    test process's) and placed on each mesh with ``_placed``; sharded initialisation gives the
    same values (tests/test_parallel.py)."""
    return jax.device_get(jax.jit(_init_fn(model, TX.transform))(jax.random.key(0)))


def initial_state_structure(model):
    """The tree structure of ``initial_state(model)``, without computing it."""
    return jax.tree.structure(jax.eval_shape(_init_fn(model, TX.transform), jax.random.key(0)))


def _placed(host_tree, shardings):
    """``host_tree`` as global arrays with ``shardings``; each process fills its own shards."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda index: np.asarray(x)[index]),
        host_tree,
        shardings,
    )


def _first_step_draws(model, params, batch, rng):
    """The first step's training forward pass: dropout-masked logits and the controller's choices
    (Gumbel argmax), which differ by O(0.1) and in whole indices if any draw differed."""
    logits, variables = model.module.apply(
        {"params": params},
        batch["encoder_input_tokens"],
        model.decoder_input_tokens(batch),
        deterministic=False,
        rngs={"dropout": jax.random.fold_in(rng, 0)},  # train_step's key at step 0
        mutable=["intermediates"],
    )
    return logits, variables["intermediates"]


Run = Tuple[List[float], dict, tuple]


def train(model, mesh, batches: Sequence[Dict[str, np.ndarray]], rngs: Sequence[jax.Array], initial=None) -> List[Run]:
    """For each key in ``rngs``: ``(losses, final params, first-step draws)`` of ``len(batches)``
    train steps on ``mesh`` from ``initial`` (default ``initial_state(model)``), compiled once as
    the trainer compiles its step; values are gathered from every process."""
    tx = TX.transform
    if initial is None:
        initial = initial_state(model)  # outside the mesh: computed on one device
    runs = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(default_axis_rules()):
        shardings = _state_shardings(model, tx, mesh)
        replicated = shardings.step
        draws = jax.jit(functools.partial(_first_step_draws, model), out_shardings=replicated)
        step = jax.jit(
            functools.partial(train_step, model, tx),
            in_shardings=(shardings, batch_sharding(mesh), replicated),
            out_shardings=(shardings, replicated),
            donate_argnums=(0,),
        )
        for rng in rngs:
            state = _placed(initial, shardings)
            first = jax.device_get(draws(state.params, global_batch(batches[0], mesh), rng))
            losses = []
            for rows in batches:
                state, metrics = step(state, global_batch(rows, mesh), rng)
                losses.append(float(metrics["loss"]))
            runs.append((losses, multihost_utils.process_allgather(state.params, tiled=True), first))
    return runs


def _relative_distance(a, b) -> float:
    """``|a - b| / |b|`` over all leaves together (float64)."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    num = sum(np.sum((np.float64(x) - np.float64(y)) ** 2) for x, y in pairs)
    return float(np.sqrt(num / sum(np.sum(np.float64(y) ** 2) for _, y in pairs)))


def assert_same_training(run, reference) -> None:
    """Same per-step losses and parameters (to rounding), and the same first-step draws."""
    losses, params, (logits, intermediates) = run
    ref_losses, ref_params, (ref_logits, ref_intermediates) = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert _relative_distance(params, ref_params) < RTOL
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL, atol=PARAM_ATOL), params, ref_params)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=RTOL)
    jax.tree.map(np.testing.assert_array_equal, intermediates, ref_intermediates)


# ----- one process, several meshes ------------------------------------------------------------

# The 8x1, 4x2 and 2x4 meshes need eight devices: make test's multi_device session (conftest); each
# test trains.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.multi_device, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(fast_compile):
    return equivalence_model()


@pytest.fixture(scope="module")
def one_device_runs(model):
    """The reference on a single device, and the same steps with another seed."""
    mesh = make_mesh(data=1, model=1, devices=jax.devices()[:1])
    return train(model, mesh, host_batches(), [jax.random.key(SEED), jax.random.key(SEED + 1)])


@pytest.fixture(scope="module")
def one_device(one_device_runs):
    return one_device_runs[0]


def test_the_equivalence_model_draws_random_numbers_that_change_the_loss(one_device_runs):
    # Otherwise the layouts could agree because nothing random happens: another seed changes
    # the first loss well beyond RTOL, and the controller's choices.
    (ref_losses, _, (_, ref_intermediates)), (losses, _, (_, intermediates)) = one_device_runs
    assert abs(losses[0] - ref_losses[0]) > 1e-3 * ref_losses[0]
    chosen, ref_chosen = jax.tree.leaves(intermediates), jax.tree.leaves(ref_intermediates)
    assert any(np.any(a != b) for a, b in zip(chosen, ref_chosen))


@pytest.mark.parametrize("data, model_axis", LAYOUTS, ids=[f"{d}x{m}" for d, m in LAYOUTS])
def test_every_mesh_layout_trains_the_same_model_as_one_device(model, one_device, data, model_axis):
    # tests/conftest.py forces 8 CPU devices; fewer means the layouts were not tested at all.
    assert len(jax.devices()) >= data * model_axis, f"{data}x{model_axis} needs {data * model_axis} devices"
    mesh = make_mesh(data=data, model=model_axis, devices=jax.devices()[: data * model_axis])
    (run,) = train(model, mesh, host_batches(), [jax.random.key(SEED)])
    assert_same_training(run, one_device)


def _draws(key):
    """Draws of the kinds the layers make: a dropout mask, Gumbel noise, and normal bits from an
    'rbg' key (LSH attention's random rotations, terra/layers/lsh_hashing.py)."""
    mask_key, gumbel_key, rbg_seed = jax.random.split(key, 3)
    rbg_key = jax.random.wrap_key_data(jnp.tile(jax.random.key_data(rbg_seed), 2), impl="rbg")
    shape = (8, 4, 16)
    return (
        jax.random.bernoulli(mask_key, 0.9, shape),
        jax.random.gumbel(gumbel_key, shape),
        jax.random.normal(rbg_key, shape),
    )


@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "not_partitionable"])
def test_random_bits_do_not_depend_on_how_the_result_is_sharded(partitionable):
    # jax_threefry_partitionable (True by default in JAX 0.10.2) changes which bits a key gives
    # and whether a sharded draw is computed in pieces or whole and all-gathered; under either
    # setting every layout gets the bits of the unsharded draw.
    with jax.threefry_partitionable(partitionable):
        key = jax.random.key(SEED)
        expected = jax.device_get(jax.jit(_draws)(key))
        for data, model_axis in LAYOUTS + [(1, 8)]:
            if data * model_axis > len(jax.devices()):
                continue
            mesh = make_mesh(data=data, model=model_axis, devices=jax.devices()[: data * model_axis])
            sharded = NamedSharding(mesh, P("data", None, "model"))
            got = jax.jit(_draws, out_shardings=(sharded,) * 3)(key)
            for a, b in zip(jax.device_get(got), expected):
                np.testing.assert_array_equal(a, b)


# ----- two processes joined through gloo ------------------------------------------------------

_WORKER = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
from terra.parallel.mesh import initialize_distributed
initialize_distributed()  # from TERRA_COORDINATOR / TERRA_NUM_PROCESSES / TERRA_PROCESS_ID
initialize_distributed()  # a second call is a no-op
import jax
import jax.numpy as jnp
import numpy as np
sys.path.insert(0, os.environ["TERRA_TESTS_DIR"])
import test_parallel_equivalence as case
from terra.parallel.mesh import describe_mesh, make_mesh
from terra.parallel.sharding import global_batch
# The processes form one mesh: each feeds two rows of its own, and a jitted sum sees all four.
inferred = make_mesh(data=-1, model=2)
rows = {"x": np.full((2, 3), jax.process_index() + 1, np.float32)}
batch = global_batch(rows, inferred)
total = jax.jit(lambda b: jnp.sum(b["x"]), out_shardings=jax.sharding.NamedSharding(inferred, jax.P()))(batch)
# A file, not stdout: gloo's own threads print to stdout mid-line.
with open(os.environ["TERRA_TEST_RESULT"] + f".mesh{jax.process_index()}.txt", "w") as f:
    f.write(f"{describe_mesh(inferred)} {batch['x'].shape} {float(total)}")
# The training: data across the processes, model inside each.
mesh = make_mesh(data=2, model=2)
batches = case.host_batches(jax.process_index(), jax.process_count())
model = case.equivalence_model()
with np.load(os.environ["TERRA_TEST_INITIAL_STATE"]) as saved:  # the test process's: no init compile
    leaves = [saved[f"leaf{i}"] for i in range(len(saved.files))]
initial = jax.tree.unflatten(case.initial_state_structure(model), leaves)
((losses, params, (logits, intermediates)),) = case.train(model, mesh, batches, [jax.random.key(case.SEED)], initial)
if jax.process_index() == 0:
    leaves = {f"param{i}": x for i, x in enumerate(jax.tree.leaves(params))}
    leaves.update({f"draw{i}": x for i, x in enumerate(jax.tree.leaves(intermediates))})
    np.savez(os.environ["TERRA_TEST_RESULT"], losses=losses, logits=logits, mesh=describe_mesh(mesh), **leaves)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path, initial, n: int = 2) -> str:
    """Runs ``_WORKER`` in ``n`` processes joined through gloo, from the host state ``initial``;
    returns process 0's result file (process ``i``'s mesh line is beside it, ``.mesh{i}.txt``)."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    initial_path = str(tmp_path / "initial.npz")
    np.savez(initial_path, **{f"leaf{i}": x for i, x in enumerate(jax.tree.leaves(initial))})
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    port, result = _free_port(), str(tmp_path / "result.npz")
    workers = []
    for process_id in range(n):
        env = dict(
            os.environ,
            PYTHONPATH=os.path.dirname(tests_dir),
            TERRA_TESTS_DIR=tests_dir,
            TERRA_COORDINATOR=f"127.0.0.1:{port}",
            TERRA_NUM_PROCESSES=str(n),
            TERRA_PROCESS_ID=str(process_id),
            TERRA_TEST_RESULT=result,
            TERRA_TEST_INITIAL_STATE=initial_path,
            # The reference in this process is compiled under fast_compile; so are the workers,
            # with the suite's compile flags (tests/conftest.py) and two devices each.
            JAX_DISABLE_MOST_OPTIMIZATIONS="1",
            XLA_FLAGS=xla_flags_with_devices(2),
        )
        workers.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output
    return result


@pytest.fixture(scope="module")
def two_gloo_processes(model, tmp_path_factory) -> str:
    """Process 0's result file of one pair of gloo workers, shared by the module's two tests of it
    (the workers form the mesh, then train on it)."""
    return _run_workers(tmp_path_factory.mktemp("gloo"), initial_state(model))


def test_two_cpu_processes_form_one_mesh_through_gloo(two_gloo_processes):
    for process_id in range(2):
        with open(f"{two_gloo_processes}.mesh{process_id}.txt") as f:
            result = f.read()
        # Each process contributes 2 rows of 3: 6 * 1 + 6 * 2 = 18, summed across processes.
        assert result == "mesh data=2 x model=2 over 4 cpu devices, 2 processes (4, 3) 18.0"


def test_two_gloo_processes_train_the_same_model_as_one_device(two_gloo_processes, one_device):
    with np.load(two_gloo_processes) as result:
        assert str(result["mesh"]) == "mesh data=2 x model=2 over 4 cpu devices, 2 processes"
        treedef = jax.tree.structure(one_device[1])
        params = jax.tree.unflatten(treedef, [result[f"param{i}"] for i in range(treedef.num_leaves)])
        draws_def = jax.tree.structure(one_device[2][1])
        draws = jax.tree.unflatten(draws_def, [result[f"draw{i}"] for i in range(draws_def.num_leaves)])
        run = (list(result["losses"]), params, (result["logits"], draws))
    assert_same_training(run, one_device)

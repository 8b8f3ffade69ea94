"""Optimizers, schedules and training logs (terra.training.optimizers / terra.training.metrics)."""

import glob
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from terra.errors import ConfigError
from terra.training import metrics as metrics_lib
from terra.training import optimizers as opt

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _apply(tx, params, grads_seq, jit=True):
    """Runs ``tx`` over a sequence of gradient trees; returns the params after each update and the state."""
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    history = []
    for grads in grads_seq:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history, state


# --- schedules ----------------------------------------------------------------------------------


def test_rsqrt_schedule_is_constant_until_warmup_then_decays():
    lr = opt.rsqrt_schedule(constant=1.0, warmup_steps=10_000)
    for step, expected in [(0, 0.01), (5000, 0.01), (10_000, 0.01), (40_000, 0.005), (1_000_000, 0.001)]:
        np.testing.assert_allclose(float(lr(step)), expected, rtol=1e-6)
    # Usable inside jit with the int32 counts optax passes.
    np.testing.assert_allclose(float(jax.jit(lr)(jnp.int32(40_000))), 0.005, rtol=1e-6)
    # gin binds the reference's knobs.
    gin.parse_config("terra.training.rsqrt_schedule.warmup_steps = 100\nterra.training.rsqrt_schedule.constant = 2.0")
    np.testing.assert_allclose(float(opt.rsqrt_schedule()(0)), 0.2, rtol=1e-6)


def test_linear_warmup_variant_ramps_up():
    lr = opt.rsqrt_schedule(constant=1.0, warmup_steps=10_000, linear_warmup=True)
    assert float(lr(0)) == 0.0  # Trax's multifactor gives 0 at step 0
    np.testing.assert_allclose(float(lr(1)), 1e-4 * 0.01, rtol=1e-5)
    np.testing.assert_allclose(float(lr(5000)), 0.005, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10_000)), 0.01, rtol=1e-6)
    np.testing.assert_allclose(float(lr(40_000)), 0.005, rtol=1e-6)
    values = [float(lr(s)) for s in range(0, 10_001, 1000)]
    assert values == sorted(values)
    # Other schedules and the synthetic tasks' Adam default (0.5 * linear_warmup(16000) * rsqrt_decay).
    np.testing.assert_allclose(float(opt.constant_schedule(0.3)(123)), 0.3)
    cosine = opt.warmup_cosine_schedule(1.0, 10, 110)
    np.testing.assert_allclose([float(cosine(s)) for s in (0, 5, 10, 60, 110)], [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
    adam = opt.adamw()
    np.testing.assert_allclose(opt.learning_rate_at(adam, 16_000), 0.5 / np.sqrt(16_000), rtol=1e-6)
    np.testing.assert_allclose(opt.learning_rate_at(adam, 8_000), 0.25 / np.sqrt(16_000), rtol=1e-6)


# --- Adafactor ----------------------------------------------------------------------------------


def test_adafactor_minimizes_a_quadratic():
    target = {"w": jnp.arange(12.0).reshape(3, 4) / 10 - 0.5, "b": jnp.array([0.3, -0.2, 0.1, 0.4])}
    params = jax.tree.map(jnp.zeros_like, target)
    loss = lambda p: sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)  # noqa: E731
    spec = opt.adafactor(learning_rate=opt.warmup_cosine_schedule(0.1, 10, 200), multiply_by_parameter_scale=False)
    state = spec.transform.init(params)

    # The 2-D parameter keeps factored (row and column) second moments, the vector a full one.
    factored = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.FactoredState))
        if isinstance(s, optax.FactoredState)
    ]
    assert len(factored) == 1
    fs = factored[0]
    assert sorted([fs.v_row["w"].shape, fs.v_col["w"].shape]) == [(3,), (4,)]
    assert fs.v["w"].shape == (1,)  # unused placeholder: no full moment for the matrix
    assert fs.v["b"].shape == (4,)

    @jax.jit
    def step(params, state):
        updates, state = spec.transform.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    start = float(loss(params))
    for _ in range(200):
        params, state = step(params, state)
    assert float(loss(params)) < 1e-3 * start


def _trax_adafactor_step(
    w, g, slots, step, lr, *, decay_rate=0.8, clip=1.0, eps1=1e-16, eps2=1e-3, wd_rate=0.0, wd_steps=0
):
    """Trax's ``Adafactor.update`` (beta1=0, factored, param-scale) for one array, in numpy."""
    decay = 1.0 - (step + 1.0) ** (-decay_rate)
    wd = wd_rate if wd_steps < 1 else wd_rate * max(wd_steps - step, 0.0) / wd_steps
    scale = lr * max(np.sqrt(np.mean(w * w)), eps2)
    g2 = g * g + eps1
    if w.ndim >= 2:
        v_row, v_col = slots
        v_row = decay * v_row + (1 - decay) * g2.mean(-1)
        v_col = decay * v_col + (1 - decay) * g2.mean(-2)
        slots = (v_row, v_col)
        row_factor = (v_row / v_row.mean(-1, keepdims=True)) ** -0.5
        y = g * row_factor[..., :, None] * (v_col**-0.5)[..., None, :]
    else:
        (v,) = slots
        v = decay * v + (1 - decay) * g2
        slots = (v,)
        y = g * v**-0.5
    y = y / max(1.0, np.sqrt(np.mean(y * y)) / clip)
    return (1 - wd) * w - scale * y, slots


def test_adafactor_matches_optax_reference_update():
    rng = np.random.default_rng(0)
    params = {
        "tall": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
        "wide": jnp.asarray(rng.normal(size=(3, 6)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(4,)) * 1e-4, jnp.float32),
    }  # RMS below epsilon2
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    schedule = opt.rsqrt_schedule(warmup_steps=2)

    # Our chain equals optax.adafactor with the mapped arguments (constant weight decay)...
    ours = opt.adafactor(learning_rate=schedule, weight_decay_rate=1e-2, decay_rate=0.8)
    reference = optax.adafactor(
        learning_rate=schedule,
        min_dim_size_to_factor=1,
        decay_rate=0.8,
        multiply_by_parameter_scale=True,
        clipping_threshold=1.0,
        momentum=None,
        weight_decay_rate=1e-2,
        eps=1e-16,
        factored=True,
    )
    got, _ = _apply(ours.transform, params, grads_seq)
    want, _ = _apply(reference, params, grads_seq)
    for a, b in zip(got, want):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)

    # ...and Trax's formula, including the linearly decaying weight decay.
    ours = opt.adafactor(learning_rate=schedule, decay_rate=0.9, weight_decay_rate=1e-2, weight_decay_steps=2)
    got, _ = _apply(ours.transform, params, grads_seq)
    np_params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    slots = {
        k: ((np.zeros(v.shape[:-1]), np.zeros(v.shape[-1:])) if v.ndim >= 2 else (np.zeros(v.shape),))
        for k, v in np_params.items()
    }
    for step, grads in enumerate(grads_seq):
        for k in np_params:
            np_params[k], slots[k] = _trax_adafactor_step(
                np_params[k],
                np.asarray(grads[k], np.float64),
                slots[k],
                step,
                float(schedule(step)),
                decay_rate=0.9,
                wd_rate=1e-2,
                wd_steps=2,
            )
        for k in np_params:
            np.testing.assert_allclose(got[step][k], np_params[k], rtol=2e-5, atol=1e-7)


def test_weight_decay_decays_linearly_to_zero():
    # With a zero learning rate only the decoupled decay moves the weights: w <- (1 - rate_t) w,
    # rate_t = 0.1 * (1 - t / 4), independent of the learning rate.
    spec = opt.adafactor(learning_rate=0.0, weight_decay_rate=0.1, weight_decay_steps=4)
    params = {"w": jnp.full((2, 3), 2.0)}
    grads = [{"w": jnp.ones((2, 3))}] * 6
    history, _ = _apply(spec.transform, params, grads)
    previous = 2.0
    for t, p in enumerate(history):
        ratio = float(p["w"][0, 0]) / previous
        np.testing.assert_allclose(1 - ratio, 0.1 * max(0.0, 1 - t / 4), atol=1e-6)
        previous = float(p["w"][0, 0])
    # Without weight_decay_steps the rate stays constant.
    history, _ = _apply(opt.adafactor(learning_rate=0.0, weight_decay_rate=0.1).transform, params, grads[:3])
    np.testing.assert_allclose(float(history[-1]["w"][0, 0]), 2.0 * 0.9**3, rtol=1e-6)


# --- build_optimizer ------------------------------------------------------------------------------


def test_gradient_clipping_bounds_the_update():
    spec = opt.build_optimizer(opt.sgd(learning_rate=1.0), clip_grad_norm=1.0)
    params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
    big = {"a": jnp.array([3.0, 4.0, 0.0]), "b": jnp.full((2, 2), 5.0)}
    (after,), _ = _apply(spec.transform, params, [big])
    norm = float(optax.tree.norm(after))
    np.testing.assert_allclose(norm, 1.0, rtol=1e-6)
    # The direction is kept; small gradients pass unchanged.
    np.testing.assert_allclose(after["a"] / after["a"][1], big["a"] / big["a"][1], rtol=1e-6)
    small = jax.tree.map(lambda g: g / 100, big)
    (after,), _ = _apply(spec.transform, params, [small])
    jax.tree.map(lambda u, g: np.testing.assert_allclose(u, -g, rtol=1e-6), after, small)
    assert spec.schedule(7) == opt.sgd(learning_rate=1.0).schedule(7)


@pytest.mark.parametrize(
    "make",
    [
        lambda: opt.sgd(learning_rate=0.1, momentum=0.9),
        lambda: opt.adamw(learning_rate=opt.rsqrt_schedule(warmup_steps=1)),
        lambda: opt.adafactor(learning_rate=0.01),
    ],
    ids=["sgd", "adam", "adafactor"],
)
def test_gradient_accumulation_equals_one_big_batch(make):
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(4)}
    halves = [
        [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(2)]
        for _ in range(2)
    ]  # two optimizer steps, each from two half-batch gradients
    means = [jax.tree.map(lambda a, b: (a + b) / 2, h[0], h[1]) for h in halves]

    accumulated = opt.build_optimizer(make(), clip_grad_norm=1.0, gradient_accumulation_steps=2)
    big_batch = opt.build_optimizer(make(), clip_grad_norm=1.0)
    got, _ = _apply(accumulated.transform, params, [g for h in halves for g in h])  # jitted, state included
    want, _ = _apply(big_batch.transform, params, means)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), got[0], params)  # first micro-step: no update
    for a, b in zip(got[1::2], want):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)
    # The spec's schedule counts update calls: micro-steps 2n and 2n+1 use the inner rate of step n.
    inner = make().schedule
    for n in range(6):
        np.testing.assert_allclose(opt.learning_rate_at(accumulated, n), float(inner(n // 2)))


def test_bad_optimizer_settings_raise_config_errors():
    with pytest.raises(ConfigError, match="decay_rate"):
        opt.adafactor(decay_rate=1.5)
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        opt.adafactor(decay_rate=0.0)
    with pytest.raises(ConfigError, match="negative"):
        opt.adafactor(learning_rate=-0.01)
    with pytest.raises(ConfigError, match="learning_rate"):
        opt.adamw(learning_rate="fast")
    with pytest.raises(ConfigError, match="warmup_steps"):
        opt.rsqrt_schedule(warmup_steps=0)
    with pytest.raises(ConfigError, match="weight_decay_steps"):
        opt.adafactor(weight_decay_rate=1e-5, weight_decay_steps=0)
    with pytest.raises(ConfigError, match="b2"):
        opt.adamw(b2=1.0)
    with pytest.raises(ConfigError, match="decay_steps"):
        opt.warmup_cosine_schedule(1.0, 100, 50)
    with pytest.raises(ConfigError, match="'adafactor'"):
        opt.optimizer_by_name("adafacter")
    with pytest.raises(ConfigError, match="decay_rate"):
        opt.optimizer_by_name("adafactor", beta2=0.9)
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        opt.build_optimizer(opt.sgd(), clip_grad_norm=0.0)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        opt.build_optimizer(opt.sgd(), gradient_accumulation_steps=0)
    with pytest.raises(ConfigError, match="OptimizerSpec"):
        opt.build_optimizer(optax.sgd(0.1))
    # Through gin, as a config file would set them.
    gin.parse_config("terra.training.adafactor.decay_rate = 0.0")
    with pytest.raises(ConfigError, match="decay_rate"):
        opt.adafactor()
    gin.clear_config()
    gin.parse_config(
        "terra.training.build_optimizer.spec = @terra.training.adafactor()\n"
        "terra.training.adafactor.decay_rate = 0.9\n"
        "terra.training.rsqrt_schedule.warmup_steps = 100\n"
        "terra.training.build_optimizer.gradient_accumulation_steps = 2"
    )
    spec = opt.build_optimizer()
    np.testing.assert_allclose(opt.learning_rate_at(spec, 1), 0.1, rtol=1e-6)
    assert isinstance(spec.transform.init({"w": jnp.zeros((2, 2))}), optax.MultiStepsState)


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_writer_appends_jsonl_and_tensorboard_events(tmp_path):
    model_dir = str(tmp_path / "run")
    with metrics_lib.MetricsWriter(model_dir) as writer:
        writer.write(10, {"loss": np.float32(2.5), "learning_rate": jnp.asarray(0.01)})
        writer.write(10, {"loss": 2.0, "accuracy": 0.25}, prefix="eval")
        writer.write(20, {"loss": 1.5})
        writer.write(20, {}, prefix="eval")  # nothing to log: no line
        # Each line is on disk as soon as it is written.
        with open(os.path.join(model_dir, "metrics.jsonl")) as f:
            assert len(f.readlines()) == 3
    records = metrics_lib.read_metrics(model_dir)
    assert records[0]["step"] == 10 and records[0]["train/loss"] == 2.5
    np.testing.assert_allclose(records[0]["train/learning_rate"], 0.01, rtol=1e-6)
    assert records[1] == {"step": 10, "eval/loss": 2.0, "eval/accuracy": 0.25}
    assert records[2] == {"step": 20, "train/loss": 1.5}
    # Appends across writers (a resumed run).
    with metrics_lib.MetricsWriter(model_dir) as writer:
        writer.write(30, {"loss": float("nan")})
    records = metrics_lib.read_metrics(model_dir)
    assert len(records) == 4 and records[3] == {"step": 30, "train/loss": "nan"}
    for line in open(os.path.join(model_dir, "metrics.jsonl")):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))

    events = glob.glob(os.path.join(model_dir, "tensorboard", "events.out.tfevents*"))
    assert events
    import tensorflow as tf

    tags = {}
    for path in events:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(
                    (
                        event.step,
                        float(tf.make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value,
                    )
                )
    loss = sorted(tags["train/loss"])  # one events file per writer
    assert loss[:2] == [(10, 2.5), (20, 1.5)] and loss[2][0] == 30 and np.isnan(loss[2][1])
    assert tags["eval/accuracy"] == [(10, 0.25)]


def test_disabled_writer_writes_nothing(tmp_path, capsys):
    model_dir = tmp_path / "host1"
    writer = metrics_lib.MetricsWriter(str(model_dir), enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not model_dir.exists()
    bar = metrics_lib.ProgressBar(100, enabled=False)
    bar.update(10, 1.0, 5.0)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_bar_reports_steps(capsys):
    with metrics_lib.ProgressBar(100, initial_step=20) as bar:
        bar.update(30, 1.2345, 4.0)
        bar.update(40, 0.5, 8.0)
    err = capsys.readouterr().err
    assert "40/100" in err
    assert "loss=0.5000" in err and "steps/s=8.00" in err
    assert "<" in err  # tqdm's elapsed<remaining (the ETA)
    assert capsys.readouterr().out == ""


def test_compiled_memory_is_reported_for_a_jitted_function():
    x = jnp.ones((64, 128), jnp.float32)
    compiled = jax.jit(lambda a: jnp.tanh(a @ a.T).sum()).lower(x).compile()
    stats = compiled.memory_analysis()
    assert stats.argument_size_in_bytes == x.nbytes
    nbytes = metrics_lib.compiled_memory_bytes(compiled)
    assert isinstance(nbytes, int) and nbytes >= x.nbytes

    # Backends without an analysis give None, not an error.
    class NoAnalysis:
        def memory_analysis(self):
            raise RuntimeError("memory analysis is not supported on this backend")

    assert metrics_lib.compiled_memory_bytes(NoAnalysis()) is None

    line = metrics_lib.summarize_start(
        mesh_description="data=1 x model=1 over 1 cpu device", param_count=12_345_678, compiled_memory_bytes=45_600_000
    )
    assert line == "mesh data=1 x model=1 over 1 cpu device · 12.3M parameters · compiled train step 45.6 MB"
    assert "memory unknown" in metrics_lib.summarize_start(
        mesh_description="m", param_count=10, compiled_memory_bytes=None
    )

"""Optimizers and learning-rate schedules (the reference's, built from optax), all gin-configurable.

Design: every optimizer factory returns an :class:`OptimizerSpec` — the optax
``GradientTransformation`` together with the learning-rate ``schedule`` it applies — so the
trainer can log ``spec.schedule(n)`` without reaching into optimizer state. The trainer then
wraps the spec with :func:`build_optimizer` (global-norm clipping, gradient accumulation),
which returns another ``OptimizerSpec``. In gin::

    train.optimizer = @terra.training.adafactor()
    terra.training.adafactor.decay_rate = 0.9
    terra.training.rsqrt_schedule.warmup_steps = 10000
    train.clip_grad_norm = 1.0                      # -> build_optimizer

Step convention: ``spec.schedule(n)`` is the learning rate applied by the ``n``-th call
(0-based) of ``spec.transform.update`` — the same count optax's schedules see. With gradient
accumulation over ``k`` micro-batches the inner schedule advances once per ``k`` calls, and the
spec returned by :func:`build_optimizer` accounts for that (``schedule(n) = inner(n // k)``).

The reference (Trax) configurations, ``docs/design/reference_code.md`` §5.1–§5.3 and §7:

* C4 pretraining: ``Adafactor(beta1=0, decay_rate=0.8, clipping_threshold=1.0, epsilon1=1e-16,
  epsilon2=1e-3, factored=True, multiply_by_parameter_scale=True, weight_decay_rate=1e-5,
  weight_decay_n_steps=100000)`` with ``lr = 1/sqrt(max(step, 10000))`` — :func:`adafactor`
  with ``weight_decay_rate=1e-5, weight_decay_steps=100_000`` and the default schedule.
* arXiv fine-tuning: the same with ``decay_rate=0.9``, no weight decay, and
  ``rsqrt_schedule(linear_warmup=True)``.
* Synthetic tasks: ``Adam(b1=0.9, b2=0.98, eps=2e-5)`` with
  ``0.5 * linear_warmup(16000) * rsqrt_decay`` — :func:`adamw` with its defaults.
"""

import difflib
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import gin
import jax
import jax.numpy as jnp
import optax

from terra.errors import ConfigError

Schedule = Callable[[Any], Any]  # step (int or int array) -> learning rate (float or array)
LearningRate = Union[float, Schedule]


class OptimizerSpec(NamedTuple):
    """An optax transformation and the learning-rate schedule it applies (for logging).

    ``transform``: the ``optax.GradientTransformation`` (its updates already include the minus
    sign and the learning rate: apply them with ``optax.apply_updates``).
    ``schedule``: ``n -> learning rate`` of the ``n``-th ``transform.update`` call (0-based).
    """

    transform: optax.GradientTransformation
    schedule: Schedule


# --- validation helpers ------------------------------------------------------------------------


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_non_negative(name: str, value, where: str) -> None:
    _check(
        _is_number(value) and value >= 0,
        f"{where}: {name}={value!r} must be a number >= 0; set e.g. {where}.{name} = {_example(name)}.",
    )


def _check_int(name: str, value, where: str, minimum: int) -> None:
    _check(
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum,
        f"{where}: {name}={value!r} must be an integer >= {minimum}; set e.g. {where}.{name} = {_example(name)}.",
    )


def _example(name: str) -> str:
    return {
        "warmup_steps": "10000",
        "decay_steps": "100000",
        "weight_decay_steps": "100000",
        "gradient_accumulation_steps": "2",
        "min_dim_size_to_factor": "1",
    }.get(name, "0.01")


def _as_schedule(learning_rate: LearningRate, where: str) -> Schedule:
    """A float becomes a constant schedule; a callable is taken as a schedule."""
    if callable(learning_rate):
        return learning_rate
    if _is_number(learning_rate):
        _check(
            learning_rate >= 0,
            f"{where}: learning_rate={learning_rate!r} is negative; the optimizer already descends "
            f"(updates carry the minus sign), so give a positive value, e.g. "
            f"{where}.learning_rate = 0.01, or a schedule such as @terra.training.rsqrt_schedule().",
        )
        return constant_schedule(float(learning_rate))
    raise ConfigError(
        f"{where}: learning_rate={learning_rate!r} is neither a number nor a schedule; use a float "
        f"or a schedule such as @terra.training.rsqrt_schedule()."
    )


# --- schedules -------------------------------------------------------------------------------


@gin.configurable(module="terra.training")
def rsqrt_schedule(*, constant: float = 1.0, warmup_steps: int = 10_000, linear_warmup: bool = False) -> Schedule:
    """The reference's ``multifactor('constant * rsqrt_decay')``: ``constant / sqrt(max(step, warmup_steps))``.

    Without linear warm-up (the C4 pretraining configs) the rate is flat at
    ``constant / sqrt(warmup_steps)`` (0.01 for 10k steps) and then decays as ``1/sqrt(step)``.
    With ``linear_warmup=True`` (``'constant * linear_warmup * rsqrt_decay'``, arXiv fine-tuning
    and, with constant 0.5 and 16k steps, the synthetic tasks) it is further multiplied by
    ``min(1, step / warmup_steps)``, so it ramps from 0 to its peak at ``warmup_steps``. As in
    Trax's ``multifactor``, the rate at step 0 is then exactly 0: the first optimizer update
    (count 0) leaves the parameters unchanged apart from weight decay.
    """
    where = "terra.training.rsqrt_schedule"
    _check_non_negative("constant", constant, where)
    _check_int("warmup_steps", warmup_steps, where, 1)
    constant, warmup = float(constant), float(warmup_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        lr = constant * jax.lax.rsqrt(jnp.maximum(step, warmup))
        if linear_warmup:
            lr = lr * jnp.minimum(1.0, step / warmup)
        return lr

    return schedule


@gin.configurable(module="terra.training")
def constant_schedule(value: float = gin.REQUIRED) -> Schedule:
    """A constant learning rate (``optax.constant_schedule``)."""
    _check_non_negative("value", value, "terra.training.constant_schedule")
    return optax.constant_schedule(float(value))


@gin.configurable(module="terra.training")
def warmup_cosine_schedule(
    peak: float = gin.REQUIRED,
    warmup_steps: int = gin.REQUIRED,
    decay_steps: int = gin.REQUIRED,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warm-up from 0 to ``peak`` over ``warmup_steps``, then cosine decay to ``end_value``
    at ``decay_steps`` (which counts the warm-up too; ``optax.warmup_cosine_decay_schedule``)."""
    where = "terra.training.warmup_cosine_schedule"
    _check_non_negative("peak", peak, where)
    _check_non_negative("end_value", end_value, where)
    _check_int("warmup_steps", warmup_steps, where, 0)
    _check_int("decay_steps", decay_steps, where, 1)
    _check(
        decay_steps > warmup_steps,
        f"{where}: decay_steps={decay_steps} must exceed warmup_steps={warmup_steps} (it is the total "
        f"length of the schedule, warm-up included).",
    )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=float(peak),
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        end_value=float(end_value),
    )


# --- optimizers ------------------------------------------------------------------------------


@gin.configurable(module="terra.training")
def adafactor(
    *,
    learning_rate: Optional[LearningRate] = None,
    decay_rate: float = 0.8,
    clipping_threshold: Optional[float] = 1.0,
    multiply_by_parameter_scale: bool = True,
    factored: bool = True,
    epsilon1: float = 1e-16,
    epsilon2: float = 1e-3,
    momentum: Optional[float] = None,
    weight_decay_rate: float = 0.0,
    weight_decay_steps: Optional[int] = None,
    min_dim_size_to_factor: int = 1,
) -> OptimizerSpec:
    """Trax's Adafactor as an optax chain (the same transforms ``optax.adafactor`` chains).

    Trax argument -> here -> optax:

    * ``learning_rate`` (default :func:`rsqrt_schedule`) -> ``optax.scale_by_learning_rate``.
    * ``decay_rate`` (0.8; arXiv 0.9): in both Trax and optax an *exponent*, the second-moment
      decay at update ``t`` (0-based) being ``1 - (t + 1) ** -decay_rate`` -> ``decay_rate``.
    * ``epsilon1`` (1e-16, added to the squared gradient) -> optax's ``eps``.
    * ``epsilon2`` (1e-3, floor of the parameter RMS) -> ``scale_by_param_block_rms(min_scale)``,
      which ``optax.adafactor`` fixes at 1e-3; exposed here.
    * ``clipping_threshold`` (update-RMS clipping, 1.0) -> ``clip_by_block_rms``; None disables.
    * ``beta1=0`` (no momentum) -> ``momentum=None``; a value -> ``optax.ema(debias=False)``,
      Trax's ``beta1 * m + (1 - beta1) * update``.
    * ``factored`` -> ``factored``. Trax factors every parameter with >= 2 dimensions
      (``min_dim_size_to_factor=1`` here; optax's default is 128). For >= 3-D parameters optax
      factors the two *largest* dimensions where Trax uses the last two.
    * ``weight_decay_rate`` / ``weight_decay_n_steps`` -> ``weight_decay_rate`` /
      ``weight_decay_steps``: decoupled decay ``w <- (1 - rate_t) w``, not multiplied by the
      learning rate, with ``rate_t = rate * max(0, 1 - t / weight_decay_steps)`` (linearly to 0;
      constant when ``weight_decay_steps`` is None) -> ``optax.add_decayed_weights`` with an
      ``optax.linear_schedule``.
    """
    where = "terra.training.adafactor"
    schedule = rsqrt_schedule() if learning_rate is None else _as_schedule(learning_rate, where)
    _check(
        _is_number(decay_rate) and 0 < decay_rate <= 1,
        f"{where}: decay_rate={decay_rate!r} must be in (0, 1]; it is the exponent of the second-moment "
        f"decay 1 - (t+1)^-decay_rate (reference: 0.8 for C4 pretraining, 0.9 for arXiv fine-tuning), "
        f"not a per-step beta2.",
    )
    _check(
        clipping_threshold is None or (_is_number(clipping_threshold) and clipping_threshold > 0),
        f"{where}: clipping_threshold={clipping_threshold!r} must be > 0 (reference 1.0) or None to disable.",
    )
    _check_non_negative("epsilon1", epsilon1, where)
    _check_non_negative("epsilon2", epsilon2, where)
    _check(
        momentum is None or (_is_number(momentum) and 0 <= momentum < 1),
        f"{where}: momentum={momentum!r} must be in [0, 1) or None (the reference uses none: beta1=0).",
    )
    _check_non_negative("weight_decay_rate", weight_decay_rate, where)
    _check(weight_decay_rate < 1, f"{where}: weight_decay_rate={weight_decay_rate!r} must be < 1 (reference 1e-5).")
    if weight_decay_steps is not None:
        _check_int("weight_decay_steps", weight_decay_steps, where, 1)
    _check_int("min_dim_size_to_factor", min_dim_size_to_factor, where, 1)

    chain = [
        optax.scale_by_factored_rms(
            factored=factored, decay_rate=decay_rate, min_dim_size_to_factor=min_dim_size_to_factor, epsilon=epsilon1
        )
    ]
    if clipping_threshold is not None:
        chain.append(optax.clip_by_block_rms(clipping_threshold))
    chain.append(optax.scale_by_learning_rate(schedule, flip_sign=False))
    if multiply_by_parameter_scale:
        chain.append(optax.scale_by_param_block_rms(min_scale=epsilon2))
    if momentum is not None:
        chain.append(optax.ema(momentum, debias=False))
    if weight_decay_rate > 0:
        rate = (
            float(weight_decay_rate)
            if weight_decay_steps is None
            else optax.linear_schedule(float(weight_decay_rate), 0.0, weight_decay_steps)
        )
        chain.append(optax.add_decayed_weights(rate))
    chain.append(optax.scale(-1.0))
    return OptimizerSpec(optax.chain(*chain), schedule)


@gin.configurable(module="terra.training")
def adamw(
    *,
    learning_rate: Optional[LearningRate] = None,
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 2e-5,
    weight_decay: float = 0.0,
) -> OptimizerSpec:
    """Adam (``optax.adamw``) with the synthetic tasks' reference settings (§7): b1 0.9, b2 0.98,
    eps 2e-5 and, by default, ``rsqrt_schedule(constant=0.5, warmup_steps=16000, linear_warmup=True)``.

    ``weight_decay`` is optax's decoupled AdamW decay, multiplied by the learning rate (Trax's
    Adam instead subtracts ``weight_decay_rate * w`` independently of it; both are off at 0).
    """
    where = "terra.training.adamw"
    schedule = (
        rsqrt_schedule(constant=0.5, warmup_steps=16_000, linear_warmup=True)
        if learning_rate is None
        else _as_schedule(learning_rate, where)
    )
    for name, value in (("b1", b1), ("b2", b2)):
        _check(
            _is_number(value) and 0 <= value < 1,
            f"{where}: {name}={value!r} must be in [0, 1) (reference b1=0.9, b2=0.98).",
        )
    _check(_is_number(eps) and eps > 0, f"{where}: eps={eps!r} must be > 0 (reference 2e-5).")
    _check_non_negative("weight_decay", weight_decay, where)
    return OptimizerSpec(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay), schedule)


@gin.configurable(module="terra.training")
def sgd(*, learning_rate: LearningRate = 0.01, momentum: Optional[float] = None) -> OptimizerSpec:
    """Plain SGD (``optax.sgd``), mainly for tests and debugging."""
    where = "terra.training.sgd"
    schedule = _as_schedule(learning_rate, where)
    _check(
        momentum is None or (_is_number(momentum) and 0 <= momentum < 1),
        f"{where}: momentum={momentum!r} must be in [0, 1) or None.",
    )
    return OptimizerSpec(optax.sgd(schedule, momentum=momentum), schedule)


OPTIMIZERS = {"adafactor": adafactor, "adamw": adamw, "sgd": sgd}


def optimizer_by_name(name: str, **kwargs) -> OptimizerSpec:
    """``optimizer_by_name("adafactor", decay_rate=0.9)``: the factory called ``name`` (for command lines)."""
    if name not in OPTIMIZERS:
        close = difflib.get_close_matches(str(name), OPTIMIZERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}.{hint}")
    try:
        return OPTIMIZERS[name](**kwargs)
    except TypeError as e:  # an unknown keyword
        import inspect

        valid = sorted(inspect.signature(OPTIMIZERS[name]).parameters)
        raise ConfigError(f"Bad arguments for optimizer {name!r} ({e}); its settings are {valid}.") from None


@gin.configurable(module="terra.training")
def build_optimizer(
    spec: OptimizerSpec, *, clip_grad_norm: Optional[float] = None, gradient_accumulation_steps: int = 1
) -> OptimizerSpec:
    """The transformation the trainer applies: ``spec`` preceded by optional global-norm clipping,
    the whole wrapped in ``optax.MultiSteps`` when accumulating gradients.

    With ``gradient_accumulation_steps = k > 1`` each ``update`` call adds one micro-batch
    gradient; every ``k``-th call applies the inner optimizer to their mean (clipped, if asked,
    as one big batch's gradient would be) and the other calls return zero updates. The
    returned ``schedule`` is in units of ``update`` calls: ``schedule(n) = spec.schedule(n // k)``.
    """
    where = "terra.training.build_optimizer"
    if not isinstance(spec, OptimizerSpec):
        raise ConfigError(
            f"{where}: expected an OptimizerSpec (e.g. @terra.training.adafactor() or @terra.training.adamw()), "
            f"got {type(spec).__name__}; wrap a raw optax transformation as OptimizerSpec(transform, schedule)."
        )
    _check(
        clip_grad_norm is None or (_is_number(clip_grad_norm) and clip_grad_norm > 0),
        f"{where}: clip_grad_norm={clip_grad_norm!r} must be > 0 or None (no clipping), e.g. 1.0.",
    )
    _check_int("gradient_accumulation_steps", gradient_accumulation_steps, where, 1)

    tx = spec.transform
    if clip_grad_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(float(clip_grad_norm)), tx)
    k = int(gradient_accumulation_steps)
    if k == 1:
        return OptimizerSpec(tx, spec.schedule)
    inner = spec.schedule
    return OptimizerSpec(optax.MultiSteps(tx, every_k_schedule=k).gradient_transformation(), lambda n: inner(n // k))


def learning_rate_at(spec_or_schedule: Union[OptimizerSpec, Schedule], step) -> float:
    """The learning rate of update ``step`` (0-based) as a Python float, for logging."""
    schedule = spec_or_schedule.schedule if isinstance(spec_or_schedule, OptimizerSpec) else spec_or_schedule
    return float(schedule(step))

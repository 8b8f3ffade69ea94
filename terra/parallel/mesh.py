"""Device meshes and multi-host start-up.

terra runs on a two-axis mesh, ``("data", "model")``: the batch is split over ``data`` and the
wide parameter axes (d_ff, heads, vocab) over ``model``, as the logical-axis rules in
``terra.layers.axes`` say. Where a tensor lands is decided by those rules (data), not by the
layers; this module only builds the device grid the rules refer to.

Two version-specific choices (``docs/design/jax_stack.md``, pitfalls 1-2 and the checklist):

* Mesh axes are ``AxisType.Auto``. In JAX 0.10.2 ``jax.make_mesh`` defaults to ``Explicit``
  axes, under which Flax Linen's ``nn.with_logical_constraint`` becomes a hard assert and the
  model fails to trace (the same assert MaxText hit, AI-Hypercomputer/maxtext#4208).
* Callers enter the mesh with ``jax.set_mesh(mesh)`` (``with mesh:`` is deprecated) and compile
  with ``jax.jit`` (``pjit`` is deprecated).
"""

import logging
import os
from typing import Optional, Sequence

import gin
import jax
from jax.sharding import AxisType, Mesh

from terra.errors import ConfigError
from terra.layers.axes import DATA_AXIS, MODEL_AXIS

logger = logging.getLogger(__name__)

MESH_AXES = (DATA_AXIS, MODEL_AXIS)

# Environment variables read by ``initialize_distributed`` when an argument is not given.
ENV_COORDINATOR = "TERRA_COORDINATOR"
ENV_NUM_PROCESSES = "TERRA_NUM_PROCESSES"
ENV_PROCESS_ID = "TERRA_PROCESS_ID"


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _suggest(n_devices: int, model: int) -> str:
    """A valid ``data=..., model=...`` choice close to what was asked for."""
    if model >= 1 and n_devices % model == 0:
        return f"data={n_devices // model}, model={model} (or data=-1)"
    fitting = [d for d in _divisors(n_devices) if d <= max(model, 1)]
    best = fitting[-1] if fitting else 1
    return f"data={n_devices // best}, model={best} (model must divide {n_devices})"


@gin.configurable(module="terra.parallel")
def make_mesh(*, data: int = -1, model: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``("data", "model")`` mesh of ``data x model`` devices with Auto axis types.

    Args:
      data: size of the ``data`` axis; ``-1`` means "all devices not used by ``model``".
      model: size of the ``model`` axis; ``-1`` means "all devices not used by ``data``".
      devices: the devices to use (default: ``jax.devices()``, every device of every process).

    Returns:
      ``Mesh`` with ``mesh.shape == {"data": data, "model": model}`` and axis types
      ``(Auto, Auto)``; ``jax.make_mesh`` orders the devices for the physical topology
      (rings on TPU), which a plain ``reshape`` of the device list would not.

    Raises:
      ConfigError: if ``data * model`` is not the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if data == -1 and model == -1:
        raise ConfigError(f"make_mesh: at most one of data and model may be -1; with {n} devices try {_suggest(n, 1)}")
    for name, size in (("data", data), ("model", model)):
        if size == 0 or size < -1:
            raise ConfigError(
                f"make_mesh: {name}={size} must be a positive axis size or -1; "
                f"with {n} devices try {_suggest(n, max(model, 1))}"
            )
    if data == -1:
        if n % model:
            raise ConfigError(f"make_mesh: model={model} does not divide the {n} devices; try {_suggest(n, model)}")
        data = n // model
    elif model == -1:
        if n % data:
            raise ConfigError(
                f"make_mesh: data={data} does not divide the {n} devices; "
                f"try data={n}, model=1 or another divisor of {n}"
            )
        model = n // data
    if data * model != n:
        raise ConfigError(
            f"make_mesh: data={data} x model={model} = {data * model} devices, but there are {n} devices; "
            f"the mesh must use every device, e.g. {_suggest(n, model)}"
        )
    return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def initialize_distributed(
    *,
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
) -> None:
    """Join a multi-process (multi-host) JAX job through ``jax.distributed.initialize``.

    Must be called before anything else touches JAX devices (``jax.devices()``, a jitted call,
    ``make_mesh``...): JAX fixes the set of processes when it creates its backend, and
    ``jax.distributed.initialize`` raises ``RuntimeError`` once the backend exists.

    Each argument falls back to an environment variable: ``TERRA_COORDINATOR`` ("host:port" of
    process 0), ``TERRA_NUM_PROCESSES`` and ``TERRA_PROCESS_ID``. When none of the three is
    given either way this is a single-process run and nothing happens. If only some are given,
    the rest are left to JAX's cluster auto-detection (TPU pods, Slurm, Open MPI).

    On CPU, cross-process collectives need an implementation; this pins
    ``jax_cpu_collectives_implementation`` to ``"gloo"`` (the JAX 0.10.2 default, pinned so a
    changed default cannot leave multi-process CPU runs without collectives) unless the user has
    chosen another one (``"mpi"``). The option is only read when a CPU client is created, so it
    is harmless on GPU/TPU.

    Calling it again after a successful initialisation does nothing.

    Raises:
      ConfigError: if an environment variable is not an integer.
    """
    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if coordinator_address is None and num_processes is None and process_id is None:
        return
    if jax.distributed.is_initialized():
        return
    if jax.config.jax_cpu_collectives_implementation in (None, "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info(
        "jax.distributed.initialize(coordinator_address=%s, num_processes=%s, process_id=%s)",
        coordinator_address,
        num_processes,
        process_id,
    )
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def describe_mesh(mesh: Mesh) -> str:
    """One line for the start-up log, e.g. ``mesh data=4 x model=2 over 8 cpu devices, 1 process``."""
    axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
    flat = list(mesh.devices.flat)
    platforms = sorted({d.platform for d in flat})
    processes = len({d.process_index for d in flat})
    return (
        f"mesh {axes} over {len(flat)} {'/'.join(platforms)} device{'s' if len(flat) != 1 else ''}, "
        f"{processes} process{'es' if processes != 1 else ''}"
    )

"""Logical-to-mesh sharding of parameters, optimizer state and batches.

terra follows T5X and MaxText: every parameter is created with *logical* axis names
(``("mlp", "embed")``, see ``terra.layers.axes``) and a list of rules maps those names onto the
mesh axes ``("data", "model")``. Changing how a model is partitioned means changing the rules
(data), never the layers. This module turns the names carried in Flax's
``nn.LogicallyPartitioned`` boxes into ``NamedSharding`` trees that ``jax.jit`` accepts as
``in_shardings``/``out_shardings``, so parameters and optimizer state are created already
sharded and the batch arrives split over ``data``.

Optimizer state cannot simply inherit the parameters' boxes (``docs/design/jax_stack.md``, pitfall 14):
``optax.adafactor(...).init(boxed_params)`` copies a parameter's box onto its factored second
moments, so ``v_row`` of a ``("embed", "mlp")`` kernel is rank 1 but still carries two names, and
``jax.jit(init, out_shardings=...)`` rejects it. ``opt_state_shardings`` therefore derives the
state's shardings itself, by matching each state leaf to the parameter at the same tree path and
comparing shapes (T5X solves the same problem with its own Adafactor and
``logical_factor_rules``).

Two more things the rules alone do not guarantee:

* ``jax.jit`` refuses uneven shards (``IndivisibleError``), so a dimension whose size the mesh
  axis does not divide (a vocabulary of 61 over ``model=2``) is replicated, with a warning,
  unless ``strict=True`` asks for an error.
* Parameters are created inside ``jax.jit(init, out_shardings=...)`` (``sharded_init``) so a
  model larger than one device's memory is never materialised on one device.
"""

import contextlib
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from terra.errors import ConfigError
from terra.layers.axes import DATA_AXIS, default_axis_rules
from terra.layers.initializers import compile_initializer

logger = logging.getLogger(__name__)

PyTree = Any
# One entry of a PartitionSpec: None, a mesh axis name, or a tuple of mesh axis names.
SpecEntry = Any


def _is_box(x) -> bool:
    return isinstance(x, meta.AxisMetadata)


def unboxed(tree: PyTree) -> PyTree:
    """``tree`` without metadata boxes. Unlike ``nn.unbox`` this never applies the boxes'
    sharding constraints, which fail on ``ShapeDtypeStruct`` values under ``jax.set_mesh``."""

    def value(leaf):
        if not _is_box(leaf):
            return leaf
        return unboxed(leaf.value if hasattr(leaf, "value") else leaf.unbox())

    return jax.tree_util.tree_map(value, tree, is_leaf=_is_box)


def _axis_size(mesh: Mesh, entry: SpecEntry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[name] for name in names)


def _entries(spec: P, rank: int) -> Tuple[SpecEntry, ...]:
    """A PartitionSpec as exactly ``rank`` entries (a spec may omit trailing ``None``)."""
    entries = tuple(spec)
    return entries + (None,) * (rank - len(entries))


def _divisible_entries(
    shape: Sequence[int], entries: Sequence[SpecEntry], mesh: Mesh
) -> Tuple[Tuple[SpecEntry, ...], List[int]]:
    """``entries`` with every dimension the mesh cannot split evenly replicated; and those dims."""
    kept, dropped = [], []
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        if size % _axis_size(mesh, entry):
            kept.append(None)
            dropped.append(dim)
        else:
            kept.append(entry)
    return tuple(kept), dropped


def _params_collection(tree: PyTree) -> PyTree:
    # ``abstract_variables()`` is ``{"params": ...}`` (plus any other collections); a bare
    # parameter tree has module names at the top, and no terra module is called "params".
    if isinstance(tree, Mapping) and "params" in tree and isinstance(tree["params"], Mapping):
        return tree["params"]
    return tree


def param_shardings(
    abstract_variables_or_params_boxed: PyTree,
    mesh: Mesh,
    rules: Optional[Sequence[Tuple[str, Any]]] = None,
    *,
    strict: bool = False,
) -> PyTree:
    """``NamedSharding`` for every parameter, from the logical names in its box.

    Args:
      abstract_variables_or_params_boxed: ``model.abstract_variables()`` (``{"params": ...}``),
        or the boxed ``params`` collection itself. Leaves are ``nn.LogicallyPartitioned``
        boxes (logical names, translated by ``rules``), ``nn.Partitioned`` boxes (names that
        already are mesh axes) or plain arrays/ShapeDtypeStructs (replicated).
      mesh: the ``("data", "model")`` mesh.
      rules: logical-to-mesh rules; default ``terra.layers.axes.default_axis_rules()``.
      strict: raise ``ConfigError`` when a sharded dimension is not divisible by its mesh axes
        instead of replicating that dimension.

    Returns:
      A tree with the structure of the *unboxed* params (``nn.unbox(variables)["params"]``)
      holding one ``NamedSharding`` per parameter; e.g. a ``("mlp", "embed")`` kernel of shape
      ``[d_ff, d_model]`` gets ``P("model", None)`` under the default rules.
    """
    if rules is None:
        rules = default_axis_rules()
    tree = _params_collection(abstract_variables_or_params_boxed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)
    shardings, uneven = [], []
    for path, leaf in flat:
        if isinstance(leaf, nn.LogicallyPartitioned):
            spec = nn.logical_to_mesh_axes(leaf.names, rules)
        elif isinstance(leaf, meta.Partitioned):
            spec = P(*leaf.names)
        else:
            spec = P()
        shape = tuple(np.shape(unboxed(leaf)))
        entries, dropped = _divisible_entries(shape, _entries(spec, len(shape)), mesh)
        if dropped:
            uneven.append(f"{jax.tree_util.keystr(path)} {shape} {spec} (dims {dropped})")
        shardings.append(NamedSharding(mesh, P(*entries)))
    if uneven:
        message = (
            f"{len(uneven)} parameter(s) have dimensions the mesh {dict(mesh.shape)} cannot split "
            f"evenly: {'; '.join(uneven)}"
        )
        if strict:
            raise ConfigError(message + ". Choose sizes divisible by the mesh axes or change the axis rules.")
        logger.warning("%s; those dimensions are replicated.", message)
    return jax.tree_util.tree_unflatten(treedef, shardings)


def _key_name(key) -> Any:
    """A path entry as a plain hashable value, so param and state paths compare equal."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _factored_axis(state_path: Tuple, param_shape: Tuple[int, ...]) -> Optional[int]:
    """The parameter axis optax's ``scale_by_factored_rms`` reduced to make this leaf, if known.

    optax factors the two largest dims, ``d1, d0 = argsort(shape)[-2], argsort(shape)[-1]``;
    ``v_row = mean(g**2, axis=d0)`` and ``v_col = mean(g**2, axis=d1)``. Repeating its
    ``np.argsort`` (rather than inferring the axis from shapes alone) keeps ties such as a
    square kernel resolved exactly as optax resolves them.
    """
    names = [_key_name(k) for k in state_path]
    if len(param_shape) < 2:
        return None
    order = np.argsort(param_shape)
    if "v_row" in names:
        return int(order[-1])
    if "v_col" in names:
        return int(order[-2])
    return None


def _reduced_entries(
    state_path: Tuple,
    state_shape: Tuple[int, ...],
    param_shape: Tuple[int, ...],
    param_entries: Tuple[SpecEntry, ...],
) -> Tuple[SpecEntry, ...]:
    """Spec entries for a state leaf that is its parameter with one axis reduced away.

    The reduced axis is the one named by optax's rule for ``v_row``/``v_col``; otherwise any
    axis whose removal gives ``state_shape``, keeping only the entries on which every such
    candidate agrees (replicating is always valid; guessing a wrong axis is not).
    """

    def drop(axis):
        return param_shape[:axis] + param_shape[axis + 1 :], param_entries[:axis] + param_entries[axis + 1 :]

    candidates = [axis for axis in range(len(param_shape)) if drop(axis)[0] == state_shape]
    if not candidates:
        return (None,) * len(state_shape)
    hinted = _factored_axis(state_path, param_shape)
    if hinted in candidates:
        return drop(hinted)[1]
    options = [drop(axis)[1] for axis in candidates]
    return tuple(column[0] if all(e == column[0] for e in column) else None for column in zip(*options))


def opt_state_shardings(
    optimizer: optax.GradientTransformation,
    abstract_params: PyTree,
    param_shardings: PyTree,
    mesh: Mesh,
) -> PyTree:
    """``NamedSharding`` for every leaf of ``optimizer.init(params)``, derived from the params'.

    Each state leaf is matched to the parameter whose tree path is the longest suffix of the
    leaf's path (``mu['encoder_0']['feed_forward']['wi']['kernel']`` ->
    ``['encoder_0']['feed_forward']['wi']['kernel']``), which works through ``optax.chain``,
    ``optax.inject_hyperparams`` and named-tuple states alike. Then:

    * same shape as the parameter (adam's ``mu``/``nu``, sgd momentum, unfactored adafactor
      ``v``): the parameter's sharding;
    * one rank lower and equal to the parameter with one axis removed (adafactor's factored
      ``v_row``/``v_col``): the parameter's spec with that axis's entry dropped; e.g. a
      ``[d_ff, d_model]`` kernel with ``P("model", None)`` and ``d_ff > d_model`` has
      ``v_row: [d_model]`` -> ``P(None)`` and ``v_col: [d_ff]`` -> ``P("model")``;
    * anything else (step counts, hyperparameters, adafactor's shape-``(1,)`` placeholders):
      replicated.

    A derived dimension the mesh cannot divide evenly is replicated.

    Args:
      optimizer: any optax transformation.
      abstract_params: the unboxed parameter tree (``ShapeDtypeStruct`` or arrays; boxes are
        unboxed here).
      param_shardings: ``param_shardings(...)`` for the same tree.
      mesh: the mesh the shardings live on.

    Returns:
      A tree with the structure of ``optimizer.init(abstract_params)``.
    """
    abstract_params = unboxed(abstract_params)
    abstract_state = jax.eval_shape(optimizer.init, abstract_params)

    param_flat, _ = jax.tree_util.tree_flatten_with_path(abstract_params)
    sharding_flat = jax.tree_util.tree_leaves(param_shardings)
    if len(param_flat) != len(sharding_flat):
        raise ConfigError(
            f"opt_state_shardings: {len(param_flat)} parameters but {len(sharding_flat)} shardings; "
            "param_shardings must be built for the same parameter tree"
        )
    by_path: Dict[Tuple, Tuple[Tuple[int, ...], Tuple[SpecEntry, ...]]] = {}
    for (path, leaf), sharding in zip(param_flat, sharding_flat):
        shape = tuple(np.shape(leaf))
        by_path[tuple(_key_name(k) for k in path)] = (shape, _entries(sharding.spec, len(shape)))

    def leaf_sharding(path, leaf) -> NamedSharding:
        shape = tuple(np.shape(leaf))
        names = tuple(_key_name(k) for k in path)
        # Longest suffix first: a state path is (optimizer prefix..., *param path).
        match = next((by_path[names[i:]] for i in range(len(names) + 1) if names[i:] in by_path), None)
        if match is None or not shape:
            return NamedSharding(mesh, P())
        param_shape, param_entries = match
        if shape == param_shape:
            entries = param_entries
        elif len(shape) == len(param_shape) - 1:
            entries = _reduced_entries(path, shape, param_shape, param_entries)
        else:
            return NamedSharding(mesh, P())
        entries, _ = _divisible_entries(shape, entries, mesh)
        return NamedSharding(mesh, P(*entries))

    return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``P("data")``: the leading (batch) axis split over ``data``, every other axis replicated."""
    return NamedSharding(mesh, P(DATA_AXIS))


def _local_data_shards(mesh: Mesh) -> int:
    """How many distinct slices along ``data`` this process's devices hold."""
    data_dim = mesh.axis_names.index(DATA_AXIS)
    me = jax.process_index()
    return len({index[data_dim] for index, d in np.ndenumerate(mesh.devices) if d.process_index == me})


def global_batch(host_batch: Mapping[str, np.ndarray], mesh: Mesh) -> Dict[str, jax.Array]:
    """Assemble each host's share of the batch into global arrays split over ``data``.

    Args:
      host_batch: feature name -> ``[local_batch, ...]`` numpy array, this process's rows of
        the global batch (every process passes the same local batch size).
      mesh: the mesh; rows go to the ``data`` axis, replicated over ``model``.

    Returns:
      feature name -> ``jax.Array`` of shape ``[global_batch, ...]`` with sharding
      ``P("data")``; ``global_batch = local_batch * data / (data slices on this process)``,
      i.e. ``local_batch * process_count`` when ``data`` spans all processes.

    Raises:
      ConfigError: if the global batch size is not divisible by the ``data`` axis size.
    """
    data = mesh.shape[DATA_AXIS]
    local_shards = _local_data_shards(mesh)
    sharding = batch_sharding(mesh)
    scalar_sharding = NamedSharding(mesh, P())

    def one(path, local):
        local = np.asarray(local)
        if local.ndim == 0:
            return jax.make_array_from_process_local_data(scalar_sharding, local)
        rows = local.shape[0]
        global_rows = rows * data // local_shards
        if rows % local_shards:
            smaller = (global_rows // data) * data
            larger = smaller + data
            hint = f"{smaller} or {larger}" if smaller else f"{larger}"
            raise ConfigError(
                f"global batch size {global_rows} (feature {jax.tree_util.keystr(path)}, {rows} rows on this "
                f"process) is not divisible by the data axis size {data}; use a multiple of {data}, e.g. {hint}"
            )
        return jax.make_array_from_process_local_data(sharding, local)

    return jax.tree_util.tree_map_with_path(one, dict(host_batch))


def _mesh_of(shardings: PyTree) -> Optional[Mesh]:
    for s in jax.tree_util.tree_leaves(shardings):
        if isinstance(s, NamedSharding):
            return s.mesh
    return None


def sharded_init(init_fn: Callable[[jax.Array], PyTree], rng: jax.Array, out_shardings: PyTree) -> PyTree:
    """``jax.jit(init_fn, out_shardings=out_shardings)(rng)``, compiled as an initializer
    (``terra.layers.initializers.compile_initializer``): every array is created on the devices
    that own it, never gathered on one.

    The mesh of the shardings is entered with ``jax.set_mesh`` while tracing, so logical
    activation constraints inside ``init_fn`` (active under ``nn.logical_axis_rules``) resolve.

    Args:
      init_fn: ``rng -> pytree``, e.g. ``lambda k: model.init_params(k)`` or an unboxed
        ``module.init``.
      rng: the PRNG key.
      out_shardings: ``NamedSharding`` tree matching ``init_fn``'s output (``param_shardings``).

    Returns:
      ``init_fn(rng)`` with the requested shardings; values equal the unsharded call's.
    """
    jitted = jax.jit(init_fn, out_shardings=out_shardings)
    mesh = _mesh_of(out_shardings)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return compile_initializer(jitted.trace(rng))(rng)


def describe_shardings(params: PyTree, shardings: PyTree, *, limit: int = 8) -> str:
    """A small table of the ``limit`` largest parameters: path, shape, PartitionSpec.

    Args:
      params: arrays or ``ShapeDtypeStruct``s (boxes are unboxed).
      shardings: the matching ``NamedSharding`` tree.
    """
    params = unboxed(params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = [s.spec for s in jax.tree_util.tree_leaves(shardings)]
    rows = sorted(
        ((jax.tree_util.keystr(path), tuple(np.shape(leaf)), spec) for (path, leaf), spec in zip(flat, specs)),
        key=lambda row: -math.prod(row[1]),
    )
    total = sum(math.prod(row[1]) for row in rows)
    shown = rows[:limit]
    width = max([len("parameter")] + [len(r[0]) for r in shown])
    shape_width = max([len("shape")] + [len(str(r[1])) for r in shown])
    lines = [
        f"{len(rows)} parameters, {total:,} values; largest {len(shown)}:",
        f"  {'parameter':<{width}}  {'shape':<{shape_width}}  spec",
    ]
    lines += [f"  {path:<{width}}  {str(shape):<{shape_width}}  {spec}" for path, shape, spec in shown]
    return "\n".join(lines)

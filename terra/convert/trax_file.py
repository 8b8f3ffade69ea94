"""Reading the weight files of the paper's own code (Trax) without Trax.

Trax writes weights with ``Layer.save_to_file`` (``gzip(pickle({'flat_weights': [...],
'flat_state': [...]}))``) and training checkpoints with ``Loop.save_checkpoint``; since the
2021 version of that format the checkpoint's ``'flat_weights'`` is an int (the gzip level) and
the arrays sit in a sibling ``<name>.weights.npy.gz``: one gzip stream of consecutive
``np.save`` records, bfloat16 stored as uint16 bit patterns. Either way ``flat_weights`` is the
depth-first list of the model's weight arrays (``fastmath.tree_flatten`` with empty entries
dropped), which :mod:`terra.convert.trax_layout` maps onto terra's parameters.

Unpickling runs code named by the file; only numpy's array reconstruction and plain
containers are allowed here, and Trax's own classes (``ShapeDtype`` in a checkpoint's
``input_signature``) are read as inert placeholders, so a file that names anything else is
refused instead of executed.
"""

import gzip
import os
import pickle
from typing import Any, List

import numpy as np

from terra.errors import CheckpointError

_ALLOWED_MODULES = ("numpy", "numpy.core", "numpy._core", "collections", "builtins", "_codecs")
_ALLOWED_BUILTINS = {"list", "tuple", "dict", "set", "frozenset", "int", "float", "bool", "complex", "bytes", "str"}


class TraxObject:
    """Stands in for an object of a Trax class found in a checkpoint (never needed for the
    weights): it accepts any constructor arguments and pickled state."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state


class _WeightsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        top = module.split(".")[0]
        if top == "trax":
            return type(name, (TraxObject,), {"__module__": module})
        if module == "builtins" and name not in _ALLOWED_BUILTINS:
            raise CheckpointError(f"the file asks to run builtins.{name} while unpickling; refusing to load it.")
        if top == "numpy" or module in _ALLOWED_MODULES:
            if module.startswith("numpy._core") and not hasattr(np, "_core"):  # numpy 1.x reading a numpy 2 pickle
                module = "numpy.core" + module[len("numpy._core") :]
            return super().find_class(module, name)
        raise CheckpointError(
            f"the file asks to import {module}.{name} while unpickling; a Trax weight file holds only "
            "numpy arrays in lists and dicts, so it was not loaded."
        )


def _flatten(tree: Any, out: List[np.ndarray]) -> None:
    """Depth-first leaves of nested lists/tuples/dicts, empty entries and Trax's shared-layer
    markers (``{'__marker_for_cached_weights_': ()}``) dropped, as ``tree_flatten`` does."""
    if isinstance(tree, np.ndarray):
        out.append(tree)
    elif isinstance(tree, dict):
        for key in sorted(tree):  # tree_flatten's order
            _flatten(tree[key], out)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _flatten(item, out)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out.append(np.asarray(tree))
    elif tree is not None:
        raise CheckpointError(f"unexpected {type(tree).__name__} among the weights; expected numpy arrays.")


def sibling_weights_path(path: str) -> str:
    """Where a Trax checkpoint written with a separate weights file keeps its arrays."""
    stem = path[: -len(".pkl.gz")] if path.endswith(".pkl.gz") else path
    return stem + ".weights.npy.gz"


def _read_sibling_arrays(path: str) -> List[np.ndarray]:
    arrays = []
    try:
        with gzip.open(path, "rb") as f:
            while True:
                try:
                    array = np.load(f, allow_pickle=False)
                except EOFError:
                    break
                except ValueError as e:
                    raise CheckpointError(f"{path}: record {len(arrays)} is not an np.save record ({e}).") from e
                # Trax stores bfloat16 as its uint16 bit pattern; widen exactly to float32.
                if array.dtype == np.uint16:
                    array = (array.astype(np.uint32) << 16).view(np.float32)
                arrays.append(array)
    except OSError as e:
        raise CheckpointError(f"{path} is not a readable gzip file: {e}") from e
    return arrays


def read_trax_weights(path: str) -> List[np.ndarray]:
    """The flat weight list of a Trax weight file or checkpoint (``*.pkl.gz``), as float32
    numpy arrays in Trax's order.

    Raises:
      CheckpointError: the file is missing, not gzip, not a pickle of Trax's layout, or needs
        a missing sibling ``.weights.npy.gz`` file; the message names the file.
    """
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist: give the Trax weight file (model.pkl.gz, written by Layer.save_to_file "
            "or a training Loop's checkpoint)."
        )
    try:
        with gzip.open(path, "rb") as f:
            content = _WeightsUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError, TypeError) as e:
        raise CheckpointError(
            f"{path} is not a Trax weight file (gzip-compressed pickle): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(content, dict) or "flat_weights" not in content:
        found = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise CheckpointError(f"{path} has no 'flat_weights' entry (found {found}); it is not a Trax weight file.")
    weights = content["flat_weights"]
    if isinstance(weights, int) and not isinstance(weights, bool):
        sibling = sibling_weights_path(path)
        if not os.path.isfile(sibling):
            raise CheckpointError(
                f"{path} keeps its weights in a separate file, and {sibling} does not exist; copy it next to "
                f"{os.path.basename(path)}."
            )
        flat = _read_sibling_arrays(sibling)
    else:
        flat = []
        _flatten(weights, flat)
    if not flat:
        raise CheckpointError(f"{path} holds no weight arrays.")
    return [np.asarray(a, dtype=np.float32) for a in flat]

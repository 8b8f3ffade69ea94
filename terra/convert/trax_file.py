"""Reading the weight files of the paper's own code (Trax) without Trax, as files from strangers.

Trax writes weights with ``Layer.save_to_file`` (``gzip(pickle({'flat_weights': [...],
'flat_state': [...], 'input_signature': ...}))``) and training checkpoints with
``Loop.save_checkpoint``. Under JAX the arrays in those pickles are jax arrays. Since the 2021
version of the Loop format the checkpoint's ``'flat_weights'`` is an int (the gzip level) and the
arrays sit in a sibling ``<name>.weights.npy.gz``: one gzip stream of consecutive ``np.save``
records, bfloat16 stored as uint16 bit patterns. Either way ``flat_weights`` is the depth-first
list of the model's weight arrays (``fastmath.tree_flatten`` with empty entries dropped), which
:mod:`terra.convert.trax_layout` maps onto terra's parameters.

Nothing the file names is run (:mod:`terra.convert.safe_pickle` allows an exact list of names,
each bound to a function that builds a numpy array), and nothing is allocated past what the
model needs: given the model's expected arrays (``leaves``), decompression of the pickle stops
at three times the model's float32 weight bytes plus 16 MiB (a 2020-format Loop checkpoint
keeps the weights and up to two optimizer slots inline), and every record of a sibling
``.weights.npy.gz`` has its shape and dtype checked against the model before its bytes are read.
"""

import gzip
import io
import math
import os
import stat
import zlib
from typing import Any, List, Optional, Sequence

import numpy as np

from terra.convert import safe_pickle
from terra.convert.limited_reader import LimitedReader
from terra.convert.trax_layout import leaf_line
from terra.errors import CheckpointError

# Without the model's expected arrays (a direct call of read_trax_weights), a file may inflate
# to this much.
DEFAULT_MAX_BYTES = 2 << 30
PICKLE_MARGIN_BYTES = 16 << 20
# A 2020-format Loop checkpoint holds the weights and the optimizer's slots (Adam: two per
# weight) inline; later formats and save_to_file hold less.
PICKLE_WEIGHT_COPIES = 3
# Pickle opcodes: about 20 per array (weights, state, slots) plus a training history's entries.
OPS_PER_ARRAY = 64
OPS_MARGIN = 2_000_000
NPY_MAX_HEADER = 10_000


def sibling_weights_path(path: str) -> str:
    """Where a Trax checkpoint written with a separate weights file keeps its arrays."""
    stem = path[: -len(".pkl.gz")] if path.endswith(".pkl.gz") else path
    return stem + ".weights.npy.gz"


def _regular_file(path: str, missing: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(missing) from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror}.") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or directory); give the weight file.")


def _read_npy_header(f: LimitedReader, path: str, index: int):
    """``(shape, fortran, dtype)`` of the next ``np.save`` record, or None at the end of the file.
    The header's length is checked before it is read; its text is parsed by numpy's own
    literal parser (``ast.literal_eval``), which runs no code."""
    magic = f.read(8)
    if not magic:
        return None
    if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
        raise CheckpointError(f"{path}: record {index} is not an np.save record.")
    major = magic[6]
    if major not in (1, 2, 3):
        raise CheckpointError(f"{path}: record {index} has np.save format version {major}, which numpy does not write.")
    length_bytes = f.read(2 if major == 1 else 4)
    length = int.from_bytes(length_bytes, "little")
    if len(length_bytes) != (2 if major == 1 else 4) or length > NPY_MAX_HEADER:
        raise CheckpointError(f"{path}: record {index} declares a {length}-byte header; np.save writes under 10 KB.")
    header = f.read(length)
    reread = io.BytesIO(magic + length_bytes + header)
    reread.seek(8)
    try:
        reader = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(reread, max_header_size=NPY_MAX_HEADER)
    except (ValueError, SyntaxError, TypeError) as e:
        raise CheckpointError(f"{path}: record {index} has an unreadable np.save header ({e}).") from None
    if dtype.hasobject or dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(
            f"{path}: record {index} declares dtype {dtype}; a Trax weights file holds numeric arrays only, so it "
            "was not read."
        )
    if len(shape) > safe_pickle.MAX_NDIM:
        raise CheckpointError(f"{path}: record {index} declares {len(shape)} dimensions.")
    return shape, fortran, dtype


def _read_sibling_arrays(path: str, leaves: Optional[Sequence[Any]]) -> List[np.ndarray]:
    _regular_file(path, f"{path} does not exist.")
    if leaves is None:
        budget = DEFAULT_MAX_BYTES
    else:  # float64 at most per element, plus every header
        budget = sum(8 * math.prod(leaf.shape) for leaf in leaves) + (len(leaves) + 1) * (NPY_MAX_HEADER + 16)
    arrays: List[np.ndarray] = []
    try:
        with gzip.open(path, "rb") as raw:
            f = LimitedReader(raw, budget, path, "the model's weights take in float64")
            while True:
                index = len(arrays)
                header = _read_npy_header(f, path, index)
                if header is None:
                    break
                shape, fortran, dtype = header
                if leaves is not None and index >= len(leaves):
                    raise CheckpointError(
                        f"{path} holds more than the {len(leaves)} arrays the model expects: extra [{index}] shape "
                        f"{shape}. The file's model has more layers or weights than the arguments describe."
                    )
                if leaves is not None and tuple(shape) != tuple(leaves[index].shape):
                    raise CheckpointError(
                        f"{path}: array [{index}] has shape {shape}, but the model expects "
                        f"{leaf_line(index, leaves[index])}. The Trax arguments (or gin config) do not "
                        "describe the model that wrote the file."
                    )
                nbytes = math.prod(shape) * dtype.itemsize
                data = f.read(nbytes)
                if len(data) != nbytes:
                    raise CheckpointError(f"{path}: record {index} ends after {len(data)} of its {nbytes} bytes.")
                array = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")
                # Trax stores bfloat16 as its uint16 bit pattern; widen exactly to float32.
                if dtype.kind == "u" and dtype.itemsize == 2:
                    array = (array.astype(np.uint32) << 16).view(np.float32)
                arrays.append(array)
    except (OSError, EOFError, zlib.error) as e:
        raise CheckpointError(f"{path} is not a readable gzip file: {e}") from None
    return arrays


def _flatten(tree: Any, out: List[np.ndarray], depth: int = 0) -> None:
    """Depth-first leaves of nested lists/tuples/dicts, empty entries and Trax's shared-layer
    markers (``{'__marker_for_cached_weights_': ()}``) dropped, as ``tree_flatten`` does."""
    if depth > safe_pickle.MAX_NESTING:
        raise CheckpointError(f"the weights nest more than {safe_pickle.MAX_NESTING} deep.")
    if isinstance(tree, (np.ndarray, np.generic)):
        out.append(np.asarray(tree))
    elif isinstance(tree, dict):
        if not all(isinstance(key, str) for key in tree):
            raise CheckpointError("a dict among the weights has keys that are not strings.")
        for key in sorted(tree):  # tree_flatten's order
            _flatten(tree[key], out, depth + 1)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _flatten(item, out, depth + 1)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out.append(np.asarray(tree, np.float32))
    elif tree is not None:
        raise CheckpointError(f"unexpected {type(tree).__name__} among the weights; expected numeric arrays.")


def _pickle_budget(leaves: Optional[Sequence[Any]]):
    if leaves is None:
        return DEFAULT_MAX_BYTES, "terra reads without a model to check against", 4 * OPS_MARGIN
    weights = sum(4 * math.prod(leaf.shape) for leaf in leaves)
    why = (
        f"that {PICKLE_WEIGHT_COPIES} float32 copies of the model's weights ({len(leaves)} arrays) plus 16 MiB take "
        "(weights and two optimizer slots)"
    )
    return PICKLE_WEIGHT_COPIES * weights + PICKLE_MARGIN_BYTES, why, OPS_PER_ARRAY * 4 * len(leaves) + OPS_MARGIN


def read_trax_weights(path: str, leaves: Optional[Sequence[Any]] = None) -> List[np.ndarray]:
    """The flat weight list of a Trax weight file or checkpoint (``*.pkl.gz``), as float32
    numpy arrays in Trax's order.

    Args:
      path: the ``.pkl.gz`` file.
      leaves: the arrays the model expects, in file order
        (:func:`terra.convert.trax_layout.trax_leaves`); they size the read limits and are
        checked against a sibling ``.weights.npy.gz`` record by record. Without them the file
        may inflate to ``DEFAULT_MAX_BYTES``.

    Raises:
      CheckpointError: the file is missing, not gzip, not a pickle of Trax's layout, names
        anything outside the allowed list, exceeds the limits, holds non-numeric arrays, or
        needs a missing sibling ``.weights.npy.gz`` file; the message names the file.
    """
    _regular_file(
        path,
        f"{path} does not exist: give the Trax weight file (model.pkl.gz, written by Layer.save_to_file or a "
        "training Loop's checkpoint).",
    )
    budget, why, max_ops = _pickle_budget(leaves)
    try:
        with gzip.open(path, "rb") as raw:
            content = safe_pickle.load(LimitedReader(raw, budget, path, why), max_ops)
    except CheckpointError as e:
        message = str(e)
        if not message.startswith(path):
            message = f"{path} {message}" if message.startswith("is not") else f"{path}: {message}"
        raise CheckpointError(message) from None
    except (OSError, EOFError, zlib.error) as e:
        raise CheckpointError(f"{path} is not a Trax weight file (gzip-compressed pickle): {e}") from None
    if not isinstance(content, dict) or "flat_weights" not in content:
        found = sorted(map(str, content)) if isinstance(content, dict) else type(content).__name__
        raise CheckpointError(f"{path} has no 'flat_weights' entry (found {found}); it is not a Trax weight file.")
    weights = content["flat_weights"]
    if isinstance(weights, int) and not isinstance(weights, bool):
        sibling = sibling_weights_path(path)
        if not os.path.exists(sibling):
            raise CheckpointError(
                f"{path} keeps its weights in a separate file, and {sibling} does not exist; copy it next to "
                f"{os.path.basename(path)}."
            )
        flat = _read_sibling_arrays(sibling, leaves)
    else:
        flat = []
        try:
            _flatten(weights, flat)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    if not flat:
        raise CheckpointError(f"{path} holds no weight arrays.")
    for index, array in enumerate(flat):
        if array.dtype.kind != "f":
            raise CheckpointError(
                f"{path}: weight array [{index}] has dtype {array.dtype}; Trax's weights are floating-point, so the "
                "file is not a weight file of this kind."
            )
    return [np.asarray(a, dtype=np.float32) for a in flat]

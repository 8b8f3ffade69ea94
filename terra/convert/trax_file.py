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
each bound to a function that builds a numpy array, and fetches no object twice), and nothing is
allocated past what the model needs: given the model's expected arrays (``leaves``), the weights
the pickle keeps may take the model's float64 size plus 16 MiB, and whatever else it holds (the
state, a predict-mode model's decode caches, a Loop's optimizer slots and history) is read and
dropped, up to four times the model's float32 size plus 2 GiB; a sibling ``.weights.npy.gz`` has
every record's shape and dtype checked against the model before its bytes are read. The whole
stream is read to its end, so gzip checks its CRC and nothing may follow the pickle, and every
weight is checked to be finite. The weights are returned as stored (views of the bytes read) and
checked against the model's count and shapes (``trax_layout.to_terra_params``) before any is
converted to float32, so a file cannot make terra convert or copy more than the model holds.
"""

import gzip
import math
import os
import re
import stat
import zlib
from typing import Any, List, Optional, Sequence

import numpy as np

from terra.convert import safe_pickle
from terra.convert.limited_reader import LimitedReader, describe_bytes
from terra.convert.trax_layout import leaf_line
from terra.errors import CheckpointError

# Without the model's expected arrays (a direct call of read_trax_weights), a file may inflate
# to this much.
DEFAULT_MAX_BYTES = 2 << 30
PICKLE_MARGIN_BYTES = 16 << 20
# Bytes of arrays that are not weights (read past and dropped at once): a 2020-format Loop
# checkpoint's two Adam slots per weight, a predict-mode model's decode caches, the state.
DROPPED_WEIGHT_COPIES = 4
DROPPED_MARGIN_BYTES = 2 << 30
# Pickle opcodes: about 20 per array (weights, state, slots) plus a training history's entries.
OPS_PER_ARRAY = 64
OPS_MARGIN = 2_000_000
NPY_MAX_HEADER = 10_000
# np.save's header for a numeric array, the only kind a Trax weights file holds: read with this
# pattern (not numpy's literal parser), so no header can make a parser recurse or build a dtype.
_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[biuf][1248])', 'fortran_order': (True|False), "
    r"'shape': \(((?:\d{1,15}, ?)*\d{1,15},?)?\),? ?\}[ \n]*"
)


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
    The header's length is checked before it is read, and its text must be the header np.save
    writes for a numeric array (:data:`_NPY_HEADER`)."""
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
    header = f.read(length).decode("latin1")
    match = _NPY_HEADER.fullmatch(header)
    if match is None:
        raise CheckpointError(
            f"{path}: record {index} has a header np.save does not write for a numeric array "
            f"({safe_pickle.shown(header.strip(), 120)}); a Trax weights file holds numeric arrays only, so it was "
            "not read."
        )
    descr, fortran, dims = match.groups()
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d) if dims else ()
    if len(shape) > safe_pickle.MAX_NDIM:
        raise CheckpointError(f"{path}: record {index} declares {len(shape)} dimensions.")
    return shape, fortran == "True", np.dtype(descr)


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
    """``(bytes kept, why, bytes read past, why, opcodes)`` for a model with the expected arrays
    ``leaves`` (None: the defaults of a read without a model to check against)."""
    if leaves is None:
        why = "terra reads without a model to check against"
        return DEFAULT_MAX_BYTES, why, DEFAULT_MAX_BYTES, why, 4 * OPS_MARGIN
    weights = sum(4 * math.prod(leaf.shape) for leaf in leaves)
    kept_why = f"that the model's weights ({len(leaves)} arrays) take in float64, plus 16 MiB"
    skipped_why = (
        f"terra reads past for this model: {DROPPED_WEIGHT_COPIES} float32 copies of its weights plus "
        f"{describe_bytes(DROPPED_MARGIN_BYTES)} of state, decode caches, optimizer slots and history"
    )
    return (
        2 * weights + PICKLE_MARGIN_BYTES,
        kept_why,
        DROPPED_WEIGHT_COPIES * weights + DROPPED_MARGIN_BYTES,
        skipped_why,
        OPS_PER_ARRAY * 4 * len(leaves) + OPS_MARGIN,
    )


def read_trax_weights(path: str, leaves: Optional[Sequence[Any]] = None) -> List[np.ndarray]:
    """The flat weight list of a Trax weight file or checkpoint (``*.pkl.gz``), in Trax's order,
    as floating-point numpy arrays of the type they were stored in (bfloat16 widened to float32
    exactly; ``trax_layout.to_terra_params`` converts each to float32 once its shape is checked).

    Args:
      path: the ``.pkl.gz`` file.
      leaves: the arrays the model expects, in file order
        (:func:`terra.convert.trax_layout.trax_leaves`); they size the read limits and are
        checked against a sibling ``.weights.npy.gz`` record by record. Without them the file
        may inflate to ``DEFAULT_MAX_BYTES``.

    Raises:
      CheckpointError: the file is missing, not gzip, damaged (a CRC that does not match, data
        after the pickle), not a pickle of Trax's layout, names anything outside the allowed
        list, exceeds the limits, holds non-numeric or non-finite arrays, or needs a missing
        sibling ``.weights.npy.gz`` file; the message names the file.
    """
    _regular_file(
        path,
        f"{path} does not exist: give the Trax weight file (model.pkl.gz, written by Layer.save_to_file or a "
        "training Loop's checkpoint).",
    )
    kept, kept_why, skipped, skipped_why, max_ops = _pickle_budget(leaves)
    try:
        with gzip.open(path, "rb") as raw:
            stream = LimitedReader(raw, kept, path, kept_why, skipped, skipped_why)
            content = safe_pickle.load(stream, max_ops)
            if not stream.at_end():  # the reader stops at the pickle's STOP; the gzip stream must end there
                raise CheckpointError(
                    f"{path} continues after the end of its pickle; a Trax weight file ends there, so this one is "
                    "damaged (two files joined, or garbage appended)."
                )
    except CheckpointError as e:
        message = str(e)
        if not message.startswith(path):
            message = f"{path} {message}" if message.startswith("is not") else f"{path}: {message}"
        raise CheckpointError(message) from None
    except (OSError, EOFError, zlib.error) as e:
        raise CheckpointError(
            f"{path} is not a Trax weight file (a gzip-compressed pickle), or it is damaged: {str(e)[:200]}"
        ) from None
    if not isinstance(content, dict) or "flat_weights" not in content:
        found = sorted(map(safe_pickle.shown, content)) if isinstance(content, dict) else type(content).__name__
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
        _check_finite(path, index, array, leaves)
    return flat


def _check_finite(path: str, index: int, array: np.ndarray, leaves: Optional[Sequence[Any]]) -> None:
    """A weight with NaN or infinite values makes every output NaN: the file is damaged, or was
    saved after training diverged. Refused, naming the array."""
    bad = array.size - int(np.count_nonzero(np.isfinite(array)))
    if bad:
        name = leaf_line(index, leaves[index]) if leaves is not None and index < len(leaves) else f"[{index}]"
        raise CheckpointError(
            f"{path}: weight array {name} holds {bad:,d} NaN or infinite value(s) of {array.size:,d}; a trained "
            "model's weights are finite, so the file is damaged or was saved after training diverged. Convert an "
            "earlier checkpoint."
        )

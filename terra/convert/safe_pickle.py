"""Unpickling a stranger's weight file without running anything it names.

A pickle is a program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes import any callable by name and
``REDUCE`` calls it. :func:`load` runs that program with every name looked up in
:data:`ALLOWED_NAMES`, an exact list of ``(module, name)`` pairs, each bound to a small function
*of this module* that checks its arguments and builds a numpy array, a dtype or an empty
container. No real numpy, jax, collections or builtins callable is ever handed to the file: no
attribute of an allowed module is reachable, dotted names are not looked up, and the opcodes
that reach other registries (``EXT*``, ``PERSID``, out-of-band buffers, ``INST``/``OBJ``) are not
run at all. ``BUILD`` (``__setstate__``) applies only to this module's own placeholders.

The names are those Trax's files contain under JAX and numpy 1 or 2 (``Layer.save_to_file`` and
a training ``Loop`` checkpoint; see docs/coming_from_trax.md): numpy arrays, numpy scalars,
dtypes (bfloat16 through ``ml_dtypes``), jax arrays (``jax._src.array._reconstruct_array``,
rebuilt here as numpy arrays), the ``defaultdict(list)`` of a Loop's history and the
``trax.shapes.ShapeDtype`` of its input signature (an inert record).

Resources: the stream is read through :class:`~terra.convert.limited_reader.LimitedReader`, so
every length the file declares is checked against the byte budget before it is read; the number
of opcodes is bounded (``max_ops``), so a small file cannot build millions of tiny objects; an
array's bytes must match its declared shape and dtype, and only numeric dtypes are accepted.
"""

import math
import pickle
import pickletools
import zlib
from typing import Any, Dict, Tuple

import numpy as np

from terra.errors import CheckpointError

# numpy dtype codes a weight file may use; anything else (object 'O', strings, structured,
# datetimes, complex) is refused before an array is made.
_NUMERIC_CODES = {
    "b1": np.bool_,
    "?": np.bool_,
    "i1": np.int8,
    "i2": np.int16,
    "i4": np.int32,
    "i8": np.int64,
    "u1": np.uint8,
    "u2": np.uint16,
    "u4": np.uint32,
    "u8": np.uint64,
    "f2": np.float16,
    "f4": np.float32,
    "f8": np.float64,
}
_BYTE_ORDERS = {"<": "<", ">": ">", "|": "<", "=": "="}
MAX_NDIM = 8
MAX_NESTING = 64


class _Marker:
    """A named stand-in for a type the file refers to but never gets (``numpy.ndarray``,
    ``builtins.list``, ``ml_dtypes.bfloat16``): it can be passed, compared and nothing else."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


_NDARRAY = _Marker("numpy.ndarray")
_LIST = _Marker("builtins.list")
_BFLOAT16 = _Marker("ml_dtypes.bfloat16")


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(
        f"{what}; a Trax weight file holds only numeric arrays in lists and dicts, so it was not loaded."
    )


class Dtype:
    """A numpy dtype described by the file (``numpy.dtype(code, align, copy)`` plus its state),
    limited to the numeric codes above and bfloat16."""

    def __init__(self, code, align=False, copy=True):
        if code is _BFLOAT16:
            self.code = "bf16"
        elif isinstance(code, str) and code.lstrip("<>|=") in _NUMERIC_CODES and len(code) <= 3:
            self.code = code.lstrip("<>|=")
        else:
            kind = "object" if isinstance(code, str) and code.lstrip("<>|=").startswith("O") else repr(code)
            raise _refuse(f"the file declares an array of dtype {kind}")
        self.order = code[0] if isinstance(code, str) and code[0] in "<>" else "<"

    def __setstate__(self, state):
        # numpy's dtype state: (version, byte order, subarray, names, fields, elsize, align, flags)
        if not isinstance(state, tuple) or len(state) < 5 or any(part is not None for part in state[2:5]):
            raise _refuse("the file declares a structured or sub-array dtype")
        if state[1] not in _BYTE_ORDERS:
            raise _refuse(f"the file declares the byte order {state[1]!r}")
        self.order = _BYTE_ORDERS[state[1]]

    def fresh(self) -> "Dtype":
        """A copy for one file, so a BUILD on it cannot change the allow-list's entry."""
        copy = Dtype.__new__(Dtype)
        copy.code, copy.order = self.code, self.order
        return copy

    @property
    def itemsize(self) -> int:
        return 2 if self.code == "bf16" else np.dtype(_NUMERIC_CODES[self.code]).itemsize

    def array(self, data, shape: Tuple[int, ...], fortran: bool) -> np.ndarray:
        """The array of ``shape`` whose bytes are ``data``; bfloat16 widened to float32 exactly."""
        shape = _shape(shape)
        count = math.prod(shape)  # exact: a declared (10^6, 10^6) is compared, never allocated
        if not isinstance(data, (bytes, bytearray)) or len(data) != count * self.itemsize:
            size = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
            raise _refuse(f"an array of shape {shape} and dtype {self.code} comes with {size} bytes of data")
        if self.code == "bf16":
            bits = np.frombuffer(data, np.dtype(np.uint16).newbyteorder(self.order))
            flat = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            flat = np.frombuffer(data, np.dtype(_NUMERIC_CODES[self.code]).newbyteorder(self.order))
        return flat.reshape(shape, order="F" if fortran else "C").astype(flat.dtype.newbyteorder("="), copy=True)


def _shape(shape) -> Tuple[int, ...]:
    if (
        not isinstance(shape, tuple)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
    ):
        raise _refuse(f"the file declares the array shape {shape!r}")
    return shape


class PendingArray:
    """What ``numpy.core.multiarray._reconstruct`` returns: an array whose shape, dtype and bytes
    arrive in the following ``BUILD``."""

    array = None

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) != 5:
            raise _refuse("an array's state is not numpy's (version, shape, dtype, fortran, data)")
        _, shape, dtype, fortran, data = state
        if not isinstance(dtype, Dtype):
            raise _refuse("an array's dtype is not a numpy dtype")
        self.array = dtype.array(data, shape, bool(fortran))


class TraxShapeDtype:
    """``trax.shapes.ShapeDtype`` (a checkpoint's input signature): kept as an inert record."""

    def __setstate__(self, state):
        self.state = state


def _reconstruct(cls, shape=(0,), typecode=b"b"):
    if cls is not _NDARRAY:
        raise _refuse("the file asks numpy to reconstruct something other than an ndarray")
    return PendingArray()


def _reconstruct_jax_array(fun, args, arr_state, aval_state):
    """``jax._src.array._reconstruct_array``: jax pickles its arrays as numpy's reconstruction
    plus an abstract-value dict; the array is rebuilt here as numpy, never on a device."""
    if fun is not _reconstruct or not isinstance(args, tuple) or not isinstance(aval_state, dict):
        raise _refuse("a jax array's reconstruction names something other than numpy's ndarray")
    pending = _reconstruct(*args)
    pending.__setstate__(arr_state)
    return pending.array


def _frombuffer(buffer, dtype, shape, order):
    """``numpy.core.numeric._frombuffer``: numpy's protocol-5 form of an array."""
    if not isinstance(dtype, Dtype) or order not in ("C", "F"):
        raise _refuse("an array's dtype or memory order is not numpy's")
    return dtype.array(bytes(buffer) if isinstance(buffer, bytearray) else buffer, shape, order == "F")


def _scalar(dtype, data=None):
    """``numpy.core.multiarray.scalar``: a numpy scalar (a Loop history's metric values)."""
    if not isinstance(dtype, Dtype):
        raise _refuse("a numpy scalar's dtype is not a numpy dtype")
    return dtype.array(data, (), False)[()]


def _defaultdict(factory=None):
    """``collections.defaultdict(list)`` (a Loop's history per mode): a plain dict."""
    if factory not in (None, _LIST):
        raise _refuse("a defaultdict names a factory other than list")
    return {}


def _ordered_dict():
    return {}


_SCALAR_TYPES = ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16")
_SCALAR_TYPES += ("float32", "float64")

# Every (module, name) a Trax weight file may name, and what it gets instead.
ALLOWED_NAMES: Dict[Tuple[str, str], Any] = {
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): Dtype,
    ("ml_dtypes", "bfloat16"): _BFLOAT16,
    ("jax._src.array", "_reconstruct_array"): _reconstruct_jax_array,
    ("trax.shapes", "ShapeDtype"): TraxShapeDtype,
    ("collections", "defaultdict"): _defaultdict,
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "list"): _LIST,
}
for _core in ("numpy.core", "numpy._core"):  # numpy 1 and numpy 2 pickles
    ALLOWED_NAMES[(f"{_core}.multiarray", "_reconstruct")] = _reconstruct
    ALLOWED_NAMES[(f"{_core}.multiarray", "scalar")] = _scalar
    ALLOWED_NAMES[(f"{_core}.numeric", "_frombuffer")] = _frombuffer
for _module in ("numpy", "jax.numpy"):  # ShapeDtype(shape, np.int32): the type stands for its dtype
    for _name in _SCALAR_TYPES:
        ALLOWED_NAMES[(_module, _name)] = Dtype(np.dtype(_name).str)

# Instances whose state a BUILD opcode may set: this module's placeholders only.
_BUILDABLE = (Dtype, PendingArray, TraxShapeDtype)

_OPCODES_NOT_RUN = {
    pickle.INST,  # protocol 0 instantiation by name
    pickle.OBJ,
    pickle.EXT1,  # copyreg's extension registry
    pickle.EXT2,
    pickle.EXT4,
    pickle.PERSID,  # persistent ids: another object store
    pickle.BINPERSID,
    pickle.NEXT_BUFFER,  # protocol 5 out-of-band buffers
    pickle.READONLY_BUFFER,
}


class _AllowListUnpickler(pickle._Unpickler):  # the pure-Python unpickler: every opcode is ours to check
    dispatch = {}

    def __init__(self, stream, max_ops: int):
        super().__init__(stream)
        self._ops_left = max_ops

    def count_operation(self) -> None:
        self._ops_left -= 1
        if self._ops_left < 0:
            raise _refuse("the file holds more pickle operations than a Trax weight file of this model")

    def find_class(self, module, name):
        target = ALLOWED_NAMES.get((module, name))
        if target is None:
            raise _refuse(f"the file asks to import {module}.{name} while unpickling")
        return target.fresh() if isinstance(target, Dtype) else target

    def load_build(self):
        state = self.stack.pop()
        if not isinstance(self.stack[-1], _BUILDABLE):
            raise _refuse(f"the file sets the state of a {type(self.stack[-1]).__name__}")
        self.stack[-1].__setstate__(state)

    def load_bytearray8(self):
        # The base class allocates bytearray(n) before reading; read (budget-checked) first.
        (n,) = pickle.unpack("<Q", self.read(8))
        data = self.read(n)
        if len(data) != n:
            raise EOFError
        self.append(bytearray(data))


def _counted(handler):
    def run(unpickler):
        unpickler.count_operation()
        handler(unpickler)

    return run


for _code, _handler in pickle._Unpickler.dispatch.items():
    if bytes([_code]) in _OPCODES_NOT_RUN:
        continue
    _handler = {
        pickle.BUILD[0]: _AllowListUnpickler.load_build,
        pickle.BYTEARRAY8[0]: _AllowListUnpickler.load_bytearray8,
    }.get(_code, _handler)
    _AllowListUnpickler.dispatch[_code] = _counted(_handler)


def load(stream, max_ops: int) -> Any:
    """The object a weight file's pickle describes, arrays as numpy (bfloat16 widened to float32).

    Args:
      stream: the decompressed bytes, a :class:`~terra.convert.limited_reader.LimitedReader`.
      max_ops: the most pickle opcodes to run.

    Raises:
      CheckpointError: a name outside :data:`ALLOWED_NAMES`, an opcode not run here, a
        non-numeric or inconsistent array, a budget exceeded, or a malformed pickle.
    """
    unpickler = _AllowListUnpickler(stream, max_ops)
    try:
        content = unpickler.load()
    except (CheckpointError, OSError, zlib.error):  # the stream's own errors go to the caller
        raise
    except KeyError as e:
        code = e.args[0] if e.args else None
        if isinstance(code, int) and code not in _AllowListUnpickler.dispatch:
            opcode = pickletools.code2op.get(chr(code))
            name = opcode.name if opcode else f"byte {code:#04x}"
            raise _refuse(f"the file uses the pickle opcode {name}, which this loader does not run") from None
        raise CheckpointError(f"is not a Trax weight file (a readable pickle): KeyError: {e}") from None
    except Exception as e:  # malformed: truncated, wrong types on the stack, a missing memo entry
        raise CheckpointError(f"is not a Trax weight file (a readable pickle): {type(e).__name__}: {e}") from None
    return resolve(content)


def resolve(tree, depth: int = 0):
    """``tree`` with every :class:`PendingArray` replaced by its array (containers copied)."""
    if depth > MAX_NESTING:
        raise _refuse(f"the pickle nests containers more than {MAX_NESTING} deep")
    if isinstance(tree, PendingArray):
        if tree.array is None:
            raise _refuse("an array was declared but never given its data")
        return tree.array
    if isinstance(tree, dict):
        return {key: resolve(value, depth + 1) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [resolve(item, depth + 1) for item in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree

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

Nothing is paid for twice. A pickle names an object again with a memo ``GET`` (a few bytes), and
each copy would then be used again: arrays built over one buffer, containers copied while the
result is resolved, a shared list nested in itself. Trax's files share only what the pickler
shares for every array (the allowed functions, dtypes, and small constants such as ``(0,)`` and
``'C'``), so a ``GET`` may fetch only such a value (:func:`shareable`); any other object is kept in
the memo as a marker that refuses to be fetched, and ``DUP`` and the set opcodes are not run. Each
object then exists once and is built from its own bytes, so the work and memory of a load are
linear in the bytes read. Dict keys are strings or small integers (hashing is then linear too).

Only the weights are kept. Under the outermost dict's ``'flat_weights'`` key (or where the file
is not such a dict) bytes are read and arrays built as views of them; under any other key (the
model's state, a predict-mode model's decode caches, a Loop's optimizer slots and history) data
is streamed past in 1 MiB pieces and counted against the reader's separate allowance for it
(:meth:`~terra.convert.limited_reader.LimitedReader.skip`), and each array there becomes a
:class:`DroppedArray` that records its shape and dtype. Memory is then what the weights take,
whatever else the file holds.
"""

import math
import pickle
import pickletools
import zlib
from typing import Any, Dict, Optional, Tuple

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


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message about a file's content:
    an integer of a million digits has no decimal form Python will write (ValueError), and a long
    string would bury the message."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of {value.bit_length():,d} bits"
    if type(value) is tuple and len(value) <= MAX_NDIM:  # a shape: each dimension shown on its own
        text = "(" + ", ".join(shown(v, limit) for v in value) + ("," if len(value) == 1 else "") + ")"
        return text if len(text) <= limit else text[: limit - 3] + "..."
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class DroppedBytes:
    """Bytes the file holds outside the weights, streamed past unread: only their length is kept."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return self.length


class DroppedArray:
    """An array of the file that is not a weight (state, optimizer slots, history), read past: its
    ``shape`` and ``dtype`` code are kept for messages."""

    def __init__(self, shape: Tuple[int, ...], dtype: str):
        self.shape, self.dtype = tuple(shape), dtype

    def __repr__(self):
        return f"DroppedArray(shape={self.shape}, dtype={self.dtype})"


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
            kind = "object" if isinstance(code, str) and code.lstrip("<>|=").startswith("O") else shown(code)
            raise _refuse(f"the file declares an array of dtype {kind}")
        self.order = code[0] if isinstance(code, str) and code[0] in "<>" else "<"

    def __setstate__(self, state):
        # numpy's dtype state: (version, byte order, subarray, names, fields, elsize, align, flags)
        if not isinstance(state, tuple) or len(state) < 5 or any(part is not None for part in state[2:5]):
            raise _refuse("the file declares a structured or sub-array dtype")
        if state[1] not in _BYTE_ORDERS:
            raise _refuse(f"the file declares the byte order {shown(state[1])}")
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
        if not isinstance(data, (bytes, bytearray, DroppedBytes)) or len(data) != count * self.itemsize:
            size = len(data) if isinstance(data, (bytes, bytearray, DroppedBytes)) else type(data).__name__
            raise _refuse(f"an array of shape {shape} and dtype {self.code} comes with {size} bytes of data")
        if isinstance(data, DroppedBytes):
            return DroppedArray(shape, self.code)
        if self.code == "bf16":
            bits = np.frombuffer(data, np.dtype(np.uint16).newbyteorder(self.order))
            flat = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            flat = np.frombuffer(data, np.dtype(_NUMERIC_CODES[self.code]).newbyteorder(self.order))
        if not flat.dtype.isnative:  # the only copy: a view of the file's bytes otherwise
            flat = flat.astype(flat.dtype.newbyteorder("="))
        return flat.reshape(shape, order="F" if fortran else "C")


def _shape(shape) -> Tuple[int, ...]:
    if (
        not isinstance(shape, tuple)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
    ):
        raise _refuse(f"the file declares the array shape {shown(shape)}")
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
    return dtype.array(buffer, shape, order == "F")


def _scalar(dtype, data=None):
    """``numpy.core.multiarray.scalar``: a numpy scalar (a Loop history's metric values)."""
    if not isinstance(dtype, Dtype):
        raise _refuse("a numpy scalar's dtype is not a numpy dtype")
    array = dtype.array(data, (), False)
    return array if isinstance(array, DroppedArray) else array[()]


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
# What the allow-list hands out: the pickler memoizes each once and fetches it for every array.
_ALLOWED_TARGETS = {id(target) for target in ALLOWED_NAMES.values()}

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
    pickle.DUP,  # one object in two places: the pickler never writes it, a crafted file would
    pickle.EMPTY_SET,  # sets: no Trax file holds one
    pickle.ADDITEMS,
    pickle.FROZENSET,
}
# The largest values a memo GET may fetch again (module docstring): names, typecodes, shapes.
SHAREABLE_STR = 1024
SHAREABLE_BYTES = 64
SHAREABLE_TUPLE = 8
# Dict keys: strings, or integers of at most this many bits.
KEY_INT_BITS = 32
WEIGHTS_KEY = "flat_weights"


def shareable(value, depth: int = 0) -> bool:
    """Whether a memo GET may fetch ``value`` again: an allowed function, class or marker, a
    dtype, ``None``, a bool, a number of at most 64 bits, a short string or bytes, or a short
    tuple of these (at most two levels). Using any of these twice costs nothing twice."""
    if value is None or isinstance(value, (bool, float, Dtype, _Marker)) or id(value) in _ALLOWED_TARGETS:
        return True
    if isinstance(value, int):
        return value.bit_length() <= 64
    if isinstance(value, str):
        return len(value) <= SHAREABLE_STR
    if isinstance(value, (bytes, DroppedBytes)):
        return len(value) <= SHAREABLE_BYTES
    if isinstance(value, tuple):
        return depth < 2 and len(value) <= SHAREABLE_TUPLE and all(shareable(v, depth + 1) for v in value)
    return False


class _NotShareable:
    """What the memo holds in place of an object a GET may not fetch again (and so need not keep)."""

    def __init__(self, kind: str):
        self.kind = kind


class _AllowListUnpickler(pickle._Unpickler):  # the pure-Python unpickler: every opcode is ours to check
    dispatch = {}

    def __init__(self, stream, max_ops: int):
        super().__init__(stream)
        self._stream = stream
        self._ops_left = max_ops

    def count_operation(self) -> None:
        self._ops_left -= 1
        if self._ops_left < 0:
            raise _refuse("the file holds more pickle operations than a Trax weight file of this model")

    def find_class(self, module, name):
        target = ALLOWED_NAMES.get((module, name))
        if target is None:
            raise _refuse(f"the file asks to import {str(module)[:200]}.{str(name)[:200]} while unpickling")
        return target.fresh() if isinstance(target, Dtype) else target

    # --- memo: each object used once -----------------------------------------------------------
    def _memoized(self, value):
        return value if shareable(value) else _NotShareable(type(value).__name__)

    def load_put(self):
        index = int(self.readline()[:-1])
        if index < 0:
            raise ValueError("negative PUT argument")
        self.memo[index] = self._memoized(self.stack[-1])

    def load_binput(self):
        self.memo[self.read(1)[0]] = self._memoized(self.stack[-1])

    def load_long_binput(self):
        (index,) = pickle.unpack("<I", self.read(4))
        self.memo[index] = self._memoized(self.stack[-1])

    def load_memoize(self):
        self.memo[len(self.memo)] = self._memoized(self.stack[-1])

    def _fetch(self, index):
        value = self.memo[index]
        if isinstance(value, _NotShareable):
            raise _refuse(
                f"the file uses one {value.kind} in two places (a memo GET); Trax's files share only dtypes, names "
                "and small constants, and a shared object would be paid for at every use"
            )
        self.append(value)

    def load_get(self):
        self._fetch(int(self.readline()[:-1]))

    def load_binget(self):
        self._fetch(self.read(1)[0])

    def load_long_binget(self):
        (index,) = pickle.unpack("<I", self.read(4))
        self._fetch(index)

    # --- dict keys -----------------------------------------------------------------------------
    @staticmethod
    def _check_key(key) -> None:
        if isinstance(key, str) or (type(key) is int and key.bit_length() <= KEY_INT_BITS):
            return
        raise _refuse(f"the file has a dict key that is a {type(key).__name__}, not a string or a small integer")

    def load_setitem(self):
        self._check_key(self.stack[-2])
        super().load_setitem()

    def load_setitems(self):
        items = self.stack  # after the MARK: key, value, key, value ...
        for key in items[0::2]:
            self._check_key(key)
        super().load_setitems()

    def load_dict(self):
        for key in self.stack[0::2]:
            self._check_key(key)
        super().load_dict()

    # --- weights kept, the rest streamed past ------------------------------------------------
    def _outer_key(self) -> Optional[str]:
        """The key of the outermost dict whose value is being built; None where the file's
        outermost object is not a dict, or no string key can be told (everything is then kept).

        The dict's items follow it on its own level (SETITEM) or on the level its MARK opened
        (SETITEMS), as key, value, key, value...; what a value is built from may follow its key
        and value on the same level (an APPEND to a list, a REDUCE's callable), so the pairs are
        read from the start, and a string left after them is the key of a value not yet pushed.
        A file that puts strings among its weights can only make terra drop them, and then its
        weights are too few and it is refused."""
        levels = [*self.metastack, self.stack]
        if not levels[0] or not isinstance(levels[0][0], dict):
            return None
        items = levels[0][1:] if len(levels[0]) > 1 or len(levels) == 1 else levels[1]
        key, i = None, 0
        while i + 1 < len(items) and isinstance(items[i], str):
            key, i = items[i], i + 2
        if i < len(items) and isinstance(items[i], str) and i == len(items) - 1:
            key = items[i]
        return key

    def _data(self, length: int, kind) -> None:
        """Push the next ``length`` bytes as ``kind`` (bytes or bytearray), or, outside the
        weights, stream them past and push a :class:`DroppedBytes`."""
        key = self._outer_key()
        if key is None or key == WEIGHTS_KEY or not hasattr(self._stream, "skip"):
            data = self.read(length)
            if len(data) != length:
                raise EOFError
            self.append(kind(data))
            return
        left = length
        while left:  # through the frame when one is open, else the stream's allowance for skipped bytes
            got = self._skip(min(left, 1 << 20))
            if not got:
                raise EOFError
            left -= got
        self.append(DroppedBytes(length))

    def _skip(self, n: int) -> int:
        """Pass ``n`` bytes: from the open frame (already read), else through the stream's
        allowance for skipped bytes (the pickler writes large data outside frames)."""
        frame = self._unframer.current_frame
        if frame is not None:
            data = frame.read(n)
            if data:
                if len(data) < n:
                    raise pickle.UnpicklingError("pickle exhausted before end of frame")
                return n
            self._unframer.current_frame = None
        return self._stream.skip(n)

    def load_binbytes(self):
        (length,) = pickle.unpack("<I", self.read(4))
        self._data(length, bytes)

    def load_short_binbytes(self):
        self._data(self.read(1)[0], bytes)

    def load_binbytes8(self):
        (length,) = pickle.unpack("<Q", self.read(8))
        self._data(length, bytes)

    def load_bytearray8(self):
        # The base class allocates bytearray(n) before reading; here the read (budget-checked) is first.
        (length,) = pickle.unpack("<Q", self.read(8))
        self._data(length, bytearray)

    def load_build(self):
        state = self.stack.pop()
        if not isinstance(self.stack[-1], _BUILDABLE):
            raise _refuse(f"the file sets the state of a {type(self.stack[-1]).__name__}")
        self.stack[-1].__setstate__(state)


def _counted(handler):
    def run(unpickler):
        unpickler.count_operation()
        handler(unpickler)

    return run


_OWN_HANDLERS = {
    pickle.PUT: "load_put",
    pickle.BINPUT: "load_binput",
    pickle.LONG_BINPUT: "load_long_binput",
    pickle.MEMOIZE: "load_memoize",
    pickle.GET: "load_get",
    pickle.BINGET: "load_binget",
    pickle.LONG_BINGET: "load_long_binget",
    pickle.SETITEM: "load_setitem",
    pickle.SETITEMS: "load_setitems",
    pickle.DICT: "load_dict",
    pickle.BUILD: "load_build",
    pickle.BINBYTES: "load_binbytes",
    pickle.SHORT_BINBYTES: "load_short_binbytes",
    pickle.BINBYTES8: "load_binbytes8",
    pickle.BYTEARRAY8: "load_bytearray8",
}
for _code, _handler in pickle._Unpickler.dispatch.items():
    if bytes([_code]) in _OPCODES_NOT_RUN:
        continue
    _name = _OWN_HANDLERS.get(bytes([_code]))
    _AllowListUnpickler.dispatch[_code] = _counted(getattr(_AllowListUnpickler, _name) if _name else _handler)


def load(stream, max_ops: int) -> Any:
    """The object a weight file's pickle describes, arrays as numpy (bfloat16 widened to float32)
    and those outside ``'flat_weights'`` as :class:`DroppedArray`.

    Args:
      stream: the decompressed bytes, a :class:`~terra.convert.limited_reader.LimitedReader`
        (bytes outside the weights are skipped through its ``skip``; without one they are read).
      max_ops: the most pickle opcodes to run.

    Raises:
      CheckpointError: a name outside :data:`ALLOWED_NAMES`, an opcode not run here, an object
        used twice, a non-numeric or inconsistent array, a budget exceeded, or a malformed pickle.
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
        raise CheckpointError(f"is not a Trax weight file (a readable pickle): KeyError: {shown(code)}") from None
    except Exception as e:  # malformed: truncated, wrong types on the stack, a missing memo entry
        reason = f"{type(e).__name__}: {shown(str(e), 200)}"
        raise CheckpointError(f"is not a Trax weight file (a readable pickle): {reason}") from None
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

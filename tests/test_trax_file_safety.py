"""A Trax weight file is a file from a stranger: it must never run code, never allocate past what
the model needs, and every refusal is one `error:` line with exit status 2. Each route that ran
code in an earlier loader has a test here, plus a generated test over gadget globals."""

import gzip
import io
import os
import pickle
import re
import struct
import tracemalloc

import numpy as np
import pytest

from terra.cli import convert as convert_cli
from terra.convert import safe_pickle
from terra.convert.trax_file import read_trax_weights
from terra.errors import CheckpointError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "trax")
DENSE = os.path.join(FIXTURES, "dense")


def _unicode(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _global(module: str, name: str, stack_global: bool) -> bytes:
    if stack_global:  # protocol 4: module and name from the stack, dotted names possible
        return _unicode(module) + _unicode(name) + pickle.STACK_GLOBAL
    return pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n"


def _call(module: str, name: str, args: tuple, stack_global: bool = True) -> bytes:
    """Pickle bytes (no PROTO, no STOP) that call ``module.name(*args)`` with string/None args."""
    body = _global(module, name, stack_global) + pickle.MARK
    for arg in args:
        body += pickle.NONE if arg is None else _unicode(arg) if isinstance(arg, str) else pickle.dumps(arg, 3)[2:-1]
    return body + pickle.TUPLE + pickle.REDUCE


def _weights_file(path, flat_state_payload: bytes = b"", flat_weights=None) -> str:
    """The dense fixture's dict with ``flat_state`` replaced by the payload's result."""
    with gzip.open(os.path.join(DENSE, "model.pkl.gz"), "rb") as f:
        content = safe_pickle.load(f, max_ops=10**6)
    weights = content["flat_weights"] if flat_weights is None else flat_weights
    # Protocol 3 has no frames, so the bytes after the dict can be spliced in.
    prefix = pickle.dumps({"flat_weights": weights}, protocol=3)[:-1]  # drop STOP; the dict stays on the stack
    state = _unicode("flat_state") + (flat_state_payload or pickle.EMPTY_LIST) + pickle.SETITEM
    with gzip.open(path, "wb") as f:
        f.write(prefix + state + pickle.STOP)
    return str(path)


def _convert(tmp_path, checkpoint, capsys, out_name="run"):
    out = tmp_path / out_name
    status = convert_cli.main(
        ["trax", f"--checkpoint={checkpoint}", f"--trax_config={os.path.join(DENSE, 'config.json')}", f"--out={out}"]
    )
    err = capsys.readouterr().err
    return status, [line for line in err.splitlines() if line.strip()], out


def test_the_dense_fixture_still_reads_through_the_allow_list(tmp_path):
    path = _weights_file(tmp_path / "model.pkl.gz")
    assert len(read_trax_weights(path)) == 93


@pytest.mark.parametrize(
    "route",
    [
        "runstring",  # numpy.testing._private.utils.runstring: an exec
        "numpy_load",  # numpy.load(path, None, True) on an object .npy
        "npyio_os_system",  # STACK_GLOBAL('numpy', 'lib._npyio_impl.os.system')
        "f2py_os_system",  # STACK_GLOBAL('numpy.f2py', 'os.system')
        "collections_sys_modules",  # collections reaches sys.modules
    ],
)
def test_a_code_execution_route_in_the_ignored_state_is_refused_with_exit_2(tmp_path, capsys, route):
    marker = tmp_path / "ran"
    touch = f"open({str(marker)!r}, 'w').close()"
    if route == "runstring":
        payload = _call("numpy.testing._private.utils", "runstring", (touch, {}))
    elif route == "numpy_load":
        evil = tmp_path / "evil.npy"

        class Touch:
            def __reduce__(self):
                return (exec, (touch,))

        np.save(evil, np.array([Touch()], dtype=object), allow_pickle=True)
        payload = _call("numpy", "load", (str(evil), None, True))
    elif route == "npyio_os_system":
        payload = _call("numpy", "lib._npyio_impl.os.system", (f"touch {marker}",))
    elif route == "f2py_os_system":
        payload = _call("numpy.f2py", "os.system", (f"touch {marker}",))
    else:
        payload = _global("collections", "_sys.modules", True)
    checkpoint = _weights_file(tmp_path / "model.pkl.gz", payload)
    status, err, out = _convert(tmp_path, checkpoint, capsys)
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and "asks to import" in err[0], err
    assert not marker.exists(), "the file ran code"
    assert not out.exists()


GADGETS = [
    ("numpy", "load"),
    ("numpy", "fromfile"),
    ("numpy", "frombuffer"),
    ("numpy", "array"),
    ("numpy", "lib"),
    ("numpy", "testing"),
    ("numpy.testing._private.utils", "runstring"),
    ("numpy.lib._npyio_impl", "os"),
    ("numpy.f2py", "os"),
    ("numpy.ctypeslib", "load_library"),
    ("numpy", "_core.multiarray._reconstruct"),  # an allowed name reached by a dotted path
    ("numpy._core.multiarray", "_reconstruct.__globals__"),
    ("jax._src.array", "api"),
    ("jax._src.array", "device_put"),
    ("ml_dtypes", "bfloat16.__reduce__"),
    ("trax.shapes", "tf"),
    ("collections", "namedtuple"),
    ("collections", "_sys"),
    ("collections", "abc"),
    ("codecs", "open"),
    ("codecs", "decode"),
    ("_codecs", "encode"),
    ("functools", "partial"),
    ("functools", "reduce"),
    ("operator", "attrgetter"),
    ("operator", "methodcaller"),
    ("operator", "getitem"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("builtins", "open"),
    ("builtins", "compile"),
    ("builtins", "setattr"),
    ("builtins", "dict"),
    ("builtins", "object"),
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "Popen"),
    ("subprocess", "check_output"),
    ("importlib", "import_module"),
    ("runpy", "run_path"),
    ("pickle", "loads"),
    ("_pickle", "loads"),
    ("shutil", "rmtree"),
    ("sys", "modules"),
    ("types", "FunctionType"),
    ("copyreg", "_reconstructor"),
    ("ctypes", "CDLL"),
    ("pty", "spawn"),
    ("code", "InteractiveInterpreter"),
    ("timeit", "timeit"),
    ("tensorflow", "io"),
]


@pytest.mark.parametrize("stack_global", [False, True], ids=["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize("module, name", GADGETS, ids=[f"{m}.{n}" for m, n in GADGETS])
def test_no_gadget_global_is_reachable(tmp_path, module, name, stack_global):
    marker = tmp_path / "ran"
    payload = pickle.PROTO + b"\x04" + _call(module, name, (f"touch {marker}",), stack_global) + pickle.STOP
    with pytest.raises(CheckpointError, match=f"asks to import {module}.{name} while unpickling"):
        safe_pickle.load(io.BytesIO(payload), max_ops=1000)
    assert not marker.exists()


def test_every_allowed_name_is_bound_to_this_module_not_to_the_library():
    """The allow-list hands out only the loader's own functions, classes and inert markers."""
    for (module, name), target in safe_pickle.ALLOWED_NAMES.items():
        owner = getattr(target, "__module__", type(target).__module__)
        assert owner == safe_pickle.__name__, (module, name, target)


@pytest.mark.parametrize("opcode", [pickle.EXT1 + b"\x01", pickle.PERSID + b"x\n", pickle.INST + b"os\nsystem\n"])
def test_opcodes_that_reach_other_registries_are_not_run(opcode):
    with pytest.raises(CheckpointError, match="opcode|asks to import"):
        safe_pickle.load(io.BytesIO(pickle.PROTO + b"\x04" + pickle.MARK + opcode + pickle.STOP), max_ops=100)


def test_state_can_be_set_only_on_the_loaders_placeholders():
    payload = pickle.dumps([[]], protocol=2)[:-1]  # a list on the stack
    payload += pickle.EMPTY_DICT + pickle.BUILD + pickle.STOP
    with pytest.raises(CheckpointError, match="sets the state of a list"):
        safe_pickle.load(io.BytesIO(payload), max_ops=100)


def test_an_object_array_is_refused_in_the_pickle_and_in_a_sibling_file(tmp_path):
    path = _weights_file(tmp_path / "model.pkl.gz", flat_weights=[np.array([1, "a"], dtype=object)])
    with pytest.raises(CheckpointError, match="dtype object"):
        read_trax_weights(path)
    checkpoint = tmp_path / "loop.pkl.gz"
    with gzip.open(checkpoint, "wb") as f:
        pickle.dump({"flat_weights": 2}, f)
    with gzip.open(tmp_path / "loop.weights.npy.gz", "wb") as f:
        np.save(f, np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match=r"record 0 has a header np.save does not write for a numeric .*'\|O'"):
        read_trax_weights(str(checkpoint))


@pytest.mark.parametrize("form", ["one declared length", "many chunks"])
def test_a_gzip_bomb_stops_at_the_models_budget_without_allocating_it(tmp_path, capsys, form):
    bomb = tmp_path / "model.pkl.gz"
    chunk = b"\0" * (1 << 20)
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # 256 MiB of zeros, under 1 MB on disk
        if form == "one declared length":
            f.write(pickle.PROTO + b"\x04" + pickle.BINBYTES8 + struct.pack("<Q", 256 << 20))
            for _ in range(256):
                f.write(chunk)
        else:  # a list of 1 MiB strings: each fits, their sum does not
            f.write(pickle.PROTO + b"\x04" + pickle.EMPTY_LIST)
            for _ in range(256):
                f.write(pickle.BINBYTES + struct.pack("<I", len(chunk)) + chunk + pickle.APPEND)
        f.write(pickle.STOP)
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    status, err, out = _convert(tmp_path, str(bomb), capsys)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert status == 2 and len(err) == 1, err
    assert "more than the" in err[0] and "that the model's weights (93 arrays) take in float64" in err[0]
    assert peak < 96 << 20, f"peak {peak / 2**20:.0f} MiB while refusing a gzip bomb"
    assert not out.exists()


def test_a_declared_terabyte_is_refused_before_it_is_read():
    payload = pickle.PROTO + b"\x04" + pickle.BINBYTES8 + struct.pack("<Q", 10**12) + b"tiny"
    with pytest.raises(CheckpointError, match="asks for"):
        safe_pickle.load(_limited(payload, 1 << 20), max_ops=100)
    framed = pickle.PROTO + b"\x04" + pickle.FRAME + struct.pack("<Q", 10**12)
    with pytest.raises(CheckpointError, match="asks for"):
        safe_pickle.load(_limited(framed, 1 << 20), max_ops=100)
    array = pickle.PROTO + b"\x05" + pickle.BYTEARRAY8 + struct.pack("<Q", 10**12)
    with pytest.raises(CheckpointError, match="asks for"):
        safe_pickle.load(_limited(array, 1 << 20), max_ops=100)


def _limited(data: bytes, budget: int):
    from terra.convert.limited_reader import LimitedReader

    return LimitedReader(io.BytesIO(data), budget, "the file", "allowed")


def test_an_array_whose_bytes_disagree_with_its_shape_is_refused():
    good = pickle.dumps(np.zeros((2, 3), np.float32), protocol=4)
    assert safe_pickle.load(io.BytesIO(good), max_ops=100).shape == (2, 3)
    lying = pickle.dumps(np.zeros((2, 3), np.float32), protocol=4).replace(b"K\x02K\x03", b"K\x20K\x30", 1)
    with pytest.raises(CheckpointError, match=r"shape \(32, 48\) and dtype f4 comes with 24 bytes"):
        safe_pickle.load(io.BytesIO(lying), max_ops=100)


def test_a_sibling_record_declaring_a_huge_shape_is_refused_from_its_header(tmp_path, capsys):
    checkpoint = tmp_path / "model.pkl.gz"
    with gzip.open(checkpoint, "wb") as f:
        pickle.dump({"flat_weights": 2, "flat_state": 2, "step": 1}, f)
    header = {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)}
    with gzip.open(tmp_path / "model.weights.npy.gz", "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 64)
    status, err, out = _convert(tmp_path, str(checkpoint), capsys)
    assert status == 2 and len(err) == 1, err
    assert "array [0] has shape (1000000, 1000000), but the model expects [0] token embedding" in err[0]


def test_a_truncated_or_nested_pickle_is_one_error():
    truncated = pickle.dumps({"flat_weights": [np.zeros(3, np.float32)]}, protocol=4)[:-20]
    with pytest.raises(CheckpointError, match="not a Trax weight file"):
        safe_pickle.load(io.BytesIO(truncated), max_ops=1000)
    nested = pickle.PROTO + b"\x04" + pickle.EMPTY_LIST + (pickle.MARK + pickle.EMPTY_LIST) * 200
    nested += (pickle.APPENDS) * 200 + pickle.STOP
    with pytest.raises(CheckpointError, match="nests"):
        safe_pickle.load(io.BytesIO(nested), max_ops=10_000)


def test_a_small_file_cannot_run_more_operations_than_the_model_needs():
    many = pickle.PROTO + b"\x04" + pickle.EMPTY_LIST + pickle.MARK + pickle.NONE * 5000 + pickle.APPENDS + pickle.STOP
    with pytest.raises(CheckpointError, match="more pickle operations"):
        safe_pickle.load(io.BytesIO(many), max_ops=1000)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_named_like_a_checkpoint_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.pkl.gz"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_trax_weights(str(fifo))


def test_a_file_cannot_change_the_allowed_names_for_the_next_file():
    """A BUILD on an allowed dtype changes the file's own copy, never the shared entry."""
    big_endian = pickle.dumps((3, ">", None, None, None, -1, -1, 0), protocol=3)[2:-1]
    payload = pickle.PROTO + b"\x04" + _global("numpy", "float32", True) + big_endian + pickle.BUILD + pickle.STOP
    assert safe_pickle.load(io.BytesIO(payload), max_ops=100).order == ">"
    assert safe_pickle.ALLOWED_NAMES[("numpy", "float32")].order == "<"


# --- a few bytes cannot stand for gigabytes: nothing is fetched twice, the rest streams past -----


def _dense_leaves():
    from terra.convert.trax_arguments import read_trax_arguments, trax_gin
    from terra.convert.trax_layout import trax_leaves
    from terra.gin_config import parsing

    files, bindings = trax_gin(*read_trax_arguments(os.path.join(DENSE, "config.json")))
    parsing.parse_gin(files, bindings, finalize=False)
    return trax_leaves(parsing.build_model().abstract_params())


def _gzip(path, data: bytes) -> str:
    with gzip.open(path, "wb") as f:
        f.write(data)
    return str(path)


def _shared_buffer_arrays(copies: int, nbytes: int) -> bytes:
    """``{'flat_weights': [frombuffer(buf), frombuffer(GET buf), ...]}``: one buffer, many arrays."""
    frombuffer = _unicode("numpy._core.numeric") + _unicode("_frombuffer") + pickle.STACK_GLOBAL
    dtype = _call("numpy", "dtype", ("f8", False, True)) + pickle.MEMOIZE
    shape = pickle.dumps((nbytes // 8,), 4)[2:-1]
    body = pickle.PROTO + b"\x05" + pickle.EMPTY_DICT + _unicode("flat_weights") + pickle.EMPTY_LIST + pickle.MARK
    body += frombuffer + pickle.MEMOIZE  # memo 0
    body += pickle.MARK + pickle.BYTEARRAY8 + struct.pack("<Q", nbytes) + b"\0" * nbytes + pickle.MEMOIZE  # memo 1
    body += dtype + shape + _unicode("C") + pickle.TUPLE + pickle.REDUCE  # dtype is memo 2
    for _ in range(copies - 1):
        body += pickle.BINGET + b"\x00" + pickle.MARK + pickle.BINGET + b"\x01" + pickle.BINGET + b"\x02"
        body += shape + _unicode("C") + pickle.TUPLE + pickle.REDUCE
    return body + pickle.APPENDS + pickle.SETITEM + pickle.STOP


def _nested_shared_lists(levels: int) -> bytes:
    """A list holding the same list twice, ``levels`` deep: 2**levels visits for 30 bytes a level."""
    tree = []
    for _ in range(levels):
        tree = [tree, tree]
    return pickle.dumps({"flat_weights": tree}, protocol=4)


@pytest.mark.parametrize(
    "kind, payload",
    [
        ("one array repeated", lambda: pickle.dumps({"flat_weights": [np.ones(1 << 17)] * 5000}, protocol=5)),
        ("one jax array repeated", lambda: pickle.dumps({"flat_weights": [_jax_array()] * 1000}, protocol=4)),
        ("one buffer under many arrays", lambda: _shared_buffer_arrays(1000, 1 << 20)),
        ("lists shared in lists", lambda: _nested_shared_lists(40)),
        ("a dict shared", lambda: pickle.dumps({"flat_weights": [{"w": np.ones(4)}] * 3}, protocol=4)),
        ("a long string shared", lambda: pickle.dumps({"flat_weights": ["x" * 4096] * 3}, protocol=4)),
        ("long bytes shared", lambda: pickle.dumps({"flat_weights": [b"x" * 1000] * 3}, protocol=4)),
        ("a long tuple shared", lambda: pickle.dumps({"flat_weights": [tuple(range(100))] * 3}, protocol=4)),
        ("a list in itself", lambda: _self_containing_list()),
    ],
)
def test_an_object_used_twice_is_refused_at_its_second_use(tmp_path, kind, payload):
    path = _gzip(tmp_path / "model.pkl.gz", payload())
    leaves = _dense_leaves()
    tracemalloc.start()
    with pytest.raises(CheckpointError) as error:
        read_trax_weights(path, leaves)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert "in two places (a memo GET)" in str(error.value) and str(error.value).startswith(path), error.value
    assert peak < 64 << 20, f"{kind}: peak {peak / 2**20:.0f} MiB before the refusal"


def _jax_array():
    import jax.numpy as jnp

    return jnp.ones(1 << 16)


def _self_containing_list() -> bytes:
    body = pickle.PROTO + b"\x04" + pickle.EMPTY_DICT + _unicode("flat_weights") + pickle.EMPTY_LIST + pickle.MEMOIZE
    return body + pickle.BINGET + b"\x00" + pickle.APPEND + pickle.SETITEM + pickle.STOP


@pytest.mark.parametrize(
    "opcode, words",
    [
        (pickle.NONE + pickle.DUP, "DUP"),
        (pickle.EMPTY_SET, "EMPTY_SET"),
        (pickle.MARK + pickle.NONE + pickle.FROZENSET, "FROZENSET"),
    ],
)
def test_dup_and_sets_are_not_run(opcode, words):
    with pytest.raises(CheckpointError, match=f"opcode {words}"):
        safe_pickle.load(io.BytesIO(pickle.PROTO + b"\x04" + opcode + pickle.STOP), max_ops=100)


@pytest.mark.parametrize(
    "key", [pickle.dumps((1, 2), 4)[2:-1], pickle.dumps(1 << 40, 4)[2:-1], pickle.dumps(1.5, 4)[2:-1]]
)
def test_dict_keys_are_strings_or_small_integers(key):
    payload = pickle.PROTO + b"\x04" + pickle.EMPTY_DICT + key + pickle.NONE + pickle.SETITEM + pickle.STOP
    with pytest.raises(CheckpointError, match="dict key that is a (tuple|int|float), not a string or a small integer"):
        safe_pickle.load(io.BytesIO(payload), max_ops=100)


def test_a_shape_too_large_to_print_is_named_by_its_size():
    huge = pickle.LONG4 + struct.pack("<I", 100_000) + b"\x7f" * 100_000  # an integer of 800,000 bits
    reconstruct = _global("numpy._core.multiarray", "_reconstruct", True)
    payload = pickle.PROTO + b"\x04" + reconstruct + pickle.MARK + _global("numpy", "ndarray", True)
    payload += pickle.MARK + pickle.BININT1 + b"\x00" + pickle.TUPLE + pickle.SHORT_BINBYTES + b"\x01b"
    payload += pickle.TUPLE + pickle.REDUCE + pickle.MARK + pickle.BININT1 + b"\x01" + pickle.MARK + huge
    payload += pickle.TUPLE + _call("numpy", "dtype", ("f4", False, True)) + pickle.NEWFALSE
    payload += pickle.SHORT_BINBYTES + b"\x00" + pickle.TUPLE + pickle.BUILD + pickle.STOP
    with pytest.raises(CheckpointError, match=r"declares the array shape \(an integer of 799,999 bits,\)"):
        safe_pickle.load(io.BytesIO(payload), max_ops=100)


def _fixture_with_state(path, state_arrays) -> str:
    with gzip.open(os.path.join(DENSE, "model.pkl.gz"), "rb") as f:
        weights = safe_pickle.load(f, max_ops=10**6)["flat_weights"]
    with gzip.open(path, "wb", compresslevel=1) as f:
        pickle.dump({"flat_weights": weights, "flat_state": state_arrays, "input_signature": None}, f, protocol=5)
    return str(path)


def test_a_predict_mode_file_whose_caches_outweigh_its_weights_converts_in_the_weights_memory(tmp_path, capsys):
    """State (a predict-mode model's decode caches) is streamed past: 96 MiB of it, 130x the tiny
    model's weights, costs neither memory nor a refusal."""
    caches = [np.full((8, 1024, 1024), i, np.float32) for i in range(3)]  # 3 x 32 MiB
    checkpoint = _fixture_with_state(tmp_path / "model.pkl.gz", caches)
    del caches
    leaves = _dense_leaves()
    weights_bytes = sum(4 * int(np.prod(leaf.shape)) for leaf in leaves)
    tracemalloc.start()
    flat = read_trax_weights(checkpoint, leaves)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(flat) == 93 and sum(a.nbytes for a in flat) == weights_bytes
    assert peak < 3 * weights_bytes + (8 << 20), f"peak {peak / 2**20:.1f} MiB for {weights_bytes / 2**20:.1f} MiB"
    status, err, out = _convert(tmp_path, checkpoint, capsys)
    assert status == 0 and os.path.isdir(out), err


def test_state_past_its_allowance_is_refused_saying_what_exceeded_it(tmp_path, monkeypatch):
    from terra.convert import trax_file

    monkeypatch.setattr(trax_file, "DROPPED_MARGIN_BYTES", 16 << 20)
    checkpoint = _fixture_with_state(tmp_path / "model.pkl.gz", [np.zeros((64, 1 << 20), np.uint8)])
    with pytest.raises(CheckpointError) as error:
        read_trax_weights(checkpoint, _dense_leaves())
    message = str(error.value)
    assert message.startswith(f"{checkpoint} holds more than 18.8 MiB besides the weights (19.0 MiB so far)"), message
    assert "plus 16.0 MiB of state, decode caches, optimizer slots and history" in message and "'eval' mode" in message


@pytest.mark.parametrize("damage", ["crc", "garbage inside", "garbage after"])
def test_a_damaged_gzip_stream_or_data_after_the_pickle_is_refused(tmp_path, damage):
    with open(os.path.join(DENSE, "model.pkl.gz"), "rb") as f:
        data = bytearray(f.read())
    path = tmp_path / "model.pkl.gz"
    if damage == "crc":
        data[-8] ^= 0xFF  # the CRC32 in the gzip trailer
        path.write_bytes(bytes(data))
        expected = "CRC check failed"
    elif damage == "garbage inside":
        _gzip(path, gzip.decompress(bytes(data)) + b"trailing bytes")
        expected = "continues after the end of its pickle"
    else:
        path.write_bytes(bytes(data) + b"not a gzip member")
        expected = "is not a Trax weight file (a gzip-compressed pickle), or it is damaged"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        read_trax_weights(str(path), _dense_leaves())


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_naming_the_array(tmp_path, value):
    with gzip.open(os.path.join(DENSE, "model.pkl.gz"), "rb") as f:
        weights = safe_pickle.load(f, max_ops=10**6)["flat_weights"]
    weights[0] = np.array(weights[0])
    weights[0][1, 2] = value
    path = _weights_file(tmp_path / "model.pkl.gz", flat_weights=weights)
    with pytest.raises(CheckpointError) as error:
        read_trax_weights(path, _dense_leaves())
    message = str(error.value)
    assert "weight array [0] token embedding" in message
    assert "holds 1 NaN or infinite value(s) of" in message and "Convert an earlier checkpoint" in message


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': " + "(" * 3000 + "'<f4'" + ")" * 3000 + ", 'fortran_order': False, 'shape': (2,), }",
        "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
        "{'descr': '<f4', 'fortran_order': __import__('os'), 'shape': (2,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }",
    ],
)
def test_an_npy_header_numpy_would_not_write_is_refused_unparsed(tmp_path, header):
    checkpoint = tmp_path / "model.pkl.gz"
    with gzip.open(checkpoint, "wb") as f:
        pickle.dump({"flat_weights": 2}, f)
    encoded = header.encode("latin1")
    with gzip.open(tmp_path / "model.weights.npy.gz", "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(encoded)) + encoded)
    with pytest.raises(CheckpointError, match="record 0 has a header np.save does not write for a numeric array"):
        read_trax_weights(str(checkpoint))


def test_the_fixtures_share_only_what_a_pickler_shares_for_every_array():
    """Trax's files fetch again only allowed functions, dtypes and short constants (the rule the
    loader enforces), and their weights come back as distinct arrays."""
    models = sorted(m for m in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, m, "model.pkl.gz")))
    assert models == ["dense", "scaling_transformer", "terraformer", "terraformer_lsh"]
    for model in models:
        with gzip.open(os.path.join(FIXTURES, model, "model.pkl.gz"), "rb") as f:
            weights = safe_pickle.load(f, max_ops=10**6)["flat_weights"]
        arrays = []
        stack = [weights]
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, np.ndarray):
                arrays.append(item)
        assert len({id(a) for a in arrays}) == len(arrays) > 60, model


@pytest.mark.parametrize("kind", ["device", "nested", "sparse"])
def test_trax_arguments_that_are_not_a_small_json_file_are_one_error(tmp_path, capsys, kind):
    arguments = tmp_path / "args.json"
    if kind == "device":
        os.symlink("/dev/zero", arguments)
        expected = f"the Trax arguments {arguments} is not a regular file"
    elif kind == "nested":
        arguments.write_text("[" * 100_000)
        expected = f"{arguments} is not JSON: maximum recursion depth exceeded"
    else:
        with open(arguments, "wb") as f:
            f.truncate(1 << 33)
        expected = f"the Trax arguments {arguments} is 8.0 GiB, more than the 1.0 MiB"
    out = tmp_path / "run"
    status = convert_cli.main(
        ["trax", f"--checkpoint={os.path.join(DENSE, 'model.pkl.gz')}", f"--trax_config={arguments}", f"--out={out}"]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and err[0].startswith(f"error: {expected}"), err
    assert not out.exists()

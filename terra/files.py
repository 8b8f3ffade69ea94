"""Paths as users give them (relative, ``~``, or a URL such as ``gs://bucket/run``), files others
made read only when they are what they claim (a regular file of a sane size), result files that an
interrupted job never leaves half-written, and shared caches built once when several processes
want them at the same time."""

import contextlib
import os
import stat
from typing import Type, Union

try:
    import fcntl
except ImportError:  # not POSIX: builders may repeat each other's work, which stays correct
    fcntl = None


def has_scheme(path: str) -> bool:
    """Whether ``path`` is a URL (``gs://``, ``s3://``...): read through ``etils.epath``, never
    joined to the working directory."""
    return "://" in str(path)


def absolute(path: str) -> str:
    """``path`` as the same file from any working directory: a local path expanded (``~``) and
    made absolute, a URL as it is."""
    path = str(path)
    return path if has_scheme(path) else os.path.abspath(os.path.expanduser(path))


def lexists(path: str) -> bool:
    """Whether there is anything at ``path``: a file, a folder, or a link (even a dangling one,
    which a reader then reports as such rather than as missing). URLs through ``etils.epath``."""
    if has_scheme(path):
        from etils import epath

        return epath.Path(path).exists()
    return os.path.lexists(path)


def describe_size(n: int) -> str:
    """``n`` bytes in the unit a reader compares at a glance (bytes, KiB, MiB or GiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def check_regular_file(path: str, max_bytes: int, error: Type[Exception], what: str) -> int:
    """The size of the local file ``path`` after checking that it is a regular file (a link is
    followed: a device, a FIFO, a socket or a folder is refused, so a read neither hangs nor runs
    until memory is gone) of at most ``max_bytes``; otherwise raises ``error`` naming ``what``
    (``'the run's config.gin'``) and ``path``. A URL is checked for its size only."""
    if has_scheme(path):
        from etils import epath

        try:
            size = epath.Path(path).stat().length
        except Exception as e:  # the file system's own (missing, no credentials, no network)
            raise error(f"cannot read {what} {path}: {' '.join(str(e).split())[:300]}") from None
    else:
        try:
            status = os.stat(path)
        except OSError as e:
            raise error(f"cannot read {what} {path}: {e.strerror}.") from None
        if not stat.S_ISREG(status.st_mode):
            raise error(f"{what} {path} is not a regular file (a device, FIFO, socket or folder), so it was not read.")
        size = status.st_size
    if size > max_bytes:
        raise error(
            f"{what} {path} is {describe_size(size)}, more than the {describe_size(max_bytes)} such a file can "
            "hold, so it was not read."
        )
    return size


def read_regular_file(path: str, max_bytes: int, error: Type[Exception], what: str) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` (:func:`check_regular_file`).
    A local file is opened without blocking and checked again on the open descriptor, so a file
    swapped for a FIFO or a device after the first check is not read either; at most
    ``max_bytes`` are read whatever the file grows to meanwhile."""
    check_regular_file(path, max_bytes, error, what)
    if has_scheme(path):
        from etils import epath

        data = epath.Path(path).read_bytes()
    else:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise error(f"cannot read {what} {path}: {e.strerror}.") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise error(f"{what} {path} is not a regular file, so it was not read.")
            data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{what} {path} grew past {describe_size(max_bytes)} while it was read; it was not used.")
    return data


def write_atomically(path: str, data: Union[str, bytes]) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to a temporary file beside ``path``, then rename it
    over ``path``: a reader sees the old file or the new one, never a part of either. Local paths
    and URLs alike (``etils.epath``, orbax's file layer)."""
    from etils import epath

    target = epath.Path(path)
    tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        tmp.replace(target)
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        # A write that fails part-way (a full disk) names no file: name the one being written.
        raise OSError(error.errno, error.strerror, str(target)) from error
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def exclusive(lock_path: str):
    """Hold an advisory lock on ``lock_path`` (created if missing) for the block. Builders of one
    cache take it, then check again whether the cache exists: the second waits for the first
    instead of repeating its work (the writes stay atomic without it)."""
    if fcntl is None:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(lock_path)), exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

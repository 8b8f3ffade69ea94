"""Paths as users give them (relative, ``~``, or a URL such as ``gs://bucket/run``), result
files that an interrupted job never leaves half-written, and shared caches built once when several
processes want them at the same time."""

import contextlib
import os
from typing import Union

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

"""Writing result files so that an interrupted job never leaves a half-written one behind, and
building shared caches once when several processes want them at the same time."""

import contextlib
import os

try:
    import fcntl
except ImportError:  # not POSIX: builders may repeat each other's work, which stays correct
    fcntl = None


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to a temporary file beside ``path``, then rename it over ``path``:
    a reader sees the old file or the new one, never a part of either."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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

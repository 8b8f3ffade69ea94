"""One trainer per MODEL_DIR: the running trainer holds a lock on ``MODEL_DIR/.terra.lock``.

The lock is an ``flock`` on that file, held for the trainer's lifetime; the file records who holds
it (host, pid, start time). The kernel releases an ``flock`` when its process dies, SIGKILL
included, so the lock of a killed trainer is taken over by the next one without any clean-up;
while its holder lives, a second trainer stops at once with a message naming the holder's host
and pid. The file itself is never removed (removing it would let two trainers lock two different
files of the same name). Only process 0 of a multi-host job takes the lock.
"""

import fcntl
import json
import os
import socket
import time
from typing import Optional

from terra.errors import ConfigError

LOCK_FILE = ".terra.lock"


class RunInUseError(ConfigError):
    """Another live trainer holds the MODEL_DIR's lock."""


class RunLock:
    """``with RunLock(model_dir):`` holds the lock (creating ``model_dir``) until the block ends."""

    def __init__(self, model_dir: str, enabled: bool = True):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_FILE)
        self.enabled = enabled
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        if not self.enabled or self._fd is not None:
            return
        os.makedirs(self.model_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise RunInUseError(
                f"{self.model_dir} is in use by another trainer ({holder}): two trainers would write the same "
                "checkpoints. Wait for it to finish or stop it (rerunning resumes), or train into another MODEL_DIR."
            ) from None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "host and pid unknown"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"

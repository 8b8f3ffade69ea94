"""The persistent XLA compilation cache terra's commands keep, so that a command run again (a
second ``terra-summarize``, ``terra-evaluate`` of the next checkpoint, a benchmark) reads the
programs it compiled last time instead of compiling them again (seconds for the tiny models,
minutes at the paper's 800M widths): JAX's own cache (``jax_compilation_cache_dir``), keyed by
each program, the compile options and the jax/jaxlib versions, under
``$TERRA_CACHE_DIR/xla`` (default ``~/.cache/terra/xla``).

XLA:CPU compiles for the instruction set of the machine it runs on, so the folder is one per CPU
model and instruction-set flags: a home folder shared by machines of different kinds never hands
one an executable the other compiled. A user's own ``JAX_COMPILATION_CACHE_DIR`` (an empty value
turns the cache off) and ``JAX_*`` cache settings win. For commands only, as they start: the
settings are environment variables JAX reads when it is imported (and the processes a command
starts inherit). Plain Python, no JAX.
"""

import hashlib
import os
import sys
from typing import Mapping, MutableMapping, Optional, TextIO

from terra import cpu_info

CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# Programs that compile faster than this are not written (JAX's default, 1 s, would leave out
# every program of the small models, whose compiles are what a small command waits for).
MIN_COMPILE_SECONDS = "0.2"
# Least recently used programs are removed above this size (JAX's LRU eviction).
MAX_BYTES = str(1 << 30)


def host_kind(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """A short name for this machine's kind: a hash of its CPU model and instruction-set flags
    (``/proc/cpuinfo``'s first processor), or ``"unknown-cpu"`` where there is no such file."""
    fields = cpu_info.first_processor(cpuinfo_path)
    if not fields:
        return "unknown-cpu"
    described = f"{fields.get('model name', '')}|{' '.join(sorted(fields.get('flags', '').split()))}"
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def cache_folder(environ: Mapping[str, str], kind: str) -> str:
    """The folder of this machine kind's programs under ``$TERRA_CACHE_DIR`` (default
    ``~/.cache/terra``)."""
    root = os.path.expanduser(environ.get("TERRA_CACHE_DIR", "~/.cache/terra"))
    return os.path.join(root, "xla", kind)


def use_for_command(
    environ: Optional[MutableMapping[str, str]] = None, kind: Optional[str] = None, err: Optional[TextIO] = None
) -> Optional[str]:
    """Points JAX's persistent compilation cache at :func:`cache_folder` (created if need be) in
    ``environ`` (default ``os.environ``), unless the user set ``JAX_COMPILATION_CACHE_DIR``;
    returns the folder used (``None``: the user's setting stands, or the folder cannot be made,
    which one ``note:`` line on ``err`` (default standard error) says: the command runs on,
    compiling as without a cache)."""
    environ = os.environ if environ is None else environ
    if CACHE_DIR_ENV in environ:
        return None
    folder = cache_folder(environ, host_kind() if kind is None else kind)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        print(
            f"note: no compilation cache: cannot make {folder} ({e.strerror or e}); set TERRA_CACHE_DIR to a "
            "writable folder to keep compiled programs between runs.",
            file=err or sys.stderr,
        )
        return None
    environ[CACHE_DIR_ENV] = folder
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", MIN_COMPILE_SECONDS)
    environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", MAX_BYTES)
    return folder

"""This process's memory: how large buffers are given back to the system, and what is resident.

A long-document prefill allocates caches and activations of tens of MB each (24 layers' keys and
values, one layer's float32 keys and values before they are narrowed), and XLA:CPU allocates them
with glibc's ``malloc``. glibc serves a block above its *mmap threshold* with its own mapping,
returned to the system when freed, and below it from its heaps, which keep freed memory. The
threshold starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB: after
the first prefill freed its blocks, the next prefill's blocks of the same sizes come from the
heaps, and their freed memory stays resident, so each prefill of a long document left the
process larger. :func:`return_large_buffers_to_system` fixes the threshold at 8 MiB; terra's
commands call it as they start. Not lower: every block above the threshold is mapped and its
pages zero-filled by the kernel at each allocation, and the many blocks of 1-8 MiB that
compiling and running small programs allocate slow them down (the measurements are in
docs/architecture.md, "Large buffers back to the system").

Each mapped block's pages are zero-filled by the kernel on first touch, one fault per 4 KiB page:
a long document's prefill touches gigabytes of fresh pages per call, millions of faults
(docs/architecture.md, "Huge pages for a prefill's fresh memory"). Where the kernel gives
transparent huge pages to regions that ask for them (``/sys/kernel/mm/transparent_hugepage/enabled``
is ``madvise``), glibc asks for its mapped blocks when the tunable ``glibc.malloc.hugetlb=1`` is
set, which it reads only as a process starts: :func:`restart_with_huge_pages` restarts a command
with it (one fault per 2 MiB page). Plain Python, no JAX.
"""

import ctypes
import gc
import os
import sys
from typing import Optional, Tuple

# glibc's mallopt parameter numbers (malloc.h).
_M_MMAP_THRESHOLD = -3
# Blocks of at least this many bytes get their own mapping, whatever was freed before.
MMAP_THRESHOLD_BYTES = 8 << 20


def _libc():
    """glibc, or ``None`` elsewhere (macOS, musl: their allocators have no such parameters)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def return_large_buffers_to_system(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap threshold at ``threshold_bytes`` (and with it stops its dynamic rise),
    so every block at least that large is mapped on its own and unmapped when freed. Returns
    whether the allocator took it (False off glibc)."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)) == 1)


# glibc's tunable for transparent huge pages on the blocks it maps (glibc 2.35 and later).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
# Set (to anything) to keep a command in the process it started in.
NO_RESTART_VARIABLE = "TERRA_NO_HUGE_PAGES"
# Set in the restarted process: a loader that drops GLIBC_TUNABLES (a setuid interpreter) must not
# make every start restart again.
RESTARTED_VARIABLE = "TERRA_HUGE_PAGES_RESTARTED"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> Tuple[int, int]:
    libc = _libc()
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):
        return (0, 0)
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    major, _, minor = libc.gnu_get_libc_version().decode("ascii").partition(".")
    return int(major), int(minor.split(".")[0] or 0)


def transparent_huge_pages() -> Optional[str]:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``None``
    where there is no such setting."""
    try:
        with open(_THP_ENABLED, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def huge_page_environment(environ, thp_mode: Optional[str], glibc_version: Tuple[int, int]):
    """The environment to restart with so that glibc maps its large blocks on huge pages, or
    ``None`` where a restart would change nothing: the kernel gives huge pages to every region
    (``always``) or to none, glibc is older than 2.35 (or absent), the tunable is already set,
    ``TERRA_NO_HUGE_PAGES`` is set, or this process is already the restarted one."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if thp_mode != "madvise" or glibc_version < (2, 35) or HUGE_PAGE_TUNABLE in tunables:
        return None
    if NO_RESTART_VARIABLE in environ or RESTARTED_VARIABLE in environ:
        return None
    setting = f"{HUGE_PAGE_TUNABLE}=1"
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{setting}" if tunables else setting, RESTARTED_VARIABLE: "1"}


def restart_with_huge_pages() -> None:
    """Replaces this process with the same program and arguments under the huge page tunable,
    where :func:`huge_page_environment` says it helps; otherwise returns. For commands only, as
    they start (nothing has run yet): the program restarts from its first line."""
    environ = huge_page_environment(os.environ, transparent_huge_pages(), _glibc_version())
    if environ is None or not getattr(sys, "orig_argv", None) or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError:  # an interpreter that cannot be started again: run on in this process
        return


def release_freed_memory() -> None:
    """Collects garbage and returns the allocator's freed pages to the system (glibc's
    ``malloc_trim``, where there is one), so that what is resident is what is still in use."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_bytes(field: str) -> Optional[int]:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``), or ``None`` without /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def resident_bytes() -> Optional[int]:
    """The process's resident bytes now (``VmRSS``), or ``None`` without /proc."""
    return _status_bytes("VmRSS")


def reset_peak_resident() -> bool:
    """Releases freed memory (:func:`release_freed_memory`), then resets the process's peak
    resident memory (``VmHWM``) to what is resident now; False where it cannot."""
    release_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_resident(was_reset: bool = False) -> Tuple[Optional[int], str]:
    """The process's peak resident bytes and what they measure: ``VmHWM`` (since
    :func:`reset_peak_resident` where ``was_reset``), else the peak since the process started
    (``ru_maxrss``)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        if was_reset:
            return peak, "VmHWM, reset before the row"
        return peak, "VmHWM, the process's peak since it started"
    try:
        import resource
    except ImportError:
        return None, "unavailable"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Bytes on macOS, kB elsewhere.
    return (peak if sys.platform == "darwin" else peak * 1024), "ru_maxrss, the process's peak since it started"

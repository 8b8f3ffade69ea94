"""This process's memory (``terra/process_memory.py``): with the mmap threshold fixed, freed large
buffers leave the process (with glibc's dynamic threshold they stay resident once a block of their
size was freed); terra's commands fix it as they start; the resident and peak readings."""

import os
import subprocess
import sys
import textwrap

import pytest

from terra import process_memory

# 12 blocks of 16 MB with a small kept allocation after each, freed, after one 16 MB block was
# mapped and freed (which raises glibc's dynamic threshold past 16 MB): MB still resident.
FRAGMENTS = textwrap.dedent(
    """
    import sys
    import numpy as np
    from terra import process_memory
    if sys.argv[1] == "fixed":
        assert process_memory.return_large_buffers_to_system()
    first = np.ones(4 << 20, np.float32)
    del first
    base = process_memory.resident_bytes()
    blocks, kept = [], []
    for _ in range(12):
        blocks.append(np.ones(4 << 20, np.float32))
        kept.append(np.ones(64 << 10, np.uint8))
    del blocks
    print((process_memory.resident_bytes() - base) / 1e6)
    """
)

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator parameters only")


def _still_resident_mb(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


@glibc
def test_freed_large_buffers_leave_the_process_once_the_threshold_is_fixed():
    assert _still_resident_mb("dynamic") > 150  # the 192 MB freed stay: why the threshold is fixed
    assert _still_resident_mb("fixed") < 20


@glibc
def test_commands_fix_the_threshold_before_they_run(monkeypatch):
    from terra.cli import app

    calls = []
    monkeypatch.setattr(process_memory, "return_large_buffers_to_system", lambda: calls.append(True))
    command = app.Command(name="terra-probe", python_m="python -m probe", doc="Probe.", run=lambda flags, rest: 0)
    assert command.call([]) == 0 and calls == [True]


def test_resident_and_peak_readings_are_consistent():
    was_reset = process_memory.reset_peak_resident()
    resident = process_memory.resident_bytes()
    peak, source = process_memory.peak_resident(was_reset)
    if resident is None:  # no /proc: the peak comes from getrusage
        assert source.startswith("ru_maxrss") or peak is None
        return
    assert peak >= resident > 0
    assert source == ("VmHWM, reset before the row" if was_reset else "VmHWM, the process's peak since it started")


def test_huge_pages_are_asked_for_only_where_the_kernel_gives_them_on_request():
    env = process_memory.huge_page_environment
    restarted = env({"PATH": "/bin"}, "madvise", (2, 36))
    assert restarted == {
        "PATH": "/bin",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        process_memory.RESTARTED_VARIABLE: "1",
    }
    # A loader that drops GLIBC_TUNABLES (secure execution) must not restart the program forever.
    assert env({k: v for k, v in restarted.items() if k != "GLIBC_TUNABLES"}, "madvise", (2, 36)) is None
    kept = env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36))
    assert kept["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env({}, "always", (2, 36)) is None  # every region gets them already
    assert env({}, "never", (2, 36)) is None and env({}, None, (2, 36)) is None
    assert env({}, "madvise", (2, 31)) is None  # glibc without the tunable
    assert env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36)) is None  # the user's choice
    assert env({process_memory.NO_RESTART_VARIABLE: "1"}, "madvise", (2, 36)) is None


@glibc
def test_a_command_restarts_once_under_the_huge_page_tunable_where_it_helps():
    """The restart replaces the process with the same program and arguments, once."""
    program = textwrap.dedent(
        """
        import os, sys
        from terra import process_memory
        print("start", sys.argv[1:], flush=True)
        process_memory.restart_with_huge_pages()
        print("tunables", os.environ.get("GLIBC_TUNABLES"))
        """
    )
    unset = ("GLIBC_TUNABLES", process_memory.NO_RESTART_VARIABLE, process_memory.RESTARTED_VARIABLE)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run(
        [sys.executable, "-c", program, "a", "b"], capture_output=True, text=True, check=True, env=env
    )
    helps = process_memory.huge_page_environment(
        env, process_memory.transparent_huge_pages(), process_memory._glibc_version()
    )
    if helps is None:
        assert done.stdout.splitlines() == ["start ['a', 'b']", "tunables None"]
    else:
        assert done.stdout.splitlines() == ["start ['a', 'b']", "start ['a', 'b']", "tunables glibc.malloc.hugetlb=1"]


def test_commands_restart_only_when_run_as_commands(monkeypatch):
    from terra.cli import app

    calls = []
    monkeypatch.setattr(process_memory, "restart_with_huge_pages", lambda: calls.append(True))
    monkeypatch.setattr(sys, "argv", ["terra-probe"])
    command = app.Command(name="terra-probe", python_m="python -m probe", doc="Probe.", run=lambda flags, rest: 0)
    assert command.main([]) == 0 and calls == []  # called from Python: this process stays
    assert command.main() == 0 and calls == [True]


@glibc
def test_a_command_that_cannot_restart_runs_on_in_its_process(monkeypatch):
    def refuse(*args):
        raise PermissionError("not executable")

    monkeypatch.setattr(process_memory, "huge_page_environment", lambda *args: {"GLIBC_TUNABLES": "x"})
    monkeypatch.setattr(process_memory.os, "execve", refuse)
    assert process_memory.restart_with_huge_pages() is None

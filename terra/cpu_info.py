"""The CPU this process runs on, as ``/proc/cpuinfo`` describes it. Plain Python, no JAX: the
commands read it before JAX is imported (``terra/compilation_cache.py``), the benchmarks to state
their machine (``terra/benchmarks/bandwidth.py``)."""

from typing import Dict


def first_processor(path: str = "/proc/cpuinfo") -> Dict[str, str]:
    """The first processor's fields (``model name``, ``flags``, ...), or ``{}`` where the file
    cannot be read (not Linux)."""
    fields: Dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():  # the first processor's block ends
                    break
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        return {}
    return fields

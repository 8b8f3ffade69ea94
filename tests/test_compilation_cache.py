"""The persistent compilation cache terra's commands keep (``terra/compilation_cache.py``): one
folder per machine kind under ``$TERRA_CACHE_DIR/xla``, the user's own JAX settings winning, set as
a command starts, and a program compiled by one process read by the next."""

import io
import os
import subprocess
import sys
import textwrap

from terra import compilation_cache
from terra.cli import app

CPUINFO = "processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n\nprocessor\t: 1\nmodel name\t: other\n"


def _cpuinfo(tmp_path, name: str, model: str, flags: str) -> str:
    path = tmp_path / name
    path.write_text(CPUINFO.format(model=model, flags=flags))
    return str(path)


def test_each_cpu_model_and_instruction_set_has_its_own_folder(tmp_path):
    avx2 = compilation_cache.host_kind(_cpuinfo(tmp_path, "a", "AMD EPYC", "fpu avx2 sse4_2"))
    assert compilation_cache.host_kind(_cpuinfo(tmp_path, "b", "AMD EPYC", "sse4_2 avx2 fpu")) == avx2  # flag order
    assert compilation_cache.host_kind(_cpuinfo(tmp_path, "c", "AMD EPYC", "fpu avx2 sse4_2 avx512f")) != avx2
    assert compilation_cache.host_kind(_cpuinfo(tmp_path, "d", "Intel Xeon", "fpu avx2 sse4_2")) != avx2
    assert compilation_cache.host_kind(str(tmp_path / "absent")) == "unknown-cpu"


def test_a_command_caches_under_terra_cache_dir_unless_the_user_set_a_cache(tmp_path, monkeypatch):
    environ = {"TERRA_CACHE_DIR": str(tmp_path / "cache")}
    folder = str(tmp_path / "cache" / "xla" / "k")
    assert compilation_cache.use_for_command(environ, kind="k") == folder and os.path.isdir(folder)
    assert environ == {
        "TERRA_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_COMPILATION_CACHE_DIR": folder,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": compilation_cache.MIN_COMPILE_SECONDS,
        "JAX_COMPILATION_CACHE_MAX_SIZE": compilation_cache.MAX_BYTES,
    }
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = {"JAX_COMPILATION_CACHE_MAX_SIZE": "5"}
    compilation_cache.use_for_command(home, kind="k")
    assert home["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "home" / ".cache" / "terra" / "xla" / "k")
    assert home["JAX_COMPILATION_CACHE_MAX_SIZE"] == "5"  # the user's size stands
    for own in ({"JAX_COMPILATION_CACHE_DIR": "/mine"}, {"JAX_COMPILATION_CACHE_DIR": ""}):  # "" turns it off
        kept = dict(own)
        assert compilation_cache.use_for_command(own, kind="k") is None and own == kept


def test_a_cache_folder_that_cannot_be_made_is_one_note_and_no_cache(tmp_path):
    (tmp_path / "file").write_text("")
    environ, err = {"TERRA_CACHE_DIR": str(tmp_path / "file" / "cache")}, io.StringIO()
    assert compilation_cache.use_for_command(environ, kind="k", err=err) is None
    assert "JAX_COMPILATION_CACHE_DIR" not in environ
    note = err.getvalue()
    assert note.count("\n") == 1 and note.startswith(f"note: no compilation cache: cannot make {tmp_path}/file/")
    assert "set TERRA_CACHE_DIR to a writable folder" in note


def test_a_command_sets_the_cache_as_it_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(app.process_memory, "restart_with_huge_pages", lambda: None)
    monkeypatch.setattr(compilation_cache, "use_for_command", lambda: calls.append("cache"))
    monkeypatch.setattr(sys, "argv", ["terra-probe", "--version"])
    command = app.Command(name="terra-probe", python_m="python -m probe", doc="Probe.", run=lambda flags, rest: 0)
    assert command.main() == 0 and calls == ["cache"]
    assert command.main([]) == 0 and calls == ["cache"]  # called from Python: the caller's JAX settings


def test_a_program_one_command_process_compiles_is_read_by_the_next(tmp_path):
    # What a command does as it starts, then a jitted program: the first process writes it to the
    # folder, the second reads it from there instead of compiling it.
    program = textwrap.dedent(
        """
        import os
        from terra import compilation_cache
        folder = compilation_cache.use_for_command()
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        import jax, jax.numpy as jnp
        from jax._src import monitoring
        hits = []
        monitoring.register_event_listener(
            lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
        )
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(4.0)).block_until_ready()
        print(folder, len(hits))
        """
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT") and "CACHE" not in k}
    environ.update(TERRA_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    runs = [
        subprocess.run([sys.executable, "-c", program], env=environ, capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    (folder, first_hits), (_, second_hits) = (r.stdout.split() for r in runs)
    assert folder.startswith(str(tmp_path / "xla")) and any(n.endswith("-cache") for n in os.listdir(folder))
    assert int(first_hits) == 0 and int(second_hits) >= 1

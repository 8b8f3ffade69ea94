"""The package installs as a package: a wheel built from the checkout carries the gin configs,
the licence and the console commands, and its commands run from a directory that is not the
checkout, finding the shipped configs (includes and all) and honouring a user's search path."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest

from terra.gin_config import parsing

from helpers import REPO_ROOT

# Every test here shares an end-to-end run (a training, a study or a built wheel): the slow tier.
pytestmark = pytest.mark.slow

COMMANDS = (
    "terra-train",
    "terra-evaluate",
    "terra-summarize",
    "terra-bench",
    "terra-reproduce",
    "terra-data",
    "terra-params",
    "terra-vocab",
    "terra-quickstart",
)


def _tracked_files():
    """The checkout's files as a clean clone of it would have them: git's tracked and not
    ignored files (the walk without build outputs when there is no git)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True
    )
    if listed.returncode == 0 and listed.stdout:
        return [p for p in listed.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(REPO_ROOT, p))]
    skip = {".git", ".venv", "runs", "out", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}
    found = []
    for root, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        found += [os.path.relpath(os.path.join(root, f), REPO_ROOT) for f in files]
    return found


def _built_kernel_library():
    """The native kernels the checkout's install built in place (None without a compiler)."""
    found = glob.glob(os.path.join(REPO_ROOT, "terra", "backends", "native", "_cpu_kernels*.so"))
    return found[0] if found else None


def _reuse_kernel_library(source) -> bool:
    """Put the checkout's built kernels where the wheel's build_ext looks for its output, newer
    than the source, so the build packages them instead of compiling them again (what this file
    tests is the packaging, not the compiler)."""
    library = _built_kernel_library()
    if library is None:
        return False
    build_lib = source / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    target = build_lib / "terra" / "backends" / "native" / os.path.basename(library)
    os.makedirs(target.parent, exist_ok=True)
    shutil.copy2(library, target)
    later = time.time() + 1
    os.utime(target, (later, later))
    return True


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel path, site folder)``: the wheel built from a copy of the checkout (no network:
    the pinned setuptools builds it; the kernels the install built are reused) and installed,
    without dependencies, into its own folder."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    for relative in _tracked_files():
        os.makedirs(source / os.path.dirname(relative), exist_ok=True)
        shutil.copy2(os.path.join(REPO_ROOT, relative), source / relative)
    _reuse_kernel_library(source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("terra-*.whl")
    site = root / "site"
    done = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return wheel, site


def test_the_wheel_carries_every_config_the_licence_and_the_commands(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"terra/configs/{n}" for folder in parsing.CONFIG_FOLDERS for n in parsing.shipped_configs(folder)}
    assert len(shipped) > 40 and shipped <= names
    # configs/ of the checkout is the package terra.configs in the wheel, not a package of its own.
    assert not any(n.startswith("configs/") for n in names)
    assert "terra/gin_config/registry.json" in names  # --gin overrides are checked against it before the imports
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert all(f"{command} = terra.cli." in text for command in COMMANDS)
    assert not any(n.startswith(("tests/", "docs/", "scripts/")) for n in names)
    library = _built_kernel_library()
    if library is not None:  # the kernels the install built travel in the wheel
        assert f"terra/backends/native/{os.path.basename(library)}" in names


def _run(site, command, cwd, *args):
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [str(site / "bin" / command), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_commands_run_from_outside_the_checkout_with_the_shipped_configs(installed, tmp_path):
    _, site = installed
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "runs").mkdir(parents=True)  # a MODEL_DIR folder named like a config folder
    where = _run(site, "terra-params", elsewhere, "--version")
    assert where.returncode == 0 and where.stdout.startswith("terra "), where.stderr
    # An experiment's includes (models, tasks, runs) resolve inside the installed package.
    result = _run(site, "terra-params", elsewhere, "--gin_file=experiments/quickstart.gin", "--gin.MODEL_DIR='runs/q'")
    assert result.returncode == 0, result.stderr
    assert "Parameters of experiments/quickstart.gin" in result.stdout and "total" in result.stdout
    located = subprocess.run(
        [sys.executable, "-c", "import terra; print(terra.__file__)"],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert located.stdout.strip().startswith(str(site)), located.stdout  # the wheel's terra, not the checkout's


def test_the_editable_install_finds_the_top_level_configs_from_another_folder(tmp_path):
    (tmp_path / "runs").mkdir()  # a MODEL_DIR folder named like a config folder
    command = os.path.join(os.path.dirname(sys.executable), "terra-params")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--gin_file=experiments/quickstart.gin", "--gin.MODEL_DIR='runs/q'"]
    result = subprocess.run([command, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Parameters of experiments/quickstart.gin" in result.stdout and "total" in result.stdout
    located = subprocess.run(
        [sys.executable, "-c", "import terra.configs; print(terra.configs.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert located.stdout.strip() == os.path.join(REPO_ROOT, "configs", "__init__.py"), located.stderr


def test_a_users_gin_file_includes_shipped_configs_through_a_search_path(installed, tmp_path):
    _, site = installed
    mine = tmp_path / "my_configs"
    mine.mkdir()
    (mine / "narrow.gin").write_text("include 'models/tiny.gin'\nTransformerConfig.d_model = 48\n")
    result = _run(site, "terra-params", tmp_path, f"--gin_search_paths={mine}", "--gin_file=narrow.gin")
    assert result.returncode == 0, result.stderr
    missing = _run(site, "terra-params", tmp_path, "--gin_file=narrow.gin")
    assert missing.returncode == 2 and "Gin file 'narrow.gin' not found" in missing.stderr
    assert "Traceback" not in missing.stderr

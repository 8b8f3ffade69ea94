"""The native kernels' sources travel with the source distribution: every ``.cc`` and ``.h`` of
``terra/backends/native/``, so that a build from the sdist (a user's ``pip install`` of it)
compiles the same library as a build from the checkout."""

import glob
import os
import subprocess
import sys
import tarfile

import pytest

from helpers import REPO_ROOT

pytestmark = pytest.mark.slow  # a subprocess that imports jax and writes an sdist

NATIVE = os.path.join("terra", "backends", "native")


def test_the_sdist_carries_every_native_source_and_header(tmp_path):
    sources = sorted(
        os.path.relpath(path, REPO_ROOT)
        for pattern in ("*.cc", "*.h")
        for path in glob.glob(os.path.join(REPO_ROOT, NATIVE, pattern))
    )
    assert any(name.endswith(".h") for name in sources) and any(name.endswith(".cc") for name in sources)
    # egg_info into tmp_path: the checkout's own terra.egg-info (the editable install's) stays as it is.
    command = [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (archive,) = glob.glob(str(tmp_path / "terra-*.tar.gz"))
    with tarfile.open(archive) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = [name for name in sources if name.replace(os.sep, "/") not in names]
    assert not missing, f"the sdist lacks {missing}"

"""Build of terra's optional native kernels and the package list; the rest of the package
metadata lives in setup.cfg.

The C++ sources in ``terra/backends/native/`` (the CPU's narrow-weight products, attention, LSH
hashing and convolutions) become one shared library, ``_cpu_kernels``, that
``terra/backends/native_kernels.py`` loads with ctypes and registers as XLA FFI custom calls. It is an
optional extension: without a C++17 compiler, or without jax (whose headers it includes), the
install still succeeds and terra decodes with its XLA products, after one warning at run time.
"""

import glob
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir():
    try:
        import jax.ffi
    except ImportError:  # an isolated build without jax: the extension is skipped, not the install
        return None
    return jax.ffi.include_dir()


class OptionalBuildExt(build_ext):
    """build_ext that reports a native library it cannot build instead of failing the install, and
    replaces an in-place library with a new file rather than rewriting it."""

    def build_extension(self, ext):
        if not ext.include_dirs:
            print("terra: jax is not importable at build time; the native kernels are skipped", file=sys.stderr)
            return
        super().build_extension(ext)

    def copy_file(self, infile, outfile, *args, **kwargs):
        # A running process that loaded the old library keeps its mapping of the old file after an
        # unlink; rewriting that file in place (what a plain copy does) can crash it.
        if os.path.isfile(outfile) and not self.dry_run:
            os.unlink(outfile)
        return super().copy_file(infile, outfile, *args, **kwargs)


# Every .cc of the folder is one library; its headers are `depends`: a change rebuilds the library,
# and the sdist carries them. Relative paths, as setuptools wants them (pip builds from this folder).
NATIVE_DIR = "terra/backends/native"
include = _ffi_include_dir()
NATIVE = Extension(
    "terra.backends.native._cpu_kernels",
    sources=sorted(glob.glob(f"{NATIVE_DIR}/*.cc")),
    depends=sorted(glob.glob(f"{NATIVE_DIR}/*.h")),
    include_dirs=[include] if include else [],
    language="c++",
    # No -march=native: the vector variants are chosen at run time (target attributes in the source),
    # so a library built on one x86-64 machine runs on any other.
    # jax's FFI headers as system headers: their own warnings are not this library's.
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-g0"] + (["-isystem", include] if include else []),
    optional=True,
)

# Listed here because setup.cfg's `find:` names packages by their folder: the gin configs are the
# package terra.configs, whose folder is the top-level configs/ (setup.cfg's package_dir).
PACKAGES = [
    *find_packages(include=["terra", "terra.*"]),
    *(f"terra.{name}" for name in find_packages(include=["configs", "configs.*"])),
]

setup(packages=PACKAGES, ext_modules=[NATIVE], cmdclass={"build_ext": OptionalBuildExt})

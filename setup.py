"""Build of terra's optional native kernels; the package metadata lives in setup.cfg.

``terra/quantization/native/narrow_products.cc`` becomes the shared library that
``terra/quantization/kernels.py`` loads with ctypes and registers as XLA FFI custom calls. It is an
optional extension: without a C++17 compiler, or without jax (whose headers it includes), the
install still succeeds and terra decodes with its XLA products, after one warning at run time.
"""

import os
import sys

from setuptools import Extension, setup
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


include = _ffi_include_dir()
NATIVE = Extension(
    "terra.quantization.native._narrow_products",
    sources=["terra/quantization/native/narrow_products.cc"],
    include_dirs=[include] if include else [],
    language="c++",
    # No -march=native: the vector variants are chosen at run time (target attributes in the source),
    # so a library built on one x86-64 machine runs on any other.
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-g0"],
    optional=True,
)

setup(ext_modules=[NATIVE], cmdclass={"build_ext": OptionalBuildExt})

"""How the command-line tools load TensorFlow, which terra uses for its input pipelines only.

Called by the entry points before anything imports ``terra.data``; importing a terra module
never does it for you (a library import must not redirect file descriptors or change
TensorFlow's device configuration behind a notebook's back).
"""

import os
import sys
import tempfile


def quiet_tensorflow_logging() -> None:
    """TensorFlow's C++ log (``op_kernel.cc`` warnings, each with a Python traceback when an
    input-pipeline function raises: hundreds of lines before terra's one ``error:`` line) off
    unless the user set ``TF_CPP_MIN_LOG_LEVEL``. It is read when TensorFlow loads, so this runs
    at ``import terra`` and in the commands, before anything imports TensorFlow."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def import_tensorflow_quietly() -> None:
    """Import TensorFlow with its GPUs hidden from it (as T5X and MaxText do), so it never takes
    accelerator memory from JAX, and without the start-up lines TF 2.21 prints from C++
    ("oneDNN custom operations are on", "Could not find cuda drivers", ...) before its logging
    is initialised, where ``TF_CPP_MIN_LOG_LEVEL`` cannot hide them. Those lines are shown if
    the import fails. Does nothing when TensorFlow is already imported."""
    if "tensorflow" in sys.modules:
        return
    quiet_tensorflow_logging()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            import tensorflow

            tensorflow.config.set_visible_devices([], "GPU")
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode("utf-8", "replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)

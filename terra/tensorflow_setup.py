"""How the command-line tools load TensorFlow, which terra uses for its input pipelines only.

Called before the data layer is first imported (:func:`before_data_layer`: by the registration
of the data configurables, and by the commands that read data, before they run); importing a
terra module never does it for you (a library import must not redirect file descriptors or change
TensorFlow's device configuration behind a notebook's back). TensorFlow is optional below the
data layer: on a host without it (an accelerator host with jax, flax, optax and orbax only) the
models, decoding, the train step and ``terra-bench train``/``decode`` run, and only a command
that reads data fails, on its import of ``terra.data``.
"""

import importlib.util
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
    the import fails. Does nothing when TensorFlow is already imported or is not installed."""
    if "tensorflow" in sys.modules or not tensorflow_installed():
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


# Set by the command runner (terra/cli/app.py): a command imports TensorFlow quietly when the
# data layer is first needed; a notebook's import only gets the log level (see the module).
_COMMAND_PROCESS = False


def quiet_imports_in_this_process() -> None:
    """Mark the process as a terra command: :func:`before_data_layer` then imports TensorFlow
    quietly (:func:`import_tensorflow_quietly`)."""
    global _COMMAND_PROCESS
    _COMMAND_PROCESS = True


def before_data_layer() -> None:
    """What runs before the data layer (seqio, TensorFlow) is first imported: in a command, the
    quiet import of TensorFlow; anywhere else, only its log level. Commands that read no data
    never reach it, so they never load TensorFlow."""
    if _COMMAND_PROCESS:
        import_tensorflow_quietly()
    else:
        quiet_tensorflow_logging()


# What ``terra.data`` imports when it loads.
DATA_LAYER_PACKAGES = ("tensorflow", "seqio")


def installed(package: str) -> bool:
    """Whether ``import package`` can find it (nothing is imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # an import hook that refuses it
        return False


def tensorflow_installed() -> bool:
    return installed("tensorflow")


def data_layer_installed() -> bool:
    """Whether ``terra.data`` (and what is built on it: the trainer's data, evaluation) can load."""
    return all(installed(p) for p in DATA_LAYER_PACKAGES)

"""Data: seqio sources, preprocessors, tasks, vocabularies and the embedded default corpus.

Importing the package registers every data configurable with gin; an entry point that reads
data imports it before parsing its gin config (gin refuses registrations after a config is
finalized). Task gin files start with ``import terra.data.tasks`` for the same reason.
"""

import os
import sys
import tempfile


def _import_tensorflow_quietly() -> None:
    """Import TensorFlow for the input pipeline only: its GPUs are hidden from it (as T5X and
    MaxText do) so it never takes accelerator memory from JAX. TF 2.21 prints start-up lines from
    C++ ("oneDNN custom operations are on", "Could not find cuda drivers", "failed call to
    cuInit") before its logging is initialised, so TF_CPP_MIN_LOG_LEVEL cannot hide them; they
    are dropped here unless the import fails."""
    if "tensorflow" in sys.modules:
        return
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


_import_tensorflow_quietly()

from terra.data import (  # noqa: E402,F401
    embedded,
    feature_converters,
    pipeline,
    preprocessors,
    sources,
    synthetic,
    tasks,
    vocabularies,
)

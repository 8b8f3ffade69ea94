"""Convert a checkpoint of the paper's own code (Trax) into a terra run directory.

``convert_trax_checkpoint`` reads a Trax weight file, maps every array onto the terra model of
the same architecture (from the Trax constructor arguments, or a terra gin config) and writes
``<out>/config.gin`` plus an orbax checkpoint (step 0, parameters only) that ``terra.load``,
``terra-evaluate``, ``terra-summarize``, fine-tuning (``INIT_FROM``) and ``terra-bench decode
--gin_file <out>/config.gin`` accept. Everything is read and checked before anything is
written, and the directory appears whole (written beside it, then renamed), so a failed
conversion leaves nothing behind.
"""

import json
import os
import shutil
import tempfile
from typing import Optional, Sequence

import gin

from terra.convert.trax_arguments import read_trax_arguments, trax_gin
from terra.convert.trax_file import read_trax_weights
from terra.convert.trax_layout import to_terra_params, trax_leaves
from terra.errors import CheckpointError, ConfigError
from terra.gin_config import parsing


def _model_gin(trax_config: Optional[str], gin_files: Sequence[str]):
    """The gin files and bindings of the architecture: from the Trax arguments, then any
    ``gin_files`` (tasks, overrides); or from ``gin_files`` alone. The arrays' shapes are checked
    against the result either way."""
    if trax_config:
        files, bindings = trax_gin(*read_trax_arguments(trax_config))
        return [*files, *gin_files], bindings
    if not gin_files:
        raise ConfigError(
            "name the architecture: --trax_config ARGS.json (the Trax constructor arguments) or a terra model "
            "config of the same architecture (--gin_file models/NAME.gin plus --gin bindings)."
        )
    return list(gin_files), []


def convert_trax_checkpoint(
    checkpoint: str,
    out: str,
    *,
    trax_config: Optional[str] = None,
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
    search_paths: Sequence[str] = (),
) -> str:
    """Writes the terra run directory ``out`` from the Trax weight file ``checkpoint``.

    Args:
      checkpoint: a Trax ``model.pkl.gz`` (``Layer.save_to_file``) or training checkpoint.
      out: the run directory to create; it must not exist yet (or be empty).
      trax_config: JSON of the Trax model's constructor arguments (``ARGS.json``).
      gin_files: a terra model config of the same architecture instead of ``trax_config``, or
        gin files parsed after the Trax arguments' config (a task config, so the run knows its
        data).
      gin_bindings: extra bindings, applied last (sizes, ``TASK_FEATURE_LENGTHS``, ...).

    Returns:
      ``out`` as an absolute path.

    Raises:
      ConfigError: arguments terra does not implement, or no architecture given.
      CheckpointError: an unreadable file, or arrays missing, extra or of the wrong shape
        (named); ``out`` already holding files.
    """
    from terra.training import checkpointing

    out = os.path.abspath(out)
    if os.path.islink(out):  # dangling or not: the run would land somewhere else than named
        raise CheckpointError(
            f"{out} is a symbolic link (to {os.readlink(out)}); convert into a new directory, or name the "
            "link's target."
        )
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"{out} already exists and is not empty; convert into a new directory.")
    files, bindings = _model_gin(trax_config, gin_files)
    parsing.parse_gin(files, [*bindings, *gin_bindings], finalize=False, search_paths=search_paths)
    model = parsing.build_model("building the model for the Trax checkpoint")
    abstract = model.abstract_params()
    leaves = trax_leaves(abstract)  # the limits and shape checks of the read come from the model
    flat = read_trax_weights(checkpoint, leaves)
    params = to_terra_params(flat, abstract, where=checkpoint, leaves=leaves)
    # The file name is quoted (JSON escapes newlines), so no name can add a line to the config.
    config = (
        f"# Converted by terra.convert from the Trax checkpoint {json.dumps(os.path.abspath(checkpoint))}\n"
        f"# ({len(flat)} arrays, {sum(a.size for a in flat):,d} parameters; terra parameters at step 0).\n\n"
        + gin.config_str()
    )
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.converting-", dir=parent)
    except OSError as e:
        raise CheckpointError(f"cannot create the run directory {out}: {e.strerror} ({e.filename}).") from None
    try:
        with open(os.path.join(staging, "config.gin"), "w") as f:
            f.write(config)
        writer = checkpointing.Checkpointer(staging, save_interval_steps=1, keep_last=None)
        try:
            writer.save(0, {"params": params}, force=True)
        finally:
            writer.close()
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.rename(staging, out)
    except OSError as e:  # a full disk, a read-only folder: nothing is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write the run directory {out}: {e.strerror or e}.") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out

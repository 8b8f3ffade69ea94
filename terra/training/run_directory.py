"""What a training run's directory keeps for whoever opens it later, from any folder or machine.

- ``config.gin``: the operative gin config. The data and vocabulary paths in it are absolute
  (``terra.gin_config.parsing`` makes them so when the config is parsed), so the run does not depend on
  the folder it was started from.
- ``vocabulary/sentencepiece.model``: a copy of the SentencePiece model the run tokenized with, as
  T5X and Hugging Face keep theirs. ``terra.load``, ``terra-evaluate --checkpoint`` and
  ``terra-summarize --checkpoint`` read this copy (a ``--vocabulary`` given to them still wins), so
  a run that is moved, copied to another machine or kept under ``gs://`` decodes with the ids it
  trained on.

Paths go through ``etils.epath`` (orbax's file layer): local folders and URLs alike.
"""

from typing import List, Optional, Sequence

from etils import epath
from gin import config_parser

from terra import files, run_config
from terra.errors import ConfigError
from terra.gin_config import reading, registry_file

CONFIG_FILE = run_config.CONFIG_FILE
VOCABULARY_FILE = "vocabulary/sentencepiece.model"
# The gin parameter the copied vocabulary is bound to (``terra.data.text_vocabulary``: every
# natural-text task reads its SentencePiece model through it).
VOCABULARY_PARAMETER = "terra.data.text_vocabulary.spm_path"
VOCABULARY_CONFIGURABLE = "terra.data.text_vocabulary"


def _run(model_dir: str) -> epath.Path:
    return epath.Path(files.absolute(model_dir))


def _config_file(model_dir: str) -> epath.Path:
    config = _run(model_dir) / CONFIG_FILE
    try:
        exists = files.lexists(str(config))
    except Exception as error:  # the file system's own (a bucket without credentials, no network)
        raise ConfigError(f"cannot read {config}: {' '.join(str(error).split())[:300]}") from None
    if not exists:
        raise ConfigError(
            f"{config} does not exist: give a terra model_dir (a training run writes its config.gin there), "
            "or name the run's experiment with --gin_file."
        )
    return config


def read_config(model_dir: str) -> run_config.RunConfig:
    """A run's ``config.gin``, read once and checked as data (:mod:`terra.run_config`):
    parse the returned text (``terra.gin_config.parsing.parse_gin`` takes it as a file), not the file."""
    return run_config.read_run_config(str(_config_file(model_dir)))


def config_path(model_dir: str) -> str:
    """The absolute path (or URL) of a run's ``config.gin``, after checking it as
    :func:`read_config` does; a clear error when there is none or it is refused."""
    return read_config(model_dir).path


def write_config(model_dir: str, text: str) -> None:
    """Write the run's ``config.gin``."""
    _run(model_dir).mkdir(parents=True, exist_ok=True)
    files.write_atomically(str(_run(model_dir) / CONFIG_FILE), text)


def vocabulary_file(vocabulary) -> Optional[str]:
    """The SentencePiece model file behind a seqio vocabulary; None for one without a file
    (bytes, digits)."""
    return getattr(vocabulary, "sentencepiece_model_file", None)


def save_vocabulary(model_dir: str, vocabulary) -> Optional[str]:
    """Copy the SentencePiece model behind ``vocabulary`` into the run (None when it has no file).

    A run that already holds a different model was trained with other ids: continuing it with
    this vocabulary would silently change the tokenization, so it is refused (nothing written)."""
    source = vocabulary_file(vocabulary)
    if not source:
        return None
    data = epath.Path(source).read_bytes()
    target = _run(model_dir) / VOCABULARY_FILE
    if target.exists():
        if target.read_bytes() != data:
            raise ConfigError(
                f"{_run(model_dir)} was trained with the SentencePiece model copied to {target}, and {source} "
                "differs from it: continuing the run would change its token ids. Pass that file "
                f"(--vocabulary={target}) or train into a new MODEL_DIR."
            )
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomically(str(target), data)
    return str(target)


def load_bindings(
    model_dir: str, config: Optional[run_config.RunConfig] = None, overrides: Sequence[str] = ()
) -> List[str]:
    """The gin bindings that open a run where it is now: its ``MODEL_DIR`` and, where the run
    holds one, its own copy of the vocabulary. Parse them after the run's ``config.gin`` and
    before the user's bindings, ``overrides`` (which win).

    A run whose ``config`` was trained with a SentencePiece model file (it binds
    ``text_vocabulary.spm_path``) but whose copy is gone is refused unless ``overrides`` name a
    vocabulary: the copy is what the run's token ids mean, and the path it was trained from may
    hold another model by now, or nothing. (A run trained with terra's built-in vocabulary opens
    with the built-in one.)"""
    run = _run(model_dir)
    bindings = [f"MODEL_DIR = {str(run)!r}"]
    vocabulary = run / VOCABULARY_FILE
    trained = config.bound_literal(VOCABULARY_CONFIGURABLE, "spm_path") if config is not None else None
    if files.lexists(str(vocabulary)):
        bindings.append(f"{VOCABULARY_PARAMETER} = {str(vocabulary)!r}")
    elif isinstance(trained, str) and trained and not _names_vocabulary(overrides):
        raise ConfigError(
            f"{vocabulary} is missing: the run keeps a copy of the SentencePiece model its token ids come from "
            f"(it was trained from {trained}). Put the run's copy back, or name the very file it was trained with "
            "(--vocabulary=FILE, or the binding terra.data.text_vocabulary.spm_path)."
        )
    return bindings


def _names_vocabulary(bindings: Sequence[str]) -> bool:
    """Whether ``bindings`` bind the SentencePiece model's path."""
    for binding in bindings:
        try:
            statements = reading.read_statements(binding)
        except SyntaxError:
            continue
        for statement in statements:
            if (
                isinstance(statement, config_parser.BindingStatement)
                and statement.arg_name == "spm_path"
                and registry_file.full_selector(statement.selector) == VOCABULARY_CONFIGURABLE
            ):
                return True
    return False

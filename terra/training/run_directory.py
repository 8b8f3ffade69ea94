"""What a training run's directory keeps for whoever opens it later, from any folder or machine.

- ``config.gin``: the operative gin config. The data and vocabulary paths in it are absolute
  (``terra.gin_utils`` makes them so when the config is parsed), so the run does not depend on
  the folder it was started from.
- ``vocabulary/sentencepiece.model``: a copy of the SentencePiece model the run tokenized with, as
  T5X and Hugging Face keep theirs. ``terra.load``, ``terra-evaluate --checkpoint`` and
  ``terra-summarize --checkpoint`` read this copy (a ``--vocabulary`` given to them still wins), so
  a run that is moved, copied to another machine or kept under ``gs://`` decodes with the ids it
  trained on.

Paths go through ``etils.epath`` (orbax's file layer): local folders and URLs alike.
"""

from typing import List, Optional

from etils import epath
from gin import config_parser

from terra import files, gin_text
from terra.errors import ConfigError

CONFIG_FILE = "config.gin"
VOCABULARY_FILE = "vocabulary/sentencepiece.model"
# The gin parameter the copied vocabulary is bound to (``terra.data.text_vocabulary``: every
# natural-text task reads its SentencePiece model through it).
VOCABULARY_PARAMETER = "terra.data.text_vocabulary.spm_path"
MAX_CONFIG_BYTES = 16 * 2**20


def _run(model_dir: str) -> epath.Path:
    return epath.Path(files.absolute(model_dir))


def config_path(model_dir: str) -> str:
    """The absolute path (or URL) of a run's ``config.gin``; a clear error when there is none."""
    config = _run(model_dir) / CONFIG_FILE
    try:
        exists = config.exists()
    except Exception as error:  # the file system's own (a bucket without credentials, no network)
        raise ConfigError(f"cannot read {config}: {' '.join(str(error).split())[:300]}") from None
    if not exists:
        raise ConfigError(
            f"{config} does not exist: give a terra model_dir (a training run writes its config.gin there), "
            "or name the run's experiment with --gin_file."
        )
    _check_config(config)
    return str(config)


def _check_config(config: epath.Path) -> None:
    """A run's ``config.gin`` may come from a stranger, and gin imports every module a config
    names and reads every file it includes. terra writes only ``import terra...`` lines and no
    includes, so anything else is refused before gin sees the file (nothing imported or read)."""
    size = config.stat().length
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{config} is {size:,d} bytes; a run's config.gin is tens of kilobytes (limit {MAX_CONFIG_BYTES:,d})."
        )
    try:
        statements = gin_text.read_statements(config.read_text())
    except SyntaxError as error:
        raise gin_text.explain_gin_error(error, f"file {config}") from None
    for statement in statements:
        if isinstance(statement, config_parser.ImportStatement) and statement.module.split(".")[0] != "terra":
            raise ConfigError(
                f"{config} imports {statement.module}: a run's config.gin imports only terra's own modules, so "
                "it was not parsed and nothing was imported. Name an experiment you trust with --gin_file instead."
            )
        if isinstance(statement, config_parser.IncludeStatement):
            raise ConfigError(
                f"{config} includes {statement.filename}: a run's config.gin is complete (terra writes no "
                "includes), so it was not parsed. Name an experiment you trust with --gin_file instead."
            )


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


def load_bindings(model_dir: str) -> List[str]:
    """The gin bindings that open a run where it is now: its ``MODEL_DIR`` and, where the run
    holds one, its own copy of the vocabulary. Parse them after the run's ``config.gin`` and
    before the user's bindings (which win)."""
    run = _run(model_dir)
    bindings = [f"MODEL_DIR = {str(run)!r}"]
    vocabulary = run / VOCABULARY_FILE
    if vocabulary.exists():
        bindings.append(f"{VOCABULARY_PARAMETER} = {str(vocabulary)!r}")
    return bindings

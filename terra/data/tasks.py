"""The task registry: every seqio task terra ships, under stable names, built from gin.

A task is built when it is first asked for (:func:`get_task`), from the gin bindings in force,
and registered with seqio under its name once: later calls return the registered task while the
bindings its data is built from (:data:`DEFINED_BY`) stay the same. When they changed (another
config was parsed, a data directory bound on the command line), the name now stands for a
different definition: the task is built again and replaces the registration, with a log line;
a task that other code registered under one of terra's names is replaced with a warning. So
re-running in a notebook or a test never hits seqio's "duplicate provider" error, and a binding
always reaches the source. Nothing touches the disk until a dataset is read, and
:func:`check_task_data` checks the data before a model is built.

| name | source | objective |
|---|---|---|
| ``c4_span_corruption`` | C4 (TFDS dir, or JSON shards if ``c4_source.json_path``) | T5 span corruption (paper §4.4) |
| ``c4_span_corruption_paper`` | same | the paper's code's span corruption: 512-token chunks, no sentinel ids added |
| ``c4_single_word_masking`` | same | span corruption with mean span 1 ("we mask single words", §4.4) |
| ``c4_lm`` | same | prefix LM |
| ``arxiv_summarization`` | arXiv (TFDS dir, or Cohan files: ``arxiv_source.cohan_path``) | article -> abstract |
| ``synthetic_copy`` / ``synthetic_addition`` | generated (paper Table 4) | copy / little-endian addition |
| ``synthetic_{copy,addition}_digits`` (``_lm``) | same, the reference's 13 ids | encoder-decoder (LM) form |
| ``embedded_span_corruption`` / ``embedded_lm`` | the embedded stdlib corpus | span corruption / prefix LM |
| ``embedded_summarization`` | the embedded stdlib corpus | docstring (or module) -> summary line |
| mixture ``synthetic`` | copy + addition, equal rates | |

The table of the tasks is :data:`terra.data.catalog.TASKS`, one :class:`~terra.data.catalog.TaskSpec`
per task: its name, its objective (:func:`task_objective`, :func:`is_summarization`; readable
without seqio, so tools can tell what a task trains without building it) and its builder, which
calls this module's ``*_task`` helpers. "A task name or a seqio task" becomes a task in one place,
:func:`resolve`, called by the entry points (the command line, ``Trainer``,
``terra.evaluation.evaluate``, ``terra.load``); every function below them takes the seqio task or
mixture itself.
Summarization tasks keep their source's document ``id`` as a string feature next to the
``*_pretokenized`` texts, for evaluation output; the feature converters drop it.
"""

import functools
import itertools
import logging
import os
import re
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import gin
import seqio

from terra.data import catalog, embedded, preprocessors, sources, synthetic, vocabularies
from terra.data.catalog import (  # noqa: F401  (re-exported: the table of the tasks, their objectives, the mixtures)
    MIXTURES,
    OBJECTIVES,
    PREFIX_LM,
    SPAN_CORRUPTION,
    SUMMARIZATION,
    SYNTHETIC,
    TASKS,
    TaskSpec,
    task_names,
)
from terra.errors import ConfigError

EXTRA_IDS = catalog.EXTRA_IDS


# --- sources and vocabularies, chosen by gin -------------------------------------------------


@gin.configurable(module="terra.data")
def c4_source(
    *,
    tfds_data_dir: Optional[str] = None,
    json_path: Union[str, Sequence[str], None] = None,
    validation_json_path: Union[str, Sequence[str], None] = None,
    version: str = sources.C4_TFDS_VERSION,
):
    """C4 from JSON-lines files when ``json_path`` is given (a folder, a glob, a pattern with
    ``{split}`` or a list of files; :func:`terra.data.sources.c4_json_files`), else from the
    TFDS directory. ``validation_json_path`` names the validation files explicitly."""
    if json_path:
        return sources.c4_json_source(path=json_path, validation_path=validation_json_path)
    return sources.c4_tfds_source(data_dir=tfds_data_dir, version=version)


@gin.configurable(module="terra.data")
def arxiv_source(*, tfds_data_dir: Optional[str] = None, cohan_path: Optional[str] = None):
    """arXiv from the extracted Cohan files when ``cohan_path`` is given, else from TFDS."""
    if cohan_path:
        return sources.arxiv_cohan_source(path=cohan_path)
    return sources.arxiv_tfds_source(data_dir=tfds_data_dir)


@gin.configurable(module="terra.data")
def text_vocabulary(
    *, spm_path: Optional[str] = None, extra_ids: int = EXTRA_IDS, embedded_vocab_size: Optional[int] = None
):
    """The SentencePiece model of the natural-text tasks: ``spm_path`` if given (the paper used
    T5's 32k model; train a substitute with ``terra-vocab``), else the vocabulary
    trained on the embedded corpus on first use."""
    if spm_path:
        return vocabularies.sentencepiece_vocabulary(spm_path, extra_ids=extra_ids)
    kwargs = {} if embedded_vocab_size is None else {"vocab_size": embedded_vocab_size}
    return vocabularies.embedded_vocabulary(extra_ids=extra_ids, **kwargs)


@gin.configurable(module="terra.data")
def synthetic_vocabulary():
    """Bytes: the digits, ``+`` and copy symbols need no trained vocabulary."""
    return vocabularies.byte_vocabulary()


def _features(vocabulary, add_eos: bool = True) -> Dict[str, seqio.Feature]:
    return {
        "inputs": seqio.Feature(vocabulary, add_eos=add_eos),
        "targets": seqio.Feature(vocabulary, add_eos=add_eos),
    }


# --- objectives --------------------------------------------------------------------------------


@gin.configurable(module="terra.data")
def pretraining_preprocessors(
    *,
    objective: str = "span_corruption",
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    concatenate_documents: bool = False,
    chunk_length: Optional[int] = None,
) -> list:
    """``text`` -> ``inputs``/``targets`` tokens. ``concatenate_documents`` packs documents into
    one stream before cutting chunks (T5 does; the paper's code does not). ``chunk_length``:
    span corruption's chunks (None: T5's, the longest whose corrupted inputs fill the inputs
    length; :func:`terra.data.preprocessors.span_corruption`)."""
    steps = [
        functools.partial(seqio.preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
        seqio.preprocessors.tokenize,
    ]
    if concatenate_documents:
        steps.append(preprocessors.concatenate_and_split)
    if objective == "span_corruption":
        steps.append(
            functools.partial(
                preprocessors.span_corruption,
                noise_density=noise_density,
                mean_noise_span_length=mean_noise_span_length,
                chunk_length=chunk_length,
            )
        )
    elif objective == "prefix_lm":
        steps.append(preprocessors.prefix_lm)
    else:
        raise ConfigError(f"pretraining objective '{objective}' is unknown; use 'span_corruption' or 'prefix_lm'.")
    return steps + [seqio.preprocessors.append_eos_after_trim]


def summarization_preprocessors() -> list:
    return [preprocessors.summarization, seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim]


def synthetic_preprocessors() -> list:
    return [seqio.preprocessors.tokenize, seqio.preprocessors.append_eos]


# --- the builders of terra.data.catalog.TASKS: seqio.Task's arguments --------------------------


def pretraining_task(source_fn, objective: str, *, extra_ids: Optional[int] = None, **kw) -> dict:
    """A pretraining task's arguments: ``source_fn()``'s texts through ``text_vocabulary`` (with
    ``extra_ids`` if given) and :func:`pretraining_preprocessors` for ``objective``."""
    vocabulary = text_vocabulary() if extra_ids is None else text_vocabulary(extra_ids=extra_ids)
    return dict(
        source=source_fn(),
        output_features=_features(vocabulary),
        preprocessors=pretraining_preprocessors(objective=objective, **kw),
    )


@gin.configurable(module="terra.data")
def c4_span_corruption_paper(*, chunk_length: int = 512, extra_ids: int = 0) -> dict:
    """The ``c4_span_corruption_paper`` task: C4 span corruption as the paper's own code makes it
    (Trax's ``c4_trax_data.gin``, ``docs/design/reference_code.md`` §5.1 and §8 item 8).

    * ``chunk_length``: documents are cut into chunks of 512 tokens (``MLM(max_length=512)``),
      not T5's 568, so the corrupted inputs (about 462 tokens with EOS) are padded to 512 and the
      targets (up to 104) to 256;
    * ``extra_ids``: no sentinel ids are appended to the SentencePiece vocabulary: sentinels count
      down from its top id (31999, 31998, ... for T5's 32,000-piece ``cc_all.32000``), reusing
      those pieces, so the model's vocabulary is 32,000 ids (divisible by every loss sparsity of
      the paper: 2, 4 and 8) instead of T5's 32,100.

    Noise density and mean span length come from ``pretraining_preprocessors`` (0.15 and 3, the
    reference's); EOS (id 1) ends both features. Returns ``seqio.TaskRegistry.add``'s arguments.
    """
    return pretraining_task(c4_source, "span_corruption", extra_ids=extra_ids, chunk_length=chunk_length)


def summarization_task(source_fn) -> dict:
    """A summarization task's arguments: article and abstract through ``text_vocabulary``."""
    return dict(
        source=source_fn(), output_features=_features(text_vocabulary()), preprocessors=summarization_preprocessors()
    )


def synthetic_task(source_fn) -> dict:
    """A synthetic task's arguments: bytes, EOS appended."""
    return dict(
        source=source_fn(), output_features=_features(synthetic_vocabulary()), preprocessors=synthetic_preprocessors()
    )


# The reference's synthetic tasks (docs/design/reference_code.md §7): its 13 ids, no EOS; copy words over
# its 11 symbols (ids 1..11); the language-model form's separators around the inputs.
COPY_SEPARATOR_ID = vocabularies.PAD_ID  # "0 w 0 w"
ADDITION_SEPARATOR_ID = vocabularies.DigitVocabulary.SEPARATOR_ID  # "<S> x+y <S> sum"


def digits_task(source_fn, *, separator_id: Optional[int] = None, **source_kwargs) -> dict:
    """A synthetic task in the reference's 13 ids, no EOS; with ``separator_id``, its
    language-model form."""
    steps = [seqio.preprocessors.tokenize]
    if separator_id is not None:
        steps.append(functools.partial(synthetic.separate_inputs, separator_id=separator_id))
    return dict(
        source=source_fn(**source_kwargs),
        output_features=_features(vocabularies.digit_vocabulary(), add_eos=False),
        preprocessors=steps,
    )


# --- the registry --------------------------------------------------------------------------------

# The gin configurables the task builders call: with the task's TaskSpec, their bindings in force
# are its definition. One list for every task rather than a field of each TaskSpec: the builders
# share configurables (text_vocabulary and pretraining_preprocessors serve the C4 and embedded
# tasks), so a per-task list would be one more thing to keep in step with each builder's calls.
DEFINED_BY = (
    c4_source,
    arxiv_source,
    text_vocabulary,
    synthetic_vocabulary,
    pretraining_preprocessors,
    c4_span_corruption_paper,
    synthetic.copy_dataset,
    synthetic.addition_dataset,
)
Provider = Union[seqio.Task, seqio.Mixture]
# What get_task registered under each name, and the definition it was built from.
_REGISTERED: Dict[str, Tuple[tuple, Provider]] = {}


# At most this many files of a bound folder are looked at (a full C4 folder holds about 2,000).
MAX_FILES_LOOKED_AT = 20_000


def _definition(name: str) -> tuple:
    """What task ``name`` is built from now: its TaskSpec (its builder), the bindings (references and macros
    resolved) of every configurable in :data:`DEFINED_BY` in the current gin scope, what is on
    disk where they point, and where the embedded corpus is (``$TERRA_CACHE_DIR``)."""
    bindings = [gin.get_bindings(fn) for fn in DEFINED_BY]
    on_disk = tuple(_on_disk(value) for values in bindings for value in values.values())
    return (TASKS[name], embedded.corpus_dir(), repr([sorted(b.items()) for b in bindings]), on_disk)


def _on_disk(value) -> tuple:
    """``(path, size, modification time)`` of the local files a bound value names: a file, the
    files under a folder, or under the folder of a glob or ``{split}`` pattern (the sources list
    the files when they are built, so data written, damaged or removed there since is another
    definition). Parsing makes the bound paths absolute; other values name nothing here."""
    if isinstance(value, (list, tuple)):
        return tuple(entry for v in value for entry in _on_disk(v))
    if not isinstance(value, str) or not os.path.isabs(value):
        return ()
    path = re.split(r"[*?\[{]", value, maxsplit=1)[0]
    if not os.path.exists(path):
        path = os.path.dirname(path)
    if os.path.isdir(path):
        paths = list(itertools.islice(_files_under(path), MAX_FILES_LOOKED_AT))
    elif os.path.exists(path):
        paths = [path]
    else:
        return ()
    return tuple((p, *_size_and_time(p)) for p in paths)


def _files_under(folder: str):
    for root, folders, names in os.walk(folder):
        folders.sort()
        yield from (os.path.join(root, name) for name in sorted(names))


def _size_and_time(path: str) -> tuple:
    try:
        stat = os.stat(path)
    except OSError:  # a broken link: the source's check names it
        return (None, None)
    return (stat.st_size, stat.st_mtime_ns)


def _registered(name: str, definition: tuple, registry, build: Callable[[], Provider]) -> Provider:
    """The provider registered under ``name`` if it was built from ``definition``; else the one
    ``build`` registers, replacing whatever the name stood for."""
    known, current = _REGISTERED.get(name), registry.get(name) if name in registry.names() else None
    if known is not None and current is known[1] and known[0] == definition:
        return current
    provider = build()
    if current is not None:
        if known is None or current is not known[1]:
            logging.warning("replacing the seqio provider '%s' that other code registered with terra's task", name)
        else:
            logging.info("'%s' is defined differently under the gin config in force: registering it again", name)
        registry.remove(name)
    registry.add_provider(name, provider)
    _REGISTERED[name] = (definition, provider)
    return provider


def get_task(name: str) -> Provider:
    """The task or mixture ``name`` of the gin config in force, registered with seqio once per
    definition (the module's docstring)."""
    if name in MIXTURES:
        members = tuple(get_task(member) for member in MIXTURES[name])
        return _registered(
            name, members, seqio.MixtureRegistry, lambda: seqio.Mixture(name, [(m, 1.0) for m in members])
        )
    if name not in TASKS:
        raise catalog.unknown_task(name)
    # A TaskSpec's builder is given this module (terra.data.catalog, which holds it, imports no seqio).
    build = functools.partial(TASKS[name].build, sys.modules[__name__])
    return _registered(name, _definition(name), seqio.TaskRegistry, lambda: seqio.Task(name, **build()))


def resolve(task: Union[str, Provider]) -> Provider:
    """The seqio task or mixture a caller gives: ``task`` itself, or terra's task or mixture of
    that name (:func:`get_task`). The entry points (the command line, ``Trainer``,
    ``terra.evaluation.evaluate``, ``terra.load``) call it once; what they call takes the task."""
    if isinstance(task, (seqio.Task, seqio.Mixture)):
        return task
    if isinstance(task, str):
        return get_task(task)
    raise ConfigError(
        f"a task is the name of one of terra's tasks ({', '.join(task_names())}) or a seqio Task or Mixture, "
        f"not {type(task).__name__} {task!r}."
    )


def register_all() -> list:
    """Register every task and mixture (idempotent); returns their names."""
    for name in task_names():
        get_task(name)
    return task_names()


def task_objective(provider: Provider) -> str:
    """What a task trains: ``"summarization"``, ``"span_corruption"``, ``"prefix_lm"`` or
    ``"synthetic"``, from its TaskSpec in :data:`TASKS`; for a mixture, its members' common
    objective, or ``"mixture"`` when they differ. Builds nothing (for a name,
    :func:`terra.data.catalog.objective`). Raises ConfigError for a task registered with seqio by
    other code, whose objective terra cannot know."""
    if isinstance(provider, seqio.Mixture):
        return catalog.mixed({task_objective(task) for task in provider.tasks})
    if provider.name not in TASKS:
        raise ConfigError(
            f"task '{provider.name}' is not one of terra's tasks, so its objective is unknown; "
            f"terra's tasks are {', '.join(task_names())}."
        )
    return TASKS[provider.name].objective


def is_summarization(provider: Provider) -> bool:
    """Whether a task (or every member of a mixture) maps a document to its summary."""
    return task_objective(provider) == SUMMARIZATION


def check_vocabulary_and_lengths(
    provider: Provider, feature_lengths: Mapping[str, int], *, vocab_size: int, max_len: int, feature_converter=None
) -> None:
    """Raise ConfigError, naming the binding to change, when a model with ``vocab_size`` ids and
    ``max_len`` positions cannot take ``provider``'s data (a task or mixture): a
    task vocabulary with more ids than the model has, or a feature length beyond ``max_len``;
    with a ``feature_converter``, also a model sequence (``encoder_input_tokens``,
    ``decoder_input_tokens``) beyond ``max_len``, such as the language-model form's
    ``inputs + targets``. Call it before anything is built or written."""
    catalog.raise_problems(
        vocabulary_and_length_problems(
            provider, feature_lengths, vocab_size=vocab_size, max_len=max_len, feature_converter=feature_converter
        )
    )


def vocabulary_and_length_problems(
    provider: Provider, feature_lengths: Mapping[str, int], *, vocab_size: int, max_len: int, feature_converter=None
) -> List[str]:
    """What :func:`check_vocabulary_and_lengths` finds, one sentence each."""
    sizes = {name: feature.vocabulary.vocab_size for name, feature in provider.output_features.items()}
    problems = catalog.fit_problems(sizes, feature_lengths, vocab_size=vocab_size, max_len=max_len)
    if feature_converter is not None and not any("max_len" in p for p in problems):
        model_lengths = feature_converter.get_model_feature_lengths(dict(feature_lengths))
        sequences = ("encoder_input_tokens", "decoder_input_tokens")
        too_long = {k: v for k, v in model_lengths.items() if k in sequences and v > max_len}
        if too_long:
            problems.append(
                f"{type(feature_converter).__name__} makes model sequences {too_long} of feature lengths "
                f"{dict(feature_lengths)}, beyond the model's max_len={max_len}; bind TransformerConfig.max_len = "
                f"{max(too_long.values())} or shorten the features"
            )
    return problems


def members(provider: Provider) -> list:
    """The seqio tasks of a task (itself) or of a mixture (its members)."""
    return list(provider.tasks) if isinstance(provider, seqio.Mixture) else [provider]


def read_checks(provider: Provider, split: str) -> dict:
    """``{"files", "readers"}`` of the local files ``split`` of a task (or mixture) reads and the
    readers that check them (none for TFDS or generated data): what a damaged-data error or a skip
    count is about (:func:`terra.data.json_lines.checked`, :class:`terra.data.pipeline.BatchIterator`)."""
    local = [task.source for task in members(provider) if isinstance(task.source, sources.LocalFileSource)]
    return {"files": [f for source in local for f in source.list_shards(split)], "readers": [s.reader for s in local]}


def check_task_data(provider: Provider, split: str = "train") -> None:
    """Fail now, with the path tried and how to get the data, if a split of a task (or mixture)
    cannot be read."""
    for task in members(provider):
        sources.check_available(task.source, split)

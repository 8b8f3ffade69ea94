"""Every task terra ships, in one table readable without building a task (and without seqio or
TensorFlow): :data:`TASKS` holds one :class:`TaskSpec` per task (its name, objective, builder,
and whether its texts go through ``text_vocabulary``), :data:`MIXTURES` the mixtures of them.
``terra.data.tasks`` builds and registers the tasks named here; ``terra.load`` reads this to open
a summarization run without the data pipeline.
"""

import dataclasses
import difflib
from types import ModuleType
from typing import Callable, Dict, List, Mapping, Sequence

from terra.errors import ConfigError

SUMMARIZATION, SPAN_CORRUPTION, PREFIX_LM, SYNTHETIC = "summarization", "span_corruption", "prefix_lm", "synthetic"
OBJECTIVES = (SUMMARIZATION, SPAN_CORRUPTION, PREFIX_LM, SYNTHETIC)
MIXTURE_OBJECTIVE = "mixture"
# T5's sentinel count, text_vocabulary's default extra_ids (<extra_id_0> is the top id).
EXTRA_IDS = 100


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Everything terra knows about one task.

    Attributes:
      name: the task's name (seqio's, ``%TASK``'s, ``--task``'s), its key in :data:`TASKS`.
      objective: what it trains, one of :data:`OBJECTIVES`.
      build: given the module ``terra.data.tasks`` (so that this one needs no seqio), returns
        ``seqio.Task``'s keyword arguments (source, output features, preprocessors) under the gin
        config in force. With the bindings of ``terra.data.tasks.DEFINED_BY`` (one list for every
        task: the builders share their configurables), the spec is the task's definition.
      text_vocabulary: both features are natural text through ``text_vocabulary()`` with its
        bound ``extra_ids`` (the same vocabulary for both), so a run of the task opens with the
        SentencePiece model alone (``terra.load``).
    """

    name: str
    objective: str
    build: Callable[[ModuleType], dict] = dataclasses.field(repr=False)
    text_vocabulary: bool = False

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            what = "no objective" if not self.objective else f"the unknown objective {self.objective!r}"
            raise ConfigError(
                f"task '{self.name}' has {what}; add it to its TaskSpec in terra.data.catalog.TASKS "
                f"(one of {', '.join(OBJECTIVES)})."
            )


def _table(*specs: TaskSpec) -> Dict[str, TaskSpec]:
    table = {spec.name: spec for spec in specs}
    if len(table) != len(specs):
        raise ValueError(f"two TaskSpecs share a name in {[spec.name for spec in specs]}")
    return table


# ``t`` is the module terra.data.tasks: its ``*_task`` helpers return seqio.Task's arguments from
# the gin-configured sources and vocabularies. The docstring of terra.data.tasks describes each task.
TASKS: Dict[str, TaskSpec] = _table(
    TaskSpec("c4_span_corruption", SPAN_CORRUPTION, lambda t: t.pretraining_task(t.c4_source, SPAN_CORRUPTION)),
    TaskSpec("c4_span_corruption_paper", SPAN_CORRUPTION, lambda t: t.c4_span_corruption_paper()),
    TaskSpec(
        "c4_single_word_masking",
        SPAN_CORRUPTION,
        lambda t: t.pretraining_task(t.c4_source, SPAN_CORRUPTION, mean_noise_span_length=1.0),
    ),
    TaskSpec("c4_lm", PREFIX_LM, lambda t: t.pretraining_task(t.c4_source, PREFIX_LM)),
    TaskSpec(
        "arxiv_summarization", SUMMARIZATION, lambda t: t.summarization_task(t.arxiv_source), text_vocabulary=True
    ),
    TaskSpec("synthetic_copy", SYNTHETIC, lambda t: t.synthetic_task(t.synthetic.copy_source)),
    TaskSpec("synthetic_addition", SYNTHETIC, lambda t: t.synthetic_task(t.synthetic.addition_source)),
    TaskSpec(
        "synthetic_copy_digits",
        SYNTHETIC,
        lambda t: t.digits_task(t.synthetic.copy_source, alphabet=t.vocabularies.DigitVocabulary.SYMBOLS),
    ),
    TaskSpec(
        "synthetic_copy_digits_lm",
        SYNTHETIC,
        lambda t: t.digits_task(
            t.synthetic.copy_source,
            separator_id=t.COPY_SEPARATOR_ID,
            alphabet=t.vocabularies.DigitVocabulary.SYMBOLS,
        ),
    ),
    TaskSpec("synthetic_addition_digits", SYNTHETIC, lambda t: t.digits_task(t.synthetic.addition_source)),
    TaskSpec(
        "synthetic_addition_digits_lm",
        SYNTHETIC,
        lambda t: t.digits_task(t.synthetic.addition_source, separator_id=t.ADDITION_SEPARATOR_ID),
    ),
    TaskSpec(
        "embedded_span_corruption", SPAN_CORRUPTION, lambda t: t.pretraining_task(t.embedded.lm_source, SPAN_CORRUPTION)
    ),
    TaskSpec("embedded_lm", PREFIX_LM, lambda t: t.pretraining_task(t.embedded.lm_source, PREFIX_LM)),
    TaskSpec(
        "embedded_summarization",
        SUMMARIZATION,
        lambda t: t.summarization_task(t.embedded.summarization_source),
        text_vocabulary=True,
    ),
)
# Each mixture's members, mixed at equal rates.
MIXTURES: Dict[str, Sequence[str]] = {"synthetic": ("synthetic_copy", "synthetic_addition")}


def task_names() -> list:
    """The tasks, then the mixtures, each sorted."""
    return sorted(TASKS) + sorted(MIXTURES)


def unknown_task(name: str) -> ConfigError:
    """The error for a name that is neither a task nor a mixture, with the closest one."""
    close = difflib.get_close_matches(str(name), task_names(), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown task '{name}'.{hint} Known tasks: {', '.join(task_names())}.")


def objective(name: str) -> str:
    """What the task or mixture ``name`` trains (a mixture: :func:`mixed` of its members');
    ConfigError (:func:`unknown_task`) for a name that is not one of terra's."""
    if name in MIXTURES:
        return mixed({objective(member) for member in MIXTURES[name]})
    if name not in TASKS:
        raise unknown_task(name)
    return TASKS[name].objective


def mixed(objectives: set) -> str:
    """A mixture's objective: its members' common one, or ``"mixture"`` when they differ."""
    return next(iter(objectives)) if len(objectives) == 1 else MIXTURE_OBJECTIVE


def is_summarization(name: str) -> bool:
    """Whether the task (or every member of the mixture) ``name`` maps a document to its summary."""
    return objective(name) == SUMMARIZATION


def check_fits(
    vocabulary_sizes: Mapping[str, int], feature_lengths: Mapping[str, int], *, vocab_size: int, max_len: int
):
    """Raise ConfigError, naming the binding to change, when a model with ``vocab_size`` ids and
    ``max_len`` positions cannot take a task whose features have ``vocabulary_sizes`` ids
    (``{feature: ids}``) at ``feature_lengths``: every problem in one error."""
    raise_problems(fit_problems(vocabulary_sizes, feature_lengths, vocab_size=vocab_size, max_len=max_len))


def fit_problems(
    vocabulary_sizes: Mapping[str, int], feature_lengths: Mapping[str, int], *, vocab_size: int, max_len: int
) -> List[str]:
    """What :func:`check_fits` finds, one sentence each (the vocabulary, then the lengths)."""
    problems = []
    too_many = {name: size for name, size in vocabulary_sizes.items() if size > vocab_size}
    if too_many:
        name, size = next(iter(too_many.items()))
        problems.append(
            f"the task's '{name}' vocabulary has {size} ids but the model's vocab_size is {vocab_size}; bind "
            f"TransformerConfig.vocab_size = {max(too_many.values())} (or a multiple of 128 above it)"
        )
    too_long = {k: v for k, v in feature_lengths.items() if v > max_len}
    if too_long:
        problems.append(
            f"feature lengths {too_long} exceed the model's max_len={max_len}; "
            f"bind TransformerConfig.max_len = {max(too_long.values())} or shorten the features"
        )
    return problems


def raise_problems(problems: Sequence[str]) -> None:
    """Nothing, one problem as its own ``ConfigError``, or several numbered in one."""
    problems = [p.rstrip(". ") for p in problems]
    if len(problems) == 1:
        raise ConfigError(problems[0] + ".")
    if problems:
        raise ConfigError(
            f"{len(problems)} problems, each to fix before a run: "
            + " ".join(f"({i}) {p}." for i, p in enumerate(problems, 1))
        )

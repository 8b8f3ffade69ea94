"""What each of terra's tasks is, readable without building it (and without seqio or
TensorFlow): its objective, whether its texts go through the SentencePiece model of
``text_vocabulary``, and the mixtures. ``terra.data.tasks`` builds the tasks named here;
``terra.load`` reads this to open a summarization run without the data pipeline.
"""

from typing import Dict, Mapping, Sequence

from terra.errors import ConfigError

SUMMARIZATION, SPAN_CORRUPTION, PREFIX_LM, SYNTHETIC = "summarization", "span_corruption", "prefix_lm", "synthetic"
OBJECTIVES = (SUMMARIZATION, SPAN_CORRUPTION, PREFIX_LM, SYNTHETIC)
MIXTURE_OBJECTIVE = "mixture"

# What each task trains (terra.data.tasks.TASK_BUILDERS has one builder per entry; a test keeps
# the two in step).
TASK_OBJECTIVES: Dict[str, str] = {
    "c4_span_corruption": SPAN_CORRUPTION,
    "c4_span_corruption_paper": SPAN_CORRUPTION,
    "c4_single_word_masking": SPAN_CORRUPTION,
    "c4_lm": PREFIX_LM,
    "arxiv_summarization": SUMMARIZATION,
    "synthetic_copy": SYNTHETIC,
    "synthetic_addition": SYNTHETIC,
    "synthetic_copy_digits": SYNTHETIC,
    "synthetic_copy_digits_lm": SYNTHETIC,
    "synthetic_addition_digits": SYNTHETIC,
    "synthetic_addition_digits_lm": SYNTHETIC,
    "embedded_span_corruption": SPAN_CORRUPTION,
    "embedded_lm": PREFIX_LM,
    "embedded_summarization": SUMMARIZATION,
}
MIXTURES: Dict[str, Sequence[str]] = {"synthetic": ("synthetic_copy", "synthetic_addition")}
# The tasks whose inputs and targets are natural text through ``text_vocabulary()`` with its
# bound ``extra_ids`` (the summarization tasks: the same vocabulary for both features).
TEXT_VOCABULARY_TASKS = ("arxiv_summarization", "embedded_summarization")
# T5's sentinel count, text_vocabulary's default extra_ids (<extra_id_0> is the top id).
EXTRA_IDS = 100


def objective(name: str) -> str:
    """What the task or mixture ``name`` trains (a mixture: its members' common objective, or
    ``"mixture"``); ConfigError for a name that is not one of terra's."""
    if name in MIXTURES:
        objectives = {objective(member) for member in MIXTURES[name]}
        return objectives.pop() if len(objectives) == 1 else MIXTURE_OBJECTIVE
    if name not in TASK_OBJECTIVES:
        raise ConfigError(f"task '{name}' is not one of terra's tasks, so its objective is unknown.")
    return TASK_OBJECTIVES[name]


def check_fits(
    vocabulary_sizes: Mapping[str, int], feature_lengths: Mapping[str, int], *, vocab_size: int, max_len: int
):
    """Raise ConfigError, naming the binding to change, when a model with ``vocab_size`` ids and
    ``max_len`` positions cannot take a task whose features have ``vocabulary_sizes`` ids
    (``{feature: ids}``) at ``feature_lengths``."""
    for name, size in vocabulary_sizes.items():
        if size > vocab_size:
            raise ConfigError(
                f"the task's '{name}' vocabulary has {size} ids but the model's vocab_size is {vocab_size}; bind "
                f"TransformerConfig.vocab_size = {size} (or a multiple of 128 above it)."
            )
    too_long = {k: v for k, v in feature_lengths.items() if v > max_len}
    if too_long:
        raise ConfigError(
            f"feature lengths {too_long} exceed the model's max_len={max_len}; "
            f"bind TransformerConfig.max_len = {max(too_long.values())} or shorten the features."
        )

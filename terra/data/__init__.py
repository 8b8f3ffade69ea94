"""Data: seqio sources, preprocessors, tasks, vocabularies and the embedded default corpus.

Every gin-configurable data function is re-exported here under the name gin knows it by
(``terra.data.copy_dataset``, ``terra.data.arxiv_source``, ...); ``terra.gin_config.registration``
registers them with gin (``register_data_layer``) before a config that names them is parsed.
The re-exports load on first use, with seqio and TensorFlow (command-line tools load TensorFlow
through ``terra.tensorflow_setup`` first), so the submodules that need neither
(``terra.data.catalog``, ``terra.data.python_vocabulary``) import without them.
"""

__all__ = [
    "addition_dataset",
    "arxiv_source",
    "build_corpus",
    "byte_vocabulary",
    "c4_source",
    "c4_span_corruption_paper",
    "concatenate_and_split",
    "copy_dataset",
    "corpus_texts",
    "digit_vocabulary",
    "embedded_vocabulary",
    "encoder_decoder_converter",
    "full_lm",
    "get_dataset",
    "language_model_converter",
    "length_concat_converter",
    "lm_source",
    "prefix_lm",
    "prefix_lm_converter",
    "pretraining_preprocessors",
    "random_spans_noise_mask",
    "sentencepiece_vocabulary",
    "single_word_masking",
    "span_corruption",
    "split_tokens",
    "summarization",
    "summarization_source",
    "synthetic_vocabulary",
    "text_vocabulary",
    "train_sentencepiece",
]


def __getattr__(name):
    """A re-exported function, its module imported on first use. A submodule is not an attribute
    until it is imported (``from terra.data import tasks`` imports it)."""
    if name not in __all__:
        raise AttributeError(f"module 'terra.data' has no attribute {name!r}")
    import sys

    # Read from sys.modules below: mid-way through a circular import a submodule is there before
    # it is an attribute of the package.
    import terra.data.embedded  # noqa: F401
    import terra.data.feature_converters  # noqa: F401
    import terra.data.pipeline  # noqa: F401
    import terra.data.preprocessors  # noqa: F401
    import terra.data.synthetic  # noqa: F401
    import terra.data.tasks  # noqa: F401
    import terra.data.vocabularies  # noqa: F401

    for home in ("embedded", "feature_converters", "pipeline", "preprocessors", "synthetic", "tasks", "vocabularies"):
        module = sys.modules[f"terra.data.{home}"]
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module 'terra.data' has no attribute {name!r}")

"""Data: seqio sources, preprocessors, tasks, vocabularies and the embedded default corpus.

Every gin-configurable data function is re-exported here under the name gin knows it by
(``terra.data.copy_dataset``, ``terra.data.arxiv_source``, ...); ``terra.configurables``
registers them with gin before any config is parsed. Command-line tools load TensorFlow through
``terra.tensorflow_setup`` first.
"""

from terra.data import (  # noqa: F401
    embedded,
    feature_converters,
    pipeline,
    preprocessors,
    sources,
    synthetic,
    tasks,
    vocabularies,
)
from terra.data.embedded import build_corpus, corpus_texts, lm_source, summarization_source
from terra.data.feature_converters import (
    encoder_decoder_converter,
    language_model_converter,
    length_concat_converter,
    prefix_lm_converter,
)
from terra.data.pipeline import get_dataset
from terra.data.preprocessors import (
    concatenate_and_split,
    full_lm,
    prefix_lm,
    random_spans_noise_mask,
    single_word_masking,
    span_corruption,
    split_tokens,
    summarization,
)
from terra.data.synthetic import addition_dataset, copy_dataset
from terra.data.tasks import (
    arxiv_source,
    c4_source,
    c4_span_corruption_paper,
    pretraining_preprocessors,
    synthetic_vocabulary,
    text_vocabulary,
)
from terra.data.vocabularies import (
    byte_vocabulary,
    digit_vocabulary,
    embedded_vocabulary,
    sentencepiece_vocabulary,
    train_sentencepiece,
)

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

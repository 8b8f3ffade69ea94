"""Every gin configurable of terra, registered in one place.

Layers, models and the data pipeline's building blocks (sources, preprocessors, vocabularies,
feature converters) are plain Python and import no gin: this module registers them
(``gin.register``, which leaves the class or function itself unchanged, so calling it from
Python never reads gin) under the package they are imported from
(``terra.layers.SparseFeedForward``). The entry functions and settings of training, data,
evaluation and parallel are decorated where they are defined (``@gin.configurable``), because
their Python callers reach the configured version by calling them
(``Trainer`` builds ``CheckpointSettings()``; a task builder calls ``c4_source()``); importing
this module imports them, and :data:`DECORATED` lists them.

Whatever parses a config (``terra.gin_config.parsing.parse_gin``) imports this module first, so gin knows
the names of the model core (layers, models, training, parallel) before it reads a config. The
data layer (``terra.data``, ``terra.evaluation``: seqio on TensorFlow) is registered by
:func:`register_data_layer`, which ``parse_gin`` calls only when the config names one of its
configurables (and ``terra.load`` before it builds a task), so a command that reads no data
(``terra-params``, ``terra-bench decode``, ``terra-convert``) never imports TensorFlow.
``terra/gin_config/registry.json`` is written from :func:`registered`, which registers both.
"""

import inspect
from typing import Callable, Dict, List, Optional

import gin

from terra import layers, models, tensorflow_setup, training
from terra.gin_config import registry_file
from terra.parallel import mesh

# Registered here: gin builds them when a config refers to them (``@SparseFeedForward``).
# What terra.data and terra.evaluation add is in register_data_layer.
REGISTERED = {
    "terra.layers": (
        layers.FeedForward,
        layers.SelfAttention,
        layers.CausalSelfAttention,
        layers.CrossAttention,
        layers.DenseLogits,
        layers.SparseFeedForward,
        layers.MultiplicativeDense,
        layers.SparseQKVAttention,
        layers.SparseQueryCrossAttention,
        layers.SparseLossLogits,
        layers.MixtureOfExpertsFeedForward,
        layers.LSHSelfAttention,
        layers.LowRankSRU,
        layers.FeedForwardWithSRU,
        layers.HalfResidual,
        layers.ReversibleStack,
        layers.default_axis_rules,
    ),
    "terra.models": (
        models.TransformerConfig,
        models.EncoderDecoderTransformer,
        models.Terraformer,
        models.EncoderDecoderModel,
        models.TerraformerModel,
        models.shared_qk_from_dense_attention,
    ),
}

# Decorated where they are defined (gin at the entry functions: see the module docstring).
DECORATED = {
    "terra.parallel": (mesh.make_mesh,),
    "terra.training": (
        training.Trainer,
        training.ParallelSettings,
        training.CheckpointSettings,
        training.EvaluationSettings,
        training.LoggingSettings,
        training.Checkpointer,
        training.build_optimizer,
        training.adafactor,
        training.adamw,
        training.sgd,
        training.constant_schedule,
        training.rsqrt_schedule,
        training.warmup_cosine_schedule,
    ),
}

for _module, _configurables in REGISTERED.items():
    for _configurable in _configurables:
        gin.register(_configurable, module=_module)
del _module, _configurables, _configurable
# The selectors of the data layer's configurables (terra/gin_config/registry.json names them).
DATA_LAYER_MODULES = ("terra.data", "terra.evaluation")


def register_data_layer() -> None:
    """Import the data layer and register its configurables with gin, once per process: a
    command imports TensorFlow quietly first (``tensorflow_setup.before_data_layer``). Does
    nothing where seqio and TensorFlow are not installed (the model core's configs still parse;
    a config that needs the data layer then fails naming the configurable)."""
    if "terra.data" in REGISTERED or not tensorflow_setup.data_layer_installed():
        return
    tensorflow_setup.before_data_layer()
    with gin.unlock_config():  # a config locked without the data layer (a model-only run) takes it now
        from terra import data, evaluation
        from terra.data import embedded, feature_converters, preprocessors, vocabularies

    data_registered = (
        vocabularies.sentencepiece_vocabulary,
        vocabularies.byte_vocabulary,
        vocabularies.digit_vocabulary,
        vocabularies.train_sentencepiece,
        vocabularies.embedded_vocabulary,
        feature_converters.encoder_decoder_converter,
        feature_converters.prefix_lm_converter,
        feature_converters.length_concat_converter,
        feature_converters.language_model_converter,
        embedded.build_corpus,
        embedded.lm_source,
        embedded.summarization_source,
        embedded.corpus_texts,
        preprocessors.random_spans_noise_mask,
        preprocessors.span_corruption,
        preprocessors.single_word_masking,
        preprocessors.split_tokens,
        preprocessors.concatenate_and_split,
        preprocessors.prefix_lm,
        preprocessors.full_lm,
        preprocessors.summarization,
    )
    with gin.unlock_config():
        for configurable in data_registered:
            gin.register(configurable, module="terra.data")
    REGISTERED["terra.data"] = data_registered
    DECORATED["terra.data"] = (
        data.c4_source,
        data.arxiv_source,
        data.text_vocabulary,
        data.synthetic_vocabulary,
        data.pretraining_preprocessors,
        data.c4_span_corruption_paper,
        data.copy_dataset,
        data.addition_dataset,
        data.get_dataset,
    )
    DECORATED["terra.evaluation"] = (evaluation.evaluate, evaluation.RougeEvaluation)


def registered() -> Dict[str, Callable]:
    """``{selector: class or function}`` of every configurable terra registers, the data layer's
    included (registered first), the undecorated form (what ``inspect.signature`` reads the
    parameters of)."""
    register_data_layer()
    out = {}
    for group in (REGISTERED, DECORATED):
        for module, configurables in group.items():
            for configurable in configurables:
                out[f"{module}.{configurable.__name__}"] = inspect.unwrap(configurable)
    return dict(sorted(out.items()))


def live_registry() -> Dict[str, Optional[List[str]]]:
    """``{selector: parameter names or None}`` of every configurable registered here: what
    ``terra/gin_config/registry.json`` stores (``make gin-registry`` writes it)."""
    return {selector: registry_file.parameters(fn) for selector, fn in registered().items()}

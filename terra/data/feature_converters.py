"""Feature converters: task features (``inputs``, ``targets``) -> the arrays a model consumes.

* :func:`encoder_decoder_converter` — seqio's ``EncDecFeatureConverter`` without packing:
  ``encoder_input_tokens [I]``, ``decoder_input_tokens``/``decoder_target_tokens``/
  ``decoder_loss_weights [T]`` (the names ``Model.loss_fn`` reads; loss weights
  are 0 on padding).
* :class:`LengthConcatFeatureConverter` — the same features plus Terraformer's LengthConcat
  layout (paper §4.1; ``docs/design/reference_code.md`` §4.1): one causal sequence of length ``I + T`` made
  of the real input tokens, then the shifted targets, with the input padding moved to the end,
  so the decoder attends to the whole input and its own past in one stream. Loss weights mark
  only the target positions. For decoder-only models over tokens: ``terra.models.Terraformer``
  builds the same layout from encoder *vectors* (``terra.layers.length_concat``) and reads the
  plain encoder-decoder features.
* :func:`prefix_lm_converter` — seqio's ``PrefixLMFeatureConverter`` (loss on targets only): the
  LM format of the synthetic tasks (``[x + y] -> sum`` in one sequence, as the reference's LM
  variant).

Packing of several examples into one row is left to the pretraining tasks, which concatenate
documents before cutting chunks (T5's span-corruption packing; no segment ids needed).
"""

from typing import Mapping

import gin
import seqio
import tensorflow as tf


def encoder_decoder_converter() -> seqio.FeatureConverter:
    """Unpacked encoder-decoder features (pad id 0, BOS 0 for the shifted decoder input)."""
    return seqio.EncDecFeatureConverter(pack=False)


def prefix_lm_converter() -> seqio.FeatureConverter:
    """Inputs and targets in one decoder sequence; loss on the targets only."""
    return seqio.PrefixLMFeatureConverter(pack=False, loss_on_targets_only=True)


class LengthConcatFeatureConverter(seqio.EncDecFeatureConverter):
    """Encoder-decoder features plus the concatenated stream Terraformer's decoder runs over.

    Extra model features, for ``task_feature_lengths = {"inputs": I, "targets": T}``:
      concat_input_tokens  [I + T]: input tokens[:n], decoder_input_tokens, then I - n pads
      concat_target_tokens [I + T]: n zeros, decoder_target_tokens, I - n zeros
      concat_loss_weights  [I + T]: 1 exactly where concat_target_tokens is a real target
      encoder_lengths      []     : n, the number of real (non-pad) input tokens

    ``n`` varies per example, which is why the padding moves to the end: the decoder positions
    follow the last real input token directly.
    """

    MODEL_FEATURES = {
        **seqio.EncDecFeatureConverter.MODEL_FEATURES,
        "concat_input_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "concat_target_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "concat_loss_weights": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "encoder_lengths": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=0),
    }

    def __init__(self, **kwargs):
        super().__init__(pack=False, **kwargs)

    def _convert_example(self, features: Mapping[str, tf.Tensor]) -> Mapping[str, tf.Tensor]:
        d = dict(super()._convert_example(features))
        inputs = d["encoder_input_tokens"]
        n = tf.reduce_sum(tf.cast(tf.not_equal(inputs, 0), tf.int32))
        pads = tf.zeros_like(inputs)[: tf.size(inputs) - n]
        lead = tf.zeros_like(inputs)[:n]
        d["concat_input_tokens"] = tf.concat([inputs[:n], d["decoder_input_tokens"], pads], 0)
        d["concat_target_tokens"] = tf.concat([lead, d["decoder_target_tokens"], pads], 0)
        d["concat_loss_weights"] = tf.concat([lead, d["decoder_loss_weights"], pads], 0)
        d["encoder_lengths"] = n
        return d

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> Mapping[str, int]:
        lengths = dict(super().get_model_feature_lengths(task_feature_lengths))
        total = task_feature_lengths["inputs"] + task_feature_lengths["targets"]
        lengths.update(
            concat_input_tokens=total, concat_target_tokens=total, concat_loss_weights=total, encoder_lengths=1
        )
        return lengths


def length_concat_converter() -> seqio.FeatureConverter:
    return LengthConcatFeatureConverter()


for _fn in (encoder_decoder_converter, prefix_lm_converter, length_concat_converter):
    gin.register(_fn, module="terra.data")

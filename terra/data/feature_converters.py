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
* :func:`prefix_lm_converter` — seqio's ``PrefixLMFeatureConverter`` (loss on targets only):
  decoder-only features (``decoder_*`` over ``[inputs | targets]``), for a decoder-only model.
  Its loss weights are 1 on every non-zero token after the inputs *and* on zero tokens inside
  the inputs, so it does not fit inputs that hold the pad id (the reference's copy, ``0 w 0``).
* :class:`LanguageModelFeatureConverter` — the language-model form of the synthetic tasks (paper
  Table 4 as the reference trains its Transformer baseline, ``docs/design/reference_code.md`` §7) for the
  encoder-decoder model families: the decoder sequence is ``[inputs | targets]``, the loss is on
  the targets' positions only, and the encoder input is one pad token. ``EncoderDecoderTransformer``
  and ``Terraformer`` then run as causal language models over the whole sequence.

Packing of several examples into one row is left to the pretraining tasks, which concatenate
documents before cutting chunks (T5's span-corruption packing; no segment ids needed).
"""

from typing import Mapping

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


class LanguageModelFeatureConverter(seqio.FeatureConverter):
    """A causal language model over ``[inputs | targets]``, in the features the encoder-decoder
    families read (no packing).

    For ``task_feature_lengths = {"inputs": I, "targets": T}``:
      decoder_target_tokens [I + T]: the example's inputs, then its targets, then pads
      decoder_input_tokens  [I + T]: the same shifted right, 0 first (the reference's ShiftRight)
      decoder_loss_weights  [I + T]: 1 exactly on the targets' positions (by position, so a pad id
                                     inside the inputs, as in the copy task's ``0 w 0``, gets none)
      encoder_input_tokens  [1]    : one pad token, an empty encoder input

    With no real encoder token, ``Terraformer``'s decoder stream is the decoder sequence alone
    (LengthConcat puts no encoder vector in it) and ``EncoderDecoderTransformer``'s decoder
    attends only to its own past, its encoder-decoder attention reading one constant vector (a
    learned bias per layer). Either is then a language model over the whole sequence, as the
    reference's ``TransformerLM`` trains on the synthetic tasks' ``(x, x, weights)`` streams.
    The length each model's positional table must hold is ``I + T``.
    """

    TASK_FEATURES = {
        "inputs": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "targets": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    MODEL_FEATURES = {
        "encoder_input_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "decoder_target_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "decoder_input_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "decoder_loss_weights": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    PACKING_FEATURE_DTYPES = {}

    def __init__(self, **kwargs):
        super().__init__(pack=False, **kwargs)

    def _convert_features(self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
        total = self.get_model_feature_lengths(task_feature_lengths)["decoder_target_tokens"]

        def convert(features):
            inputs, targets = features["inputs"], features["targets"]
            tokens = tf.concat([inputs, targets], 0)
            weights = tf.concat([tf.zeros_like(inputs), tf.ones_like(targets)], 0)
            pad = [[0, total - tf.size(tokens)]]
            tokens, weights = tf.pad(tokens, pad), tf.pad(weights, pad)
            return {
                "encoder_input_tokens": tf.zeros([1], tf.int32),
                "decoder_target_tokens": tf.ensure_shape(tokens, [total]),
                "decoder_input_tokens": tf.ensure_shape(tf.concat([[0], tokens[:-1]], 0), [total]),
                "decoder_loss_weights": tf.ensure_shape(weights, [total]),
            }

        return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> Mapping[str, int]:
        total = task_feature_lengths["inputs"] + task_feature_lengths["targets"]
        return {
            "encoder_input_tokens": 1,
            "decoder_target_tokens": total,
            "decoder_input_tokens": total,
            "decoder_loss_weights": total,
        }


def language_model_converter() -> seqio.FeatureConverter:
    """:class:`LanguageModelFeatureConverter`: the synthetic tasks' language-model form."""
    return LanguageModelFeatureConverter()

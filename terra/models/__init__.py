"""Models built from injected layers, their typed config, and the model families implementing
the ``Model`` protocol."""

from terra.models.config import ConfigError, TransformerConfig
from terra.models.encoder_decoder import EncoderDecoderTransformer
from terra.models.model import EncoderDecoderModel, Seq2SeqModel, TerraformerModel, shift_right
from terra.models.protocol import Model
from terra.models.terraformer import Terraformer, shared_qk_from_dense_attention

__all__ = [
    "ConfigError",
    "EncoderDecoderModel",
    "EncoderDecoderTransformer",
    "Model",
    "Seq2SeqModel",
    "Terraformer",
    "TerraformerModel",
    "TransformerConfig",
    "shared_qk_from_dense_attention",
    "shift_right",
]

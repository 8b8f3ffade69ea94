"""Models built from injected layers, their typed config, and the model wrapper."""

from terra.models.config import ConfigError, TransformerConfig
from terra.models.encoder_decoder import EncoderDecoderTransformer
from terra.models.model_api import EncoderDecoderModel
from terra.models.terraformer import Terraformer

__all__ = ["ConfigError", "EncoderDecoderModel", "EncoderDecoderTransformer", "Terraformer", "TransformerConfig"]

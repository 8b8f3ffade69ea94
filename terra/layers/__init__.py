"""Flax linen layers, one concept per module.

Importing this package registers every layer with gin (module ``terra.layers``), so
gin files can inject them at the model's swap points.
"""

from terra.layers import axes
from terra.layers.attention import CausalSelfAttention, CrossAttention, SelfAttention
from terra.layers.dense import Dense
from terra.layers.embedding import DenseLogits, TokenEmbedding
from terra.layers.feedforward import FeedForward
from terra.layers.normalization import LayerNorm
from terra.layers.positional import TrainablePositionalEmbedding

__all__ = [
    "axes",
    "CausalSelfAttention",
    "CrossAttention",
    "Dense",
    "DenseLogits",
    "FeedForward",
    "LayerNorm",
    "SelfAttention",
    "TokenEmbedding",
    "TrainablePositionalEmbedding",
]

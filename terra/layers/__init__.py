"""Flax linen layers, one concept per module.

Plain Flax modules: no layer imports gin. ``terra/gin_config/registration.py`` registers them with gin
(module ``terra.layers``), so gin files can inject them at the model's swap points.
"""

from terra.layers import axes
from terra.layers.attention import CausalSelfAttention, CrossAttention, SelfAttention
from terra.layers.axes import default_axis_rules
from terra.layers.dense import Dense
from terra.layers.embedding import TokenEmbedding
from terra.layers.feedforward import FeedForward
from terra.layers.feedforward_with_sru import FeedForwardWithSRU
from terra.layers.logits import DenseLogits
from terra.layers.lsh_attention import LSHSelfAttention
from terra.layers.mixture_of_experts import MixtureOfExpertsFeedForward
from terra.layers.multiplicative import MultiplicativeDense
from terra.layers.normalization import LayerNorm
from terra.layers.positional import TrainablePositionalEmbedding
from terra.layers.reversible import HalfResidual, ReversibleStack
from terra.layers.sparse_feedforward import SparseFeedForward
from terra.layers.sparse_loss import SparseLossLogits
from terra.layers.sparse_qkv import ModuleConvolution, SparseQKVAttention, SparseQueryCrossAttention
from terra.layers.sru import LowRankSRU

__all__ = [
    "axes",
    "default_axis_rules",
    "CausalSelfAttention",
    "CrossAttention",
    "Dense",
    "DenseLogits",
    "FeedForward",
    "FeedForwardWithSRU",
    "HalfResidual",
    "LayerNorm",
    "LowRankSRU",
    "LSHSelfAttention",
    "MixtureOfExpertsFeedForward",
    "ModuleConvolution",
    "MultiplicativeDense",
    "ReversibleStack",
    "SelfAttention",
    "SparseFeedForward",
    "SparseLossLogits",
    "SparseQKVAttention",
    "SparseQueryCrossAttention",
    "TokenEmbedding",
    "TrainablePositionalEmbedding",
]

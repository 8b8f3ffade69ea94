"""Logical axis names and the default rules that map them onto a ('data', 'model') mesh.

Every parameter is created with names from this module and every large activation is
constrained with them, so partitioning is decided by the rules (data), never by the layers.
"""

from typing import Sequence, Tuple

# Activation axes.
BATCH = "batch"
LENGTH = "length"
# Encoder positions as seen by encoder-decoder attention (keys and values).
KV_LENGTH = "kv_length"

# Parameter (and activation feature) axes.
EMBED = "embed"  # d_model
MLP = "mlp"  # d_ff
HEADS = "heads"  # attention heads
KV = "kv"  # per-head feature (d_head)
VOCAB = "vocab"
POSITIONS = "positions"  # rows of a positional table
QKV = "qkv"  # the stacked query/key/value axis of a fused projection
# Scaling Transformer axes.
SPARSE_ELEMENTS = "sparse_elements"  # N: units per sparse-FF block (d_ff = blocks * N, blocks on MLP)
LOWRANK = "lowrank"  # the sparse-FF controller's bottleneck (d_lowrank)
MODULES = "modules"  # S: modules of a multiplicative layer
KV_IN = "kv_in"  # a convolution's input features per module
CONV_LENGTH = "conv_length"  # F: a convolution's window along the sequence


def dropout_broadcast_dims(share_over_length: bool) -> Tuple[int, ...]:
    """``nn.Dropout``'s ``broadcast_dims`` over ``[..., length, features]``: one mask per example
    shared over the positions (the reference's ``dropout_shared_axes=[-2]``) or one per position
    (its ``None``)."""
    return (-2,) if share_over_length else ()


CONV_MODULES = "conv_modules"  # k: a convolution's window along the modules
EXPERTS = "experts"  # blocks of the mixture-of-experts feed-forward
SRU_UNITS = "sru_units"  # the low-rank SRU's width n (its input, carry and output features)
SRU_GATES = "sru_gates"  # the SRU's fused [r, f, y] projection, 3n

# Mesh axis names.
DATA_AXIS = "data"
MODEL_AXIS = "model"

AxisRules = Tuple[Tuple[str, object], ...]


def default_axis_rules(*, shard_embed: bool = False, additional_rules: Sequence[Tuple[str, object]] = ()) -> AxisRules:
    """Logical-to-mesh rules in priority order (the T5X/Flax ``logical_axis_rules`` form).

    Batch goes on 'data'; the wide parameter axes (d_ff, heads, vocab) go on 'model';
    d_model is replicated unless ``shard_embed`` (FSDP-style) is asked for.
    """
    rules = (
        (BATCH, DATA_AXIS),
        (MLP, MODEL_AXIS),
        (HEADS, MODEL_AXIS),
        (VOCAB, MODEL_AXIS),
        (EMBED, DATA_AXIS if shard_embed else None),
        (LENGTH, None),
        (KV_LENGTH, None),
        (KV, None),
        (POSITIONS, None),
        (QKV, None),
        (SPARSE_ELEMENTS, None),
        (LOWRANK, None),
        (MODULES, None),
        (KV_IN, None),
        (CONV_LENGTH, None),
        (CONV_MODULES, None),
        (EXPERTS, None),
        (SRU_UNITS, None),
        (SRU_GATES, None),
    )
    return tuple(additional_rules) + rules

"""Benchmark presets: which models to time and how.

Decode speed (``ml_collections`` ConfigDicts, ``terra-bench decode``) and the training-throughput
rows (``terra-bench train``). Importing this module loads nothing heavy.

A row is a name, the gin files that build its model and extra gin bindings; a preset adds the
timing protocol. ``terra-bench decode --preset NAME`` overrides any field from the command line
(``ml_collections.config_flags``), e.g. ``--config.tokens=20 --config.input_length=32``.
"""

from typing import Callable, Dict, Sequence

import ml_collections

# The reference's decode-timing model (trax_reference.md §5.5, "medium"): 2 encoder and 24
# decoder layers at the 800M widths; dropout is irrelevant to decoding.
TIMING_SHAPE_800M = ("TransformerConfig.n_encoder_layers = 2",)


def make_row(name: str, *gin_files: str, bindings=(), series: str = "", sparsity: float = 0.0):
    return ml_collections.ConfigDict(
        {"name": name, "gin_files": list(gin_files), "bindings": list(bindings), "series": series, "sparsity": sparsity}
    )


def timing_config(rows, **overrides) -> ml_collections.ConfigDict:
    """The timing protocol around ``rows`` (``make_row``); ``overrides`` replace its fields."""
    config = ml_collections.ConfigDict(
        {
            "rows": rows,
            "common_bindings": list(TIMING_SHAPE_800M),
            "input_length": 16,  # encoder tokens, as the reference
            "tokens": 12,  # steps per repetition; the first two are not timed
            "skip": 2,
            "repeats": 3,
            "warmup": 4,
            "block_mode": "divide",  # 'divide': time / decoder layers; 'difference': see paper_17b_block
            "weights_dtype": "float32",
            "bandwidth_buffer_mb": 1024,
            "dense_row": 0,  # the row speed-ups are relative to
        }
    )
    config.update(overrides)
    return config


def paper_800m() -> ml_collections.ConfigDict:
    """Tables 1 (upper half), 2 and 7 at the 800M shape, the fully sparse model and the MoE baseline."""
    m = "models/{}_800m.gin".format
    return timing_config(
        [
            make_row("baseline Transf.", m("dense")),
            make_row("+ Sparse FF", m("sparse_ff")),
            make_row("+ Sparse QKV", m("sparse_qkv")),
            make_row("+ Sparse FF+QKV", m("sparse_ff_qkv")),
            make_row("Sparse FF 128", m("sparse_ff128")),
            make_row("Sparse loss S=2", m("sparse_loss2")),
            make_row("Sparse loss S=4", m("sparse_loss4")),
            make_row("Sparse loss S=8", m("sparse_loss8")),
            make_row("+ Sparse FF+QKV+loss 4", m("sparse_ff_qkv_loss4")),
            make_row("fully sparse (+ sparse enc-dec attn)", m("fully_sparse")),
            make_row("MoE FF (64 experts)", m("moe_ff")),
            # Table 8: Terraformer 800M (Sparse FF+QKV, loss 4, SRU, two decoder attentions).
            make_row("Terraformer", m("terraformer")),
        ]
    )


# The 17B model's widths (paper footnote 2; trax_reference.md §5.5): d_model 9216, 96 heads.
_WIDE = (
    "TransformerConfig.d_model = 9216",
    "TransformerConfig.n_heads = 96",
    "TransformerConfig.n_encoder_layers = 0",
    "TransformerConfig.vocab_size = 1024",  # the logits are not part of a block
    "TransformerConfig.max_len = 64",
)


# Terraformer with dense layers (the sparse ones are terraformer_800m.gin's defaults).
_TERRAFORMER_DENSE = ("Terraformer.feed_forward = @FeedForward", "Terraformer.decoder_attention = @CausalSelfAttention")


def paper_17b_block() -> ml_collections.ConfigDict:
    """Per-decoder-block time at the 17B widths (Table 1 lower half, Table 6).

    Each row is timed with 1 and with 2 decoder layers, one model in memory at a time; the
    block time is the difference. Dense d_ff is the reference's slice (5/8 * 65536 = 40960,
    "+0% params"); sparse rows use d_ff 65536, FF sparsity 256 with d_lowrank 32, and attention
    sparsity 64.
    """
    m = "models/{}_800m.gin".format
    dense_ff = ("TransformerConfig.d_ff = 40960",)
    ff = ("TransformerConfig.d_ff = 65536", "SparseFeedForward.ff_sparsity = 256", "SparseFeedForward.d_lowrank = 32")
    qkv = ("TransformerConfig.d_ff = 65536", "SparseQKVAttention.attention_sparsity = 64")
    cross = ("SparseQueryCrossAttention.attention_sparsity = 64",)
    return timing_config(
        [
            make_row("baseline Transf.", m("dense"), bindings=dense_ff),
            make_row("+ Sparse FF", m("sparse_ff"), bindings=ff),
            make_row("+ Sparse QKV", m("sparse_qkv"), bindings=qkv),
            make_row("+ Sparse FF+QKV", m("sparse_ff_qkv"), bindings=ff + qkv),
            make_row("fully sparse (+ sparse enc-dec attn)", m("fully_sparse"), bindings=ff + qkv + cross),
            # Table 6 per block: Terraformer blocks (two attentions + FF + SRU), dense to sparse.
            make_row("Terraformer dense", m("terraformer"), bindings=dense_ff + _TERRAFORMER_DENSE),
            make_row("Terraformer Sparse FF", m("terraformer"), bindings=ff + _TERRAFORMER_DENSE[1:]),
            make_row("Terraformer Sparse FF+QKV", m("terraformer"), bindings=ff + qkv),
        ],
        common_bindings=list(_WIDE),
        block_mode="difference",
        repeats=4,  # the per-block difference of two timings needs more samples
        warmup=2,
    )


def sparsity_sweep() -> ml_collections.ConfigDict:
    """Decode time against FF sparsity N (Figure 3's axis) and loss sparsity S."""
    rows = [make_row("dense FF", "models/dense_800m.gin", series="ff_sparsity", sparsity=0)]
    for n in (16, 32, 64, 128):
        rows.append(
            make_row(
                f"Sparse FF {n}",
                "models/sparse_ff_800m.gin",
                bindings=(f"SparseFeedForward.ff_sparsity = {n}",),
                series="ff_sparsity",
                sparsity=n,
            )
        )
    rows.append(make_row("dense loss", "models/dense_800m.gin", series="loss_sparsity", sparsity=1))
    for s in (2, 4, 8):
        rows.append(
            make_row(f"Sparse loss S={s}", f"models/sparse_loss{s}_800m.gin", series="loss_sparsity", sparsity=s)
        )
    return timing_config(rows)


def tiny() -> ml_collections.ConfigDict:
    """Runs in seconds: a smoke test of the whole benchmark."""
    return timing_config(
        [
            make_row("baseline Transf.", "models/tiny.gin"),
            make_row("+ Sparse FF", "models/tiny_sparse_ff.gin", series="ff_sparsity", sparsity=16),
            make_row("fully sparse", "models/tiny_fully_sparse.gin"),
            make_row("Terraformer", "models/tiny_terraformer.gin"),
        ],
        common_bindings=[],
        tokens=6,
        repeats=1,
        warmup=2,
        bandwidth_buffer_mb=64,
    )


def single_model(gin_files: Sequence[str], bindings: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """One model, from its own gin files, with the default timing protocol."""
    return timing_config([make_row(" + ".join(gin_files), *gin_files, bindings=bindings)], common_bindings=[])


PRESETS: Dict[str, Callable[[], ml_collections.ConfigDict]] = {
    "paper_800m": paper_800m,
    "paper_17b_block": paper_17b_block,
    "sparsity_sweep": sparsity_sweep,
    "tiny": tiny,
}


# --- terra-bench train: the training-throughput rows ---------------------------------------------

# 6+6 layers, d_model 512, d_ff 2048 (N = 32 blocks of 64), 8 heads, a 4,100-id vocabulary.
TRAIN_SPEED_SMALL_SIZE = [
    "TransformerConfig.vocab_size = 4100",
    "TransformerConfig.d_model = 512",
    "TransformerConfig.d_ff = 2048",
    "TransformerConfig.n_heads = 8",
    "TransformerConfig.n_encoder_layers = 6",
    "TransformerConfig.n_decoder_layers = 6",
    "TransformerConfig.max_len = 512",
    "SparseFeedForward.ff_sparsity = 64",
    "SparseQKVAttention.attention_sparsity = 8",
    "SparseQueryCrossAttention.attention_sparsity = 8",
    "SparseLossLogits.loss_sparsity = 4",
]
# terra-bench train --small: seconds, for the smoke test.
TRAIN_SPEED_SMOKE_SIZE = [
    "TransformerConfig.d_model = 64",
    "TransformerConfig.n_heads = 4",
    "TransformerConfig.n_encoder_layers = 1",
    "TransformerConfig.n_decoder_layers = 1",
    "SparseQKVAttention.attention_sparsity = 4",
    "SparseQueryCrossAttention.attention_sparsity = 4",
]
TRAIN_SPEED_ROWS = {  # key: (name, model config, bindings)
    "dense": ("dense", "models/dense_800m.gin", ["TransformerConfig.d_ff = 2048"]),
    "sparse_ff": ("Sparse FF", "models/sparse_ff_800m.gin", ["TransformerConfig.d_ff = 2048"]),
    "scaling": (
        "Sparse FF+QKV+loss (Scaling Transformer)",
        "models/sparse_ff_qkv_loss4_800m.gin",
        ["TransformerConfig.d_ff = 3072"],
    ),
    # Reversible, two decoder attentions over [encoder | decoder], SRU; Sparse FF+QKV+loss 4.
    "terraformer": (
        "Terraformer",
        "models/terraformer_800m.gin",
        ["TransformerConfig.d_ff = 3072", "TransformerConfig.max_len = 512"],
    ),
}

"""Benchmark presets: which models to time and how.

Decode speed (``ml_collections`` ConfigDicts, ``terra-bench decode``) and the training-throughput
rows (``terra-bench train``). Importing this module loads nothing heavy.

A row is a name, the gin files that build its model and extra gin bindings; a preset adds the
timing protocol. ``terra-bench decode --preset NAME`` overrides any field from the command line
(``ml_collections.config_flags``), e.g. ``--config.tokens=20 --config.input_length=32`` (or
``--config.input_lengths=15360`` for the ``long_document`` preset's lengths, or
``--config.batch_sizes=1,16`` for the ``batched_800m`` preset's batch sizes).
"""

import copy
from typing import Callable, Dict, Sequence

import ml_collections

# The reference's decode-timing model (docs/design/reference_code.md §5.5, "medium"): 2 encoder and 24
# decoder layers at the 800M widths; dropout is irrelevant to decoding.
TIMING_SHAPE_800M = ("TransformerConfig.n_encoder_layers = 2",)


def make_row(
    name: str,
    *gin_files: str,
    bindings=(),
    series: str = "",
    sparsity: float = 0.0,
    baseline: str = "",
    paper: float = 0.0,
    paper_note: str = "",
    weights_dtype: str = "",
    cache_dtype: str = "",
):
    """One model to time. ``baseline``: the name of the row its speed-up is measured against
    (default: the preset's ``dense_row``); ``paper``: the paper's seconds for the same row on
    the paper's CPU (0: the paper has none), ``paper_note`` where that figure comes from;
    ``weights_dtype``: how its weights are stored (default: the preset's ``weights_dtype``);
    ``cache_dtype``: how its attention caches are stored (default: the preset's ``cache_dtype``;
    other than float32 it is the binding ``TransformerConfig.cache_dtype``)."""
    return ml_collections.ConfigDict(
        {
            "name": name,
            "gin_files": list(gin_files),
            "bindings": list(bindings),
            "series": series,
            "sparsity": sparsity,
            "baseline": baseline,
            "paper": paper,
            "paper_note": paper_note,
            "weights_dtype": weights_dtype,
            "cache_dtype": cache_dtype,
        }
    )


def timing_config(rows, **overrides) -> ml_collections.ConfigDict:
    """The timing protocol around ``rows`` (``make_row``); ``overrides`` replace its fields."""
    config = ml_collections.ConfigDict(
        {
            "rows": rows,
            "common_bindings": list(TIMING_SHAPE_800M),
            "input_length": 16,  # encoder tokens, as the reference
            # Encoder lengths to time every row at (each row x each length), instead of input_length;
            # --config.input_lengths=15360 runs one. Rows that do not fit the memory are skipped.
            "input_lengths": (),
            # Sequences decoded at once to time every row at (each row x each size), instead of
            # batch 1: --config.batch_sizes=1,16 runs two. Not with input_lengths, baseline_beside
            # or block_mode 'difference' (decode_speed.check_batch_sizes).
            "batch_sizes": (),
            "tokens": 12,  # steps per repetition; the first two are not timed
            # Decoder self-attention slots, at least (more where tokens need them): the reference's
            # max_inference_length = 2 x its max_len 16 (docs/design/reference_code.md §6).
            "decoder_cache_length": 32,
            "skip": 2,
            "repeats": 3,
            "warmup": 4,
            "block_mode": "divide",  # 'divide': time / decoder layers; 'difference': see paper_17b_block
            "weights_dtype": "float32",  # or 'bfloat16', 'int8': rows without their own (terra.quantization)
            "cache_dtype": "float32",  # or 'bfloat16', 'int8': the attention caches of rows without their own
            # False: only the in-loop time (no per-call step protocol; one prefill per repetition).
            "time_calls": True,
            # With input_lengths: skip a row whose estimated memory exceeds this (0: what the machine has).
            "memory_limit_gb": 0.0,
            "bandwidth_buffer_mb": 1024,
            "dense_row": 0,  # the row speed-ups are relative to (unless a row names its baseline)
            # Time the dense row's generation loop again beside every other row (decode_speed.py).
            "baseline_beside": False,
            "title": "",  # the table's and plot's title (default: the preset's name)
        }
    )
    config.update(overrides)
    return config


def paper_800m() -> ml_collections.ConfigDict:
    """Tables 1 (upper half), 2, 7 and 8 at the 800M widths in the 2+24-layer timing shape, the
    fully sparse model and the MoE baseline."""
    m = "models/{}_800m.gin".format
    return timing_config(
        [
            make_row("baseline Transf.", m("dense"), paper=0.160, paper_note="Table 1"),
            make_row("+ Sparse FF", m("sparse_ff"), paper=0.093, paper_note="Table 1"),
            make_row("+ Sparse QKV", m("sparse_qkv"), paper=0.152, paper_note="Table 1"),
            make_row("+ Sparse FF+QKV", m("sparse_ff_qkv"), paper=0.061, paper_note="Table 1"),
            make_row("Sparse FF 128", m("sparse_ff128"), paper=0.089, paper_note="Table 2"),
            make_row("Sparse loss S=2", m("sparse_loss2"), paper=0.158, paper_note="Table 7"),
            make_row("Sparse loss S=4", m("sparse_loss4"), paper=0.149, paper_note="Table 7"),
            make_row("Sparse loss S=8", m("sparse_loss8"), paper=0.148, paper_note="Table 7"),
            make_row("+ Sparse FF+QKV+loss 4", m("sparse_ff_qkv_loss4"), paper=0.061, paper_note="Table 8"),
            make_row("fully sparse (+ sparse enc-dec attn)", m("fully_sparse")),
            make_row("MoE FF (64 experts)", m("moe_ff"), paper=0.11, paper_note="§3.1"),
            # Table 8: Terraformer 800M (Sparse FF+QKV, loss 4, SRU, two decoder attentions).
            make_row("Terraformer", m("terraformer"), paper=0.086, paper_note="Table 8"),
        ],
        title="Decode speed at the 800M widths, 2+24-layer timing shape (batch 1, float32)",
    )


# The 17B model's widths (paper footnote 2; docs/design/reference_code.md §5.5): d_model 9216, 96 heads.
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
            make_row("baseline Transf.", m("dense"), bindings=dense_ff, paper=0.581, paper_note="Table 1, per block"),
            make_row("+ Sparse FF", m("sparse_ff"), bindings=ff, paper=0.259, paper_note="Table 1, per block"),
            make_row("+ Sparse QKV", m("sparse_qkv"), bindings=qkv, paper=0.554, paper_note="Table 1, per block"),
            make_row(
                "+ Sparse FF+QKV", m("sparse_ff_qkv"), bindings=ff + qkv, paper=0.014, paper_note="Table 1, per block"
            ),
            make_row("fully sparse (+ sparse enc-dec attn)", m("fully_sparse"), bindings=ff + qkv + cross),
            # Table 6: Terraformer blocks (two attentions + FF + SRU), dense to sparse, against the
            # dense Terraformer block; the paper's figures are for the whole 17B model.
            make_row(
                "Terraformer dense",
                m("terraformer"),
                bindings=dense_ff + _TERRAFORMER_DENSE,
                baseline="Terraformer dense",
                paper=3.651,
                paper_note="Table 6, whole model",
            ),
            make_row(
                "Terraformer Sparse FF",
                m("terraformer"),
                bindings=ff + _TERRAFORMER_DENSE[1:],
                baseline="Terraformer dense",
                paper=1.595,
                paper_note="Table 6, whole model",
            ),
            make_row(
                "Terraformer Sparse FF+QKV",
                m("terraformer"),
                bindings=ff + qkv,
                baseline="Terraformer dense",
                paper=0.183,
                paper_note="Table 6, whole model",
            ),
        ],
        common_bindings=list(_WIDE),
        block_mode="difference",
        title="Decode speed per decoder block at the 17B widths (d_model 9216; batch 1, float32)",
        repeats=4,  # the per-block difference of two timings needs more samples
        warmup=2,
    )


QUANTIZED_WIDTHS = ("float32", "bfloat16", "int8")


def _at_each_width(name: str, *gin_files: str, bindings=(), baseline: str = ""):
    """One model's rows at every weight store, one run so the ratios compare."""
    return [
        make_row(f"{name} · {dtype}", *gin_files, bindings=bindings, weights_dtype=dtype, baseline=baseline)
        for dtype in QUANTIZED_WIDTHS
    ]


def quantized_800m() -> ml_collections.ConfigDict:
    """Quantized decoding (the paper's §7 future work) at the 800M widths, 2+24-layer timing
    shape: dense, Sparse FF+QKV+loss, fully sparse and Terraformer with float32, bfloat16 and
    int8 weights; speed-ups against dense float32."""
    m = "models/{}_800m.gin".format
    return timing_config(
        _at_each_width("baseline Transf.", m("dense"))
        + _at_each_width("+ Sparse FF+QKV+loss 4", m("sparse_ff_qkv_loss4"))
        + _at_each_width("fully sparse", m("fully_sparse"))
        + _at_each_width("Terraformer", m("terraformer")),
        title="Quantized decoding at the 800M widths, 2+24-layer timing shape (batch 1, float32 activations)",
        # A 6 ms row timed over 10 steps is 60 ms of loop, a few scheduler slices: 30 steps and
        # 5 repetitions, with dense float32 timed beside each, give ratios a noisy VM keeps.
        tokens=32,
        repeats=5,
        baseline_beside=True,
    )


def quantized_17b_block() -> ml_collections.ConfigDict:
    """Quantized decoding per decoder block at the 17B widths: the dense and fully sparse
    blocks and the Terraformer blocks (as ``paper_17b_block``) at each weight store."""
    base = paper_17b_block()
    rows = {row.name: row for row in base.rows}
    picked = []
    for name in (
        "baseline Transf.",
        "fully sparse (+ sparse enc-dec attn)",
        "Terraformer dense",
        "Terraformer Sparse FF+QKV",
    ):
        row = rows[name]
        baseline = "Terraformer dense · float32" if name.startswith("Terraformer") else ""
        picked += _at_each_width(name, *row.gin_files, bindings=row.bindings, baseline=baseline)
    base.rows = picked
    base.title = "Quantized decoding per decoder block at the 17B widths (d_model 9216; batch 1, float32 activations)"
    return base


def sparsity_sweep() -> ml_collections.ConfigDict:
    """Decode time against FF sparsity N (Figure 3's axis) and loss sparsity S."""
    table_2 = {64: 0.093, 128: 0.089}  # paper Table 2 (and 0.160 dense)
    table_7 = {2: 0.158, 4: 0.149, 8: 0.148}  # paper Table 7
    rows = [
        make_row(
            "dense FF", "models/dense_800m.gin", series="ff_sparsity", sparsity=0, paper=0.160, paper_note="Table 2"
        )
    ]
    for n in (16, 32, 64, 128):
        rows.append(
            make_row(
                f"Sparse FF {n}",
                "models/sparse_ff_800m.gin",
                bindings=(f"SparseFeedForward.ff_sparsity = {n}",),
                series="ff_sparsity",
                sparsity=n,
                paper=table_2.get(n, 0.0),
                paper_note="Table 2" if n in table_2 else "",
            )
        )
    loss = dict(series="loss_sparsity", baseline="dense loss")
    rows.append(make_row("dense loss", "models/dense_800m.gin", sparsity=1, paper=0.160, paper_note="Table 7", **loss))
    for s in (2, 4, 8):
        rows.append(
            make_row(
                f"Sparse loss S={s}",
                f"models/sparse_loss{s}_800m.gin",
                sparsity=s,
                paper=table_7[s],
                paper_note="Table 7",
                **loss,
            )
        )
    return timing_config(rows, title="Decode speed against sparsity, 800M widths, 2+24-layer timing shape (batch 1)")


def tiny() -> ml_collections.ConfigDict:
    """Runs in seconds: a smoke test of the whole benchmark."""
    return timing_config(
        [
            make_row("baseline Transf.", "models/tiny.gin"),
            make_row("+ Sparse FF", "models/tiny_sparse_ff.gin", series="ff_sparsity", sparsity=16),
            make_row("fully sparse", "models/tiny_fully_sparse.gin"),
            make_row("fully sparse · int8", "models/tiny_fully_sparse.gin", weights_dtype="int8"),
            make_row("Terraformer", "models/tiny_terraformer.gin"),
        ],
        common_bindings=[],
        tokens=8,
        repeats=3,  # the in-loop time of a tiny model needs repetitions to tell it from jitter
        warmup=2,
        bandwidth_buffer_mb=64,
    )


BATCH_SIZES = (1, 4, 16, 64)


def batched_800m() -> ml_collections.ConfigDict:
    """Batched decoding (issue 59) at the 800M widths, 2+24-layer timing shape: dense, fully
    sparse and Terraformer with float32, bfloat16 and int8 weights, each decoding 1, 4, 16 and
    64 sequences at once; per step, per sequence and tokens per second, the bytes of a step
    (a sparse layer's selected rows counted as their union over the batch) and their floor.
    Speed-ups against dense float32 at the same batch size."""
    m = "models/{}_800m.gin".format
    return timing_config(
        _at_each_width("baseline Transf.", m("dense"))
        + _at_each_width("fully sparse", m("fully_sparse"))
        + _at_each_width("Terraformer", m("terraformer")),
        batch_sizes=BATCH_SIZES,
        tokens=16,
        repeats=3,
        warmup=2,
        title="Batched decoding at the 800M widths, 2+24-layer timing shape (float32 activations)",
    )


LONG_DOCUMENT_LENGTHS = (1024, 4096, 15360)


def long_document() -> ml_collections.ConfigDict:
    """Decoding at arXiv-summarization input lengths (paper §5: inputs of 15,360 tokens), issue 40:
    the dense baseline, the fully sparse model, the Terraformer with dense attention and with LSH,
    each with float32 and int8 weights and with int8 weights and an int8 cache, at inputs of
    1,024, 4,096 and 15,360 tokens, 256 generated tokens, 2+24-layer timing shape. Reports the
    prefill, the in-loop ms per token, the bytes each token reads from weights and from caches
    with their floors, and each row's peak memory; rows the machine cannot hold are skipped with
    the reason. Positional tables of 16,384 rows (the Terraformer's) for every model."""
    m = "models/{}_800m.gin".format
    rows = []
    for name, config in (
        ("baseline Transf.", "dense"),
        ("fully sparse", "fully_sparse"),
        ("Terraformer", "terraformer"),
        ("Terraformer LSH", "terraformer_lsh"),
    ):
        rows += [
            make_row(f"{name} · float32", m(config), weights_dtype="float32"),
            make_row(f"{name} · int8", m(config), weights_dtype="int8"),
            make_row(f"{name} · int8 · int8 cache", m(config), weights_dtype="int8", cache_dtype="int8"),
        ]
    return timing_config(
        rows,
        common_bindings=list(TIMING_SHAPE_800M) + ["TransformerConfig.max_len = 16384"],
        input_lengths=LONG_DOCUMENT_LENGTHS,
        tokens=256,
        decoder_cache_length=0,  # the 2 + 256 tokens decoded
        repeats=2,  # each repetition is a prefill of up to 15,360 tokens and 258 steps
        time_calls=False,
        title="Long-document decoding at the 800M widths, 2+24-layer timing shape (batch 1, 256 generated tokens)",
    )


def select_rows(config: ml_collections.ConfigDict, patterns: Sequence[str]) -> ml_collections.ConfigDict:
    """``config`` with only the rows whose names contain one of ``patterns`` (case-insensitive),
    plus the rows their speed-ups are measured against (the dense row always, and a row's own
    ``baseline``), in the preset's order; ``dense_row`` follows its row. No patterns: unchanged."""
    if not patterns:
        return config
    rows = list(config.rows)
    wanted = {i for i, row in enumerate(rows) if any(p.lower() in row.name.lower() for p in patterns)}
    if not wanted:
        names = ", ".join(row.name for row in rows)
        raise ValueError(f"no row's name contains any of {list(patterns)}; the rows are: {names}.")
    index = {row.name: i for i, row in enumerate(rows)}
    wanted |= {index[rows[i].baseline] for i in wanted if rows[i].baseline} | {config.dense_row}
    kept = sorted(wanted)
    selected = copy.deepcopy(config)
    selected.rows = [rows[i] for i in kept]
    selected.dense_row = kept.index(config.dense_row)
    return selected


def single_model(gin_files: Sequence[str], bindings: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """One model, from its own gin files, with the default timing protocol."""
    return timing_config([make_row(" + ".join(gin_files), *gin_files, bindings=bindings)], common_bindings=[])


PRESETS: Dict[str, Callable[[], ml_collections.ConfigDict]] = {
    "paper_800m": paper_800m,
    "paper_17b_block": paper_17b_block,
    "quantized_800m": quantized_800m,
    "quantized_17b_block": quantized_17b_block,
    "long_document": long_document,
    "batched_800m": batched_800m,
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

"""The reproduction studies' settings (``ml_collections`` ConfigDicts) and the models they train.

``terra-reproduce STUDY --preset NAME`` starts from one of these and ``--config.FIELD=VALUE``
overrides a field. Importing this module loads nothing heavy, so ``--help`` lists the fields at
once.
"""

import dataclasses
from typing import Callable, Dict

import ml_collections

from terra.errors import ConfigError

# --- the sparsity study ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """A model of the study: a gin model config, sparsity bindings valid at any width, and the
    d_ff multiplier that keeps its parameter count at the dense model's (the paper's sparse-QKV
    configs raise d_ff from 4096 to 6144 for the parameters the attention gives up)."""

    label: str
    gin_file: str
    bindings: tuple = ()
    d_ff_scale: float = 1.0


def _sparse_ff(n: int) -> tuple:
    return (f"SparseFeedForward.ff_sparsity = {n}",)


VARIANTS: Dict[str, Variant] = {
    "dense": Variant("dense baseline", "models/dense_800m.gin"),
    "sparse_ff_16": Variant("Sparse FF N=16", "models/sparse_ff_800m.gin", _sparse_ff(16)),
    "sparse_ff_32": Variant("Sparse FF N=32", "models/sparse_ff_800m.gin", _sparse_ff(32)),
    "sparse_ff_64": Variant("Sparse FF N=64", "models/sparse_ff_800m.gin", _sparse_ff(64)),
    "sparse_qkv": Variant("Sparse QKV", "models/sparse_qkv_800m.gin", d_ff_scale=1.5),
    "sparse_ff_qkv": Variant("Sparse FF+QKV", "models/sparse_ff_qkv_800m.gin", d_ff_scale=1.5),
    "sparse_ff_qkv_loss": Variant("Sparse FF+QKV+loss S=4", "models/sparse_ff_qkv_loss4_800m.gin", d_ff_scale=1.5),
    "moe_ff": Variant("MoE FF (64 experts, 1 active)", "models/moe_ff_800m.gin"),
}

# Widths per size. Attention sparsity S = n_heads as in the paper (S=16 with 16 heads at 800M).
SPARSITY_SIZES = {
    "small": dict(d_model=128, d_ff=512, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, attention_sparsity=4),
    "smoke": dict(d_model=32, d_ff=128, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, attention_sparsity=4),
}


def sparsity_config(preset: str = "small") -> ml_collections.ConfigDict:
    """The study's settings; ``smoke`` is the few-step version the tests run."""
    if preset not in ("small", "smoke"):
        raise ConfigError(f"unknown sparsity preset {preset!r}; use 'small' or 'smoke'.")
    smoke = preset == "smoke"
    return ml_collections.ConfigDict(
        {
            "size": preset,
            "variants": "dense,sparse_ff_qkv_loss" if smoke else ",".join(VARIANTS),
            "seeds": "0,1" if smoke else "0",
            "steps": 3 if smoke else 1000,
            "batch_size": 4 if smoke else 16,
            "eval_every": 3 if smoke else 100,
            "eval_steps": 1 if smoke else 8,
            "warmup_steps": 100 if smoke else 200,
            "checkpoint_every": 1000,
            "task_gin": "tasks/embedded_span_corruption.gin",
            "c4_task_gin": "tasks/c4_span_corruption.gin",
            "feature_lengths": {"inputs": 32, "targets": 8} if smoke else {"inputs": 128, "targets": 32},
            "dropout": 0.0,
            "decode_at": "trained",
            "decode_tokens": 4 if smoke else 12,
            "decode_repeats": 1 if smoke else 3,
            "bandwidth_buffer_mb": 16 if smoke else 512,
        }
    )


# --- the length-generalization study (paper Table 4) ------------------------------------------------

LENGTH_TASKS = ("copy", "addition")
LENGTH_MODELS = {"transformer": "Transformer", "terraformer": "Terraformer"}

# Paper Table 4 (%): token accuracy and whole-sequence accuracy on inputs 2x the training length.
PAPER_TABLE_4 = {
    "transformer": {"copy": 79.8, "copy_seq": 0.0, "addition": 36.4, "addition_seq": 0.0},
    "terraformer": {"copy": 99.9, "copy_seq": 93.9, "addition": 86.9, "addition_seq": 32.4},
}

LENGTH_MODEL_SIZES = {
    # Both models at the same width; the Terraformer has the deeper encoder, as the reference's
    # 12 + 4 layers against the Transformer's 4.
    "small": {
        "transformer": dict(d_model=128, d_ff=512, n_heads=4, n_encoder_layers=2, n_decoder_layers=2),
        "terraformer": dict(d_model=128, d_ff=256, n_heads=4, n_encoder_layers=4, n_decoder_layers=2),
    },
    "smoke": {
        "transformer": dict(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=1, n_decoder_layers=1),
        "terraformer": dict(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=1, n_decoder_layers=1),
    },
}


def length_generalization_config(preset: str = "small") -> ml_collections.ConfigDict:
    """``small`` (CPU, inputs up to 16 digits, evaluated on 32+), ``smoke`` (tests) or ``paper``
    (the experiments' own settings: up to 64 digits, evaluated on 128+, 300k steps)."""
    if preset not in ("small", "smoke", "paper"):
        raise ConfigError(f"unknown length_generalization preset {preset!r}; use 'small', 'smoke' or 'paper'.")
    lengths = {
        # copy: train words 1..copy_train_length-1; eval words in [eval_min, eval_max).
        # addition: the reference's min/max lengths (first operand >= (min-1)//2 digits,
        # whole input x+y <= max symbols).
        "small": dict(
            copy_train_length=17,
            copy_eval_min_length=32,
            copy_eval_max_length=40,
            addition_train_min_length=3,
            addition_train_max_length=33,
            addition_eval_min_length=65,
            addition_eval_max_length=75,
        ),
        "smoke": dict(
            copy_train_length=5,
            copy_eval_min_length=8,
            copy_eval_max_length=10,
            addition_train_min_length=3,
            addition_train_max_length=9,
            addition_eval_min_length=17,
            addition_eval_max_length=21,
        ),
        "paper": dict(
            copy_train_length=64,
            copy_eval_min_length=128,
            copy_eval_max_length=160,
            addition_train_min_length=3,
            addition_train_max_length=129,
            addition_eval_min_length=257,
            addition_eval_max_length=301,
        ),
    }[preset]
    smoke, paper = preset == "smoke", preset == "paper"
    return ml_collections.ConfigDict(
        {
            "preset": preset,
            "tasks": ",".join(LENGTH_TASKS),
            "models": ",".join(LENGTH_MODELS),
            "seeds": "0",
            "steps": 2 if smoke else (300_000 if paper else 3000),
            "batch_size": 4 if smoke else 128 if paper else 32,
            "eval_every": 2 if smoke else (1000 if paper else 500),
            "eval_steps": 1 if smoke else 8,
            "in_distribution_batches": 1 if smoke else 8,
            # The reference's schedule, 0.5 * linear warm-up over 16k steps then rsqrt, scaled to the
            # run length: peak 0.5/sqrt(16000) = 0.004 there, 0.1/sqrt(500) = 0.0045 here.
            "learning_rate_constant": 0.5 if paper else 0.1,
            "warmup_steps": 16000 if paper else (100 if smoke else 500),
            "dropout": ml_collections.config_dict.placeholder(float)
            if paper
            else 0.1,  # unset: the experiments' own (0.1 / 0.3)
            "position_max_offset": 300 if paper else (8 if smoke else 64),
            "max_len": 512 if paper else 256,
            **lengths,
        }
    )


SPARSITY_PRESETS: Dict[str, Callable[[], ml_collections.ConfigDict]] = {
    name: (lambda name=name: sparsity_config(name)) for name in ("small", "smoke")
}
LENGTH_PRESETS: Dict[str, Callable[[], ml_collections.ConfigDict]] = {
    name: (lambda name=name: length_generalization_config(name)) for name in ("small", "smoke", "paper")
}


# --- the quality cost of quantized weights (docs/decode_speed.md) ---


def quantization_config(preset: str = "default") -> ml_collections.ConfigDict:
    """Settings of ``terra-reproduce quantization``: how much of each run's validation split is
    scored teacher-forced and how many of its inputs are decoded greedily; ``smoke`` is the tests'."""
    if preset not in ("default", "smoke"):
        raise ConfigError(f"unknown quantization preset {preset!r}; use 'default' or 'smoke'.")
    smoke = preset == "smoke"
    return ml_collections.ConfigDict(
        {
            "weights": "float32,bfloat16,int8",
            "split": "validation",
            "eval_batches": 1 if smoke else 16,
            "eval_batch_size": 0,  # 0: the run's BATCH_SIZE, as its trainer evaluated
            "decode_examples": 4 if smoke else 32,
            "max_new_tokens": 4 if smoke else 32,
        }
    )


QUANTIZATION_PRESETS: Dict[str, Callable[[], ml_collections.ConfigDict]] = {
    name: (lambda name=name: quantization_config(name)) for name in ("default", "smoke")
}

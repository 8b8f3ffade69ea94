"""Training-step memory of a Terraformer against its depth, reversible or not (paper §4.2).

``terra-bench memory [--out DIR]`` compiles (does not run) the
gradient of the loss for Terraformers of increasing depth, once with the reversible layers'
custom backward pass and once with plain autodiff of the same functions, and prints XLA's
compiled temporary memory (``memory_analysis().temp_size_in_bytes``) as a Markdown table
(and ``DIR/reversible_memory.json``). Reversible layers store no activations between layers,
so their temporaries grow far less than linearly with depth.
"""

import json
import os
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp

from terra.models import Terraformer, TerraformerModel, TransformerConfig


def temp_bytes(config: TransformerConfig, *, reversible: bool, batch: int, inputs: int, targets: int) -> int:
    """Compiled temporary bytes of ``grad(loss)`` for one Terraformer (nothing is executed)."""
    model = TerraformerModel(Terraformer(config, reversible=reversible))
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), jax.eval_shape(model.init_params, jax.random.key(0))
    )
    batch_spec = {
        "encoder_input_tokens": jax.ShapeDtypeStruct((batch, inputs), jnp.int32),
        "decoder_target_tokens": jax.ShapeDtypeStruct((batch, targets), jnp.int32),
    }
    grad = jax.jit(jax.grad(lambda p, b, k: model.loss_fn(p, b, k)[0]))
    compiled = grad.lower(params, batch_spec, jax.random.key(0)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(
    depths: Sequence[int] = (1, 2, 4, 8),
    *,
    d_model: int = 256,
    d_ff: int = 1024,
    n_heads: int = 4,
    batch: int = 4,
    inputs: int = 256,
    targets: int = 64,
    vocab_size: int = 512,
) -> List[Dict]:
    """One row per (depth, mode): encoder and decoder both ``depth`` layers."""
    rows = []
    for depth in depths:
        config = TransformerConfig(
            vocab_size=vocab_size,
            d_model=d_model,
            d_ff=d_ff,
            n_heads=n_heads,
            n_encoder_layers=depth,
            n_decoder_layers=depth,
            max_len=max(inputs, targets),
        )
        for reversible in (True, False):
            rows.append(
                dict(
                    depth=depth,
                    reversible=reversible,
                    temp_bytes=temp_bytes(config, reversible=reversible, batch=batch, inputs=inputs, targets=targets),
                )
            )
    return rows


def markdown(rows: Sequence[Dict]) -> str:
    by = {(r["depth"], r["reversible"]): r["temp_bytes"] for r in rows}
    depths = sorted({r["depth"] for r in rows})
    lines = [
        "| layers (enc + dec) | reversible temp MB | plain autodiff temp MB |",
        "|---|---|---|",
    ]
    for d in depths:
        lines.append(f"| {d} + {d} | {by[(d, True)] / 2**20:,.1f} | {by[(d, False)] / 2**20:,.1f} |")
    if len(depths) > 1:
        lo, hi = depths[0], depths[-1]
        per_layer = lambda rev: (by[(hi, rev)] - by[(lo, rev)]) / (hi - lo) / 2**20  # noqa: E731
        lines.append(f"| growth per extra layer pair | {per_layer(True):,.2f} | {per_layer(False):,.2f} |")
    return "\n".join(lines) + "\n"


def run(
    out_dir: Optional[str] = None,
    *,
    depths: Sequence[int] = (1, 2, 4, 8),
    d_model: int = 256,
    batch: int = 4,
    inputs: int = 256,
    targets: int = 64,
) -> List[Dict]:
    """Prints the table of :func:`measure` (``d_ff = 4 d_model``) and writes
    ``reversible_memory.json`` to ``out_dir`` when given."""
    rows = measure(list(depths), d_model=d_model, d_ff=4 * d_model, batch=batch, inputs=inputs, targets=targets)
    print(
        f"Terraformer training step (grad of the loss), d_model {d_model}, batch {batch} x "
        f"({inputs} + {targets}) tokens: XLA compiled temporary memory\n"
    )
    print(markdown(rows))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "reversible_memory.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows

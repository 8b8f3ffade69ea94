"""Parameter counts: from abstract shapes (nothing allocated) and in closed form.

  python -m terra.models.param_count --gin_file=models/dense_800m.gin
"""

import argparse
import math
from typing import Dict

import flax.linen as nn
import jax

from terra import gin_utils
from terra.models.config import TransformerConfig


def count_params(abstract_params) -> Dict[str, int]:
    """Parameters per top-level group (plus ``'total'``) of a params pytree of shapes."""
    params = nn.unbox(abstract_params)
    counts: Dict[str, int] = {}
    for name, subtree in params.items():
        group = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        counts[group] = counts.get(group, 0) + sum(math.prod(x.shape) for x in jax.tree.leaves(subtree))
    counts["total"] = sum(v for k, v in counts.items())
    return counts


def closed_form_param_count(cfg: TransformerConfig) -> int:
    """The dense encoder-decoder's parameter count from its sizes alone.

    Per attention (with biases): Q, K, V, O = ``4 (d^2 + d)``; cross-attention the same.
    Feed-forward: ``2 d d_ff + d_ff + d``. LayerNorm: ``2 d``. Encoder layer = attention +
    FF + 2 LN; decoder layer = 2 attentions + FF + 3 LN. Plus the shared token embedding
    ``V d``, two positional tables ``max_len d`` each, two final LayerNorms and the untied
    logits ``V d + V``.
    """
    d, v = cfg.d_model, cfg.vocab_size
    attention = 4 * (d * d + d)
    ff = 2 * d * cfg.d_ff + cfg.d_ff + d
    norm = 2 * d
    encoder_layer = attention + ff + 2 * norm
    decoder_layer = 2 * attention + ff + 3 * norm
    return (
        cfg.n_encoder_layers * encoder_layer
        + cfg.n_decoder_layers * decoder_layer
        + v * d
        + 2 * cfg.max_len * d
        + 2 * norm
        + v * d
        + v
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gin_utils.add_gin_flags(parser)
    args = gin_utils.parse_flags(parser, argv)
    if not args.gin_file:
        args.gin_file = ["models/dense_800m.gin"]
        gin_utils.parse_gin(args.gin_file)
    model = gin_utils.build("terra.models.EncoderDecoderModel")
    counts = count_params(model.abstract_variables()["params"])
    print(f"Parameters of {', '.join(args.gin_file)} (from abstract shapes, nothing allocated):")
    for name, n in counts.items():
        print(f"  {name:<20} {n:>15,d}")
    closed = closed_form_param_count(model.config)
    print(f"  {'closed form':<20} {closed:>15,d}  ({'matches' if closed == counts['total'] else 'DIFFERS'})")
    print(f"  float32 bytes: {counts['total'] * 4 / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)

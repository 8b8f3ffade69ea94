"""Parameter counts and the weights one decoded token reads, from abstract shapes.

  python -m terra.models.param_count --gin_file=models/dense_800m.gin   # one config, by group
  python -m terra.models.param_count --all                              # every model config

Nothing is allocated (``jax.eval_shape``), so the 800M and larger configs print instantly.
"Read per token" is what a batch-1 decode step must stream from memory: the decoder's
weights, minus what the injected layers skip (sparse feed-forward reads one row per block,
encoder-decoder keys/values are cached), plus one embedding row and one positional row.
"""

import argparse
import glob
import math
import os
from typing import Dict

import flax.linen as nn
import jax

from terra import gin_utils
from terra.models.config import TransformerConfig


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def count_params(abstract_params) -> Dict[str, int]:
    """Parameters per top-level group (plus ``'total'``) of a params pytree of shapes."""
    params = nn.unbox(abstract_params)
    counts: Dict[str, int] = {}
    for name, subtree in params.items():
        group = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        counts[group] = counts.get(group, 0) + _size(subtree)
    counts["total"] = sum(counts.values())
    return counts


def _read(layer_factory, params) -> int:
    reads = getattr(layer_factory, "params_read_per_token", None)
    return int(reads(params)) if reads else _size(params)


def _terraformer_decoder_reads(module, params, parts: Dict[str, int]) -> None:
    """Terraformer's decoder stack: per block ``n_decoder_attention_layers`` attention
    half-residuals then one ``FeedForwardWithSRU`` (its feed-forward read as the injected
    layer reads it; its norm and SRU branch whole)."""
    period = module.n_decoder_attention_layers + 1
    for name, half in params["decoder_stack"].items():
        index = int(name.rsplit("_", 1)[1])
        parts["norms"] += _size(half.get("norm", {}))
        layer = half["layer"]
        if index % period < module.n_decoder_attention_layers:
            parts["decoder self-attention"] += _read(module.decoder_attention, layer)
            continue
        for sub, sub_params in layer.items():
            if sub == "feed_forward":
                parts["feed-forward"] += _read(module.feed_forward, sub_params)
            elif sub == "sru":
                parts["feed-forward"] += _size(sub_params)
            else:
                parts["norms"] += _size(sub_params)


def _encoder_decoder_reads(module, params, parts: Dict[str, int]) -> None:
    """``EncoderDecoderTransformer``'s decoder layers, each sub-layer read as its injected layer reads it."""
    layer_factories = {
        "self_attention": ("decoder self-attention", module.decoder_self_attention),
        "cross_attention": ("encoder-decoder attention", module.encoder_decoder_attention),
        "feed_forward": ("feed-forward", module.feed_forward),
    }
    for name, layer in params.items():
        if not name.startswith("decoder_") or not name[len("decoder_") :].isdigit():
            continue
        for sub, sub_params in layer.items():
            part, factory = layer_factories.get(sub, ("norms", None))
            parts[part] += _read(factory, sub_params) if factory else _size(sub_params)


def params_read_per_token(module, abstract_params) -> Dict[str, int]:
    """Parameters one batch-1 decode step reads, by part (plus ``'total'``)."""
    params = nn.unbox(abstract_params)
    parts = dict.fromkeys(
        ("decoder self-attention", "encoder-decoder attention", "feed-forward", "norms", "embedding rows", "logits"), 0
    )
    if "decoder_stack" in params:  # Terraformer: a reversible decoder stack, no cross-attention
        _terraformer_decoder_reads(module, params, parts)
    else:
        _encoder_decoder_reads(module, params, parts)
    parts["norms"] += _size(params["decoder_norm"])
    parts["embedding rows"] = 2 * module.config.d_model  # the token's embedding and its positional row
    parts["logits"] = _read(module.logits_layer, params["logits"])
    parts["total"] = sum(parts.values())
    return parts


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


def _model_summary(gin_file: str, bindings=()):
    gin_utils.parse_gin([gin_file], bindings)
    model = gin_utils.build("terra.models.EncoderDecoderModel")
    abstract = model.abstract_variables()["params"]
    return count_params(abstract), params_read_per_token(model.module, abstract)


def print_all(bindings=()) -> None:
    files = sorted(glob.glob(os.path.join(gin_utils.CONFIGS_DIR, "models", "*.gin")))
    print(f"{'config':<36} {'params':>14} {'read / token':>14} {'float32 MB / token':>19}")
    for path in files:
        name = os.path.relpath(path, gin_utils.CONFIGS_DIR)
        counts, reads = _model_summary(name, bindings)
        print(f"{name:<36} {counts['total']:>14,d} {reads['total']:>14,d} {reads['total'] * 4 / 1e6:>19.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gin_utils.add_gin_flags(parser)
    parser.add_argument("--all", action="store_true", help="Summarise every config in configs/models/.")
    args = gin_utils.parse_flags(parser, argv)
    if args.all:
        print_all(args.gin_bindings)
        return 0
    if not args.gin_file:
        args.gin_file = ["models/dense_800m.gin"]
        gin_utils.parse_gin(args.gin_file, args.gin_bindings)
    model = gin_utils.build("terra.models.EncoderDecoderModel")
    abstract = model.abstract_variables()["params"]
    counts = count_params(abstract)
    print(f"Parameters of {', '.join(args.gin_file)} (from abstract shapes, nothing allocated):")
    for name, n in counts.items():
        print(f"  {name:<28} {n:>15,d}")
    closed = closed_form_param_count(model.config)
    verdict = "matches" if closed == counts["total"] else "differs: the closed form is for the dense baseline"
    print(f"  {'dense closed form':<28} {closed:>15,d}  ({verdict})")
    print(f"  float32 bytes: {counts['total'] * 4 / 2**30:.2f} GiB")
    print("Read per decoded token (batch 1):")
    for name, n in params_read_per_token(model.module, abstract).items():
        print(f"  {name:<28} {n:>15,d}")
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)

"""The dense encoder-decoder's parameter count in closed form, the check on the counts every
model computes from its abstract shapes (``Model.param_count``)."""

from terra.models.config import TransformerConfig


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

"""Trax constructor arguments -> the terra gin config of the same architecture.

``ARGS.json`` holds the keyword arguments of ``trax.models.ConfigurableTransformer`` or
``ConfigurableTerraformer`` in JSON form, as the test fixtures' ``config.json`` does
(``{"trax_constructor": ..., "constructor_kwargs": {...}}``), or the arguments alone with a
``"model"`` key naming the constructor. A layer argument such as
``encoder_decoder_attention_type=functools.partial(tl.MultiplicativeConvCausalAttention,
sparsity=4)`` is written ``{"trax_layer": "MultiplicativeConvCausalAttention",
"partial_kwargs": {"sparsity": 4}}``.

Every argument is either mapped onto a terra binding or checked to have the value terra
implements; anything else is an error that names the argument (terra never silently converts
a model it would compute differently). Omitted arguments take Trax's defaults.

``LSHSelfAttention`` (the Terraformer's long-document attention, paper §4) converts with its
weights and every argument that decides what it computes; its hash rotations are not
arguments. Trax draws them from the layer's state, one key per example and head, and draws
new ones at every eval call; terra draws its own per head. A converted model therefore
computes Trax's function given the same buckets (the tests replay Trax's), and a different
random approximation of full attention otherwise (docs/coming_from_trax.md).
"""

import json
import os
from typing import Any, Dict, List, Tuple

from terra import files
from terra.errors import ConfigError

TRANSFORMER = "ConfigurableTransformer"
TERRAFORMER = "ConfigurableTerraformer"

# Trax's defaults (trax/models/research/configurable_transformer.py and terraformer.py at the
# paper's commit) for the arguments a file may omit.
_COMMON_DEFAULTS: Dict[str, Any] = {
    "output_vocab_size": None,
    "d_model": 512,
    "d_ff": 2048,
    "n_encoder_layers": 6,
    "n_decoder_layers": 6,
    "n_heads": 8,
    "max_len": 2048,
    "dropout": 0.1,
    "ff_activation": {"trax_layer": "Relu", "partial_kwargs": {}},
    "ff_dropout": 0.1,
    "ff_chunk_size": 0,
    "ff_use_sru": 0,
    "ff_sparsity": 0,
    "loss_sparsity_type": "mult",
    "loss_sparsity": 0,
    "loss_d_lowrank": 0,
    "loss_sparsity_prob": None,
    "attention_chunk_size": 0,
    "pos_d_axial_embs": None,
    "mode": "train",
}
DEFAULTS: Dict[str, Dict[str, Any]] = {
    TRANSFORMER: {
        **_COMMON_DEFAULTS,
        "dropout_shared_axes": None,
        "ff_sparsity_type": "1inN",
        "encoder_attention_type": {"trax_layer": "Attention", "partial_kwargs": {}},
        "encoder_decoder_attention_type": {"trax_layer": "CausalAttention", "partial_kwargs": {}},
        "pos_type": None,
        "pos_axial_shape": None,
        "enc_dec_attention_sparsity": 0,
    },
    TERRAFORMER: {
        **_COMMON_DEFAULTS,
        "d_attention_key": None,
        "d_attention_value": None,
        "encoder_attention_type": {"trax_layer": "SelfAttention", "partial_kwargs": {}},
        "encoder_decoder_attention_type": {"trax_layer": "SelfAttention", "partial_kwargs": {}},
        "pos_type": "fixed-base",
        "pos_axial_shape": (),
        "pos_start_from_zero_prob": 1.0,
        "pos_max_offset_to_add": 0,
        "ff_dropout": None,  # None: the value of `dropout` (reformer's blocks)
        "n_layers_forget": 0,
        "forget_dense": True,
        "n_decoder_attention_layers": 2,
        "use_bfloat16": False,
        "reversible_encoder": False,
        "use_two_swaps_per_encoder_block": True,
        "center_layernorm": True,
        "half_before_layer": None,
        "double_after_layer": None,
    },
}
BASE_CONFIG = {TRANSFORMER: "models/dense_800m.gin", TERRAFORMER: "models/terraformer_800m.gin"}
# An ARGS.json is a few kilobytes.
MAX_ARGUMENTS_BYTES = 1 << 20
# What terra converts, named in every refusal of a model or layer it does not.
SUPPORTED_MODELS = f"trax.models.{TRANSFORMER} (encoder-decoder) and trax.models.{TERRAFORMER}"
ENCODER_ATTENTION = {TRANSFORMER: ("Attention",), TERRAFORMER: ("Attention", "LSHSelfAttention")}
DECODER_ATTENTION = {
    TRANSFORMER: ("CausalAttention", "MultiplicativeConvCausalAttention"),
    TERRAFORMER: ("CausalAttention", "MultiplicativeConvCausalAttention", "LSHSelfAttention"),
}
_ATTENTION_CHOICES = {"encoder_attention_type": ENCODER_ATTENTION, "encoder_decoder_attention_type": DECODER_ATTENTION}
# Trax's MultiplicativeConvCausalAttention defaults (sparsity None means the model's n_heads).
_MULTCONV_DEFAULTS = {"sparsity": None, "length_kernel_size": 3}
# Trax's SparseFF defaults when ff_sparsity is N or (N, d_lowrank).
_SPARSE_FF_TEMPERATURE, _SPARSE_FF_QUANT_PROB = 0.1, 0.3
# Trax's LSHSelfAttention defaults (trax/layers/research/efficient_attention.py) for the
# arguments that decide what it computes.
_LSH_DEFAULTS = {"chunk_len": 128, "n_chunks_before": 1, "n_chunks_after": 0, "n_hashes": 1, "n_buckets": None}
# Passed by the Terraformer's blocks (ApplyAttentionLayer), overriding any value in the partial:
# n_heads, d_qk = d_v = d_model / n_heads, causal (False in the encoder, True in the decoder),
# masked (the encoder's padding), attention_dropout = output_dropout = dropout, and the mode.
_LSH_SET_BY_THE_MODEL = ("n_heads", "d_qk", "d_v", "causal", "masked", "attention_dropout", "output_dropout", "mode")
# How Trax runs the layer, not what it computes: the predict-mode memory (terra's decode cache
# holds the whole sequence; the two agree while the sequence fits predict_mem_len), the padding
# of the buckets kept for the backward pass, the loop over heads, and share_qk ("unused").
_LSH_SCHEDULE = (
    "predict_mem_len",
    "predict_drop_len",
    "max_length_for_buckets",
    "n_parallel_heads",
    "use_python_loop",
    "use_reference_code",
    "share_qk",
)


def read_trax_arguments(path: str) -> Tuple[str, Dict[str, Any]]:
    """``(constructor name, keyword arguments)`` from an ``ARGS.json`` file."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path} does not exist: give the JSON file of the Trax model's constructor arguments.")
    data = files.read_regular_file(path, MAX_ARGUMENTS_BYTES, ConfigError, "the Trax arguments")
    try:
        content = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path} is not JSON: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{path} holds a {type(content).__name__}; expected a JSON object of constructor arguments.")
    if "constructor_kwargs" in content:
        name, kwargs = content.get("trax_constructor", ""), dict(content["constructor_kwargs"])
    else:
        kwargs = dict(content)
        name = kwargs.pop("model", "")
    name = str(name).rsplit(".", 1)[-1]
    if not name:
        raise ConfigError(
            f'{path} does not name the Trax model; add "trax_constructor" (or "model"): {SUPPORTED_MODELS}.'
        )
    if name not in DEFAULTS:
        raise ConfigError(f"{path}: {_unsupported_model(name)}")
    return name, kwargs


def _unsupported_model(name: str) -> str:
    return f"the Trax model {name} is not supported: terra converts {SUPPORTED_MODELS}."


def _layer(value: Any, argument: str, constructor: str = "") -> Tuple[str, Dict[str, Any]]:
    if isinstance(value, (list, tuple)):
        # Trax's Terraformer cycles a list of decoder attention types over the layers.
        names = [_layer(v, argument)[0] if isinstance(v, (str, dict)) else repr(v) for v in value]
        supported = _ATTENTION_CHOICES.get(argument, {}).get(constructor)
        what = f": {', '.join(supported)}" if supported else ""
        raise ConfigError(
            f"{constructor}({argument}=[{', '.join(names)}]): a per-layer list of layer types is not supported; "
            f"terra converts one type for every layer{what}."
        )
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1], {}
    if isinstance(value, dict) and "trax_layer" in value:
        return str(value["trax_layer"]).rsplit(".", 1)[-1], dict(value.get("partial_kwargs") or {})
    raise ConfigError(f"{argument}={value!r}: expected a layer name or {{'trax_layer': ..., 'partial_kwargs': ...}}.")


class _Arguments:
    """The arguments with defaults filled in; ``take`` marks each one as handled."""

    def __init__(self, constructor: str, kwargs: Dict[str, Any]):
        self.constructor = constructor
        unknown = sorted(set(kwargs) - set(DEFAULTS[constructor]) - {"input_vocab_size"})
        if unknown:
            raise ConfigError(
                f"{constructor} has no argument(s) {unknown} (terra maps the arguments of the paper's Trax code, "
                "commit 7c189c2); remove them or check the spelling."
            )
        if "input_vocab_size" not in kwargs:
            raise ConfigError(f"{constructor}: input_vocab_size is required (Trax has no default for it).")
        self.values = {**DEFAULTS[constructor], **kwargs}
        self.unhandled = set(self.values)

    def take(self, name: str) -> Any:
        self.unhandled.discard(name)
        return self.values[name]

    def require(self, name: str, allowed, why: str) -> Any:
        value = self.take(name)
        if value not in allowed:
            raise ConfigError(f"{self.constructor}({name}={value!r}): {why}")
        return value


def _integer(constructor: str, name: str, value, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive integer" if minimum > 0 else "a non-negative integer"
        raise ConfigError(f"{constructor}({name}={value!r}) must be {kind}.")
    return value


def _number(constructor: str, name: str, value, low: float = 0.0, high: float = 1.0) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{constructor}({name}={value!r}) must be a number in [{low}, {high}].")
    return float(value)


def _positive_int(args: _Arguments, name: str) -> int:
    return _integer(args.constructor, name, args.take(name), minimum=1)


def _sizes(args: _Arguments) -> List[str]:
    vocab = _positive_int(args, "input_vocab_size")
    output_vocab = args.take("output_vocab_size")
    if output_vocab not in (None, vocab):
        raise ConfigError(
            f"{args.constructor}(output_vocab_size={output_vocab}) differs from input_vocab_size={vocab}: terra "
            "shares one vocabulary between inputs and outputs (Trax does too when output_vocab_size is None)."
        )
    bindings = [f"TransformerConfig.vocab_size = {vocab}"]
    for name in ("d_model", "d_ff", "n_heads", "max_len"):
        bindings.append(f"TransformerConfig.{name} = {_positive_int(args, name)}")
    for name in ("n_encoder_layers", "n_decoder_layers"):
        bindings.append(f"TransformerConfig.{name} = {_integer(args.constructor, name, args.take(name))}")
    dropout = _number(args.constructor, "dropout", args.take("dropout"))
    ff_dropout = args.take("ff_dropout")
    ff_dropout = dropout if ff_dropout is None else _number(args.constructor, "ff_dropout", ff_dropout)
    bindings += [
        f"TransformerConfig.dropout = {dropout}",
        f"TransformerConfig.attention_dropout = {dropout}",  # Trax passes `dropout` to the attention layers
        f"TransformerConfig.ff_dropout = {ff_dropout}",
        "TransformerConfig.dtype = 'float32'",
    ]
    activation, _ = _layer(args.take("ff_activation"), "ff_activation", args.constructor)
    if activation != "Relu":
        raise ConfigError(f"{args.constructor}(ff_activation={activation}): terra's feed-forward layers use ReLU only.")
    args.require("attention_chunk_size", (0,), "terra has no chunked dense attention; use attention_chunk_size=0.")
    args.require(
        "pos_type", (None,), "terra's positional table is Trax's default trainable sinusoid table (pos_type=None)."
    )
    args.require("pos_axial_shape", (None, [], ()), "terra has no axial positional embeddings.")
    args.require("pos_d_axial_embs", (None,), "terra has no axial positional embeddings.")
    # ConfigurableTransformer has neither argument: its positions always start from zero.
    start, offset = 1.0, 0
    if "pos_start_from_zero_prob" in args.values:
        start = _number(args.constructor, "pos_start_from_zero_prob", args.take("pos_start_from_zero_prob"))
        offset = _integer(args.constructor, "pos_max_offset_to_add", args.take("pos_max_offset_to_add"))
    bindings += [
        f"TransformerConfig.position_start_from_zero_prob = {start}",
        f"TransformerConfig.position_max_offset = {offset}",
    ]
    args.take("mode")  # eval/predict/train: terra picks the mode per call
    return bindings


def _feed_forward(args: _Arguments, selector: str) -> List[str]:
    sparsity = args.take("ff_sparsity")
    chunk = _integer(args.constructor, "ff_chunk_size", args.take("ff_chunk_size") or 0)
    if sparsity in (0, None):
        # terra's dense FF is unchunked: the same outputs, more training memory
        return [f"{selector}.feed_forward = @FeedForward"]
    if isinstance(sparsity, str):  # Trax's sweep-file form, "N d_lowrank [temperature quant_prob]"
        try:
            sparsity = [float(x) if "." in x else int(x) for x in sparsity.split()]
        except ValueError:
            sparsity = [sparsity]
    # Trax's SparseFF takes N, (N, d_lowrank) or (N, d_lowrank, temperature, quant_prob).
    if isinstance(sparsity, (list, tuple)) and len(sparsity) in (2, 4):
        n, d_lowrank = sparsity[0], sparsity[1]
        temperature, quant_prob = (
            sparsity[2:] if len(sparsity) == 4 else (_SPARSE_FF_TEMPERATURE, _SPARSE_FF_QUANT_PROB)
        )
    elif not isinstance(sparsity, (list, tuple)):
        n, d_lowrank, temperature, quant_prob = sparsity, None, _SPARSE_FF_TEMPERATURE, _SPARSE_FF_QUANT_PROB
    else:
        raise ConfigError(
            f"{args.constructor}(ff_sparsity={sparsity!r}): expected 0, N, (N, d_lowrank) or "
            "(N, d_lowrank, temperature, quant_prob), as Trax's SparseFF unpacks it."
        )
    d_lowrank = None if d_lowrank is None else _integer(args.constructor, "ff_sparsity's d_lowrank", d_lowrank, 1)
    return [
        f"{selector}.feed_forward = @SparseFeedForward",
        f"SparseFeedForward.ff_sparsity = {_integer(args.constructor, 'ff_sparsity', n, 1)}",
        # One straight-through coin per chunk, computed chunk by chunk (training only).
        f"SparseFeedForward.ff_chunk_size = {chunk}",
        f"SparseFeedForward.d_lowrank = {d_lowrank}",
        f"SparseFeedForward.temperature = {_number(args.constructor, 'ff_sparsity temperature', temperature, 0, 1e3)}",
        f"SparseFeedForward.quant_prob = {_number(args.constructor, 'ff_sparsity quant_prob', quant_prob)}",
    ]


def _logits(args: _Arguments, selector: str) -> List[str]:
    sparsity = args.take("loss_sparsity")
    kind = args.take("loss_sparsity_type")
    args.require("loss_d_lowrank", (0, None), "terra's sparse loss is the multiplicative layer (loss_d_lowrank=0).")
    args.require("loss_sparsity_prob", (None,), "terra's sparse loss has no mixing probability.")
    if not sparsity:
        return [f"{selector}.logits_layer = @DenseLogits"]
    if kind != "mult":
        raise ConfigError(
            f"{args.constructor}(loss_sparsity_type={kind!r}): terra's sparse loss is the multiplicative "
            "layer ('mult')."
        )
    sparsity = _integer(args.constructor, "loss_sparsity", sparsity, 1)
    return [f"{selector}.logits_layer = @SparseLossLogits", f"SparseLossLogits.loss_sparsity = {sparsity}"]


def _lsh_attention(args: _Arguments, name: str, options: Dict[str, Any], scope: str, causal: bool) -> List[str]:
    """Trax's ``LSHSelfAttention`` (shared-QK, per-head projections) as terra's, in its 'model'
    weights format and without biases (Trax's default ``bias=False``). The Terraformer sets
    causality, masking, both dropouts and the head sizes itself (``_LSH_SET_BY_THE_MODEL``)."""
    options = {**_LSH_DEFAULTS, **options}
    if options.pop("bias", False):
        raise ConfigError(
            f"{args.constructor}({name}=LSHSelfAttention, bias=True): not supported; Trax adds Q and V biases "
            "without an output bias, terra's LSHSelfAttention has all three or none: terra converts bias=False "
            "(Trax's default)."
        )
    for key in (*_LSH_SET_BY_THE_MODEL, *_LSH_SCHEDULE):
        options.pop(key, None)
    sizes = {key: options.pop(key) for key in _LSH_DEFAULTS}
    if options:
        raise ConfigError(f"{name}: LSHSelfAttention options {sorted(options)} have no terra counterpart.")
    chunk_len = _integer(args.constructor, f"{name} chunk_len", sizes["chunk_len"], 1)
    n_hashes = _integer(args.constructor, f"{name} n_hashes", sizes["n_hashes"], 1)
    before = _integer(args.constructor, f"{name} n_chunks_before", sizes["n_chunks_before"])
    after = _integer(args.constructor, f"{name} n_chunks_after", sizes["n_chunks_after"])
    n_buckets = _lsh_buckets(args, name, sizes["n_buckets"])
    layer = f"{scope}/LSHSelfAttention"
    return [
        f"{layer}.weights_format = 'model'",
        f"{layer}.use_bias = False",
        f"{layer}.causal = {causal}",
        f"{layer}.chunk_len = {chunk_len}",
        f"{layer}.n_chunks_before = {before}",
        f"{layer}.n_chunks_after = {after}",
        f"{layer}.n_hashes = {n_hashes}",
        f"{layer}.n_buckets = {n_buckets}",
        # ApplyAttentionLayer passes the model's dropout, whatever the partial says.
        f"{layer}.attention_dropout = {args.values['dropout']}",
        f"{layer}.std_length = None",
    ]


def _lsh_buckets(args: _Arguments, name: str, n_buckets) -> Any:
    """``None`` (Trax's automatic count), an even int, or a list of even factors (a factorised hash)."""
    if n_buckets is None:
        return None
    factors = list(n_buckets) if isinstance(n_buckets, (list, tuple)) else [n_buckets]
    if factors and all(isinstance(f, int) and not isinstance(f, bool) and f > 0 and f % 2 == 0 for f in factors):
        return factors if isinstance(n_buckets, (list, tuple)) else n_buckets
    raise ConfigError(
        f"{args.constructor}({name} n_buckets={n_buckets!r}) must be None, an even positive integer or a list of "
        "them, as Trax's hash_vecs asserts."
    )


def _unsupported_layer(args: _Arguments, name: str, layer: str) -> ConfigError:
    supported = _ATTENTION_CHOICES[name][args.constructor]
    return ConfigError(
        f"{args.constructor}({name}={layer}): not supported; terra converts {' or '.join(supported)} here."
    )


def _decoder_attention(args: _Arguments, name: str, selector: str) -> List[str]:
    layer, options = _layer(args.take(name), name, args.constructor)
    if layer not in DECODER_ATTENTION[args.constructor]:
        raise _unsupported_layer(args, name, layer)
    if layer == "LSHSelfAttention":
        return [f"{selector} = @decoder/LSHSelfAttention", *_lsh_attention(args, name, options, "decoder", True)]
    options.pop("max_inference_length", None)  # the decode cache length; terra sizes it per call
    if layer == "CausalAttention":
        options.pop("dropout", None)
        if options:
            raise ConfigError(f"{name}: CausalAttention options {sorted(options)} have no terra counterpart.")
        return [f"{selector} = @CausalSelfAttention"]
    # MultiplicativeConvCausalAttention, the last of DECODER_ATTENTION
    options = {**_MULTCONV_DEFAULTS, **options}
    options.pop("dropout", None)
    sparsity, length_kernel = options.pop("sparsity"), options.pop("length_kernel_size")
    sparsity = args.values["n_heads"] if sparsity is None else sparsity
    sparsity = _integer(args.constructor, f"{name} sparsity", sparsity, 1)
    length_kernel = _integer(args.constructor, f"{name} length_kernel_size", length_kernel, 1)
    if options:
        raise ConfigError(
            f"{name}: MultiplicativeConvCausalAttention options {sorted(options)} have no terra counterpart."
        )
    return [
        f"{selector} = @SparseQKVAttention",
        f"SparseQKVAttention.attention_sparsity = {sparsity}",
        f"SparseQKVAttention.length_kernel_size = {length_kernel}",
        "SparseQKVAttention.variant = 'multconv'",
    ]


def _encoder_attention(args: _Arguments, selector: str) -> List[str]:
    name = "encoder_attention_type"
    layer, options = _layer(args.take(name), name, args.constructor)
    if layer not in ENCODER_ATTENTION[args.constructor]:
        raise _unsupported_layer(args, name, layer)
    if layer == "LSHSelfAttention":
        return [f"{selector} = @encoder/LSHSelfAttention", *_lsh_attention(args, name, options, "encoder", False)]
    options.pop("dropout", None)
    if options:
        raise ConfigError(
            f"{args.constructor}({name}=Attention{options}): Attention options have no terra counterpart."
        )
    return [f"{selector} = @SelfAttention"]


def _attention_output_dropout(args: _Arguments) -> bool:
    """Trax's LSHSelfAttention drops its output (rate ``dropout``); Attention, CausalAttention and
    MultiplicativeConvCausalAttention have no output dropout. terra's switch covers both sides."""
    lsh = [_layer(args.values[name], name)[0] == "LSHSelfAttention" for name in _ATTENTION_CHOICES]
    if all(lsh):
        return True
    if any(lsh) and args.values["dropout"]:
        raise ConfigError(
            f"{args.constructor}(dropout={args.values['dropout']}) with LSHSelfAttention on one side only: not "
            "supported; Trax drops the LSH layer's output but not the other attention's, and terra's "
            "Terraformer.attention_output_dropout covers both sides. terra converts LSHSelfAttention on both sides, "
            "or on one side with dropout=0."
        )
    return False


def _transformer(args: _Arguments) -> List[str]:
    bindings = _sizes(args)
    args.require("ff_sparsity_type", ("1inN",), "terra's Sparse FF is the paper's '1inN' controller.")
    args.require("ff_use_sru", (0, None), "terra's encoder-decoder Transformer has no SRU; use ff_use_sru=0.")
    args.require("enc_dec_attention_sparsity", (0,), "terra converts the dense encoder-decoder attention (sparsity 0).")
    shared = args.take("dropout_shared_axes")
    if shared not in (None, [], (), [-2], (-2,), [1], (1,)):
        raise ConfigError(
            f"{args.constructor}(dropout_shared_axes={shared!r}): terra shares dropout masks over the length "
            "axis ([-2]) or not at all (None)."
        )
    bindings.append(f"TransformerConfig.share_dropout_over_length = {bool(shared)}")
    bindings += _feed_forward(args, "EncoderDecoderTransformer")
    bindings += _encoder_attention(args, "EncoderDecoderTransformer.encoder_attention")
    bindings += _decoder_attention(
        args, "encoder_decoder_attention_type", "EncoderDecoderTransformer.decoder_self_attention"
    )
    bindings += ["EncoderDecoderTransformer.encoder_decoder_attention = @CrossAttention"]
    bindings += _logits(args, "EncoderDecoderTransformer")
    return bindings


def _boolean(args: _Arguments, name: str) -> bool:
    value = args.take(name)
    if not isinstance(value, bool):
        raise ConfigError(f"{args.constructor}({name}={value!r}) must be true or false.")
    return value


def _decoder_attention_layers(args: _Arguments) -> int:
    return _integer(args.constructor, "n_decoder_attention_layers", args.take("n_decoder_attention_layers"), 1)


def _terraformer(args: _Arguments) -> List[str]:
    # ConfigurableTerraformer shares every dropout mask over the length axis ([-2]).
    bindings = [*_sizes(args), "TransformerConfig.share_dropout_over_length = True"]
    values = args.values
    d_head = values["d_model"] // values["n_heads"]
    for name in ("d_attention_key", "d_attention_value"):
        args.require(name, (None, d_head), f"terra's attention heads are d_model / n_heads = {d_head} wide.")
    sru = args.take("ff_use_sru")
    if isinstance(sru, (list, tuple)) and len(sru) == 2:
        sru_layers = _integer(args.constructor, "ff_use_sru n_layers", sru[0])
        sru_units = _integer(args.constructor, "ff_use_sru n_units", sru[1], 1)
    elif isinstance(sru, int) and not isinstance(sru, bool) and sru >= 0:
        sru_layers, sru_units = sru, 32  # Trax: an int n means (n, 32)
    else:
        raise ConfigError(f"{args.constructor}(ff_use_sru={sru!r}): expected 0, n or (n_layers, n_units).")
    bindings += [
        f"Terraformer.sru_units = {sru_units if sru_layers else 0}",
        f"Terraformer.sru_layers = {max(sru_layers, 1)}",
    ]
    bindings += _feed_forward(args, "Terraformer")
    bindings += _encoder_attention(args, "Terraformer.encoder_attention")
    bindings += _decoder_attention(args, "encoder_decoder_attention_type", "Terraformer.decoder_attention")
    bindings += _logits(args, "Terraformer")
    bindings += [
        f"Terraformer.n_decoder_attention_layers = {_decoder_attention_layers(args)}",
        f"Terraformer.reversible_encoder = {_boolean(args, 'reversible_encoder')}",
        # Trax's center_layernorm reaches the norms inside the blocks and the SRU branch; the norm
        # after a non-reversible encoder and the final norm are centred either way, as in terra.
        f"Terraformer.center_layernorm = {_boolean(args, 'center_layernorm')}",
        f"Terraformer.attention_output_dropout = {_attention_output_dropout(args)}",
    ]
    args.require("n_layers_forget", (0,), "terra's Terraformer has no 'forget' layers; use n_layers_forget=0.")
    args.take("forget_dense")  # only read when n_layers_forget > 0
    args.require(
        "use_two_swaps_per_encoder_block",
        (True,),
        "terra's encoder block swaps the two streams twice (the C4 configs' choice).",
    )
    args.require("half_before_layer", (None,), "terra keeps d_model through the stack.")
    args.require("double_after_layer", (None,), "terra keeps d_model through the stack.")
    args.take("use_bfloat16")  # the weights are converted to float32; TransformerConfig.dtype picks the compute
    return bindings


def trax_gin(constructor: str, kwargs: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """``(gin files, gin bindings)`` of the terra model computing what
    ``trax.models.<constructor>(**kwargs)`` computes.

    Raises:
      ConfigError: an unknown argument, or a value terra does not implement (named).
    """
    if constructor not in DEFAULTS:
        raise ConfigError(_unsupported_model(constructor))
    args = _Arguments(constructor, kwargs)
    bindings = _transformer(args) if constructor == TRANSFORMER else _terraformer(args)
    assert not args.unhandled, f"arguments not mapped: {sorted(args.unhandled)}"
    return [BASE_CONFIG[constructor]], bindings

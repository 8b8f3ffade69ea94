"""Where each array of a Trax weight file goes in terra's parameter tree.

Trax stores a model's weights as one flat list in the depth-first order of its layer tree
(:mod:`terra.convert.trax_file`); terra names every parameter. :func:`trax_leaves` lists, for a
terra model, the Trax arrays in file order: what each one is, the shape Trax stores it with,
and the terra parameter (and the part of it) it becomes. The order and layouts follow the
reference's ``ConfigurableTransformer`` and ``ConfigurableTerraformer`` (docs/coming_from_trax.md
has the table); the layouts differ where terra stores kernels output-major or fuses Q, K and
V:

* Trax ``Dense`` ``w [d_in, d_out]`` is terra's kernel ``[d_out, d_in]`` (transposed);
  attention's Q, K, V ``[d_model, heads*d_head]`` fill ``qkv [heads, 3, d_head, d_model]``
  and the output ``[heads*d_head, d_model]`` is ``out [d_model, heads, d_head]``.
* Sparse FF: Trax ``w1 [d_model, d_ff/N, N]`` and ``w2 [N, d_ff/N, d_model]`` are both terra
  ``[d_ff/N, N, d_model]``: unit (block b, element j) is ``w1[:, b, j]`` but ``w2[j, b, :]``.
* LSH attention: Trax's per-head ``w_q``, ``w_v`` ``[heads, d_model, d_head]`` (shared QK)
  fill ``qv [heads, 2, d_head, d_model]``; ``w_o [heads, d_head, d_model]`` is ``out
  [d_model, heads, d_head]``. Neither has a bias.
* The multiplicative layer, the Q/K/V convolutions, norms, embeddings and positional tables
  are stored alike.

The layout is read off the terra model's own parameter tree (which layer each block holds), so
a terra gin config of the same architecture gives the same list as the Trax arguments.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Sequence, Tuple

import jax
import numpy as np

from terra.errors import CheckpointError

Transform = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class TraxLeaf:
    """One array of the Trax file: ``describe`` names it as Trax does, ``shape`` is how Trax
    stores it, ``to_terra`` turns it into ``params[path][index]``."""

    describe: str
    shape: Tuple[int, ...]
    path: Tuple[str, ...]  # () for an array Trax stores but never uses: checked, then dropped
    to_terra: Transform = np.asarray
    index: Tuple[Any, ...] = ()


class _Builder:
    def __init__(self, params: Dict[str, Any]):
        self.params = params
        self.leaves: List[TraxLeaf] = []

    def subtree(self, path: Sequence[str]) -> Dict[str, Any]:
        node = self.params
        for key in path:
            node = node[key]
        return node

    def shape(self, path: Sequence[str]) -> Tuple[int, ...]:
        return tuple(self.subtree(path).shape)

    def add(self, describe, shape, path, to_terra=np.asarray, index=()):
        self.leaves.append(TraxLeaf(describe, tuple(int(s) for s in shape), tuple(path), to_terra, index))

    # ----- layers --------------------------------------------------------------------------
    def copy(self, describe: str, path: Sequence[str]) -> None:
        self.add(describe, self.shape(path), path)

    def norm(self, describe: str, path: Sequence[str]) -> None:
        """Trax's ``LayerNorm`` stores a scale and a bias even with ``center=False``, where the
        bias is never added; terra's RMS norm has no bias, so that array is read and dropped."""
        node = self.subtree(path)
        self.copy(f"{describe} LayerNorm scale", [*path, "scale"])
        if "bias" in node:
            self.copy(f"{describe} LayerNorm bias", [*path, "bias"])
        else:
            self.add(f"{describe} LayerNorm bias (unused without centring; dropped)", node["scale"].shape, ())

    def dense(self, describe: str, path: Sequence[str]) -> None:
        """Trax ``Dense``: ``w [d_in, d_out]``, ``b [d_out]``; terra's kernel is
        ``[*out, *in]`` with the bias shaped like its output axes."""
        node = self.subtree(path)
        kernel_shape = tuple(node["kernel"].shape)
        d_out = int(np.prod(node["bias"].shape)) if "bias" in node else None
        d_in = int(np.prod(kernel_shape)) // d_out
        self.add(f"{describe} Dense w [d_in, d_out]", (d_in, d_out), [*path, "kernel"], _transpose_to(kernel_shape))
        self.add(f"{describe} Dense b [d_out]", (d_out,), [*path, "bias"], _reshape_to(node["bias"].shape))

    def dense_attention(self, describe: str, path: Sequence[str]) -> None:
        """Trax ``Attention``/``CausalAttention``/the encoder-decoder ``AttentionQKV``: Dense Q,
        K, V then the output Dense, each ``[d_model, heads*d_head]`` with a bias."""
        node = self.subtree(path)
        if "qkv" in node:
            parts = [("Q", "qkv", 0), ("K", "qkv", 1), ("V", "qkv", 2)]
        elif "q" in node and "kv" in node:
            parts = [("Q", "q", None), ("K", "kv", 0), ("V", "kv", 1)]
        else:
            raise _unsupported(path, node)
        for label, name, slot in parts:
            kernel = node[name]["kernel"].shape  # [heads, (slot,) d_head, d_model]
            heads, d_head, d_model = kernel[0], kernel[-2], kernel[-1]
            index = (slice(None), slot) if slot is not None else ()
            self.add(
                f"{describe} {label} Dense w [d_model, heads*d_head]",
                (d_model, heads * d_head),
                [*path, name, "kernel"],
                _heads_in(heads, d_head),
                index,
            )
            self.add(
                f"{describe} {label} Dense b [heads*d_head]",
                (heads * d_head,),
                [*path, name, "bias"],
                _reshape_to((heads, d_head)),
                index,
            )
        out = node["out"]["kernel"].shape  # [d_model, heads, d_head]
        d_model, heads, d_head = out
        self.add(
            f"{describe} output Dense w [heads*d_head, d_model]",
            (heads * d_head, d_model),
            [*path, "out", "kernel"],
            lambda w, h=heads, k=d_head, d=d_model: w.reshape(h, k, d).transpose(2, 0, 1),
        )
        self.copy(f"{describe} output Dense b [d_model]", [*path, "out", "bias"])

    def multiplicative(self, describe: str, path: Sequence[str]) -> None:
        """Trax ``FactoredDense``: gating ``[S, d_in]``, projection ``[d_in, d_out/S]``, bias."""
        self.copy(f"{describe} FactoredDense gating [S, d_in]", [*path, "gate"])
        self.copy(f"{describe} FactoredDense projection [d_in, d_out/S]", [*path, "kernel"])
        self.copy(f"{describe} FactoredDense bias [d_out]", [*path, "bias"])

    def lsh_attention(self, describe: str, path: Sequence[str]) -> None:
        """Trax ``LSHSelfAttention``: per-head ``w_q`` (the shared QK), ``w_v``, ``w_o``, no
        biases (``bias=False``; with ``bias=True`` Trax adds Q and V biases but never an output
        bias, which terra's ``use_bias`` would need)."""
        node = self.subtree(path)
        if "bias" in node["qv"] or "bias" in node["out"]:
            raise CheckpointError(
                f"the terra layer {'/'.join(path)} is LSHSelfAttention with use_bias=True: not supported; Trax's "
                "LSHSelfAttention has no output bias, so terra converts it with LSHSelfAttention.use_bias = False."
            )
        heads, _, d_head, d_model = node["qv"]["kernel"].shape
        for label, slot in (("w_q [heads, d_model, d_qk] (shared QK)", 0), ("w_v [heads, d_model, d_v]", 1)):
            self.add(
                f"{describe} LSH {label}",
                (heads, d_model, d_head),
                [*path, "qv", "kernel"],
                lambda w: w.transpose(0, 2, 1),
                (slice(None), slot),
            )
        self.add(
            f"{describe} LSH w_o [heads, d_v, d_model]",
            (heads, d_head, d_model),
            [*path, "out", "kernel"],
            lambda w: w.transpose(2, 0, 1),
        )

    def attention(self, describe: str, path: Sequence[str]) -> None:
        node = self.subtree(path)
        if "qv" in node:  # LSH attention's fused shared-QK and value projections ('model' format)
            self.lsh_attention(describe, path)
        elif "mult" in node and "out_conv" not in node and "out" not in node:
            # MultiplicativeConvCausalAttention: one FactoredDense, then the Q, K, V
            # LocallyConvDense kernels (HWIO: length, modules, in, out) with biases.
            self.multiplicative(f"{describe} Sparse QKV", [*path, "mult"])
            for label in ("q", "k", "v"):
                self.copy(f"{describe} Sparse QKV {label.upper()} conv kernel HWIO", [*path, f"{label}_conv", "kernel"])
                self.copy(f"{describe} Sparse QKV {label.upper()} conv bias", [*path, f"{label}_conv", "bias"])
        else:
            self.dense_attention(describe, path)

    def feed_forward(self, describe: str, path: Sequence[str]) -> None:
        node = self.subtree(path)
        if "controller_up" in node and "wi_bias" not in node:
            wi = node["wi"].shape  # [d_ff/N, N, d_model]
            blocks, n, d_model = wi
            low = node["controller_up"].shape[0]
            self.add(
                f"{describe} SparseFF m1 [d_model, d_lowrank]",
                (d_model, low),
                [*path, "controller_down", "kernel"],
                np.transpose,
            )
            self.copy(f"{describe} SparseFF m2 [d_lowrank, d_ff/N, N]", [*path, "controller_up"])
            self.copy(f"{describe} SparseFF mb [d_ff/N, N]", [*path, "controller_bias"])
            self.add(
                f"{describe} SparseFF w1 [d_model, d_ff/N, N]",
                (d_model, blocks, n),
                [*path, "wi"],
                lambda w: w.transpose(1, 2, 0),
            )
            self.add(
                f"{describe} SparseFF w2 [N, d_ff/N, d_model]",
                (n, blocks, d_model),
                [*path, "wo"],
                lambda w: w.transpose(1, 0, 2),
            )
            self.copy(f"{describe} SparseFF b2 [d_model]", [*path, "wo_bias"])
        elif "wi" in node and "kernel" in node["wi"]:
            self.dense(f"{describe} FF first", [*path, "wi"])
            self.dense(f"{describe} FF second", [*path, "wo"])
        else:
            raise _unsupported(path, node)

    def feed_forward_with_sru(self, describe: str, path: Sequence[str]) -> None:
        """The Terraformer's FF half: ``[LN -> FF](x) + [LN -> Dense(n) -> SRU(n) ... -> Dense(d)](x)``."""
        self.norm(f"{describe} FF", [*path, "norm"])
        self.feed_forward(describe, [*path, "feed_forward"])
        node = self.subtree(path)
        if "sru" in node:
            sru = node["sru"]
            self.norm(f"{describe} SRU branch", [*path, "sru", "norm"])
            self.dense(f"{describe} SRU branch down", [*path, "sru", "down"])
            for i in range(sum(1 for k in sru if k.startswith("sru_"))):
                self.dense(f"{describe} SRU {i} gates", [*path, "sru", f"sru_{i}", "gates"])
            self.dense(f"{describe} SRU branch up", [*path, "sru", "up"])

    def logits(self, path: Sequence[str]) -> None:
        node = self.subtree(path)
        if "dense" in node:
            self.dense("output layer", [*path, "dense"])
        elif "multiplicative" in node:
            self.multiplicative("output layer (sparse loss)", [*path, "multiplicative"])
        else:
            raise _unsupported(path, node)


def _transpose_to(shape) -> Transform:
    return lambda w: np.asarray(w).T.reshape(shape)


def _reshape_to(shape) -> Transform:
    return lambda w: np.asarray(w).reshape(shape)


def _heads_in(heads: int, d_head: int) -> Transform:
    """``[d_model, heads*d_head]`` (head-major columns) -> ``[heads, d_head, d_model]``."""
    return lambda w: np.asarray(w).reshape(w.shape[0], heads, d_head).transpose(1, 2, 0)


def _unsupported(path: Sequence[str], node) -> CheckpointError:
    names = sorted(node) if isinstance(node, dict) else type(node).__name__
    return CheckpointError(
        f"the terra layer {'/'.join(path)} (parameters {names}) has no Trax counterpart that terra converts "
        "(dense and Sparse FF, dense, Sparse QKV and LSH attention, dense and sparse-loss logits, the SRU)."
    )


def _numbered(params: Dict[str, Any], prefix: str) -> List[str]:
    names = [k for k in params if k.startswith(prefix) and k[len(prefix) :].isdigit()]
    return sorted(names, key=lambda k: int(k[len(prefix) :]))


# (what Trax calls the sublayer, terra's pre-norm, terra's layer) in Trax's order within a block.
_ENCODER_SUBLAYERS = (("attention", "pre_attention_norm", "attention"), ("FF", "pre_ff_norm", "feed_forward"))
_DECODER_SUBLAYERS = (
    ("self-attention", "pre_self_attention_norm", "self_attention"),
    ("encoder-decoder attention", "pre_cross_attention_norm", "cross_attention"),
    ("FF", "pre_ff_norm", "feed_forward"),
)


def _pre_norm_stack(b: _Builder, prefix: str, sublayers) -> None:
    for name in _numbered(b.params, prefix):
        where = f"{prefix.rstrip('_')} layer {name.split('_')[1]}"
        for label, norm, layer in sublayers:
            b.norm(f"{where} {label}", [name, norm])
            if layer == "feed_forward":
                b.feed_forward(where, [name, layer])
            else:
                b.attention(f"{where} {label}", [name, layer])


def _transformer(b: _Builder) -> None:
    """``ConfigurableTransformer``: embedding, encoder positions, encoder blocks, encoder norm,
    decoder positions (the embedding is shared, stored once), decoder blocks, decoder norm, output."""
    b.copy("token embedding [vocab, d_model]", ["token_embedding", "embedding"])
    b.copy("encoder positional table [max_len, d_model]", ["encoder_positions", "pos_embedding"])
    _pre_norm_stack(b, "encoder_", _ENCODER_SUBLAYERS)
    b.norm("encoder final", ["encoder_norm"])
    b.copy("decoder positional table [max_len, d_model]", ["decoder_positions", "pos_embedding"])
    _pre_norm_stack(b, "decoder_", _DECODER_SUBLAYERS)
    b.norm("decoder final", ["decoder_norm"])
    b.logits(["logits"])


def _reversible_stack(b: _Builder, stack: str, describe: str) -> None:
    for name in _numbered(b.params[stack], "layer_"):
        node = b.params[stack][name]
        where = f"{describe} half-residual {name.split('_')[1]}"
        if "norm" in node:  # an attention half: LayerNorm then the attention layer
            b.norm(f"{where} attention", [stack, name, "norm"])
            b.attention(f"{where} attention", [stack, name, "layer"])
        else:  # a feed-forward half carries its own norms
            b.feed_forward_with_sru(where, [stack, name, "layer"])


def _terraformer(b: _Builder) -> None:
    """``ConfigurableTerraformer``: embedding, encoder positions and decoder positions (both
    embeddings are built before the encoder runs), the encoder's half-residuals, [the merge
    Dense and LayerNorm without ``reversible_encoder``], the decoder's, the final norm, output."""
    b.copy("token embedding [vocab, d_model]", ["token_embedding", "embedding"])
    b.copy("encoder positional table [max_len, d_model]", ["encoder_positions", "pos_embedding"])
    b.copy("decoder positional table [max_len, d_model]", ["decoder_positions", "pos_embedding"])
    if "encoder_stack" in b.params:
        _reversible_stack(b, "encoder_stack", "encoder")
    if "encoder_merge" in b.params:
        b.dense("encoder merge", ["encoder_merge"])
        b.norm("encoder final", ["encoder_norm"])
    _reversible_stack(b, "decoder_stack", "decoder")
    b.norm("final", ["decoder_norm"])
    b.logits(["logits"])


def trax_leaves(params: Dict[str, Any]) -> List[TraxLeaf]:
    """The Trax file's arrays, in file order, for a terra parameter tree (arrays or
    ``ShapeDtypeStruct``) of an ``EncoderDecoderTransformer`` or a ``Terraformer``."""
    b = _Builder(params)
    if "decoder_stack" in params:
        _terraformer(b)
    elif "decoder_0" in params:
        _transformer(b)
    else:
        raise CheckpointError(
            f"the terra model (top-level parameters {sorted(params)}) is neither an encoder-decoder Transformer "
            "nor a Terraformer; only those two have Trax counterparts."
        )
    return b.leaves


def leaf_line(i: int, leaf: TraxLeaf) -> str:
    """``[i] what Trax calls it (shape) -> the terra parameter's path``: an expected array in errors."""
    return f"[{i}] {leaf.describe} {leaf.shape} -> {'/'.join(leaf.path) or '(dropped)'}"


def to_terra_params(
    flat: Sequence[np.ndarray], params: Dict[str, Any], where: str = "the Trax file", leaves=None
) -> Dict:
    """terra parameters (nested dicts of float32 numpy arrays shaped like ``params``) from the
    Trax file's flat weight list.

    Raises:
      CheckpointError: an array of the wrong shape, missing arrays or extra ones, each named by
        its index in the file, what Trax calls it and the terra parameter it would fill.
    """
    leaves = trax_leaves(params) if leaves is None else leaves
    for i, (leaf, array) in enumerate(zip(leaves, flat)):
        if tuple(array.shape) != leaf.shape:
            raise CheckpointError(
                f"{where}: array [{i}] has shape {tuple(array.shape)}, but the model expects {leaf_line(i, leaf)}. "
                "The Trax arguments (or gin config) do not describe the model that wrote the file."
            )
    if len(flat) < len(leaves):
        missing = "; ".join(leaf_line(i, leaves[i]) for i in range(len(flat), min(len(leaves), len(flat) + 5)))
        raise CheckpointError(
            f"{where} holds {len(flat)} arrays, the model expects {len(leaves)}: missing {missing}"
            f"{' ...' if len(leaves) - len(flat) > 5 else ''}."
        )
    if len(flat) > len(leaves):
        extra = "; ".join(
            f"[{i}] shape {tuple(flat[i].shape)}" for i in range(len(leaves), min(len(flat), len(leaves) + 5))
        )
        raise CheckpointError(
            f"{where} holds {len(flat)} arrays, the model expects {len(leaves)}: extra {extra}"
            f"{' ...' if len(flat) - len(leaves) > 5 else ''}. The file's model has more layers or weights than "
            "the arguments describe."
        )
    out = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), params)
    written = jax.tree.map(lambda a: np.zeros(a.shape, np.bool_), params)
    for leaf, array in zip(leaves, flat):
        if not leaf.path:
            continue
        _at(out, leaf.path)[leaf.index] = leaf.to_terra(np.asarray(array, np.float32))
        _at(written, leaf.path)[leaf.index] = True
    unset = [
        jax.tree_util.keystr(path) for path, seen in jax.tree_util.tree_leaves_with_path(written) if not seen.all()
    ]
    if unset:
        raise CheckpointError(f"{where} leaves terra parameters unset: {unset}; this model cannot be converted.")
    return out


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree

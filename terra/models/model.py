"""The model families: a Flax network wrapped with everything the ``Model`` protocol asks.

``Seq2SeqModel`` holds what every family shares (initialisation, the loss and evaluation
metrics with the configured pad id, scoring, the decode contract and generation, parameter
counts); a family adds only what differs, which is how one decoded token reads its weights:

- ``EncoderDecoderModel``: the Scaling Transformer's encoder-decoder, dense or with any of
  the sparse layers injected (paper §3);
- ``TerraformerModel``: the reversible Terraformer (paper §4), dense or LSH attention.

Both construct a default network when none is given, so ``EncoderDecoderModel()`` is the
paper's 800M dense baseline and ``EncoderDecoderModel(EncoderDecoderTransformer(cfg))`` works
without gin; gin files bind the network (``terra.models.EncoderDecoderModel.module``).
"""

import abc
import dataclasses
import functools
import math
from typing import Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.backends import native_kernels
from terra.decoding.beam_search import beam_search
from terra.decoding.decode_step import IncrementalDecoder
from terra.decoding.generate import Generation, generate
from terra.errors import ConfigError
from terra.gin_config import frozen
from terra.layers.initializers import compile_initializer
from terra.models import losses
from terra.models.config import TransformerConfig
from terra.models.encoder_decoder import EncoderDecoderTransformer
from terra.models.protocol import Batch, Params
from terra.models.terraformer import Terraformer


def shift_right(targets: jax.Array, start_id: int = 0) -> jax.Array:
    """``[batch, length]`` -> decoder inputs: ``start_id`` then the targets minus the last."""
    start = jnp.full_like(targets[:, :1], start_id)
    return jnp.concatenate([start, targets[:, :-1]], axis=1)


def tree_size(tree) -> int:
    """Number of elements in a pytree of arrays or shapes."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def layer_reads(layer_factory, params, batch: int = 1) -> int:
    """Parameters a layer reads per decode step of ``batch`` sequences: its own
    ``params_read_per_token(params, batch=...)`` when the layer class defines one (sparse layers
    skip most rows, and a batch reads the union of the rows its sequences select), else all of
    them (whatever the batch: a step reads each weight once for every sequence). At batch 1 the
    method is called as ``params_read_per_token(params)``, so a layer whose method takes no
    batch still counts."""
    reads = getattr(layer_factory, "params_read_per_token", None)
    if not reads:
        return tree_size(params)
    return int(reads(params) if batch == 1 else reads(params, batch=batch))


def _init_variables(module: nn.Module, rng: jax.Array) -> Dict:
    # Parameter shapes do not depend on lengths; short dummy sequences keep init cheap.
    length = min(8, module.config.max_len)
    inputs = jnp.ones((1, length), jnp.int32)
    targets = jnp.ones((1, length), jnp.int32)
    return module.init({"params": rng, "dropout": rng}, inputs, targets)


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Layers built alike, named ``{prefix}{index}`` under ``path`` in every variable collection:
    ``count`` of them, repeating with ``period`` (layer ``i`` is built as layer ``i % period``)."""

    path: Tuple[str, ...]
    prefix: str
    period: int
    count: int


READ_PARTS = (
    "decoder self-attention",
    "encoder-decoder attention",
    "feed-forward",
    "norms",
    "embedding rows",
    "logits",
)


class Seq2SeqModel(abc.ABC):
    """Loss, scoring and decoding for a sequence-to-sequence Flax module (the ``Model`` protocol).

    Args:
      module: the network; a subclass supplies the default.
    """

    module_type: type = nn.Module

    def __init__(self, module: Optional[nn.Module] = None):
        module = self.default_module() if module is None else module
        if not isinstance(module, self.module_type):
            raise ConfigError(
                f"{type(self).__name__} wraps a {self.module_type.__name__}, got {type(module).__name__}; "
                f"bind MODEL = @terra.models.{_family_for(module)}() for that network."
            )
        self.module = module
        self.config: TransformerConfig = module.config
        # Build the whole variable tree abstractly now (nothing is allocated), so that
        # incompatible sizes in any injected layer (d_ff % N, d_model % S, vocab % S) fail
        # when the model is configured, not in the middle of a training job. The layers of a
        # stack are built alike, so the tree is traced with one layer per stack (one period of
        # a Terraformer's halves) and the other layers' subtrees are copies of theirs: at 800M
        # that trace is 1/16 to 1/30 of the whole initializer's, which is traced only when
        # parameters are first asked for (init_params); a restored or trained model never is.
        self._abstract = self._abstract_from_one_layer_per_stack(module)
        # The layers gin injected (``feed_forward = @SparseFeedForward``) would read gin's
        # bindings whenever Flax constructs them (init, apply, tracing), i.e. from whatever
        # config is parsed then: freeze them to this build's config and scope (``MODEL``), the
        # values the check above used, so that building another model changes nothing here.
        self.module = frozen.freeze_configurables(module)

    @abc.abstractmethod
    def default_module(self) -> nn.Module:
        """The network built when none is given."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.module).__name__}, {self.param_count()['total']:,d} parameters)"

    @abc.abstractmethod
    def layer_stacks(self) -> Tuple["LayerStack", ...]:
        """The network's stacks of alike layers, as they are named in its variable tree."""

    # ----- parameters -------------------------------------------------------------------
    def init_variables(self, rng: jax.Array) -> Dict:
        """Random variables boxed with their logical axes (see ``Model.init_variables``)."""
        return _init_variables(self.module, rng)

    def _abstract_from_one_layer_per_stack(self, module: nn.Module) -> Dict:
        """The abstract variable tree of ``module``: its initializer traced with one layer per
        stack, every other layer's subtree that layer's (``layer_stacks``)."""
        cfg = module.config
        shallow = module.clone(
            config=dataclasses.replace(cfg, n_encoder_layers=min(1, cfg.n_encoder_layers), n_decoder_layers=1)
        )
        traced = jax.jit(functools.partial(_init_variables, shallow)).trace(jax.random.key(0))
        tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type), traced.out_info)
        for collection in tree.values():
            for stack in self.layer_stacks():
                node = collection
                for name in stack.path:
                    node = node.get(name, {})
                for index in range(stack.period, stack.count):
                    node[f"{stack.prefix}{index}"] = node[f"{stack.prefix}{index % stack.period}"]
        return tree

    def abstract_variables(self) -> Dict:
        """Shapes and logical axes of every variable (``LogicallyPartitioned`` boxes), from a
        trace of the initializer with one layer per stack: nothing is allocated, so any size
        works."""
        return self._abstract

    def init_params(self, rng: jax.Array) -> Params:
        """Random parameters as a plain (unboxed) pytree. A raw ``uint32`` key
        (``jax.random.PRNGKey(n)``) draws what its typed key (``jax.random.key(n)``) draws, from
        the same compiled initializer."""
        if isinstance(rng, jax.core.Tracer):  # inside the caller's trace: part of its program
            return nn.unbox(self.init_variables(rng))["params"]
        if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            # JAX reads a raw key as the default PRNG's key data: wrapped, it is that typed key
            # (the same bits), so it needs no second compile of the initializer.
            rng = jax.random.wrap_key_data(rng)
        if jax.typeof(rng) != jax.typeof(jax.random.key(0)):  # another PRNG
            return nn.unbox(compile_initializer(jax.jit(self.init_variables).trace(rng))(rng))["params"]
        return nn.unbox(self._compiled_initializer(rng))["params"]

    @functools.cached_property
    def _compiled_initializer(self) -> jax.stages.Compiled:
        """The whole initializer, traced and compiled when parameters are first asked for."""
        return compile_initializer(jax.jit(self.init_variables).trace(jax.random.key(0)))

    def abstract_params(self) -> Params:
        """``jax.ShapeDtypeStruct`` of every parameter, unboxed."""
        return nn.unbox(self._abstract)["params"]

    def param_count(self) -> Dict[str, int]:
        """Parameters per top-level group (``encoder``, ``decoder``, ``token_embedding``, ...,
        numbered layers counted together) plus ``'total'``."""
        counts: Dict[str, int] = {}
        for name, subtree in self.abstract_params().items():
            group = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
            counts[group] = counts.get(group, 0) + tree_size(subtree)
        counts["total"] = sum(counts.values())
        return counts

    def params_read_per_token(self, batch: int = 1) -> Dict[str, int]:
        """Parameters one decode step of ``batch`` sequences must stream from memory, by part
        (plus ``'total'``): the decoder's layers as their injected classes read them (each weight
        once per step; of the rows a sparse layer selects per sequence, their expected union,
        see ``layer_reads``), its final norm, each sequence's token embedding row and the one
        positional row they share (the sequences decode in step), and the logits layer. Batch 1
        (the default): what one decoded token reads."""
        params = self.abstract_params()
        parts = dict.fromkeys(READ_PARTS, 0)
        self.add_decoder_reads(params, parts, batch)
        parts["norms"] += tree_size(params["decoder_norm"])
        # The tokens' embedding rows (sequences sharing a token would share its row: an upper
        # bound) and the positional row.
        parts["embedding rows"] = (batch + 1) * self.config.d_model
        parts["logits"] = layer_reads(self.module.logits_layer, params["logits"], batch)
        parts["total"] = sum(parts.values())
        return parts

    @abc.abstractmethod
    def add_decoder_reads(self, params: Params, parts: Dict[str, int], batch: int = 1) -> None:
        """Adds what one decode step of ``batch`` sequences reads of each decoder layer to
        ``parts`` (by part name; ``layer_reads``)."""

    # ----- training and scoring ---------------------------------------------------------
    def decoder_input_tokens(self, batch: Batch) -> jax.Array:
        """``batch['decoder_input_tokens']``, or the targets shifted right with the pad id first."""
        if "decoder_input_tokens" in batch:
            return batch["decoder_input_tokens"]
        return shift_right(batch["decoder_target_tokens"], self.config.pad_id)

    def logits(self, params: Params, batch: Batch, *, dropout_rng: Optional[jax.Array] = None) -> jax.Array:
        """Teacher-forced logits ``[batch, target_length, vocab]``; dropout on iff a
        ``dropout_rng`` is given."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        return self.module.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            self.decoder_input_tokens(batch),
            batch.get("encoder_mask"),
            deterministic=dropout_rng is None,
            rngs=rngs,
        )

    def loss_fn(self, params: Params, batch: Batch, dropout_rng: Optional[jax.Array] = None) -> Tuple[jax.Array, Dict]:
        """Mean weighted cross-entropy per target token, and summable metrics (``loss_sum``,
        ``weight_sum``, ``correct``)."""
        logits = self.logits(params, batch, dropout_rng=dropout_rng)
        targets = batch["decoder_target_tokens"]
        weights = losses.target_weights(targets, batch.get("decoder_loss_weights"), pad_id=self.config.pad_id)
        loss_sum, weight_sum = losses.weighted_cross_entropy(logits, targets, weights)
        correct = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
        loss = loss_sum / jnp.maximum(weight_sum, 1.0)
        return loss, {"loss_sum": loss_sum, "weight_sum": weight_sum, "correct": correct}

    def eval_metrics(self, params: Params, batch: Batch) -> Dict[str, jax.Array]:
        """Summable metrics without dropout: NLL and token counts, correct tokens and fully
        correct sequences (``terra.models.losses.evaluation_sums``, with this model's pad id)."""
        logits = self.logits(params, batch)
        return losses.evaluation_sums(
            logits, batch["decoder_target_tokens"], batch.get("decoder_loss_weights"), pad_id=self.config.pad_id
        )

    def score(self, params: Params, batch: Batch) -> jax.Array:
        """``[batch]`` log-likelihood (nats) of each row's weighted target tokens, no dropout."""
        logits = self.logits(params, batch)
        targets = batch["decoder_target_tokens"]
        weights = losses.target_weights(targets, batch.get("decoder_loss_weights"), pad_id=self.config.pad_id)
        return -jnp.sum(losses.token_cross_entropy(logits, targets) * weights, axis=-1)

    @functools.cached_property
    def _jit_eval_metrics(self):
        return jax.jit(self.eval_metrics)

    def loss_sums(self, params: Params, batch: Batch) -> Dict[str, float]:
        """:meth:`eval_metrics` of a batch as Python floats; jitted once per shape."""
        return {k: float(v) for k, v in jax.device_get(self._jit_eval_metrics(params, dict(batch))).items()}

    def log_perplexity(self, params: Params, batch: Batch) -> float:
        """Mean negative log-likelihood (nats) per non-pad target token, no dropout."""
        metrics = self.loss_sums(params, batch)
        return metrics["loss_sum"] / max(metrics["weight_sum"], 1.0)

    # ----- decoding ---------------------------------------------------------------------
    def decoder(self, max_decode_length: int) -> IncrementalDecoder:
        """The jitted prefill/step pair for a cache of ``max_decode_length`` tokens (cached, so
        each length compiles once; a decoder asked for inside ``native_kernels.disabled()`` or
        ``unfused()`` is another, since the kernels are chosen when it is traced)."""
        return self._decoder(max_decode_length, native_kernels.traced_choice())

    @functools.lru_cache(maxsize=8)  # noqa: B019  (models live as long as their compiled decoders should)
    def _decoder(self, max_decode_length: int, kernels: tuple) -> IncrementalDecoder:
        return IncrementalDecoder(self.module, max_decode_length)

    def generate(
        self,
        params: Params,
        encoder_input_tokens,
        *,
        max_decode_length: int,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        num_beams: int = 1,
        length_penalty: float = 0.0,
        seed: int = 0,
        encoder_mask=None,
        stream=None,
        repetition_penalty: float = 1.0,
        no_repeat_ngram_size: int = 0,
        return_scores: bool = False,
    ) -> Generation:
        """Generate up to ``max_decode_length`` tokens per row, stopping each row at EOS.

        ``num_beams == 1``: greedy (``temperature == 0``) or sampling at ``temperature``,
        optionally from the ``top_k`` most likely tokens or the ``top_p`` nucleus.
        ``num_beams > 1``: beam search (deterministic; ``temperature``/``top_k``/``top_p``
        must be left at their defaults), ranked by log-likelihood over the GNMT length
        penalty ``((5 + length) / 6) ** length_penalty``. ``stream``: each step's tokens handed to
        the host as the loop chooses them (``terra.decoding.generate``; not with beam search, whose
        beams are only ranked at the end). ``repetition_penalty``, ``no_repeat_ngram_size`` and
        ``return_scores``: see ``terra.decoding.generate`` (not with beam search).
        """
        if num_beams < 1:
            raise ValueError(f"num_beams={num_beams} must be >= 1.")
        if num_beams > 1 and stream is not None:
            raise ValueError("a stream hands over each chosen token: beam search ranks its beams at the end.")
        if num_beams > 1 and (repetition_penalty != 1 or no_repeat_ngram_size or return_scores):
            raise ValueError(
                "repetition_penalty, no_repeat_ngram_size and return_scores act on the sampling loop: use num_beams=1."
            )
        decoder = self.decoder(max_decode_length)
        if num_beams > 1:
            if temperature or top_k is not None or top_p is not None:
                raise ValueError(
                    "beam search is deterministic: leave temperature, top_k and top_p unset with num_beams > 1."
                )
            result = beam_search(
                decoder,
                params,
                encoder_input_tokens,
                encoder_mask=encoder_mask,
                num_beams=num_beams,
                eos_id=self.config.eos_id,
                pad_id=self.config.pad_id,
                length_penalty=length_penalty,
            )
            return Generation(tokens=result.tokens, lengths=result.lengths)
        return generate(
            decoder,
            params,
            encoder_input_tokens,
            encoder_mask=encoder_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_id=self.config.eos_id,
            pad_id=self.config.pad_id,
            stream=stream,
            repetition_penalty=repetition_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size,
            return_scores=return_scores,
        )


class EncoderDecoderModel(Seq2SeqModel):
    """The Scaling Transformer's encoder-decoder (``EncoderDecoderTransformer``), dense or sparse.

    Args:
      module: the network (default: the paper's 800M dense baseline, ``TransformerConfig()``).
    """

    module_type = EncoderDecoderTransformer

    def default_module(self) -> nn.Module:
        return EncoderDecoderTransformer(TransformerConfig())

    def layer_stacks(self) -> Tuple[LayerStack, ...]:
        cfg = self.config
        return (
            LayerStack((), "encoder_", 1, cfg.n_encoder_layers),
            LayerStack((), "decoder_", 1, cfg.n_decoder_layers),
        )

    def add_decoder_reads(self, params: Params, parts: Dict[str, int], batch: int = 1) -> None:
        # Every decoder layer reads its three sub-layers as their injected classes read them;
        # the encoder-decoder keys and values are cached at prefill, only Q and O are read.
        module = self.module
        layer_factories = {
            "self_attention": ("decoder self-attention", module.decoder_self_attention),
            "cross_attention": ("encoder-decoder attention", module.encoder_decoder_attention),
            "feed_forward": ("feed-forward", module.feed_forward),
        }
        for index in range(self.config.n_decoder_layers):
            for sub, sub_params in params[f"decoder_{index}"].items():
                part, factory = layer_factories.get(sub, ("norms", None))
                parts[part] += layer_reads(factory, sub_params, batch) if factory else tree_size(sub_params)


class TerraformerModel(Seq2SeqModel):
    """The Terraformer (``Terraformer``): reversible blocks, SRU feed-forward, dense or LSH attention.

    Args:
      module: the network (default: ``Terraformer(TransformerConfig())``).
    """

    module_type = Terraformer

    def default_module(self) -> nn.Module:
        return Terraformer(TransformerConfig())

    def layer_stacks(self) -> Tuple[LayerStack, ...]:
        # ReversibleStack names its halves layer_{i}: an encoder block is an attention and a
        # feed-forward half, a decoder block n_decoder_attention_layers attentions and one.
        cfg, period = self.config, self.module.n_decoder_attention_layers + 1
        return (
            LayerStack(("encoder_stack",), "layer_", 2, 2 * cfg.n_encoder_layers),
            LayerStack(("decoder_stack",), "layer_", period, period * cfg.n_decoder_layers),
        )

    def add_decoder_reads(self, params: Params, parts: Dict[str, int], batch: int = 1) -> None:
        # Per block, n_decoder_attention_layers attention half-residuals then one
        # FeedForwardWithSRU: its feed-forward read as the injected layer reads it, its norm
        # and SRU branch whole.
        module = self.module
        period = module.n_decoder_attention_layers + 1
        for name, half in params["decoder_stack"].items():
            index = int(name.rsplit("_", 1)[1])
            parts["norms"] += tree_size(half.get("norm", {}))
            layer = half["layer"]
            if index % period < module.n_decoder_attention_layers:
                parts["decoder self-attention"] += layer_reads(module.decoder_attention, layer, batch)
                continue
            for sub, sub_params in layer.items():
                if sub == "feed_forward":
                    parts["feed-forward"] += layer_reads(module.feed_forward, sub_params, batch)
                elif sub == "sru":
                    parts["feed-forward"] += tree_size(sub_params)
                else:
                    parts["norms"] += tree_size(sub_params)


FAMILIES = (EncoderDecoderModel, TerraformerModel)


def _family_for(module: nn.Module) -> str:
    for family in FAMILIES:
        if isinstance(module, family.module_type):
            return family.__name__
    return "<a model class for it>"

"""The decode contract every terra model implements, compiled once per shape.

  prefill(params, encoder_input_tokens[, encoder_mask]) -> cache
  step(params, cache, token) -> (logits, cache)

``token`` is ``[batch]`` int32: the previously emitted token (the start token 0 on the first
step); ``logits`` is ``[batch, vocab]`` float32 for the next position. ``step`` donates the
cache, so XLA updates the KV caches in place instead of copying them every token. Both the
generation loop and the decode-speed benchmark drive this same ``step``.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

Cache = Any


class IncrementalDecoder:
    """Jitted prefill/step for a module exposing ``prefill_cache`` and ``decode``.

    Args:
      module: the Flax model (e.g. ``EncoderDecoderTransformer``).
      max_decode_length: the self-attention cache length, i.e. the most tokens ``step`` can
        be called for after one ``prefill``.
    """

    def __init__(self, module, max_decode_length: int):
        if max_decode_length <= 0:
            raise ValueError(f"max_decode_length={max_decode_length} must be positive.")
        max_len = getattr(getattr(module, "config", None), "max_len", None)
        if max_len is not None and max_decode_length > max_len:
            raise ValueError(
                f"max_decode_length={max_decode_length} exceeds the model's positional table "
                f"(TransformerConfig.max_len={max_len}); decode fewer tokens or raise max_len."
            )
        self.module = module
        self.max_decode_length = max_decode_length
        self.prefill = jax.jit(self._prefill)
        self.step = jax.jit(self._step, donate_argnums=(1,))

    def _prefill(self, params, encoder_input_tokens: jax.Array, encoder_mask: Optional[jax.Array] = None) -> Cache:
        _, variables = self.module.apply(
            {"params": params},
            encoder_input_tokens,
            encoder_mask,
            max_decode_length=self.max_decode_length,
            method=self.module.prefill_cache,
            mutable=["cache"],
        )
        return variables["cache"]

    def _step(self, params, cache: Cache, token: jax.Array):
        logits, variables = self.module.apply(
            {"params": params, "cache": cache},
            token.astype(jnp.int32)[:, None],
            decode=True,
            method=self.module.decode,
            mutable=["cache"],
        )
        return logits[:, 0, :], variables["cache"]

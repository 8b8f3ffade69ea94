"""The decode contract every terra model implements, compiled once per shape.

  prefill(params, encoder_input_tokens[, encoder_mask]) -> cache
  step(params, cache, token) -> (logits, cache)

``token`` is ``[batch]`` int32: the previously emitted token (the start token 0 on the first
step); ``logits`` is ``[batch, vocab]`` float32 for the next position. ``step`` donates the
cache, so XLA updates the KV caches in place instead of copying them every token.

``generate_tokens`` runs ``step`` and the token choice inside one jitted ``while_loop``, so a
sequence pays the host's per-call work (flattening and checking some 900 parameter and cache
arrays at the 800M widths, then a host round trip for the next token) once instead of per
token; the decode-speed benchmark times both ways (docs/decode_speed.md). A caller that drives
the decode a token at a time from the host (the paper's timing protocol, a server streaming
tokens) uses ``start`` instead of ``step``: its ``DecodeSession`` runs the same step inside one
jitted loop that takes each token from the host, so a call costs the loop's step.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from terra.decoding import streaming
from terra.decoding.decode_session import DecodeSession, session_loop
from terra.decoding.sampling import banned_ngram_tokens, penalize_repetitions, sample_next_token

Cache = Any


class IncrementalDecoder:
    """Jitted prefill/step for a module exposing ``prefill_cache`` and ``decode_step``.

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
        self.prefill = jax.jit(self.prefill_fn)
        self.step = jax.jit(self.step_fn, donate_argnums=(1,))
        self._generate_tokens_jit = jax.jit(self._generate_tokens, donate_argnums=(1,))
        self._session_loops = {}  # (batch, native exchange) -> the jitted loop of DecodeSession
        self._logits_widths = {}  # batch -> step's vocabulary width

    def checked_new_tokens(self, max_new_tokens: Optional[int]) -> int:
        """``max_new_tokens`` (default: the cache length), checked to fit the cache."""
        max_new_tokens = self.max_decode_length if max_new_tokens is None else max_new_tokens
        if not 0 < max_new_tokens <= self.max_decode_length:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} must be in [1, {self.max_decode_length}] "
                "(the decoder's max_decode_length)."
            )
        return max_new_tokens

    def prefill_fn(self, params, encoder_input_tokens: jax.Array, encoder_mask: Optional[jax.Array] = None) -> Cache:
        """The function ``prefill`` compiles, for callers that trace it inside their own jit
        (beam search): ``[batch, input_length]`` tokens -> the filled cache."""
        _, variables = self.module.apply(
            {"params": params},
            encoder_input_tokens,
            encoder_mask,
            max_decode_length=self.max_decode_length,
            method=self.module.prefill_cache,
            mutable=["cache"],
        )
        return variables["cache"]

    def step_fn(self, params, cache: Cache, token: jax.Array):
        """The function ``step`` compiles: ``[batch]`` tokens -> ``([batch, vocab] logits, cache)``."""
        logits, variables = self.module.apply(
            {"params": params, "cache": cache},
            token.astype(jnp.int32)[:, None],
            method=self.module.decode_step,
            mutable=["cache"],
        )
        return logits[:, 0, :], variables["cache"]

    def start(self, params, encoder_input_tokens: jax.Array, encoder_mask: Optional[jax.Array] = None):
        """Prefills and returns a running ``DecodeSession``: one call per token at the cost of the
        generation loop's step (``session.step(token) -> logits``; see
        ``terra.decoding.decode_session``)."""
        return DecodeSession(self, params, self.prefill(params, encoder_input_tokens, encoder_mask))

    def session_loop(self, batch: int, native: bool):
        """The jitted loop ``DecodeSession``s of ``batch`` rows run (``decode_session.session_loop``;
        ``native``: through the native kernels' exchange), built once and shared by them."""
        loop = self._session_loops.get((batch, native))
        if loop is None:
            loop = self._session_loops[(batch, native)] = session_loop(self, batch, native)
        return loop

    def logits_width(self, params, cache, batch: int) -> int:
        """The vocabulary width of ``step``'s logits for this cache (a trace, once per batch size)."""
        width = self._logits_widths.get(batch)
        if width is None:
            token = jax.ShapeDtypeStruct((batch,), jnp.int32)
            logits, _ = jax.eval_shape(self.step_fn, params, cache, token)
            width = self._logits_widths[batch] = int(logits.shape[-1])
        return width

    def generate_tokens(
        self,
        params,
        cache: Cache,
        token,
        rng,
        max_new_tokens,
        temperature,
        eos_id,
        pad_id,
        top_k=0,
        top_p=1.0,
        stream_id=None,
        controls: Optional["Controls"] = None,
    ):
        """Up to ``max_new_tokens`` steps in one jitted ``while_loop`` (the cache donated),
        stopping early once every row has emitted ``eos_id`` (a row's tokens after its EOS are
        ``pad_id``).

        Args: ``token`` ``[batch]`` int32, the start token; ``rng`` the sampling key, split once
        per step; ``max_new_tokens``, ``temperature``, ``eos_id``, ``pad_id``, ``top_k``,
        ``top_p`` scalars, traced as int32 / float32 whatever the caller passes, so one
        compilation serves them all (``temperature == 0`` is greedy; ``top_k=0`` and
        ``top_p=1`` turn those filters off, see ``sampling.filter_logits``).

        ``stream_id``: the ``operand`` of a stream of ``terra.decoding.streaming``
        (``open_stream``), handed each step's tokens as they are chosen, which may end the loop;
        the same loop with one hand-over per step, compiled once for every stream.

        ``controls``: a :class:`Controls` (the repetition penalty and the n-gram ban, traced
        scalars) makes the loop apply them to each step's logits before the choice, and return
        each chosen token's log-probability too; None is the loop without them.

        Returns ``(tokens [batch, max_decode_length] int32, steps, cache)``: the first ``steps``
        columns were generated, the rest are ``pad_id``; with ``controls``, ``(tokens, steps,
        cache, scores)``, ``scores [batch, max_decode_length]`` float32 the log-probability of each
        token under the model's own distribution (0 after a row's EOS).
        """
        return self._generate_tokens_jit(
            params,
            cache,
            token,
            rng,
            jnp.int32(max_new_tokens),
            jnp.float32(temperature),
            jnp.int32(eos_id),
            jnp.int32(pad_id),
            jnp.int32(top_k),
            jnp.float32(top_p),
            None if stream_id is None else jnp.int32(stream_id),
            None if controls is None else controls.traced(),
        )

    def _generate_tokens(
        self,
        params,
        cache: Cache,
        token,
        rng,
        max_new_tokens,
        temperature,
        eos_id,
        pad_id,
        top_k,
        top_p,
        stream_id=None,
        controls=None,
    ):
        """The loop ``generate_tokens`` jits; ``stream_id`` or ``controls`` None traces it without
        the stream's callback or the controls (a pytree without leaves: jit keeps one program for
        each)."""
        batch = token.shape[0]
        tokens = jnp.full((batch, self.max_decode_length), pad_id, jnp.int32)
        extra = ()
        if controls is not None:  # the tokens each row has chosen, and their log-probabilities
            vocab = self.logits_width(params, cache, batch)
            extra = (jnp.zeros((batch, vocab), bool), jnp.zeros((batch, self.max_decode_length), jnp.float32))

        def keep_going(carry):
            i, _, _, done, _, _, _ = carry
            return (i < max_new_tokens) & ~jnp.all(done)

        def one_token(carry):
            i, cache, token, done, rng, tokens, extra = carry
            logits, cache = self.step_fn(params, cache, token)
            rng, sample_rng = jax.random.split(rng)
            chosen_from = logits if controls is None else controls.apply(logits, extra[0], tokens, i)
            token = jnp.where(done, pad_id, sample_next_token(chosen_from, sample_rng, temperature, top_k, top_p))
            if controls is not None:
                seen, scores = extra
                log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                score = jnp.where(done, 0.0, jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0])
                scores = jax.lax.dynamic_update_slice(scores, score[:, None], (0, i))
                seen = seen.at[jnp.arange(batch), token].set(True)
                extra = (seen, scores)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
            done = done | (token == eos_id)
            if stream_id is not None:  # the host may end the loop: every row is then done
                done = done | streaming.hand_over(stream_id, i, token)
            return i + 1, cache, token, done, rng, tokens, extra

        start = (jnp.int32(0), cache, token.astype(jnp.int32), jnp.zeros((batch,), bool), rng, tokens, extra)
        steps, cache, _, _, _, tokens, extra = jax.lax.while_loop(keep_going, one_token, start)
        if controls is None:
            return tokens, steps, cache
        return tokens, steps, cache, extra[1]


class Controls(NamedTuple):
    """What ``generate_tokens`` applies to each step's logits before the choice, as Hugging Face's
    logits processors do: ``repetition_penalty`` (1: off; the CTRL penalty of the tokens a row has
    generated, ``sampling.penalize_repetitions``) and ``no_repeat_ngram_size`` (0: off; a token
    that would repeat an n-gram of the row is never chosen, ``sampling.banned_ngram_tokens``).
    Traced scalars: one compiled loop serves every value."""

    repetition_penalty: Any = 1.0
    no_repeat_ngram_size: Any = 0

    def traced(self) -> "Controls":
        return Controls(jnp.float32(self.repetition_penalty), jnp.int32(self.no_repeat_ngram_size))

    def apply(self, logits, seen, tokens, step):
        logits = penalize_repetitions(logits, seen, self.repetition_penalty)
        n = self.no_repeat_ngram_size
        banned = jax.lax.cond(
            n > 0,
            lambda: banned_ngram_tokens(tokens, step, n, logits.shape[-1]),
            lambda: jnp.zeros(logits.shape, bool),
        )
        return jnp.where(banned, -jnp.inf, logits)

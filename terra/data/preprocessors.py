"""seqio preprocessors for Terraformer pretraining and fine-tuning, written in TF ops.

The paper ("Sparse is Enough in Scaling Transformers", Jaszczur et al., 2021) pretrains every
model on C4 (§4.4, appendix 6.5); its code uses T5's span corruption (15% noise, mean span 3,
``docs/design/reference_code.md`` §5.1), and for Terraformer the paper says "we mask single words" (mean
span 1). It then fine-tunes on arXiv summarization. Those preprocessors live in the ``t5``
package, which cannot be installed next to our pinned tensorflow/seqio, so this module
reimplements the same semantics:

* ``random_spans_noise_mask``: ``round(length * noise_density)`` noise tokens (at least 1, at
  most ``length - 1``) in ``round(num_noise_tokens / mean_noise_span_length)`` spans (at least
  1); the noise and non-noise span lengths are each a uniformly random composition into that many
  positive parts, interleaved starting with a non-noise span, so a mask never starts with noise
  (and, for ``length >= 2``, always ends with it).
* ``span_corruption``: documents are cut into chunks of ``tokens_length`` tokens (chosen by
  ``span_corruption_lengths`` so that the corrupted inputs plus EOS fit ``sequence_length
  ["inputs"]``, T5's rule; or a fixed ``chunk_length``, the paper's code's rule), every noise
  span in the inputs is replaced by one sentinel, and the targets are
  the noise spans, each preceded by its sentinel. Sentinels count down from the top of the
  vocabulary (``vocab_size - 1`` for the first span, which is ``<extra_id_0>`` for a
  ``SentencePieceVocabulary(extra_ids=100)``).
* ``prefix_lm`` / ``full_lm``: language-modelling examples from the same chunked documents.
* ``summarization``: CNN/DailyMail / arXiv examples rekeyed to ``inputs``/``targets`` with one
  abstract sentence per line, which is what ROUGE-Lsum splits on.

seqio calls a preprocessor with the dataset and, when the function's signature names them, the
``sequence_length`` and ``output_features`` keyword arguments. Random steps are decorated with
``seqio.map_over_dataset(num_seeds=1)``: within ``Task.get_dataset(seed=...)`` seqio's
``map_seed_manager`` hands each such step its own deterministic stateless seed, so the same task
seed reproduces the same corruption; with no task seed the corruption is non-deterministic.

Usage in a task (T5's ``c4_v220_span_corruption`` layout)::

    preprocessors=[
        functools.partial(seqio.preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
        seqio.preprocessors.tokenize,
        terra.data.preprocessors.span_corruption,
        seqio.preprocessors.append_eos_after_trim,
    ]

Every public preprocessor is registered with gin under ``terra.data``, e.g. a config can write
``terra.data.span_corruption.mean_noise_span_length = 1.0``.
"""

from typing import Any, Mapping, Optional, Sequence, Tuple

import seqio
import tensorflow as tf

from terra.errors import ConfigError

__all__ = [
    "random_spans_noise_mask",
    "span_corruption_lengths",
    "chunk_corruption_lengths",
    "span_corruption",
    "single_word_masking",
    "split_tokens",
    "concatenate_and_split",
    "prefix_lm",
    "full_lm",
    "summarization",
]


# ---------------------------------------------------------------------------------------------
# Noise mask
# ---------------------------------------------------------------------------------------------


def _check_noise_args(noise_density: float, mean_noise_span_length: float) -> None:
    if not 0.0 < noise_density < 1.0:
        raise ConfigError(
            f"noise_density={noise_density!r} must lie strictly between 0 and 1 "
            "(the fraction of tokens masked; the paper and T5 use 0.15)."
        )
    if not mean_noise_span_length >= 1.0:
        raise ConfigError(
            f"mean_noise_span_length={mean_noise_span_length!r} must be at least 1 (a span has at "
            "least one token); use 3.0 for span corruption or 1.0 to mask single words."
        )


def _noise_counts(length: int, noise_density: float, mean_noise_span_length: float) -> Tuple[int, int]:
    """Python twin of the counts ``random_spans_noise_mask`` uses: (noise tokens, noise spans).

    Python's ``round`` and ``tf.round`` both round half to even, and both sides compute in float64,
    so the lengths predicted by ``span_corruption_lengths`` are exactly the ones the mask produces.
    """
    if length < 2:
        return 0, 0
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = int(round(num_noise / mean_noise_span_length))
    num_spans = min(max(num_spans, 1), num_noise, length - num_noise)
    return num_noise, num_spans


def _random_composition(total: tf.Tensor, num_parts: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Lengths of ``num_parts`` positive parts summing to ``total``, uniformly at random.

    A composition is fixed by its ``num_parts - 1`` cut points among the ``total - 1`` gaps between
    items; taking the top-k of i.i.d. uniform scores picks a uniformly random k-subset of gaps.
    """
    scores = tf.random.stateless_uniform([total - 1], seed=seed)
    cuts = tf.sort(tf.math.top_k(scores, k=num_parts - 1, sorted=False).indices + 1)
    bounds = tf.concat([[0], cuts, [total]], axis=0)
    return bounds[1:] - bounds[:-1]


def _as_seed_pair(seeds) -> Tuple[tf.Tensor, tf.Tensor]:
    """Accepts one stateless seed (shape [2]) or two (shape [2, 2] / a pair of seeds)."""
    seeds = tf.convert_to_tensor(seeds)
    if seeds.dtype not in (tf.int32, tf.int64):
        seeds = tf.cast(seeds, tf.int64)
    if seeds.shape.rank == 1:
        # One seed in (what map_over_dataset(num_seeds=1) supplies): derive two independent ones.
        seeds = tf.random.experimental.stateless_split(seeds, num=2)
    return seeds[0], seeds[1]


def random_spans_noise_mask(length, noise_density: float, mean_noise_span_length: float, seeds) -> tf.Tensor:
    """Boolean mask of shape ``[length]`` marking noise tokens in random spans (T5's semantics).

    Args:
      length: number of tokens (Python int or scalar int tensor).
      noise_density: fraction of tokens that are noise; exactly ``round(length * noise_density)``
        tokens are, clipped to ``[1, length - 1]``.
      mean_noise_span_length: average noise span length; there are
        ``round(num_noise_tokens / mean_noise_span_length)`` spans (at least 1).
      seeds: stateless seed(s): one int seed of shape [2] (split into two internally) or two,
        shape [2, 2]; the first draws the noise span lengths, the second the non-noise ones.

    Returns:
      ``tf.bool`` tensor; the mask starts with a non-noise span and alternates, so for
      ``length >= 2`` it ends with a noise span. For ``length < 2`` it is all False.
      Deterministic for given seeds.
    """
    _check_noise_args(noise_density, mean_noise_span_length)
    noise_seed, nonnoise_seed = _as_seed_pair(seeds)
    length = tf.cast(tf.convert_to_tensor(length), tf.int32)
    # At least 2 tokens are needed for one non-noise and one noise span; shorter inputs get an
    # all-False mask via the same code path (computed for 2 tokens, then cut back).
    work_length = tf.maximum(length, 2)

    # float64 + half-to-even rounding, exactly like the Python helper `_noise_counts`.
    num_noise = tf.cast(tf.round(tf.cast(work_length, tf.float64) * noise_density), tf.int32)
    num_noise = tf.clip_by_value(num_noise, 1, work_length - 1)
    num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float64) / mean_noise_span_length), tf.int32)
    num_spans = tf.minimum(tf.maximum(num_spans, 1), tf.minimum(num_noise, work_length - num_noise))

    noise_lengths = _random_composition(num_noise, num_spans, noise_seed)
    nonnoise_lengths = _random_composition(work_length - num_noise, num_spans, nonnoise_seed)
    # [nonnoise_0, noise_0, nonnoise_1, noise_1, ...]: odd-numbered spans are noise.
    span_lengths = tf.reshape(tf.stack([nonnoise_lengths, noise_lengths], axis=1), [-1])
    span_ends = tf.cumsum(span_lengths)
    span_index = tf.searchsorted(span_ends, tf.range(work_length), side="right")
    mask = tf.equal(span_index % 2, 1)
    # For length < 2 the first (non-noise) span covers what is kept, hence all False.
    return mask[:length]


# ---------------------------------------------------------------------------------------------
# Span corruption
# ---------------------------------------------------------------------------------------------


def span_corruption_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> Tuple[int, int]:
    """How many raw tokens to corrupt so the inputs fill ``inputs_length``; and the targets length.

    After corruption a chunk of ``n`` tokens becomes ``n - noise + spans + 1`` input tokens
    (non-noise tokens, one sentinel per noise span, EOS) and ``noise + spans + 1`` target tokens
    (noise tokens, one sentinel per span, EOS). This returns the largest ``tokens_length`` whose
    inputs fit (the input length never decreases as ``n`` grows, so shorter chunks fit too) and
    the targets length that chunk needs. T5 calls this ``random_spans_helper``; for inputs 512,
    density 0.15 and mean span 3 it gives (568, 114), and for mean span 1 (511, 155). (T5's extra
    tweak for ``noise_density == 0.5``, shaving a token to make targets equal inputs, is omitted.)
    """
    _check_noise_args(noise_density, mean_noise_span_length)
    if inputs_length < 2:
        raise ConfigError(
            f"span corruption needs sequence_length['inputs'] >= 2 (one token plus EOS); got {inputs_length}."
        )
    tokens_length = 1
    while _corrupted_lengths(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    return tokens_length, _corrupted_lengths(tokens_length, noise_density, mean_noise_span_length)[1]


def _corrupted_lengths(tokens_length: int, noise_density: float, mean_noise_span_length: float) -> Tuple[int, int]:
    """(inputs, targets) lengths, EOS included, of a corrupted chunk of ``tokens_length`` tokens."""
    if tokens_length < 2:  # a lone token stays in the inputs; the targets are one sentinel
        return tokens_length + 1, 2
    num_noise, num_spans = _noise_counts(tokens_length, noise_density, mean_noise_span_length)
    return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1


def chunk_corruption_lengths(
    chunk_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> Tuple[int, int]:
    """The longest (inputs, targets), EOS included, that span corruption makes of chunks of at
    most ``chunk_length`` tokens: the lengths a task must give when it cuts fixed chunks, as the
    paper's code does (512-token chunks: inputs up to 462, targets up to 104 at 0.15 / 3;
    ``docs/design/reference_code.md`` §5.1)."""
    _check_noise_args(noise_density, mean_noise_span_length)
    if chunk_length < 1:
        raise ConfigError(f"span corruption needs a positive chunk_length; got {chunk_length}.")
    lengths = [_corrupted_lengths(n, noise_density, mean_noise_span_length) for n in range(1, chunk_length + 1)]
    return max(i for i, _ in lengths), max(t for _, t in lengths)


def _spans_to_sentinels(tokens: tf.Tensor, marked: tf.Tensor, vocab_size: int) -> tf.Tensor:
    """Replaces each run of marked tokens by one sentinel: vocab_size - 1, vocab_size - 2, ..."""
    previous = tf.concat([[False], marked[:-1]], axis=0)
    span_starts = tf.logical_and(marked, tf.logical_not(previous))
    span_number = tf.cumsum(tf.cast(span_starts, tokens.dtype))  # 1 for the first span
    sentinels = tf.cast(vocab_size, tokens.dtype) - span_number
    replaced = tf.where(span_starts, sentinels, tokens)
    return tf.boolean_mask(replaced, tf.logical_or(tf.logical_not(marked), span_starts))


@seqio.map_over_dataset(num_seeds=1)
def _corrupt_spans(
    features,
    seed,
    *,
    vocab_size: int,
    noise_density: float,
    mean_noise_span_length: float,
    input_feature_key: str,
    target_key: str,
):
    tokens = features[target_key]
    mask = random_spans_noise_mask(tf.size(tokens), noise_density, mean_noise_span_length, seed)
    out = dict(features)
    # Inputs: noise spans -> sentinels. Targets: non-noise spans -> sentinels (T5's
    # nonnoise_span_to_unique_sentinel). The k-th non-noise span comes right before the k-th noise
    # span, so the targets read "<s_k> noise span k" with the sentinel the inputs use for that span.
    # Since the mask ends with noise there is no trailing sentinel (except the degenerate 1-token
    # chunk, whose targets are a single sentinel, as in T5).
    out[input_feature_key] = _spans_to_sentinels(tokens, mask, vocab_size)
    out[target_key] = _spans_to_sentinels(tokens, tf.logical_not(mask), vocab_size)
    return out


def _vocab_size(output_features: Optional[Mapping[str, Any]], key: str, caller: str) -> int:
    if not output_features or key not in output_features:
        raise ConfigError(
            f"{caller} needs output_features[{key!r}] (its vocabulary gives the sentinel ids); "
            f"got features {sorted(output_features or {})}. Run it inside a seqio.Task, which passes "
            "output_features, or pass them explicitly."
        )
    return int(output_features[key].vocabulary.vocab_size)


def _required_length(sequence_length: Optional[Mapping[str, Optional[int]]], key: str, caller: str) -> int:
    if not sequence_length or sequence_length.get(key) is None:
        raise ConfigError(
            f"{caller} needs sequence_length[{key!r}]; got {sequence_length!r}. Pass sequence_length "
            "to Task.get_dataset (e.g. {'inputs': 512, 'targets': 114})."
        )
    return int(sequence_length[key])


def span_corruption(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, Any],
    *,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    input_feature_key: str = "inputs",
    target_key: str = "targets",
    passthrough_feature_keys: Sequence[str] = (),
    chunk_length: Optional[int] = None,
) -> tf.data.Dataset:
    """T5 span corruption (the C4 pretraining objective of the paper's code, §4.4).

    Expects tokenized documents in ``features[target_key]`` (rank-1 int tokens, e.g. after
    ``rekey({"inputs": None, "targets": "text"})`` and ``seqio.preprocessors.tokenize``). Each
    document is split into chunks of ``chunk_length`` tokens, by default (None) T5's: the longest
    whose corrupted inputs fill ``sequence_length["inputs"]`` (``span_corruption_lengths``; 568
    for 512 inputs). The paper's code cuts chunks as long as the inputs instead (512, so its
    corrupted inputs are about 462 tokens and padded; ``docs/design/reference_code.md`` §5.1). Each
    chunk becomes one example:

    * ``inputs``: the chunk with every noise span replaced by one sentinel,
    * ``targets``: each noise span preceded by the same sentinel,

    sentinels counting down from ``vocab_size - 1`` of ``output_features[target_key]``'s vocabulary.
    EOS is *not* added here: follow this with ``seqio.preprocessors.append_eos_after_trim`` (the
    lengths reserve one slot for it in both features). Features other than ``target_key`` and
    ``passthrough_feature_keys`` are dropped (they cannot be split along with the tokens).

    seqio passes ``sequence_length`` and ``output_features``; the rest are gin-bindable.

    Raises:
      ConfigError: if ``sequence_length[target_key]`` is shorter than the targets need, or a
        ``chunk_length`` chunk's corrupted inputs do not fit ``sequence_length[input_feature_key]``.
    """
    _check_noise_args(noise_density, mean_noise_span_length)
    inputs_length = _required_length(sequence_length, input_feature_key, "span_corruption")
    vocab_size = _vocab_size(output_features, target_key, "span_corruption")
    if chunk_length is None:
        tokens_length, targets_length = span_corruption_lengths(inputs_length, noise_density, mean_noise_span_length)
        settings = f"sequence_length[{input_feature_key!r}]={inputs_length}"
    else:
        tokens_length = chunk_length
        needed_inputs, targets_length = chunk_corruption_lengths(chunk_length, noise_density, mean_noise_span_length)
        settings = f"chunk_length={chunk_length}"
        if needed_inputs > inputs_length:
            raise ConfigError(
                f"span_corruption with chunk_length={chunk_length}, noise_density={noise_density} and "
                f"mean_noise_span_length={mean_noise_span_length} produces inputs of up to {needed_inputs} "
                f"tokens (with EOS), but sequence_length[{input_feature_key!r}]={inputs_length}; set the inputs "
                f"length to at least {needed_inputs} or shorten the chunks."
            )
    available = sequence_length.get(target_key)
    if available is not None and available < targets_length:
        raise ConfigError(
            f"span_corruption with {settings}, "
            f"noise_density={noise_density} and mean_noise_span_length={mean_noise_span_length} "
            f"produces targets of up to {targets_length} tokens (with EOS), but "
            f"sequence_length[{target_key!r}]={available}; set the targets length to at least "
            f"{targets_length} (or lower the inputs length / noise density)."
        )
    dataset = split_tokens(
        dataset,
        max_tokens_per_segment=tokens_length,
        feature_key=target_key,
        passthrough_feature_keys=passthrough_feature_keys,
    )
    return _corrupt_spans(
        dataset,
        vocab_size=vocab_size,
        noise_density=noise_density,
        mean_noise_span_length=mean_noise_span_length,
        input_feature_key=input_feature_key,
        target_key=target_key,
    )


def single_word_masking(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, Any],
    *,
    noise_density: float = 0.15,
    input_feature_key: str = "inputs",
    target_key: str = "targets",
    passthrough_feature_keys: Sequence[str] = (),
) -> tf.data.Dataset:
    """``span_corruption`` with ``mean_noise_span_length=1``: every noise span is one token.

    The paper's "we mask single words" variant (T5's ``iid_denoising``-like objective with
    sentinels). With inputs 512 and density 0.15 it cuts 511-token chunks and needs targets 155.
    """
    return span_corruption(
        dataset,
        sequence_length,
        output_features,
        noise_density=noise_density,
        mean_noise_span_length=1.0,
        input_feature_key=input_feature_key,
        target_key=target_key,
        passthrough_feature_keys=passthrough_feature_keys,
    )


# ---------------------------------------------------------------------------------------------
# Chunking
# ---------------------------------------------------------------------------------------------


def split_tokens(
    dataset: tf.data.Dataset,
    *,
    max_tokens_per_segment: int,
    feature_key: str = "targets",
    passthrough_feature_keys: Sequence[str] = (),
) -> tf.data.Dataset:
    """Splits each example's ``feature_key`` tokens into consecutive segments.

    Every segment has ``max_tokens_per_segment`` tokens except possibly the last of a document;
    empty documents yield nothing. Each output example holds ``{feature_key: segment}`` plus the
    ``passthrough_feature_keys`` copied from its document; other features are dropped.
    """
    if max_tokens_per_segment < 1:
        raise ConfigError(f"max_tokens_per_segment must be positive; got {max_tokens_per_segment}.")
    passthrough = tuple(passthrough_feature_keys)
    segment = int(max_tokens_per_segment)

    def to_segments(features):
        tokens = features[feature_key]
        n = tf.size(tokens)
        num_segments = (n + segment - 1) // segment
        # Pad to a whole number of segments, reshape, and remember each segment's true length.
        padded = tf.pad(tokens, [[0, num_segments * segment - n]])
        lengths = tf.minimum(segment, n - tf.range(num_segments) * segment)
        out = {feature_key: tf.reshape(padded, [num_segments, segment])}
        for key in passthrough:
            out[key] = tf.repeat(tf.expand_dims(features[key], 0), num_segments, axis=0)
        return out, lengths

    def strip_padding(features, length):
        features = dict(features)
        features[feature_key] = features[feature_key][:length]
        return features

    dataset = dataset.filter(lambda features: tf.size(features[feature_key]) > 0)
    dataset = dataset.map(to_segments, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
    return dataset.map(strip_padding, num_parallel_calls=tf.data.AUTOTUNE)


def concatenate_and_split(
    dataset: tf.data.Dataset,
    *,
    segment_length: Optional[int] = None,
    documents_per_group: int = 128,
    feature_key: str = "targets",
    separator_id: Optional[int] = None,
) -> tf.data.Dataset:
    """Packs consecutive documents' tokens together so short documents do not waste padding.

    T5 concatenates documents before span corruption (``reduce_concat_tokens``, then
    ``split_tokens``); the paper's reference code does not, hence a separate, optional step.

    * ``segment_length=None`` (usable as a bare seqio step): each group of ``documents_per_group``
      consecutive documents becomes one example holding their concatenated tokens (T5's
      ``reduce_concat_tokens`` with batch size 128); nothing is dropped, and the following
      ``span_corruption`` / ``prefix_lm`` cuts the chunks, leaving at most one short chunk per group.
    * ``segment_length=N``: the documents form one token stream over the whole dataset, cut into
      examples of exactly ``N`` tokens; the final partial segment (< N tokens) is dropped. Use
      ``N = span_corruption_lengths(inputs_length, ...)[0]`` (or a multiple) before span corruption.

    ``separator_id`` (e.g. the EOS id), when given, is appended to each document first.
    Outputs only ``{feature_key: tokens}``.
    """
    if segment_length is not None and segment_length < 1:
        raise ConfigError(f"concatenate_and_split needs a positive segment_length (or None); got {segment_length}.")
    if documents_per_group < 1:
        raise ConfigError(f"concatenate_and_split needs documents_per_group >= 1; got {documents_per_group}.")
    dtype = dataset.element_spec[feature_key].dtype

    def document_tokens(features):
        tokens = features[feature_key]
        if separator_id is not None:
            tokens = tf.concat([tokens, tf.constant([separator_id], dtype)], axis=0)
        return tokens

    dataset = dataset.map(document_tokens, num_parallel_calls=tf.data.AUTOTUNE)
    if segment_length is None:
        dataset = dataset.ragged_batch(documents_per_group).map(lambda group: group.flat_values)
        dataset = dataset.filter(lambda tokens: tf.size(tokens) > 0)
    else:
        segment = int(segment_length)

        def emit_full_segments(leftover, tokens):
            stream = tf.concat([leftover, tokens], axis=0)
            full = (tf.size(stream) // segment) * segment
            return stream[full:], tf.reshape(stream[:full], [-1, segment])

        # scan carries the tokens not yet emitted from one document to the next (one stream).
        dataset = dataset.scan(tf.zeros([0], dtype), emit_full_segments).unbatch()
    return dataset.map(lambda tokens: {feature_key: tokens})


# ---------------------------------------------------------------------------------------------
# Language modelling
# ---------------------------------------------------------------------------------------------


@seqio.map_over_dataset(num_seeds=1)
def _split_at_random_point(features, seed, *, feature_key: str):
    tokens = features[feature_key]
    # Both halves non-empty: the split point is uniform over 1 .. n-1 (chunks have n >= 2).
    split = tf.random.stateless_uniform([], seed=seed, minval=1, maxval=tf.size(tokens), dtype=tf.int32)
    return {"inputs": tokens[:split], "targets": tokens[split:]}


def prefix_lm(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Optional[Mapping[str, Any]] = None,
    *,
    feature_key: str = "targets",
) -> tf.data.Dataset:
    """Prefix LM: chunk each document and split every chunk at a uniformly random point.

    The chunk length is ``min(sequence_length["inputs"], sequence_length["targets"])``: the largest
    for which *every* split point leaves the prefix (``inputs``) and the rest (``targets``) each at
    most their length minus one, so ``append_eos_after_trim`` never cuts tokens. Chunks shorter
    than 2 tokens (which cannot be split into two non-empty parts) are dropped. ``output_features``
    (passed by seqio) is only checked to contain both ``inputs`` and ``targets``.
    """
    if output_features is not None:
        missing = [key for key in ("inputs", "targets") if key not in output_features]
        if missing:
            raise ConfigError(
                f"prefix_lm produces 'inputs' and 'targets', but output_features lacks {missing}; "
                "add them to the task's output_features."
            )
    chunk = min(
        _required_length(sequence_length, "inputs", "prefix_lm"),
        _required_length(sequence_length, "targets", "prefix_lm"),
    )
    if chunk < 2:
        raise ConfigError(f"prefix_lm needs inputs and targets lengths of at least 2; got {dict(sequence_length)}.")
    dataset = split_tokens(dataset, max_tokens_per_segment=chunk, feature_key=feature_key)
    dataset = dataset.filter(lambda features: tf.size(features[feature_key]) >= 2)
    return _split_at_random_point(dataset, feature_key=feature_key)


def full_lm(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    *,
    feature_key: str = "targets",
    reserve_eos: bool = False,
) -> tf.data.Dataset:
    """Decoder-only LM: ``targets`` = consecutive chunks of ``sequence_length["targets"]`` tokens.

    ``inputs`` is empty (int shape [0]). With ``reserve_eos=True`` chunks are one token shorter so
    a following ``append_eos_after_trim`` adds EOS instead of overwriting the chunk's last token.
    """
    length = _required_length(sequence_length, "targets", "full_lm") - (1 if reserve_eos else 0)
    if length < 1:
        raise ConfigError(f"full_lm needs a positive targets length; got {dict(sequence_length)}.")
    dataset = split_tokens(dataset, max_tokens_per_segment=length, feature_key=feature_key)

    def to_lm_example(features):
        tokens = features[feature_key]
        return {"inputs": tf.zeros([0], tokens.dtype), "targets": tokens}

    return dataset.map(to_lm_example, num_parallel_calls=tf.data.AUTOTUNE)


# ---------------------------------------------------------------------------------------------
# Summarization
# ---------------------------------------------------------------------------------------------


def summarization(
    dataset: tf.data.Dataset,
    *,
    article_key: str = "article",
    abstract_key: str = "abstract",
    id_key: Optional[str] = "id",
) -> tf.data.Dataset:
    """Text summarization examples -> ``{"inputs": article, "targets": abstract}`` (untokenized),
    plus ``"id"`` when the source has an ``id_key`` feature.

    The abstract keeps one sentence per line (ROUGE-Lsum splits sentences on "\\n"): ``<S>``/``</S>``
    sentence tags (arXiv) are removed, ``</S>`` ending a line; every line is stripped and empty
    lines are dropped. The article loses its tags and surrounding whitespace. Examples whose article
    or abstract ends up empty are dropped (the reference code's FilterEmptyExamples). Use
    ``abstract_key="highlights"`` for CNN/DailyMail.

    The ``id`` (a string naming the document in its source, e.g. the arXiv ``article_id``) is not
    an output feature: ``seqio.preprocessors.tokenize`` and ``append_eos_after_trim`` pass it
    through untouched, so ``Task.get_dataset`` still has it for evaluation output, and the
    feature converters, which build the model features from ``inputs``/``targets`` only, drop it.
    """
    keep_id = bool(id_key) and id_key in dataset.element_spec

    def clean(features):
        article = tf.strings.regex_replace(features[article_key], r"</?S>", " ")
        article = tf.strings.strip(article)
        abstract = tf.strings.regex_replace(features[abstract_key], r"</S>", "\n")
        abstract = tf.strings.regex_replace(abstract, r"<S>", " ")
        lines = tf.strings.strip(tf.strings.split(abstract, sep="\n"))
        lines = tf.boolean_mask(lines, tf.strings.length(lines) > 0)
        out = {"inputs": article, "targets": tf.strings.reduce_join(lines, separator="\n")}
        if keep_id:
            out["id"] = features[id_key]
        return out

    def not_empty(features):
        return tf.logical_and(tf.strings.length(features["inputs"]) > 0, tf.strings.length(features["targets"]) > 0)

    return dataset.map(clean, num_parallel_calls=tf.data.AUTOTUNE).filter(not_empty)

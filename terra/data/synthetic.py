"""Synthetic length-generalisation tasks: decimal addition and sequence copy.

The paper ("Sparse is Enough in Scaling Transformers", Table 4) trains on short
instances of these two tasks and evaluates on strictly longer ones. The formats
follow the reference implementation (Trax, ``trax/data/inputs.py``):

* **Addition** (``addition_inputs`` / ``addition_input_stream`` with ``encdec=True``,
  config ``reformer_addition.gin``). Numbers are decimal and *little-endian* (least
  significant digit first); the most significant digit is non-zero unless the number has
  one digit. The input is ``x+y`` and the target the little-endian digits of ``x + y``.
  With ``add_len = (min_length - 1) // 2`` the operand lengths are
  ``l1 = randint((max_length - add_len + 1) // 2) + add_len`` and
  ``l2 = randint(max_length - l1 - 1) + 1`` (``randint(n)`` uniform on ``[0, n)``); a
  candidate whose input or target is longer than ``max_length`` symbols is redrawn.
  Train uses ``min_length=3, max_length=129`` (first operand 1-64 digits, ``x+y`` at
  most 129 symbols); eval uses ``min_length=257, max_length=301`` (first operand
  128-214 digits, ``x+y`` at most 301 symbols).
* **Copy** (``sequence_copy_inputs``). The input is a random word ``w`` and the target
  is ``w``. With ``train_length=64`` the train words have length uniform on ``[1, 64)``;
  eval words have length uniform on ``[eval_min_length, eval_max_length) = [128, 160)``.
  The reference draws from 11 token ids; here symbols are the characters of ``alphabet``.

Examples are ``{"inputs": tf.string, "targets": tf.string}`` (e.g. ``b"321+54"`` ->
``b"861"``: 123 + 45 = 168), to be tokenized later by a seqio vocabulary: bytes with EOS for
terra's own form (``synthetic_copy``, ``synthetic_addition``), or the reference's 13 digit ids
without EOS (``terra.data.vocabularies.DigitVocabulary``: digit ``k`` -> ``k + 1``, ``+`` -> 11,
``<S>`` -> 12; copy words over ``0123456789+``, the reference's ids 1..11) for the
``synthetic_*_digits`` tasks. The reference's language-model form (its default, what its
Transformer baseline trains on) puts a separator around the inputs (:func:`separate_inputs`:
copy ``0 w 0`` + ``w``, addition ``<S> x+y <S>`` + the sum) and the loss on the targets only
(``terra.data.feature_converters.LanguageModelFeatureConverter``).

Every example is a pure function of ``(seed, split, index)`` computed with stateless TF
random ops inside ``Dataset.range(...).map(...)``. That keeps the whole pipeline
in-graph, so ``tf.train.Checkpoint`` can save and restore the iterator position,
``Dataset.shard`` splits the stream between hosts without overlap, and a restart
reproduces exactly the examples it would have seen.
"""

from __future__ import annotations

import logging

import gin
import seqio
import tensorflow as tf

from terra.errors import ConfigError

SPLITS = ("train", "validation")

# The train stream is indexed, not repeated, so that no example index is ever reused;
# 2**62 examples is more than any run will consume and stays clear of int64 overflow.
_TRAIN_STREAM_SIZE = 2**62
_PLUS = ord("+")
_ZERO = ord("0")
# Philox is pinned (rather than "auto_select") so a stream is bit-identical on any host.
_ALG = "philox"


def _check_split(split: str) -> int:
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}.")
    return SPLITS.index(split)


def _check_int(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}.")
    return value


def _check_seed(seed) -> int:
    _check_int("seed", seed)
    if not -(2**63) <= seed < 2**63:
        raise ConfigError(f"seed must fit in int64, got {seed}.")
    return seed


def _split_key(seed: int, split_index: int) -> tf.Tensor:
    # The split is part of the Philox key, so train and validation are independent
    # streams for every seed instead of overlapping prefixes of one stream.
    return tf.constant([seed, split_index], dtype=tf.int64)


def _example_keys(split_key: tf.Tensor, index: tf.Tensor, num: int) -> tf.Tensor:
    """``num`` independent stateless keys for example ``index``: shape ``[num, 2]``."""
    key = tf.random.experimental.stateless_fold_in(split_key, index, alg=_ALG)
    return tf.random.experimental.stateless_split(key, num=num, alg=_ALG)


def _randint(key: tf.Tensor, low, high, shape=()) -> tf.Tensor:
    """Uniform int32 on ``[low, high)``."""
    return tf.random.stateless_uniform(shape, seed=key, minval=low, maxval=high, dtype=tf.int32, alg=_ALG)


def _encode(codepoints: tf.Tensor) -> tf.Tensor:
    return tf.strings.unicode_encode(codepoints, "UTF-8")


def _build(split: str, num_eval_examples: int, example_fn) -> tf.data.Dataset:
    size = _TRAIN_STREAM_SIZE if split == "train" else num_eval_examples
    # deterministic=True: parallel map must not reorder, or the stream would depend on
    # thread timing and a restored iterator could not reproduce it.
    return tf.data.Dataset.range(size).map(example_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


# --------------------------------------------------------------------------- addition


def _check_addition_lengths(name: str, min_length, max_length) -> None:
    _check_int(f"{name}_min_length", min_length, minimum=3)  # The reference requires >= 3 too.
    _check_int(f"{name}_max_length", max_length)
    if min_length > max_length:
        raise ConfigError(f"{name}_min_length ({min_length}) must not exceed {name}_max_length ({max_length}).")


def _random_number(key_body: tf.Tensor, key_top: tf.Tensor, length: tf.Tensor) -> tf.Tensor:
    """Little-endian digits of a random ``length``-digit number, as the reference draws it."""
    body = _randint(key_body, 0, 10, shape=tf.reshape(length - 1, [1]))
    # A lone digit is 0-9; otherwise the top digit is 1-9 so the length is exact.
    top = _randint(key_top, tf.cast(length > 1, tf.int32), 10)
    return tf.concat([body, tf.reshape(top, [1])], axis=0)


def _add_little_endian(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Digit-wise sum of two little-endian digit vectors, without leading zeros.

    Operands reach 214 digits, far past int64, so the sum is done per digit.
    """
    width = tf.maximum(tf.size(a), tf.size(b)) + 1  # One extra digit for the final carry.
    digits = tf.pad(a, [[0, width - tf.size(a)]]) + tf.pad(b, [[0, width - tf.size(b)]])

    # Push every carry one place up until none is left. Each pass is vectorised over all
    # digits, and random operands rarely chain carries, so this takes few passes; the
    # worst case (999...9 + 1) takes `width` passes and still terminates.
    def push_carries(d):
        carry = d // 10
        return (d % 10 + tf.concat([[0], carry[:-1]], axis=0),)

    (digits,) = tf.while_loop(
        lambda d: tf.reduce_any(d >= 10),
        push_carries,
        (digits,),
        shape_invariants=(tf.TensorShape([None]),),
    )
    # Trim the spare top digit (and zeros above it); a sum of 0 keeps its single "0".
    positions = tf.range(width)
    length = tf.reduce_max(tf.where(digits != 0, positions, 0)) + 1
    return digits[:length]


def addition_operand_digits(min_length: int, max_length: int) -> tuple:
    """``((fewest, most), (fewest, most))`` digits of the first and the second operand under
    the reference's length rules: ``l1 = add + randint((max_length - add + 1) // 2)`` with
    ``add = (min_length - 1) // 2``, then ``l2 = 1 + randint(max_length - l1 - 1)``, so the
    second operand can be the longer one."""
    add = (min_length - 1) // 2
    return (add, add + (max_length - add + 1) // 2 - 1), (1, max_length - add - 1)


def addition_feature_lengths(min_length: int, max_length: int) -> dict:
    """Feature lengths that hold every example: the input ``x+y`` plus EOS, and the sum (one
    digit more than the longer operand) plus EOS."""
    (_, first_most), (_, second_most) = addition_operand_digits(min_length, max_length)
    return {"inputs": max_length + 1, "targets": max(first_most, second_most) + 2}


def _addition_example_fn(split_key: tf.Tensor, min_length: int, max_length: int):
    (l1_fewest, l1_most), _ = addition_operand_digits(min_length, max_length)

    def example_fn(index):
        keys = _example_keys(split_key, index, num=6)
        # The reference redraws a candidate whose input (l1 + 1 + l2 symbols) or target
        # (at most max(l1, l2) + 1 digits) exceeds max_length. With these formulas
        # l2 <= max_length - l1 - 1, so the input never does; and given
        # 3 <= min_length <= max_length, l1 <= max_length - 2, so the target has at most
        # max_length - 1 digits. The redraw never fires, so drawing l1 and l2 directly
        # reproduces the reference's distribution exactly.
        l1 = _randint(keys[0], 0, l1_most - l1_fewest + 1) + l1_fewest
        l2 = _randint(keys[1], 0, max_length - l1 - 1) + 1
        x = _random_number(keys[2], keys[3], l1)
        y = _random_number(keys[4], keys[5], l2)
        total = _add_little_endian(x, y)
        inputs = tf.concat([x + _ZERO, [_PLUS], y + _ZERO], axis=0)
        return {"inputs": _encode(inputs), "targets": _encode(total + _ZERO)}

    return example_fn


# Decorated (not only registered) so that bindings such as `addition_dataset.train_max_length`
# reach the calls the sources make from Python, as the other entry functions are.
@gin.configurable(module="terra.data")
def addition_dataset(
    split: str,
    *,
    seed: int = 0,
    train_min_length: int = 3,
    train_max_length: int = 129,
    eval_min_length: int = 257,
    eval_max_length: int = 301,
    num_eval_examples: int = 1000,
) -> tf.data.Dataset:
    """Little-endian addition ``x+y -> x+y's digits``, as Trax's ``addition_inputs``.

    ``split="train"`` is an effectively endless stream (2**62 examples) drawn with the
    train lengths; ``"validation"`` is ``num_eval_examples`` examples drawn with the eval
    lengths. ``*_min_length``/``*_max_length`` are the reference's ``min_length`` /
    ``max_length``: the first operand has at least ``(min_length - 1) // 2`` digits and
    the whole input ``x+y`` at most ``max_length`` symbols.
    """
    split_index = _check_split(split)
    _check_seed(seed)
    _check_addition_lengths("train", train_min_length, train_max_length)
    _check_addition_lengths("eval", eval_min_length, eval_max_length)
    _check_int("num_eval_examples", num_eval_examples, minimum=1)
    if split == "train":
        min_length, max_length = train_min_length, train_max_length
    else:
        min_length, max_length = eval_min_length, eval_max_length
    example_fn = _addition_example_fn(_split_key(seed, split_index), min_length, max_length)
    return _build(split, num_eval_examples, example_fn)


# --------------------------------------------------------------------------- copy


def _check_copy_config(train_length, eval_min_length, eval_max_length, alphabet) -> None:
    _check_int("train_length", train_length, minimum=2)  # Train words are 1..train_length-1 long.
    _check_int("eval_min_length", eval_min_length, minimum=1)
    _check_int("eval_max_length", eval_max_length)
    if eval_min_length >= eval_max_length:
        raise ConfigError(
            f"eval_min_length ({eval_min_length}) must be below eval_max_length ({eval_max_length}): "
            "eval word lengths are drawn from [eval_min_length, eval_max_length)."
        )
    if not isinstance(alphabet, str) or not alphabet:
        raise ConfigError(f"alphabet must be a non-empty string of symbols, got {alphabet!r}.")


def _copy_example_fn(split_key: tf.Tensor, min_length: int, max_length: int, alphabet: str):
    codepoints = tf.constant([ord(c) for c in alphabet], dtype=tf.int32)

    def example_fn(index):
        keys = _example_keys(split_key, index, num=2)
        length = _randint(keys[0], min_length, max_length)
        symbols = _randint(keys[1], 0, len(alphabet), shape=tf.reshape(length, [1]))
        word = _encode(tf.gather(codepoints, symbols))
        return {"inputs": word, "targets": word}

    return example_fn


@gin.configurable(module="terra.data")
def copy_dataset(
    split: str,
    *,
    seed: int = 0,
    train_length: int = 64,
    eval_min_length: int = 128,
    eval_max_length: int = 160,
    alphabet: str = "0123456789",
    num_eval_examples: int = 1000,
) -> tf.data.Dataset:
    """Sequence copy ``w -> w``, as Trax's ``sequence_copy_inputs``.

    Train words have length uniform on ``[1, train_length)`` (endless stream); validation
    words uniform on ``[eval_min_length, eval_max_length)`` (``num_eval_examples`` of them).
    Each symbol is a uniform character of ``alphabet``.
    """
    split_index = _check_split(split)
    _check_seed(seed)
    _check_copy_config(train_length, eval_min_length, eval_max_length, alphabet)
    _check_int("num_eval_examples", num_eval_examples, minimum=1)
    if split == "train":
        min_length, max_length = 1, train_length
    else:
        min_length, max_length = eval_min_length, eval_max_length
    example_fn = _copy_example_fn(_split_key(seed, split_index), min_length, max_length, alphabet)
    return _build(split, num_eval_examples, example_fn)


# --------------------------------------------------------------------------- seqio sources


def _function_source(dataset_builder, kwargs) -> seqio.FunctionDataSource:
    kwargs = dict(kwargs)
    configured_seed = kwargs.pop("seed", 0)
    # Build (and discard) a validation dataset now so a bad configuration fails when the
    # task is registered rather than at its first get_dataset deep inside a pipeline.
    dataset_builder("validation", seed=configured_seed, **kwargs)

    # seqio finds the arguments by name: exactly `split, shuffle_files` and, when it has
    # one to pass, `seed`.
    def dataset_fn(split, shuffle_files, seed=None):
        del shuffle_files  # Examples are generated by index; there are no files to shuffle.
        return dataset_builder(split, seed=configured_seed if seed is None else seed, **kwargs)

    return seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=SPLITS)


def addition_source(**kwargs) -> seqio.FunctionDataSource:
    """A seqio source over :func:`addition_dataset`; ``kwargs`` are its keyword arguments.

    A seed passed by seqio replaces the configured ``seed``.
    """
    return _function_source(addition_dataset, kwargs)


def copy_source(**kwargs) -> seqio.FunctionDataSource:
    """A seqio source over :func:`copy_dataset`; ``kwargs`` are its keyword arguments.

    A seed passed by seqio replaces the configured ``seed``.
    """
    return _function_source(copy_dataset, kwargs)


def separate_inputs(dataset: tf.data.Dataset, *, separator_id: int) -> tf.data.Dataset:
    """Tokenized ``inputs`` -> ``[separator] + inputs + [separator]``: the prefix of the reference's
    language-model form, whose sequences are ``0 w 0 w`` (copy, separator 0) and
    ``<S> x+y <S> sum`` (addition, separator 12) with the loss on the part after the prefix."""

    def separate(features):
        inputs = features["inputs"]
        separator = tf.fill([1], tf.cast(separator_id, inputs.dtype))
        return {**features, "inputs": tf.concat([separator, inputs, separator], 0)}

    return dataset.map(separate, num_parallel_calls=tf.data.AUTOTUNE)


class _DropUncachedSourceWarning(logging.Filter):
    """seqio warns that an uncached FunctionDataSource repeats data after a restart; these
    streams are a pure function of (seed, index) and a restart restores the iterator's position,
    so the warning does not apply."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "uncached FunctionDataset" not in str(record.msg)


logging.getLogger("absl").addFilter(_DropUncachedSourceWarning())

"""The synthetic addition and copy tasks (paper Table 4): formats, lengths, determinism."""

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from terra.data import synthetic
from terra.errors import ConfigError

N = 200
SEED = 7


def take(dataset, n=N):
    return [{k: v.decode() for k, v in ex.items()} for ex in dataset.take(n).as_numpy_iterator()]


@pytest.fixture(scope="module")
def first_examples():
    """``(make, split) -> the first N examples of make(split, seed=SEED)``, each stream built once
    per module: building a stream traces its example function, most of what reading it costs, and
    the tests that read the same stream's examples share them. A test that compares two builds
    builds the second itself."""
    built = {}

    def get(make, split):
        if (make, split) not in built:
            built[make, split] = take(make(split, seed=SEED))
        return built[make, split]

    return get


def little_endian(digits: str) -> int:
    return int(digits[::-1])


def operands(example):
    x, y = example["inputs"].split("+")
    return x, y


@pytest.mark.parametrize("split", ["train", "validation"])
def test_every_addition_target_is_the_little_endian_sum(split, first_examples):
    for ex in first_examples(synthetic.addition_dataset, split):
        x, y = operands(ex)
        assert x.isdigit() and y.isdigit(), ex
        total = little_endian(x) + little_endian(y)
        assert ex["targets"] == str(total)[::-1], ex


def test_carries_propagate_through_long_chains_of_nines():
    nines = tf.constant([9] * 250, tf.int32)
    one = tf.constant([1], tf.int32)
    assert synthetic._add_little_endian(nines, one).numpy().tolist() == [0] * 250 + [1]
    zero = tf.constant([0], tf.int32)
    assert synthetic._add_little_endian(zero, zero).numpy().tolist() == [0]


def test_addition_lengths_fall_in_the_train_and_eval_ranges(first_examples):
    def check(split, first_range, max_input):
        first_lengths = []
        for ex in first_examples(synthetic.addition_dataset, split):
            x, y = operands(ex)
            assert first_range[0] <= len(x) <= first_range[1], ex
            assert len(y) >= 1 and len(ex["inputs"]) <= max_input, ex
            assert len(ex["targets"]) <= max_input, ex
            for number in (x, y, ex["targets"]):
                # Little-endian: the most significant digit is the last one.
                assert len(number) == 1 or number[-1] != "0", ex
            first_lengths.append(len(x))
        # The whole range is used, not just a corner of it.
        assert min(first_lengths) <= first_range[0] + 5 and max(first_lengths) >= first_range[1] - 5

    check("train", (1, 64), 129)
    check("validation", (128, 214), 301)


def test_single_digit_operands_take_all_ten_digits_and_longer_ones_never_lead_with_zero(first_examples):
    # min_length = max_length = 3 leaves only "d+d".
    examples = take(synthetic.addition_dataset("train", train_min_length=3, train_max_length=3))
    assert {len(ex["inputs"]) for ex in examples} == {3}
    for side in (0, 1):
        assert {operands(ex)[side] for ex in examples} == set("0123456789")
    tops = {operands(ex)[0][-1] for ex in first_examples(synthetic.addition_dataset, "validation")}
    assert tops == set("123456789")


def test_copy_targets_equal_sources_and_lengths_are_in_range(first_examples):
    for split, low, high in [("train", 1, 63), ("validation", 128, 159)]:
        lengths = []
        for ex in first_examples(synthetic.copy_dataset, split):
            assert ex["targets"] == ex["inputs"]
            assert set(ex["inputs"]) <= set("0123456789")
            assert low <= len(ex["inputs"]) <= high, ex
            lengths.append(len(ex["inputs"]))
        assert min(lengths) <= low + 3 and max(lengths) >= high - 3


def test_copy_uses_the_given_alphabet():
    examples = take(synthetic.copy_dataset("train", alphabet="ab\u00e9", train_length=40))
    symbols = set("".join(ex["inputs"] for ex in examples))
    assert symbols == set("ab\u00e9")


@pytest.mark.parametrize("make", [synthetic.addition_dataset, synthetic.copy_dataset])
@pytest.mark.slow
def test_same_seed_gives_the_same_stream_and_different_seeds_differ(make, first_examples):
    first = first_examples(make, "train")[:50]
    assert take(make("train", seed=SEED), 50) == first
    assert take(make("train", seed=SEED + 1), 50) != first
    assert take(make("validation", seed=SEED), 50) == first_examples(make, "validation")[:50]


@pytest.mark.parametrize("make", [synthetic.addition_dataset, synthetic.copy_dataset])
def test_train_and_validation_streams_differ(make):
    # Equal lengths make the two splits comparable symbol for symbol.
    if make is synthetic.addition_dataset:
        kwargs = dict(eval_min_length=3, eval_max_length=129)
    else:
        kwargs = dict(train_length=50, eval_min_length=1, eval_max_length=50)
    train = take(make("train", **kwargs), 100)
    validation = take(make("validation", **kwargs), 100)
    assert not {ex["inputs"] for ex in train} & {ex["inputs"] for ex in validation}


def test_validation_has_num_eval_examples_and_train_is_endless():
    assert len(take(synthetic.addition_dataset("validation", num_eval_examples=17), 1000)) == 17
    assert synthetic.copy_dataset("validation", num_eval_examples=5).cardinality().numpy() == 5
    assert synthetic.copy_dataset("train").cardinality().numpy() >= 2**62


def test_sharding_splits_the_stream_without_overlap(first_examples):
    whole = first_examples(synthetic.addition_dataset, "train")[:40]
    shards = [take(synthetic.addition_dataset("train", seed=SEED).shard(2, i), 20) for i in range(2)]
    assert shards[0] == whole[0::2] and shards[1] == whole[1::2]


@pytest.mark.parametrize("make", [synthetic.addition_dataset, synthetic.copy_dataset])
def test_iterator_state_can_be_checkpointed_and_resumed(make, tmp_path):
    def read(iterator, n):
        return [{k: v.numpy() for k, v in next(iterator).items()} for _ in range(n)]

    iterator = iter(make("train", seed=5))
    read(iterator, 7)
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt"))
    expected = read(iterator, 5)

    resumed = iter(make("train", seed=5))
    tf.train.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    assert read(resumed, 5) == expected


@pytest.mark.parametrize(
    "source, make, check",
    [
        (
            synthetic.addition_source,
            synthetic.addition_dataset,
            lambda i, t: little_endian(t) == sum(little_endian(n) for n in i.split("+")),
        ),
        (synthetic.copy_source, synthetic.copy_dataset, lambda i, t: i == t),
    ],
)
@pytest.mark.slow
def test_sources_work_through_a_seqio_task(source, make, check):
    name = f"terra_test_synthetic_{source.__name__}"
    vocabulary = seqio.ByteVocabulary()
    seqio.TaskRegistry.add(
        name,
        source=source(seed=11, num_eval_examples=20),
        preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
        output_features={
            "inputs": seqio.Feature(vocabulary),
            "targets": seqio.Feature(vocabulary),
        },
    )
    try:
        task = seqio.get_mixture_or_task(name)
        dataset = task.get_dataset(sequence_length={"inputs": 512, "targets": 512}, split="validation", shuffle=False)
        examples = list(dataset.as_numpy_iterator())
        assert len(examples) == 20
        direct = take(make("validation", seed=11, num_eval_examples=20))
        for ex, raw in zip(examples, direct):
            assert ex["inputs"][-1] == vocabulary.eos_id and ex["targets"][-1] == vocabulary.eos_id
            inputs = vocabulary.decode(ex["inputs"].tolist())
            targets = vocabulary.decode(ex["targets"].tolist())
            assert (inputs, targets) == (raw["inputs"], raw["targets"])
            assert check(inputs, targets)
        # A seed from seqio overrides the configured one.
        reseeded = task.get_dataset(
            sequence_length={"inputs": 512, "targets": 512}, split="validation", shuffle=False, seed=12
        )
        assert [ex["inputs"].tolist() for ex in reseeded.as_numpy_iterator()] != [
            ex["inputs"].tolist() for ex in examples
        ]
    finally:
        seqio.TaskRegistry.remove(name)


def test_functions_are_gin_configurable():
    gin.bind_parameter("terra.data.copy_dataset.train_length", 3)
    lengths = {len(ex["inputs"]) for ex in take(synthetic.copy_source().get_dataset("train"), 50)}
    assert lengths == {1, 2}  # the binding reaches the dataset the source builds


@pytest.mark.parametrize("make", [synthetic.addition_dataset, synthetic.copy_dataset])
def test_a_bad_split_raises_config_error_naming_the_valid_splits(make):
    with pytest.raises(ConfigError) as info:
        make("test")
    assert "'test'" in str(info.value) and "'train', 'validation'" in str(info.value)


@pytest.mark.parametrize(
    "make, kwargs, fragment",
    [
        (
            synthetic.addition_dataset,
            dict(train_min_length=130, train_max_length=129),
            "train_min_length (130)",
        ),
        (synthetic.addition_dataset, dict(eval_min_length=2), "eval_min_length must be at least 3"),
        (synthetic.addition_dataset, dict(num_eval_examples=0), "num_eval_examples must be at least 1"),
        (synthetic.copy_dataset, dict(eval_min_length=160, eval_max_length=128), "eval_min_length (160)"),
        (synthetic.copy_dataset, dict(train_length=1), "train_length must be at least 2"),
        (synthetic.copy_dataset, dict(alphabet=""), "alphabet must be a non-empty string"),
        (synthetic.copy_dataset, dict(seed=1.5), "seed must be an int"),
    ],
)
def test_bad_lengths_raise_config_error_with_a_helpful_message(make, kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        make("train", **kwargs)
    assert fragment in str(info.value)


def test_sources_reject_a_bad_configuration_when_built():
    with pytest.raises(ConfigError, match="eval_min_length"):
        synthetic.copy_source(eval_min_length=10, eval_max_length=10)


# --- the reference's form: its 13 digit ids, its language-model sequences ------------------------


def test_the_digit_vocabulary_has_the_reference_ids():
    from terra.data.vocabularies import DigitVocabulary

    vocabulary = DigitVocabulary()
    assert vocabulary.vocab_size == 13 and vocabulary.eos_id is None and vocabulary.pad_id == 0
    # digit k -> k + 1, '+' -> 11, '<S>' -> 12.
    assert vocabulary.encode("<S>0123456789+<S>") == [12, *range(1, 11), 11, 12]
    assert vocabulary.encode_tf(tf.constant("<S>90+1<S>")).numpy().tolist() == [12, 10, 1, 11, 2, 12]
    assert vocabulary.decode([12, 10, 1, 11, 2, 12, 0, 0]) == "<S>90+1<S>"
    assert vocabulary.decode_tf(tf.constant([12, 10, 1, 11, 2, 0])).numpy() == b"<S>90+1"
    with pytest.raises(ValueError, match="'a' is not one of the digit vocabulary's symbols"):
        vocabulary.encode("1a")
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside the digit vocabulary"):
        vocabulary.encode_tf(tf.constant("1a"))


def _first_batch(task, lengths, converter=None):
    from terra.data import pipeline, tasks

    return next(
        pipeline.BatchIterator(
            pipeline.get_dataset(
                tasks.get_task(task),
                feature_lengths=lengths,
                batch_size=16,
                split="validation",
                shuffle=False,
                feature_converter=converter,
            )
        )
    )


def _digits(ids):
    """Reference ids -> the little-endian number they spell (digit k is id k + 1)."""
    return int("".join(str(i - 1) for i in ids)[::-1])


def test_the_reference_copy_language_model_sequence_is_0w0w_with_the_loss_on_the_second_w():
    from terra.data import feature_converters

    gin.bind_parameter("terra.data.copy_dataset.eval_min_length", 5)
    gin.bind_parameter("terra.data.copy_dataset.eval_max_length", 9)
    batch = _first_batch(
        "synthetic_copy_digits_lm", {"inputs": 10, "targets": 8}, feature_converters.language_model_converter()
    )
    assert batch["encoder_input_tokens"].shape == (16, 1) and not batch["encoder_input_tokens"].any()
    symbols = set()
    for tokens, inputs, weights in zip(
        batch["decoder_target_tokens"], batch["decoder_input_tokens"], batch["decoder_loss_weights"]
    ):
        n = int(np.flatnonzero(tokens[1:] == 0)[0])  # the length of w: the first separator after it
        w = tokens[1 : 1 + n].tolist()
        assert 5 <= n <= 8 and tokens.tolist() == [0, *w, 0, *w] + [0] * (18 - 2 * n - 2)
        assert weights.tolist() == [0] * (n + 2) + [1] * n + [0] * (18 - 2 * n - 2)  # no weight on the zeros
        assert inputs.tolist() == [0, *tokens[:-1].tolist()]  # shifted right, 0 first
        symbols.update(w)
    assert symbols == set(range(1, 12))  # the reference's copy symbols: ids 1..11


def test_the_reference_addition_language_model_sequence_is_s_x_plus_y_s_sum_with_the_loss_on_the_sum():
    from terra.data import feature_converters

    batch = _first_batch(
        "synthetic_addition_digits_lm", {"inputs": 303, "targets": 215}, feature_converters.language_model_converter()
    )
    for tokens, weights in zip(batch["decoder_target_tokens"], batch["decoder_loss_weights"]):
        tokens, weights = tokens.tolist(), weights.tolist()
        assert tokens[0] == 12
        second = tokens.index(12, 1)  # "<S> x + y <S>"
        x, y = tokens[1 : tokens.index(11)], tokens[tokens.index(11) + 1 : second]
        answer = [t for t, w in zip(tokens, weights) if w]
        assert weights.index(1) == second + 1 and len(answer) == sum(weights)
        assert _digits(answer) == _digits(x) + _digits(y)
        assert not any(tokens[second + 1 + len(answer) :])  # no EOS: pads follow the sum


def test_the_reference_encoder_decoder_forms_have_no_eos():
    copy = _first_batch("synthetic_copy_digits", {"inputs": 160, "targets": 160})
    np.testing.assert_array_equal(copy["encoder_input_tokens"], copy["decoder_target_tokens"])
    np.testing.assert_array_equal(copy["decoder_loss_weights"], copy["decoder_target_tokens"] != 0)
    # Words of 128-159 symbols, ids 1..11, ending with a symbol of the word (an EOS would be a 1 on
    # every row).
    words = [row[row != 0] for row in copy["decoder_target_tokens"]]
    assert all(128 <= len(w) <= 159 and w.max() <= 11 for w in words)
    assert {int(w[-1]) for w in words} != {1}
    addition = _first_batch("synthetic_addition_digits", {"inputs": 302, "targets": 216})
    for inputs, targets in zip(addition["encoder_input_tokens"], addition["decoder_target_tokens"]):
        inputs, targets = [t for t in inputs.tolist() if t], [t for t in targets.tolist() if t]
        plus = inputs.index(11)
        # The last digit of the sum is its most significant one; with an EOS it would be 1.
        assert _digits(targets) == _digits(inputs[:plus]) + _digits(inputs[plus + 1 :]) and targets[-1] != 1

"""terra.data.preprocessors: T5-style span corruption, chunking, LM and summarization, via seqio."""

import functools
import uuid

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from terra.data import preprocessors as prep
from terra.errors import ConfigError
from terra.gin_config import registration

VOCAB_SIZE = 1000
EOS_ID = 1
# Synthetic token ids stay well below the sentinel range (VOCAB_SIZE - 1 counting down).
MAX_TOKEN_ID = 800


def _output_features(vocab_size=VOCAB_SIZE):
    vocabulary = seqio.PassThroughVocabulary(size=vocab_size, eos_id=EOS_ID)
    return {
        "inputs": seqio.Feature(vocabulary, add_eos=True),
        "targets": seqio.Feature(vocabulary, add_eos=True),
    }


def _documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, MAX_TOKEN_ID, size=n).astype(np.int32) for n in lengths]


def _token_dataset(documents):
    return tf.data.Dataset.from_generator(
        lambda: ({"targets": doc} for doc in documents),
        output_signature={"targets": tf.TensorSpec([None], tf.int32)},
    )


def _run(preprocessor, documents, sequence_length, seed=1234, **kwargs):
    """Applies a seqio preprocessor the way a Task does, with a fixed map seed."""
    with seqio.utils.map_seed_manager(seed):
        dataset = preprocessor(
            _token_dataset(documents), sequence_length=sequence_length, output_features=_output_features(), **kwargs
        )
    return list(dataset.as_numpy_iterator())


def _spans(mask):
    """Lengths of the runs of True in a boolean vector."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return edges[1::2] - edges[::2]


def _reconstruct(inputs, targets):
    """Puts each sentinel's span from the targets back in place of that sentinel in the inputs."""
    span_by_sentinel, current = {}, None
    for token in targets:
        if token > MAX_TOKEN_ID:
            current = int(token)
            span_by_sentinel[current] = []
        else:
            span_by_sentinel[current].append(int(token))
    out = []
    for token in inputs:
        out.extend(span_by_sentinel[int(token)] if token > MAX_TOKEN_ID else [int(token)])
    return out


def test_noise_mask_has_the_requested_density_and_mean_span_length():
    length, density, mean_span = 200, 0.15, 3.0
    mask_fn = tf.function(lambda seed: prep.random_spans_noise_mask(length, density, mean_span, seed))
    expected_noise = round(length * density)  # 30
    expected_spans = round(expected_noise / mean_span)  # 10
    all_span_lengths, masks = [], set()
    for s in range(100):
        mask = mask_fn(tf.constant([s, 7], tf.int64)).numpy()
        assert mask.shape == (length,) and mask.dtype == bool
        assert mask.sum() == expected_noise
        assert not mask[0] and mask[-1]  # starts with a non-noise span, ends with noise
        spans = _spans(mask)
        assert len(spans) == expected_spans
        all_span_lengths.extend(spans)
        masks.add(mask.tobytes())
    assert np.mean(all_span_lengths) == pytest.approx(mean_span)
    assert len(set(all_span_lengths)) > 3  # span lengths really vary
    assert len(masks) == 100  # every seed gives its own mask
    # Deterministic for a given seed; two [2, 2] seeds are accepted as well.
    seed = tf.constant([3, 4], tf.int64)
    np.testing.assert_array_equal(mask_fn(seed), mask_fn(seed))
    pair = tf.constant([[1, 2], [3, 4]], tf.int64)
    np.testing.assert_array_equal(
        prep.random_spans_noise_mask(length, density, mean_span, pair),
        prep.random_spans_noise_mask(length, density, mean_span, pair),
    )
    # Degenerate lengths: a single token is never noise.
    assert prep.random_spans_noise_mask(1, density, mean_span, seed).numpy().tolist() == [False]
    assert prep.random_spans_noise_mask(2, density, mean_span, seed).numpy().tolist() == [False, True]


def test_span_corruption_sentinels_are_distinct_and_descending_from_the_top_of_the_vocabulary():
    examples = _run(prep.span_corruption, _documents([568, 568, 300]), {"inputs": 512, "targets": 114})
    assert len(examples) == 3
    for example in examples:
        input_sentinels = [t for t in example["inputs"] if t > MAX_TOKEN_ID]
        target_sentinels = [t for t in example["targets"] if t > MAX_TOKEN_ID]
        expected = list(range(VOCAB_SIZE - 1, VOCAB_SIZE - 1 - len(input_sentinels), -1))
        assert input_sentinels == expected and target_sentinels == expected
        assert example["targets"][0] == VOCAB_SIZE - 1  # the targets open with the first sentinel
        assert example["targets"][-1] <= MAX_TOKEN_ID  # ... and end with noise, no trailing sentinel
    # A full 568-token chunk has round(568 * 0.15) = 85 noise tokens in round(85 / 3) = 28 spans.
    assert len([t for t in examples[0]["inputs"] if t > MAX_TOKEN_ID]) == 28
    assert len(examples[0]["targets"]) == 85 + 28


def test_interleaving_inputs_and_targets_reconstructs_the_original_tokens():
    documents = _documents([1, 2, 7, 100, 1300])
    examples = _run(prep.span_corruption, documents, {"inputs": 64, "targets": 32})
    tokens_length, _ = prep.span_corruption_lengths(64)
    chunks = [doc[i : i + tokens_length].tolist() for doc in documents for i in range(0, len(doc), tokens_length)]
    assert len(examples) == len(chunks)
    for example, chunk in zip(examples, chunks):
        assert _reconstruct(example["inputs"], example["targets"]) == chunk


def test_span_corruption_lengths_match_t5():
    assert prep.span_corruption_lengths(512, 0.15, 3.0) == (568, 114)
    assert prep.span_corruption_lengths(512, 0.15, 1.0) == (511, 155)
    assert prep.span_corruption_lengths(512) == (568, 114)


def test_fixed_chunks_as_the_papers_code_cuts_them_reconstruct_the_documents():
    # The reference cuts 512-token chunks (docs/design/reference_code.md §5.1); 512 inputs and 256 targets
    # then hold every corrupted chunk with its EOS (462 and 104 at most).
    assert prep.chunk_corruption_lengths(512) == (462, 104)
    documents = _documents([1, 100, 512, 1300])
    examples = _run(prep.span_corruption, documents, {"inputs": 512, "targets": 256}, chunk_length=512)
    chunks = [doc[i : i + 512].tolist() for doc in documents for i in range(0, len(doc), 512)]
    assert len(examples) == len(chunks) == 6
    for example, chunk in zip(examples, chunks):
        assert _reconstruct(example["inputs"], example["targets"]) == chunk
        assert example["targets"][0] == VOCAB_SIZE - 1  # sentinels still count down from the top id
    full = examples[2]  # a whole 512-token chunk: 77 noise tokens in 26 spans
    assert (len(full["inputs"]), len(full["targets"])) == (512 - 77 + 26, 77 + 26)


def test_fixed_chunks_whose_corruption_does_not_fit_raise_a_clear_error():
    with pytest.raises(ConfigError, match=r"chunk_length=568,.* inputs of up to 512 .* at least 512"):
        prep.span_corruption(
            _token_dataset(_documents([10])), {"inputs": 462, "targets": 256}, _output_features(), chunk_length=568
        )
    with pytest.raises(ConfigError, match=r"chunk_length=512.*targets of up to 104 .* at least 104"):
        prep.span_corruption(
            _token_dataset(_documents([10])), {"inputs": 512, "targets": 100}, _output_features(), chunk_length=512
        )


def test_corrupted_inputs_fit_the_inputs_length_after_eos():
    sequence_length = {"inputs": 512, "targets": 114}
    documents = _documents([1, 2, 5, 567, 568, 569, 3000])
    with seqio.utils.map_seed_manager(5):
        dataset = prep.span_corruption(_token_dataset(documents), sequence_length, _output_features())
    before_eos = list(dataset.as_numpy_iterator())
    after_eos = list(
        seqio.preprocessors.append_eos_after_trim(dataset, _output_features(), sequence_length).as_numpy_iterator()
    )
    assert max(len(x["inputs"]) for x in before_eos) == 511  # room for EOS, so trimming cuts nothing
    assert max(len(x["targets"]) for x in before_eos) == 113
    for before, after in zip(before_eos, after_eos):
        assert after["inputs"].tolist() == before["inputs"].tolist() + [EOS_ID]
        assert after["targets"].tolist() == before["targets"].tolist() + [EOS_ID]
        assert len(after["inputs"]) <= 512 and len(after["targets"]) <= 114
    # Full 568-token chunks fill the inputs exactly.
    assert sum(len(x["inputs"]) == 512 for x in after_eos) == 1 + 1 + 5


def test_single_word_masking_makes_spans_of_one_token():
    sequence_length = {"inputs": 512, "targets": 155}
    examples = _run(prep.single_word_masking, _documents([511, 2000]), sequence_length)
    for example in examples:
        targets = example["targets"]
        # "<s> w <s> w ...": every sentinel is followed by exactly one word.
        assert all(t > MAX_TOKEN_ID for t in targets[0::2]) and all(t <= MAX_TOKEN_ID for t in targets[1::2])
        inputs = example["inputs"]
        sentinel_positions = np.flatnonzero(inputs > MAX_TOKEN_ID)
        assert np.all(np.diff(sentinel_positions) > 1)  # never two masked words in a row
    full = examples[0]
    assert len(full["targets"]) == 2 * round(511 * 0.15) == 154  # 155 with EOS
    assert len(full["inputs"]) == 511
    with pytest.raises(ConfigError, match="155"):
        _run(prep.single_word_masking, _documents([10]), {"inputs": 512, "targets": 114})


def test_same_seed_gives_the_same_corruption():
    vocabulary = seqio.ByteVocabulary(extra_ids=100)
    texts = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 2) for i in range(6)]

    def dataset_fn(split, shuffle_files, seed=None):
        del split, shuffle_files, seed
        return tf.data.Dataset.from_tensor_slices({"text": texts})

    name = f"terra_test_span_corruption_{uuid.uuid4().hex}"
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
        preprocessors=[
            functools.partial(seqio.preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
            seqio.preprocessors.tokenize,
            prep.span_corruption,
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features={
            "inputs": seqio.Feature(vocabulary, add_eos=True),
            "targets": seqio.Feature(vocabulary, add_eos=True),
        },
    )
    try:
        task = seqio.get_mixture_or_task(name)
        sequence_length = {"inputs": 64, "targets": 16}

        def corrupt(seed):
            dataset = task.get_dataset(sequence_length, split="train", shuffle=False, seed=seed)
            return [(x["inputs"].tolist(), x["targets"].tolist()) for x in dataset.as_numpy_iterator()]

        first, again, other = corrupt(17), corrupt(17), corrupt(18)
        assert len(first) > len(texts)  # long documents were split into several chunks
        assert first == again
        assert first != other
        # Byte vocabulary with 100 extra ids: the first sentinel is the top id, <extra_id_0>.
        top = vocabulary.vocab_size - 1
        assert all(targets[0] == top for _, targets in first)
        assert all(len(inputs) <= 64 and len(targets) <= 16 for inputs, targets in first)
    finally:
        seqio.TaskRegistry.remove(name)


def test_gin_bindings_reach_span_corruption_when_seqio_calls_it():
    registration.register_data_layer()  # registers terra.data.span_corruption with gin
    gin.parse_config(
        """
        terra.data.span_corruption.noise_density = 0.25
        terra.data.span_corruption.mean_noise_span_length = 1.0
        """
    )
    configured = gin.get_configurable("terra.data.span_corruption")
    # What a Task does with each preprocessor: pass sequence_length/output_features by name.
    preprocessor = seqio.utils.add_kwargs_to_transform(
        configured, sequence_length={"inputs": 64, "targets": 40}, output_features=_output_features()
    )
    with seqio.utils.map_seed_manager(3):
        (example,) = list(preprocessor(_token_dataset(_documents([60]))).as_numpy_iterator())
    # 60 tokens at density 0.25 and mean span 1: 15 one-token spans, "<s> w" pairs in the targets.
    assert len(example["targets"]) == 30 and len(example["inputs"]) == 60


def test_targets_length_too_small_raises_a_clear_error():
    with pytest.raises(ConfigError) as error:
        prep.span_corruption(_token_dataset(_documents([10])), {"inputs": 512, "targets": 100}, _output_features())
    message = str(error.value)
    assert "114" in message and "100" in message and "at least 114" in message
    with pytest.raises(ConfigError, match="noise_density"):
        prep.span_corruption(
            _token_dataset(_documents([10])), {"inputs": 512, "targets": 114}, _output_features(), noise_density=1.5
        )


def test_prefix_lm_splits_a_chunk_into_inputs_and_targets():
    documents = _documents([100, 45, 1])
    sequence_length = {"inputs": 32, "targets": 40}
    examples = _run(prep.prefix_lm, documents, sequence_length)
    chunks = [doc[i : i + 32] for doc in documents for i in range(0, len(doc), 32)]
    chunks = [c for c in chunks if len(c) >= 2]  # the 1-token leftovers cannot be split
    assert len(examples) == len(chunks) == 6
    split_points = []
    for example, chunk in zip(examples, chunks):
        assert len(example["inputs"]) >= 1 and len(example["targets"]) >= 1
        np.testing.assert_array_equal(np.concatenate([example["inputs"], example["targets"]]), chunk)
        assert len(example["inputs"]) <= 31 and len(example["targets"]) <= 39  # EOS still fits
        split_points.append(len(example["inputs"]))
    assert len(set(split_points)) > 1
    again = _run(prep.prefix_lm, documents, sequence_length)  # same seed, same splits
    assert [len(x["inputs"]) for x in again] == split_points

    lm = list(prep.full_lm(_token_dataset(documents), {"targets": 32}).as_numpy_iterator())
    assert [len(x["targets"]) for x in lm] == [32, 32, 32, 4, 32, 13, 1]
    assert all(x["inputs"].shape == (0,) and x["inputs"].dtype == np.int32 for x in lm)


def test_concatenate_and_split_packs_documents_into_full_chunks():
    documents = _documents([5, 3, 12, 1, 9])
    stream = np.concatenate(documents)
    packed = list(prep.concatenate_and_split(_token_dataset(documents), segment_length=8).as_numpy_iterator())
    assert [len(x["targets"]) for x in packed] == [8, 8, 8]  # 30 tokens: 3 full chunks, 6 dropped
    np.testing.assert_array_equal(np.concatenate([x["targets"] for x in packed]), stream[:24])

    separated = list(
        prep.concatenate_and_split(_token_dataset(documents), segment_length=7, separator_id=EOS_ID).as_numpy_iterator()
    )
    expected = np.concatenate([np.append(doc, EOS_ID) for doc in documents])
    assert len(separated) == len(expected) // 7
    np.testing.assert_array_equal(np.concatenate([x["targets"] for x in separated]), expected[: 7 * len(separated)])

    # Without a segment length (a bare seqio step): groups of documents, nothing dropped, and a
    # following span_corruption cuts full chunks out of each group.
    grouped = list(prep.concatenate_and_split(_token_dataset(documents), documents_per_group=2).as_numpy_iterator())
    assert [len(x["targets"]) for x in grouped] == [8, 13, 9]
    np.testing.assert_array_equal(np.concatenate([x["targets"] for x in grouped]), stream)
    with seqio.utils.map_seed_manager(0):
        packed_corruption = prep.span_corruption(
            prep.concatenate_and_split(_token_dataset(_documents([30] * 10))),
            {"inputs": 64, "targets": 32},
            _output_features(),
        )
        # One 300-token group -> chunks of 70 (inputs 63 + EOS) and a last one of 20 (20 - 3 + 1 = 18).
        assert [len(x["inputs"]) for x in packed_corruption.as_numpy_iterator()] == [63, 63, 63, 63, 18]


def test_summarization_keeps_one_sentence_per_line_and_drops_empty_examples():
    raw = tf.data.Dataset.from_tensor_slices(
        {
            "article": [
                "  The article text.  \n",
                "<S> tagged article . </S>",
                "an article with no abstract",
                "   ",
            ],
            "abstract": [
                "  first sentence .  \n\n   second sentence .\n",
                "<S> one . </S> <S> two . </S>",
                " <S> </S>  \n ",
                "an abstract with no article",
            ],
        }
    )
    examples = list(prep.summarization(raw).as_numpy_iterator())
    assert examples == [
        {"inputs": b"The article text.", "targets": b"first sentence .\nsecond sentence ."},
        {"inputs": b"tagged article .", "targets": b"one .\ntwo ."},
    ]
    renamed = tf.data.Dataset.from_tensor_slices({"story": ["s"], "highlights": ["a\nb"]})
    assert list(prep.summarization(renamed, article_key="story", abstract_key="highlights").as_numpy_iterator()) == [
        {"inputs": b"s", "targets": b"a\nb"}
    ]


def test_summarization_keeps_the_source_id_through_tokenization_and_nothing_else():
    raw = tf.data.Dataset.from_tensor_slices(
        {
            "article": ["first article .", "   ", "third article ."],
            "abstract": ["first .", "dropped .", "third ."],
            "section_names": ["intro", "intro", "intro"],
            "doc": ["paper-a", "paper-b", "paper-c"],
        }
    )
    cleaned = prep.summarization(raw, id_key="doc")
    assert set(cleaned.element_spec) == {"inputs", "targets", "id"}
    assert [ex["id"] for ex in cleaned.as_numpy_iterator()] == [b"paper-a", b"paper-c"]  # follows its example
    vocabulary = seqio.ByteVocabulary()
    features = {"inputs": seqio.Feature(vocabulary, add_eos=True), "targets": seqio.Feature(vocabulary, add_eos=True)}
    tokenized = seqio.preprocessors.append_eos_after_trim(
        seqio.preprocessors.tokenize(cleaned, features),
        output_features=features,
        sequence_length={"inputs": 8, "targets": 8},
    )
    first = next(tokenized.as_numpy_iterator())
    assert first["id"] == b"paper-a" and first["inputs_pretokenized"] == b"first article ."
    assert len(first["inputs"]) == 8 and first["inputs"][-1] == vocabulary.eos_id
    # Without an id feature (or with id_key=None) the output is inputs/targets only, as before.
    assert set(prep.summarization(raw).element_spec) == {"inputs", "targets"}
    assert set(prep.summarization(raw, id_key=None).element_spec) == {"inputs", "targets"}

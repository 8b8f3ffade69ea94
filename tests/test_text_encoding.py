"""Texts encoded for the model outside a task (terra/text_encoding.py): only what can be used is
tokenized, and the truncation note names the feature that was cut."""

from terra.text_encoding import encode_text


class WordVocabulary:
    """One id per whitespace-separated word; records how many characters it was asked to encode."""

    def __init__(self):
        self.encoded_characters = []

    def encode(self, text):
        self.encoded_characters.append(len(text))
        return [2 + len(word) for word in text.split()]


def test_a_huge_text_is_tokenized_only_as_far_as_the_input_length_needs():
    vocabulary = WordVocabulary()
    text = "sparse layers decode fast " * 400_000  # 10.4 MB
    ids, note = encode_text(text, vocabulary, 48)
    assert ids == vocabulary.encode(text)[:47] + [1]
    assert max(vocabulary.encoded_characters[:-1]) <= 4 * 48 * 16  # two slices, not the 10 MB
    assert note == "more than 47 tokens (10,400,000 characters), truncated to the model's input length of 47 (+ EOS)"


def test_a_slice_too_short_for_the_length_is_widened_and_a_short_text_counted_exactly():
    vocabulary = WordVocabulary()
    long_words = ("x" * 40 + " ") * 100  # 41 characters a token: the first slice holds too few
    ids, note = encode_text(long_words, vocabulary, 48)
    assert ids == [42] * 47 + [1] and note.startswith("more than 47 tokens")
    assert len(vocabulary.encoded_characters) == 2  # one slice, then one 4x wider
    assert encode_text("a b c", WordVocabulary(), 48) == ([3, 3, 3, 1], None)
    _, note = encode_text("a b c d", WordVocabulary(), 3)
    assert note == "4 tokens, truncated to the model's input length of 2 (+ EOS)"


def test_the_truncation_note_of_a_target_names_the_target_length():
    _, note = encode_text("a b c d", WordVocabulary(), 3, feature="targets")
    assert note == "4 tokens, truncated to the model's target length of 2 (+ EOS)"

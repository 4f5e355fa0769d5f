import numpy as np
import pytest

from indexer.tokens import MAX_VOCAB_SIZE, SEPARATOR, Namespace, as_tokens


def test_separator_is_outside_every_vocabulary():
    # The separator must never be a valid id, even for the largest allowed vocabulary.
    assert int(SEPARATOR) == MAX_VOCAB_SIZE
    with pytest.raises(ValueError, match=f"id {MAX_VOCAB_SIZE} at position 0"):
        as_tokens([MAX_VOCAB_SIZE], MAX_VOCAB_SIZE)


def test_int32_array_passes_through():
    arr = np.array([0, 5, 9], dtype=np.int32)
    out = as_tokens(arr, 10)
    # Already valid int32: same values, same dtype.
    assert out.dtype == np.int32
    assert out.tolist() == [0, 5, 9]


def test_non_contiguous_int32_array_is_made_contiguous():
    arr = np.arange(10, dtype=np.int32)[::2]
    out = as_tokens(arr, 10)
    # A strided view is valid input; the result is a contiguous copy of the same ids.
    assert out.flags.c_contiguous
    assert out.tolist() == [0, 2, 4, 6, 8]


def test_python_list_is_converted_to_int32():
    out = as_tokens([1, 2, 3], 10)
    # Python ints are the one accepted input needing conversion.
    assert out.dtype == np.int32
    assert out.tolist() == [1, 2, 3]


def test_numpy_integer_scalars_in_a_list_are_accepted():
    out = as_tokens([np.int64(4), np.int32(7)], 10)
    # np.integer elements count as ints.
    assert out.dtype == np.int32
    assert out.tolist() == [4, 7]


def test_empty_list_gives_empty_int32_array():
    out = as_tokens([], 10)
    # No ids to check: an empty int32 array.
    assert out.dtype == np.int32
    assert out.size == 0


@pytest.mark.parametrize("dtype", [np.int64, np.int16, np.uint32, np.float32, np.float64, np.bool_])
def test_wrong_numpy_dtype_is_rejected(dtype):
    arr = np.array([1, 0, 1], dtype=dtype)
    # Non-int32 arrays are caller bugs and must not be silently cast.
    with pytest.raises(ValueError, match="dtype"):
        as_tokens(arr, 10)


def test_two_dimensional_array_is_rejected():
    arr = np.array([[1, 2], [3, 4]], dtype=np.int32)
    # Token arrays are flat.
    with pytest.raises(ValueError, match="1-D"):
        as_tokens(arr, 10)


def test_nested_list_is_rejected():
    # A list of lists is not a flat sequence of ints.
    with pytest.raises(ValueError):
        as_tokens([[1, 2], [3, 4]], 10)


def test_id_equal_to_vocab_size_names_id_and_position():
    # 10 is one past the last valid id of a 10-token vocabulary, at index 2.
    with pytest.raises(ValueError, match=r"id 10 at position 2 is outside the vocabulary \[0, 10\)"):
        as_tokens([1, 2, 10], 10)


def test_negative_id_names_id_and_position():
    arr = np.array([3, -1, 4], dtype=np.int32)
    # -1 is below the vocabulary; the first bad position is reported.
    with pytest.raises(ValueError, match=r"id -1 at position 1"):
        as_tokens(arr, 10)


def test_first_bad_id_is_reported():
    # Both 11 (position 1) and -5 (position 3) are bad; the earliest one is named.
    with pytest.raises(ValueError, match=r"id 11 at position 1"):
        as_tokens([0, 11, 2, -5], 10)


def test_what_label_prefixes_the_message():
    # The caller's label tells the user which argument was wrong.
    with pytest.raises(ValueError, match=r"^prompt: id 12"):
        as_tokens([12], 10, what="prompt")


def test_bools_are_rejected():
    # True is an int subclass but never a token id.
    with pytest.raises(ValueError, match="int"):
        as_tokens([1, True, 2], 10)


@pytest.mark.parametrize("bad", ["abc", b"abc"])
def test_strings_and_bytes_are_rejected(bad):
    # A string is a sequence, but of characters, not ids.
    with pytest.raises(ValueError, match="sequence of ints"):
        as_tokens(bad, 10)


def test_floats_and_strings_inside_a_list_are_rejected():
    # Every element must be an integer.
    with pytest.raises(ValueError, match="int"):
        as_tokens([1, 2.0], 10)
    with pytest.raises(ValueError, match="int"):
        as_tokens([1, "2"], 10)


def test_huge_python_int_is_rejected_not_wrapped():
    # 2**70 does not fit any integer dtype; it must not wrap into a valid id.
    with pytest.raises(ValueError):
        as_tokens([2**70], 10)


def test_namespace_valid():
    ns = Namespace(name="llama2", vocab_size=32000)
    # A plain name and positive vocabulary are stored as given.
    assert (ns.name, ns.vocab_size) == ("llama2", 32000)


@pytest.mark.parametrize("name", ["", "x" * 129, "bad\nname", "tab\there"])
def test_namespace_rejects_bad_names(name):
    # Names are 1-128 printable characters.
    with pytest.raises(ValueError, match="name"):
        Namespace(name=name, vocab_size=10)


def test_namespace_accepts_128_character_name():
    # 128 characters is the inclusive upper bound.
    assert Namespace(name="x" * 128, vocab_size=10).name == "x" * 128


@pytest.mark.parametrize("vocab", [0, -1, MAX_VOCAB_SIZE + 1])
def test_namespace_rejects_bad_vocab_sizes(vocab):
    # The vocabulary must be non-empty and leave room for the separator.
    with pytest.raises(ValueError, match="vocab_size"):
        Namespace(name="t", vocab_size=vocab)


def test_namespace_accepts_extreme_vocab_sizes():
    # 1 and MAX_VOCAB_SIZE are both inclusive bounds.
    assert Namespace(name="t", vocab_size=1).vocab_size == 1
    assert Namespace(name="t", vocab_size=MAX_VOCAB_SIZE).vocab_size == MAX_VOCAB_SIZE

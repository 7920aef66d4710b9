"""The byte tokenizer: lossless round trips, special ids, and errors for ids outside the vocabulary."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from ltm_jax.data.tokenizer import ByteTokenizer, get_tokenizer

TOK = ByteTokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200))
def test_round_trip_any_text(text):
  ids = TOK.encode(text)
  assert ids.dtype == np.int32 and ids.ndim == 1
  assert len(ids) == len(text.encode("utf-8"))
  assert TOK.decode(ids) == text


def test_encode_is_utf8_bytes():
  np.testing.assert_array_equal(TOK.encode("aé€"), [97, 0xC3, 0xA9, 0xE2, 0x82, 0xAC])
  assert TOK.encode("").shape == (0,)


def test_specials_and_sizes():
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.vocab_size) == (256, 257, 258, 259)
  assert TOK.bytes_per_token == 1.0
  assert TOK.decode([TOK.bos_id, 104, 105, TOK.eos_id, TOK.pad_id]) == "hi"
  assert TOK.decode([]) == ""


def test_decode_accepts_arrays_of_any_shape():
  ids = np.array([[104, 105], [TOK.eos_id, 33]], dtype=np.uint16)
  assert TOK.decode(ids) == "hi!"
  assert TOK.decode(x for x in [104, 105]) == "hi"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=100))
def test_decode_never_raises_in_vocab(ids):
  assert isinstance(TOK.decode(ids), str)


def test_invalid_utf8_is_replaced():
  assert TOK.decode([0xE2, 0x82]) == "\ufffd"  # A character cut in half, as in a truncated sample.
  assert TOK.decode([0xFF, 97]) == "\ufffda"


@pytest.mark.parametrize("bad", [[97, 259], [-1], [2**70]])
def test_decode_rejects_out_of_vocab(bad):
  with pytest.raises(ValueError):
    TOK.decode(bad)


def test_decode_rejects_floats():
  with pytest.raises(ValueError, match="integers"):
    TOK.decode(np.array([97.0]))


def test_get_tokenizer():
  assert isinstance(get_tokenizer("byte"), ByteTokenizer)
  with pytest.raises(ValueError, match="unknown tokenizer 'bpe'"):
    get_tokenizer("bpe")

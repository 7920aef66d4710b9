"""The RWKV World tokenizer: round trips, and the official tokenizer's ids (the `rwkv` package's TRIE_TOKENIZER) on
mixed-script sample text. Needs the vocabulary file, which the `rwkv` package ships."""

from __future__ import annotations

import importlib.util
import pathlib

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from ltm_jax.data.rwkv_world import VOCAB_FILE, RwkvWorldTokenizer, default_vocab_path
from ltm_jax.data.tokenizer import get_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("rwkv") is None,
                                reason="the RWKV World vocabulary comes with `pip install rwkv`")

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.\n\n",
    "def f(x):\n    return x ** 2  # squares\n\t\ttabs and    spaces",
    "Élan vital, naïve café — “quotes” … ½ ¾ ±",
    "中文分词测试：我们在北京天安门广场。日本語のテキストも。한국어 문장입니다.",
    "Emoji 🦆🚀👩‍👩‍👧 and math ∑_{i=1}^{n} i² = n(n+1)(2n+1)/6",
    "\x00\x01 control bytes \r\n and a long rule ################################################################",
    "",
]


@pytest.fixture(scope="module")
def tok():
  return get_tokenizer("rwkv_world")


@pytest.fixture(scope="module")
def official():
  from rwkv.rwkv_tokenizer import TRIE_TOKENIZER  # Pure Python; no torch import.
  return TRIE_TOKENIZER(str(default_vocab_path()))


def test_ids_match_the_official_tokenizer(tok, official):
  assert {i: b for i, b in enumerate(tok._id_to_bytes) if b} == official.idx2token  # Same 65,529 entries.
  for text in SAMPLES:
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    np.testing.assert_array_equal(ids, official.encode(text), err_msg=repr(text))
  long_text = "".join(SAMPLES) * 20
  np.testing.assert_array_equal(tok.encode(long_text), official.encode(long_text))
  assert len(tok.encode(SAMPLES[0])) < len(SAMPLES[0]) / 2  # Whole words, not bytes.


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=120))
def test_round_trip_any_text(tok, text):
  assert tok.decode(tok.encode(text)) == text


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="ab tehTH\n.,中文é", max_size=60))
def test_matches_official_on_random_text(tok, official, text):
  np.testing.assert_array_equal(tok.encode(text), official.encode(text))


def test_decode_specials_partial_characters_and_errors(tok):
  ids = tok.encode("héllo")
  assert tok.decode(np.concatenate([[0], ids, [0, 65535]])) == "héllo"  # End-of-text and unused ids vanish.
  assert tok.decode(np.array([ids, ids])) == "héllohéllo"  # Any shape, flattened.
  cut = tok.encode_bytes("€".encode("utf-8")[:2])
  assert tok.decode(cut) == "\ufffd"
  for bad in ([65536], [-1]):
    with pytest.raises(ValueError, match="outside"):
      tok.decode(bad)
  with pytest.raises(ValueError, match="integers"):
    tok.decode(np.array([1.0]))
  assert (tok.vocab_size, tok.eos_id, tok.bytes_per_token) == (65536, 0, None)


def test_vocabulary_from_a_given_path_and_a_clear_error_without_one(tmp_path, monkeypatch):
  small = tmp_path / "vocab.txt"
  small.write_text("".join(f"{i + 1} {bytes([i])!r} 1\n" for i in range(256))
                   + "257 'ab' 2\n258 'abc' 3\n259 b'\\xe2\\x82' 2\n", encoding="utf-8")
  t = RwkvWorldTokenizer(small)
  np.testing.assert_array_equal(t.encode("abcab a€"), [258, 257, 33, 98, 259, 0xAC + 1])
  assert t.decode(t.encode("abcab a€")) == "abcab a€"
  monkeypatch.setenv("LTM_RWKV_WORLD_VOCAB", str(tmp_path / "missing.txt"))
  with pytest.raises(FileNotFoundError, match="LTM_RWKV_WORLD_VOCAB"):
    RwkvWorldTokenizer()
  monkeypatch.setenv("LTM_RWKV_WORLD_VOCAB", str(small))
  assert RwkvWorldTokenizer().encode("abc").tolist() == [258]
  assert pathlib.Path(default_vocab_path()).name == "vocab.txt" and VOCAB_FILE.endswith(".txt")

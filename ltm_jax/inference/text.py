"""Generated tokens as text, for `LanguageModel.generate`/`stream` and the server's rows alike (one implementation).

  text = StopText(tokenizer, stop=("\\n\\n",))
  stopped = text.add(tokens)      # a row's next tokens (drawn before its end-of-text token)
  piece = text.take(final=False)  # the text not yet handed out, less what could begin a stop string
  text.close(); rest = text.take(final=True)

Tokens are decoded incrementally: a character split across tokens waits for its last byte, and bytes that are not
valid UTF-8 become U+FFFD, so the text is what decoding all the tokens at once gives. The text ends before the first
occurrence of any stop string (not included); while it goes on, its last len(longest stop) - 1 characters are held
back from `take`, since a stop string could begin there. `ends` records the text's length after each token, so the
tokens behind any prefix of the text can be counted (`tokens_behind`).
"""

from __future__ import annotations

import bisect
import codecs
from collections.abc import Sequence

import numpy as np


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
  """`stop` (None, a string, or a sequence of them) as a tuple of non-empty strings, or a one-line ValueError."""
  if stop is None:
    return ()
  stops = (stop,) if isinstance(stop, str) else stop
  if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
    raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}")
  return tuple(stops)


class StopText:
  """The text of one row's tokens, cut at the first stop string. `text`: the text so far (cut once `stopped`);
  `sent`: how much of it `take` has handed out."""

  def __init__(self, tokenizer, stop: Sequence[str] = ()):
    self.tokenizer, self.stop = tokenizer, tuple(stop)
    self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.text, self.sent = "", 0
    self.ends: list[int] = []  # len(text) after each token added.
    self.stopped = False
    self.hold = max((len(s) for s in self.stop), default=1) - 1

  def add(self, tokens) -> bool:
    """Appends the text of `tokens` (ids of text, not the end-of-text token) -> whether a stop string has ended the
    text. Once it has, further tokens are ignored."""
    if self.stopped:
      return True
    start = len(self.text)
    for token in np.asarray(tokens).reshape(-1):
      self.text += self.decoder.decode(self.tokenizer.decode_bytes(np.asarray([token])))
      self.ends.append(len(self.text))
    hits = [i for i in (self.text.find(s, max(start - len(s) + 1, 0)) for s in self.stop) if i >= 0]
    if hits:
      self.text, self.stopped = self.text[:min(hits)], True
    return self.stopped

  def close(self) -> None:
    """Ends the text without a stop string (end of text or of the token budget): the decoder's held bytes, an
    incomplete character, become U+FFFD."""
    if not self.stopped:
      self.text += self.decoder.decode(b"", final=True)
      if self.ends:
        self.ends[-1] = len(self.text)

  def take(self, final: bool) -> str:
    """The text not yet handed out; unless `final`, less the last characters that could begin a stop string."""
    end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
    piece, self.sent = self.text[self.sent:end], end
    return piece

  def tokens_behind(self, chars: int) -> int:
    """The tokens needed for the first `chars` characters of the text."""
    return 0 if chars <= 0 else min(bisect.bisect_left(self.ends, chars) + 1, len(self.ends))

  @property
  def returned(self) -> int:
    """The tokens behind the whole text (after a stop-string cut)."""
    return self.tokens_behind(len(self.text))

"""The embedded corpus: Python's own documentation (help topics and stdlib docstrings) as training text.

The embedded corpus needs no download: it is the English prose that ships with every CPython installation, i.e. the
`pydoc_data.topics` help pages (all topics, sorted by name) followed by the module, class and function docstrings of
the standard library, read by parsing the source files with `ast` (nothing is imported, so modules with import side
effects such as `this` or `antigravity` are never run). Test packages, site-packages and unreadable files are skipped,
docstrings shorter than `MIN_DOCSTRING_CHARS` are dropped (mostly one-line API notes, not prose) and exact duplicate
texts are kept once, so that no whole document sits on both sides of the split. Related documents still share
paragraphs: on CPython 3.11.7, 6,134 of the validation documents' 81,740 bytes (7.5%) are in paragraphs of 200 or more
characters that the training split also holds (e.g. `topic/augassign` repeats five of `topic/assignment`'s).

Every document has a stable name ("topic/<name>" or "<module path>:<qualname>") and goes to the validation split iff
`zlib.crc32(name) % 20 == 0` (about 5%), so the split never changes with the corpus order or size. Documents are joined
with a blank line rather than the eos token: every token stays a byte, which keeps bits-per-byte exact and lets the
corpus decode to plain text.

Size on CPython 3.11.7: 2,496 documents (146 validation); train 1,704,190 bytes, validation 82,030 bytes (4.6%).
`embedded_corpus_stats()` reports the figures for the running Python. A cold build parses ~730 files with `ast`, about
2 s on an idle core (dominated by `ast.parse`); the encoded result is cached under `$XDG_CACHE_HOME/ltm_jax` (default
`~/.cache/ltm_jax`), keyed by the Python version and the size/mtime of every source file, and loads in ~10-20 ms.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
import sysconfig
import tempfile
import textwrap
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ltm_jax.data.tokenizer import ByteTokenizer
from ltm_jax.errors import DataError

MIN_DOCSTRING_CHARS = 200
VAL_BUCKETS = 20  # crc32(name) % VAL_BUCKETS == 0 -> validation.
DOC_SEPARATOR = "\n\n"
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Bump when the extraction rules change so stale caches are not reused.
_FORMAT_VERSION = 2

log = logging.getLogger(__name__)


def _storage_dtype(vocab_size: int) -> np.dtype:
  # int32 per token would quadruple the memory of a byte-level corpus; the loader casts windows to int32.
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _encode(tokenizer: ByteTokenizer, text: str) -> np.ndarray:
  return tokenizer.encode(text).astype(_storage_dtype(tokenizer.vocab_size))


def is_validation_document(name: str) -> bool:
  """Whether the embedded document `name` belongs to the validation split."""
  return zlib.crc32(name.encode("utf-8")) % VAL_BUCKETS == 0


def _normalize(text: str) -> str:
  """Unix newlines, no tabs or trailing spaces, common indentation removed, at most one blank line in a row."""
  text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(8)
  text = "\n".join(line.rstrip() for line in textwrap.dedent(text).split("\n"))
  return re.sub(r"\n{3,}", "\n\n", text).strip()


def _stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: pathlib.Path) -> list[str]:
  """Relative POSIX paths of the standard library's .py files, in sorted walk order, without tests."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
    rel_dir = pathlib.Path(dirpath).relative_to(root)
    found += [(rel_dir / f).as_posix() for f in sorted(filenames) if f.endswith(".py")]
  return found


_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")  # Statement lists that may hold a def.
_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.TryStar, ast.Match,
             ast.ExceptHandler, ast.match_case)


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, str]]:
  """(qualname, docstring) of the module ("") and of every class/function, including ones nested in if/try blocks."""
  stack = [(tree, "")]
  while stack:  # An explicit stack: deeply nested code must not hit the recursion limit.
    node, qual = stack.pop()
    if isinstance(node, (ast.Module, *_DEFS)):
      doc = ast.get_docstring(node, clean=True)
      if doc:
        yield qual, doc
    children = []
    # Only statement blocks are walked: expressions cannot define a class or function, and skipping them is most of
    # the tree.
    for field in _BLOCKS:
      for child in getattr(node, field, ()):
        if isinstance(child, _DEFS):
          children.append((child, f"{qual}.{child.name}" if qual else child.name))
        elif isinstance(child, _COMPOUND):
          children.append((child, qual))
    stack.extend(reversed(children))


def embedded_documents() -> list[tuple[str, str]]:
  """The embedded corpus as (name, text) pairs: help topics by name, then stdlib docstrings in file order.

  Deterministic for a given Python installation.
  """
  try:
    from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  except ImportError:  # Some distributions strip pydoc_data; the docstrings are still there.
    topics = {}
  docs = [(f"topic/{name}", _normalize(topics[name])) for name in sorted(topics)]
  root = _stdlib_root()
  with warnings.catch_warnings():
    # Parsing can warn (e.g. about escape sequences in newer Pythons); the text is still good, and warnings-as-errors
    # test runs must not turn a corpus build into a failure.
    warnings.simplefilter("ignore")
    for rel in _stdlib_files(root):
      try:
        tree = ast.parse((root / rel).read_bytes(), filename=rel)
      except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        continue  # Unreadable or not valid for this Python (e.g. templates): not part of the corpus.
      for qual, doc in _docstrings(tree):
        docs.append((f"{rel}:{qual}" if qual else rel, _normalize(doc)))
  seen_texts, name_counts, unique = set(), {}, []
  for name, text in docs:
    if (name.startswith("topic/") or len(text) >= MIN_DOCSTRING_CHARS) and text and text not in seen_texts:
      seen_texts.add(text)
      # A function defined in both branches of an `if` has one qualname for two texts; numbering keeps names unique.
      name_counts[name] = name_counts.get(name, 0) + 1
      unique.append((name if name_counts[name] == 1 else f"{name}#{name_counts[name]}", text))
  return unique


def _build_embedded(tokenizer: ByteTokenizer) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
  docs = embedded_documents()
  val_docs = [text for name, text in docs if is_validation_document(name)]
  train_docs = [text for name, text in docs if not is_validation_document(name)]
  train_text, val_text = DOC_SEPARATOR.join(train_docs), DOC_SEPARATOR.join(val_docs)
  meta = {
      "python": sys.version.split()[0],
      "documents": len(docs),
      "train_documents": len(train_docs),
      "val_documents": len(val_docs),
      "train_bytes": len(train_text.encode("utf-8")),
      "val_bytes": len(val_text.encode("utf-8")),
  }
  return _encode(tokenizer, train_text), _encode(tokenizer, val_text), meta


def default_cache_dir() -> pathlib.Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "ltm_jax"


def _cache_key(tokenizer: ByteTokenizer) -> str:
  """Changes with the Python build, the extraction rules, the tokenizer, or any stdlib source file (size/mtime)."""
  root = _stdlib_root()
  files = []
  for rel in _stdlib_files(root):
    try:
      st = (root / rel).stat()
    except OSError:
      continue
    files.append((rel, st.st_size, st.st_mtime_ns))
  payload = json.dumps([_FORMAT_VERSION, tokenizer.name, sys.version, sys.implementation.name, str(root), files])
  return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:20]


def _cache_path(tokenizer: ByteTokenizer, cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
  folder = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
  version = ".".join(map(str, sys.version_info[:3]))
  return folder / f"embedded-py{version}-{tokenizer.name}-{_cache_key(tokenizer)}.npz"


def _read_cache(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]] | None:
  try:
    with np.load(path, allow_pickle=False) as z:
      return z["train"], z["val"], json.loads(str(z["meta"]))
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
    return None  # Missing or damaged: rebuild.


def _write_cache(path: pathlib.Path, train: np.ndarray, val: np.ndarray, meta: dict[str, Any]) -> None:
  """Writes to a temporary file and renames it, so a concurrent reader never sees half a file."""
  tmp = None
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      np.savez(f, train=train, val=val, meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)
  except OSError as e:
    log.info("not caching the embedded corpus at %s: %s", path, e)
    if tmp is not None and os.path.exists(tmp):
      os.unlink(tmp)


def _load_embedded(tokenizer: ByteTokenizer, cache_dir: str | os.PathLike[str] | None = None,
                   use_cache: bool = True) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
  path = _cache_path(tokenizer, cache_dir) if use_cache else None
  cached = _read_cache(path) if path is not None and path.exists() else None
  if cached is not None:
    return cached
  train, val, meta = _build_embedded(tokenizer)
  if not len(train) or not len(val):
    raise DataError(f"the embedded corpus of this Python ({_stdlib_root()}) is empty: no documentation found")
  if path is not None:
    _write_cache(path, train, val, meta)
  return train, val, meta


def embedded_corpus(tokenizer: ByteTokenizer | None = None, *, cache_dir: str | os.PathLike[str] | None = None,
                    use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """(train, val) token ids of the embedded corpus, 1-D uint16. `use_cache=False` always builds afresh."""
  train, val, _ = _load_embedded(tokenizer or ByteTokenizer(), cache_dir, use_cache)
  return train, val


def embedded_corpus_stats(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
  """Sizes of the embedded corpus for this Python: documents, bytes and tokens of each split."""
  train, val, meta = _load_embedded(ByteTokenizer(), cache_dir)
  return {**meta, "train_tokens": len(train), "val_tokens": len(val)}

"""A real-text corpus of Python source code, built offline from the .py files of installed distributions.

`build(specs, out)` reads the .py files that each distribution records in its RECORD (found with
`importlib.metadata`; nothing is imported) and writes a corpus folder that `load_splits(DataConfig(source=out), ...)`
reads:

  train.txt, val.txt  the kept files' texts joined with `DOC_SEPARATOR`, in the fixed order below.
  manifest.json       the builder format, the Python version and platform, each distribution's name and version,
                      file counts, bytes per split, the sha256 of both text files and `corpus_sha256`, the corpus
                      identity.

A spec is `name` or `name==version`; a distribution that is not installed, or installed at another version than
pinned, is refused before anything is written. Names are compared in their normalised form (lower case, runs of
`-_.` as one `-`), which is also the name used in the order and the split.

Which files: every recorded `.py` file inside the installation folder (files recorded outside it, such as scripts
in bin/, and anything under `__pycache__` are left out). Files larger than `max_file_bytes` (mostly generated
tables), files that are not valid UTF-8 and files holding only whitespace are skipped and counted; newlines are
normalised to "\\n", and a text equal to one already kept (same sha256) is kept once, counted as a duplicate. Files are
taken in a fixed order, sorted by (normalised distribution name, recorded path as POSIX), and a file goes to
validation iff `zlib.crc32(f"{name}/{path}") % VAL_BUCKETS == 0` (about 5%), so the split of a file never changes
with the set of packages.

Reproducibility: only the files' texts and the recorded relative paths enter the corpus, never absolute paths,
mtimes or the order of the file system, so the same distributions at the same versions give the same
`corpus_sha256` on any machine that installed the same wheels. Some of the default packages ship compiled wheels per
Python version and platform (grain, hypothesis, jaxlib, matplotlib, numpy, scipy, torch), whose Python files may
differ between platforms (numpy's generated `__config__.py` records its build); the manifest names the Python
version. `corpus_sha256` is the sha256 of the text `sha256sum train.txt val.txt` prints in the corpus folder, so
`sha256sum train.txt val.txt | sha256sum` checks it.

`DEFAULT_PACKAGES` pins the JAX stack this project depends on (with jaxlib and scipy, which jax requires), its test
tools and torch's CPU build (the Makefile's pin): all installed by `pip install -e '.[dev,convert]'`. The pins are
the exact versions the hash below was measured with; apart from torch, their versions float in pyproject.toml, and a
machine that installed another version is refused (build with the versions it has, named explicitly, for a corpus
of another identity). Measured with CPython 3.11.7 on Linux x86_64 (manylinux wheels): 5,535 files kept (5,267
train, 268 validation), 48 duplicates, 154 empty, 1 oversized (torch's 1.4 MB
`testing/_internal/common_methods_invocations.py`), none undecodable; train.txt 107,380,130 bytes, val.txt
5,806,196 bytes (5.1%); corpus_sha256 79bf11a7ed6ecf4a316b63402fe17c7b0317421e12bd94ae0b2e2ac1494ad810. The build
takes 1.5-2 s on a 2-core machine (plus ~5 s for `python -m` to import the `ltm_jax` package).

Command line: `python -m ltm_jax.data.pycorpus --out DIR [--max-file-bytes N] [--overwrite] [SPEC ...]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import secrets
import shutil
import sys
import sysconfig
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from ltm_jax.data.embedded import DOC_SEPARATOR
from ltm_jax.errors import DataError, LtmError, first_line

FORMAT_VERSION = 1
VAL_BUCKETS = 20  # crc32(f"{name}/{path}") % VAL_BUCKETS == 0 -> validation.
MAX_FILE_BYTES = 1_000_000
TRAIN_FILE = "train.txt"
VAL_FILE = "val.txt"
MANIFEST_FILE = "manifest.json"
_SEPARATOR = DOC_SEPARATOR.encode("utf-8")

DEFAULT_PACKAGES = (
    "absl-py==2.5.1",
    "chex==0.1.92",
    "flax==0.12.8",
    "grain==0.2.18",
    "hypothesis==6.170.17",
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "matplotlib==3.11.2",
    "numpy==2.3.5",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "pytest==9.2.0",
    "scipy==1.17.1",
    "torch==2.13.0+cpu",
)

_SPEC = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:==\s*(\S+)\s*)?$")


@dataclasses.dataclass(frozen=True)
class _Package:
  """An installed distribution that passed its spec's checks."""
  name: str  # Normalised name: the key of the order and of the split.
  version: str
  dist: importlib.metadata.Distribution


@dataclasses.dataclass
class _Counts:
  kept: int = 0
  duplicates: int = 0
  undecodable: int = 0
  oversized: int = 0
  empty: int = 0


def normalize_name(name: str) -> str:
  """A distribution name as pip compares it: lower case, every run of `-`, `_` and `.` as one `-`."""
  return re.sub(r"[-_.]+", "-", name).lower()


def is_validation_file(name: str, path: str) -> bool:
  """Whether file `path` (as recorded, POSIX) of distribution `name` (normalised) belongs to the validation split."""
  return zlib.crc32(f"{name}/{path}".encode("utf-8")) % VAL_BUCKETS == 0


def _parse_spec(spec: str) -> tuple[str, str | None]:
  match = _SPEC.match(spec)
  if not match:
    raise DataError(f"bad package spec {spec!r}: use NAME or NAME==VERSION")
  return match.group(1), match.group(2)


def _resolve(specs: Iterable[str]) -> list[_Package]:
  """The installed distributions of `specs`, sorted by name; DataError names the first one that does not fit."""
  packages: dict[str, _Package] = {}
  pins: dict[str, str | None] = {}
  for spec in specs:
    name, pinned = _parse_spec(spec)
    key = normalize_name(name)
    if key in pins and None not in (pins[key], pinned) and pins[key] != pinned:
      raise DataError(f"package {name} is pinned twice, to {pins[key]} and {pinned}")
    try:
      dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      install = f"{name}=={pinned}" if pinned else name
      raise DataError(f"package {name!r} is not installed (pip install '{install}')") from None
    if pinned is not None and dist.version != pinned:
      raise DataError(f"package {name} is {dist.version}, pinned {pinned}")
    if dist.files is None:
      raise DataError(f"package {name} {dist.version} has no RECORD of its files")
    pins[key] = pinned or pins.get(key)
    packages[key] = _Package(key, dist.version, dist)
  if not packages:
    raise DataError("no packages given")
  return [packages[key] for key in sorted(packages)]


def _source_paths(package: _Package) -> list[str]:
  """Recorded .py paths inside the installation folder, outside __pycache__, sorted."""
  paths = set()
  for f in package.dist.files or ():
    parts = pathlib.PurePosixPath(f.as_posix()).parts
    if f.suffix == ".py" and parts and parts[0] != "/" and ".." not in parts and "__pycache__" not in parts:
      paths.add(f.as_posix())
  return sorted(paths)


def _read_source(package: _Package, path: str, max_file_bytes: int) -> tuple[str, str]:
  """(text with "\\n" newlines, "") for a kept file, or ("", reason) with reason "oversized", "undecodable" or
  "empty"."""
  location = pathlib.Path(package.dist.locate_file(path))
  try:
    if location.stat().st_size > max_file_bytes:
      return "", "oversized"
    data = location.read_bytes()
  except OSError as e:
    raise DataError(f"package {package.name} {package.version}: cannot read {path}: {e.strerror or e}") from e
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    return "", "undecodable"
  text = text.replace("\r\n", "\n").replace("\r", "\n")
  return (text, "") if text.strip() else ("", "empty")


class _SplitWriter:
  """Writes UTF-8 texts joined with DOC_SEPARATOR to a file, hashing and counting the bytes written."""

  def __init__(self, path: pathlib.Path):
    self._file = open(path, "wb")  # pylint: disable=consider-using-with
    self.sha256 = hashlib.sha256()
    self.bytes = 0
    self.files = 0

  def add(self, data: bytes) -> None:
    for chunk in ((_SEPARATOR, data) if self.files else (data,)):
      self._file.write(chunk)
      self.sha256.update(chunk)
      self.bytes += len(chunk)
    self.files += 1

  def close(self) -> None:
    self._file.close()


def _write_splits(packages: Sequence[_Package], folder: pathlib.Path,
                  max_file_bytes: int) -> tuple[dict[str, _SplitWriter], _Counts, list[dict[str, Any]]]:
  """Writes train.txt and val.txt into `folder`; returns the writers, the file counts and per-package sizes."""
  writers = {TRAIN_FILE: _SplitWriter(folder / TRAIN_FILE), VAL_FILE: _SplitWriter(folder / VAL_FILE)}
  counts, seen, per_package = _Counts(), set(), []
  try:
    for package in packages:
      kept = kept_bytes = 0
      for path in _source_paths(package):
        text, skipped = _read_source(package, path, max_file_bytes)
        if skipped:
          setattr(counts, skipped, getattr(counts, skipped) + 1)
          continue
        data = text.encode("utf-8")
        digest = hashlib.sha256(data).digest()
        if digest in seen:
          counts.duplicates += 1
          continue
        seen.add(digest)
        writers[VAL_FILE if is_validation_file(package.name, path) else TRAIN_FILE].add(data)
        kept, kept_bytes = kept + 1, kept_bytes + len(data)
      counts.kept += kept
      per_package.append({"name": package.name, "version": package.version, "files": kept, "bytes": kept_bytes})
  finally:
    for writer in writers.values():
      writer.close()
  return writers, counts, per_package


def _corpus_sha256(digests: dict[str, str]) -> str:
  """The sha256 of what `sha256sum train.txt val.txt` prints for these digests."""
  listing = "".join(f"{digests[name]}  {name}\n" for name in (TRAIN_FILE, VAL_FILE))
  return hashlib.sha256(listing.encode("utf-8")).hexdigest()


def _manifest(packages: Sequence[_Package], writers: dict[str, _SplitWriter], counts: _Counts,
              per_package: list[dict[str, Any]], max_file_bytes: int) -> dict[str, Any]:
  digests = {name: writer.sha256.hexdigest() for name, writer in writers.items()}
  return {
      "format_version": FORMAT_VERSION,
      "python": sys.version.split()[0],
      "platform": sysconfig.get_platform(),
      "packages": per_package,
      "specs": [f"{p.name}=={p.version}" for p in packages],
      "max_file_bytes": max_file_bytes,
      "val_buckets": VAL_BUCKETS,
      "files": {**dataclasses.asdict(counts), "train": writers[TRAIN_FILE].files, "val": writers[VAL_FILE].files},
      "bytes": {"train": writers[TRAIN_FILE].bytes, "val": writers[VAL_FILE].bytes},
      "sha256": digests,
      "corpus_sha256": _corpus_sha256(digests),
  }


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
  if out.exists() and not out.is_dir():
    raise DataError(f"output {out} exists and is not a folder")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise DataError(f"output folder {out} exists and is not empty (use overwrite=True, or --overwrite)")


def _move_into_place(tmp: pathlib.Path, out: pathlib.Path) -> None:
  """Renames `tmp` to `out`; a folder already at `out` is moved aside first and removed once `tmp` is in place."""
  old = None
  if out.is_dir():
    if any(out.iterdir()):
      old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
      os.rename(out, old)
    else:
      out.rmdir()
  try:
    os.rename(tmp, out)
  except OSError:
    if old is not None:
      os.rename(old, out)
    raise
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def build(specs: Iterable[str], out: str | os.PathLike[str], *, max_file_bytes: int = MAX_FILE_BYTES,
          overwrite: bool = False) -> dict[str, Any]:
  """Writes the corpus of `specs` (`name` or `name==version`, e.g. `DEFAULT_PACKAGES`) into the folder `out` and
  returns its manifest.

  The folder is written under a temporary name beside `out` and renamed into place, so `out` is either untouched or
  complete. Raises DataError, before anything is written, for a bad spec, a package that is not installed or not at
  its pinned version, a non-positive `max_file_bytes`, or an `out` that exists and is not empty (unless
  `overwrite`), and for a set of packages without a single kept file.
  """
  if not isinstance(max_file_bytes, int) or max_file_bytes <= 0:
    raise DataError(f"max_file_bytes must be a positive integer, got {max_file_bytes!r}")
  packages = _resolve([specs] if isinstance(specs, str) else specs)
  out = pathlib.Path(out).expanduser().absolute()
  _check_out(out, overwrite)
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
  except OSError as e:
    raise DataError(f"cannot create the output folder {out}: {e.strerror or e}") from e
  try:
    writers, counts, per_package = _write_splits(packages, tmp, max_file_bytes)
    if not counts.kept:
      raise DataError(f"no .py files to keep in {', '.join(p.name for p in packages)}")
    manifest = _manifest(packages, writers, counts, per_package, max_file_bytes)
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    _check_out(out, overwrite)
    _move_into_place(tmp, out)
  except OSError as e:
    raise DataError(f"cannot write the corpus to {out}: {e.strerror or e}") from e
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)
  return manifest


def summary(manifest: dict[str, Any], out: str | os.PathLike[str]) -> str:
  """One line: where the corpus is, its files, megabytes per split and hash."""
  files, size = manifest["files"], manifest["bytes"]
  return (f"{out}: {files['kept']:,} files from {len(manifest['packages'])} packages "
          f"(train {size['train'] / 1e6:.1f} MB, val {size['val'] / 1e6:.1f} MB; skipped {files['duplicates']:,} "
          f"duplicates, {files['undecodable']:,} undecodable, {files['oversized']:,} oversized, "
          f"{files['empty']:,} empty), corpus sha256 {manifest['corpus_sha256']}")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m ltm_jax.data.pycorpus",
      description="Build a corpus folder (train.txt, val.txt, manifest.json) from the .py files of installed "
                  "Python distributions.")
  p.add_argument("--out", required=True, help="the corpus folder to write (must not exist or be empty)")
  p.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES,
                 help=f"skip files larger than this (default {MAX_FILE_BYTES:,})")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
  p.add_argument("specs", nargs="*", metavar="SPEC",
                 help="NAME or NAME==VERSION of an installed distribution (default: DEFAULT_PACKAGES)")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:
    manifest = build(args.specs or DEFAULT_PACKAGES, args.out, max_file_bytes=args.max_file_bytes,
                     overwrite=args.overwrite)
  except LtmError as e:
    if os.environ.get("LTM_DEBUG"):
      raise
    print(f"error: {first_line(e)}", file=sys.stderr)
    return 2
  print(summary(manifest, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())

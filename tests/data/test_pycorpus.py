"""The Python source corpus: file selection, the split, the manifest's hash, refusals and load_splits reading it."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from ltm_jax.config import DataConfig
from ltm_jax.data import pycorpus
from ltm_jax.data.corpus import load_splits
from ltm_jax.data.embedded import DOC_SEPARATOR
from ltm_jax.errors import DataError

NAME = "ltm-fake-corpus"
VERSION = "1.0"
PKG = "fakecorpus"
CAP = 4000  # max_file_bytes of the builds below; table.py is larger.
N_MODULES = 40


def _module(i):
  return f"# module {i:03d}\n" + "".join(f"def f{i}_{j}(x):\n  return x * {j} + {i}\n" for j in range(8))


def _files():
  """Relative path -> bytes of the fake distribution, in no particular order."""
  files = {f"{PKG}/mod_{i:02d}.py": _module(i).encode() for i in range(N_MODULES)}
  files.update({
      f"{PKG}/__init__.py": b"",  # Empty: skipped.
      f"{PKG}/zz_copy.py": _module(3).encode(),  # Same text as mod_03.py, which comes first: a duplicate.
      f"{PKG}/latin1.py": b"# caf\xe9\nx = 1\n",  # Not UTF-8.
      f"{PKG}/table.py": b"x = 1\n" * 1000,  # Larger than CAP.
      f"{PKG}/crlf.py": b"a = 1\r\nb = 2\r\n",  # Kept with \n newlines.
      f"{PKG}/__pycache__/stale.py": b"stale = True\n",  # Under __pycache__: skipped.
      f"{PKG}/notes.txt": b"not python\n",  # Not .py: skipped.
  })
  return files


def _make_site(root):
  """A site folder holding the fake distribution: its files and a .dist-info with METADATA and RECORD."""
  files = _files()
  info = root / f"{NAME.replace('-', '_')}-{VERSION}.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n")
  for rel, data in files.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
  record = [f"{rel},sha256=,{len(data)}" for rel, data in files.items()]
  record += ["../../bin/fake_tool.py,,", f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]  # Outside: skipped.
  (info / "RECORD").write_text("\n".join(record) + "\n")
  return root


@pytest.fixture(name="site")
def fixture_site(tmp_path, monkeypatch):
  site = _make_site(tmp_path / "site")
  monkeypatch.syspath_prepend(str(site))
  return site


def _expected_splits():
  """train.txt and val.txt as the rules give them: kept texts in path order, split by crc32."""
  kept = sorted([f"{PKG}/mod_{i:02d}.py" for i in range(N_MODULES)] + [f"{PKG}/crlf.py"])
  sides = {True: [], False: []}
  for rel in kept:
    text = _files()[rel].decode().replace("\r\n", "\n")
    sides[pycorpus.is_validation_file(NAME, rel)].append(text)
  return DOC_SEPARATOR.join(sides[False]), DOC_SEPARATOR.join(sides[True])


def _build(out, *specs, **kw):
  return pycorpus.build(specs or (f"{NAME}=={VERSION}",), out, max_file_bytes=CAP, **kw)


def test_files_counts_split_and_manifest(site, tmp_path):
  del site
  out = tmp_path / "corpus"
  manifest = _build(out)
  train, val = _expected_splits()
  assert val, "the fixture must put at least one file in validation"
  assert (out / "train.txt").read_bytes() == train.encode()
  assert (out / "val.txt").read_bytes() == val.encode()
  assert "\r" not in train + val and "stale" not in train + val and "caf" not in train + val
  assert manifest["files"] == {"kept": N_MODULES + 1, "duplicates": 1, "undecodable": 1, "oversized": 1, "empty": 1,
                               "train": N_MODULES + 1 - val.count("# module"), "val": val.count("# module")}
  assert manifest["bytes"] == {"train": len(train.encode()), "val": len(val.encode())}
  assert manifest["packages"] == [{"name": NAME, "version": VERSION, "files": N_MODULES + 1,
                                   "bytes": len((train + val).encode()) - len(DOC_SEPARATOR) * (N_MODULES - 1)}]
  assert manifest["sha256"] == {"train.txt": hashlib.sha256(train.encode()).hexdigest(),
                                "val.txt": hashlib.sha256(val.encode()).hexdigest()}
  listing = f"{manifest['sha256']['train.txt']}  train.txt\n{manifest['sha256']['val.txt']}  val.txt\n"
  assert manifest["corpus_sha256"] == hashlib.sha256(listing.encode()).hexdigest()
  assert json.loads((out / "manifest.json").read_text()) == manifest
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "site"]  # No temporary folder left behind.


def test_same_inputs_same_hash_wherever_installed(site, tmp_path, monkeypatch):
  first = _build(tmp_path / "a")
  again = pycorpus.build(NAME.replace("-", "_").upper(), tmp_path / "b", max_file_bytes=CAP)  # One unpinned spec.
  elsewhere = shutil.copytree(site, tmp_path / "deeper" / "other-site")
  monkeypatch.syspath_prepend(str(elsewhere))
  moved = _build(tmp_path / "c")
  assert first["corpus_sha256"] == again["corpus_sha256"] == moved["corpus_sha256"]
  assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "c" / "manifest.json").read_bytes()


@pytest.mark.parametrize("specs, message", [
    ((f"{NAME}=={VERSION}", "ltm-no-such-distribution"), r"^package 'ltm-no-such-distribution' is not installed"),
    ((f"{NAME}==2.0",), rf"^package {NAME} is {VERSION}, pinned 2\.0$"),
    ((f"{NAME}=={VERSION}", f"{NAME}==2.0"), rf"^package {NAME} is pinned twice"),
    ((f"{NAME}>=1",), "bad package spec"),
])
def test_refused_specs_write_nothing(site, tmp_path, specs, message):
  del site
  out = tmp_path / "out" / "corpus"
  with pytest.raises(DataError, match=message) as e:
    _build(out, *specs)
  assert "\n" not in str(e.value)
  assert not (tmp_path / "out").exists()


def test_existing_folder(site, tmp_path):
  del site
  out = tmp_path / "corpus"
  out.mkdir()
  _build(out)  # Empty: used.
  (out / "keep.txt").write_text("mine")
  with pytest.raises(DataError, match="exists and is not empty") as e:
    _build(out)
  assert "\n" not in str(e.value)
  assert (out / "keep.txt").read_text() == "mine"
  _build(out, overwrite=True)
  assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train.txt", "val.txt"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "site"]


def test_failed_build_leaves_no_folder(site, tmp_path, monkeypatch):
  del site
  calls, read = [], pycorpus._read_source

  def failing(*args):
    calls.append(args)
    if len(calls) == 10:
      raise DataError("disk trouble")
    return read(*args)

  monkeypatch.setattr(pycorpus, "_read_source", failing)
  with pytest.raises(DataError, match="disk trouble"):
    _build(tmp_path / "corpus")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_load_splits_reads_train_and_val(site, tmp_path):
  del site
  out = tmp_path / "corpus"
  manifest = _build(out)
  splits = load_splits(DataConfig(source=str(out)), 259, 16)
  assert len(splits.train) == (out / "train.txt").stat().st_size == manifest["bytes"]["train"]
  assert len(splits.val) == (out / "val.txt").stat().st_size == manifest["bytes"]["val"]
  assert bytes(splits.val.astype("uint8")) == (out / "val.txt").read_bytes()


def test_cli(site, tmp_path, capsys):
  del site
  out = tmp_path / "corpus"
  assert pycorpus.main(["--out", str(out), "--max-file-bytes", str(CAP), f"{NAME}=={VERSION}"]) == 0
  printed = capsys.readouterr().out.strip().splitlines()
  manifest = json.loads((out / "manifest.json").read_text())
  assert len(printed) == 1 and manifest["corpus_sha256"] in printed[0] and "41 files" in printed[0]
  assert pycorpus.main(["--out", str(out), f"{NAME}=={VERSION}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: output folder") and "not empty" in err[0]


def test_default_packages_are_pinned():
  for spec in pycorpus.DEFAULT_PACKAGES:
    _, version = pycorpus._parse_spec(spec)
    assert version is not None, spec
  assert list(pycorpus.DEFAULT_PACKAGES) == sorted(pycorpus.DEFAULT_PACKAGES)

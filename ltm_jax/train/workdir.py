"""One writer per workdir: an exclusive OS lock held for a training run's lifetime, and a check that the checkpoints
folder can be written before any step runs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import tempfile

from ltm_jax.errors import WorkdirError

LOCK = ".ltm-train.lock"  # Holds the PID of the run that holds the lock; the lock itself is flock(2) on this file.


@contextlib.contextmanager
def exclusive(workdir: str | pathlib.Path):
  """Holds an exclusive flock on WORKDIR/.ltm-train.lock, or raises WorkdirError naming the holder's PID.

  The OS releases the lock when its process exits in any way (kill -9 included), so a lock file left behind by a dead
  run never blocks the next one."""
  workdir = pathlib.Path(workdir)
  _check_directory(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  path = workdir / LOCK
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
        raise WorkdirError(f"cannot lock {path}: {e.strerror}") from e
      holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
      raise WorkdirError(f"{workdir} is in use by another training run (pid {holder}); wait for it to finish or "
                         "stop it, or use another workdir") from None
    pid = f"{os.getpid()}\n".encode()
    if os.pread(fd, 64, 0) != pid:  # Unchanged when this process held it before (an mtime is a change too).
      os.ftruncate(fd, 0)
      os.pwrite(fd, pid, 0)
    yield
  finally:
    os.close(fd)  # Closing the descriptor releases the lock.


def check_writable(folder: str | pathlib.Path) -> None:
  """WorkdirError at once (not after a save times out) when files cannot be created in `folder`."""
  folder = pathlib.Path(folder)
  _check_directory(folder)
  try:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
      pass
  except OSError as e:
    raise WorkdirError(f"cannot write in {folder}: {e.strerror or e}") from e


def _check_directory(path: pathlib.Path) -> None:
  if path.exists() and not path.is_dir():
    raise WorkdirError(f"{path} is a file, not a directory")

"""One writer per workdir: an exclusive OS lock held for a training run's lifetime, a check that the checkpoints
folder can be written before any step runs, and one that a workdir whose logs say it trained still holds a checkpoint.
None writes anything: a run refused by them, or by any later check, leaves the workdir as it found it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib

from ltm_jax.errors import WorkdirError


@contextlib.contextmanager
def exclusive(workdir: str | pathlib.Path):
  """Holds an exclusive flock(2) on the WORKDIR directory itself (created if absent), or raises WorkdirError naming
  the holder's PID (from /proc/locks where the OS has one, else "unknown").

  The lock needs no file, so taking it changes nothing in the workdir. The OS releases it when its process exits in
  any way (kill -9 included), so a dead run never blocks the next one."""
  workdir = pathlib.Path(workdir)
  _check_directory(workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # A file on the path, no permission, ...
    raise WorkdirError(f"cannot create {workdir}: {e.strerror}") from e
  try:
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
  except OSError as e:
    raise WorkdirError(f"cannot open {workdir}: {e.strerror}") from e
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
        raise WorkdirError(f"cannot lock {workdir}: {e.strerror}") from e
      raise WorkdirError(f"{workdir} is in use by another training run (pid {_holder(fd)}); wait for it to finish "
                         "or stop it, or use another workdir") from None
    yield
  finally:
    os.close(fd)  # Closing the descriptor releases the lock.


def _holder(fd: int) -> str:
  """The PID holding a flock on the file of `fd`, read from /proc/locks ("unknown" where it cannot be read)."""
  st = os.fstat(fd)
  inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
  try:
    with open("/proc/locks") as f:
      lines = f.read().splitlines()
  except OSError:
    return "unknown"
  for line in lines:
    fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"
    if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
      return fields[4]
  return "unknown"


def check_writable(folder: str | pathlib.Path) -> None:
  """WorkdirError at once (not after a save times out) when `folder` is a file, or when files cannot be created in
  it (in its nearest existing parent if it does not exist yet). Asks the OS (access(2), which also reports a
  read-only file system) instead of writing a test file, so the check changes nothing."""
  folder = pathlib.Path(folder).absolute()
  _check_directory(folder)
  existing = folder
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise WorkdirError(f"cannot write in {folder}: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    reason = "read-only file system" if _read_only(existing) else "permission denied"
    raise WorkdirError(f"cannot write in {folder}: {reason}")


def check_checkpoints_kept(workdir: str | pathlib.Path, logged: list[dict], start_over: str | None = None) -> None:
  """WorkdirError when metrics.jsonl logs training (`logged`: its rows) but WORKDIR/checkpoints holds no checkpoint,
  readable or not (emptied or deleted): starting over would replace a trained run's logs. `start_over` says how to
  start over (default: delete the workdir or train in another). Creates nothing."""
  from ltm_jax.train import checkpoint as ckpt_lib  # Deferred: checkpointing imports orbax.
  workdir = pathlib.Path(workdir)
  if not logged or not (workdir / "checkpoints").is_dir():
    kept = False
  else:
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
    try:
      kept = bool(checkpointer.all_steps())
    finally:
      checkpointer.close()
  if logged and not kept:
    raise WorkdirError(f"{workdir} holds no checkpoint, but its metrics.jsonl logs training up to step "
                       f"{max(row['step'] for row in logged)}; to start over, " +
                       (start_over or f"delete {workdir} or train in another workdir"))


def _read_only(path: pathlib.Path) -> bool:
  with contextlib.suppress(OSError):
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  return False


def _check_directory(path: pathlib.Path) -> None:
  if path.exists() and not path.is_dir():
    raise WorkdirError(f"{path} is a file, not a directory")

"""Errors raised for bad input. The CLI prints them as one line and exits non-zero."""


def first_line(error: BaseException, limit: int = 300) -> str:
  """An exception's message cut to its first line (and `limit` characters): errors are reported on one line."""
  text = str(error).strip()
  return (text.splitlines()[0] if text else type(error).__name__)[:limit]


class LtmError(Exception):
  """Base class: a problem with the user's input, reported without a traceback."""


class ConfigError(LtmError):
  """An unknown key, a value of the wrong type, or values that do not fit together."""


class DataError(LtmError):
  """A missing or empty corpus, or token ids outside the vocabulary."""


class CheckpointError(LtmError):
  """A workdir whose checkpoint does not belong to the configured model, or that has none that can be read."""


class DamagedCheckpointError(CheckpointError):
  """One checkpoint whose files cannot be read or do not match their checksums."""

  def __init__(self, step: int, reason: str):
    super().__init__(f"checkpoint step {step} cannot be read: {reason}")
    self.step = step


class ShapeMismatchError(CheckpointError):
  """A checkpoint whose arrays have other shapes than the model restoring it: a model of other sizes."""


class TrainingError(LtmError):
  """Training diverged (non-finite loss or gradients); the last good checkpoint is kept."""


class WorkdirError(LtmError):
  """A workdir that cannot be used: locked by another run, not writable, or holding a file that cannot be read."""

"""Errors raised for bad input. The CLI prints them as one line and exits non-zero."""


class LtmError(Exception):
  """Base class: a problem with the user's input, reported without a traceback."""


class ConfigError(LtmError):
  """An unknown key, a value of the wrong type, or values that do not fit together."""


class DataError(LtmError):
  """A missing or empty corpus, or token ids outside the vocabulary."""


class CheckpointError(LtmError):
  """A workdir whose checkpoint does not belong to the configured model."""


class TrainingError(LtmError):
  """Training diverged (non-finite loss or gradients); the last good checkpoint is kept."""

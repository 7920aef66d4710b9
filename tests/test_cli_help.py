"""`ltm --version`, and `--help` pages that show every option's default."""

from __future__ import annotations

import argparse

import pytest

import ltm_jax
from ltm_jax import cli


def test_version(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0 and capsys.readouterr().out == f"ltm {ltm_jax.__version__}\n"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
  (sub,) = [a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)]
  return sub.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_help_shows_every_default(command):
  """Each option with a default to show (not None, False or empty) has it on its help page, once: appended to its
  text, or the text already names it."""
  page = _subcommands()[command]
  text = " ".join(page.format_help().split("options:")[1].split())  # Wrapped: compared without line breaks.
  for action in page._actions:
    if not action.option_strings or action.default in (None, False, [], (), argparse.SUPPRESS):
      continue
    entry = text[text.index(action.option_strings[-1] + " "):]
    assert "default" in entry.split(" --")[0], (command, action.option_strings, entry[:200])


def test_defaults_are_shown_as_values():
  text = " ".join(_subcommands()["serve"].format_help().split())
  assert "--port PORT the port to listen on (0: any free one) (default: 8000)" in text
  assert "decoding rows (requests decoded together) (default: 32)" in text
  assert "(default: 128) (default" not in text
  assert "--max-new-tokens MAX_NEW_TOKENS default: 200" in " ".join(_subcommands()["generate"].format_help().split())

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


def test_overrides_may_come_between_and_after_options(capsys):
  args = cli.parse_args(["train", "model.d_model=32", "--config", "c.py", "model.n_layers=2", "--workdir", "w",
                         "train.steps=3"])
  assert (args.overrides, args.config, args.workdir) == (["model.d_model=32", "model.n_layers=2", "train.steps=3"],
                                                         "c.py", "w")
  with pytest.raises(SystemExit) as exit_info:  # An unknown option is still refused, overrides or not.
    cli.parse_args(["train", "--config", "c.py", "--workdir", "w", "a=1", "--no-such-option"])
  assert exit_info.value.code == 2 and "unrecognized arguments: --no-such-option" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:  # A command without overrides takes no stray key=value.
    cli.parse_args(["convert-rwkv", "--checkpoint", "c.pth", "--out", "o", "a=1"])
  assert exit_info.value.code == 2 and "unrecognized arguments: a=1" in capsys.readouterr().err

"""docs/flags.md is generated from the config docstrings; it must not drift from them, and
--help must show every flag."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.cli_options import flags_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_flags_reference_is_up_to_date():
    assert (DOCS / "flags.md").read_text().strip() == flags_markdown().strip(), (
        "regenerate: python -m batchgen.cli_options > docs/flags.md")


def test_every_run_flag_is_documented():
    text = (DOCS / "flags.md").read_text()
    from batchgen.cli_options import config_parameters

    for param in config_parameters():
        assert f"`--{param.name.replace('_', '-')}" in text, param.name


@pytest.mark.parametrize("columns", [80, 100, 160])
def test_help_shows_every_flag_name_whole(columns):
    """Rich's option tables cut long flag names ("--initial-gpu-page-…") in narrow terminals:
    every command's --help must show each of its flags in full at any width."""
    import typer.main

    from batchgen.cli import app

    commands = typer.main.get_command(app).commands
    env = {**os.environ, "COLUMNS": str(columns)}
    for name, command in commands.items():
        shown = subprocess.run([sys.executable, "-m", "batchgen", name, "--help"], env=env,
                               capture_output=True, text=True, check=True).stdout
        names = [opt for param in command.params if not getattr(param, "hidden", False)
                 for opt in param.opts + param.secondary_opts]  # hidden: deprecated spellings
        missing = [opt for opt in names if opt.startswith("--")
                   and re.search(re.escape(opt) + r"(?![\w-])", shown) is None]
        assert not missing, f"`batchgen {name} --help` at {columns} columns cuts {missing}"

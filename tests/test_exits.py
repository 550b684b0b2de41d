"""Exit codes are one IntEnum (runner/exits.py), import-light, and the one docs/reliability.md
tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from batchgen.runner.files.errors import EXIT_CODES
from batchgen.runner.exits import ExitCode

ROOT = Path(__file__).resolve().parents[1]


def test_the_documented_codes_are_the_enum():
    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text.split("## Exit codes of `batchgen run`", 1)[1].split("\n## ", 1)[0]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert documented == {int(code) for code in ExitCode}


def test_every_user_error_maps_to_an_exit_code():
    assert all(isinstance(code, ExitCode) for code in EXIT_CODES.values())


def test_exits_imports_nothing_heavy():
    code = ("import sys, batchgen.runner.exits; "
            "print(sorted(m for m in ('torch', 'typer', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

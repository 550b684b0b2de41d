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


ROOT = DOCS.parent


def _module_files() -> list[Path]:
    """Every module of batchgen and of its kernels package (package __init__ files aside)."""
    return [path.relative_to(ROOT) for folder in ("batchgen", "kernels/batchgen_kernels")
            for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "__init__.py"]


def test_every_module_sits_on_a_floor_of_the_import_layers():
    """docs/architecture.md, "Layers": a module imports only from the floors below its own. A
    module that pyproject.toml's layers contract does not name is checked by no floor."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = config["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {name.strip(" ()") for layer in layers for name in layer.split("|")}
    missing = []
    for path in _module_files():
        if path.parts[0] != "batchgen":
            continue
        dotted = ".".join(path.with_suffix("").parts)
        if not any(dotted == name or dotted.startswith(name + ".") for name in named):
            missing.append(dotted)
    assert not missing, f"on no floor of pyproject.toml's layers contract: {missing}"


def test_the_architecture_map_names_every_module():
    """A newcomer finds every module in docs/architecture.md."""
    text = (DOCS / "architecture.md").read_text()
    missing = [str(path) for path in _module_files()
               if re.search(r"(?<![\w.])" + re.escape(path.name) + r"(?!\w)", text) is None]
    assert not missing, f"docs/architecture.md does not name {missing}"


FINGERPRINT_NAMES = {"input_sha256": "sha256", "model": "`model`",
                     "model_weights": "`model_weights`", "dtype": "dtype", "kv_dtype": "KV dtype",
                     "seed": "seed",
                     "include_special_tokens": "`--detokenization-include-special-tokens`",
                     "default_max_tokens": "`--max-tokens`",
                     "sampling_defaults": "`sampling_defaults`"}
"""Fingerprint keys named in the docs by something other than their own flag."""


def test_every_fingerprint_key_is_documented():
    """A resume is refused when any fingerprint key changes: docs/job-files.md's "Fingerprint"
    paragraph names every key fingerprint() can record (by its flag where it has one)."""
    from batchgen.config import (EngineConfig, JobConfig, ModelConfig, OutputConfig,
                                 StorageConfig)
    from batchgen.runner.files.job import fingerprint

    config = JobConfig(storage=StorageConfig(input="in.jsonl", max_tokens=5, max_line_bytes=4096),
                       engine=EngineConfig(model=ModelConfig(max_model_len=512)),
                       output=OutputConfig(tool_call_parser="hermes"))
    keys = fingerprint(config, "sha", "model", "weights", "cpu", True, {"temperature": 0.7},
                       "{{ messages }}")
    text = (DOCS / "job-files.md").read_text().split("**Fingerprint.**")[1].split("\n\n")[0]
    missing = [key for key in keys
               if FINGERPRINT_NAMES.get(key, f"`--{key.replace('_', '-')}`") not in text]
    assert not missing, f"docs/job-files.md's Fingerprint paragraph does not name {missing}"


def _accepted_line_examples() -> list[str]:
    """The lines of the ```json blocks under docs/job-files.md's "Accepted line shapes": what a
    user copies into a JSONL file to start."""
    text = (DOCS / "job-files.md").read_text()
    section = text.split("### Accepted line shapes")[1].split("\n#")[0]
    blocks = re.findall(r"```json\n(.*?)```", section, re.DOTALL)
    assert blocks, "docs/job-files.md's Accepted line shapes shows no example lines"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_accepted_line_examples_are_valid_jsonl_lines(tmp_path, capsys):
    """Each example line of the input shapes, copied as it is shown, is one valid request:
    JSONL holds one object per line, so an example wrapped over two lines would teach a file
    of invalid_json lines."""
    from batchgen.runner.leader.validate import validate_file

    lines = _accepted_line_examples()
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = validate_file(path, max_tokens=16)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{len(lines)} requests: {len(lines)} valid" in out, out

"""docs/flags.md is generated from the config docstrings; it must not drift from them."""

from pathlib import Path

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

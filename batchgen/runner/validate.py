"""`batchgen validate`: parse every line as a job would, without a model or tokenizer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import typer

from batchgen.io.intake import IntakeError, parse_record
from batchgen.io.reader import read_records, scan_input
from batchgen.runner.exits import ExitCode

SHOWN_ERRORS = 50


def validate_file(path: Path, max_tokens: int) -> int:
    """0 when every line is a valid request, 1 when some lines would become error results."""
    summary = scan_input(path)  # file-level problems (duplicates, unreadable) raise here
    codes: Counter[str] = Counter()
    shown = 0
    for record in read_records(path):
        parsed = parse_record(record, max_tokens)
        if isinstance(parsed, IntakeError):
            codes[parsed.code] += 1
            if shown < SHOWN_ERRORS:
                typer.echo(f"line {parsed.line}: {parsed.code}: {parsed.message}")
                shown += 1
    bad = sum(codes.values())
    typer.echo(f"{path}: {summary.format}, {summary.records} requests, {summary.records - bad} "
               f"valid, {bad} invalid" + (f" ({dict(codes)})" if bad else ""))
    typer.echo(f"sha256 {summary.sha256}")
    return ExitCode.FAILED if bad else ExitCode.OK

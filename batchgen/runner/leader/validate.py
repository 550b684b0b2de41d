"""`batchgen validate`: parse every line as a job would, without a model or tokenizer."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import typer

from batchgen.io.field_hints import has_unknown_fields, unknown_fields
from batchgen.io.intake import IntakeError, ParsedRequest, parse_record
from batchgen.io.reader import DEFAULT_MAX_LINE_BYTES, RawRecord, scan_input
from batchgen.request_checks import forced_functions, forces_call
from batchgen.runner.exits import ExitCode

SHOWN_ERRORS = 50
SHOWN_WARNINGS = 20
PROGRESS_INTERVAL_S = 30.0
"""Seconds between the progress lines (on stderr) of a long file's check."""


def grammar_checked(parsed):
    """`parsed`, or the error line a job's worker makes of it when the grammar compiler refuses
    its response_format (unsupported_response_format) or the parameters schema of the tool call
    its tool_choice forces (invalid_tool_choice): converting a JSON schema needs no model."""
    if not isinstance(parsed, ParsedRequest) or not (
            parsed.extra.get("response_format") or forces_call(parsed.extra)):
        return parsed
    from batchgen.engine.structured import schema_problem  # xgrammar (and torch) only if used

    forced = forced_functions(parsed.extra.get("tools"), parsed.extra.get("tool_choice"))
    problem = schema_problem(parsed.extra.get("response_format"), forced)
    if problem is None:
        return parsed
    code, param = (("invalid_tool_choice", "tools") if problem.startswith("tools:")
                   else ("unsupported_response_format", "response_format"))
    return IntakeError(parsed.custom_id, parsed.line, code, f"line {parsed.line}: {problem}",
                       param)


def _count_words(counts: Counter[str]) -> str:
    return ", ".join(f"{n} {code.replace('_', ' ')}" for code, n in counts.most_common())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def validate_file(path: Path, max_tokens: int,
                  max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
    """0 when every line is a valid request, 1 when some lines would become error results.
    Unknown fields are warnings: the line still runs, with defaults for what it misspelled.
    `max_line_bytes`: the job's --max-line-bytes (a longer line is line_too_long in both)."""
    codes: Counter[str] = Counter()
    shown: list[str] = []  # at most SHOWN_ERRORS + SHOWN_WARNINGS^2 lines, printed after the scan
    warned, checked, next_note = 0, 0, time.monotonic() + PROGRESS_INTERVAL_S

    def check(record: RawRecord, _key: str) -> None:
        nonlocal warned, checked, next_note
        checked += 1
        if not checked % 1024 and time.monotonic() >= next_note:  # millions take minutes
            next_note = time.monotonic() + PROGRESS_INTERVAL_S
            typer.echo(f"checking {path}: {checked:,} records so far, to line "
                       f"{record.line:,}", err=True)
        parsed = grammar_checked(parse_record(record, max_tokens))
        if isinstance(parsed, IntakeError):
            codes[parsed.code] += 1
            if codes.total() <= SHOWN_ERRORS:
                where = f"line {parsed.line}: "  # error lines' messages start with it too
                shown.append(f"{where}{parsed.code}: {parsed.message.removeprefix(where)}")
            return
        if warned >= SHOWN_WARNINGS:  # only counted from here: naming a field costs a fuzzy match
            warned += has_unknown_fields(record.data)
            return
        problems = unknown_fields(record.data, SHOWN_WARNINGS)
        warned += bool(problems)
        shown.extend(f"line {record.line}: warning: {problem}" for problem in problems)

    # The one pass that parses the lines; file-level problems (duplicates, unreadable) raise
    # here, before any line's message is shown.
    summary = scan_input(path, max_line_bytes, each=check)
    for message in shown:
        typer.echo(message)
    unshown = codes.total() - SHOWN_ERRORS
    if unshown > 0:
        typer.echo(f"... and {unshown:,} more invalid line{'s' * (unshown != 1)} not shown "
                   f"(the first {SHOWN_ERRORS} are; all are counted below)")
    if summary.records == 0:
        typer.echo(f"{path}: the file holds no requests ({summary.why_no_requests()}): "
                   "nothing to run")
        return ExitCode.FAILED
    bad = sum(codes.values())
    if bad < summary.records:
        typer.echo("checked without the model: what needs its tokenizer (a prompt's length "
                   "against the context and --max-model-len, token ids against the vocabulary, "
                   "the chat template) is checked when the job runs")
    line = (f"{path}: {summary.format}, {_plural(summary.records, 'request')}: "
            f"{summary.records - bad} valid, {bad} invalid")
    typer.echo(line + (f" ({_count_words(codes)})" if bad else "")
               + (f"; {_plural(warned, 'line')} with unknown fields" if warned else ""))
    typer.echo(f"sha256 {summary.sha256}")
    return ExitCode.FAILED if bad else ExitCode.OK

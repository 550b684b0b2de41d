"""Stream input records from JSONL or Parquet with bounded memory.

Streaming passes over the input:
  identify_input() its format, sha256 and size (bytes only: nothing is parsed);
  scan_input()     the one pass that parses the lines: record count, duplicate custom_ids
                   (file-level errors, raised as InputFileError with line numbers), and each
                   record handed to a callback (a job parses and stores it there:
                   io/parsed_input.py; `batchgen validate` checks it);
  read_records()   one RawRecord per non-blank line (per Parquet row), what scan_input reads.
A bad line never raises here: it becomes RawRecord(error=LineError(...)) and, later, an error
result line. Line numbers are 1-based physical lines (blank lines count, they are just skipped);
for Parquet the line number is row index + 1.
"""

from __future__ import annotations

import hashlib
import math
import os
import reprlib
import stat
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import numpy as np
import orjson

from batchgen.io.json_errors import json_kind, json_problem

PARQUET_SUFFIXES = {".parquet", ".pq"}
PARQUET_MAGIC = b"PAR1"
PARQUET_BATCH_ROWS = 1024
"""Rows per pyarrow record batch: small enough that a batch of long prompts stays in memory."""
_BOM = b"\xef\xbb\xbf"
HEAD_BYTES = 64 << 10
"""Bytes of the input read to tell its format (and plain text from JSONL)."""
REQUEST_COLUMNS = {"prompt", "messages", "input", "body"}
"""A Parquet input needs one of these columns (plain rows: prompt/messages, or input for
embeddings; OpenAI: body)."""
EXACT_FLOAT_INTS = 2**53
"""Whole numbers a float holds exactly: a larger numeric custom_id has lost digits already."""
DEFAULT_MAX_LINE_BYTES = 8 << 20
"""--max-line-bytes' default: a longer JSONL line becomes a line_too_long error unread."""
_SKIP_CHUNK = 1 << 20


class InputFileError(Exception):
    """The input file as a whole cannot be used; the message names the path and the fix."""


@dataclass(frozen=True)
class LineError:
    code: str
    """One of the error codes documented in docs/job-files.md (invalid_json, ...)."""
    message: str


@dataclass(frozen=True)
class RawRecord:
    line: int
    """1-based line number (Parquet: row index + 1)."""
    data: dict | None
    error: LineError | None = None


@dataclass(frozen=True)
class InputFile:
    """What identifies an input before it is parsed (the job's batch id derives from it)."""

    path: Path
    format: str
    """"jsonl" or "parquet"."""
    sha256: str
    size_bytes: int
    version: tuple[int, ...] = ()
    """file_version() taken before the hash: a parse that ends with another one did not read
    the bytes `sha256` names (the file was edited or replaced meanwhile)."""


def file_version(path: str | Path) -> tuple[int, ...]:
    """What changes when a file is edited or replaced: size, mtime, inode, device (() when it
    cannot be read; reading it then fails with the reader's own error)."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


@dataclass(frozen=True)
class InputSummary:
    path: Path
    format: str
    """"jsonl" or "parquet"."""
    sha256: str
    size_bytes: int
    records: int
    """Non-blank lines (Parquet: rows); results + errors of a finished job add up to this."""
    line_errors: dict[str, int] = field(default_factory=dict)
    """Count of lines per reader-level error code (invalid_json, invalid_utf8, not_an_object)."""
    default_max_tokens_lines: int | None = None
    """Requests that give no max_tokens and so take --max-tokens (counted by the pass that
    parses every request, parsed_input.parse_input); None where no such pass ran."""
    refused_lines: int | None = None
    """Records the parse made error lines (IntakeError: a bad line, whatever its fault), counted
    by that same pass; None where no such pass ran."""

    def why_no_requests(self) -> str:
        """What a file of no records holds instead, and the fix (the refusal of an empty input
        says it in parentheses)."""
        if self.format == "parquet":
            return "it has no rows: write one request per row"
        what = "it is empty" if self.size_bytes == 0 else "it holds only blank lines"
        return f"{what}: write one JSON request per line"


def detect_format(path: str | Path) -> str:
    """"jsonl" or "parquet", from the content first (Parquet magic), then the extension."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        if stat.S_ISDIR(mode):
            raise InputFileError(f"input {p} is a directory: pass a .jsonl or .parquet file")
        if not stat.S_ISREG(mode):  # opening a FIFO could block, reading it empties it
            raise InputFileError(f"input {p} is not a regular file (a pipe or a device): a job "
                                 "reads its input more than once and again on every resume; "
                                 "save it to a file first and pass that")
        with open(p, "rb") as f:
            head = f.read(HEAD_BYTES)
    except FileNotFoundError:
        raise InputFileError(f"input file {p} does not exist: check the --input path") from None
    except OSError as e:
        raise InputFileError(f"cannot read input file {p}: {e.strerror}; check its "
                             "permissions and that the filesystem is mounted") from None
    suffix = p.suffix.lower()
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    _refuse_json_document(p, head)
    if suffix in PARQUET_SUFFIXES and not head:
        raise InputFileError(f"input file {p} is empty (0 bytes), not a Parquet file: its "
                             "writer stopped before writing anything; write it again")
    if suffix in PARQUET_SUFFIXES:
        raise InputFileError(f"input file {p} has a Parquet extension but is not a Parquet file "
                             "(no PAR1 magic): rewrite it with pyarrow or rename it to .jsonl")
    if head[:2] == b"\x1f\x8b":  # whatever the name: a gzipped x.jsonl too
        raise InputFileError(f"input file {p} is gzip-compressed: decompress it first "
                             "(gunzip -k) and pass the .jsonl file")
    if suffix in (".csv", ".tsv") and not head.removeprefix(_BOM).lstrip().startswith(b"{"):
        tab = ", parse_options=c.ParseOptions(delimiter='\\t')" if suffix == ".tsv" else ""
        raise InputFileError(
            f"input file {p} is {suffix[1:].upper()}: convert it to Parquet (column types kept; "
            "a `prompt` or `messages` column, sampling fields as columns), e.g. python -c "
            "\"import sys, pyarrow.csv as c, pyarrow.parquet as pq; "
            f"pq.write_table(c.read_csv(sys.argv[1]{tab}), sys.argv[2])\" {p} "
            f"{p.with_suffix('.parquet')}")
    _refuse_lines_of_no_object(p, head)
    return "jsonl"


def _refuse_json_document(p: Path, head: bytes) -> None:
    """Files that would turn every line into an error line: UTF-16 text, a JSON array, one
    pretty-printed object. Better one message with the fix than a job of error lines."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InputFileError(f"input file {p} is UTF-16 text: convert it to UTF-8 "
                             f"(iconv -f UTF-16 -t UTF-8 {p.name} > {p.stem}.utf8.jsonl)")
    first_line = head.removeprefix(_BOM).lstrip().split(b"\n", 1)[0].strip()
    if first_line == b"[" or first_line.startswith(b"[{"):
        raise InputFileError(f"input file {p} is a JSON array, not JSONL (one JSON object per "
                             f"line): convert it with jq -c '.[]' {p.name} > {p.stem}.lines.jsonl")
    if first_line == b"{":
        raise InputFileError(f"input file {p} holds pretty-printed JSON, not JSONL (one JSON "
                             f"object per line): convert it with jq -c . {p.name} > "
                             f"{p.stem}.lines.jsonl")


def _refuse_lines_of_no_object(p: Path, head: bytes) -> None:
    """A file none of whose first lines (those in `head`) is a JSON object: plain text (a
    prompt per line, the commonest first try), JSON strings, or binary content. Every line
    would be an error line; one message with the fix instead."""
    lines = head.removeprefix(_BOM).split(b"\n")
    cut = lines.pop() if len(head) == HEAD_BYTES else b""  # the read may end inside a line
    lines = [line.strip() for line in lines if line.strip()]
    if _binary((lines or [cut])[0]):
        raise InputFileError(f"input file {p} is neither JSONL (one JSON object per line) nor "
                             "Parquet: its content is binary")
    if not lines or any(line.startswith(b"{") for line in lines):
        return  # empty or one long first line (named later, line by line) or JSONL
    out = f"{p.stem}.prompts.jsonl"
    if all(line.startswith(b'"') for line in lines):
        raise InputFileError(f"input file {p} holds JSON strings, one per line, not request "
                             "objects: make each one a prompt, e.g. jq -c '{prompt: .}' "
                             f"{p.name} > {out} (or messages, for a chat model)")
    raise InputFileError(
        f"input file {p} is plain text, not JSONL (one JSON object per line, such as "
        '{"custom_id": "q1", "prompt": "..."}): if each line is a prompt, convert it with '
        f"jq -Rc 'select(length > 0) | {{prompt: .}}' {p.name} > {out}")


def _binary(data: bytes) -> bool:
    """Not UTF-8 text: undecodable, or holding control bytes text does not."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return any(b < 0x20 and b not in b"\t\r\x0c" for b in data)


def parse_line(raw: bytes, line: int) -> RawRecord:
    """One JSONL line to a RawRecord; never raises."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson validates UTF-8 itself; decode only on failure, to name the right cause.
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as u:
            return RawRecord(line, None, LineError(
                "invalid_utf8", f"line {line} is not valid UTF-8 (byte {u.start}): "
                                "re-encode the file as UTF-8"))
        return RawRecord(line, None, LineError("invalid_json", json_problem(raw, line, e)))
    if not isinstance(data, dict):
        return RawRecord(line, None, LineError(
            "not_an_object", f"line {line} is {json_kind(data)}, not an object: each line "
                             "must be one JSON object ({...})"))
    return RawRecord(line, data)


def _jsonl_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, bytes) of each non-blank line, read line by line in binary; a line longer
    than `max_line_bytes` (its newline not counted) is never held in memory: (number, its
    length) instead. A UTF-8 byte order mark starting a line is dropped: Windows editors write
    one at the start of each file, and files joined with `cat` keep them mid-file."""
    max_line_bytes = min(max_line_bytes, sys.maxsize - 1)  # readline's size is a C ssize_t
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(max_line_bytes + 1):
            number += 1
            raw = raw.removeprefix(_BOM)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                yield number, len(raw) + _skip_line(f)
            elif raw.strip():
                yield number, raw


def _skip_line(f) -> int:
    """Read past the rest of the current line in bounded chunks; how many bytes it held."""
    skipped = 0
    while chunk := f.readline(_SKIP_CHUNK):
        if chunk.endswith(b"\n"):
            return skipped + len(chunk) - 1
        skipped += len(chunk)
    return skipped


def too_long(line: int, size: int, max_line_bytes: int) -> RawRecord:
    return RawRecord(line, None, LineError(
        "line_too_long", f"line {line} is {size} bytes, over the {max_line_bytes}-byte limit "
                         "(--max-line-bytes): it was not read; shorten the request, or raise "
                         "--max-line-bytes if the machine has the memory for it"))


def _clean_value(value: object) -> object:
    # pandas writes missing numbers as NaN; a NaN cell means "not given", like a null, in a
    # struct column (an OpenAI `body`) too.
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        cleaned = {k: _clean_value(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v is not None}
    if isinstance(value, list):
        # Arrow lists hold one type: one of ints or strings (token ids, stop strings) has
        # nothing to clean and is not walked. Others (messages' structs, Hive's binary text,
        # a list of decimals) are cleaned item by item, keeping each item's place.
        if value and isinstance(value[0], (int, str)):
            return value
        return [_clean_value(v) for v in value]
    if isinstance(value, Decimal):  # SQL engines type a literal such as 0.7 as DECIMAL(1,1)
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes):  # text written as BINARY without the UTF8 annotation (Hive)
        return value.decode("utf-8")
    return value


def _parquet_record(row: int, item: dict) -> RawRecord:
    """One row as a record; a binary cell that is not UTF-8 makes it an invalid_utf8 line,
    which keeps the row's custom_id where that cell is readable (its result is named by it)."""
    for name, value in item.items():
        try:
            item[name] = _clean_value(value)
        except UnicodeDecodeError as e:
            return RawRecord(row, _own_id(item), LineError(
                "invalid_utf8", f"line {row}: column {name!r} holds bytes that are not UTF-8 "
                                f"text (byte {e.start}): write it as UTF-8 strings"))
    return RawRecord(row, {k: v for k, v in item.items() if v is not None})


def _own_id(item: dict) -> dict | None:
    """{"custom_id": ...} of a row whose custom_id cell is readable, else None."""
    try:
        return {"custom_id": _clean_value(item["custom_id"])} if "custom_id" in item else None
    except UnicodeDecodeError:
        return None


def _arrow_words(error: Exception) -> str:
    """pyarrow's message on one line, without its closing period (some span several lines:
    "Couldn't deserialize thrift: ...\nDeserializing page header failed.\n")."""
    return " ".join(str(error).split()).rstrip(".")


def _parquet_rows(path: Path) -> Iterator[RawRecord]:
    import pyarrow as pa  # only Parquet inputs pay for importing it
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputFileError(f"cannot open Parquet file {path}: {_arrow_words(e)}; check it "
                             "was written completely (pyarrow.parquet.read_metadata)") from None
    columns = pf.schema_arrow.names
    twice = sorted({name for name in columns if columns.count(name) > 1})
    if twice:
        raise InputFileError(f"Parquet file {path} has more than one column named "
                             f"{', '.join(map(repr, twice))}: which one a row means is unclear; "
                             "rename or drop the others")
    if not set(columns) & REQUEST_COLUMNS:
        raise InputFileError(f"Parquet file {path} has none of the columns "
                             f"{', '.join(sorted(REQUEST_COLUMNS))} (it has {', '.join(columns)}): "
                             "rename the column holding the prompts (docs/job-files.md)")
    row = 0
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS)
    while True:
        try:  # pages are decoded here: a damaged one (bad copy, bit rot) fails mid-file
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise InputFileError(f"cannot read Parquet file {path} past row {row}: "
                                 f"{_arrow_words(e)}; the file is damaged: write it again from "
                                 "its source") from None
        if batch is None:
            return
        # A MAP column (Spark's, or pyarrow's for a dict such as logit_bias) becomes a dict,
        # not a list of (key, value) tuples; of repeated keys the last wins, as in JSON.
        for item in batch.to_pylist(maps_as_pydicts="lossy"):
            row += 1
            yield _parquet_record(row, item)


def read_records(path: str | Path,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[RawRecord]:
    """Every non-blank line (Parquet row) of the input as a RawRecord, streamed. A JSONL line
    over `max_line_bytes` is a line_too_long error (its custom_id unread: `line-N`)."""
    p = Path(path)
    if detect_format(p) == "parquet":
        yield from _parquet_rows(p)
        return
    for number, raw in _jsonl_lines(p, max_line_bytes):
        if isinstance(raw, int):
            yield too_long(number, raw, max_line_bytes)
        else:
            yield parse_line(raw, number)


def custom_id_of(data: dict) -> str | None:
    """The record's own custom_id: a non-empty string, or an integer (Parquet id columns, and
    pandas' float columns of whole numbers) as its decimal string; None when absent or
    unusable."""
    cid = data.get("custom_id")
    if isinstance(cid, str) and cid:
        return cid
    if isinstance(cid, int) and not isinstance(cid, bool):
        return str(cid)
    if isinstance(cid, float) and cid.is_integer() and abs(cid) <= EXACT_FLOAT_INTS:
        return str(int(cid))  # pandas: an int column with a gap
    return None


def record_key(record: RawRecord) -> str:
    """The custom_id this record's result carries: its own, or `line-<N>` when it has none
    usable (a plain line without one, or a line that is not a JSON object at all)."""
    own = custom_id_of(record.data) if record.data is not None else None
    return own if own is not None else f"line-{record.line}"


def iter_keys(path: str | Path,
              max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """(line, custom_id) for every record in input order: the order of the final output."""
    for record in read_records(path, max_line_bytes):
        yield record.line, record_key(record)


def digest64(key: str) -> int:
    """A 64-bit digest of a custom_id; callers confirm candidate matches on the real string."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def identify_input(path: str | Path) -> InputFile:
    """The input's format, sha256 and size, from its bytes (no line is parsed)."""
    p = Path(path)
    fmt = detect_format(p)
    version = file_version(p)  # before the hash: an edit while hashing moves it
    return InputFile(p, fmt, _file_sha256(p), p.stat().st_size, version)


def scan_input(path: str | Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
               each: Callable[[RawRecord, str], None] | None = None,
               identity: InputFile | None = None) -> InputSummary:
    """The pass that parses every line, before weights load: count, and refuse duplicate
    custom_ids; `each(record, custom_id)` sees every record, in input order. `identity`: the
    input's identify_input(), when the caller took it already (else it is taken here).

    Memory: 8 bytes per record (an array of 64-bit id digests), sorted once at the end; only
    when digests repeat (a duplicate, which fails the job) are the real strings read again."""
    p = Path(path)
    fmt = detect_format(p)
    digests = array("Q")
    errors: dict[str, int] = {}
    for record in read_records(p, max_line_bytes):
        key = record_key(record)
        digests.append(digest64(key))
        if record.error is not None:
            errors[record.error.code] = errors.get(record.error.code, 0) + 1
        if each is not None:
            each(record, key)
    _refuse_duplicates(p, digests, max_line_bytes)
    identity = identity or identify_input(p)
    return InputSummary(p, fmt, identity.sha256, identity.size_bytes, len(digests), errors)


def _refuse_duplicates(path: Path, digests: array, max_line_bytes: int) -> None:
    values = np.frombuffer(digests, dtype=np.uint64) if len(digests) else np.zeros(0, np.uint64)
    ordered = np.sort(values)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if not len(repeated):
        return
    suspects = {int(v) for v in np.unique(repeated)}
    first_line: dict[str, int] = {}
    named: set[int] = set()  # lines whose key is generated (line-<N>), not their own
    for record in read_records(path, max_line_bytes):
        key, line = record_key(record), record.line
        if digest64(key) not in suspects:
            continue
        if record.data is None or custom_id_of(record.data) is None:
            named.add(line)
        if key in first_line:
            shown = reprlib.repr(key)  # a custom_id may be megabytes long
            why = "".join(f" (line {n} has no usable custom_id of its own, so its result is "
                          f"named {shown})" for n in (first_line[key], line) if n in named)
            raise InputFileError(
                f"{path}: custom_id {shown} appears on line {first_line[key]} and line {line}"
                f"{why}; custom_ids must be unique: rename or remove the duplicate")
        first_line[key] = line

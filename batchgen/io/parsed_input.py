"""The job's input, parsed once: each line's request (or its error) in a file of the job.

The supervisor reads the input once, before any weights load: reader.scan_input counts the
records and refuses duplicate custom_ids while every record is parsed and checked here
(intake.parse_record: shape, custom_id, messages/prompt, sampling fields) and stored, in input
order, in `batches/{batch_id}.requests` (JobPaths.parsed_input), written all or nothing. From
then on no one parses the input: each worker reads its shard of the stored records (skipping
the others' unread) and only tokenizes them; resume and the final merge read the custom_ids in
input order from it. It is removed when the job completes.

A resumed job reuses the store (a million lines take tens of seconds to parse) when its stamp
(`{batch_id}.requests.stamp`, written after it) says it was parsed from this input (sha256),
with these parse settings, by this parsing code (a digest of its source files), and the
store's own size and sha256 still match; anything else, or no stamp, parses the input again.
A reader that finds the store damaged removes the stamp, so the next run rewrites it.

Format: records one after another, each a header (line: u64, custom_id bytes: u32, item bytes:
u32, prompt-prefix key: 12 bytes, prefix_shards.prefix_key), the custom_id in UTF-8, and the
item pickled (ParsedRequest, EmbeddingRequest or
IntakeError, built by this package); read back by an unpickler that admits those classes and
SamplingParams only. Pickling keeps what parse_record made: SamplingParams are not checked again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import struct
import sys
import time
from collections.abc import Container, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

import batchgen.core
import batchgen.request_checks
from batchgen.atomic import atomic_file, read_json_dict, write_json_atomic
from batchgen.io.embeddings import EmbeddingRequest
from batchgen.io.field_hints import has_unknown_fields, unknown_fields
from batchgen.io.intake import IntakeError, ParsedRequest, parse_record, takes_default_max_tokens
from batchgen.io.prefix_shards import assign_packed, prefix_key
from batchgen.io.reader import (InputFile, InputFileError, InputSummary, RawRecord,
                                file_version, scan_input)

log = logging.getLogger("batchgen.job")

HEADER = struct.Struct("<QII12s")
"""line number, custom_id length, pickled item length, prompt-prefix key."""
HEADER_PREFIX_AT = struct.calcsize("<QII")
SHOWN_IGNORED = 3
"""Lines with fields batchgen does not read that the run's warning names (validate: all)."""
PARSE_LOG_INTERVAL_S = 30.0
"""Seconds between the log lines of a long parse (millions of lines take minutes)."""
_CLASSES = {("batchgen.io.intake", "ParsedRequest"), ("batchgen.io.intake", "IntakeError"),
            ("batchgen.io.embeddings", "EmbeddingRequest"), ("batchgen.core", "SamplingParams")}


@dataclass(frozen=True)
class ParsedRecord:
    """One input record as parse_record left it."""

    line: int
    """1-based line number (Parquet: row index + 1)."""
    key: str
    """The custom_id its result carries (reader.record_key)."""
    item: ParsedRequest | EmbeddingRequest | IntakeError | None
    """None when read by keys only (parsed_keys)."""


class _Store:
    """Appends each record scan_input hands it, parsed, to the open file (and its digest)."""

    def __init__(self, f: BinaryIO, default_max_tokens: int, input_bytes: int = 0):
        self.out, self.default_max_tokens = f, default_max_tokens
        self.sha256, self.size = hashlib.sha256(), 0
        self.input_bytes, self.records = input_bytes, 0
        self.next_log = time.monotonic() + PARSE_LOG_INTERVAL_S
        self.defaulted = 0
        """Records whose max_tokens is the default (intake.takes_default_max_tokens)."""
        self.refused = 0
        """Records parsed into an IntakeError (their answer is an error line)."""
        self.ignoring = 0
        """Records with a field batchgen does not read (field_hints.unknown_fields)."""
        self.ignored: list[str] = []
        """The first SHOWN_IGNORED of them, as "line N: what"."""

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def add(self, record: RawRecord, key: str) -> None:
        parsed = parse_record(record, self.default_max_tokens)
        if not isinstance(parsed, IntakeError):  # an error line runs with no field at all
            self._note_ignored(record)
        self.defaulted += takes_default_max_tokens(parsed, record)
        self.refused += isinstance(parsed, IntakeError)
        item = pickle.dumps(parsed, protocol=pickle.HIGHEST_PROTOCOL)
        raw_key = key.encode("utf-8", "surrogatepass")
        prefix = (prefix_key(parsed.messages, parsed.prompt) if isinstance(parsed, ParsedRequest)
                  else bytes(12))  # embeddings and bad lines: one group, spread evenly
        self.write(HEADER.pack(record.line, len(raw_key), len(item), prefix))
        self.write(raw_key)
        self.write(item)
        self.records += 1
        if not self.records % 1024 and time.monotonic() >= self.next_log:
            self._log_progress(record.line)

    def _log_progress(self, line: int) -> None:
        """One line every PARSE_LOG_INTERVAL_S while the input is parsed (before the model
        loads: a long silence otherwise)."""
        self.next_log = time.monotonic() + PARSE_LOG_INTERVAL_S
        log.info("parsing the input (%s): %s records so far, to line %s; the model loads "
                 "once every line is checked", batchgen.core.human_bytes(self.input_bytes),
                 f"{self.records:,}", f"{line:,}")

    def _note_ignored(self, record: RawRecord) -> None:
        """Count a line with fields batchgen does not read; name the first SHOWN_IGNORED (the
        fuzzy match that names a field costs more than parsing the line: once per line shown)."""
        if not has_unknown_fields(record.data):
            return
        self.ignoring += 1
        if len(self.ignored) < SHOWN_IGNORED:
            self.ignored.append(f"line {record.line}: {unknown_fields(record.data, 1)[0]}")


def parse_input(identity: InputFile, out: Path, max_line_bytes: int,
                default_max_tokens: int) -> InputSummary:
    """Parse every record of the input once into `out` (all or nothing: a duplicate custom_id
    or an unreadable file raises InputFileError and leaves `out` as it was), then stamp it.
    A store stamped for this input and these settings is reused instead (reused_input)."""
    settings = _settings(identity, max_line_bytes, default_max_tokens)
    summary = reused_input(identity, out, settings)
    if summary is not None:
        log.info("the input's %d records were parsed by an earlier run of this job: reused",
                 summary.records)
        return summary
    stamp_of(out).unlink(missing_ok=True)
    # Temp files of parses killed before their rename (one per kill, each ~2x the input):
    # never renamed by anyone, and under the job lock no other parse is writing one.
    for stale in out.parent.glob(f".{out.name}*.tmp-*"):
        stale.unlink(missing_ok=True)
    with atomic_file(out) as f:
        store = _Store(f, default_max_tokens, identity.size_bytes)
        summary = scan_input(identity.path, max_line_bytes, store.add, identity)
    summary = replace(summary, default_max_tokens_lines=store.defaulted,
                      refused_lines=store.refused)
    _warn_ignored(store, identity.path)
    if identity.version and file_version(identity.path) != identity.version:
        # Edited or replaced since it was hashed: the store may hold lines the sha256 does
        # not name. This run is refused before it publishes (check_input_unchanged); no stamp,
        # so no later run of this job reuses them.
        log.warning("the input %s changed while it was parsed: its parsed records are not "
                    "kept for a resume", identity.path)
        return summary
    write_json_atomic(stamp_of(out), {
        **settings, "store_bytes": store.size, "store_sha256": store.sha256.hexdigest(),
        "records": summary.records, "line_errors": summary.line_errors,
        "default_max_tokens_lines": summary.default_max_tokens_lines,
        "refused_lines": summary.refused_lines})
    return summary


def _warn_ignored(store: _Store, path: Path) -> None:
    """One warning for the lines with fields batchgen does not read: each such line runs with
    the field's default (a `max_tokens` beside an OpenAI line's "body", a typo)."""
    if store.ignoring:
        one = store.ignoring == 1
        log.warning("%d line%s of the input carr%s fields batchgen does not read, which run "
                    "with their defaults (%s%s); `batchgen validate -i %s` names them line by "
                    "line",
                    store.ignoring, "" if one else "s", "ies" if one else "y",
                    "; ".join(store.ignored),
                    "; ..." if store.ignoring > len(store.ignored) else "", path)


def stamp_of(store: Path) -> Path:
    """The stamp file beside a store: what it was parsed from, and its own digest."""
    return store.with_name(store.name + ".stamp")


def remove_parsed(store: Path) -> None:
    """Remove a store and its stamp (the job completed, or nothing was parsed)."""
    for path in (stamp_of(store), store):
        path.unlink(missing_ok=True)


def _settings(identity: InputFile, max_line_bytes: int, default_max_tokens: int) -> dict:
    return {"input_sha256": identity.sha256, "input_bytes": identity.size_bytes,
            "format": identity.format, "max_line_bytes": max_line_bytes,
            "default_max_tokens": default_max_tokens, "parser": parser_digest()}


def parser_digest() -> str:
    """A digest of the source of every module that decides a stored record: the io package
    (reader, intake, sampling fields, templates, ...), the request checks and the core types,
    with the versions of Python, orjson and pyarrow.
    A changed parser, or pickled classes of another shape, must not be read back."""
    files = sorted(Path(__file__).parent.glob("*.py"))
    files += [Path(batchgen.core.__file__), Path(batchgen.request_checks.__file__)]
    digest = hashlib.sha256()
    # and what reads the lines and pickles the records: another version may read them otherwise
    versions = [sys.version] + [_version(name) for name in ("orjson", "pyarrow")]
    digest.update("|".join(versions).encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def reused_input(identity: InputFile, out: Path, settings: dict) -> InputSummary | None:
    """The summary of a store already parsed from this input with these settings, or None
    (no store or stamp, other settings or parser, or a store whose bytes changed since)."""
    stamp = read_json_dict(stamp_of(out))
    if stamp is None or any(stamp.get(k) != v for k, v in settings.items()):
        return None
    try:
        with open(out, "rb") as f:
            if os.fstat(f.fileno()).st_size != stamp.get("store_bytes"):
                return None
            if hashlib.file_digest(f, "sha256").hexdigest() != stamp.get("store_sha256"):
                return None
    except OSError:
        return None
    try:
        return InputSummary(identity.path, identity.format, identity.sha256,
                            identity.size_bytes, int(stamp["records"]),
                            {str(k): int(v) for k, v in stamp["line_errors"].items()},
                            int(stamp["default_max_tokens_lines"]),
                            int(stamp["refused_lines"]))
    except (KeyError, TypeError, ValueError, AttributeError):  # a stamp edited by hand
        return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _CLASSES:
            raise pickle.UnpicklingError(f"{module}.{name} is no parsed request")
        return super().find_class(module, name)


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InputFileError(f"the job's parsed input {path} is missing (the supervisor writes "
                             "it before the workers start): re-run the job") from None


def _headers(f: BinaryIO, path: Path) -> Iterator[tuple[int, int, int, bytes]]:
    """Each record's header; the file is left at the record's custom_id."""
    while head := f.read(HEADER.size):
        if len(head) < HEADER.size:
            raise _damaged(path)
        yield HEADER.unpack(head)


def replica_of_records(path: Path, world: int) -> np.ndarray:
    """The data-parallel replica of each stored record, in input order (prefix_shards)."""
    keys = bytearray()  # the 12-byte keys end to end: no object per record
    with _open(path) as f:
        for _, key_len, item_len, prefix in _headers(f, path):
            keys += prefix
            f.seek(key_len + item_len, 1)
    return assign_packed(keys, HEADER.size - HEADER_PREFIX_AT, world)


def _records(path: Path, rank: int, world: int, items: bool,
             skip: Container[str] = ()) -> Iterator[ParsedRecord]:
    owner = replica_of_records(path, world) if world > 1 else None
    with _open(path) as f:
        for index, (line, key_len, item_len, _) in enumerate(_headers(f, path)):
            if owner is not None and owner[index] != rank:
                f.seek(key_len + item_len, 1)
                continue
            raw_key = f.read(key_len)
            if len(raw_key) < key_len:
                raise _damaged(path)
            key = raw_key.decode("utf-8", "surrogatepass")
            if key in skip:
                f.seek(item_len, 1)
                continue
            item = None
            if items:
                raw = f.read(item_len)
                if len(raw) < item_len:
                    raise _damaged(path)
                item = _load(raw, path)
            else:
                f.seek(item_len, 1)
            yield ParsedRecord(line, key, item)


def _load(raw: bytes, path: Path):
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, KeyError,
            TypeError) as err:
        _unstamp(path)
        raise InputFileError(f"the job's parsed input {path} is damaged ({err}): re-run the job "
                             "(the supervisor writes it again from the input)") from None


def _unstamp(path: Path) -> None:
    """A store found damaged loses its stamp: the next run parses the input again."""
    with contextlib.suppress(OSError):
        stamp_of(path).unlink(missing_ok=True)


def _damaged(path: Path) -> InputFileError:
    _unstamp(path)
    return InputFileError(f"the job's parsed input {path} ends inside a record (damaged): "
                          "re-run the job (the supervisor writes it again from the input)")


def read_parsed(path: Path, rank: int = 0, world: int = 1,
                skip: Container[str] = ()) -> Iterator[ParsedRecord]:
    """The stored records data-parallel replica `rank` of `world` owns (prefix_shards:
    records that start alike together, equal shares), streamed in input order; the others'
    are skipped unread, and so are those whose custom_id is in `skip` (a resumed job's
    finished requests: a job resumed with 900k of 1M done unpickled each of them to drop it)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    return _records(Path(path), rank, world, items=True, skip=skip)


def parsed_keys(path: Path) -> Iterator[tuple[int, str]]:
    """(line, custom_id) of every stored record in input order: the order of the final
    output (no item is read)."""
    for record in _records(Path(path), 0, 1, items=False):
        yield record.line, record.key

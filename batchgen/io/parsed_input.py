"""The job's input, parsed once: each line's request (or its error) in a file of the job.

The supervisor reads the input once, before any weights load: reader.scan_input counts the
records and refuses duplicate custom_ids while every record is parsed and checked here
(intake.parse_record: shape, custom_id, messages/prompt, sampling fields) and stored, in input
order, in `batches/{batch_id}.requests` (JobPaths.parsed_input), written all or nothing. From
then on no one parses the input: each worker reads its shard of the stored records (skipping
the others' unread) and only tokenizes them; resume and the final merge read the custom_ids in
input order from it. The file is rewritten from the input on every run (the input's sha256
is checked anyway) and removed when the job completes.

Format: records one after another, each a header (line: u64, custom_id bytes: u32, item bytes:
u32, prompt-prefix key: 12 bytes, prefix_shards.prefix_key), the custom_id in UTF-8, and the
item pickled (ParsedRequest, EmbeddingRequest or
IntakeError, built by this package); read back by an unpickler that admits those classes and
SamplingParams only. Pickling keeps what parse_record made: SamplingParams are not checked again.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Container, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from batchgen.atomic import atomic_file
from batchgen.io.embeddings import EmbeddingRequest
from batchgen.io.intake import IntakeError, ParsedRequest, parse_record, takes_default_max_tokens
from batchgen.io.prefix_shards import assign_packed, prefix_key
from batchgen.io.reader import InputFile, InputFileError, InputSummary, RawRecord, scan_input

HEADER = struct.Struct("<QII12s")
"""line number, custom_id length, pickled item length, prompt-prefix key."""
HEADER_PREFIX_AT = struct.calcsize("<QII")
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
    """Appends each record scan_input hands it, parsed, to the open file."""

    def __init__(self, f: BinaryIO, default_max_tokens: int):
        self.f, self.default_max_tokens = f, default_max_tokens
        self.defaulted = 0
        """Records whose max_tokens is the default (intake.takes_default_max_tokens)."""

    def add(self, record: RawRecord, key: str) -> None:
        parsed = parse_record(record, self.default_max_tokens)
        self.defaulted += takes_default_max_tokens(parsed, record)
        item = pickle.dumps(parsed, protocol=pickle.HIGHEST_PROTOCOL)
        raw_key = key.encode("utf-8", "surrogatepass")
        prefix = (prefix_key(parsed.messages, parsed.prompt) if isinstance(parsed, ParsedRequest)
                  else bytes(12))  # embeddings and bad lines: one group, spread evenly
        self.f.write(HEADER.pack(record.line, len(raw_key), len(item), prefix))
        self.f.write(raw_key)
        self.f.write(item)


def parse_input(identity: InputFile, out: Path, max_line_bytes: int,
                default_max_tokens: int) -> InputSummary:
    """Parse every record of the input once into `out` (all or nothing: a duplicate custom_id
    or an unreadable file raises InputFileError and leaves `out` as it was)."""
    with atomic_file(out) as f:
        store = _Store(f, default_max_tokens)
        summary = scan_input(identity.path, max_line_bytes, store.add, identity)
    return replace(summary, default_max_tokens_lines=store.defaulted)


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
        raise InputFileError(f"the job's parsed input {path} is damaged ({err}): re-run the job "
                             "(the supervisor writes it again from the input)") from None


def _damaged(path: Path) -> InputFileError:
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

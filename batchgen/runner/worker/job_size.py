"""How many sequences the rest of a job can decode at once, read before the engine starts:
CUDA graphs are captured for batch sizes up to it and no further (engine/graphs.py)."""

from __future__ import annotations

from collections.abc import Container, Iterable

from batchgen.io.intake import ParsedRequest, parse_record
from batchgen.io.reader import RawRecord, record_key


def job_sequences(records: Iterable[RawRecord], done: Container[str], limit: int) -> int:
    """The sequences of `records` not in `done`: each request's n (a line that decodes nothing,
    an embedding or a bad line, counts 1, an upper bound). The count stops at `limit`: a job
    that large uses every bucket, so a long input is read no further than its first lines."""
    total = 0
    for record in records:
        if record_key(record) in done:
            continue
        parsed = parse_record(record)
        n = parsed.sampling.n if isinstance(parsed, ParsedRequest) else None
        total += max(1, n or 1)
        if total >= limit:
            return limit
    return total

"""How many sequences the rest of a job can decode at once, read before the engine starts:
CUDA graphs are captured for batch sizes up to it and no further (engine/graphs.py)."""

from __future__ import annotations

from collections.abc import Container, Iterable

from batchgen.io.intake import ParsedRequest
from batchgen.io.parsed_input import ParsedRecord


def job_sequences(records: Iterable[ParsedRecord], done: Container[str], limit: int) -> int:
    """The sequences of `records` (the job's parsed input) not in `done`: each request's n (a
    line that decodes nothing, an embedding or a bad line, counts 1, an upper bound). The count
    stops at `limit`: a job that large uses every bucket, so a long input is read no further
    than its first records."""
    total = 0
    for record in records:
        if record.key in done:
            continue
        item = record.item
        total += max(1, item.sampling.n) if isinstance(item, ParsedRequest) else 1
        if total >= limit:
            return limit
    return total

"""How many sequences the rest of a job can decode at once, read before the engine starts:
CUDA graphs are captured for batch sizes up to it and no further (engine/graphs.py)."""

from __future__ import annotations

from collections.abc import Container, Iterable

from batchgen.io.embeddings import EmbeddingRequest
from batchgen.io.intake import IntakeError, ParsedRequest
from batchgen.io.parsed_input import ParsedRecord


def job_sequences(records: Iterable[ParsedRecord], done: Container[str], limit: int) -> int:
    """The sequences of `records` (the job's parsed input) not in `done`: each request's n; a
    line that decodes nothing (an embedding, a bad line) counts 0, one read by its key only 1
    (an upper bound). 0: nothing left decodes, so no CUDA graph is captured. The count stops
    at `limit`: a job that large uses every bucket, so a long input is read no further than
    its first records."""
    total = 0
    for record in records:
        if record.key in done:
            continue
        total += _sequences(record.item)
        if total >= limit:
            return limit
    return total


def _sequences(item: ParsedRequest | EmbeddingRequest | IntakeError | None) -> int:
    if isinstance(item, ParsedRequest):
        return max(1, item.sampling.n)
    return 1 if item is None else 0


def held_at_once(sequences: int, limit: int, share: int) -> int:
    """How many sequences this replica may hold KV for at once, which sizes its pools: the
    count job_sequences found where it counted them all (below `limit`: a resumed job with a
    few requests left), else `share`, its share of the job's records (an upper bound)."""
    return sequences if sequences < limit else share

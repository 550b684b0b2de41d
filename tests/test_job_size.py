"""The job size the worker gives the engine before it captures CUDA graphs."""

from __future__ import annotations

from batchgen.io.intake import parse_record
from batchgen.io.parsed_input import ParsedRecord
from batchgen.io.reader import RawRecord
from batchgen.runner.worker.job_size import held_at_once, job_sequences


def _parsed(record: RawRecord) -> ParsedRecord:
    """The record as the supervisor's scan stores it."""
    item = parse_record(record)
    return ParsedRecord(record.line, item.custom_id, item)


def _chat(key: str, n: int | None = None) -> ParsedRecord:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if n is not None:
        body["n"] = n
    return _parsed(RawRecord(0, {"custom_id": key, "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))


def test_counts_each_remaining_request_n_times():
    records = [_chat("a"), _chat("b", n=4), _chat("c", n=8), _chat("d")]
    assert job_sequences(records, set(), 1000) == 14
    assert job_sequences(records, {"c"}, 1000) == 6  # finished requests decode nothing
    assert job_sequences(records, {"a", "b", "c", "d"}, 1000) == 0


def test_lines_that_decode_nothing_count_zero():
    """Embeddings and bad lines decode nothing: a job of only those captures no CUDA graph
    (the runner skips the capture at 0). A record read by its key only counts 1."""
    bad = _parsed(RawRecord(3, {"custom_id": "x", "messages": "not a list"}))
    embedding = _parsed(RawRecord(4, {"custom_id": "e", "method": "POST",
                                      "url": "/v1/embeddings", "body": {"input": "text"}}))
    assert job_sequences([bad, embedding, _chat("a", n=2)], set(), 1000) == 2
    assert job_sequences([bad, embedding], set(), 1000) == 0
    assert job_sequences([ParsedRecord(5, "k", None)], set(), 1000) == 1


def test_stops_reading_at_the_limit():
    """A job at least as large as the largest bucket uses them all: the input is read no
    further than needed to know it."""
    read = []

    def records():
        for i in range(10_000):
            read.append(i)
            yield _chat(f"r{i}", n=2)

    assert job_sequences(records(), set(), 16) == 16
    assert len(read) == 8


def test_the_pools_are_sized_for_the_sequences_left_when_all_were_counted():
    """A job of a million records resumed with ten left sizes its KV pools for ten sequences
    (the count is exact below the limit), not for its share of every record."""
    records = [_chat(f"r{i}") for i in range(12)]
    done = {f"r{i}" for i in range(2, 12)}
    left = job_sequences(records, done, 512)
    assert left == 2 and held_at_once(left, 512, 1_000_000) == 2
    counted_to_the_limit = job_sequences(records, set(), 5)
    assert held_at_once(counted_to_the_limit, 5, 1_000_000) == 1_000_000
    assert held_at_once(0, 512, 1_000_000) == 0  # embeddings and bad lines only

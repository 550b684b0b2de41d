"""Poison requests: a request in flight during K (--quarantine-after) consecutive crashes of the
job becomes an error line, so one bad request cannot crash-loop a job.

Files, per rank, beside the batch file:
  {batch_id}.inflight.rank{R}       journal: a {"run": id} line, then the custom_ids this run
                                    read (one JSON string per line, written as each line is read,
                                    before its template, tokenizer and grammar run), plus a
                                    {"crash": code} line the supervisor appends when it saw the
                                    worker crash
  {batch_id}.suspects.rank{R}.json  strikes: custom_id -> consecutive crashes it was in flight at

The journal is written without fsync: it must survive the death of the process (the page cache
keeps it), not of the machine; a machine crash only loses a strike. A clean exit (done,
preempted, disk full) deletes it. At the next start the worker counts the last run as a crash
only when it is confirmed (the supervisor saw the worker fail, or torchrun restarted it): a
kill -9 of the whole job is no evidence against the requests in flight.

Counting: each confirmed crash adds a strike to every request in flight and clears the others
(consecutive). The book records which run it counted, so a kill between saving the book and
starting the next journal does not count the same crash twice. The next run first serves the
suspects in isolation, in at most ISOLATION_GROUPS groups run one after the other, so each
crash narrows the set in flight. A request is quarantined once it has K strikes AND was alone
in flight at the last crash: an innocent request never pays for a neighbour.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from batchgen.atomic import open_job_file, write_json_atomic
from batchgen.io.parsed_input import ParsedRecord
from batchgen.io.results import dumps, failure_line
from batchgen.testing import faults

ISOLATION_GROUPS = 16


def journal_paths(batch_dir: Path, batch_id: str) -> list[Path]:
    return sorted(Path(batch_dir).glob(f"{batch_id}.inflight.rank*"))


def mark_crashed(batch_dir: Path, batch_id: str, exitcode: int) -> int:
    """Supervisor side: confirm that the workers whose journals remain crashed (exit code
    `exitcode`). Returns how many journals were marked."""
    # On a line of its own even after a torn last line (the worker died inside a write).
    marker = b"\n" + orjson.dumps({"crash": exitcode}) + b"\n"
    for path in journal_paths(batch_dir, batch_id):
        fd = open_job_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        with os.fdopen(fd, "ab") as f:
            f.write(marker)
    return len(journal_paths(batch_dir, batch_id))


@dataclass
class LastRun:
    admitted: list[str]
    crashed: bool
    run_id: str | None = None
    """The run's journal identity (None in journals written before it had one)."""


class CrashJournal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = -1

    def read(self) -> LastRun | None:
        """What the previous run left; None after a clean exit."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        admitted, seen, crashed, run_id = [], set(), False, None
        for line in raw.splitlines():
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a torn last line: the process died inside the write
            if isinstance(item, str) and item not in seen:
                seen.add(item)
                admitted.append(item)
            elif isinstance(item, dict) and "crash" in item:
                crashed = True
            elif isinstance(item, dict) and "run" in item:
                run_id = str(item["run"])
        return LastRun(admitted, crashed, run_id)

    def start(self) -> None:
        self._fd = open_job_file(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        self._write(orjson.dumps({"run": os.urandom(8).hex()}) + b"\n")

    def append(self, custom_ids: list[str]) -> None:
        self._write(b"".join(orjson.dumps(c) + b"\n" for c in custom_ids))

    def _write(self, payload: bytes) -> None:
        data = memoryview(payload)
        while data:
            data = data[os.write(self._fd, data):]

    def clear(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


@dataclass
class SuspectBook:
    strikes: dict[str, int] = field(default_factory=dict)
    last_crash_in_flight: int = 0
    quarantined: list[str] = field(default_factory=list)
    counted_run: str | None = None
    """The journal identity of the last crash counted."""

    @staticmethod
    def load(path: Path) -> SuspectBook:
        try:
            return SuspectBook(**orjson.loads(Path(path).read_bytes()))
        except FileNotFoundError:
            return SuspectBook()

    def record_crash(self, in_flight: list[str]) -> None:
        self.strikes = {cid: self.strikes.get(cid, 0) + 1 for cid in in_flight}
        self.last_crash_in_flight = len(in_flight)


class Quarantine:
    """One rank's journal and strikes."""

    def __init__(self, batch_dir: Path, batch_id: str, rank: int, after: int):
        self.batch_id = batch_id
        self.after = after
        self.journal = CrashJournal(Path(batch_dir) / f"{batch_id}.inflight.rank{rank}")
        self.book_path = Path(batch_dir) / f"{batch_id}.suspects.rank{rank}.json"
        self.book = SuspectBook()
        self._on_admit = faults.admit_fault()

    def recover(self, done, restarted: bool) -> None:
        """Count the previous run if it was a confirmed crash, then start a fresh journal.
        done: custom_ids with a result (container); restarted: torchrun restarted this worker."""
        self.book = SuspectBook.load(self.book_path)
        last = self.journal.read()
        counted = last is not None and last.run_id is not None and (
            last.run_id == self.book.counted_run)
        if last is not None and (last.crashed or restarted) and not counted:
            in_flight = [cid for cid in last.admitted if cid not in done]
            if in_flight:  # a crash before any admission says nothing about requests
                self.book.record_crash(in_flight)
                self.book.counted_run = last.run_id
        self.book.strikes = {c: n for c, n in self.book.strikes.items() if c not in done}
        if self.book.strikes or self.book_path.exists():
            self._save()
        self.journal.start()

    def is_suspect(self, custom_id: str) -> bool:
        return custom_id in self.book.strikes

    def convicted(self, custom_id: str) -> bool:
        return (self.book.strikes.get(custom_id, 0) >= self.after
                and self.book.last_crash_in_flight == 1)

    def error_line(self, record: ParsedRecord) -> bytes:
        cid = record.key
        n = self.book.strikes[cid]
        return dumps(failure_line(
            self.batch_id, cid, record.line, "quarantined",
            f"line {record.line}: this request was in flight during {n} consecutive worker "
            f"crashes, the last time alone (--quarantine-after {self.after}), so it was set "
            "aside to let the job finish; the worker logs show the crashes"))

    def mark_quarantined(self, custom_ids: list[str]) -> None:
        """After their error lines are durable: they leave the suspects."""
        for cid in custom_ids:
            self.book.strikes.pop(cid, None)
            self.book.quarantined.append(cid)
        self._save()

    def suspects_served(self) -> None:
        """Every suspect of this replica's shard was answered in isolation (or quarantined):
        none is left in a streak of crashes. Strikes of requests outside the shard (another
        --world-size) are forgotten with them."""
        self.book.strikes = {}
        self._save()

    def isolation_groups(self, records: Iterable[ParsedRecord]) -> list[list[ParsedRecord]]:
        """The suspects' records in at most ISOLATION_GROUPS groups, most strikes first."""
        suspects = sorted(records, key=lambda r: -self.book.strikes[r.key])
        if not suspects:
            return []
        size = math.ceil(len(suspects) / ISOLATION_GROUPS)
        return [suspects[i:i + size] for i in range(0, len(suspects), size)]

    def admitted(self, custom_ids: list[str]) -> None:
        """Journal requests as they are read (before their intake or first step can crash)."""
        if not custom_ids:
            return
        self.journal.append(custom_ids)
        if self._on_admit is not None:
            self._on_admit(custom_ids)

    def clean_exit(self) -> None:
        self.journal.clear()

    def _save(self) -> None:
        write_json_atomic(self.book_path, {"strikes": self.book.strikes,
                                           "last_crash_in_flight": self.book.last_crash_in_flight,
                                           "quarantined": self.book.quarantined,
                                           "counted_run": self.book.counted_run})

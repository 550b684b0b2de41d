"""In-flight checkpoints: the tokens each unfinished request has generated, so that a stopped
or killed job continues its answers instead of drawing them again.

batches/{batch_id}.checkpoint.rank{R} (one per data-parallel rank) is a log of lines
`CRC32 JSON\\n`. The first line is a snapshot (`"full": true`), written whole by
`atomic_file`; each later line is one fsynced append holding only what changed since the line
before: for each request, per choice, the tokens drawn since (`at` says how many came before
them, so a line that does not follow on is refused), a finished choice's result, and the ids
that left the set (finished, their results on disk). When the appends outgrow the state they
describe, the file is rewritten as one snapshot.

Reading stops at the first line that is torn or fails its CRC (a crash mid-append): the lines
before it still describe every request at an earlier point, and a request known only from
the torn line starts over. A file written for another job fingerprint (or another number of
ranks) is refused whole. Ids whose results are saved never resume (`load` drops them), so a
result is never produced twice whatever instant a crash hits.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from batchgen.core import ChoiceProgress, Completion, FinishReason, TokenLogprob
from batchgen.atomic import atomic_file, open_job_file

log = logging.getLogger("batchgen.checkpoints")

COMPACT_RATIO = 4
"""Rewrite the file as one snapshot once it is this many times the size a snapshot of the
state would have (the tokens of finished requests and each line's framing accumulate)."""
COMPACT_MIN_BYTES = 1 << 20
"""...and is at least this large."""


def checkpoint_path(batch_file: Path, batch_id: str, dp_rank: int) -> Path:
    return batch_file.with_name(f"{batch_id}.checkpoint.rank{dp_rank}")


def checkpoint_files(batch_file: Path, batch_id: str) -> list[Path]:
    return sorted(batch_file.parent.glob(f"{batch_id}.checkpoint.rank*"))


def checkpoint_fingerprint(job_fingerprint: dict, dp_size: int) -> str:
    """What a checkpoint must match to be used: the job's fingerprint (model, weights, dtype,
    seed, input, parse settings) and the number of data-parallel ranks (each rank's file holds
    its own shard's requests)."""
    data = orjson.dumps({"job": job_fingerprint, "dp_size": dp_size}, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass
class LoadReport:
    """What reading a checkpoint found, for the worker's log."""

    requests: int = 0
    tokens: int = 0
    torn: bool = False
    """A line was torn or corrupt: it and any after it were ignored."""
    refused: str | None = None
    """Why the whole file was refused (another fingerprint), or None."""
    dropped: list[str] = field(default_factory=list)
    """Requests whose lines did not follow on from each other (they start over)."""


def load(path: Path, fingerprint: str | None,
         done: set[str] | frozenset = frozenset()) -> tuple[dict[str, list[ChoiceProgress]],
                                                            LoadReport]:
    """The requests the file says are in flight, less those in `done`. `fingerprint` None
    reads any job's file (for `batchgen status`)."""
    report = LoadReport()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, report
    state: dict[str, list[ChoiceProgress]] = {}
    for raw in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"):
        line = _parse(raw)
        if line is None:
            report.torn = True
            break
        if fingerprint is not None and line.get("fp") != fingerprint:
            report.refused = "written for another job fingerprint or number of ranks"
            return {}, report
        _apply(state, line, report)
    state = {cid: choices for cid, choices in state.items() if cid not in done}
    report.requests = with_progress_count(state)
    report.tokens = sum(len(c.token_ids) for choices in state.values() for c in choices)
    return state, report


def with_progress_count(state: dict[str, list[ChoiceProgress]]) -> int:
    """Requests of `state` a resume continues rather than starts over: those with a token
    drawn or a choice finished (one admitted but not yet started is in flight with nothing)."""
    return sum(1 for choices in state.values()
               if any(c.token_ids or c.done is not None for c in choices))


class CheckpointLog:
    """The writing side of one rank's checkpoint file: `start` snapshots what a run resumes
    with, `save` appends what changed since, `remove` deletes it once nothing is in flight."""

    def __init__(self, path: Path, fingerprint: str):
        self.path, self.fingerprint = Path(path), fingerprint
        self._written: dict[str, list[tuple[int, bool]]] = {}
        """Per request, per choice: (tokens on file, finished on file)."""
        self._snapshot_bytes = 0
        self._snapshot_tokens = 0
        """Tokens in the last snapshot."""
        self._restarted: set[str] = set()

    def start(self, state: dict[str, list[ChoiceProgress]]) -> None:
        """Replace the file with one snapshot of `state` (also drops a torn tail)."""
        self._written = {}
        line = self._line(state, full=True)
        with atomic_file(self.path) as f:
            f.write(line)
        self._snapshot_bytes = len(line)

    def save(self, state: dict[str, list[ChoiceProgress]]) -> int:
        """Make `state` (every request in flight) durable; bytes written (0: nothing new)."""
        size = self._file_size()
        if size > COMPACT_MIN_BYTES and size > COMPACT_RATIO * self._snapshot_size(state):
            self.start(state)
            return self._snapshot_bytes
        line = self._line(state, full=False)
        if line is None:
            return 0
        fd = open_job_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return len(line)

    def restart(self, cid: str) -> None:
        """`cid` starts over (its saved progress could not continue it): the next line drops
        what the file holds for it before adding its new tokens."""
        if self._written.pop(cid, None) is not None:
            self._restarted.add(cid)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self._written = {}

    @property
    def tokens(self) -> int:
        """Tokens the file holds for the requests in flight."""
        return sum(n for choices in self._written.values() for n, _ in choices)

    def _snapshot_size(self, state: dict[str, list[ChoiceProgress]]) -> float:
        """About the bytes of a snapshot of `state`, at the last snapshot's bytes per token."""
        per_token = self._snapshot_bytes / self._snapshot_tokens if self._snapshot_tokens else 8.0
        tokens = sum(len(c.token_ids) for choices in state.values() for c in choices)
        return 100 + 40 * len(state) + per_token * tokens

    def _file_size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _line(self, state: dict[str, list[ChoiceProgress]], full: bool) -> bytes | None:
        changed, written = {}, {}
        gone = [] if full else [cid for cid in self._written if cid not in state]
        gone += [] if full else sorted(self._restarted)
        self._restarted = set()
        for cid, choices in state.items():
            before = [] if full else self._written.get(cid, [])
            if before and not _follows(before, choices):
                gone.append(cid)  # started over (its saved state could not continue it)
                before = []
            before = before or [(0, False)] * len(choices)
            written[cid] = [(len(c.token_ids), c.done is not None) for c in choices]
            if full or written[cid] != before:
                changed[cid] = [_choice(c, *b) for c, b in zip(choices, before)]
        self._written = written
        if not (full or changed or gone):
            return None
        if full:
            self._snapshot_tokens = sum(len(e["t"]) for entry in changed.values() for e in entry)
        body = orjson.dumps({"fp": self.fingerprint, "full": full, "req": changed, "gone": gone})
        return f"{zlib.crc32(body):08x} ".encode() + body + b"\n"


def _follows(before: list[tuple[int, bool]], choices: list[ChoiceProgress]) -> bool:
    """Whether `choices` extend what the file holds (`before`)."""
    return len(before) == len(choices) and all(
        n <= len(c.token_ids) and (c.done is not None or not done)
        for (n, done), c in zip(before, choices))


def _choice(progress: ChoiceProgress, at: int, was_done: bool) -> dict:
    """One choice's entry: its tokens from `at` on (and their logprobs), its result if it
    finished since the last line."""
    entry: dict = {"at": at, "t": progress.token_ids[at:]}
    if progress.logprobs is not None:
        entry["lp"] = [[p.token_id, p.logprob, p.top] for p in progress.logprobs[at:]]
    if progress.done is not None and not was_done:
        done = progress.done
        entry["done"] = {"index": done.index, "reason": done.finish_reason.value,
                         "text": done.text, "stop": done.stop_reason}
    return entry


def _parse(raw: bytes) -> dict | None:
    crc, _, body = raw.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        line = orjson.loads(body)
    except ValueError:
        return None
    return line if isinstance(line, dict) and isinstance(line.get("req"), dict) else None


def _apply(state: dict[str, list[ChoiceProgress]], line: dict, report: LoadReport) -> None:
    if line.get("full"):
        state.clear()
    for cid in line.get("gone", []):
        state.pop(cid, None)
    for cid, entries in line["req"].items():
        try:
            merged = _merge(state.get(cid), entries)
        except (KeyError, TypeError, ValueError, IndexError):
            merged = None
        if merged is None:
            state.pop(cid, None)
            report.dropped.append(cid)
        else:
            state[cid] = merged


def _merge(current: list[ChoiceProgress] | None,
           entries: list[dict]) -> list[ChoiceProgress] | None:
    """`current` extended by one line's entries; None when they do not follow on."""
    if current is None:
        current = [ChoiceProgress([], [] if "lp" in e else None) for e in entries]
    if len(current) != len(entries):
        return None
    out = []
    for progress, entry in zip(current, entries):
        if not progress.token_ids and progress.done is None:
            # A choice that had drawn nothing yet (a sibling of n > 1 still waiting for its
            # first token) was saved without logprobs: its first tokens bring them.
            progress = ChoiceProgress([], [] if "lp" in entry else None)
        if entry["at"] != len(progress.token_ids) or (progress.logprobs is None) != (
                "lp" not in entry):
            return None
        tokens = progress.token_ids + [int(t) for t in entry["t"]]
        logprobs = None
        if progress.logprobs is not None:
            logprobs = progress.logprobs + [
                TokenLogprob(int(t), float(lp), [(int(i), float(v)) for i, v in top])
                for t, lp, top in entry["lp"]]
            if len(logprobs) != len(tokens):
                return None
        done = progress.done
        if "done" in entry:
            d = entry["done"]
            done = Completion(int(d["index"]), tokens, FinishReason(d["reason"]), d["text"],
                              logprobs, d["stop"])
        out.append(ChoiceProgress(tokens, logprobs, done))
    return out

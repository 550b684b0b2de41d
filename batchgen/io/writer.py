"""Durable results: the incremental file (completion order, fsynced per flush) and the final
merge into input order.

Done = write + fsync succeeded. The incremental file only ever grows by whole flushes, so after
a crash at most its last line is torn: that tail is cut off on open and the request recomputed.
An unparsable line with complete lines after it cannot come from a crash: it is corruption and
we refuse to guess (see docs/job-files.md for the way out).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import sys
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from batchgen.atomic import atomic_file, is_named, open_job_file
from batchgen.io.jobfiles import errors_path_for
from batchgen.io.reader import digest64, iter_keys
from batchgen.io.results import is_success

REPAIR_HINT = ("move the file aside (its requests are then recomputed), or keep its good lines "
               "with `{python} -m batchgen.io.writer --repair-incremental {path}` (the original "
               "is kept as {path}.corrupt-<time>, bad lines are dropped and recomputed)")


class CorruptIncrementalFile(Exception):
    """A bad line with complete lines after it: not a torn write."""


class WriteFailed(Exception):
    """A flush could not be made durable (ENOSPC, EIO, ...); the job must stop."""


class ResultsFileRemoved(Exception):
    """The incremental file was removed (by hand, or with its folder) while being written: the
    results appended since are gone with it."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


class WriterLocked(Exception):
    """Another live process holds this incremental file."""


class IdSet:
    """custom_ids as 16-byte blake2b digests: ~100 bytes per id instead of the strings."""

    def __init__(self) -> None:
        self._digests: set[bytes] = set()

    @staticmethod
    def _digest(custom_id: str) -> bytes:
        return hashlib.blake2b(custom_id.encode(), digest_size=16).digest()

    def add(self, custom_id: str) -> None:
        self._digests.add(self._digest(custom_id))

    def __contains__(self, custom_id: object) -> bool:
        return isinstance(custom_id, str) and self._digest(custom_id) in self._digests

    def __len__(self) -> int:
        return len(self._digests)


def _parse_result(raw: bytes) -> dict | None:
    """A complete, well-formed result line, else None: an object with string `id` and
    `custom_id`, and a `response` holding an integer `status_code` and an object `body`, or
    none and an `error` object (results.py writes no other). A line of other JSON (edited by
    hand, written by another tool) is no answer: taken for one, its request would go
    unanswered and the merged files would be refused by the next run."""
    if not raw.endswith(b"\n"):
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("custom_id"), str)
            and isinstance(obj.get("id"), str)):
        return None
    response, error = obj.get("response"), obj.get("error")
    if isinstance(response, dict):
        ok = isinstance(response.get("status_code"), int) and isinstance(response.get("body"),
                                                                          dict)
    else:
        ok = response is None and isinstance(error, dict)
    return obj if ok else None


def _custom_id(raw: bytes) -> str | None:
    obj = _parse_result(raw)
    return None if obj is None else obj["custom_id"]


class IncrementalScan:
    """Iterate the good lines of an incremental file as (offset, length, custom_id).

    Afterwards: `good_end` is the byte length of the good prefix, `size` the file length, and
    `lines` the good line count. A bad line followed by more lines raises CorruptIncrementalFile."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.good_end = self.size = self.lines = 0

    def __iter__(self) -> Iterator[tuple[int, int, str]]:
        bad_line = None
        offset = 0
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if bad_line is not None:
                    raise CorruptIncrementalFile(
                        f"{self.path}: line {bad_line} is not a complete result line but more "
                        "lines follow it, so it is corruption, not a torn write; "
                        + REPAIR_HINT.format(path=self.path, python=sys.executable or "python"))
                cid = _custom_id(raw)
                if cid is None:
                    bad_line = number
                else:
                    yield offset, len(raw), cid
                    self.lines += 1
                    self.good_end = offset + len(raw)
                offset += len(raw)
        self.size = offset


def read_done_ids(paths: Iterable[Path]) -> IdSet:
    """custom_ids finished in any of these files (read-only: torn tails are just not counted)."""
    done = IdSet()
    for path in paths:
        for _, _, cid in IncrementalScan(path):
            done.add(cid)
    return done


class IncrementalWriter:
    """Append-only, fsynced result file of one rank; repairs a torn tail when opened.

    fault: the reliability tests' faulty flush (batchgen.testing.faults.WriterFault), else None."""

    def __init__(self, path: str | Path, fault=None, lock: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fault = fault
        self._fd = open_job_file(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if lock:
                self._lock()
            self._done, self.lines, self.repaired_bytes = self._repair()
        except BaseException:
            os.close(self._fd)
            raise
        self._size = os.fstat(self._fd).st_size
        self._broken = False

    def _lock(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WriterLocked(f"{self.path} is in use by another live batchgen process; wait "
                               "for it to exit (or kill it) before starting this job "
                               "again") from None

    def _repair(self) -> tuple[IdSet, int, int]:
        # Scanned under the lock, so no live writer can be appending while we truncate.
        scan, done = IncrementalScan(self.path), IdSet()
        for _, _, cid in scan:
            done.add(cid)
        torn = scan.size - scan.good_end
        if torn:
            os.ftruncate(self._fd, scan.good_end)
            os.fsync(self._fd)
        return done, scan.lines, torn

    def done_ids(self) -> IdSet:
        """custom_ids whose result was already in the file when it was opened."""
        return self._done

    def _write_all(self, data: memoryview) -> None:
        while data:
            written = os.write(self._fd, data)
            if written == 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            data = data[written:]  # a short write (signal, full pipe) continues where it stopped

    def write_batch(self, lines: list[bytes]) -> None:
        """Append whole lines (each ending in a newline) with one write and one fsync."""
        if self._broken:
            raise WriteFailed(f"{self.path}: an earlier flush failed; this writer is unusable")
        if not lines:
            return
        if not all(line.endswith(b"\n") for line in lines):
            raise ValueError("every result line must end with a newline")
        data = memoryview(b"".join(lines))
        self._broken = True  # until this flush is durable; an escaping exception leaves it set
        try:
            self._flush(data)
        except OSError as e:
            if e.errno == errno.ESTALE:  # removed on another node of a shared filesystem
                raise self._removed() from e
            self._rollback()
            raise WriteFailed(
                f"could not save {len(lines)} finished results to {self.path}: "
                f"{e.strerror or e} ({errno.errorcode.get(e.errno or 0, e.errno)}). Results saved "
                "before are safe; fix the disk (free space) and run the same command again to "
                "resume") from e
        self._size += len(data)
        if not is_named(self._fd, self.path):  # written to a file no one will read
            raise self._removed()
        self._broken = False

    def _removed(self) -> ResultsFileRemoved:
        return ResultsFileRemoved(
            f"{self.path} was removed while the job was writing it (by hand, or with its "
            "folder): the results saved in it are gone", self.path)

    def _flush(self, data: memoryview) -> None:
        if self._fault is not None:
            self._fault.flush(self._fd, data, self._write_all)
            return
        self._write_all(data)
        os.fsync(self._fd)

    def _rollback(self) -> None:
        # Put the file back to its last durable length. No fsync retry: after a failed fsync
        # the kernel may have dropped the dirty pages and a second fsync would lie.
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            pass  # the next open cuts a torn tail anyway

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1

    def __enter__(self) -> IncrementalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class FinalizeReport:
    completed: int
    """Success lines written to the output."""
    failed: int
    """Error lines written to the errors file."""
    ignored: int
    """Incremental lines not used: duplicates of an id already taken, or ids not in the input."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Token usage summed over the success lines written: what the job's output holds,
    however many runs it took (a result recomputed after a crash counts once)."""
    cached_tokens: int = 0
    """Of prompt_tokens, those the prefix cache held (usage.prompt_tokens_details)."""


class IncompleteResults(Exception):
    """finalize() found input records without a result; nothing was written."""


class _Index:
    """Where each incremental line lives, sorted by 64-bit id digest (stable: file order, then
    offset, so the first record of a duplicated id wins). 24 bytes per line."""

    def __init__(self, paths: list[Path]):
        digest, file, offset, length = array("Q"), array("I"), array("q"), array("I")
        for i, path in enumerate(paths):
            for off, n, cid in IncrementalScan(path):
                digest.append(digest64(cid))
                file.append(i)
                offset.append(off)
                length.append(n)
        self.digest = np.frombuffer(digest, np.uint64)
        order = np.argsort(self.digest, kind="stable")
        self.digest = self.digest[order]
        self.file = np.frombuffer(file, np.uint32)[order]
        self.offset = np.frombuffer(offset, np.int64)[order]
        self.length = np.frombuffer(length, np.uint32)[order]
        self.used = np.zeros(len(self.digest), dtype=bool)


def _chunks(keys: Iterable[str], size: int = 65536) -> Iterator[list[str]]:
    chunk: list[str] = []
    for key in keys:
        chunk.append(key)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _lookup(index: _Index, fds: list[int], key: str, digest: int,
            at: int) -> tuple[bytes, dict] | None:
    """The first line for `key`, confirmed on the real custom_id (digests may collide)."""
    while at < len(index.digest) and index.digest[at] == digest:
        raw = os.pread(fds[index.file[at]], int(index.length[at]), int(index.offset[at]))
        obj = _parse_result(raw)
        if obj is not None and obj["custom_id"] == key:
            index.used[at] = True
            return raw, obj
        at += 1
    return None


def finalize(incremental_paths: list[Path], input_order: Path | Iterable[str],
             output_path: Path, errors_path: Path | None = None) -> FinalizeReport:
    """Merge incremental files into the final output (successes) and errors file, both in
    input order, one line per input record, each file replaced atomically.

    input_order: the input file, or its custom_ids in order (reader.iter_keys)."""
    keys = ((k for _, k in iter_keys(input_order)) if isinstance(input_order, (str, Path))
            else input_order)
    errors_path = errors_path or errors_path_for(Path(output_path))
    for target in (Path(output_path), Path(errors_path)):
        target.parent.mkdir(parents=True, exist_ok=True)
    index = _Index([Path(p) for p in incremental_paths])
    fds = [os.open(p, os.O_RDONLY) for p in incremental_paths]
    completed = failed = prompt_tokens = completion_tokens = cached_tokens = missing = 0
    first_missing: list[str] = []  # named in the error; the others only counted
    try:
        with atomic_file(Path(output_path)) as out, atomic_file(errors_path) as err:
            for chunk in _chunks(keys):
                digests = np.array([digest64(k) for k in chunk], dtype=np.uint64)
                starts = np.searchsorted(index.digest, digests, side="left")
                for key, digest, at in zip(chunk, digests, starts):
                    found = _lookup(index, fds, key, digest, int(at))
                    if found is None:
                        missing += 1
                        if len(first_missing) < 5:
                            first_missing.append(key)
                    elif is_success(found[1]):
                        out.write(found[0])
                        completed += 1
                        usage = _usage_of(found[1])
                        prompt_tokens += usage.get("prompt_tokens", 0)
                        completion_tokens += usage.get("completion_tokens", 0)
                        details = usage.get("prompt_tokens_details")
                        if isinstance(details, dict):
                            cached_tokens += details.get("cached_tokens") or 0
                    else:
                        err.write(found[0])
                        failed += 1
            if missing:
                raise IncompleteResults(
                    f"{missing} input records have no result yet (first: "
                    f"{', '.join(map(repr, first_missing))}); run the job again to finish them")
    finally:
        for fd in fds:
            os.close(fd)
    return FinalizeReport(completed, failed, int((~index.used).sum()), prompt_tokens,
                          completion_tokens, cached_tokens)


def _usage_of(line: dict) -> dict:
    body = line["response"].get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    return usage if isinstance(usage, dict) else {}


def salvage(path: Path) -> tuple[int, int]:
    """Keep the good lines of a corrupt incremental file; the original is kept beside it.
    Returns (lines kept, lines dropped). Dropped requests are recomputed by the next run."""
    path = Path(path)
    backup = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    os.link(path, backup)  # the original stays reachable at every instant
    kept = dropped = 0
    with open(backup, "rb") as src, atomic_file(path) as dst:
        for raw in src:
            if _custom_id(raw) is None:
                dropped += 1
            else:
                dst.write(raw)
                kept += 1
    return kept, dropped


def count_lines(path: Path) -> int:
    """Newline-ended lines in `path`, read in 1 MiB blocks (raises OSError)."""
    lines = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
    return lines


def final_files_complete(output: Path, errors: Path, records: int) -> bool:
    """Whether a finished job's final files are both there with one line per input record
    (a file deleted or cut by hand afterwards makes the next run merge them again)."""
    try:
        return count_lines(output) + count_lines(errors) == records
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--repair-incremental":
        sys.exit("usage: python -m batchgen.io.writer --repair-incremental PATH")
    kept_n, dropped_n = salvage(Path(sys.argv[2]))
    print(f"kept {kept_n} result lines, dropped {dropped_n} (recomputed by the next run)")


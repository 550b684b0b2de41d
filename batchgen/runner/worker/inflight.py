"""A worker's in-flight checkpoints: what a run resumes with, and when to save the progress of
the requests in flight (every --inflight-checkpoint-interval seconds between steps, and on a
stop before exiting 75). File format: `batchgen.io.checkpoints`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from batchgen.core import ChoiceProgress, Request
from batchgen.io.checkpoints import (CheckpointLog, checkpoint_fingerprint, checkpoint_path,
                                     load, with_progress_count)
from batchgen.io.jobfiles import BatchFile, JobPaths

log = logging.getLogger("batchgen.worker")


class InflightCheckpoints:
    """One data-parallel rank's checkpoint (kept by the rank that writes results)."""

    def __init__(self, paths: JobPaths, batch_id: str, dp_rank: int, dp_size: int,
                 interval: float, done):
        state = BatchFile(paths.batch_file).load()
        fingerprint = checkpoint_fingerprint(state.fingerprint if state else {}, dp_size)
        path = checkpoint_path(paths.batch_file, batch_id, dp_rank)
        self.resumable, report = load(path, fingerprint, done)
        if report.refused:
            log.warning("rank %d: in-flight checkpoint %s ignored (%s): its requests start over",
                        dp_rank, path.name, report.refused)
        if report.torn:
            log.warning("rank %d: in-flight checkpoint %s ends in a torn line: ignored from "
                        "there (the requests only it held start over)", dp_rank, path.name)
        if self.resumable:
            log.info("rank %d: %d requests continue from the in-flight checkpoint (%d tokens "
                     "not drawn again)", dp_rank, report.requests, report.tokens)
        self.file = CheckpointLog(path, fingerprint)
        self.file.start(self.resumable)
        self.interval = interval
        self._last = time.monotonic()
        self.stats = {"saves": 0, "bytes": 0, "last_seconds": 0.0, "max_seconds": 0.0,
                      "total_seconds": 0.0, "requests": report.requests,
                      "tokens": report.tokens, "resumed_requests": report.requests,
                      "resumed_tokens": report.tokens, "generated_at_save": 0}

    def due(self) -> bool:
        return self.interval > 0 and time.monotonic() - self._last >= self.interval

    def save(self, state_of: Callable[[], dict[str, list[ChoiceProgress]]],
             generated: int) -> None:
        """Make the progress of every request in flight (`state_of()`) durable, fsynced;
        `generated`: the engine's count of tokens drawn so far (what a kill now would lose
        is counted from it). Timed whole: export, encoding, write and fsync."""
        start = time.perf_counter()
        state = state_of()
        written = self.file.save(state)
        seconds = time.perf_counter() - start
        self._last = time.monotonic()
        s = self.stats
        s["saves"] += 1
        s["bytes"] += written
        s["last_seconds"] = seconds
        s["max_seconds"] = max(s["max_seconds"], seconds)
        s["total_seconds"] += seconds
        s["requests"], s["tokens"] = with_progress_count(state), self.file.tokens
        s["generated_at_save"] = generated

    def remove(self) -> None:
        """Nothing is in flight any more (the shard is done)."""
        self.file.remove()
        self.stats.update(requests=0, tokens=0)


def with_progress(request: Request, resumable: dict[str, list[ChoiceProgress]]) -> Request:
    """`request` carrying its checkpointed progress, if it has one (taken out of
    `resumable`: a request resumes once)."""
    progress = resumable.pop(request.request_id, None)
    return request if progress is None else replace(request, resume=progress)

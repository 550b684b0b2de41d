"""Fault injection for the reliability tests, and nothing else.

Every fault is off unless the environment of the job names it; the variables below are read
here and nowhere else. Production code asks for its hook once, when it builds the object
concerned (`writer_fault`, `admit_fault`, `replica_fault`, `stuck_seconds`), and gets None (or
0) when the variable is unset: a normal run has no fault behaviour at all. Tests that run in
their own process build the hooks directly (`WriterFault(on_phase=...)`) instead.

| variable | fault |
|---|---|
| BATCHGEN_TEST_WRITER_FAULT=PHASE[:N] | SIGKILL at the N-th time a results flush reaches PHASE |
| BATCHGEN_TEST_DISK_FULL_AT=BYTES | the results file's disk "fills up" at BYTES (ENOSPC) |
| BATCHGEN_TEST_CRASH_ON_ADMIT=ID | SIGKILL the worker right after it admits (and journals) ID |
| BATCHGEN_TEST_DIVERGE=RANK:STEP | that TP rank drops one scheduled chunk at that step |
| BATCHGEN_TEST_STUCK_S=S | each decode iteration sleeps S s (a burst S s per step) |
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

WRITER_FAULT_ENV = "BATCHGEN_TEST_WRITER_FAULT"
DISK_FULL_ENV = "BATCHGEN_TEST_DISK_FULL_AT"
CRASH_ON_ADMIT_ENV = "BATCHGEN_TEST_CRASH_ON_ADMIT"
DIVERGE_ENV = "BATCHGEN_TEST_DIVERGE"
STUCK_ENV = "BATCHGEN_TEST_STUCK_S"
PHASES = ("before_write", "mid_write", "after_write", "after_fsync")
"""The points of a results flush a WriterFault stops at, in order."""


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class WriterFault:
    """A results file's flush (io.writer.IncrementalWriter takes one as `fault`) the faulty
    way: the data goes down in two halves, `on_phase` is called at each of PHASES (it may raise
    or end the process), and with `disk_full_at` the disk fills up at that file size: what fits
    is written, then the write fails with ENOSPC, so the writer's own rollback runs."""

    def __init__(self, on_phase: Callable[[str], None] | None = None,
                 disk_full_at: int | None = None):
        self.on_phase = on_phase or (lambda phase: None)
        self.disk_full_at = disk_full_at

    def flush(self, fd: int, data: memoryview, write_all: Callable[[memoryview], None]) -> None:
        self.on_phase("before_write")
        half = len(data) // 2
        self._write(fd, data[:half], write_all)
        self.on_phase("mid_write")
        self._write(fd, data[half:], write_all)
        self.on_phase("after_write")
        os.fsync(fd)
        self.on_phase("after_fsync")

    def _write(self, fd: int, data: memoryview, write_all: Callable[[memoryview], None]) -> None:
        if self.disk_full_at is not None:
            room = self.disk_full_at - os.fstat(fd).st_size
            if len(data) > room:
                write_all(data[:max(room, 0)])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(data)


def kill_at(spec: str) -> Callable[[str], None]:
    """An `on_phase` that SIGKILLs the process the N-th time the flush reaches PHASE
    ("PHASE[:N]", N defaulting to 1)."""
    phase, _, nth = spec.partition(":")
    if phase not in PHASES:
        raise ValueError(f"{WRITER_FAULT_ENV}={spec!r}: phase must be one of {PHASES}")
    target, seen = int(nth or 1), [0]

    def on_phase(at: str) -> None:
        if at == phase:
            seen[0] += 1
            if seen[0] == target:
                _kill_self()
    return on_phase


def writer_fault() -> WriterFault | None:
    """The results writer's fault named by the environment, or None."""
    kill, full = os.environ.get(WRITER_FAULT_ENV), os.environ.get(DISK_FULL_ENV)
    if not kill and not full:
        return None
    return WriterFault(kill_at(kill) if kill else None, int(full) if full else None)


def admit_fault() -> Callable[[list[str]], None] | None:
    """Called with each admission wave's custom_ids once journaled: SIGKILLs the process when
    the environment's custom_id is among them. None when unset."""
    victim = os.environ.get(CRASH_ON_ADMIT_ENV)
    if not victim:
        return None

    def on_admit(custom_ids: list[str]) -> None:
        if victim in custom_ids:
            _kill_self()
    return on_admit


def replica_fault(rank: int) -> Callable[[int, list], None] | None:
    """Called with each step's number and scheduled chunks before the replicas compare them:
    at the environment's RANK (this TP rank) and from its STEP on, drops one chunk, once, so
    the replica check must catch the divergence. None when unset or another rank's."""
    spec = os.environ.get(DIVERGE_ENV)
    if not spec:
        return None
    target_rank, at_step = (int(v) for v in spec.split(":"))
    if target_rank != rank:
        return None
    done = [False]

    def tamper(step: int, chunks: list) -> None:
        if not done[0] and step >= at_step and chunks:
            chunks.pop()
            done[0] = True
    return tamper


def stuck_seconds() -> float:
    """Seconds each decode iteration sleeps inside its watchdog deadline (0: none)."""
    value = float(os.environ.get(STUCK_ENV) or 0.0)
    if value < 0:
        raise ValueError(f"{STUCK_ENV}={value}: seconds >= 0")
    return value

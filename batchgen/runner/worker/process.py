"""A worker process under the launcher: its stop signals, dying with the supervisor and the
launch time its startup deadline counts from. The supervisor's side is runner/leader/launch.py,
which sets the environment variables named here."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from batchgen.runner.exits import STOP_SIGNALS, ExitCode

WORKER_STOP_SIGNALS = tuple(getattr(signal, name) for name in STOP_SIGNALS)
"""A worker stops at its next step on each signal that stops the job. The agent forwards the
supervisor's own signal and Slurm may signal every process: SIGQUIT left at its default
would kill the worker mid-step and dump a core the size of its memory (weights included)."""
WORKER_GRACE_SHARE = 0.75
SAME_NOTICE_S = 2.0
"""Signals this close together are one notice: Slurm signals every process of the step and the
agent forwards its own copy, so a worker may see the same preemption twice within milliseconds."""
LAUNCHED_AT_ENV = "BATCHGEN_LAUNCHED_AT"
"""Unix time the supervisor launched the workers: --startup-timeout counts from it."""
SUPERVISOR_PID_ENV = "BATCHGEN_SUPERVISOR_PID"


@dataclass
class StopFlag:
    """A worker's stop signals: the first stops admission (the loop flushes and exits 75); the
    worker leaves by itself once its share of the grace period is spent; a second notice (more
    than SAME_NOTICE_S later) exits at once. Finished lines are durable at every instant, so
    leaving early only costs recomputing what was in flight."""

    grace: float
    requested: bool = False
    serving: bool = False
    """Set once the worker loop runs; before that (loading) there is nothing to flush."""
    _first_at: float | None = field(default=None, repr=False)

    def install(self) -> None:
        for sig in WORKER_STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_at is not None:
            if now - self._first_at >= SAME_NOTICE_S:
                os._exit(ExitCode.REQUEUE)
            return
        self._first_at = now
        if not self.serving:
            os._exit(ExitCode.REQUEUE)
        self.requested = True
        leave = threading.Timer(self.grace * WORKER_GRACE_SHARE, os._exit, (ExitCode.REQUEUE,))
        leave.daemon = True
        leave.start()


def die_with_supervisor() -> None:
    """SIGKILL this worker when the supervisor dies (even by SIGKILL): an orphaned worker would
    keep computing and holding the job's files. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor and os.getppid() != int(supervisor):
        os._exit(ExitCode.REQUEUE)  # it died before prctl took effect


def launched_at() -> float:
    """When the supervisor launched this worker (now, when run by hand)."""
    try:
        return float(os.environ[LAUNCHED_AT_ENV])
    except (KeyError, ValueError):
        return time.time()

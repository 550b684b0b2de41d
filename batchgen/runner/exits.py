"""The requeue exit code and the stop signals, in a module that imports nothing heavy: the
`batchgen` entry point catches stop signals with it before the command line loads."""

from __future__ import annotations

import os
import signal

EXIT_REQUEUE = 75
"""Exit code meaning "preempted: requeue me" (EX_TEMPFAIL); Slurm jobs requeue on it. Finished
results are durable: the same command resumes."""

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""Signals that stop a job (SIGUSR1: Slurm --signal, spot notices)."""


def requeue_on_stop_signals() -> None:
    """Until the supervisor installs its handlers (importing it takes seconds: torch), a stop
    signal exits 75 at once: nothing has started, so nothing is lost, and a wrapper that
    requeues on 75 sees the code docs/reliability.md promises instead of a signal death."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _requeue)


def _requeue(signum, frame) -> None:
    os._exit(EXIT_REQUEUE)

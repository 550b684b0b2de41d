"""The exit codes and the stop signals, in a module that imports nothing heavy: the `batchgen`
entry point catches stop signals with it before the command line loads, and the supervisor's
own handlers (`StopSignals`) live here too. docs/reliability.md tables the exit codes."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from enum import IntEnum
from typing import NoReturn


class ExitCode(IntEnum):
    """Every exit code batchgen sets (the process's, a worker's, a command's)."""

    OK = 0
    """Done (also: the job was already complete)."""
    CRASH = 1
    """A worker crashed (signal or unexpected error); re-running resumes."""
    FAILED = 1
    """`validate` found invalid lines, `status` found no job (the same code as CRASH)."""
    INPUT = 2
    """Bad input file, flags or paths."""
    RESUME_REFUSED = 3
    """Settings that decide the answers changed, or a corrupt results or batch file."""
    LOCKED = 4
    """The job is held by another live run."""
    MODEL = 5
    """Model not found or unusable."""
    DISK = 6
    """Disk full or failing (or too little disk at preflight)."""
    INCOMPLETE = 7
    """Results incomplete at the final merge."""
    PREFLIGHT = 8
    """The machine is not ready (/dev/shm, host memory, no CUDA device)."""
    WATCHDOG = 70
    """A worker group ended by the watchdog (a restart resumes)."""
    DEVICE_OOM = 71
    """Device out of memory."""
    REQUEUE = 75
    """Preempted: requeue me (EX_TEMPFAIL); Slurm jobs requeue on it. Finished results are
    durable: the same command resumes."""

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""Signals that stop a job (SIGUSR1: Slurm --signal, spot notices)."""


def requeue_on_stop_signals(announce: bool = False) -> None:
    """Until the supervisor installs its handlers (importing it takes seconds: torch), a stop
    signal exits 75 at once: nothing has started, so nothing is lost, and a wrapper that
    requeues on 75 sees the code docs/reliability.md promises instead of a signal death.
    `announce`: say so on stderr (the command a person started; a worker leaves it to its
    supervisor)."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _requeue_announced if announce else _requeue)


def ignore_stop_signals() -> None:
    """From here the stop signals change nothing (the exit code is decided)."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _requeue(signum, frame) -> None:
    os._exit(ExitCode.REQUEUE)


def _requeue_announced(signum, frame) -> None:
    os.write(2, f"batchgen: stopped by {signal.Signals(signum).name} before the job started: "
                "nothing was run; re-run the same command (exit 75: requeue)\n".encode())
    os._exit(ExitCode.REQUEUE)


def exit_without_teardown(code: int) -> NoReturn:
    """Leave with `code` once the process has done what a normal exit does for others: its
    threads joined (the non-daemon ones), its atexit functions run (multiprocessing joins its
    children there), its logs and standard streams flushed. What it skips is the interpreter's
    teardown of its modules, which with torch and transformers loaded takes 0.5-1.4 s of CPU
    after the results are durable, in the supervisor and again in every worker."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    os._exit(code)


def exit_code_of(done: SystemExit) -> int | None:
    """The process exit code `sys.exit(x)` asks for, or None where Python must print `x`
    itself (a message: exit 1 after it)."""
    if done.code is None:
        return ExitCode.OK
    return done.code if isinstance(done.code, int) else None


class Preempted(BaseException):
    """A stop signal: leave with ExitCode.REQUEUE (BaseException: no `except Exception` eats it)."""


class StopSignals:
    """The supervisor's own stop handlers (the launcher replaces them while it runs)."""

    def __init__(self) -> None:
        self.stopping = False
        self.completed = False  # on record as completed: a stop signal changes nothing now
        self._previous: dict = {}

    def install(self) -> None:
        for sig in (getattr(signal, name) for name in STOP_SIGNALS):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        """Put back the handlers found at install(), except the entry point's early ones
        (`requeue_on_stop_signals`): those mean "nothing decided yet, exit 75", but the job's
        exit code is decided once we get here, so a signal from now on changes nothing."""
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if previous is _requeue else previous)

    def _handle(self, signum, frame) -> None:
        if self.completed:  # the exit stays 0: a requeue would only find the job done
            if self.stopping:
                os._exit(ExitCode.OK)
            self.stopping = True
            return
        if self.stopping:
            os._exit(ExitCode.REQUEUE)  # a second signal: leave now; finished lines are durable
        self.stopping = True
        raise Preempted(signal.Signals(signum).name)

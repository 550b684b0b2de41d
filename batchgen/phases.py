"""Start-up phases: where the seconds between the command and the first token go.

A `StartupClock` records the wall time at which each phase ended (`mark`); `durations()` turns
them into seconds per phase, the first one measured from the moment the operating system
started the process (so interpreter start and imports are counted too). Wall times (not
monotonic ones) are recorded so a worker's marks can be read against its supervisor's start.
"""

from __future__ import annotations

import os
import time

_IMPORTED_AT = time.time()
"""Fallback process start where /proc is not readable (the moment this module loaded)."""


def process_start_time() -> float:
    """Wall time at which this process started, from /proc (Linux); else when this module
    was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22 (starttime, clock ticks after boot); fields after the parenthesised name.
        start_ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


class StartupClock:
    """Phase end times of one process, in order; `origin` is when its first phase began."""

    def __init__(self, origin: float | None = None):
        self.origin = process_start_time() if origin is None else origin
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """`phase` ended now (or at `at`); a phase marked twice keeps its first end."""
        self.marks.setdefault(phase, time.time() if at is None else at)

    def durations(self) -> dict[str, float]:
        """Seconds of each phase, from the end of the one before (the first from `origin`)."""
        out: dict[str, float] = {}
        last = self.origin
        for phase, at in sorted(self.marks.items(), key=lambda item: item[1]):
            out[phase] = round(max(0.0, at - last), 3)
            last = max(last, at)
        return out

    def since_origin(self) -> float:
        """Seconds from `origin` to now."""
        return time.time() - self.origin


def format_phases(durations: dict[str, float]) -> str:
    """`process 0.4 s, weights 3.1 s, ...` in the order given."""
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s"
                     for name, seconds in durations.items())

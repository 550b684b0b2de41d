"""Progress of a Hub download (hub.py): a tqdm bar on a terminal, log lines in a job's log."""

from __future__ import annotations

import logging
import os
import sys
import time

from batchgen.core import human_seconds, rate_text

log = logging.getLogger("batchgen.hub")


def progress(total: int, initial: int):
    """A tqdm bar on a terminal; where stderr is a file or a pipe (a Slurm log, a job under
    nohup), `LoggedProgress` lines instead, which a log can hold."""
    from tqdm.auto import tqdm

    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is not None:
        return tqdm(total=total, initial=initial, disable=True)
    if not sys.stderr.isatty():
        return LoggedProgress(total, initial)
    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc="download")


class LoggedProgress:
    """Download progress as a log line every `every_s` seconds (and at the end): bytes so far,
    share, rate since the start."""

    def __init__(self, total: int, initial: int, every_s: float = 30.0):
        self.total, self.done, self.start_done = total, initial, initial
        self.every_s = every_s
        self.started = self.last = time.monotonic()

    def __enter__(self) -> "LoggedProgress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self._say()

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= self.every_s:
            self._say()

    def _say(self) -> None:
        self.last = time.monotonic()
        rate = (self.done - self.start_done) / max(1e-9, self.last - self.started)
        left = self.total - self.done
        eta = f", about {human_seconds(left / rate)} left" if rate > 0 and left > 0 else ""
        log.info("download: %.2f of %.2f GB (%.0f%%), %s MB/s%s", self.done / 1e9,
                 self.total / 1e9, 100 * self.done / max(1, self.total), rate_text(rate / 1e6),
                 eta)

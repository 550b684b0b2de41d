"""One live run per job: an exclusive flock on batches/{batch_id}.lock naming its holder.

A run spread over nodes (or over the ranks of an external launcher) is one run: its leader
(node 0, rank 0) holds the job lock; every other member holds batches/{batch_id}.node{R}.lock
(or .rank{R}.lock) instead. So members never contend with the leader, and two copies of the
same member (a stale node still running when its job was requeued) cannot both start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from batchgen.atomic import is_named, open_job_file
from batchgen.io.jobfiles import FOLDER_MODE

log = logging.getLogger("batchgen.lock")


class JobLocked(RuntimeError):
    pass


class JobLock:
    def __init__(self, path: Path, what: str = "job is already running",
                 remove_on_release: bool = False):
        self.path = Path(path)
        self.what = what
        """What a live holder means, for the refusal."""
        self.remove_on_release = remove_on_release
        """Unlink the lock file on release (it sits in a user's folder): a waiter that locked
        the unlinked file notices and locks the path's new file instead."""
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock, waiting up to `wait_s` seconds (--wait-for-lock) for a live holder
        to let go; JobLocked naming the holder if it does not."""
        self.path.parent.mkdir(FOLDER_MODE, parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while True:
            fd = open_job_file(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                self._wait_for(fd, deadline, wait_s)
            except BaseException:  # refused, or a stop signal while waiting
                os.close(fd)
                raise
            if is_named(fd, self.path):
                break
            os.close(fd)  # its holder removed it while we waited: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def _wait_for(self, fd: int, deadline: float, wait_s: float) -> None:
        """flock `fd`, retrying every 0.5 s until `deadline` (monotonic; `wait_s`: the wait
        asked for, as the messages say it)."""
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    waited = f" after waiting {wait_s:g} s" if wait_s else ""
                    raise JobLocked(f"{self.what} ({_holder(fd)}, lock {self.path})"
                                    f"{waited}; wait for it to finish (--wait-for-lock SECONDS "
                                    "waits for you), or stop it first (a dead holder releases "
                                    "the lock itself)") from None
                if not announced:
                    log.warning("job is running elsewhere (%s, lock %s): waiting up to %g s "
                                "for it to end (--wait-for-lock)", _holder(fd), self.path,
                                wait_s)
                    announced = True
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # no stale holder name for the next run to report
                if self.remove_on_release:
                    self.path.unlink()  # still locked: a waiter sees it is gone (is_named)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def member_lock(batch_file: Path, kind: str, member: int) -> JobLock:
    """The lock of member `member` (> 0) of a group: kind "node" or "rank"."""
    batch_file = Path(batch_file)
    return JobLock(batch_file.with_name(f"{batch_file.name.split('.')[0]}.{kind}{member}.lock"))



def _holder(fd: int) -> str:
    """Who holds the lock; it writes its name right after taking the lock, so wait a moment."""
    for _ in range(20):
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if holder:
            return holder
        time.sleep(0.025)
    return "holder unknown"

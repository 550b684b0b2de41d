"""Errors a user can fix, shown as one clear message and an exit code (never a traceback).

The exit code of each error is an `exits.ExitCode` (docs/reliability.md tables them).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable

from batchgen.io.jobfiles import CorruptBatchFile, FingerprintMismatch, UnsafeJobPath
from batchgen.io.reader import InputFileError
from batchgen.io.writer import CorruptIncrementalFile, IncompleteResults, WriteFailed, WriterLocked
from batchgen.models.errors import CheckpointError, ModelNotFoundError
from batchgen.models.registry import UnsupportedModelError
from batchgen.runner.exits import ExitCode
from batchgen.runner.files.lock import JobLocked

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
"""OSErrors that mean "the disk cannot take our writes": reported as exit 6, never retried."""


DISK_FIXES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space under your disk quota (or have it raised)",
    errno.EROFS: "the file system is mounted read-only: remount it read-write (another "
                 "--storage-path is another job, which starts over)",
    errno.EIO: "the disk reported an I/O error: check it (dmesg, the storage's health)",
    errno.EFBIG: "a file outgrew the file system's or the shell's limit (ulimit -f): raise it, "
                 "or use another file system",
}
"""What to do about each of DISK_ERRNOS, as the message says it."""


class DiskError(Exception):
    """A job file could not be written (ENOSPC, EIO, ...); what was saved before is safe."""


class PreflightFailed(Exception):
    """The machine is not ready for this job; the message names each fix."""

    def __init__(self, message: str, code: int = ExitCode.PREFLIGHT):
        super().__init__(message)
        self.code = code


EXIT_CODES = {
    InputFileError: ExitCode.INPUT,
    UnsafeJobPath: ExitCode.INPUT,
    FingerprintMismatch: ExitCode.RESUME_REFUSED,
    CorruptBatchFile: ExitCode.RESUME_REFUSED,
    CorruptIncrementalFile: ExitCode.RESUME_REFUSED,
    JobLocked: ExitCode.LOCKED,
    WriterLocked: ExitCode.LOCKED,
    ModelNotFoundError: ExitCode.MODEL,
    CheckpointError: ExitCode.MODEL,
    UnsupportedModelError: ExitCode.MODEL,
    WriteFailed: ExitCode.DISK,
    DiskError: ExitCode.DISK,
    IncompleteResults: ExitCode.INCOMPLETE,
}


def exit_code_of(err: BaseException) -> int:
    if isinstance(err, PreflightFailed):
        return err.code
    return EXIT_CODES[type(err)]


@contextlib.contextmanager
def user_errors(fail: Callable[[str, int], None]):
    try:
        yield
    except (*EXIT_CODES, PreflightFailed) as err:
        fail(str(err), exit_code_of(err))


def is_disk_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in DISK_ERRNOS


@contextlib.contextmanager
def disk_errors(doing: str):
    """Turn "the disk cannot take our writes" into DiskError naming what we were doing."""
    try:
        yield
    except OSError as err:
        if not is_disk_error(err):
            raise
        where = f" ({err.filename})" if err.filename else ""
        raise DiskError(
            f"could not {doing}: {err.strerror}{where} "
            f"[{errno.errorcode.get(err.errno or 0, err.errno)}]. Results saved before are safe; "
            f"{DISK_FIXES.get(err.errno, 'fix the disk')} and run the same command again to "
            "resume") from None

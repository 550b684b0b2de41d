"""Errors a user can fix, shown as one clear message and an exit code (never a traceback).

Exit codes of `batchgen run` (docs/reliability.md):
  0 done   1 a worker crashed (re-run resumes)   2 bad input or flags   3 resume refused
  4 job locked by a live run   5 model not found / unusable   6 disk full or failing
  7 results incomplete   8 preflight: the machine is not ready   70 watchdog
  71 device out of memory   75 stopped by a signal: requeue me
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable

from batchgen.io.jobfiles import CorruptBatchFile, FingerprintMismatch, UnsafeJobPath
from batchgen.io.reader import InputFileError
from batchgen.io.writer import CorruptIncrementalFile, IncompleteResults, WriteFailed, WriterLocked
from batchgen.models.loader import CheckpointError, ModelNotFoundError
from batchgen.models.registry import UnsupportedModelError
from batchgen.runner.lock import JobLocked

EXIT_CRASH = 1
EXIT_INPUT = 2
EXIT_LOCKED = 4
EXIT_DISK = 6
EXIT_PREFLIGHT = 8
EXIT_DEVICE_OOM = 71
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
"""OSErrors that mean "the disk cannot take our writes": reported as exit 6, never retried."""


class DiskError(Exception):
    """A job file could not be written (ENOSPC, EIO, ...); what was saved before is safe."""


class PreflightFailed(Exception):
    """The machine is not ready for this job; the message names each fix."""

    def __init__(self, message: str, code: int = EXIT_PREFLIGHT):
        super().__init__(message)
        self.code = code


EXIT_CODES = {
    InputFileError: EXIT_INPUT,
    UnsafeJobPath: EXIT_INPUT,
    FingerprintMismatch: 3,
    CorruptBatchFile: 3,
    CorruptIncrementalFile: 3,
    JobLocked: EXIT_LOCKED,
    WriterLocked: EXIT_LOCKED,
    ModelNotFoundError: 5,
    CheckpointError: 5,
    UnsupportedModelError: 5,
    WriteFailed: EXIT_DISK,
    DiskError: EXIT_DISK,
    IncompleteResults: 7,
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
            "free space (or fix the disk) and run the same command again to resume") from None

"""Errors a user can fix, shown as one clear message and an exit code (never a traceback)."""

from __future__ import annotations

import contextlib
from typing import Callable

from batchgen.io.jobfiles import FingerprintMismatch
from batchgen.io.reader import InputFileError
from batchgen.io.writer import CorruptIncrementalFile, IncompleteResults, WriteFailed, WriterLocked
from batchgen.models.loader import CheckpointError, ModelNotFoundError
from batchgen.models.registry import UnsupportedModelError
from batchgen.runner.lock import JobLocked

EXIT_CODES = {
    InputFileError: 2,
    FingerprintMismatch: 3,
    CorruptIncrementalFile: 3,
    JobLocked: 4,
    WriterLocked: 4,
    ModelNotFoundError: 5,
    CheckpointError: 5,
    UnsupportedModelError: 5,
    WriteFailed: 6,
    IncompleteResults: 7,
}


@contextlib.contextmanager
def user_errors(fail: Callable[[str, int], None]):
    try:
        yield
    except tuple(EXIT_CODES) as err:
        fail(str(err), EXIT_CODES[type(err)])

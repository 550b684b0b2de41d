"""Files replaced all or nothing (temp file, fsync, rename, fsync the folder), and the small
JSON records written that way; every open refuses to follow a symbolic link. Used by every
layer that keeps state on disk (job files, the conversion cache, the watchdog and quarantine
records), so it depends on nothing in batchgen."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson


NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
"""Flags of every job file open: a symbolic link planted where a job file goes is never
followed (the storage folder may be shared, and batch ids are predictable)."""


class UnsafeJobPath(Exception):
    """A job folder or file another user could redirect (a planted link, a folder owned by
    someone else or writable by everyone)."""


def open_job_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open with NOFOLLOW: a symbolic link at `path` raises UnsafeJobPath, never opened."""
    try:
        return os.open(path, flags | NOFOLLOW, mode)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise UnsafeJobPath(link_message(Path(path))) from None


def link_message(path: Path) -> str:
    return (f"{path} is a symbolic link (to {os.readlink(path)!r}); batchgen never writes a job "
            "file through a link, since another user could have planted it to overwrite "
            "their target: remove the link (and check who made it), or use a storage folder "
            "only you can write (--storage-path)")


def is_named(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path`: not removed (unlinked, or NFS's
    silly-renamed `.nfsXXXX`, or gone on another node: ESTALE) and not replaced by another
    file under that name."""
    try:
        mine = os.fstat(fd)
        if mine.st_nlink == 0:
            return False
        named = os.lstat(path)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ESTALE):
            return False
        raise
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """Write `path` all or nothing: temp file beside it, fsync, rename, fsync the folder.
    On an exception the temp file is removed and `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a stale one (or a planted link): O_EXCL creates a new file
    f = os.fdopen(open_job_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        try:
            f.close()  # may raise again (ENOSPC while flushing): the temp file still goes
        except OSError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        raise


def read_json_dict(path: Path) -> dict | None:
    """A small JSON record file written by write_json_atomic: its object, or None when it is
    missing, unreadable or not an object (callers treat it as absent and rewrite it)."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: Any) -> None:
    with atomic_file(path) as f:
        f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")

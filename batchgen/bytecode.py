"""Bytecode for installs that ship none, compiled in parallel while the imports run.

Python compiles a module's source the first time it imports it and normally keeps the result
in `__pycache__` beside the source. Where packages were installed without bytecode (uv's
default, `pip install --no-compile`) and Python may not write it (`PYTHONDONTWRITEBYTECODE=1`,
common in container images), every start compiles everything it imports again: for batchgen's
start (torch, transformers' configs and the modules they pull in, ~2,000 modules) that is
10-20 s of one core, before the first weight is read.

There, `start_bytecode_compile` (called first thing by `batchgen run`, `batchgen bench` and
each worker) points Python's bytecode cache at a directory of batchgen's own
(`sys.pycache_prefix`, nothing is written beside any source) and starts one process
(`python -m batchgen.bytecode`) that compiles the modules a start imports
(`startup_modules.txt`, in import order) into it on all but one core (at most 16). The imports
then find most modules compiled ahead of them; what the list lacks they compile and cache
themselves. A later start on the same machine finds the cache filled. The environment variable
PYTHONPYCACHEPREFIX passes the directory to the processes this one starts (the workers), which
read it and add what they compile themselves.

Installs that ship bytecode (pip's default) or may write it are left exactly as they are. This
module imports nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from batchgen.config import cache_root

MANIFEST = Path(__file__).with_name("startup_modules.txt")
"""Source files a start imports, as `package/relative/path.py`, in import order
(`python scripts/startup_modules.py` writes it)."""


MAX_WORKERS = 16
"""A start's ~2,000 modules compile in about a second on 16 cores; more processes only cost
memory and start time."""


def cache_dir() -> Path:
    """Where the bytecode goes: bytecode/ in batchgen's cache, beside the converted models."""
    return cache_root() / "bytecode"


def needs_compiling(probe: str = "torch") -> bool:
    """Would this start compile its imports from source? Only where Python may not write
    bytecode, no cache directory is set, and `probe` (torch: the largest import) ships no
    bytecode."""
    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return False
    spec = importlib.util.find_spec(probe)
    if spec is None or not spec.origin:
        return False
    return not os.path.exists(importlib.util.cache_from_source(spec.origin))


def start_bytecode_compile(manifest: Path = MANIFEST, target: Path | None = None,
                           workers: int | None = None,
                           probe: str = "torch") -> subprocess.Popen | None:
    """Where `needs_compiling(probe)`: cache bytecode in `target` (default `cache_dir()`) from
    now on and start compiling `manifest` into it; returns the compiling process (None:
    nothing to do, or the directory cannot be made). It is ended at exit if still running."""
    target = target or cache_dir()
    if sys.pycache_prefix and Path(sys.pycache_prefix) == target:
        sys.dont_write_bytecode = False  # a parent's start set this cache up: add to it
        return None
    if not needs_compiling(probe):
        return None
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable home: compile as before
    sys.pycache_prefix = str(target)
    sys.dont_write_bytecode = False  # into `target` only, never beside a source
    os.environ["PYTHONPYCACHEPREFIX"] = str(target)  # the workers started later read it
    process = subprocess.Popen(compiler_command(target, manifest, workers or default_workers()),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    atexit.register(_end, process)
    return process


def compiler_command(target: Path, manifest: Path, workers: int) -> list[str]:
    """The command of the process that compiles `manifest` into `target` (`compile_all`)."""
    return [sys.executable, "-m", "batchgen.bytecode", str(target), str(manifest), str(workers)]


def default_workers() -> int:
    """All the cores this process may use but one, at most MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))  # a Slurm allocation's or cgroup's cores
    except AttributeError:
        cores = os.cpu_count() or 2
    return max(1, min(MAX_WORKERS, cores - 1))


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def manifest_sources(manifest: Path) -> list[str]:
    """The manifest's files that exist here, as absolute paths, in its order. An entry is
    `package/relative/path.py` or, for a top-level module, `module.py`; each is found without
    importing anything."""
    roots: dict[str, str | None] = {}
    found = []
    for line in manifest.read_text().splitlines():
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        top, _, rest = entry.partition("/")
        if top not in roots:
            roots[top] = _location(top.removesuffix(".py") if not rest else top, bool(rest))
        root = roots[top]
        path = os.path.join(root, rest) if root and rest else root
        if path and os.path.isfile(path):
            found.append(path)
    return found


def _location(name: str, package: bool) -> str | None:
    """A top-level package's folder, or a top-level module's file (None: not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if package:
        return spec.submodule_search_locations[0] if spec.submodule_search_locations else None
    return spec.origin if spec.origin and spec.origin.endswith(".py") else None


def _compile(source: str) -> None:
    import py_compile

    cached = importlib.util.cache_from_source(source)  # under sys.pycache_prefix: set here
    if _fresh(source, cached):
        return
    try:
        py_compile.compile(source, cfile=cached, doraise=True)
    except (py_compile.PyCompileError, OSError, ValueError):
        pass  # the import compiles it itself and reports any error there


def _fresh(source: str, cached: str) -> bool:
    """Does `cached` hold this Python's bytecode of `source` as it is now (the header the
    import checks: magic number, then the source's mtime and size)?"""
    try:
        with open(cached, "rb") as f:
            header = f.read(16)
        stat = os.stat(source)
    except OSError:
        return False
    return (len(header) == 16 and header[:4] == importlib.util.MAGIC_NUMBER
            and int.from_bytes(header[4:8], "little") == 0
            and int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF)


def _set_prefix(target: str) -> None:
    sys.pycache_prefix = target


def compile_all(target: str, manifest: Path, workers: int) -> None:
    """Compile the manifest's files that lack fresh bytecode into `target` with `workers`
    processes, in its order. One process compiles into a directory at a time (a lock there):
    the ranks that torchrun starts side by side do not all compile the same files."""
    import fcntl
    from concurrent.futures import ProcessPoolExecutor

    with open(os.path.join(target, "compile.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another start is compiling them
        sources = manifest_sources(manifest)
        with ProcessPoolExecutor(workers, initializer=_set_prefix,
                                 initargs=(target,)) as pool:
            for _ in pool.map(_compile, sources, chunksize=8):
                pass


if __name__ == "__main__":
    compile_all(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))

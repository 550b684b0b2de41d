"""`batchgen status`: what a job's batch file, incremental files, lock and workers' stats say."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from batchgen.io.jobfiles import JobPaths
from batchgen.io.writer import CorruptIncrementalFile, read_done_ids
from batchgen.runner.exits import ExitCode
from batchgen.runner.job import JobSpec
from batchgen.runner.progress import read_worker_stats


def show_status(storage: Path, target: str | None) -> int:
    """Print each job's table. target: a batch id under `storage`, or a job folder (a storage
    path: every job in it); None: every job under `storage`."""
    batch_id = target
    if target is not None and ("/" in target or Path(target).is_dir()):
        storage, batch_id = Path(target), None
    batches = storage / "batches"
    if batch_id is None:
        files = sorted(p for p in batches.glob("*.json") if p.stem.count(".") == 0)
    else:  # an id is a file name, never a pattern
        files = [p for p in [batches / f"{batch_id}.json"] if p.is_file()]
    if not files:
        Console(stderr=True, soft_wrap=True).print(
            f"no job{' ' + batch_id if batch_id else ''} under {storage} (give a batch id with "
            "--storage-path, or a job folder)")
        return ExitCode.FAILED
    console, failed = Console(), ExitCode.OK
    for path in files:
        try:
            state = orjson.loads(path.read_bytes())
            batch_id = state["batch_id"]
            table = _table(state, read_worker_stats(batches, batch_id))
            if state.get("status") != "completed":
                table.add_row("saved", _saved(storage, batch_id, state))
                table.add_row("run", _liveness(batches / f"{batch_id}.lock", state["status"]))
            console.print(table)
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as err:
            Console(stderr=True, soft_wrap=True).print(f"cannot read {path}: {err!r}")
            failed = ExitCode.FAILED
    return failed


def _saved(storage: Path, batch_id: str, state: dict) -> str:
    """Results fsynced so far: the incremental files' complete lines (the batch file's counts
    are only written when the job ends)."""
    spec = storage / "batches" / f"{batch_id}.spec.json"
    try:
        paths = JobSpec.load(spec).paths  # where this job's --incremental-output-dir points
    except (OSError, ValueError, KeyError, TypeError):
        paths = JobPaths.for_job(storage, batch_id)
    try:
        done = len(read_done_ids(paths.incremental_files()))
    except CorruptIncrementalFile as err:
        return f"unreadable: {err}"
    total = state.get("request_counts", {}).get("total", 0)
    return f"{done} of {total} results (incremental files)"


def _liveness(lock: Path, status: str) -> str:
    """Whether a live run holds the job: the lock file names its holder while held (a run
    that ends clears it; one killed outright leaves its pid behind). Never takes the lock:
    a status probe must not make a starting run think the job is busy."""
    try:
        holder = lock.read_text().strip()
    except OSError:
        holder = ""
    found = re.fullmatch(r"pid (\d+) on host (\S+)", holder)
    if found is not None and found.group(2) != socket.gethostname():
        return f"held by {holder} (another host: not checked from here)"
    if found is not None and _alive(int(found.group(1))):
        return f"running ({holder})"
    if status in ("validating", "in_progress", "finalizing"):
        return "not running: stopped before the end (the same command resumes it)"
    return "not running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _table(state: dict, workers: list[dict]) -> Table:
    table = Table(title=f"{state['batch_id']}: {state['status']}", show_header=False)
    counts = state.get("request_counts", {})
    table.add_row("requests", f"{counts.get('completed', 0)} completed, {counts.get('failed', 0)} "
                  f"failed, {counts.get('total', 0)} total"
                  + ("" if state.get("status") == "completed" else " (counted at the end)"))
    usage = state.get("usage", {})
    table.add_row("tokens", f"{usage.get('prompt_tokens', 0)} prompt, "
                  f"{usage.get('completion_tokens', 0)} completion")
    for key, value in state.get("throughput", {}).items():
        table.add_row(key, f"{value:,.1f}")
    table.add_row("output", state.get("output_file", ""))
    for key, value in state.get("health", {}).items():
        table.add_row(f"health.{key}", str(value))
    now = time.time()
    for w in workers:  # stats files are rewritten as workers go: take what is there
        beat = w.get("heartbeat")
        table.add_row(f"rank {w.get('rank', '?')}",
                      f"{w.get('completed', 0)} done, {w.get('failed', 0)} failed, "
                      f"{w.get('output_tokens_per_s', 0):,.1f} out tok/s, heartbeat "
                      + (f"{now - beat:.0f}s ago" if isinstance(beat, (int, float)) else "none"))
    return table

"""`batchgen status`: what a job's batch file and workers' stats say."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

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
        return 1
    console, failed = Console(), 0
    for path in files:
        try:
            state = orjson.loads(path.read_bytes())
            console.print(_table(state, read_worker_stats(batches, state["batch_id"])))
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as err:
            Console(stderr=True, soft_wrap=True).print(f"cannot read {path}: {err!r}")
            failed = 1
    return failed


def _table(state: dict, workers: list[dict]) -> Table:
    table = Table(title=f"{state['batch_id']}: {state['status']}", show_header=False)
    counts = state.get("request_counts", {})
    table.add_row("requests", f"{counts.get('completed', 0)} completed, {counts.get('failed', 0)} "
                  f"failed, {counts.get('total', 0)} total")
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

"""`batchgen status`: what a job's batch file and workers' stats say."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from batchgen.runner.progress import read_worker_stats


def show_status(storage: Path, batch_id: str | None) -> int:
    batches = storage / "batches"
    files = sorted(batches.glob(f"{batch_id or '*'}.json"))
    files = [f for f in files if f.stem.count(".") == 0]
    if not files:
        Console(stderr=True).print(f"no job{' ' + batch_id if batch_id else ''} under {storage}")
        return 1
    console = Console()
    for path in files:
        state = orjson.loads(path.read_bytes())
        console.print(_table(state, read_worker_stats(batches, state["batch_id"])))
    return 0


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
    for w in workers:
        table.add_row(f"rank {w['rank']}", f"{w['completed']} done, {w['failed']} failed, "
                      f"{w.get('output_tokens_per_s', 0):,.1f} out tok/s, heartbeat "
                      f"{now - w['heartbeat']:.0f}s ago")
    return table

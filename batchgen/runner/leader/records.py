"""What the batch file records when a run ends: status, health, the engines' counters (the
prefix cache's hit rate recomputed over the ranks), usage over every run, throughput, the
result files' paths and the start-up phases."""

from __future__ import annotations

import logging
import time

from batchgen.io.jobfiles import BatchFile, JobPaths
from batchgen.phases import format_phases, process_start_time
from batchgen.runner.files.job import JobSpec
from batchgen.runner.leader.progress import read_worker_stats
from batchgen.runner.worker.watchdog import health_from_stats

log = logging.getLogger("batchgen")


def try_record_end(*args, **kwargs) -> None:
    """Record how a failed or stopped run ended, without masking why it ended."""
    try:
        record_end(*args, **kwargs)
    except OSError as err:
        log.warning("could not update the batch file: %s", err)


def record_end(spec: JobSpec, batch_file: BatchFile, started: float, status: str,
                health: dict, counts: dict | None = None, usage: dict | None = None) -> None:
    """Status, health, counters, usage and throughput of the run that ends, from the workers'
    stats files. `usage`: the job's total (a completed job's, summed over its output lines)
    instead of the previous total plus this run's."""
    stats = read_worker_stats(spec.paths.batch_file.parent, spec.batch_id)
    elapsed = max(time.time() - started, 1e-9)
    completion = sum(s.get("completion_tokens", 0) for s in stats)
    prompt = sum(s.get("prompt_tokens", 0) for s in stats)
    changes = {
        "status": status, "health": {**health_from_stats(stats), **health},
        "counters": _engine_counters(stats),
        "timings": {"finished_at": int(time.time()), "last_run_seconds": round(elapsed, 3)},
        "throughput": {"output_tokens_per_s": round(completion / elapsed, 2),
                       "total_tokens_per_s": round((completion + prompt) / elapsed, 2)},
        **result_files(spec.paths), "usage": usage or _usage_after(batch_file, prompt, completion)}
    changes["timings"].update(_all_runs(batch_file, elapsed))
    if counts:
        changes["request_counts"] = counts
    startup = startup_phases(stats)
    if startup:
        changes["timings"]["startup"] = startup
        log.info("start-up: %s; whole run %.1f s", format_phases(startup),
                 time.time() - process_start_time())
    batch_file.update(spec.batch_id, **changes)


def result_files(paths: JobPaths) -> dict:
    """Absolute, so `batchgen status OUTPUT` finds the job from any working directory."""
    return {"output_file": str(paths.output.absolute()),
            "errors_file": str(paths.errors_output.absolute())}


def _all_runs(batch_file: BatchFile, elapsed: float) -> dict:
    """Runs of the job so far and their seconds together, this one included."""
    state = batch_file.load()
    timings = state.timings if state else {}
    return {"runs": int(timings.get("runs", 0)) + 1,
            "all_runs_seconds": round(float(timings.get("all_runs_seconds", 0.0)) + elapsed, 3)}


def startup_phases(stats: list[dict]) -> dict[str, float]:
    """Seconds of each start-up phase of this command: until the workers were launched (flag
    checks, input scan, lock, preflight), then the first worker's own phases (process start and
    imports, config, weights, host pool, graphs, first token, first result written)."""
    first = next((s for s in stats if s.get("startup")), None)
    if first is None:
        return {}
    launch = max(0.0, first.get("startup_origin", 0.0) - process_start_time())
    return {"launch": round(launch, 3), **dict(first["startup"])}  # pairs: in phase order


def _engine_counters(stats: list[dict]) -> dict:
    counters: dict = {}
    for s in stats:
        for key, value in s.get("engine", {}).items():
            if key == "prefix_hit_rate":
                continue  # a ratio: recomputed over the ranks below, not summed
            if isinstance(value, (int, float)):
                counters[key] = counters.get(key, 0) + value
            else:
                counters.setdefault(key, value)
    if "prompt_tokens" in counters:
        counters["prefix_hit_rate"] = (counters.get("cached_prompt_tokens", 0)
                                       / max(1, counters["prompt_tokens"]))
    return counters


def _usage_after(batch_file: BatchFile, prompt: int, completion: int) -> dict:
    """Token usage of every run so far (each run adds its own)."""
    state = batch_file.load()
    usage = dict(state.usage) if state else {}
    return usage_total(usage.get("prompt_tokens", 0) + prompt,
                        usage.get("completion_tokens", 0) + completion)


def usage_total(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

"""What the supervisor says when a worker fails or the job's files go: one paragraph for the
log and the batch file's `health.last_failure`, from the worker's exit code and what its stats
file recorded."""

from __future__ import annotations

import os
import shutil

from batchgen.io.jobfiles import JobPaths
from batchgen.runner.exits import ExitCode
from batchgen.runner.files.job import JobSpec
from batchgen.runner.leader.launch import WorkerFailure
from batchgen.runner.leader.progress import read_worker_stats


def removed_cause(what: str) -> str:
    """What to say when `what` (a job folder or results file) was removed during the run."""
    return (f"{what} was removed while the job ran: the results saved there are gone; run the "
            "same command again to start the job over (keep the storage folder until the job "
            "completes)")


def free_space(paths: JobPaths) -> str:
    """The free space where a worker writes: the incremental folder (results) and the job's
    batches folder (in-flight checkpoint, stats), each file system named once."""
    seen, parts = set(), []
    for folder in (paths.incremental_dir, paths.batch_file.parent):
        try:
            device, free = os.stat(folder).st_dev, shutil.disk_usage(folder).free
        except OSError:
            continue
        if device not in seen:
            seen.add(device)
            parts.append(f"{free / 1e6:.1f} MB free under {folder}")
    return ", ".join(parts) or "free space unknown: the job's folders cannot be read"


def failure_cause(spec: JobSpec, failure: WorkerFailure) -> str:
    """One paragraph for the log and the batch file's health.last_failure."""
    stats = {s.get("rank"): s
             for s in read_worker_stats(spec.paths.batch_file.parent, spec.batch_id)}
    mine = stats.get(failure.rank, {})
    resume = "re-run the same command to resume (under Slurm: requeue)"
    removed = spec.paths.removed_while_running()
    if removed is None and mine.get("removed"):  # its results file alone: the folders stand
        removed = str(mine["removed"])
    if removed is not None:
        return removed_cause(removed)
    if failure.cause:
        return f"{failure.cause}; {resume}"
    if failure.exitcode == ExitCode.WATCHDOG:
        cause = mine.get("watchdog", {}).get("cause", "watchdog: a deadline was missed")
        return f"worker rank {failure.rank}: {cause}; {resume}"
    if failure.exitcode == ExitCode.DISK:
        said = mine.get("failure", "it could not save results or its in-flight checkpoint "
                                   "(disk full or failing)")
        return f"worker rank {failure.rank}: {said} ({free_space(spec.paths)})"
    if failure.exitcode == ExitCode.DEVICE_OOM:
        return (f"worker rank {failure.rank} ran out of device memory; {resume}: the requests "
                "in flight are retried in smaller groups")
    if failure.exitcode == ExitCode.INPUT:
        said = mine.get("failure", "it could not read the job's parsed input")
        return f"worker rank {failure.rank}: {said}; {resume}"
    if failure.exitcode == ExitCode.MODEL:
        said = mine.get("failure", "it could not load the model")
        return (f"worker rank {failure.rank}: {said}. Nothing was answered with it; fix the "
                "model (or --model) and run again")
    if failure.exitcode == ExitCode.LOCKED:
        said = mine.get("failure", "its results file is locked by another live batchgen process")
        return (f"worker rank {failure.rank}: {said}; stop the other process (or wait for it) "
                f"and {resume}")
    how = (f"killed by signal {-failure.exitcode}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return (f"worker rank {failure.rank} crashed ({how}). The requests in flight are retried "
            f"in isolation on the next run; one in flight at "
            f"{spec.config.watchdog.quarantine_after} consecutive crashes is quarantined as an "
            f"error line; {resume}")

"""`batchgen run`: validate, lock, launch workers, show progress, write the final outputs.

Everything that can fail cheaply (flags, input file, fingerprint, lock) fails before any
weights load. The supervisor is the only writer of the batch file; workers write their own
incremental files and stats.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

from batchgen.config import JobConfig
from batchgen.io.jobfiles import (BatchFile, JobPaths, check_fingerprint, derive_batch_id,
                                  record_upload)
from batchgen.io.reader import scan_input
from batchgen.io.writer import finalize, read_done_ids
from batchgen.runner.job import EXIT_REQUEUE, JobSpec, fingerprint, now
from batchgen.runner.launch import WorkerFailure, launch_workers
from batchgen.runner.lock import JobLock
from batchgen.runner.progress import ProgressReporter, read_worker_stats

log = logging.getLogger("batchgen")


class JobRefused(RuntimeError):
    """The job cannot start (changed settings, corrupt state); nothing was touched."""


def model_identity(config: JobConfig) -> str:
    return config.engine.model.model or "embedded:SmolLM2-135M-Instruct"


def prepare(config: JobConfig) -> tuple[JobSpec, BatchFile]:
    """Scan the input, derive the job identity, check the fingerprint. No weights loaded."""
    summary = scan_input(Path(config.storage.input))
    batch_id = config.storage.batch_id or derive_batch_id(summary.sha256)
    s = config.storage
    paths = JobPaths.for_job(s.storage_path, batch_id, s.incremental_output_dir, s.output)
    paths.make_dirs()
    batch_file = BatchFile(paths.batch_file)
    state = batch_file.load()
    fp = fingerprint(config, summary.sha256, model_identity(config))
    if state is not None and state.fingerprint:
        check_fingerprint(state.fingerprint, fp)
    created = int(state.timings.get("created_at", now())) if state else now()
    spec = JobSpec(config, batch_id, summary.sha256, summary.records, created)
    if state is None:
        record_upload(paths, Path(s.input), summary.sha256, summary.size_bytes, summary.records,
                      summary.format)
        batch_file.update(batch_id, status="validating", input_file=str(Path(s.input).resolve()),
                          fingerprint=fp, timings={"created_at": created},
                          request_counts={"total": summary.records, "completed": 0, "failed": 0})
    return spec, batch_file


def run_job(config: JobConfig) -> int:
    from batchgen.models.factory import model_folder

    spec, batch_file = prepare(config)
    paths = spec.paths
    state = batch_file.load()
    if state.status == "completed" and paths.output.exists():
        log.info("job %s already completed: %s", spec.batch_id, paths.output)
        return 0
    model_folder(config.engine.model, config.dist.world_size)  # not found / convert: fail here
    lock = JobLock(paths.batch_file.with_suffix(".lock"))
    lock.acquire()
    try:
        return _run_locked(spec, batch_file)
    finally:
        lock.release()


def _run_locked(spec: JobSpec, batch_file: BatchFile) -> int:
    paths = spec.paths
    already = len(read_done_ids(paths.incremental_files()))
    log.info("job %s: %d requests, %d already done; results -> %s", spec.batch_id,
             spec.total_records, already, paths.output)
    started = time.time()
    batch_file.update(spec.batch_id, status="in_progress", timings={"started_at": int(started)})
    for stale in paths.batch_file.parent.glob(f"{spec.batch_id}.worker*.json"):
        stale.unlink()
    progress = ProgressReporter(paths.batch_file.parent, spec.batch_id, spec.total_records, already)
    progress.start()
    previous = signal.signal(signal.SIGUSR1, _usr1_as_term)
    try:
        if already < spec.total_records:
            launch_workers(spec.config.dist, spec.save(), paths.storage_path / "logs" / spec.batch_id)
    except WorkerFailure as failure:
        code = failure.exitcode
        _record_end(spec, batch_file, started, "in_progress" if code == EXIT_REQUEUE else "failed",
                    {"last_failure": str(failure)[:4000], "last_failure_at": int(time.time())})
        if code == EXIT_REQUEUE:
            log.warning("preempted: finished results are safe; re-run the same command to resume")
            return EXIT_REQUEUE
        log.error("%s", failure)
        return code if 0 < code < 256 else 1
    except BaseException as err:  # SignalException from the launcher on SIGTERM
        if type(err).__name__ == "SignalException":
            _record_end(spec, batch_file, started, "in_progress", {})
            log.warning("stopped by signal: finished results are safe; re-run to resume")
            return EXIT_REQUEUE
        raise
    finally:
        signal.signal(signal.SIGUSR1, previous)
        progress.stop()
    return _finish(spec, batch_file, started)


def _usr1_as_term(signum, frame) -> None:
    """Slurm's --signal=B:USR1@120 and spot notices: same graceful stop as SIGTERM."""
    os.kill(os.getpid(), signal.SIGTERM)


def _finish(spec: JobSpec, batch_file: BatchFile, started: float) -> int:
    paths = spec.paths
    batch_file.update(spec.batch_id, status="finalizing")
    report = finalize(paths.incremental_files(), Path(spec.config.storage.input), paths.output,
                      paths.errors_output)
    s = spec.config.storage
    if s.save_result and s.output:
        default = JobPaths.for_job(s.storage_path, spec.batch_id).output
        shutil.copyfile(paths.output, default)
    if s.no_incremental_save:
        for path in paths.incremental_files():
            path.unlink()
    _record_end(spec, batch_file, started, "completed", {},
                counts={"total": spec.total_records, "completed": report.completed,
                        "failed": report.failed})
    log.info("done: %d results -> %s, %d errors -> %s", report.completed, paths.output,
             report.failed, paths.errors_output)
    return 0


def _record_end(spec: JobSpec, batch_file: BatchFile, started: float, status: str,
                health: dict, counts: dict | None = None) -> None:
    stats = read_worker_stats(spec.paths.batch_file.parent, spec.batch_id)
    elapsed = time.time() - started
    completion = sum(s["completion_tokens"] for s in stats)
    prompt = sum(s["prompt_tokens"] for s in stats)
    counters: dict = {}
    for s in stats:
        for key, value in s.get("engine", {}).items():
            if isinstance(value, (int, float)):
                counters[key] = counters.get(key, 0) + value
            else:
                counters.setdefault(key, value)
    changes = dict(status=status, health=health, counters=counters,
                   timings={"finished_at": int(time.time()), "last_run_seconds": round(elapsed, 3)},
                   throughput={"output_tokens_per_s": round(completion / max(elapsed, 1e-9), 2),
                               "total_tokens_per_s": round((completion + prompt) / max(elapsed, 1e-9), 2)},
                   output_file=str(spec.paths.output), errors_file=str(spec.paths.errors_output))
    if counts:
        changes["request_counts"] = counts
    state = batch_file.load()
    usage = dict(state.usage) if state else {}
    usage["prompt_tokens"] = usage.get("prompt_tokens", 0) + prompt
    usage["completion_tokens"] = usage.get("completion_tokens", 0) + completion
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    changes["usage"] = usage
    batch_file.update(spec.batch_id, **changes)

"""`batchgen run`: validate, lock, preflight, launch workers, show progress, write the outputs.

Everything that can fail cheaply (flags, input file, lock, fingerprint, preflight) fails before
any weights load. The supervisor is the only writer of the batch file; workers write their own
incremental files and stats, which it copies into the batch file's health section.
Stop signals: see launch.py; outside the launcher (before or after it runs) they raise Preempted
here, and a second one exits at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

from batchgen.config import JobConfig
from batchgen.io.jobfiles import (
    BatchFile,
    JobPaths,
    check_fingerprint,
    derive_batch_id,
    record_upload,
)
from batchgen.io.reader import InputSummary, scan_input
from batchgen.io.writer import finalize, read_done_ids
from batchgen.runner.errors import EXIT_CRASH, EXIT_DEVICE_OOM, EXIT_DISK, EXIT_LOCKED, disk_errors
from batchgen.runner.job import EXIT_REQUEUE, EXIT_WATCHDOG, JobSpec, fingerprint, now
from batchgen.runner.launch import WorkerFailure, is_stop_signal, launch_workers
from batchgen.runner.lock import JobLock
from batchgen.runner.preflight import preflight
from batchgen.runner.progress import ProgressReporter, read_worker_stats
from batchgen.runner.quarantine import mark_crashed
from batchgen.runner.watchdog import health_from_stats

log = logging.getLogger("batchgen")
SUPERVISOR_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
NOT_CRASHES = (EXIT_DISK, EXIT_LOCKED)
"""Worker exit codes that are no evidence against the requests in flight (no quarantine strike)."""


class Preempted(BaseException):
    """A stop signal: leave with EXIT_REQUEUE (BaseException: no `except Exception` eats it)."""


class StopSignals:
    """The supervisor's own stop handlers (the launcher replaces them while it runs)."""

    def __init__(self) -> None:
        self.stopping = False
        self._previous: dict = {}

    def install(self) -> None:
        for sig in SUPERVISOR_STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum, frame) -> None:
        if self.stopping:
            os._exit(EXIT_REQUEUE)  # a second signal: leave now; finished lines are durable
        self.stopping = True
        raise Preempted(signal.Signals(signum).name)


def model_identity(config: JobConfig) -> str:
    return config.engine.model.model or "embedded:SmolLM2-135M-Instruct"


def identify(config: JobConfig) -> tuple[InputSummary, JobPaths]:
    """Scan the input and derive the job identity; creates the job's folders, nothing else."""
    summary = scan_input(Path(config.storage.input))
    s = config.storage
    batch_id = s.batch_id or derive_batch_id(summary.sha256)
    paths = JobPaths.for_job(s.storage_path, batch_id, s.incremental_output_dir, s.output)
    paths.make_dirs()
    return summary, paths


def prepare(config: JobConfig, summary: InputSummary, paths: JobPaths) -> tuple[JobSpec, BatchFile]:
    """Check the fingerprint and record a new job (under the job lock). No weights loaded."""
    batch_id, s = paths.batch_id, config.storage
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
    stops = StopSignals()
    stops.install()
    try:
        with disk_errors(f"write the job's files under {config.storage.storage_path}"):
            return _run(config, stops)
    except Preempted as stop:
        log.warning("stopped by %s: finished results are safe; re-run the same command to "
                    "resume (exit %d: requeue)", stop, EXIT_REQUEUE)
        return EXIT_REQUEUE
    finally:
        stops.restore()


def _run(config: JobConfig, stops: StopSignals) -> int:
    from batchgen.models.factory import model_folder

    summary, paths = identify(config)
    lock = JobLock(paths.batch_file.with_suffix(".lock"))
    lock.acquire()  # before anything is written: a second live run changes nothing
    try:
        spec, batch_file = prepare(config, summary, paths)
        if batch_file.load().status == "completed" and paths.output.exists():
            log.info("job %s already completed: %s", spec.batch_id, paths.output)
            return 0
        already = len(read_done_ids(paths.incremental_files()))  # refuses a corrupt file
        preflight(config, paths, summary.size_bytes, summary.records, summary.records - already)
        model_folder(config.engine.model, config.dist.world_size)  # not found / convert: here
        return _run_locked(spec, batch_file, already, stops)
    finally:
        lock.release()


def _run_locked(spec: JobSpec, batch_file: BatchFile, already: int, stops: StopSignals) -> int:
    paths = spec.paths
    log.info("job %s: %d requests, %d already done; results -> %s", spec.batch_id,
             spec.total_records, already, paths.output)
    started = time.time()
    batch_file.update(spec.batch_id, status="in_progress", timings={"started_at": int(started)})
    for stale in paths.batch_file.parent.glob(f"{spec.batch_id}.worker*.json"):
        stale.unlink()
    progress = ProgressReporter(paths.batch_file.parent, spec.batch_id, spec.total_records, already)
    progress.start()
    try:
        if already < spec.total_records:
            launch_workers(spec.config.dist, spec.save(), paths.storage_path / "logs" / spec.batch_id,
                           spec.config.watchdog.preempt_grace)
    except WorkerFailure as failure:
        return _worker_failed(spec, batch_file, started, failure)
    except BaseException as err:
        if not (is_stop_signal(err) or isinstance(err, Preempted)):
            raise
        stops.stopping = True  # the launcher took the first signal: the next one exits at once
        name = signal.Signals(err.sigval).name if hasattr(err, "sigval") else str(err)
        _try_record_end(spec, batch_file, started, "in_progress", {"last_stop": name})
        raise Preempted(name) from None
    finally:
        progress.stop()
        stops.install()  # the launcher replaced our handlers with its own
    return _finish(spec, batch_file, started)


def _worker_failed(spec: JobSpec, batch_file: BatchFile, started: float,
                   failure: WorkerFailure) -> int:
    code = failure.exitcode
    if code == EXIT_REQUEUE:
        _try_record_end(spec, batch_file, started, "in_progress", {"last_stop": "worker stopped"})
        raise Preempted(f"worker rank {failure.rank} (exit {code})")
    if code not in NOT_CRASHES:
        mark_crashed(spec.paths.batch_file.parent, spec.batch_id, code)
    cause = _failure_cause(spec, failure)
    _try_record_end(spec, batch_file, started, "failed",
                    {"last_failure": cause, "last_failure_at": int(time.time()),
                     "last_exit_code": code, "worker_log": failure.log_path})
    log.error("%s\n%s", cause, failure.log_tail)
    if code in (EXIT_WATCHDOG, EXIT_DISK, EXIT_DEVICE_OOM, EXIT_LOCKED):
        return code
    return code if 0 < code < 256 else EXIT_CRASH


def _failure_cause(spec: JobSpec, failure: WorkerFailure) -> str:
    """One paragraph for the log and the batch file's health.last_failure."""
    stats = {s.get("rank"): s for s in read_worker_stats(spec.paths.batch_file.parent, spec.batch_id)}
    mine = stats.get(failure.rank, {})
    resume = "re-run the same command to resume (under Slurm: requeue)"
    if failure.exitcode == EXIT_WATCHDOG:
        cause = mine.get("watchdog", {}).get("cause", "watchdog: a deadline was missed")
        return f"worker rank {failure.rank}: {cause}; {resume}"
    if failure.exitcode == EXIT_DISK:
        free = shutil.disk_usage(spec.paths.incremental_dir).free
        said = mine.get("failure", "it could not save results (disk full or failing)")
        return (f"worker rank {failure.rank}: {said} ({free / 1e6:.1f} MB free under "
                f"{spec.paths.incremental_dir})")
    if failure.exitcode == EXIT_DEVICE_OOM:
        return (f"worker rank {failure.rank} ran out of device memory; {resume}: the requests "
                "in flight are retried in smaller groups")
    how = (f"killed by signal {-failure.exitcode}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return (f"worker rank {failure.rank} crashed ({how}). The requests in flight are retried "
            f"in isolation on the next run; one in flight at "
            f"{spec.config.watchdog.quarantine_after} consecutive crashes is quarantined as an "
            f"error line; {resume}")


def _finish(spec: JobSpec, batch_file: BatchFile, started: float) -> int:
    paths = spec.paths
    batch_file.update(spec.batch_id, status="finalizing")
    _remove_output_temps(paths)  # left by a finalize that was killed
    try:
        with disk_errors("write the final outputs"):
            report = finalize(paths.incremental_files(), Path(spec.config.storage.input),
                              paths.output, paths.errors_output)
    except BaseException:
        _remove_output_temps(paths)  # a temp file whose close failed on a full disk stays
        raise
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


def _remove_output_temps(paths: JobPaths) -> None:
    for target in (paths.output, paths.errors_output):
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            stale.unlink(missing_ok=True)


def _try_record_end(*args, **kwargs) -> None:
    """Record how a failed or stopped run ended, without masking why it ended."""
    try:
        _record_end(*args, **kwargs)
    except OSError as err:
        log.warning("could not update the batch file: %s", err)


def _record_end(spec: JobSpec, batch_file: BatchFile, started: float, status: str,
                health: dict, counts: dict | None = None) -> None:
    """Status, health, counters, usage and throughput of the run that ends, from the workers'
    stats files."""
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
        "output_file": str(spec.paths.output), "errors_file": str(spec.paths.errors_output),
        "usage": _usage_after(batch_file, prompt, completion)}
    if counts:
        changes["request_counts"] = counts
    batch_file.update(spec.batch_id, **changes)


def _engine_counters(stats: list[dict]) -> dict:
    counters: dict = {}
    for s in stats:
        for key, value in s.get("engine", {}).items():
            if isinstance(value, (int, float)):
                counters[key] = counters.get(key, 0) + value
            else:
                counters.setdefault(key, value)
    return counters


def _usage_after(batch_file: BatchFile, prompt: int, completion: int) -> dict:
    """Token usage of every run so far (each run adds its own)."""
    state = batch_file.load()
    usage = dict(state.usage) if state else {}
    usage["prompt_tokens"] = usage.get("prompt_tokens", 0) + prompt
    usage["completion_tokens"] = usage.get("completion_tokens", 0) + completion
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage

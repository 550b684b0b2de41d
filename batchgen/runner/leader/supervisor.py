"""`batchgen run`: validate, lock, preflight, launch workers, show progress, write the outputs.

Everything that can fail cheaply (flags, input file, lock, fingerprint, preflight) fails before
any weights load. The supervisor is the only writer of the batch file; workers write their own
incremental files and stats, which it copies into the batch file's health section.
Stop signals: see launch.py; outside the launcher (before or after it runs) they raise Preempted
here, and a second one exits at once.

Runs over several nodes, or under an external torchrun / srun (members.py): the leader (node 0,
rank 0) does all of the above and publishes a plan (group.py); every other member checks it,
runs its own ranks and reports how they ended. The leader merges only after every member
reported success, and ends the run non-zero naming the rank when one fails or dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from itertools import islice
from pathlib import Path

from batchgen.atomic import atomic_file
from batchgen.config import ConfigError, JobConfig
from batchgen.io.checkpoints import checkpoint_files
from batchgen.io.jobfiles import (FOLDER_MODE, BatchFile, FingerprintMismatch, JobPaths,
                                  errors_path_for)
from batchgen.io.parsed_input import parsed_keys, read_parsed, remove_parsed
from batchgen.io.results import dumps, error_line
from batchgen.io.writer import FinalizeReport, IncompleteResults, finalize, read_done_ids
from batchgen.models.folder_checks import check_model_folder, machine_memory
from batchgen.models.loader import MANIFEST
from batchgen.runner.exits import ExitCode, Preempted, StopSignals
from batchgen.runner.files.errors import (EXIT_CODES, DiskError, PreflightFailed, disk_errors,
                                         exit_code_of)
from batchgen.runner.files.job import JobSpec, check_input_unchanged
from batchgen.runner.files.lock import JobLock
from batchgen.runner.leader.failures import failure_cause, removed_cause
from batchgen.runner.leader.group import Group, GroupError, MemberEnd, PlanRefused
from batchgen.runner.leader.launch import WorkerFailure, is_stop_signal, release_exit_barrier
from batchgen.runner.leader.members import Member, check_plan, member_failure, member_for
from batchgen.runner.leader.preflight import merge_space, preflight, refuse_unwritable
from batchgen.runner.leader.prepare import (completed_already, final_files_whole, identify,
                                            parse, prepare)
from batchgen.runner.leader.progress import ProgressReporter, read_worker_stats, run_summary
from batchgen.runner.leader.records import (record_end, record_killed_run,
                                            refuse_a_changed_input, result_files,
                                            try_record_end, usage_total, warn_if_replacing)
from batchgen.runner.worker.quarantine import journal_paths, mark_crashed

log = logging.getLogger("batchgen")
SHARED_FS_RETRY_S = (2, 5, 10, 20, 30)
"""Waits before retrying a merge that misses results other nodes reported done (NFS caches)."""
NOT_CRASHES = (ExitCode.DISK, ExitCode.LOCKED, ExitCode.INPUT, ExitCode.MODEL)
"""Worker exit codes that are no evidence against the requests in flight (no quarantine strike)."""


def run_job(config: JobConfig) -> int:
    stops = StopSignals()
    stops.install()
    try:
        with disk_errors(f"write the job's files under {config.storage.storage_path}"):
            config, member = member_for(config)
            try:
                return _run(config, stops, member) if member.leader else _follow(config, member)
            finally:
                if member.group is not None:
                    member.group.close()
    except (GroupError, ConfigError) as err:  # members disagree, or the launcher's world does
        print(f"error: {err}", file=sys.stderr, flush=True)  # a user's fix, not a log event
        return getattr(err, "code", ExitCode.INPUT)
    except Preempted as stop:
        log.warning("stopped by %s: finished results are safe; re-run the same command to "
                    "resume (exit %d: requeue)", stop, ExitCode.REQUEUE)
        return ExitCode.REQUEUE
    finally:
        stops.restore()


def _run(config: JobConfig, stops: StopSignals, member: Member) -> int:
    from batchgen.models.factory import model_folder

    group = member.group
    with _abort_followers(group):
        source, paths = identify(config)  # source.version: taken before the input is read
        lock = member.lock(paths.batch_file)
        # before anything is written: a second live run changes nothing
        lock.acquire(config.storage.wait_for_lock)
    output_lock = JobLock(paths.output_lock, f"another live job writes {paths.output}",
                          remove_on_release=True)
    try:
        with _abort_followers(group, paths):
            _lock_output(output_lock, paths, config.storage.wait_for_lock)
            if completed_already(config, source, paths):  # nothing to parse or run
                return _completed(config, paths, stops, group)
            refuse_a_changed_input(config, paths, source.size_bytes)
            summary = parse(config, source, paths)
            try:
                spec, batch_file = prepare(config, summary, paths)
            except FingerprintMismatch:  # refused: a completed job keeps no parsed input
                state = BatchFile(paths.batch_file).load()
                if state is not None and state.status == "completed":
                    remove_parsed(paths.parsed_input)
                raise
            if batch_file.load().status == "completed" and final_files_whole(paths,
                                                                             summary.records):
                return _completed(config, paths, stops, group)
            warn_if_replacing(spec, Path(config.storage.storage_path))
            already = done_records(paths, summary.records)
            left = summary.records - already
            preflight(config, paths, summary.size_bytes, summary.records, left,
                      external=member.external is not None)
            with disk_errors("convert the model into the converted-checkpoint cache"):
                folder, _ = model_folder(spec.pinned().config.engine.model,
                                         config.dist.world_size,
                                         config.dist.tensor_parallel_size)  # not found: here
            if not (folder / MANIFEST).is_file():  # ours (converted) are checked when written
                check_model_folder(folder, *machine_memory(),
                                   tensor_parallel=config.dist.tensor_parallel_size or 1)
        return _run_locked(spec, batch_file, already, stops, member,
                           {"input_bytes": summary.size_bytes, "left": left}, source.version,
                           refused_only=summary.refused_lines == summary.records)
    except FileNotFoundError:  # a write of the supervisor's own (parse, batch file, merge)
        removed = paths.removed_while_running()
        if removed is None:
            raise
        log.error("%s", removed_cause(removed))
        return ExitCode.INPUT
    finally:
        output_lock.release()
        lock.release()


def _completed(config: JobConfig, paths: JobPaths, stops: StopSignals, group) -> int:
    """A rerun of a job that completed: say so, tidy what a kill may have left, exit 0."""
    log.info("job %s already completed: %s", paths.batch_id, paths.output)
    stops.completed = True
    if config.storage.no_incremental_save:  # a kill came before their removal
        paths.remove_incremental()
    remove_parsed(paths.parsed_input)
    if group is not None:
        group.publish_final("done")
    return ExitCode.OK


def _lock_output(output_lock: JobLock, paths: JobPaths, wait_s: float) -> None:
    """Two jobs given one --output: the second is refused (JobLocked, exit 4). A folder that
    cannot take the lock file is named as preflight names it."""
    try:
        output_lock.acquire(wait_s)
    except OSError:
        refuse_unwritable(paths)
        raise


def done_records(paths: JobPaths, records: int) -> int:
    """How many input records have a saved result (a corrupt incremental file is refused).
    When the results seem to cover every record, their ids are checked against the input's:
    a result whose custom_id is no input's (a damaged id, a line from another file) must not
    stand in for a record that has none, or no worker would ever run to answer it."""
    done = read_done_ids(paths.incremental_files())
    if len(done) < records:
        return len(done)
    answered = sum(1 for _, key in parsed_keys(paths.parsed_input) if key in done)
    if answered < len(done):
        log.warning("%d saved results belong to no record of the input (ignored: the final "
                    "files hold one line per input record)", len(done) - answered)
    return answered


@contextlib.contextmanager
def _abort_followers(group: Group | None, paths: JobPaths | None = None):
    """The leader failed before launching: tell the followers why (and with which code; a job
    folder `paths` names removed meanwhile is what the leader says too)."""
    try:
        yield
    except BaseException as err:
        if group is not None:
            code, reason = _code_of(err), f"{type(err).__name__}: {err}"
            removed = paths.removed_while_running() if paths is not None else None
            if isinstance(err, FileNotFoundError) and removed is not None:
                code, reason = ExitCode.INPUT, removed_cause(removed)
            try:
                group.publish_final("abort", 10.0, code=code, reason=reason)
            except Exception as lost:  # noqa: BLE001
                log.warning("could not tell the followers: %s (they stop when we exit)", lost)
        raise


def _code_of(err: BaseException) -> int:
    if isinstance(err, Preempted) or is_stop_signal(err):
        return ExitCode.REQUEUE
    if isinstance(err, GroupError):
        return err.code
    if isinstance(err, (*EXIT_CODES, PreflightFailed)):
        return exit_code_of(err)
    return ExitCode.CRASH


def _run_locked(spec: JobSpec, batch_file: BatchFile, already: int, stops: StopSignals,
                member: Member, sizes: dict, input_version: tuple[int, ...],
                refused_only: bool = False) -> int:
    """Run the job's ranks (or, `refused_only`: every line is one the parse refused, write
    their error lines here: no worker, no model loaded), then merge the outputs."""
    paths, group = spec.paths, member.group
    log.info("job %s: %d requests, %d already done; results -> %s", spec.batch_id,
             spec.total_records, already, paths.output)
    record_killed_run(spec.batch_id, batch_file, paths.batch_file.parent)
    started = time.time()
    batch_file.update(spec.batch_id, status="in_progress", timings={"started_at": int(started)},
                      **result_files(paths))
    for stale in paths.batch_file.parent.glob(f"{spec.batch_id}.worker*.json"):
        stale.unlink()
    paths.remove_write_temps()
    spec_file = spec.save()
    progress = ProgressReporter(paths.batch_file.parent, spec.batch_id, spec.total_records, already)
    progress.start()
    try:
        if already < spec.total_records and not refused_only:
            _lead_ranks(spec, spec_file, member, sizes, stops)
        else:  # no rank has anything to run
            if already < spec.total_records:
                _answer_refused_lines(spec)
            if group is not None:
                group.publish_final("done")
    except PlanRefused as err:  # nothing ran: no crash evidence against any request
        try_record_end(spec, batch_file, started, "failed", {"last_failure": str(err)})
        log.error("%s", err)
        return err.code
    except GroupError:  # a follower's ranks failed, or it died
        if group is None or group.failure is None:
            raise
        return _worker_failed(spec, batch_file, started, member_failure(group.failure, spec.config))
    except WorkerFailure as own:
        failure = own
        if group is not None and group.failure is not None:  # we stopped because of a follower
            failure = member_failure(group.failure, spec.config)
        return _worker_failed(spec, batch_file, started, failure)
    except BaseException as err:
        if not (is_stop_signal(err) or isinstance(err, Preempted)):
            raise
        stops.install()  # the launcher's handlers left with it: a second signal exits at once
        if group is not None and group.failure is not None:  # our own stop, for a follower
            return _worker_failed(spec, batch_file, started,
                                  member_failure(group.failure, spec.config))
        stops.stopping = True  # the launcher took the first signal: the next one exits at once
        name = signal.Signals(err.sigval).name if hasattr(err, "sigval") else str(err)
        try_record_end(spec, batch_file, started, "in_progress", {"last_stop": name})
        raise Preempted(name) from None
    finally:
        stops.install()  # the launcher (or the in-process worker) replaced our handlers
        progress.stop()
    try:
        check_input_unchanged(spec, input_version)
    except FingerprintMismatch as err:  # the job is to start over: no rerun may resume it
        try_record_end(spec, batch_file, started, "failed",
                       {"last_failure": str(err), "input_changed": True})
        raise
    try:
        return _finish(spec, batch_file, started, stops, already, patient=group is not None)
    except Preempted as stop:  # recorded as a stop while the workers run is; a rerun merges
        try_record_end(spec, batch_file, started, "in_progress", {"last_stop": str(stop)})
        raise


def _lead_ranks(spec: JobSpec, spec_file: Path, member: Member, sizes: dict,
                stops: StopSignals) -> None:
    """Publish the plan, run our own ranks while watching the followers, then wait for every
    follower to report its shard done."""
    group = member.group
    if group is not None:
        group.publish("launch", spec=spec_file.read_bytes().decode(), **sizes,
                      records=spec.total_records)
        group.wait_ready()
        group.watch(lambda end: _stop_for_follower(group))
    member.run_ranks(spec, spec.config.dist)
    if group is not None:
        stops.install()  # from here a stop signal raises Preempted in this loop
        group.unwatch()
        others = group.members - 1
        log.info("our ranks are done; waiting for the other %d %s%s to finish their shards",
                 others, group.kind, "" if others == 1 else "s")
        group.wait_ends()


def _answer_refused_lines(spec: JobSpec, per_write: int = 4096) -> None:
    """Every record of the input is a line the parse refused (bad JSON, no messages, ...):
    their error lines go to the results file here, as a worker would write them, without
    launching one or loading the model for nothing."""
    from batchgen.runner.worker.worker import open_results  # the engine's imports: not before

    paths = spec.paths
    log.warning("no line of the input is a request batchgen can run (each one's error goes to "
                "%s; `batchgen validate -i %s` lists them): no model is loaded",
                paths.errors_output, spec.config.storage.input)
    with disk_errors("write the error lines of the refused records"):
        writer, done = open_results(paths, 0, 1)
        try:
            lines = (dumps(error_line(spec.batch_id, record.item))
                     for record in read_parsed(paths.parsed_input, skip=done))
            while batch := list(islice(lines, per_write)):
                writer.write_batch(batch)
        finally:
            writer.close()


def _stop_for_follower(group) -> None:
    """A follower failed or died while our ranks run (or wait in the launcher's exit barrier,
    their shard done): stop ours, then report it (`_run_locked` names the follower)."""
    if group.kind == "node":  # our own launcher across the nodes, which has an exit barrier
        release_exit_barrier(group.store)
    os.kill(os.getpid(), signal.SIGTERM)


def _follow(config: JobConfig, member: Member) -> int:
    """A member other than the leader: run the leader's plan with our ranks, report the end.
    Never touches the batch file or the final outputs."""
    from batchgen.models.factory import model_folder

    group = member.group
    who = member.name
    lost: list[str] = []
    group.start_beating(
        on_lost=lambda why: (lost.append(why), os.kill(os.getpid(), signal.SIGTERM)))
    plan = group.plan()
    if plan["action"] == "done":
        log.info("%s: the leader says nothing is left to run", who)
        return ExitCode.OK
    if plan["action"] == "abort":
        log.error("%s: the leader stopped before launching: %s", who, plan["reason"])
        return int(plan["code"])
    spec_bytes = plan["spec"].encode()
    spec = JobSpec.from_bytes(spec_bytes)
    lock = member.lock(spec.paths.batch_file)
    try:
        check_plan(config, spec, spec_bytes, who)
        lock.acquire(config.storage.wait_for_lock)
        if member.external is None or member.external.local_rank == 0:
            preflight(config, spec.paths, plan["input_bytes"], plan["records"], plan["left"],
                      external=member.external is not None)
        model_folder(spec.pinned().config.engine.model, config.dist.world_size,
                     config.dist.tensor_parallel_size)  # the leader's commit: downloaded here
    except BaseException as err:
        group.report(MemberEnd(group.member, _code_of(err), cause=f"{who}: {err}"))
        lock.release()
        raise
    group.ready()
    try:
        end = _run_follower_ranks(spec, config, member, lost)
    finally:
        lock.release()
    group.report(end)
    group.close()
    if end.code == ExitCode.OK:
        log.info("%s: our ranks finished their shards; the leader merges the outputs", who)
    return end.code


def _run_follower_ranks(spec: JobSpec, config: JobConfig, member: Member,
                        lost: list[str]) -> MemberEnd:
    m = member.group.member
    try:
        member.run_ranks(spec, config.dist)
        return MemberEnd(m, ExitCode.OK)
    except WorkerFailure as failure:
        code = _worker_exit_code(failure.exitcode)
        log.error("%s\n%s", failure.cause or f"worker rank {failure.rank} exited with code "
                  f"{failure.exitcode}", failure.log_tail)
        return MemberEnd(m, code, failure.rank, failure.exitcode, failure.log_tail,
                         failure.log_path)
    except BaseException as err:
        if not (is_stop_signal(err) or isinstance(err, Preempted)):
            raise
        why = lost[0] if lost else "a stop signal"
        log.warning("%s stopped (%s): finished results are safe (exit %d: requeue)",
                    member.name, why, ExitCode.REQUEUE)
        return MemberEnd(m, ExitCode.REQUEUE, cause=f"{member.name} stopped: {why}")


def _worker_exit_code(code: int) -> int:
    return code if 0 < code < 256 else ExitCode.CRASH


def _worker_failed(spec: JobSpec, batch_file: BatchFile, started: float,
                   failure: WorkerFailure) -> int:
    code = failure.exitcode
    if code == ExitCode.REQUEUE:
        try_record_end(spec, batch_file, started, "in_progress", {"last_stop": "worker stopped"})
        raise Preempted(f"worker rank {failure.rank} (exit {code})")
    if code not in NOT_CRASHES:
        mark_crashed(spec.paths.batch_file.parent, spec.batch_id, code)
    cause = failure_cause(spec, failure)
    try_record_end(spec, batch_file, started, "failed",
                    {"last_failure": cause, "last_failure_at": int(time.time()),
                     "last_exit_code": code, "worker_log": failure.log_path})
    log.error("%s\n%s", cause, failure.log_tail)
    return _worker_exit_code(code)


def _finish(spec: JobSpec, batch_file: BatchFile, started: float, stops: StopSignals,
            already: int, patient: bool = False) -> int:
    """Merge the incremental files into the outputs. `already`: the records earlier runs had
    answered when this one started (every other one is this run's, whichever attempt of a
    --max-restarts group answered it). `patient`: other nodes wrote some of them; give a
    shared filesystem's caches a minute to show their last lines before giving up."""
    paths = spec.paths
    batch_file.update(spec.batch_id, status="finalizing")
    paths.remove_output_temps()  # left by a finalize that was killed
    report = _merge(spec, batch_file, started, patient)
    s = spec.config.storage
    if s.save_result and s.output:
        _keep_default_copy(paths.output, JobPaths.for_job(s.storage_path, spec.batch_id))
    stops.completed = True  # a stop signal while "completed" goes on record changes nothing
    try:
        record_end(spec, batch_file, started, "completed", {},
                    counts={"total": spec.total_records, "completed": report.completed,
                            "failed": report.failed},
                    usage=usage_total(report.prompt_tokens, report.completion_tokens,
                                      report.cached_tokens))
    except BaseException:
        stops.completed = False
        raise
    if s.no_incremental_save:  # only once "completed" is on record: a rerun skips the job
        paths.remove_incremental()
    _clean_up(paths, spec.batch_id)
    _summarize(spec, report, started, already)
    return ExitCode.OK


def _merge(spec: JobSpec, batch_file: BatchFile, started: float,
           patient: bool) -> FinalizeReport:
    """The final merge of the incremental files; retried while a shared filesystem has not
    shown every line yet (`patient`), a full disk recorded as the job's failure."""
    paths = spec.paths
    waits = list(SHARED_FS_RETRY_S) if patient else []
    while True:
        try:
            with disk_errors("write the final outputs"):
                keys = (key for _, key in parsed_keys(paths.parsed_input))
                return finalize(paths.incremental_files(), keys, paths.output,
                                paths.errors_output)
        except IncompleteResults as err:
            paths.remove_output_temps()
            if not waits:
                raise
            log.warning("%s; waiting %d s for the shared filesystem", err, waits[0])
            time.sleep(waits.pop(0))
        except BaseException as err:
            paths.remove_output_temps()  # a temp file whose close failed on a full disk stays
            if isinstance(err, DiskError):  # status says why it stopped (a rerun only merges)
                err = DiskError(f"{err} ({merge_space(paths)})")
                try_record_end(spec, batch_file, started, "failed", {"last_failure": str(err)})
                raise err from None
            raise


def _clean_up(paths: JobPaths, batch_id: str) -> None:
    """What a completed job no longer needs. Every request has its result: no checkpoint holds
    anything a rerun would resume (a stop after the last result was saved leaves one behind,
    and no worker runs again to drop it), and no crash journal anything to strike (a rank of
    an earlier, larger --world-size left its own, which no worker of this run cleared)."""
    batch_dir = paths.batch_file.parent
    for leftover in (*checkpoint_files(paths.batch_file, batch_id),
                     *journal_paths(batch_dir, batch_id)):
        leftover.unlink(missing_ok=True)
    remove_parsed(paths.parsed_input)


def _summarize(spec: JobSpec, report: FinalizeReport, started: float, already: int) -> None:
    """The run's closing summary on stderr."""
    paths = spec.paths
    stats = read_worker_stats(paths.batch_file.parent, spec.batch_id)
    print(run_summary(time.time() - started, report.completed, report.failed,
                      report.prompt_tokens, report.completion_tokens,
                      sum(s.get("completion_tokens", 0) for s in stats), paths.output,
                      paths.errors_output, paths.storage_path, spec.total_records - already,
                      report.cached_tokens, sum(s.get("prompt_tokens", 0) for s in stats),
                      sum(s.get("checkpoint", {}).get("resumed_tokens", 0) for s in stats)),
          file=sys.stderr, flush=True)


def _keep_default_copy(output: Path, default: JobPaths) -> None:
    """--save-result: the results and the error lines also at the job folder's default output
    paths, each all or nothing (a copy killed halfway leaves only a temp file, which the rerun
    removes). Its outputs/ folder is one of the job's own: 0750, as the others."""
    default.output.parent.mkdir(FOLDER_MODE, parents=True, exist_ok=True)
    default.remove_output_temps()
    for source, copy in ((output, default.output),
                         (errors_path_for(output), default.errors_output)):
        if not source.exists():
            continue
        with disk_errors("keep a copy of the results (--save-result)"), \
                open(source, "rb") as src, atomic_file(copy) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

"""`batchgen status`: what a job's batch file, incremental files, lock and workers' stats say."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from batchgen.core import human_seconds
from batchgen.io.checkpoints import checkpoint_files, load
from batchgen.io.jobfiles import JobPaths, pinned_commit
from batchgen.io.writer import CorruptIncrementalFile, IdSet, read_done_ids
from batchgen.runner.exits import ExitCode
from batchgen.runner.files.job import JobSpec
from batchgen.runner.leader.progress import (cached_share, embeddings_only, prefix_hits,
                                             read_worker_stats, speed_text)
from batchgen.runner.leader.records import (batch_files, cached_tokens, drawn_tokens,
                                           jobs_writing, run_tokens, unreadable_batch_files)


UNREADABLE_HINT = ("; batch files are written whole, so something else changed it: move it "
                   "aside and run the job's command again (its saved results are kept)")
"""What to do about a batch file that is not a job's record."""
TIMESTAMPS = ("last_heartbeat", "last_failure_at")
"""Health keys holding Unix times, shown as an age and a local date."""
RESULT_SUFFIXES = (".jsonl", ".json", ".ndjson")
"""A status argument ending so names a results file (a batch id has no dot)."""
HISTORY = ("last_failure", "last_stop")
"""Health keys saying how an unfinished run ended: on a completed job, an earlier run's."""


def show_status(storage: Path, target: str | None, as_json: bool = False) -> int:
    """Print each job's table (`as_json`: one JSON object a line, `_job_record`). target: a
    job's results file (finished or not), a batch id under `storage`, or a job folder (a
    storage path: every job in it); None: every job under `storage`."""
    batch_id = target
    if target is not None and not Path(target).is_dir():
        # A results file: present once the job finished, only named in its batch file before
        # (a running, stopped or killed job's output does not exist yet).
        # A batch file that does not parse may be this output's job: named, not passed over.
        jobs = jobs_writing(Path(target), storage) or unreadable_batch_files(Path(target),
                                                                            storage)
        if jobs or Path(target).is_file():
            return _show_files(jobs, as_json, f"no job writes {target} under "
                               f"{Path(target).absolute().parent / '.batchgen'} or {storage} "
                               "(give the job's --storage-path)")
    beside = [Path(target).absolute().parent / ".batchgen"] if target is not None else []
    if target is not None and not Path(target).exists() and (
            "/" in target or Path(target).suffix.lower() in RESULT_SUFFIXES):
        return _show_files([], as_json, f"no job writes {target} (looked in "
                           f"{beside[0]} and {storage}), and "
                           "no job folder is there: give the job's --storage-path, its batch "
                           "id, or its job folder", [*beside, storage])
    if target is not None and ("/" in target or Path(target).is_dir()):
        storage, batch_id = _job_folder(Path(target)), None
    batches = storage / "batches"
    if batch_id is None:
        files = batch_files(storage)
    else:  # an id is a file name, never a pattern
        files = [p for p in [batches / f"{batch_id}.json"] if p.is_file()]
    return _show_files(files, as_json, f"no job{' ' + batch_id if batch_id else ''} under "
                       f"{storage} (give "
                       "a batch id with --storage-path, a job folder, or a job's output file)",
                       [storage] if batch_id is None else [])


def _job_folder(folder: Path) -> Path:
    """The job folder a folder argument means: itself, or the `.batchgen/` that `batchgen run`
    made in it (the output's folder, where a user looks for the job) when it has no jobs of
    its own."""
    nested = folder / ".batchgen"
    if not (folder / "batches").is_dir() and (nested / "batches").is_dir():
        return nested
    return folder


def _show_files(files: list[Path], as_json: bool, missing: str,
                folders: list[Path] = ()) -> int:
    """Each batch file's table; with none, the jobs of `folders` still starting (`_starting`),
    or `missing`."""
    if not files:
        starting = _starting(folders)
        for batch_id, holder in starting:
            record = {"batch_id": batch_id, "status": "starting", "run": f"running ({holder})"}
            print(orjson.dumps(record).decode() if as_json else
                  f"{batch_id}: starting ({holder}): reading its input or fetching its model; "
                  "its record is written once that is done")
        if not starting:
            Console(stderr=True, soft_wrap=True, markup=False).print(missing)
        return ExitCode.OK if starting else ExitCode.FAILED
    # No markup: paths and failure messages are shown as they are ("[rank 1]" is no style)
    console, failed = Console(markup=False), ExitCode.OK
    for path in files:
        storage, batches = path.parent.parent, path.parent
        try:
            state = orjson.loads(path.read_bytes())
            batch_id = state["batch_id"]
            liveness = _liveness(batches / f"{batch_id}.lock", state["status"])
            workers = read_worker_stats(batches, batch_id)
            running = liveness.startswith("running")
            unfinished = state.get("status") != "completed"
            done = _done_ids(storage, batch_id) if unfinished else None  # read once: slow
            if as_json:
                record = _job_record(state, workers, liveness, done, storage)
                sys.stdout.write(orjson.dumps(record).decode() + "\n")
                continue
            table = _table(state, workers, running=running)
            if unfinished:
                table.add_row("saved", _saved(done, state))
                table.add_row("checkpoint", _checkpointed(storage, batch_id, done))
                table.add_row("run", liveness)
            console.print(table)
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as err:
            Console(stderr=True, soft_wrap=True, markup=False).print(
                f"cannot read {path}: {err!r}" + UNREADABLE_HINT * (not isinstance(err, OSError)))
            failed = ExitCode.FAILED
    return failed


def _starting(folders: list[Path]) -> list[tuple[str, str]]:
    """(batch id, lock holder) of the jobs a live run holds in `folders` that have no batch file
    yet: a run writes it once the input is parsed and the model found, which takes hours for
    a large download."""
    found = []
    for folder in dict.fromkeys(folders):
        for lock in sorted((folder / "batches").glob("*.lock")):
            if lock.with_suffix(".json").exists() or "." in lock.stem:
                continue
            held = _lock_holder(lock)
            if held is not None:
                found.append((lock.stem, held[0]))
    return found


def _job_record(state: dict, workers: list[dict], liveness: str,
                done: IdSet | CorruptIncrementalFile | None, storage: Path) -> dict:
    """A job as `status --json` prints it: its batch file as written (job-files.md), `run`
    (whether a run holds it, as the table says), `workers` (its ranks' stats files, as the
    last or the running run wrote them), and for an unfinished job `saved` (results fsynced
    so far, or why they cannot be read) and `checkpoint` (requests in flight an in-flight
    checkpoint holds, and their tokens)."""
    record = {**state, "run": liveness, "workers": workers}
    if done is not None:
        record["saved"] = str(done) if isinstance(done, CorruptIncrementalFile) else len(done)
        requests, tokens = _checkpoint_counts(storage, state["batch_id"], done)
        record["checkpoint"] = {"requests": requests, "tokens": tokens}
    return record


def _done_ids(storage: Path, batch_id: str) -> IdSet | CorruptIncrementalFile:
    """The ids of the results fsynced so far (every incremental file's complete lines), or
    why they cannot be read."""
    try:
        return read_done_ids(_job_paths(storage, batch_id).incremental_files())
    except CorruptIncrementalFile as err:
        return err


def _saved(done: IdSet | CorruptIncrementalFile, state: dict) -> str:
    """Results fsynced so far (the batch file's counts are only written when the job ends)."""
    if isinstance(done, CorruptIncrementalFile):
        return f"unreadable: {done}"
    total = state.get("request_counts", {}).get("total", 0)
    return f"{len(done):,} of {total:,} results (incremental files)"


def _checkpointed(storage: Path, batch_id: str, done: IdSet | CorruptIncrementalFile) -> str:
    """Requests in flight whose progress an in-flight checkpoint holds (those whose results
    are saved since are not counted), and the tokens a resume does not draw again."""
    requests, tokens = _checkpoint_counts(storage, batch_id, done)
    if not requests:
        return "none (a resume starts any unfinished request from its prompt)"
    return (f"{requests:,} requests in flight hold {tokens:,} generated tokens (resume "
            "continues them)")


def _checkpoint_counts(storage: Path, batch_id: str,
                       done: IdSet | CorruptIncrementalFile) -> tuple[int, int]:
    """(requests in flight an in-flight checkpoint holds, their generated tokens), leaving
    out those whose results are saved since."""
    paths = _job_paths(storage, batch_id)
    if isinstance(done, CorruptIncrementalFile):
        done = set()
    requests = tokens = 0
    for path in checkpoint_files(paths.batch_file, batch_id):
        _, report = load(path, None, done)
        requests += report.requests
        tokens += report.tokens
    return requests, tokens


def _job_paths(storage: Path, batch_id: str) -> JobPaths:
    default = JobPaths.for_job(storage, batch_id)
    try:
        return JobSpec.load(default.spec_file).paths  # where its --incremental-output-dir points
    except (OSError, ValueError, KeyError, TypeError):
        return default


def _lock_holder(lock: Path) -> tuple[str, bool] | None:
    """(holder, on this host) while a run holds the job: the lock file names its holder while
    held (a run that ends clears it; one killed outright leaves its pid behind, which is alive
    no more). A holder on another host is not checked from here. None when none holds it.
    Never takes the lock: a status probe must not make a starting run think the job is busy."""
    try:
        holder = lock.read_text().strip()
    except OSError:
        return None
    found = re.fullmatch(r"pid (\d+) on host (\S+)", holder)
    if found is None:
        return None
    if found.group(2) != socket.gethostname():
        return holder, False
    return (holder, True) if _alive(int(found.group(1))) else None


def _liveness(lock: Path, status: str) -> str:
    """Whether a live run holds the job (`_lock_holder`), and if none does, how the last one
    left it."""
    held = _lock_holder(lock)
    if held is not None:
        holder, here = held
        return (f"running ({holder})" if here
                else f"held by {holder} (another host: not checked from here)")
    if status == "validating":  # its checks refused something, or it was stopped in them
        return ("not running: stopped before answering anything (its run's error says why; "
                "the same command tries again)")
    if status in ("in_progress", "finalizing"):
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


def age(seconds: float) -> str:
    """How long ago, as a person says it: 3 s ago, 4 min ago, 2 h ago."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _speed(state: dict) -> str:
    """Output tokens per second of the saved results over every run of the job, and the tokens
    the last run drew a second (answers still in flight when it stopped included); input tokens
    per second for a job that generated nothing (embeddings only). A job whose finished
    results so far are embeddings lines but whose engine admitted requests to generate (a
    chat job stopped before its first answer) is not one: its rate stays in output tokens."""
    timings, usage = state.get("timings", {}), state.get("usage", {})
    last = state.get("throughput", {}).get("output_tokens_per_s")
    seconds, runs = timings.get("all_runs_seconds"), timings.get("runs")
    embedded = embeddings_only(usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0),
                               (state.get("counters") or {}).get("admitted", 0))
    parts = []
    if seconds and runs:
        rate = usage.get("prompt_tokens" if embedded else "completion_tokens", 0) / seconds
        parts.append(f"{rate:,.1f} {'in' if embedded else 'out'} tok/s over {runs} "
                     f"run{'s' * (runs != 1)} ({human_seconds(seconds)})")
    if last is not None and not embedded:
        parts.append(f"last run drew {last:,.1f} out tok/s (its unsaved answers' tokens "
                     "included)")
    return "; ".join(parts) or "not measured yet"


def _request_counts(state: dict) -> str:
    """The job's completed / failed / total requests: the batch file counts the first two
    when the job ends, so before that only the total is shown (the "saved" row has progress)."""
    counts = state.get("request_counts", {})
    total = f"{counts.get('total', 0):,} total"
    if state.get("status") != "completed":
        return f"{total} (completed and failed are counted when the job ends; saved: below)"
    return f"{counts.get('completed', 0):,} completed, {counts.get('failed', 0):,} failed, {total}"


def _model(fingerprint: dict) -> str:
    """The model the job answers with, as its fingerprint records it: the --model value (the
    embedded model by name) and, for a Hub model, the commit a resume is pinned to."""
    model = fingerprint.get("model")
    if not isinstance(model, str):
        return ""
    commit = pinned_commit(fingerprint)
    return model + (f" (Hub commit {commit})" if commit else "")


def _running_tokens(workers: list[dict]) -> str:
    """The tokens of the run going on, from its workers' stats files (the batch file adds a
    run's tokens when it ends), or "" when they report none."""
    writing = [w for w in workers if w.get("writes_results", True)]  # a TP group's one writer
    prompt, completion, _ = run_tokens(writing)
    drawn = drawn_tokens(writing)
    if not prompt and not completion and not drawn:
        return ""
    text = f"; the run going on: {prompt:,} in, {completion:,} out so far"
    if drawn != completion:  # answers still going (or continued from a checkpoint)
        text += f" in saved results, {drawn:,} tokens drawn (answers in flight included)"
    return text


def _prefix_row(state: dict, workers: list[dict], running: bool) -> str:
    """The prefix cache's hits: the run going on's engines while one runs, else the last
    run's (the batch file records a run's counters when it ends)."""
    live = [w["engine"] for w in workers if isinstance(w.get("engine"), dict)]
    if running and prefix_hits(live) != "-":
        return prefix_hits(live, " in the run going on")
    return prefix_hits([state.get("counters", {})], " in the last run")


def _health(state: dict, workers: list[dict], running: bool) -> dict:
    """The batch file's health, whose heartbeat is a run's last when it ended: while a run is
    going on, its workers' newest heartbeat instead (a minutes-old one would read as a hang)."""
    health = dict(state.get("health", {}))
    beats = [w["heartbeat"] for w in workers if isinstance(w.get("heartbeat"), (int, float))]
    if running and beats:
        recorded = health.get("last_heartbeat")
        health["last_heartbeat"] = max(beats + ([recorded] if isinstance(recorded, (int, float))
                                                else []))
    return health


def _table(state: dict, workers: list[dict], running: bool = False) -> Table:
    table = Table(title=f"{state['batch_id']}: {state['status']}", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # a path is shown whole, folded over lines, never cut
    model = _model(state.get("fingerprint") or {})
    if model:
        table.add_row("model", model)
    table.add_row("requests", _request_counts(state))
    usage = state.get("usage", {})
    prompt = usage.get("prompt_tokens", 0)
    table.add_row("tokens", f"{prompt:,} in{cached_share(cached_tokens(usage), prompt)}, "
                  f"{usage.get('completion_tokens', 0):,} out ("
                  + ("runs that ended" if running else "all runs") + ")"
                  + (_running_tokens(workers) if running else ""))
    table.add_row("speed", _speed(state))
    table.add_row("prefix cache", _prefix_row(state, workers, running))
    table.add_row("output", state.get("output_file", ""))
    table.add_row("errors", state.get("errors_file", ""))
    now = time.time()
    for key, value in _health(state, workers, running).items():
        if key in TIMESTAMPS and isinstance(value, (int, float)) and value > 0:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
            value = f"{age(now - value)} ({when})"
        if key in HISTORY and state.get("status") == "completed":
            value = f"{value} (an earlier run's: the job completed since)"
        table.add_row(f"health.{key}", str(value))
    for w in workers:  # stats files are rewritten as workers go: take what is there
        beat = w.get("heartbeat")
        table.add_row(f"rank {w.get('rank', '?')}",
                      f"{w.get('completed', 0)} done, {w.get('failed', 0)} failed, "
                      f"{speed_text([w])}, prefix hits "
                      f"{prefix_hits([w.get('engine', {})])}, heartbeat "
                      + (age(now - beat) if isinstance(beat, (int, float)) else "none"))
    return table

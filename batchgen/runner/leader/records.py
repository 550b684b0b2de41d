"""What the batch file records when a run ends: status, health, the engines' counters (the
prefix cache's hit rate recomputed over the ranks), usage over every run, throughput, the
result files' paths and the start-up phases."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import orjson

from batchgen.config import JobConfig
from batchgen.io.jobfiles import BatchFile, CorruptBatchFile, FingerprintMismatch, JobPaths
from batchgen.io.writer import count_lines
from batchgen.phases import format_phases, process_start_time
from batchgen.runner.files.job import JobSpec
from batchgen.runner.leader.progress import read_worker_stats
from batchgen.runner.worker.outputs import outputs_belong_to
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
    prompt, completion, cached = run_tokens(stats)
    drawn = drawn_tokens(stats)
    changes = {
        "status": status, "health": {**health_from_stats(stats), **health},
        "counters": _engine_counters(stats),
        "timings": {"finished_at": int(time.time()), "last_run_seconds": round(elapsed, 3)},
        "throughput": {"output_tokens_per_s": round(drawn / elapsed, 2),
                       "total_tokens_per_s": round((drawn + prompt) / elapsed, 2)},
        **result_files(spec.paths),
        "usage": usage or _usage_after(batch_file, prompt, completion, cached)}
    changes["timings"].update(_all_runs(batch_file, elapsed))
    if counts:
        changes["request_counts"] = counts
    startup = startup_phases(stats)
    if startup:
        changes["timings"]["startup"] = startup
        log.info("start-up: %s; whole run %.1f s", format_phases(startup),
                 time.time() - process_start_time())
    batch_file.update(spec.batch_id, **changes)


def record_killed_run(batch_id: str, batch_file: BatchFile, batch_dir: Path) -> None:
    """A run killed before it could record its end (SIGKILL, a lost node) left the job
    in_progress (or finalizing, killed in its merge), started after its last recorded end,
    and left its workers' stats files: count that run, its tokens and its seconds up to the
    stats' last write, so that the job's rate over all runs stays true. Call before the next
    run removes those files."""
    state = batch_file.load()
    if state is None or state.status not in ("in_progress", "finalizing"):  # killed in the merge
        return
    started, ended = state.timings.get("started_at"), state.timings.get("finished_at", 0)
    files = list(batch_dir.glob(f"{batch_id}.worker*.json"))
    if not started or ended >= started or not files:
        return
    last = max(path.stat().st_mtime for path in files)
    stats = read_worker_stats(batch_dir, batch_id)
    prompt, completion, cached = run_tokens(stats)
    batch_file.update(batch_id, usage=_usage_after(batch_file, prompt, completion, cached),
                      timings={**_all_runs(batch_file, max(0.0, last - started)),
                               "finished_at": int(last)})


def result_files(paths: JobPaths) -> dict:
    """Absolute, so `batchgen status OUTPUT` finds the job from any working directory."""
    return {"output_file": str(paths.output.absolute()),
            "errors_file": str(paths.errors_output.absolute())}


def batch_files(storage: Path) -> list[Path]:
    """The batch files (one per job) under a job folder."""
    return sorted(p for p in (storage / "batches").glob("*.json") if p.stem.count(".") == 0)


def _folders_of(output: Path, storage: Path) -> tuple[Path, Path]:
    """Where the jobs writing `output` keep their batch files: the default job folder beside
    it (.batchgen/), then `storage`."""
    return output.absolute().parent / ".batchgen", storage


def jobs_writing(output: Path, storage: Path) -> list[Path]:
    """Batch files of the jobs whose results file is `output`: in the default job folder
    beside it (.batchgen/), else under `storage`."""
    want = output.resolve()
    for folder in _folders_of(output, storage):
        found = []
        for path in batch_files(folder):
            try:
                written = orjson.loads(path.read_bytes()).get("output_file")
            except (OSError, orjson.JSONDecodeError, AttributeError):
                continue
            if written and Path(written).resolve() == want:
                found.append(path)
        if found:
            return found
    return []


def unreadable_batch_files(output: Path, storage: Path) -> list[Path]:
    """Batch files where jobs_writing looks for the jobs writing `output` that are not JSON
    objects: which output they name is unknown, so any of them may be that job's."""
    unreadable = []
    for folder in _folders_of(output, storage):
        for path in batch_files(folder):
            try:
                readable = isinstance(orjson.loads(path.read_bytes()), dict)
            except (OSError, orjson.JSONDecodeError):
                readable = False
            if not readable:
                unreadable.append(path)
    return unreadable


def warn_if_replacing(spec: JobSpec, storage: Path) -> None:
    """Say so when the job's --output holds another job's results (a changed input, other
    flags): this job replaces the file when it finishes. That job's results stay in its
    incremental file, and rerunning its command writes them back without recomputing."""
    output = spec.paths.output
    foreign = _foreign_results(spec.batch_id, (output, spec.paths.errors_output))
    if foreign is None:
        return
    input_file = None
    try:
        others = [p for p in jobs_writing(output, storage) if p.stem != spec.batch_id]
        if others:
            newest = max(others, key=lambda p: p.stat().st_mtime)
            input_file = orjson.loads(newest.read_bytes()).get("input_file")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        pass
    how = (f"`batchgen run -i {input_file} -o {output}` with that job's other flags writes "
           "them back without recomputing" if input_file else "")
    log.warning("%s holds the results of another job%s; this job replaces it when it "
                "finishes. %s%sTo keep both, stop now and give this job another --output.",
                foreign, f" (input {input_file})" if input_file else "",
                "Those results stay in the job folder: " if how else "",
                how + ". " if how else "")


def _foreign_results(batch_id: str, files: tuple[Path, ...]) -> Path | None:
    """The first of the final files (results, then errors) holding lines another job wrote;
    None when each is missing, empty or this job's own. An unreadable one counts as foreign."""
    for path in files:
        try:
            if (path.is_file() and path.stat().st_size
                    and not outputs_belong_to(batch_id, path)):
                return path
        except OSError:
            return path
    return None


def refuse_a_changed_input(config: JobConfig, paths: JobPaths, size_bytes: int) -> None:
    """Lines appended to an unfinished job's input, or the file replaced, between its runs: the
    same command derives another batch id from the new content, a new job that would answer
    every line again while the saved results wait under the old id, unused. Refused (exit 3)
    naming both ways on; --batch-id or another --output says that a new job is meant."""
    s = config.storage
    if s.batch_id is not None or BatchFile(paths.batch_file).load() is not None:
        return  # a job named by hand, or this job's own resume
    here = str(Path(s.input).resolve())
    for path in batch_files(paths.storage_path):
        try:
            state = BatchFile(path).load()
        except CorruptBatchFile:
            continue
        if (state is None or state.status == "completed" or state.input_file != here
                or state.health.get("input_changed")):  # edited mid-run: told to start over
            continue
        old = JobPaths.for_job(paths.storage_path, state.batch_id, s.incremental_output_dir,
                               s.output)
        saved = _lines(old.incremental_files())
        if Path(state.output_file) != old.output.absolute() or not saved:
            continue  # it wrote another output, or decided nothing yet
        raise FingerprintMismatch(
            f"input {s.input} changed since job {state.batch_id} started from it "
            f"({_sizes(_size_then(old), size_bytes)}) and that job is unfinished: "
            f"{saved:,} of its {state.request_counts.get('total', 0):,} results are saved. "
            "This command would start a new job that answers every line again. To finish "
            "that job, put back the input it read and run the same command; to answer this "
            "file as a new job, run it with --batch-id NAME (or another --output).")


def _lines(files: list[Path]) -> int:
    """Result lines in `files` (one unreadable counts none: this only decides a refusal)."""
    count = 0
    for path in files:
        try:
            count += count_lines(path)
        except OSError:
            continue
    return count


def _sizes(then: str, now: int) -> str:
    """The input's size then and now, or that only its content changed."""
    if then == f"{now:,}":
        return f"the same {now:,} bytes, other content"
    return f"{then} bytes then, {now:,} now"


def _size_then(paths: JobPaths) -> str:
    try:
        return f"{int(orjson.loads(paths.upload_file.read_bytes())['size_bytes']):,}"
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return "?"


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


def run_tokens(stats: list[dict]) -> tuple[int, int, int]:
    """Prompt, completion and cached prompt tokens the ranks' stats files count for a run."""
    return tuple(sum(s.get(key, 0) for s in stats)
                 for key in ("prompt_tokens", "completion_tokens", "cached_tokens"))


def drawn_tokens(stats: list[dict]) -> int:
    """Output tokens the run's engines drew (`generated_tokens`): the tokens of its answers
    less those continued from an in-flight checkpoint, which an earlier run drew, plus those
    of answers still going when a run stops. A stats file without engine counters (a rank of
    a tensor-parallel group that writes no results) counts its answers' tokens."""
    return sum(s["engine"]["generated_tokens"]
               if isinstance(s.get("engine"), dict) and "generated_tokens" in s["engine"]
               else s.get("completion_tokens", 0) for s in stats)


def _usage_after(batch_file: BatchFile, prompt: int, completion: int, cached: int) -> dict:
    """Token usage of every run so far (each run adds its own)."""
    state = batch_file.load()
    usage = dict(state.usage) if state else {}
    return usage_total(usage.get("prompt_tokens", 0) + prompt,
                       usage.get("completion_tokens", 0) + completion,
                       cached_tokens(usage) + cached)


def usage_total(prompt: int, completion: int, cached: int = 0) -> dict:
    """A job's usage, shaped as its result lines' (`cached`: of the prompt tokens, those the
    prefix cache held, summed over the lines' `prompt_tokens_details.cached_tokens`)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def cached_tokens(usage: dict) -> int:
    """The cached prompt tokens of a usage dict (0 in a record written without them)."""
    details = usage.get("prompt_tokens_details")
    return details.get("cached_tokens", 0) if isinstance(details, dict) else 0

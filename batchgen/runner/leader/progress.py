"""Progress of a running job, read from the workers' per-rank stats files (rich bar on a TTY,
plain periodic log lines otherwise, e.g. in Slurm logs)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import orjson

from batchgen.core import human_seconds, rate_text

log = logging.getLogger("batchgen")
PLAIN_INTERVAL_S = 30.0


def read_worker_stats(batch_dir: Path, batch_id: str) -> list[dict]:
    stats = []
    for path in sorted(batch_dir.glob(f"{batch_id}.worker*.json")):
        try:
            stats.append(orjson.loads(path.read_bytes()))
        except (OSError, orjson.JSONDecodeError):
            continue  # being replaced right now; next poll reads it
    return stats


class ProgressReporter(threading.Thread):
    def __init__(self, batch_dir: Path, batch_id: str, total: int, already_done: int):
        super().__init__(daemon=True)
        self.batch_dir, self.batch_id = batch_dir, batch_id
        self.total, self.already_done = total, already_done
        self._stop_event = threading.Event()
        self._t0 = time.time()

    def snapshot(self) -> tuple[int, str, str]:
        """(requests done, the ranks' summed speed as text (`speed_text`), the share of prompt
        tokens the prefix cache supplied, as text)."""
        stats = [s for s in read_worker_stats(self.batch_dir, self.batch_id)
                 if s.get("heartbeat", 0) >= self._t0]
        done = self.already_done + sum(s["completed"] + s["failed"] for s in stats)
        return (min(done, self.total), speed_text(stats),
                prefix_hits([s.get("engine", {}) for s in stats]))

    def run(self) -> None:
        if sys.stderr.isatty():
            self._run_rich()
        else:
            self._run_plain()

    def _run_rich(self) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        with Progress(TextColumn("[bold]batchgen"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      transient=False) as bar:
            task = bar.add_task("requests", total=self.total, completed=self.already_done, rate="")
            while not self._stop_event.wait(1.0):
                done, speed, hits = self.snapshot()
                bar.update(task, completed=done, rate=f"{speed}, prefix hits {hits}")

    def _run_plain(self) -> None:
        # The time left is measured from the first line that saw a result (start-up, loading
        # the model, is not the rate to come); until then from the start.
        since_done, since = self.already_done, self._t0
        while not self._stop_event.wait(PLAIN_INTERVAL_S):
            done, speed, hits = self.snapshot()
            now = time.time()
            log.info("%s", progress_line(done, self.total, since_done, speed, hits, now - since))
            if since == self._t0 and done > self.already_done:
                since_done, since = done, now

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def progress_line(done: int, total: int, since_done: int, speed: str, hits: str,
                  elapsed: float) -> str:
    """The periodic progress line of a run without a terminal (a Slurm log): requests done
    (and their share), speed, prefix-cache hits and the time left at the rate since an earlier
    moment (`elapsed` seconds ago, when `since_done` requests were done): "progress:
    4,000/100,000 requests (4.0%), 42 out tok/s, prefix cache hits 22% of 131,239 prompt
    tokens; about 48 min 00 s left"."""
    line = (f"progress: {done:,}/{total:,} requests ({done / max(total, 1):.1%}), {speed}, "
            f"prefix cache hits {hits}")
    answered = done - since_done
    if answered <= 0 or elapsed <= 0:
        return line
    return f"{line}; about {human_seconds((total - done) * elapsed / answered)} left"


def speed_text(stats: list[dict]) -> str:
    """Ranks' speed, summed over their stats: "812 out tok/s", or the input tokens embedded
    per second ("1,520 in tok/s") while they have embedded something and admitted nothing to
    generate (an embeddings job, where output tokens stay 0)."""
    embedded = embeddings_only(sum(s.get("completion_tokens", 0) for s in stats),
                               sum(s.get("prompt_tokens", 0) for s in stats),
                               sum((s.get("engine") or {}).get("admitted", 0) for s in stats))
    key, unit = ("input_tokens_per_s", "in") if embedded else ("output_tokens_per_s", "out")
    return f"{rate_text(sum(s.get(key, 0.0) for s in stats))} {unit} tok/s"


def embeddings_only(completion_tokens: int, prompt_tokens: int, admitted: int = 0) -> bool:
    """Whether a job's (or a run's) tokens are embeddings': input tokens and no output, and no
    request admitted to generate (a chat job stopped before its first answer is not one). Its
    speed is then said in input tokens per second."""
    return not completion_tokens and not admitted and prompt_tokens > 0


def prefix_hits(counters: list[dict], scope: str = "") -> str:
    """Share of prompt tokens whose KV came from the prefix cache, over engines' counters
    (`prompt_tokens`, `cached_prompt_tokens`, `forks`, `extra_choices`): "87% of 2,048 prompt
    tokens", or "-". The engine counts each choice of an n > 1 request (a fork finds all but
    the last prompt token cached), so where such choices ran, forked or not (a tight pool, or a
    prompt of 64k + 1 tokens, has none to copy), the count says so: it is then above the job's
    prompt tokens, which count each request's prompt once. `scope` follows the tokens (" in
    the last run")."""
    prompt = sum(c.get("prompt_tokens", 0) for c in counters)
    cached = sum(c.get("cached_prompt_tokens", 0) for c in counters)
    if not prompt:
        return "-"
    each = (" (each choice of n > 1 counted)"
            if sum(c.get("forks", 0) + c.get("extra_choices", 0) for c in counters) else "")
    return f"{cached / prompt:.0%} of {prompt:,} prompt tokens{scope}{each}"


def run_summary(elapsed: float, completed: int, failed: int, tokens_in: int, tokens_out: int,
                run_tokens_out: int, output: Path, errors: Path, storage: Path,
                run_answered: int | None = None, cached_tokens: int = 0,
                run_tokens_in: int = 0, run_tokens_resumed: int = 0) -> str:
    """What a finished `batchgen run` prints: time, requests, tokens, speed, where things are.
    Requests and tokens are the job's (every run of it); the speed is this run's: output
    tokens per second, or input tokens per second (`run_tokens_in`) for a job that generated
    nothing (embeddings only), as `batchgen status` says it.
    `run_answered`: the requests this run answered, when earlier runs saved the others (a
    resume): the time and speed are then said to be this run's. `cached_tokens`: of the
    prompt tokens, those the prefix cache held (said when there are any).
    `run_tokens_resumed`: of `run_tokens_out`, those continued from an in-flight checkpoint
    (an earlier run drew them): said, and left out of the speed."""
    unit, run_tokens = (("in", run_tokens_in) if embeddings_only(tokens_out, tokens_in)
                        else ("out", run_tokens_out))
    resumed = run_tokens_resumed if unit == "out" else 0
    rate = (run_tokens - resumed) / elapsed if elapsed > 0 else 0.0
    continued = f", {resumed:,} of them continued from a checkpoint" if resumed else ""
    total, took = completed + failed, human_seconds(elapsed)
    if run_answered is None or run_answered >= total:
        done, out = f"({total:,} requests) in {took}", f"{rate:,.1f} {unit} tok/s this run"
        if resumed:
            out = f"this run {run_tokens:,} {unit}{continued}, {rate:,.1f} {unit} tok/s"
    elif run_answered == 0:
        done = f"({total:,} requests, all saved by earlier runs: this run merged them in {took})"
        out = "all runs"
    else:
        done = (f"({total:,} requests: {run_answered:,} answered by this run in {took}, "
                f"{total - run_answered:,} saved by earlier runs)")
        out = f"all runs; this run {run_tokens:,} {unit}{continued}, {rate:,.1f} {unit} tok/s"
    lines = [
        f"done: {completed:,} results, {failed:,} errors {done}",
        f"tokens: {tokens_in:,} in{cached_share(cached_tokens, tokens_in)}, {tokens_out:,} out "
        f"({out})",
        f"results: {output}",
        f"errors:  {errors}" if failed else f"errors:  none ({errors} is empty)",
        f"job:     {storage} (`{status_command(output, storage)}` shows it)",
    ]
    return "\n".join(lines)


def cached_share(cached_tokens: int, tokens_in: int) -> str:
    """" (617 of them cached, 50%)" after a job's prompt tokens, or "" when none were cached:
    the run summary and `batchgen status` say it alike."""
    if not cached_tokens or not tokens_in:
        return ""
    return f" ({cached_tokens:,} of them cached, {cached_tokens / tokens_in:.0%})"


def status_command(output: Path, storage: Path) -> str:
    """The `batchgen status` command that finds this job: it looks in the `.batchgen/` beside
    the output and in the default job folder; any other job folder must be named."""
    from batchgen.config import default_storage_path

    found = {Path(default_storage_path(str(output))).resolve(),
             Path(default_storage_path(None)).expanduser().resolve()}
    if Path(storage).expanduser().resolve() in found:
        return f"batchgen status {output}"
    return f"batchgen status {output} --storage-path {storage}"

"""Shared helpers of the tests/test_reliability_*.py fault-injection suite (no tests here).

Every fault test runs the same small greedy job, compares its final output with one clean run
(computed once per pytest run and cached), and counts records lost and duplicated.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

from job_utils import batchgen, chat_rows, read_jsonl, start, write_jsonl

SYSTEM = ("You answer questions about the world for a children's encyclopedia. Use short "
          "sentences, plain words and one concrete example. Never invent dates, names or "
          "numbers; when you are not sure, say so. Keep every answer under sixty words, and end "
          "with a question that invites the reader to look further. Readers are between eight "
          "and twelve years old: explain any word a child might not know, prefer everyday "
          "comparisons to technical terms, and never talk down to them. If a question is "
          "about something dangerous, say how to stay safe and suggest asking an adult.")
ROWS = [{**row, "body": {**row["body"], "messages": [{"role": "system", "content": SYSTEM},
                                                      *row["body"]["messages"]]}}
        for row in chat_rows(32, max_tokens=40, temperature=0.0)]
"""Greedy: resumed answers must equal the clean run token for token. Every request starts
with the same system prompt (over a KV page of tokens), so the faults land on jobs whose
requests share cached prefix pages."""
_CLEAN: dict[str, Path] = {}
FIGURES_ENV = "BATCHGEN_RELIABILITY_FIGURES"
"""When set, tests append their measured figures (one JSON object per line) to this file."""


def seeded_rng(test: str) -> random.Random:
    """A seeded RNG; the seed is printed so a failure can be replayed (BATCHGEN_TEST_SEED)."""
    seed = int(os.environ.get("BATCHGEN_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"{test}: BATCHGEN_TEST_SEED={seed}")
    return random.Random(seed)


def job_input(folder: Path, rows: list[dict] = ROWS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_jsonl(folder / "in.jsonl", rows)


def run_args(inp: Path, storage: Path, model: Path, *extra) -> list:
    return ["run", "--input", inp, "--storage-path", storage, "--model", model, "--seed", "3",
            *extra]


def run(inp, storage, model, *extra, env=None, timeout=300, **kw):
    return batchgen(*run_args(inp, storage, model, *extra), env=env, timeout=timeout, **kw)


def launch(inp, storage, model, *extra, env=None):
    return start(*run_args(inp, storage, model, *extra), env=env)


def clean_storage(model: Path) -> Path:
    """Storage of one uninterrupted run of ROWS (cached: the suite pays for it once)."""
    key = str(model)
    if key not in _CLEAN:
        root = Path(tempfile.mkdtemp(prefix="batchgen-clean-"))
        atexit.register(shutil.rmtree, root, True)
        run(job_input(root), root / "s", model, check=True)
        _CLEAN[key] = root / "s"
    return _CLEAN[key]


def clean_input(model: Path) -> Path:
    """The input the clean job read: a copy of its storage resumes with it."""
    return clean_storage(model).parent / "in.jsonl"


def copy_clean(model: Path, dest: Path) -> Path:
    """A copy of the clean job's storage: resuming it is the same job (same `created`)."""
    shutil.copytree(clean_storage(model), dest)
    return dest


def outputs(storage: Path, folder: Path | None = None) -> tuple[list[dict], list[dict]]:
    """(results, error lines) of a finished job; folder: where --output put them."""
    out = sorted(Path(folder or Path(storage) / "outputs").glob("*.jsonl"))
    results = [p for p in out if not p.name.endswith(".errors.jsonl")]
    errors = [p for p in out if p.name.endswith(".errors.jsonl")]
    return read_jsonl(results[0]), read_jsonl(errors[0]) if errors else []


def incremental_file(storage: Path) -> Path:
    return next((Path(storage) / "incremental").glob("*.jsonl"))


def incremental_ids(storage: Path, folder: Path | None = None) -> list[str]:
    ids = []
    for path in Path(folder or Path(storage) / "incremental").glob("*.jsonl"):
        for raw in path.read_bytes().splitlines():
            ids.append(json.loads(raw)["custom_id"])
    return ids


def count_lines(storage: Path) -> int:
    try:
        return incremental_file(storage).read_bytes().count(b"\n")
    except (StopIteration, FileNotFoundError):
        return 0


def batch_state(storage: Path) -> dict:
    for path in (Path(storage) / "batches").glob("batch_*.json"):
        if path.name.count(".") == 1:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                return {}  # replaced right now
    return {}


def worker_pids(storage: Path) -> list[int]:
    pids = []
    for path in (Path(storage) / "batches").glob("*.worker*.json"):
        try:
            pids.append(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return pids


def without_run_details(lines: list[dict], created: bool = False) -> list[dict]:
    """The lines less what says how this run computed them rather than what it answered:
    `usage.prompt_tokens_details.cached_tokens` (which request met a shared prompt prefix
    first depends on kills, resumes and replicas) and, unless `created`, the start time of the
    job ("created": two separate jobs differ in it)."""
    lines = json.loads(json.dumps(lines))
    for line in lines:
        body = (line.get("response") or {}).get("body") or {}
        if not created:
            body.pop("created", None)
        (body.get("usage") or {}).get("prompt_tokens_details", {}).pop("cached_tokens", None)
    return lines



def check_against_clean(storage: Path, model: Path, same_job: bool = False,
                        allowed_errors: tuple[str, ...] = (), incremental_dir: Path | None = None,
                        output_dir: Path | None = None) -> dict:
    """Exactly one record per custom_id, identical to the clean run; returns the figures.
    incremental_dir / output_dir: where --incremental-output-dir / --output put the files."""
    clean, _ = outputs(clean_storage(model))
    results, errors = outputs(storage, output_dir)
    inc = Counter(incremental_ids(storage, incremental_dir))
    final = Counter(r["custom_id"] for r in results + errors)
    expected = [r["custom_id"] for r in clean]
    lost = [cid for cid in expected if cid not in final]
    duplicated = sorted({c for c, n in inc.items() if n > 1}
                        | {c for c, n in final.items() if n > 1})
    assert not lost and not duplicated, f"lost {lost}, duplicated {duplicated}"
    assert sorted(e["custom_id"] for e in errors) == sorted(allowed_errors)
    wanted = [r for r in clean if r["custom_id"] not in allowed_errors]
    assert without_run_details(results, created=same_job) == \
        without_run_details(wanted, created=same_job)
    return {"records": len(expected), "lost": len(lost), "duplicated": len(duplicated)}


def wait_for(predicate, timeout: float, poll: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def kill_group(proc, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def record_figures(name: str, **figures) -> None:
    path = os.environ.get(FIGURES_ENV)
    print(f"{name}: {figures}")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")

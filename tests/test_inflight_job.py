"""In-flight checkpoints end to end: a job stopped (SIGTERM) or killed (SIGKILL) mid-answer
continues its answers on resume, draws no token twice after a stop, and ends with results
identical to an uninterrupted run; `batchgen status` counts what the checkpoint holds.
(benchmarks/inflight_faults.py runs the long loops and prints the figures.)"""

import json
import os
import signal
import subprocess
import sys

import pytest
from batchgen.testing.faults import STUCK_ENV
from job_utils import chat_rows
from test_reliability_support import (
    count_lines,
    job_input,
    kill_group,
    launch,
    outputs,
    run,
    seeded_rng,
    wait_for,
    without_run_details,
)

ROWS = chat_rows(8, max_tokens=24, temperature=0.8)
EXTRA = ("--preempt-grace", "60", "--decode-burst-steps", "2")
"""A slow shared CPU may take seconds per step: the grace must not cut the stop short."""


@pytest.fixture(autouse=True)
def slow_decode_steps(monkeypatch):
    """On a fast machine each decode step sleeps 50 ms (the testing fault), so that a stop
    lands mid-answer; the jobs these tests start inherit the environment."""
    monkeypatch.setenv(STUCK_ENV, "0.05")


def stats(storage) -> dict:
    for path in (storage / "batches").glob("*.worker0.json"):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
    return {}


def generated(storage) -> int:
    return stats(storage).get("engine", {}).get("generated_tokens", 0)


def attempt(inp, storage, model, sig, rng, *extra) -> dict:
    """One run stopped by `sig` a random moment after its first step; its worker's figures."""
    for path in (storage / "batches").glob("*.worker*.json"):
        path.unlink()
    proc = launch(inp, storage, model, *EXTRA, *extra)
    assert wait_for(lambda: "engine" in stats(storage), 240), proc.communicate()[1][-3000:]
    wait_for(lambda: proc.poll() is not None, rng.uniform(0, 1.5))
    if sig is signal.SIGKILL:  # right after a stats write, so its token count is current
        before = (storage / "batches").glob("*.worker0.json")
        mtime = max(p.stat().st_mtime for p in before)
        wait_for(lambda: max(p.stat().st_mtime for p in
                             (storage / "batches").glob("*.worker0.json")) > mtime, 10)
    if proc.poll() is None:
        kill_group(proc, sig)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode in (0, 75, -9), err[-3000:]
    return {"exit": proc.returncode, "generated": generated(storage), **stats(storage).get(
        "checkpoint", {})}


def status(storage) -> str:
    proc = subprocess.run([sys.executable, "-m", "batchgen", "status", "--storage-path",
                           str(storage)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    return proc.stdout


def stopped_job(tmp_path, model, sig, stops: int, *extra) -> tuple[list[dict], int, int]:
    """(attempts, tokens over all attempts, tokens of an uninterrupted run); asserts the
    results equal the uninterrupted run's."""
    rng = seeded_rng(f"stopped_job {sig.name}")
    inp = job_input(tmp_path / "in", ROWS)
    clean = tmp_path / "clean"
    run(inp, clean, model, *EXTRA, check=True)
    storage = tmp_path / "s"
    attempts = []
    for _ in range(stops):
        attempts.append(attempt(inp, storage, model, sig, rng, *extra))
        if attempts[-1]["exit"] == 0 or count_lines(storage) == len(ROWS):
            break
        if sig is signal.SIGTERM:
            held = attempts[-1]["requests"]
            assert f"{held} requests in flight hold {attempts[-1]['tokens']}" in status(storage)
    for path in (storage / "batches").glob("*.worker*.json"):
        path.unlink()
    run(inp, storage, model, *EXTRA, *extra, check=True)
    # No worker runs when the last stop came after the last result was saved.
    attempts.append({"exit": 0, "generated": generated(storage),
                     **stats(storage).get("checkpoint", {})})
    print(json.dumps(attempts))
    assert without_run_details(outputs(storage)[0]) == without_run_details(outputs(clean)[0])
    assert not list((storage / "batches").glob("*.checkpoint.*"))  # done: nothing in flight
    return attempts, sum(a["generated"] for a in attempts), generated(clean)


def test_sigterm_resumes_in_flight_answers_exactly(tmp_path, tiny_chat_model):
    attempts, total, clean = stopped_job(tmp_path, tiny_chat_model, signal.SIGTERM, 2)
    assert any(a.get("resumed_tokens", 0) > 0 for a in attempts)
    assert total == clean  # no token drawn twice: each stop saved every token drawn


@pytest.mark.slow
def test_ten_sigterms_at_random_moments(tmp_path, tiny_chat_model):
    attempts, total, clean = stopped_job(tmp_path, tiny_chat_model, signal.SIGTERM, 10)
    assert total == clean


@pytest.mark.slow
def test_sigkill_loses_at_most_the_interval(tmp_path, tiny_chat_model):
    """Killed outright, a run keeps what its last periodic checkpoint saved: the tokens drawn
    again are at most those drawn since that save (an interval's decoding, here 1 s)."""
    attempts, total, clean = stopped_job(tmp_path, tiny_chat_model, signal.SIGKILL, 4,
                                         "--inflight-checkpoint-interval", "1")
    killed = [a for a in attempts if a["exit"] == -9]
    unsaved = [a["generated"] - a["generated_at_save"] for a in killed]
    print(f"tokens drawn since the last save at each kill: {unsaved}, "
          f"drawn again: {total - clean}")
    assert killed and any(a.get("resumed_tokens", 0) > 0 for a in attempts)
    assert total - clean <= sum(unsaved)

"""Single writer: a second live run of the same job exits at once (code 4) naming the holder."""

import signal
import socket
import threading
import time

import pytest

from batchgen.testing.faults import STUCK_ENV
from test_reliability_support import (
    check_against_clean,
    job_input,
    launch,
    record_figures,
    run,
    wait_for,
)


@pytest.mark.slow
def test_second_live_run_is_refused_and_only_the_first_writes(tmp_path, tiny_chat_model):
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    # Decode steps slowed down: the first run must still be live when the second one starts
    # (a fast machine finished the tiny job in between: "already completed", exit 0).
    slow = {STUCK_ENV: "0.2"}
    first = launch(inp, storage, tiny_chat_model, env=slow)
    lock = None

    def holder_named() -> bool:
        nonlocal lock
        lock = next((storage / "batches").glob("*.lock"), None)
        return lock is not None and b"pid" in lock.read_bytes()

    assert wait_for(holder_named, 120), first.communicate()[1][-3000:]
    t0 = time.monotonic()
    second = run(inp, storage, tiny_chat_model, env=slow)
    refused_in = time.monotonic() - t0
    assert second.returncode == 4, second.stderr[-3000:]
    assert f"pid {first.pid} on host {socket.gethostname()}" in second.stderr
    assert "Traceback" not in second.stderr and "loading" not in second.stderr
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    launches = list((storage / "logs").glob("*/*/attempt_*"))
    assert len(launches) == 1, "the refused run must not have started workers"
    figures = check_against_clean(storage, tiny_chat_model)
    record_figures("single_writer", refused_exit=4, refused_in_s=round(refused_in, 2), **figures)


def test_lock_waits_for_its_holder_only_as_long_as_asked(tmp_path):
    from batchgen.runner.files.lock import JobLock, JobLocked

    path = tmp_path / "batches" / "job.lock"
    holder = JobLock(path)
    holder.acquire()
    t0 = time.monotonic()
    with pytest.raises(JobLocked, match="already running") as refused:
        JobLock(path).acquire()
    assert time.monotonic() - t0 < 1.0 and "after waiting" not in str(refused.value)
    t0 = time.monotonic()
    with pytest.raises(JobLocked, match="after waiting 0.6 s") as refused:
        JobLock(path).acquire(wait_s=0.6)
    assert 0.6 <= time.monotonic() - t0 < 3.0
    assert f"pid {__import__('os').getpid()}" in str(refused.value)

    threading.Timer(0.8, holder.release).start()
    waiter = JobLock(path)
    t0 = time.monotonic()
    waiter.acquire(wait_s=30)
    assert 0.7 <= time.monotonic() - t0 < 5.0, "took the lock once its holder let go"
    waiter.release()


def test_wait_for_lock_flag_is_validated():
    from batchgen.config import ConfigError, StorageConfig

    with pytest.raises(ConfigError, match="wait_for_lock|wait-for-lock"):
        StorageConfig(input="x.jsonl", wait_for_lock=-1).validate()


@pytest.mark.slow
def test_run_waits_for_a_live_run_then_completes(tmp_path, tiny_chat_model):
    """--wait-for-lock: a run started while another holds the job lock waits for it (a
    requeued job overlapping the old run's flush), then runs the job to the same results; a
    shorter wait still ends in exit 4, a stop signal while waiting in exit 75."""
    from batchgen.config import JobConfig, StorageConfig
    from batchgen.runner.files.lock import JobLock
    from batchgen.runner.leader.prepare import identify

    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    _, paths = identify(JobConfig(storage=StorageConfig(input=str(inp), storage_path=storage)))
    live = JobLock(paths.batch_file.with_suffix(".lock"))
    live.acquire()  # stands in for the other run
    refused = run(inp, storage, tiny_chat_model, "--wait-for-lock", "1")
    assert refused.returncode == 4 and "after waiting 1 s" in refused.stderr, \
        refused.stderr[-3000:]
    stopped, said = _launch_reading(inp, storage, tiny_chat_model, "--wait-for-lock", "300")
    assert wait_for(lambda: "waiting up to 300 s" in "".join(said), 120), "".join(said)
    stopped.send_signal(signal.SIGTERM)  # a stop while waiting: requeue, as at any other time
    assert stopped.wait(60) == 75 and "Traceback" not in "".join(said), "".join(said)[-3000:]
    waiting, said = _launch_reading(inp, storage, tiny_chat_model, "--wait-for-lock", "300")
    # Released only once it waits (a loaded machine can take longer than any fixed sleep to
    # reach the lock: released before, the run never waits at all).
    assert wait_for(lambda: "waiting up to 300 s" in "".join(said), 120), "".join(said)
    time.sleep(1.0)
    assert waiting.poll() is None, "it waits"
    assert not list((storage / "logs").glob("*/*/attempt_*")), "no worker before the lock"
    live.release()
    assert waiting.wait(300) == 0, "".join(said)[-3000:]
    check_against_clean(storage, tiny_chat_model)


def _launch_reading(inp, storage, model, *extra):
    """A run in the background, and the list its stderr lines are appended to as they come."""
    proc = launch(inp, storage, model, *extra)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")),
                     daemon=True).start()
    return proc, lines


def test_finished_ids_are_read_once_the_results_lock_is_ours(tmp_path):
    """A worker waits for a results file another live writer still holds; what that writer
    finishes meanwhile must count as done (read before the lock, it was computed again)."""
    import fcntl
    import os
    import threading

    from batchgen.io.jobfiles import JobPaths
    from batchgen.runner.worker.worker import open_results

    paths = JobPaths.for_job(tmp_path, "batch_x")
    target = paths.incremental(0, 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other live writer, as IncrementalWriter locks
    opened = {}
    waiter = threading.Thread(target=lambda: opened.update(
        zip(("writer", "done"), open_results(paths, 0, 1, wait_s=30))))
    waiter.start()
    time.sleep(0.5)  # the waiter retries the lock every 0.2 s
    assert waiter.is_alive()
    os.write(fd, b'{"id": "batch_req_x", "custom_id": "finished-while-we-waited", '
                 b'"response": {"status_code": 200, "body": {}}, "error": null}\n')
    os.close(fd)  # releases the lock
    waiter.join(timeout=30)
    assert "finished-while-we-waited" in opened["done"]
    opened["writer"].close()


def test_a_worker_refused_by_the_results_lock_is_reported_as_such(tmp_path):
    """Exit 4 from a worker is another live process, not a crash with retries in isolation."""
    from types import SimpleNamespace

    from batchgen.io.jobfiles import JobPaths
    from batchgen.runner.exits import ExitCode
    from batchgen.runner.leader.launch import WorkerFailure
    from batchgen.runner.leader.failures import failure_cause

    said = "/x/batch_1.jsonl is in use by another live batchgen process"
    paths = JobPaths.for_job(tmp_path, "batch_1")
    paths.make_dirs()
    paths.batch_file.with_name("batch_1.worker0.json").write_text(
        f'{{"rank": 0, "failure": "{said}"}}')
    spec = SimpleNamespace(batch_id="batch_1", paths=paths)
    cause = failure_cause(spec, WorkerFailure(0, ExitCode.LOCKED, ""))
    assert said in cause and "stop the other process" in cause and "crashed" not in cause

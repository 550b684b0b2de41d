"""Single writer: a second live run of the same job exits at once (code 4) naming the holder."""

import socket
import time

import pytest
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
    slow = ("--watchdog-test-stuck-time", "0.2")
    first = launch(inp, storage, tiny_chat_model, *slow)
    lock = None

    def holder_named() -> bool:
        nonlocal lock
        lock = next((storage / "batches").glob("*.lock"), None)
        return lock is not None and b"pid" in lock.read_bytes()

    assert wait_for(holder_named, 120), first.communicate()[1][-3000:]
    t0 = time.monotonic()
    second = run(inp, storage, tiny_chat_model, *slow)
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

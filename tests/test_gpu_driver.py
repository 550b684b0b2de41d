"""The GPU driver's start in a background thread (batchgen/gpu_driver.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import time

import pytest

import batchgen.__main__ as entry
from batchgen import gpu_driver
from batchgen.parallel import pick_device


class SlowNvml:
    """Stands in for libnvidia-ml: its init takes a while and is recorded."""

    def __init__(self, log: list[str]):
        self.log = log

    def nvmlInit_v2(self) -> int:
        time.sleep(0.3)
        self.log.append("initialised")
        return 0


def test_pick_device_waits_for_the_drivers_start(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(gpu_driver.ctypes, "CDLL", lambda name: SlowNvml(log))
    thread = gpu_driver.start_driver_init()
    assert thread.name == gpu_driver.THREAD_NAME and thread.is_alive()
    pick_device("auto")  # must not count GPUs (or let anyone fork) while NVML starts
    assert log == ["initialised"] and not thread.is_alive()


def test_cpu_choice_does_not_wait(monkeypatch):
    release = threading.Event()

    class StuckNvml:
        def nvmlInit_v2(self) -> int:
            release.wait(10)
            return 0

    monkeypatch.setattr(gpu_driver.ctypes, "CDLL", lambda name: StuckNvml())
    thread = gpu_driver.start_driver_init()
    try:
        assert pick_device("cpu").type == "cpu" and thread.is_alive()
    finally:
        release.set()
        gpu_driver.wait_driver_init()


@pytest.mark.parametrize("library", ["libnvidia-ml-absent.so.1", ctypes.util.find_library("c")])
def test_no_driver_here_is_harmless(library):
    """No NVML library, or a library without NVML's entry point (libc): the thread just ends."""
    gpu_driver.start_driver_init(library).join(10)
    gpu_driver.wait_driver_init()
    assert not any(t.name == gpu_driver.THREAD_NAME for t in threading.enumerate())


@pytest.mark.parametrize("command,starts", [("run", True), ("bench", True), ("status", False),
                                            ("simulate", False)])
def test_run_and_bench_start_the_driver_and_bytecode_first(monkeypatch, command, starts):
    calls = []
    monkeypatch.setattr(entry, "start_driver_init", lambda: calls.append(command))
    monkeypatch.setattr(entry, "start_bytecode_compile", lambda: calls.append("bytecode"))
    for handlers in ("requeue_on_stop_signals", "ignore_stop_signals"):  # keep pytest's own
        monkeypatch.setattr(entry, handlers, lambda *args, **kwargs: None)
    monkeypatch.setattr(entry, "exit_without_teardown", sys.exit)  # not pytest's own process
    monkeypatch.setattr(sys, "argv", ["batchgen", command, "--help"])
    with pytest.raises(SystemExit) as done:
        entry.main()
    assert done.value.code == 0
    assert calls == (["bytecode", command] if starts else [])

"""Watchdog: a missed deadline (startup, step, decode step) dumps stacks, records the cause in
the batch file's health and ends the worker with exit code 70; re-running resumes."""

import json
import threading
import time

import pytest

from batchgen.testing.faults import STUCK_ENV
from test_reliability_support import (
    batch_state,
    check_against_clean,
    job_input,
    record_figures,
    run,
)

from batchgen.config import WatchdogConfig
from batchgen.runner.worker.watchdog import (
    TICK_S,
    StatsFile,
    Watchdog,
    guard_decode_steps,
    health_from_stats,
    launch_counts,
)

MARGIN_S = 1.0


def _watchdog(tmp_path, **cfg) -> tuple[Watchdog, threading.Event, list]:
    tripped, codes = threading.Event(), []

    def fake_exit(code):
        codes.append(code)
        tripped.set()

    stats = StatsFile(tmp_path / "w.worker0.json", initial={"rank": 0})
    watchdog = Watchdog(WatchdogConfig(**cfg), stats, time.time(), exit=fake_exit, backstop=False)
    return watchdog, tripped, codes


def test_a_restarted_rank_counts_on_from_its_launchs_earlier_attempt(tmp_path):
    """torchrun restarts a worker group (--max-restarts) within one launch: the new attempt's
    stats start from the file the earlier one left, so the run counts both; a file of another
    launch (or of a worker run by hand, with no launch) counts for nothing."""
    path = tmp_path / "w.worker0.json"
    earlier = StatsFile(path, initial={"launch": "1.5", **launch_counts(path, "1.5")})
    earlier.update({"completed": 4, "failed": 1, "completion_tokens": 16, "prompt_tokens": 9})
    assert launch_counts(path, "1.5") == {"completed": 4, "failed": 1, "prompt_tokens": 9,
                                          "completion_tokens": 16, "cached_tokens": 0}
    assert set(launch_counts(path, "2.5").values()) == {0}
    assert set(launch_counts(path, None).values()) == {0}
    assert set(launch_counts(tmp_path / "none.json", "1.5").values()) == {0}
    restarted = StatsFile(path, initial={"launch": "1.5", **launch_counts(path, "1.5")})
    assert restarted.counts()["completed"] == 4 and StatsFile(path).counts()["completed"] == 0


def test_missed_step_deadline_trips_within_timeout(tmp_path, capfd):
    wd, tripped, codes = _watchdog(tmp_path, watchdog_timeout=0.3)
    wd.start()
    t0 = time.monotonic()
    with wd.deadline("step"):
        assert tripped.wait(5)
    late = time.monotonic() - t0
    assert codes == [70] and 0.3 <= late <= 0.3 + TICK_S + MARGIN_S
    cause = json.loads((tmp_path / "w.worker0.json").read_text())["watchdog"]
    assert cause["deadline"] == "step" and "--watchdog-timeout" in cause["cause"]
    assert "most recent call first" in capfd.readouterr().err  # faulthandler's stack dump


def test_deadline_met_never_trips_and_times_steps(tmp_path):
    wd, tripped, _ = _watchdog(tmp_path, watchdog_timeout=0.5, decode_step_timeout=0.5)
    wd.start()
    for _ in range(5):
        with wd.deadline("step"), wd.deadline("decode_step"):
            time.sleep(0.05)
    assert not tripped.wait(0.8)
    assert wd.health()["loop_steps"] == 5 and wd.health()["max_step_seconds"] >= 0.05


def test_startup_deadline_counts_from_launch(tmp_path):
    stats = StatsFile(tmp_path / "w.worker0.json")
    codes = []
    wd = Watchdog(WatchdogConfig(startup_timeout=1.0), stats, time.time() - 0.9, exit=codes.append,
                  backstop=False)
    wd.start()
    time.sleep(0.5)
    assert codes == [70]


def test_no_watchdog_turns_every_deadline_off(tmp_path):
    wd, tripped, _ = _watchdog(tmp_path, watchdog_timeout=0.1, startup_timeout=0.1,
                               no_watchdog=True)
    wd.start()
    with wd.deadline("step"):
        assert not tripped.wait(0.5)


def test_heartbeats_are_written_while_a_step_runs_long(tmp_path):
    wd, _, _ = _watchdog(tmp_path, watchdog_heartbeat_interval=0.2)
    wd.start()
    path = tmp_path / "w.worker0.json"
    time.sleep(0.5)
    first = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads(path.read_text())["heartbeat"] > first


def test_decode_deadline_covers_queueing_and_collecting_bursts(tmp_path):
    """Queueing a burst (computing it, on a CPU) and collecting one (waiting for it, on a GPU)
    run under the decode-step deadline; the continuation queued inside a collect leaves the
    collect's deadline armed until the collect ends; a prefill step is not a decode step. The
    engine arms it through its step observer hook."""
    from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig
    from batchgen.core import Request, SamplingParams
    from batchgen.engine.engine import Engine
    from engine_utils import load_ours
    from tiny_models import save_tiny_model

    wd, _, _ = _watchdog(tmp_path, decode_step_timeout=60)
    armed = lambda: "decode_step" in wd._armed
    seen = []
    model = load_ours(save_tiny_model("llama", tmp_path / "tiny"))
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1),
                       runtime=RuntimeConfig(decode_burst_steps=2)).validate()
    engine = Engine(model, cfg)
    runner = engine.runner
    runner.overlaps_host = True  # queue each continuation inside the collect, as on a GPU
    execute, queue_burst, collect = runner.execute, runner.queue_burst, runner.collect

    def recording(name, call):
        def wrapped(*args, **kwargs):
            seen.append((name, armed()))
            return call(*args, **kwargs)
        return wrapped

    def recording_collect(burst, on_result, before_last=None):
        def last():
            before_last()
            seen.append(("continued", armed()))
        collect(burst, on_result, last if before_last else None)
        seen.append(("collect", armed()))

    runner.execute = recording("execute", execute)
    runner.queue_burst = recording("queue", queue_burst)
    runner.collect = recording_collect
    guard_decode_steps(engine, wd)
    engine.generate([Request("r", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0,
                                                            ignore_eos=True))])
    assert seen[0] == ("execute", False)  # the prefill
    assert ("queue", True) in seen and ("collect", True) in seen
    assert ("continued", True) in seen  # a continuation queued inside a collect
    assert all(flag for name, flag in seen[1:]), seen
    assert not armed()


GIL_HOLDING_HANG = """
import re, sys, time
from pathlib import Path
from batchgen.config import WatchdogConfig
from batchgen.runner.worker.watchdog import StatsFile, Watchdog

wd = Watchdog(WatchdogConfig(decode_step_timeout=0.5), StatsFile(Path(sys.argv[1])), time.time())
wd.start()
with wd.deadline("decode_step"):
    time.sleep(0.3)  # the watchdog thread sets the C timer
    print("hanging", flush=True)
    re.match(r"(a|aa)+$", "a" * 80 + "b")  # exponential backtracking in C, GIL held throughout
print("not reached", flush=True)
"""


def test_a_hang_holding_the_gil_is_ended_by_the_c_timer(tmp_path):
    """The watchdog thread cannot run while a C call holds the GIL; faulthandler's timer
    ends the process anyway, one timeout (at least BACKSTOP_MIN_S) after the deadline, with
    every thread's stack in the log."""
    import subprocess
    import sys

    from batchgen.runner.worker.watchdog import BACKSTOP_MIN_S

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", GIL_HOLDING_HANG, str(tmp_path / "w.json")],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 1 and "hanging" in proc.stdout, proc.stderr[-3000:]
    assert "not reached" not in proc.stdout
    assert "Timeout" in proc.stderr and "<string>" in proc.stderr  # the stacks, hung line too
    assert 0.5 + BACKSTOP_MIN_S <= took < 0.5 + BACKSTOP_MIN_S + 15


def test_health_from_stats_reports_the_cause():
    stats = [{"rank": 0, "heartbeat": 5.0, "max_step_seconds": 2.0, "quarantined": ["a"],
              "watchdog": {"cause": "watchdog: step exceeded 1 s"}}, {"rank": 1, "heartbeat": 7.0}]
    health = health_from_stats(stats)
    assert health["last_heartbeat"] == 7.0 and health["quarantined"] == 1
    assert health["watchdog"]["cause"].startswith("watchdog: step")


@pytest.mark.slow
def test_stuck_decode_step_trips_then_rerun_completes(tmp_path, tiny_chat_model):
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    t0 = time.monotonic()
    proc = run(inp, storage, tiny_chat_model, "--decode-step-timeout", "1",
               env={STUCK_ENV: "30"})
    took = time.monotonic() - t0
    assert proc.returncode == 70, proc.stderr[-3000:]
    assert took < 30, "the run waited for the stuck step instead of tripping"
    assert "decode_step exceeded 1 s (--decode-step-timeout)" in proc.stderr
    assert "most recent call first" in proc.stderr  # stacks, teed from the worker log
    health = batch_state(storage)["health"]
    watchdog = health["watchdog"]
    latency = watchdog["at"] - watchdog["armed_at"]
    assert 1.0 <= latency <= 1.0 + MARGIN_S
    assert health["last_exit_code"] == 70 and "decode_step" in health["last_failure"]
    run(inp, storage, tiny_chat_model, check=True)
    figures = check_against_clean(storage, tiny_chat_model)
    record_figures("watchdog_stuck_decode", exit_code=70, trip_latency_s=round(latency, 2),
                   timeout_s=1.0, **figures)


@pytest.mark.slow
def test_startup_timeout_trips_before_the_first_step(tmp_path, tiny_chat_model):
    proc = run(job_input(tmp_path), tmp_path / "s", tiny_chat_model, "--startup-timeout", "0.5")
    assert proc.returncode == 70, proc.stderr[-3000:]
    assert "startup exceeded 0.5 s (--startup-timeout)" in proc.stderr

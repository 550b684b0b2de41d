"""Worker health: a deadline on every wait (startup, scheduler step, decode step), heartbeats in
the rank's stats file, and what a missed deadline does.

A daemon thread checks the armed deadlines every TICK_S. A miss dumps every thread's stack
(faulthandler) to the worker log, writes the cause into the rank's stats file (the supervisor,
sole writer of the batch file, copies it into `health`) and ends the process with
ExitCode.WATCHDOG (70), so the job is restarted and resumes; finished lines are already durable.
The watchdog is off unless a timeout is given (the default) and --no-watchdog
turns every deadline off.

The thread needs the GIL to run, so a C call that hangs while holding it (a wedged extension)
would stall the watchdog with it. Behind the thread stands faulthandler's C timer, which runs
without the GIL: the thread keeps it set to fire one timeout (at least BACKSTOP_MIN_S) after
the earliest armed deadline. It fires only if the thread could not trip first; it dumps every
stack to the worker log and ends the process with exit code 1 (no cause can be recorded
without the GIL), which the supervisor handles as a crash: restart, resume, quarantine
suspects.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchgen.config import WatchdogConfig
from batchgen.atomic import write_json_atomic
from batchgen.runner.exits import ExitCode

log = logging.getLogger("batchgen.watchdog")
TICK_S = 0.1
CAUSE_WRITE_LIMIT_S = 10.0
"""A miss must end the process even when the disk holding the stats file hangs: faulthandler's
C timer kills us this long after the miss if recording the cause does not return."""
BACKSTOP_MIN_S = 2.0
"""Least time between a missed deadline and the C timer's exit: the thread trips first
whenever it can get the GIL at all."""
DEADLINES = {
    "startup": ("startup_timeout", "--startup-timeout"),
    "step": ("watchdog_timeout", "--watchdog-timeout"),
    "decode_step": ("decode_step_timeout", "--decode-step-timeout"),
}
"""Deadline name -> (WatchdogConfig field, flag)."""


COUNTS = ("completed", "failed", "prompt_tokens", "completion_tokens", "cached_tokens")
"""What a rank has answered in one launch of the workers (its stats file's running totals)."""


def launch_counts(path: Path, launch: str | None) -> dict[str, int]:
    """The COUNTS to start a rank's stats file from: an earlier attempt's, when that attempt
    belonged to the same launch (`launch`, the supervisor's BATCHGEN_LAUNCHED_AT: torchrun
    restarted the worker group, --max-restarts), so the run's summary and the batch file count
    what every attempt of the run answered, not the last attempt's alone; else zeros (the
    supervisor removes an earlier run's stats files before it launches)."""
    counts = dict.fromkeys(COUNTS, 0)
    try:
        earlier = orjson.loads(path.read_bytes()) if launch else None
    except (OSError, orjson.JSONDecodeError):
        earlier = None
    if isinstance(earlier, dict) and earlier.get("launch") == launch:
        counts.update({key: value for key in COUNTS
                       if isinstance(value := earlier.get(key), int) and value >= 0})
    return counts


class StatsFile:
    """The rank's stats file (batches/{batch_id}.worker{R}.json): progress from the worker loop,
    heartbeats and a failure cause from the watchdog thread. One lock keeps the two threads from
    racing on the same temp file. The file is advisory: a failed write is logged once, never
    fatal (a full disk is reported by the result writer, which is what matters)."""

    def __init__(self, path: Path, initial: dict | None = None):
        self.path = Path(path)
        self._data: dict = dict(initial or {})
        self._lock = threading.Lock()
        self._warned = False

    def update(self, fields: dict, lock_timeout: float = -1) -> bool:
        if not self._lock.acquire(timeout=lock_timeout):
            return False
        try:
            self._data.update(fields)
            self._data["heartbeat"] = time.time()
            write_json_atomic(self.path, self._data)
            return True
        except OSError as err:
            if not self._warned:
                log.warning("cannot write %s (%s); progress and health go unreported",
                            self.path, err)
                self._warned = True
            return False
        finally:
            self._lock.release()

    def counts(self) -> dict[str, int]:
        """The COUNTS the file starts from (see launch_counts)."""
        return {key: int(self._data.get(key, 0)) for key in COUNTS}


@dataclass
class Deadline:
    name: str
    seconds: float
    due: float
    """time.monotonic() value after which the deadline is missed."""
    armed_at: float
    """Unix time the wait began (startup: the launch)."""


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, stats: StatsFile, launched_at: float,
                 exit: Callable[[int], None] = os._exit, backstop: bool = True):
        self.cfg = cfg
        self.stats = stats
        self._exit = exit  # tests replace it to observe a trip without dying
        self._backstop = backstop  # the C timer (off in tests that must not die)
        self._backstop_due: float | None = None
        self._armed: dict[str, Deadline] = {}
        self._lock = threading.Lock()
        self._last_beat = 0.0
        self.last_step_s = self.max_step_s = 0.0
        self.steps = 0
        self._arm_startup(launched_at)

    def timeout(self, name: str) -> float | None:
        """The configured seconds of a deadline; None when off."""
        if self.cfg.no_watchdog:
            return None
        return getattr(self.cfg, DEADLINES[name][0])

    @property
    def heartbeat_interval(self) -> float | None:
        return None if self.cfg.no_watchdog else self.cfg.watchdog_heartbeat_interval

    def start(self) -> None:
        wanted = any(self.timeout(n) for n in DEADLINES) or self.heartbeat_interval
        if wanted:
            threading.Thread(target=self._run, name="batchgen-watchdog", daemon=True).start()

    def _arm_startup(self, launched_at: float) -> None:
        seconds = self.timeout("startup")
        if seconds:
            left = seconds - (time.time() - launched_at)
            self._armed["startup"] = Deadline("startup", seconds, time.monotonic() + left,
                                              launched_at)

    def started(self) -> None:
        """The first step is done: startup is over."""
        with self._lock:
            self._armed.pop("startup", None)

    @contextlib.contextmanager
    def deadline(self, name: str) -> Iterator[None]:
        """Arm `name`'s deadline around a wait (a no-op when it is off); steps are timed for
        health either way. Inside a wait already under `name`'s deadline it changes nothing:
        the inner wait is part of the outer one."""
        seconds = self.timeout(name)
        t0 = time.monotonic()
        with self._lock:
            nested = name in self._armed
            if seconds and not nested:
                self._armed[name] = Deadline(name, seconds, t0 + seconds, time.time())
        if nested:
            yield
            return
        try:
            yield
        finally:
            if seconds:
                with self._lock:
                    self._armed.pop(name, None)
            if name == "step":
                self._timed(time.monotonic() - t0)

    def _timed(self, seconds: float) -> None:
        self.steps += 1
        self.last_step_s = seconds
        self.max_step_s = max(self.max_step_s, seconds)

    def health(self) -> dict:
        """Step times for the stats file (the supervisor copies them into health)."""
        return {"last_step_seconds": round(self.last_step_s, 4),
                "max_step_seconds": round(self.max_step_s, 4), "loop_steps": self.steps}

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            with self._lock:
                armed = list(self._armed.values())
            missed = [d for d in armed if now > d.due]
            if missed:
                self._trip(min(missed, key=lambda d: d.due))
                return
            self._set_backstop(armed, now)
            interval = self.heartbeat_interval
            if interval and now - self._last_beat >= interval:
                self._last_beat = now
                # Idle heartbeat: shows the process alive even while one step runs long.
                self.stats.update({"heartbeat_kind": "watchdog", **self.health()}, lock_timeout=1.0)

    def _set_backstop(self, armed: list[Deadline], now: float) -> None:
        """Point faulthandler's C timer at one timeout (at least BACKSTOP_MIN_S) past the
        earliest armed deadline, or cancel it. A target a few ticks stale is still safe: a
        deadline armed since began before the earlier one was due, so it is due no later
        than that one's target, for deadlines of one kind."""
        if not self._backstop:
            return
        due = min((d.due + max(d.seconds, BACKSTOP_MIN_S) for d in armed), default=None)
        if due == self._backstop_due:
            return
        self._backstop_due = due
        if due is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            faulthandler.dump_traceback_later(max(due - now, 0.01), exit=True)

    def _trip(self, missed: Deadline) -> None:
        faulthandler.dump_traceback_later(CAUSE_WRITE_LIMIT_S, exit=True)
        _, flag = DEADLINES[missed.name]
        cause = (f"watchdog: {missed.name} exceeded {missed.seconds:g} s ({flag}) on pid "
                 f"{os.getpid()}; all threads' stacks are in this worker's log (health.worker_log)")
        log.error("%s", cause)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self.stats.update({"watchdog": {"cause": cause, "deadline": missed.name,
                                        "seconds": missed.seconds, "armed_at": missed.armed_at,
                                        "at": time.time()}}, lock_timeout=2.0)
        self._exit(ExitCode.WATCHDOG)
        faulthandler.cancel_dump_traceback_later()  # only reached when a test replaced exit


def guard_decode_steps(engine, watchdog: Watchdog, stuck_time: float = 0.0) -> None:
    """Put --decode-step-timeout around each decode iteration of the engine, through its step
    observer hook: a decode-only single step, and the queueing and collecting of decode bursts
    (queueing computes on a CPU, collecting waits on a GPU; a burst of K decode iterations is
    timed as one, with the postprocessing it overlaps and the queueing of the burst that
    follows). `stuck_time` (batchgen.testing.faults.stuck_seconds, testing only) sleeps inside
    the guarded iteration, once per decode step of a single step or a collect."""
    engine.add_step_observer(DecodeStepGuard(watchdog, stuck_time))


class DecodeStepGuard:
    """A step observer (engine.StepObserver) arming the decode-step deadline."""

    def __init__(self, watchdog: Watchdog, stuck_time: float = 0.0):
        self.watchdog = watchdog
        self.stuck_time = stuck_time

    @contextlib.contextmanager
    def __call__(self, kind: str, steps: int) -> Iterator[None]:
        if kind == "step":
            yield
            return
        with self.watchdog.deadline("decode_step"):
            if self.stuck_time and kind != "queue":
                time.sleep(self.stuck_time * steps)
            yield


def health_from_stats(stats: list[dict]) -> dict:
    """What the batch file's health section shows about the workers of the last run."""
    if not stats:
        return {}
    health: dict = {"last_heartbeat": max(s.get("heartbeat", 0) for s in stats),
                    "max_step_seconds": max(s.get("max_step_seconds", 0) for s in stats),
                    "last_step_seconds": max(s.get("last_step_seconds", 0) for s in stats)}
    quarantined = [cid for s in stats for cid in s.get("quarantined", [])]
    health["quarantined"] = len(quarantined)
    if quarantined:
        health["quarantined_ids"] = quarantined[:20]
    health["crash_suspects"] = sum(s.get("suspects", 0) for s in stats)
    tripped = [s["watchdog"] for s in stats if "watchdog" in s]
    if tripped:
        health["watchdog"] = tripped[0]
    return health

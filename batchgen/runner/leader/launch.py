"""How workers start and stop: torch.distributed's elastic launcher (torchrun's API) and the stop
signals (Slurm preemption, spot notices); a worker's own side (its stop flag, dying with the
supervisor) is in runner/worker/process.py.

Signals, end to end. The launcher's agent handles SIGTERM, SIGINT, SIGHUP, SIGQUIT and (we add
it) SIGUSR1 in the supervisor: it forwards the same signal to every worker, waits
`shutdown_timeout` seconds, SIGKILLs what is left and raises SignalException, which the
supervisor turns into exit code 75 ("requeue me"). A worker that gets a stop signal stops
admitting, flushes what is finished and exits 75; it leaves by itself after WORKER_GRACE_SHARE of
--preempt-grace whatever it is doing (finished lines are already durable), and the agent's
SIGKILL comes at AGENT_GRACE_SHARE, so the supervisor is out within the grace period.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from batchgen.config import DistConfig
from batchgen.io.jobfiles import FOLDER_MODE
from batchgen.parallel import NCCL_SAFE_ENV
from batchgen.runner.exits import STOP_SIGNALS, ExitCode  # the signals the agent forwards
from batchgen.runner.worker.process import LAUNCHED_AT_ENV, SUPERVISOR_PID_ENV

AGENT_GRACE_SHARE = 0.9
MONITOR_INTERVAL_S = 0.1
"""How often the launcher's agent looks at its workers: a worker's end (or failure) is seen at
most this late. Each look polls the processes and, on one node, reads the rendezvous state
from the local store: microseconds."""


@dataclass
class WorkerFailure(Exception):
    rank: int
    exitcode: int
    log_tail: str
    log_path: str = ""
    """The failed worker's stderr log (stack dumps of the watchdog and faulthandler land there)."""
    cause: str = ""
    """What was seen instead of an exit code (a node of the group stopped responding)."""

    def __str__(self) -> str:
        what = self.cause or f"worker rank {self.rank} exited with code {self.exitcode}"
        return f"{what}\n{self.log_tail}"


def launch_workers(dist: DistConfig, spec_file: Path, log_dir: Path, grace: float) -> None:
    """Run `python -m batchgen.runner.worker.worker_entry SPEC` on this node's ranks; raise
    WorkerFailure, or the launcher's SignalException when the supervisor got a stop signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    force_safe_env()
    quiet_signal_warnings()
    cheap_rendezvous_event_names()
    os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())
    os.environ[LAUNCHED_AT_ENV] = repr(time.time())
    per_node = dist.world_size // dist.nnodes
    log_dir.mkdir(FOLDER_MODE, parents=True, exist_ok=True)  # the job's own folders are 0750
    if dist.nnodes == 1:
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0",
                "run_id": uuid.uuid4().hex[:8]}
    else:
        rdzv = {"rdzv_backend": "static", "rdzv_endpoint": dist.dist_init_addr,
                "run_id": MULTINODE_RUN_ID, "rdzv_configs": {"rank": dist.node_rank}}
    config = LaunchConfig(**supported_launch_options(
        min_nodes=dist.nnodes, max_nodes=dist.nnodes, nproc_per_node=per_node,
        max_restarts=dist.max_restarts, monitor_interval=MONITOR_INTERVAL_S,
        logs_specs=_logs_specs(log_dir),
        **NO_LINE_PREFIX,
        signals_to_handle=",".join(STOP_SIGNALS), shutdown_timeout=agent_shutdown_timeout(grace),
        **rdzv))
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "batchgen.runner.worker.worker_entry",
                                               str(spec_file))
    except ChildFailedError as err:
        rank, failure = root_failure(err.failures)  # global rank; logs are per local rank
        log = _log_of(log_dir, failure.local_rank)
        raise WorkerFailure(rank, failure.exitcode, tail(log), str(log or "")) from None


MULTINODE_RUN_ID = "batchgen"
"""The nodes' static rendezvous id: torch's launcher keeps its keys under it in the group's
store (the leader's, which the group's own keys share)."""


def release_exit_barrier(store) -> None:
    """Let this node's launcher out of its exit barrier. Once its own ranks succeed, torch's
    agent waits there for every node's agent, up to 300 s in one C++ call that defers our stop
    signals, and a node whose ranks failed never arrives: the leader calls this when it sees a
    follower fail, so it stops and reports at once instead of minutes later. The key is the
    launcher's own (private) name; with a torch that names it otherwise the wait stays."""
    try:
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN

        store.set(f"{MULTINODE_RUN_ID}/{_TERMINAL_STATE_SYNC_ID}{_LAST_MEMBER_CHECKIN}",
                  "released")
    except Exception as err:  # noqa: BLE001 (only a shortcut: the barrier times out anyway)
        logging.getLogger("batchgen.launch").debug("could not release the exit barrier: %s",
                                                   err)


LAUNCHER_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                    "torch.distributed.elastic.multiprocessing.api")
SIGNAL_NOISE = re.compile(r"death signal|closing signal|Unable to shutdown process")


def _not_signal_noise(record: logging.LogRecord) -> bool:
    return SIGNAL_NOISE.search(record.getMessage()) is None


def quiet_signal_warnings() -> None:
    """Drop the launcher's warnings about the stop signals it forwards (received, sent, forced):
    the supervisor says what a stop means (results safe, exit 75) in one line. Idempotent."""
    for name in LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        if _not_signal_noise not in logger.filters:
            logger.addFilter(_not_signal_noise)


def _method_name(depth: int = 2) -> str:
    """torch's rendezvous `get_method_name`: the name of the function `depth` frames up."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def cheap_rendezvous_event_names() -> None:
    """torch's single-node (c10d) rendezvous names each of its ~9 start-up events by calling
    `inspect.stack()` twice, which reads every frame's source and scans every loaded module:
    0.1-0.15 s a call with torch and batchgen loaded (~1 s of each job's launch on a 2-core
    machine). The name is a frame's function name, which `sys._getframe` gives in
    microseconds. A torch without that helper is left as it is. Idempotent."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name


NO_LINE_PREFIX = {"role": "", "log_line_prefix_template": "${role_name}"}
"""Worker lines reach the console as they are (their own format names the rank), not behind
the launcher's "[default_role0]:" tag: a template that renders empty (a falsy one would mean
the default tag)."""


def supported_launch_options(**options) -> dict:
    """The options this torch's LaunchConfig knows. torch 2.11 lacks `shutdown_timeout` (the
    agent then waits its default before SIGKILL) and older ones `signals_to_handle` (SIGUSR1 is
    then not forwarded: Slurm's --signal must target SIGTERM)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    dropped = sorted(set(options) - known)
    if dropped:
        logging.getLogger("batchgen.launch").warning(
            "this torch's launcher has no %s; running without", ", ".join(dropped))
    return {k: v for k, v in options.items() if k in known}


def root_failure(failures: dict) -> tuple:
    """(global rank, ProcessFailure) of the rank that brought the group down. When one rank dies
    the agent SIGTERMs the others, which exit 75 (stopped), or die of that SIGTERM where our
    handler is not in place (seen on GPUs; likely a rank already exiting after its shard, when
    Python has restored the default handlers): those are effects, not the cause.
    Then the first to fail (the agent stamps whole seconds, so ties are common), then the
    lowest rank."""
    def stopped_by_agent(failure) -> bool:
        return failure.exitcode in (ExitCode.REQUEUE, -signal.SIGTERM)

    return min(failures.items(), key=lambda item: (stopped_by_agent(item[1]), item[1].timestamp,
                                                   item[0]))


def force_safe_env() -> None:
    """NCCL_SAFE_ENV in this process's environment (workers inherit it)."""
    os.environ.update(NCCL_SAFE_ENV)


def agent_shutdown_timeout(grace: float) -> int:
    """Whole seconds the agent waits for workers after forwarding a stop signal (it takes ints)."""
    return max(1, math.floor(grace * AGENT_GRACE_SHARE))


def is_stop_signal(err: BaseException) -> bool:
    """The launcher's agent raises SignalException after it shut the workers down on a signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(err, SignalException)


def _logs_specs(log_dir: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    return DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee=Std.ALL)


def _log_of(log_dir: Path, rank: int) -> Path | None:
    logs = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def tail(log: Path | None) -> str:
    """The last 20 lines of a worker's log, for the failure report."""
    if log is None:
        return "(no worker log found)"
    text = log.read_text(errors="replace").splitlines()[-20:]
    return f"last lines of {log}:\n" + "\n".join("  " + line for line in text)

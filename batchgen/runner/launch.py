"""Starting workers through torch.distributed's elastic launcher (torchrun's API)."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from batchgen.config import DistConfig

NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0"}
"""NVLink multicast stays off on every GPU machine we launch on (it hangs lent machines)."""


@dataclass
class WorkerFailure(Exception):
    rank: int
    exitcode: int
    log_tail: str

    def __str__(self) -> str:
        return f"worker rank {self.rank} exited with code {self.exitcode}\n{self.log_tail}"


def launch_workers(dist: DistConfig, spec_file: Path, log_dir: Path) -> None:
    """Run `python -m batchgen.runner.worker SPEC` on this node's ranks; raise WorkerFailure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["BATCHGEN_SUPERVISOR_PID"] = str(os.getpid())
    per_node = dist.world_size // dist.nnodes
    log_dir.mkdir(parents=True, exist_ok=True)
    if dist.nnodes == 1:
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex[:8])
    else:
        rdzv = dict(rdzv_backend="static", rdzv_endpoint=dist.dist_init_addr, run_id="batchgen",
                    rdzv_configs={"rank": dist.node_rank})
    config = LaunchConfig(min_nodes=dist.nnodes, max_nodes=dist.nnodes, nproc_per_node=per_node,
                          max_restarts=dist.max_restarts, monitor_interval=0.5,
                          logs_specs=_logs_specs(log_dir), **rdzv)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "batchgen.runner.worker", str(spec_file))
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        raise WorkerFailure(rank, failure.exitcode, _tail(log_dir, rank)) from None


def _logs_specs(log_dir: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    return DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee=Std.ALL)


def _tail(log_dir: Path, rank: int, lines: int = 20) -> str:
    logs = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return "(no worker log found)"
    text = logs[-1].read_text(errors="replace").splitlines()[-lines:]
    return f"last lines of {logs[-1]}:\n" + "\n".join("  " + line for line in text)

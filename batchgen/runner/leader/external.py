"""`batchgen run` started by an external launcher (torchrun, srun): this process is one rank.

The rule (docs/slurm.md): when the environment names this process's rank, `batchgen run` runs
the worker itself, in this process, instead of starting a launcher of its own. The rank is named
by
- torchrun (or any launcher that sets TORCHELASTIC_RUN_ID, or RANK + WORLD_SIZE + LOCAL_RANK
  with MASTER_ADDR), or
- srun with more than one task: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, with MASTER_ADDR
  (and MASTER_PORT, default 29500) exported by the job script, and --nnodes left at 1
  (--nnodes > 1 means one `batchgen run` per node that launches that node's ranks itself).
Global rank 0 is the leader: it alone takes the job lock, writes the batch file, and merges the
outputs once every rank reported that its shard is done (group.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from batchgen.config import ConfigError, DistConfig
from batchgen.io.jobfiles import FOLDER_MODE
from batchgen.runner.leader.launch import force_safe_env

log = logging.getLogger("batchgen")
DEFAULT_MASTER_PORT = 29500
"""torch's own default when a launcher exports MASTER_ADDR but no port."""


@dataclass(frozen=True)
class ExternalRank:
    launcher: str
    """"torchrun" or "srun": who started this process."""
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    agent_store: bool
    """torchrun's agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT (every rank is a
    client); otherwise rank 0 serves it."""
    run_key: str
    """Unique per launch attempt: keys of an earlier attempt in torchrun's long-lived store
    must not be read as this attempt's."""

    @property
    def nnodes(self) -> int:
        return max(1, self.world // max(1, self.local_world))

    def describe(self) -> str:
        return (f"started by {self.launcher} as rank {self.rank} of {self.world} (local rank "
                f"{self.local_rank}); running the worker in this process, no launcher of our own")


def external_rank(dist: DistConfig, env: dict | None = None) -> ExternalRank | None:
    """This process's rank when an external launcher started it (see the module docstring)."""
    env = os.environ if env is None else env
    master = env.get("MASTER_ADDR")
    named = all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if named and (master or "TORCHELASTIC_RUN_ID" in env):
        world = int(env["WORLD_SIZE"])
        return ExternalRank(
            "torchrun", int(env["RANK"]), world, int(env["LOCAL_RANK"]),
            int(env.get("LOCAL_WORLD_SIZE", world)), master or "localhost",
            int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            f"{env.get('TORCHELASTIC_RUN_ID', 'ext')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}")
    slurm = all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    if slurm and master and int(env["SLURM_NTASKS"]) > 1 and dist.nnodes == 1:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", 1))
        return ExternalRank(
            "srun", int(env["SLURM_PROCID"]), world, int(env["SLURM_LOCALID"]),
            world // nodes if world % nodes == 0 else world, master,
            int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)), False,
            f"slurm-{env.get('SLURM_JOB_ID', 0)}.{env.get('SLURM_STEP_ID', 0)}")
    return None


def launcher_world_size(world_size: int, nnodes: int, env: dict | None = None) -> int:
    """--world-size as the job will run it, for validating the flags before `adopt`: left out
    (1) under an external launcher, it is the launcher's (`--tensor-parallel-size 8` under
    `torchrun --nproc-per-node 8` must be checked against 8, not 1)."""
    ext = external_rank(DistConfig(nnodes=nnodes), env)
    return ext.world if ext is not None and world_size == 1 else world_size


def adopt(ext: ExternalRank, dist: DistConfig) -> DistConfig:
    """The launcher's world becomes the job's: torch's variables set for the worker (and for
    torch.distributed's env:// init), and the DistConfig the workers are handed."""
    if dist.world_size not in (1, ext.world):
        raise ConfigError("world_size", dist.world_size,
                          f"{ext.launcher} started {ext.world} ranks; leave --world-size out or "
                          f"set it to {ext.world}")
    os.environ.update({"RANK": str(ext.rank), "WORLD_SIZE": str(ext.world),
                       "LOCAL_RANK": str(ext.local_rank), "LOCAL_WORLD_SIZE": str(ext.local_world),
                       "MASTER_ADDR": ext.master_addr, "MASTER_PORT": str(ext.master_port)})
    force_safe_env()
    adopted = dataclasses.replace(dist, world_size=ext.world, nnodes=ext.nnodes,
                                  node_rank=ext.rank // max(1, ext.local_world),
                                  dist_init_addr=f"{ext.master_addr}:{ext.master_port}")
    adopted.validate()
    return adopted


def run_worker_here(spec_file: Path, log_file: Path) -> int:
    """The worker's main() in this process; its log lines also go to `log_file` (a rank that
    fails reports that file's tail to the leader)."""
    from batchgen.runner.worker import serve

    log_file.parent.mkdir(FOLDER_MODE, parents=True, exist_ok=True)  # the job's logs/: 0750
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        return serve.main([str(spec_file)])
    finally:
        root.removeHandler(handler)
        handler.close()

"""Which part of a run this process plays, and how it runs its ranks.

- alone (one node, no external launcher): the supervisor launches every rank (launch.py);
- a node of `--nnodes N`: node R's supervisor launches that node's W/N ranks; node 0 leads;
- a rank of an external torchrun / srun (external.py): it runs its one worker in-process;
  global rank 0 leads.
The leader alone takes the job lock, writes the batch file and merges the outputs; the others
hold a lock of their own (lock.py) and only write their ranks' results and stats.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from batchgen.config import DistConfig, JobConfig
from batchgen.runner.exits import ExitCode
from batchgen.runner.leader.external import ExternalRank, adopt, external_rank, run_worker_here
from batchgen.runner.leader.group import Group, GroupError, GroupTimeouts, MemberEnd, open_store
from batchgen.runner.files.job import JobSpec
from batchgen.runner.leader.launch import WorkerFailure, launch_workers, tail
from batchgen.runner.files.lock import JobLock, member_lock

log = logging.getLogger("batchgen")
SHARED_FS_WAIT_S = 60.0
"""How long a follower waits to see the leader's fresh spec file (NFS caches names ~60 s)."""


@dataclass
class Member:
    group: Group | None
    """None when this process is the whole run."""
    external: ExternalRank | None = None

    @property
    def leader(self) -> bool:
        return self.group is None or self.group.leader

    @property
    def name(self) -> str:
        return f"{self.group.kind} {self.group.member}" if self.group else "the run"

    def lock(self, spec_or_batch_file: Path) -> JobLock:
        """The job lock for the leader; a member lock (never contended by the leader) else."""
        if self.leader:
            return JobLock(spec_or_batch_file.with_suffix(".lock"))
        return member_lock(spec_or_batch_file, self.group.kind, self.group.member)

    def log_dir(self, spec: JobSpec, dist: DistConfig) -> Path:
        base = spec.paths.storage_path / "logs" / spec.batch_id
        if self.external is None and dist.nnodes > 1:
            return base / f"node{dist.node_rank}"  # each node's launcher numbers local ranks
        return base

    def run_ranks(self, spec: JobSpec, dist: DistConfig) -> None:
        """This member's ranks (`dist`: its own node rank) until their shards are done; raises
        WorkerFailure, or the launcher's SignalException after a stop signal."""
        log_dir = self.log_dir(spec, dist)
        if self.external is None:
            launch_workers(dist, spec.spec_file(), log_dir, spec.config.watchdog.preempt_grace)
            return
        log_file = log_dir / f"rank{self.external.rank}.log"
        code = run_worker_here(spec.spec_file(), log_file)
        if code != 0:
            raise WorkerFailure(self.external.rank, code, tail(log_file), str(log_file))


def member_for(config: JobConfig) -> tuple[JobConfig, Member]:
    """This process's part (see the module docstring) and the config it runs with."""
    ext = external_rank(config.dist)
    timeouts = GroupTimeouts.from_env()
    if ext is not None:
        log.info("%s", ext.describe())
        config = dataclasses.replace(config, dist=adopt(ext, config.dist))
        if ext.world == 1:
            return config, Member(None, ext)
        store = open_store(ext.master_addr, ext.master_port,
                           ext.rank == 0 and not ext.agent_store, timeouts.join_s)
        return config, Member(Group(store, ext.rank, ext.world, "rank", f"batchgen/{ext.run_key}",
                                    timeouts), ext)
    dist = config.dist
    if dist.nnodes == 1:
        return config, Member(None)
    host, _, port = dist.dist_init_addr.rpartition(":")
    store = open_store(host, int(port), dist.node_rank == 0, timeouts.join_s)
    log.info("node %d of %d: %d ranks here; node 0 (%s) leads and merges the outputs",
             dist.node_rank, dist.nnodes, dist.world_size // dist.nnodes, dist.dist_init_addr)
    return config, Member(Group(store, dist.node_rank, dist.nnodes, "node", timeouts=timeouts))


def member_failure(end: MemberEnd, config: JobConfig) -> WorkerFailure:
    """A follower's end as the leader reports it (a dead member: the first rank it ran)."""
    if end.rank >= 0:
        return WorkerFailure(end.rank, end.exitcode or end.code, end.log_tail, end.log_path,
                             end.cause)
    per_member = config.dist.world_size // config.dist.nnodes if config.dist.nnodes > 1 else 1
    first = end.member * per_member
    ranks = f"rank {first}" if per_member == 1 else f"ranks {first}-{first + per_member - 1}"
    named = re.search(rf"\b{re.escape(ranks)}\b", end.cause)  # "rank 1 stopped ...": once
    cause = end.cause if named else f"{end.cause} ({ranks})"
    return WorkerFailure(first, end.code, "(its process could not report: no log tail)", "",
                         cause)


def check_plan(config: JobConfig, spec: JobSpec, spec_bytes: bytes, who: str) -> None:
    """A follower runs the leader's spec only if its own flags are the same (node rank aside)
    and the leader's job folder is visible here (shared filesystem)."""
    differ = _differences(config, spec.config)
    if differ:
        raise GroupError(f"{who} was started with other flags than the leader: "
                         + "; ".join(differ) + ". Start every member with the same flags",
                         ExitCode.INPUT)
    deadline = time.monotonic() + SHARED_FS_WAIT_S
    path = spec.spec_file()
    while True:
        try:
            if path.read_bytes() == spec_bytes:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise GroupError(
                f"the job folder is not shared: {path} does not hold the spec the leader just "
                f"wrote (seen from {who}). Every node needs --storage-path (and "
                "--incremental-output-dir, --output) on one shared filesystem", ExitCode.INPUT)
        time.sleep(1.0)


def _differences(mine: JobConfig, theirs: JobConfig) -> list[str]:
    ours = _flat(dataclasses.asdict(mine))
    leader = _flat(dataclasses.asdict(theirs))
    ignore = {"node_rank"}
    return [f"--{k.replace('_', '-')}: leader {leader.get(k)!r}, here {ours.get(k)!r}"
            for k in sorted(set(ours) | set(leader))
            if k not in ignore and ours.get(k) != leader.get(k)]


def _flat(d: dict) -> dict:
    out = {}
    for key, value in d.items():
        out.update(_flat(value) if isinstance(value, dict) else {key: value})
    return out

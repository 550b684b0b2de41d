"""Runs over several nodes, and under an external torchrun / srun, emulated on one CPU machine:
each "node" is a `batchgen run --nnodes 2 --node-rank R` process, each srun task a process
with SLURM_* variables. One job, one record per custom_id, the answers of world size 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from job_utils import BATCHGEN
from test_reliability_support import (
    batch_state,
    check_against_clean,
    clean_input,
    incremental_ids,
    job_input,
    run_args,
    wait_for,
)

from batchgen.config import ConfigError, DistConfig
from batchgen.parallel import free_port
from batchgen.runner.leader.external import adopt, external_rank
from batchgen.runner.leader.group import (
    Group,
    GroupError,
    GroupTimeouts,
    MemberEnd,
    PlanRefused,
    open_store,
)
from batchgen.parallel import NCCL_SAFE_ENV
from batchgen.testing.faults import STUCK_ENV
from batchgen.runner.files.lock import JobLock, member_lock


def spawn(args, env=None, log: Path | None = None) -> subprocess.Popen:
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCHGEN_GROUP_DEAD_S": "10", **(env or {})}
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed by the child's exit)
    return subprocess.Popen([*BATCHGEN, *map(str, args)], stdout=out, stderr=subprocess.STDOUT,
                            text=True, env=full, cwd="/", start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    return codes


def two_nodes(inp, storage, model, tmp_path, *extra, tag="", env=None) -> list[subprocess.Popen]:
    port = free_port()
    return [spawn(run_args(inp, storage, model, "--world-size", 2, "--nnodes", 2, "--node-rank",
                           r, "--dist-init-addr", f"127.0.0.1:{port}", *extra),
                  env=env, log=tmp_path / f"node{r}{tag}.log") for r in (0, 1)]


def one_record_each(storage: Path, expected: int) -> None:
    counts = Counter(incremental_ids(storage))
    assert len(counts) == expected and set(counts.values()) == {1}


def test_two_nodes_run_one_job_like_world_size_one(tmp_path, tiny_chat_model):
    inp = clean_input(tiny_chat_model)
    storage = tmp_path / "s"
    codes = finish(two_nodes(inp, storage, tiny_chat_model, tmp_path))
    logs = [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], logs
    assert "node 0 (127.0.0.1" in logs[0] and "done:" in logs[0]
    assert "our ranks finished their shards; the leader merges" in logs[1]
    assert "done:" not in logs[1]  # node 1 never merged
    files = sorted(p.name.split(".", 1)[1] for p in (storage / "incremental").glob("*.jsonl"))
    assert files == ["rank0.jsonl", "rank1.jsonl"]
    assert {p.name for p in (storage / "logs").glob("*/*")} == {"node0", "node1"}
    assert batch_state(storage)["status"] == "completed"
    check_against_clean(storage, tiny_chat_model)


def test_an_external_ranks_log_folder_is_private(tmp_path, monkeypatch):
    """Under torchrun / srun each rank makes logs/{batch_id}/ itself: 0750, as the job's other
    folders (docs/job-files.md), whatever the umask allows."""
    from batchgen.runner.leader.external import run_worker_here
    from batchgen.runner.worker import serve

    monkeypatch.setattr(serve, "main", lambda argv: 0)
    log_file = tmp_path / "logs" / "batch_x" / "rank3.log"
    old = os.umask(0o022)
    try:
        assert run_worker_here(tmp_path / "spec.json", log_file) == 0
    finally:
        os.umask(old)
    assert log_file.parent.stat().st_mode & 0o777 == 0o750


def test_srun_tasks_are_the_ranks(tmp_path, tiny_chat_model):
    """srun with 2 tasks: each process runs its worker in-process; rank 0 merges."""
    inp, storage, port = clean_input(tiny_chat_model), tmp_path / "s", free_port()
    procs = [spawn(run_args(inp, storage, tiny_chat_model),
                   env={"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                        "SLURM_NNODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                   log=tmp_path / f"rank{r}.log") for r in (0, 1)]
    codes = finish(procs)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], logs
    assert all("started by srun as rank" in text and "no launcher of our own" in text
               for text in logs)
    assert sorted(p.name for p in (storage / "logs").glob("*/*")) == ["rank0.log", "rank1.log"]
    check_against_clean(storage, tiny_chat_model)


def test_under_torchrun(tmp_path, tiny_chat_model):
    """A real torchrun: the ranks talk through its agent's store (TORCHELASTIC_USE_AGENT_STORE)."""
    inp, storage = clean_input(tiny_chat_model), tmp_path / "s"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", "batchgen",
           *map(str, run_args(inp, storage, tiny_chat_model))]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, cwd="/",
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started by torchrun as rank 1 of 2" in proc.stderr
    check_against_clean(storage, tiny_chat_model)


def kill_worker(storage: Path, rank: int) -> int:
    """SIGKILL worker `rank` once it has written a result; its pid (from its stats file)."""
    stats = lambda: list((storage / "batches").glob(f"*.worker{rank}.json"))
    rank_file = lambda: list((storage / "incremental").glob(f"*.rank{rank}.jsonl"))
    assert wait_for(lambda: rank_file() and rank_file()[0].stat().st_size > 0 and stats(),
                    180, 0.05)
    pid = json.loads(stats()[0].read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


SLOW = {STUCK_ENV: "0.1"}
"""Every decode step sleeps 0.1 s, so a worker is still running when the test kills it."""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_follower_failing_after_the_leaders_ranks_finished_is_reported_at_once(
        tmp_path, tiny_chat_model):
    """Node 0's ranks finish their shard while node 1's still run; then node 1's worker dies.
    torch's launcher on node 0 waits in its exit barrier for node 1's launcher (which never
    comes: its ranks failed), up to 300 s with our stop signal deferred; the leader lets it out
    as soon as it sees the failure, so both nodes end (failed, naming rank 1) within seconds."""
    inp = job_input(tmp_path / "job")
    storage = tmp_path / "s"
    port = free_port()
    procs = [spawn(run_args(inp, storage, tiny_chat_model, "--world-size", 2, "--nnodes", 2,
                            "--node-rank", r, "--dist-init-addr", f"127.0.0.1:{port}"),
                   env={STUCK_ENV: "1.0"} if r else None, log=tmp_path / f"node{r}.log")
             for r in (0, 1)]
    stats = lambda: list((storage / "batches").glob("*.worker0.json"))
    assert wait_for(stats, 180, 0.05)
    leader_rank = json.loads(stats()[0].read_text())["pid"]
    assert wait_for(lambda: _gone(leader_rank), 180, 0.1), "node 0's rank never finished"
    assert procs[1].poll() is None, "node 1 ended before node 0's ranks (1 s per decode step)"
    kill_worker(storage, 1)
    killed = time.monotonic()
    codes = finish(procs, timeout=120)
    node0 = (tmp_path / "node0.log").read_text()
    assert time.monotonic() - killed < 90, node0
    assert codes[0] != 0 and codes[1] != 0, node0
    assert "worker rank 1 crashed (killed by signal 9)" in node0
    assert batch_state(storage)["status"] == "failed"


def test_killed_worker_on_node_1_fails_the_group_then_resumes(tmp_path, tiny_chat_model):
    inp = job_input(tmp_path / "job")
    storage = tmp_path / "s"
    procs = two_nodes(inp, storage, tiny_chat_model, tmp_path, env=SLOW)
    kill_worker(storage, 1)
    codes = finish(procs)
    node0 = (tmp_path / "node0.log").read_text()
    assert codes[0] != 0 and codes[1] != 0, node0
    assert "worker rank 1 crashed (killed by signal 9)" in node0
    assert "last lines of" in node0  # the dead rank's log tail
    assert batch_state(storage)["status"] == "failed"
    assert not list((storage / "outputs").glob("*.jsonl"))
    codes = finish(two_nodes(inp, storage, tiny_chat_model, tmp_path, tag="-again"))
    assert codes == [0, 0], (tmp_path / "node0-again.log").read_text()[-3000:]
    one_record_each(storage, 32)
    check_against_clean(storage, tiny_chat_model)


def test_killed_worker_of_two_ranks_on_one_node(tmp_path, tiny_chat_model):
    inp = job_input(tmp_path / "job")
    storage = tmp_path / "s"
    proc = spawn(run_args(inp, storage, tiny_chat_model, "--world-size", 2), env=SLOW,
                 log=tmp_path / "run.log")
    kill_worker(storage, 1)
    code = finish([proc])[0]
    text = (tmp_path / "run.log").read_text()
    assert code != 0 and "worker rank 1 crashed (killed by signal 9)" in text, text[-3000:]
    again = spawn(run_args(inp, storage, tiny_chat_model, "--world-size", 2),
                  log=tmp_path / "again.log")
    assert finish([again]) == [0], (tmp_path / "again.log").read_text()[-3000:]
    one_record_each(storage, 32)
    check_against_clean(storage, tiny_chat_model)


# ---- units: the launcher rule, the group protocol, the locks


def test_external_launcher_rule():
    dist = DistConfig()
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "n0", "MASTER_PORT": "29400",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    ext = external_rank(dist, torchrun)
    assert (ext.launcher, ext.rank, ext.world, ext.nnodes, ext.agent_store) == ("torchrun", 3, 16,
                                                                                2, True)
    srun = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
            "MASTER_ADDR": "n0"}
    ext = external_rank(dist, srun)
    assert (ext.launcher, ext.rank, ext.local_rank, ext.master_port, ext.agent_store) == (
        "srun", 9, 1, 29500, False)
    # One srun task per node running `--nnodes 2`: that is node mode, not an external rank.
    assert external_rank(DistConfig(world_size=16, nnodes=2), {**srun, "SLURM_NTASKS": "2"}) is None
    assert external_rank(dist, {**srun, "SLURM_NTASKS": "1"}) is None  # the batch shell
    assert external_rank(dist, {k: v for k, v in srun.items() if k != "MASTER_ADDR"}) is None
    assert external_rank(dist, {}) is None


def test_the_reported_failure_is_the_cause_not_the_ranks_the_agent_stopped():
    """Rank 1 SIGKILLed; the agent then SIGTERMs rank 0, which exits 75 or (on GPUs, seen on the
    H200 pair) dies of the SIGTERM itself, stamped in the same whole second."""
    from types import SimpleNamespace as Failure

    from batchgen.runner.leader.launch import root_failure

    for survivor in (75, -signal.SIGTERM):
        failures = {0: Failure(exitcode=survivor, timestamp=100),
                    1: Failure(exitcode=-signal.SIGKILL, timestamp=100)}
        assert root_failure(failures)[0] == 1
    crashed_first = {0: Failure(exitcode=1, timestamp=99), 1: Failure(exitcode=-9, timestamp=100)}
    assert root_failure(crashed_first)[0] == 0
    everyone_stopped = {r: Failure(exitcode=75, timestamp=100) for r in (0, 1)}
    assert root_failure(everyone_stopped)[0] == 0


def test_adopt_takes_the_launchers_world(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", *NCCL_SAFE_ENV):
        monkeypatch.setenv(key, "")  # recorded, so adopt()'s values are undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # a caller's setting never wins
    srun = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
            "MASTER_ADDR": "n0"}
    ext = external_rank(DistConfig(), srun)
    dist = adopt(ext, DistConfig(tensor_parallel_size=8))
    assert (dist.world_size, dist.nnodes, dist.node_rank, dist.dist_init_addr) == (16, 2, 1,
                                                                                  "n0:29500")
    assert os.environ["RANK"] == "9" and os.environ["LOCAL_RANK"] == "1"
    assert all(os.environ[k] == v for k, v in NCCL_SAFE_ENV.items())
    with pytest.raises(ConfigError, match="started 16 ranks"):
        adopt(ext, DistConfig(world_size=8))


def test_member_locks_never_contend_with_the_job_lock(tmp_path):
    batch_file = tmp_path / "batch_abc.json"
    job = JobLock(batch_file.with_suffix(".lock"))
    job.acquire()
    node1 = member_lock(batch_file, "node", 1)
    node1.acquire()  # node 0 holds the job lock: node 1 still starts
    assert node1.path.name == "batch_abc.node1.lock"
    with pytest.raises(RuntimeError, match="already running"):
        member_lock(batch_file, "node", 1).acquire()  # a second node 1 does not
    node1.release()
    job.release()


def group_pair(timeouts: GroupTimeouts) -> tuple[Group, Group]:
    port = free_port()
    leader = Group(open_store("127.0.0.1", port, True, 5), 0, 2, timeouts=timeouts)
    follower = Group(open_store("127.0.0.1", port, False, 5), 1, 2, timeouts=timeouts)
    return leader, follower


def test_group_plan_ready_and_ends():
    leader, follower = group_pair(GroupTimeouts(5, 5, 0.1))
    follower.start_beating()
    leader.publish("launch", spec="{}", left=3)
    assert follower.plan() == {"action": "launch", "spec": "{}", "left": 3}
    follower.ready()
    leader.wait_ready()
    follower.report(MemberEnd(1, 0))
    leader.wait_ends()
    follower.close()


def test_group_names_a_failed_member_and_a_dead_one():
    leader, follower = group_pair(GroupTimeouts(5, 0.5, 0.1))
    follower.report(MemberEnd(1, 1, rank=1, exitcode=-9, log_tail="tail"))
    with pytest.raises(GroupError, match="node 1 ended with code 1"):
        leader.wait_ends()
    assert leader.failure.exitcode == -9 and leader.failure.log_tail == "tail"
    leader, follower = group_pair(GroupTimeouts(5, 0.5, 0.1))
    follower.start_beating()
    time.sleep(0.3)
    follower.close()  # its heartbeat stops, as when its process is killed
    with pytest.raises(GroupError, match="node 1 stopped responding"):
        leader.wait_ends()
    leader, _ = group_pair(GroupTimeouts(0.5, 5, 0.1))
    with pytest.raises(PlanRefused, match="never joined"):
        leader.wait_ready()


def test_follower_sees_the_leader_vanish():
    leader, follower = group_pair(GroupTimeouts(5, 5, 0.05))
    lost: list[str] = []
    follower.start_beating(on_lost=lost.append)
    del leader  # the server lives in the leader's store object
    import gc

    gc.collect()
    assert wait_for(lambda: lost, 10, 0.05), "no loss noticed"
    with pytest.raises(GroupError, match="lost the leader"):
        follower.plan()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_wrong_flags_on_a_follower_are_refused(tmp_path, tiny_chat_model):
    """Node 1 started with another --seed: node 0 ends the run before any worker starts."""
    inp, storage, port = clean_input(tiny_chat_model), tmp_path / "s", free_port()
    procs = [spawn(run_args(inp, storage, tiny_chat_model, "--world-size", 2, "--nnodes", 2,
                            "--node-rank", r, "--dist-init-addr", f"127.0.0.1:{port}",
                            *(["--seed", "4"] if r else [])), log=tmp_path / f"node{r}.log")
             for r in (0, 1)]
    codes = finish(procs)
    node0 = (tmp_path / "node0.log").read_text()
    assert codes == [2, 2], node0
    assert "--seed: leader 3, here 4" in node0
    assert not list((storage / "incremental").glob("*.jsonl"))


def test_a_final_plan_waits_until_the_followers_read_it():
    """"done" / "abort" end the leader's process (and the store with it): it waits for a read."""
    import threading

    leader, follower = group_pair(GroupTimeouts(5, 5, 0.1))
    got: list[dict] = []
    reader = threading.Thread(target=lambda: (time.sleep(0.5), got.append(follower.plan())))
    reader.start()
    started = time.monotonic()
    leader.publish_final("abort", 10.0, code=4, reason="JobLocked: job is already running")
    assert 0.4 < time.monotonic() - started < 5
    reader.join()
    assert got == [{"action": "abort", "code": 4, "reason": "JobLocked: job is already running"}]


def test_releasing_the_exit_barrier_ends_the_launchers_wait():
    """The key release_exit_barrier sets is the one torch's agent waits on at its exit barrier
    (under the static rendezvous' prefix): a barrier for two agents that only one reaches
    returns at once instead of after its timeout."""
    from torch.distributed import HashStore, PrefixStore
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import barrier

    from batchgen.runner.leader.launch import MULTINODE_RUN_ID, release_exit_barrier

    store = HashStore()
    agent_view = PrefixStore(MULTINODE_RUN_ID, store)
    with pytest.raises(Exception):  # alone at the barrier: it times out
        barrier(agent_view, 2, _TERMINAL_STATE_SYNC_ID + "/first", barrier_timeout=0.5)
    release_exit_barrier(store)
    start = time.monotonic()
    barrier(agent_view, 2, _TERMINAL_STATE_SYNC_ID, barrier_timeout=30)
    assert time.monotonic() - start < 5

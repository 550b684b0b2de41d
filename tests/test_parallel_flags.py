"""Parallel flags as a user of torchrun / srun and of --tensor-parallel-size meets them."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

from job_utils import BATCHGEN

from batchgen.parallel import ParallelError, free_port
from batchgen.runner.exits import ExitCode
from batchgen.runner.leader.external import launcher_world_size
from batchgen.runner.worker import serve, worker

SRUN_RANK1 = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
              "SLURM_NNODES": "1", "MASTER_ADDR": "127.0.0.1"}


def test_launcher_world_size_is_the_launchers_when_world_size_is_left_out():
    assert launcher_world_size(1, 1, SRUN_RANK1) == 2
    assert launcher_world_size(2, 1, SRUN_RANK1) == 2
    assert launcher_world_size(1, 1, {}) == 1
    assert launcher_world_size(4, 1, {}) == 4
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "x"}
    assert launcher_world_size(1, 1, torchrun) == 8


def test_tensor_parallel_size_under_srun_without_world_size_is_not_refused(tmp_path):
    """docs/slurm.md: under torchrun / srun --world-size may be left out, e.g.
    `torchrun --nproc-per-node 8 -m batchgen run --input ... --tensor-parallel-size 8`.
    The flag check must use the launcher's world, not the default 1 (was: exit 2, "a divisor
    of --world-size (1)"). Rank 1 alone then gets as far as the group's store (none here)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "body": {"messages": [{"role": "user", '
                   '"content": "hi"}], "max_tokens": 2}}\n')
    env = {**os.environ, **SRUN_RANK1, "MASTER_PORT": str(free_port()),
           "BATCHGEN_GROUP_JOIN_S": "1"}
    proc = subprocess.run([*BATCHGEN, "run", "-i", str(inp), "--storage-path",
                           str(tmp_path / "s"), "--device", "cpu",
                           "--tensor-parallel-size", "2"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert "a divisor of --world-size (1)" not in proc.stderr
    assert "started by srun as rank 1 of 2" in proc.stderr
    assert "could not reach the group's store" in proc.stderr


def test_a_tensor_parallel_size_the_model_cannot_split_is_a_model_error_not_a_crash(
        monkeypatch):
    """num_attention_heads not divisible by --tensor-parallel-size, found while the worker
    builds the model: exit 5 (no crash strike, no "re-run to resume"), like any other config
    the model code does not take (was: an uncaught ParallelError, exit 1, "crashed")."""
    class Unsplittable:
        def __init__(self, *args):
            raise ParallelError("num_attention_heads (9) is not divisible by the "
                                "tensor-parallel size 2: choose --tensor-parallel-size "
                                "dividing it")

    monkeypatch.setattr(serve, "Worker", Unsplittable)
    recorded = {}
    watchdog = SimpleNamespace(stats=SimpleNamespace(update=recorded.update))
    code = serve.serve(None, worker.RankInfo(), None, watchdog)
    assert code == ExitCode.MODEL
    assert "choose --tensor-parallel-size" in recorded["failure"]


def test_a_dead_members_failure_names_its_rank_once():
    from types import SimpleNamespace

    from batchgen.runner.leader.members import member_failure

    config = SimpleNamespace(dist=SimpleNamespace(world_size=2, nnodes=2))

    def cause(text):
        end = SimpleNamespace(rank=-1, member=1, code=1, exitcode=None, log_tail="",
                              log_path="", cause=text)
        return member_failure(end, config).cause

    assert cause("rank 1 stopped responding (no heartbeat for 10 s)").count("rank 1") == 1
    assert cause("the node went away").endswith("(rank 1)")
    assert cause("rank 10 stopped").endswith("(rank 1)")

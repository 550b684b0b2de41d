"""The Slurm job scripts in jobs/, run without Slurm: stand-ins for batchgen, srun and scontrol
record what the scripts pass them, as Slurm's environment would have the scripts do."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parent.parent / "jobs"
SCRIPTS = sorted(JOBS.glob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_batch_log_needs_no_folder_slurm_would_have_to_create(script):
    """Slurm opens the batch shell's --output before the script runs and creates no folder: a
    log in a folder missing where sbatch runs fails the job before a line is written."""
    subprocess.run(["bash", "-n", str(script)], check=True)
    outputs = re.findall(r"^#SBATCH\s+(?:--output=|-o\s*)(\S+)", script.read_text(), re.M)
    assert outputs and all("/" not in out for out in outputs), outputs


def stand_ins(tmp_path: Path, code: int) -> dict[str, str]:
    """batchgen (records its arguments, exits `code`), srun (runs its command as node 0) and
    scontrol (records requeues; `show hostnames` lists two nodes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "batchgen": f'printf "%s\\n" "$@" > {tmp_path}/args\nexit {code}\n',
        "srun": 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": f'if [ "$1" = show ]; then echo node-a; echo node-b; '
                    f'else echo "$@" >> {tmp_path}/scontrol; fi\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "INPUT": "/in.jsonl",
            "STORAGE": str(tmp_path / "storage"), "TP": "2", "SLURM_JOB_ID": "41",
            "SLURM_GPUS_ON_NODE": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
            "EXTRA": "--max-tokens 7 --seed 3"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("code,requeued", [(75, True), (0, False), (5, False)])
def test_tp_and_extra_reach_batchgen_and_only_a_stop_requeues(tmp_path, script, code, requeued):
    proc = subprocess.run(["bash", str(script)], env=stand_ins(tmp_path, code), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    args = (tmp_path / "args").read_text().split("\n")
    assert args[:3] == ["run", "--input", "/in.jsonl"]
    joined = " ".join(args)
    assert "--tensor-parallel-size 2" in joined and "--max-tokens 7 --seed 3" in joined
    assert f"--storage-path {tmp_path / 'storage'}" in joined
    world = "8" if script.name == "multi_node.sbatch" else "4"
    assert f"--world-size {world}" in joined
    scontrol = tmp_path / "scontrol"
    assert (scontrol.is_file() and scontrol.read_text() == "requeue 41\n") == requeued

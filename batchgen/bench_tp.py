"""`batchgen bench --tensor-parallel-size N`: the benchmark on a tensor-parallel group of N ranks,
one process per rank, as a job's TP group runs (GPUs 0..N-1 over NCCL, or CPU processes over
gloo with --device cpu or on a machine without GPUs). bench.py calls in here with the function
each rank runs (its own one-rank benchmark), so this module never imports bench.py.

Every rank draws the whole random checkpoint with the same seed and keeps its slice, so the
group holds the one-device model's weights: in float32 on CPU its greedy tokens equal a
one-rank run's (tests/test_bench_shapes.py compares the tokens' sha256). Every rank runs the
whole workload in lockstep (the same scheduler on the same requests, as in a job); rank 0's
report is the group's. Its weight sizes, roofline and HBM bandwidth are rank 0's: the roofline
is one rank's bytes and FLOPs, so it leaves the all-reduces out.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from batchgen.parallel import ParallelError, TensorParallel, free_port, join_local_group


def bench_tensor_parallel(run_rank: Callable, cfg, work) -> dict:
    """Start the ranks, each calling `run_rank(cfg, work, tp)` (bench.bench: a module-level
    function, so it reaches the spawned processes), wait for all of them, return rank 0's report.
    A rank's exception ends the others and is raised here (torch.multiprocessing reports which
    rank and why). `cfg` is a bench.BenchConfig and `work` a bench.Workload."""
    check_group(cfg, work)
    size = cfg.tensor_parallel_size
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-tp-") as tmp:
        report_path = Path(tmp) / "report.pkl"
        torch.multiprocessing.spawn(
            _rank_main, args=(run_rank, cfg, work, free_port(), str(report_path)), nprocs=size,
            join=True)
        report = pickle.loads(report_path.read_bytes())
    kind = report["device"].split(":")[0]
    report["device"] = f"{size} x {kind} (TP {size}; sizes per rank)"
    return report


def check_group(cfg, work) -> None:
    """Refuse, before any process starts, what the group cannot run (free: meta tensors)."""
    from batchgen.models.loader import meta_model

    size = cfg.tensor_parallel_size
    if cfg.peer != "none":
        raise ValueError("--peer hf runs HF generate on the whole model in one process: use "
                         "--tensor-parallel-size 1 with it")
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {cfg.device}: with --tensor-parallel-size the ranks take "
                         "GPUs 0..N-1 (auto or cuda) or the CPU (cpu)")
    gpus = torch.cuda.device_count()
    wants_gpus = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
    if wants_gpus and gpus < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; this machine has "
                         f"{gpus} (use --device cpu for a CPU run over gloo)")
    work.validate()
    hf_config = cfg.hf_config()
    try:  # heads, MLP columns or experts not divisible by the group: say which
        meta_model(hf_config, cfg.model_config(), TensorParallel(size, 0, None))
    except ParallelError as err:
        raise ValueError(f"--shape {cfg.shape}: {err}") from err


def rank_device(cfg, rank: int) -> torch.device:
    """GPU `rank`, or the CPU with --device cpu or on a machine without GPUs (check_group
    refused a machine with some GPUs but fewer than ranks)."""
    if cfg.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _rank_main(rank: int, run_rank: Callable, cfg, work, port: int, report_path: str) -> None:
    size = cfg.tensor_parallel_size
    device = rank_device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp = join_local_group(rank, size, port, device)
    try:
        report = run_rank(replace(cfg, device=str(device)), work, tp)
        if rank == 0:
            Path(report_path).write_bytes(pickle.dumps(report))
    finally:
        torch.distributed.destroy_process_group()


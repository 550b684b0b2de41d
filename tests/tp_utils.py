"""Run a function on N CPU processes joined by gloo, as tensor-parallel ranks (test helper)."""

from __future__ import annotations

import traceback

import torch
import torch.multiprocessing as mp

from batchgen.parallel import free_port, join_local_group


def _entry(rank: int, world: int, port: int, fn, args, results):
    torch.set_num_threads(1)
    try:
        tp = join_local_group(rank, world, port, torch.device("cpu"))
        results[rank] = fn(tp, *args)
    except BaseException:
        results[rank] = RuntimeError(traceback.format_exc())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_tensor_parallel(world: int, fn, *args) -> list:
    """fn(tp, *args) on `world` ranks; its return values in rank order (exceptions re-raised)."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_entry, args=(world, free_port(), fn, args, results), nprocs=world, join=True)
        out = [results[r] for r in range(world)]
    for value in out:
        if isinstance(value, BaseException):
            raise value
    return out

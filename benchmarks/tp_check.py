"""Tensor parallel on GPUs (NCCL): tiny Llama and tiny DeepSeek (experts split across the ranks)
at TP = number of GPUs must give the one-GPU greedy tokens. Run from the repo root with
`tests/` on PYTHONPATH (it reuses the tests' tiny models):

    PYTHONPATH=tests python benchmarks/tp_check.py [--gpus 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig
from batchgen.engine.engine import Engine
from batchgen.models.loader import build_model, load_hf_config, read_safetensors
from batchgen.parallel import TensorParallel, free_port, join_local_group


def generate(folder: Path, device: torch.device, tp: TensorParallel, options=None):
    dtype = torch.float32  # bf16 partial sums round differently from one whole matmul
    model = build_model(load_hf_config(folder), read_safetensors(folder), dtype, device,
                        options, tp=tp)
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.5, host_kv_cache_size=0.5))
    engine = Engine(model, cfg.validate(), tp=tp)
    from engine_utils import greedy_requests

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 17, 64, 65, 150, 9)]
    done = engine.generate(greedy_requests(prompts, 32, ignore_eos=True))
    return [d.completions[0].token_ids for d in done]


def worker(rank: int, world: int, port: int, cases, results):
    device = device_of(rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    tp = join_local_group(rank, world, port, device)
    for name, folder, options in cases:
        results[(name, rank)] = generate(folder, device, tp, options)
    torch.distributed.destroy_process_group()


def device_of(rank: int, world: int) -> torch.device:
    """cuda:rank, or the CPU (gloo) when the machine has fewer GPUs than ranks."""
    return torch.device("cuda", rank) if torch.cuda.device_count() >= world else torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=max(2, torch.cuda.device_count()))
    gpus = parser.parse_args().gpus
    from test_deepseek import save_tiny
    from tiny_models import save_tiny_model

    root = Path(tempfile.mkdtemp())
    save_tiny(root / "ds")
    cases = [("llama", save_tiny_model("llama", root / "llama"), None),
             ("deepseek", root / "ds", None),
             ("deepseek+offload0.5", root / "ds",
              ModelConfig(enable_ep_with_offloading=True, ep_offloading_ratio=0.5))]
    single = {name: generate(folder, device_of(0, gpus), TensorParallel(), options)
              for name, folder, options in cases}
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(gpus, free_port(), cases, results), nprocs=gpus, join=True)
        results = dict(results)
    for name, _, _ in cases:
        same = [results[(name, r)] == single[name] for r in range(gpus)]
        print(f"{name:<22} TP{gpus} == one GPU: {all(same)} (per rank {same})")


if __name__ == "__main__":
    main()

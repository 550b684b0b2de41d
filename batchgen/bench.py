"""`batchgen bench`: a fixed synthetic workload on a random-init model of a real shape, through
batchgen and (with --peer hf) HF transformers `generate` on the same weights, in one process.

Prints output and total tokens/s for each, their ratio, and the fraction of the roofline
(decode reads every device weight once per step plus each sequence's KV; prefill costs
2 * active params FLOPs per token, k of E routed experts for MoE shapes), with the HBM
bandwidth measured on the spot. EOS is ignored. Shapes, random weights and HF's twin model
live in batchgen/bench_models.py.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass

import torch

from batchgen.bench_models import SHAPES, hf_config_for, hf_twin, random_model, weight_stats
from batchgen.config import EngineConfig, MemoryConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from batchgen.core import Request, SamplingParams

__all__ = ["SHAPES", "BenchConfig", "Workload", "bench", "format_table", "hf_config_for",
           "random_model"]

PEAK_BF16_FLOPS = {"cuda": 790e12, "cpu": 1e11}
"""Dense bf16 FLOP/s used for the prefill term (H200 measured; CPU a rough placeholder)."""


@dataclass(frozen=True)
class Workload:
    requests: int = 256
    input_len: int = 1000
    output_len: int = 256
    output_dist: str = "fixed"
    """fixed, or lognormal (mean output_len, capped at max_output_len)."""
    max_output_len: int = 16384
    seed: int = 0

    def lengths(self) -> list[int]:
        if self.output_dist == "fixed":
            return [self.output_len] * self.requests
        gen = torch.Generator().manual_seed(self.seed)
        sigma = 1.0
        mu = math.log(self.output_len) - sigma ** 2 / 2
        draws = torch.empty(self.requests).log_normal_(mu, sigma, generator=gen)
        return [max(1, min(self.max_output_len, int(x))) for x in draws.tolist()]

    def prompts(self, vocab: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return torch.randint(10, vocab - 10, (self.requests, self.input_len), generator=gen).tolist()


def measure_hbm_bandwidth(device: torch.device) -> float:
    """Read+write bytes/s of a large device-to-device copy."""
    if device.type != "cuda":
        return 20e9
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def roofline_seconds(stats: dict, layout, work: Workload, outputs: list[int], batch: int,
                     bandwidth: float, device: torch.device) -> float:
    """Lower bound on the job's time: prefill FLOPs at peak + decode bytes at HBM bandwidth."""
    prefill = 2 * stats["active_params"] * work.input_len * work.requests / PEAK_BF16_FLOPS[device.type]
    steps = sum(outputs) / min(batch, work.requests)
    kv_read = sum(o * (work.input_len + o / 2) for o in outputs) * layout.bytes_per_token
    return prefill + (steps * stats["device_bytes"] + kv_read) / bandwidth


def run_ours(model, tokenizer, engine_cfg: EngineConfig, work: Workload) -> dict:
    from batchgen.engine.engine import Engine

    engine = Engine(model, engine_cfg, tokenizer, ())
    prompts, outputs = work.prompts(model.config.vocab_size), work.lengths()
    sync(model)
    start = time.perf_counter()
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        engine.add_request(Request(f"b{i}", prompt, SamplingParams(
            max_tokens=out, min_tokens=out, temperature=0.0, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    sync(model)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    layout = engine.layout
    engine.close()
    return {"seconds": elapsed, "output_tokens": sum(outputs), "stats": stats,
            "layout": layout, "outputs": outputs}


def run_hf_peer(model, hf_config, work: Workload, batch: int) -> dict:
    """HF `generate` on static batches of the same requests, on our weights (`hf_twin`)."""
    device = next(model.parameters()).device
    gc.collect()  # our engine's KV pools: give their memory back before HF allocates its cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = hf_twin(model, hf_config)
    prompts, outputs = work.prompts(hf_config.vocab_size), work.lengths()
    sync(model)
    start = time.perf_counter()
    produced = 0
    for first in range(0, work.requests, batch):
        chunk = torch.tensor(prompts[first:first + batch], device=device)
        longest = max(outputs[first:first + batch])
        with torch.inference_mode():
            hf.generate(chunk, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                        pad_token_id=0, eos_token_id=None)
        produced += sum(outputs[first:first + batch])
    sync(model)
    del hf
    return {"seconds": time.perf_counter() - start, "output_tokens": produced}


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


@dataclass(frozen=True)
class BenchConfig:
    shape: str = "smollm2-135m"
    """A key of SHAPES."""
    dtype: str = "auto"
    kv_dtype: str = "auto"
    peer: str = "none"
    """none, or hf: HF `generate` on static batches of the same requests and weights."""
    peer_batch: int = 256
    max_decode_batch: int = 256
    gpu_kv_cache_size: float | None = None
    host_kv_cache_size: float | None = None
    device: str = "auto"
    enable_cuda_graph: bool = False
    fp8_weights: bool = False
    """DeepSeek shapes: FP8 e4m3 block-quantized linears and experts, as the real checkpoints
    (kept FP8 on CUDA: block-scaled GEMMs; dequantized on CPU)."""
    pre_dequantize_weights: bool = False
    """Dequantize MXFP4 (gpt-oss) or FP8 weights once at load instead of on the fly."""
    enable_ep_with_offloading: bool = False
    ep_offloading_ratio: float = 0.0
    """Share of each MoE layer's routed experts kept in pinned host memory."""
    tiny: bool = False
    """The shape's layer pattern at toy widths (bench_models.TINY): CPU smoke runs and tests."""

    def model_config(self) -> ModelConfig:
        """The options the model is built with (validated like a job's)."""
        cfg = ModelConfig(kv_dtype=self.kv_dtype, pre_dequantize_weights=self.pre_dequantize_weights,
                          enable_ep_with_offloading=self.enable_ep_with_offloading,
                          ep_offloading_ratio=self.ep_offloading_ratio)
        cfg.validate()
        return cfg


def bench(cfg: BenchConfig, work: Workload) -> dict:
    from batchgen.engine.engine import pick_device
    from batchgen.models.loader import resolve_dtype

    device = pick_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    hf_config = hf_config_for(cfg.shape, cfg.tiny, cfg.fp8_weights)
    options = cfg.model_config()
    model = random_model(hf_config, dtype, device, options)
    stats = weight_stats(model)
    engine_cfg = EngineConfig(
        model=options,
        memory=MemoryConfig(gpu_kv_cache_size=cfg.gpu_kv_cache_size,
                            host_kv_cache_size=cfg.host_kv_cache_size or 8.0),
        scheduler=SchedulerConfig(max_decode_batch=cfg.max_decode_batch),
        runtime=RuntimeConfig(cuda_graph_max_bucket_size=cfg.max_decode_batch,
                              enable_cuda_graph=cfg.enable_cuda_graph)).validate()
    ours = run_ours(model, None, engine_cfg, work)
    bandwidth = measure_hbm_bandwidth(device)
    bound = roofline_seconds(stats, ours["layout"], work, ours["outputs"], cfg.max_decode_batch,
                             bandwidth, device)
    total_in = work.requests * work.input_len
    rows = {"batchgen": {"output_tok_s": ours["output_tokens"] / ours["seconds"],
                         "total_tok_s": (ours["output_tokens"] + total_in) / ours["seconds"],
                         "seconds": ours["seconds"], "roofline_fraction": bound / ours["seconds"]}}
    if cfg.peer == "hf":
        peer = run_hf_peer(model, hf_config, work, cfg.peer_batch)
        rows["hf_generate"] = {"output_tok_s": peer["output_tokens"] / peer["seconds"],
                               "total_tok_s": (peer["output_tokens"] + total_in) / peer["seconds"],
                               "seconds": peer["seconds"]}
        rows["ratio"] = rows["batchgen"]["output_tok_s"] / rows["hf_generate"]["output_tok_s"]
    return {"config": asdict(cfg), "workload": asdict(work), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "weights": stats,
            "hbm_bytes_per_s": bandwidth, "roofline_seconds": bound, "results": rows,
            "engine_stats": {k: v for k, v in ours["stats"].items() if not isinstance(v, list)}}


def format_table(report: dict) -> str:
    w = report["weights"]
    host = f", {w['host_bytes'] / 2**30:.1f} GiB of experts in host memory" if w["host_bytes"] else ""
    header = (f"{report['config']['shape']} ({report['dtype']}): {_count(w['params'])} params "
              f"({_count(w['active_params'])} active per token), "
              f"{w['device_bytes'] / 2**30:.1f} GiB of weights on {report['device']}{host}")
    lines = [header,
             f"{'runner':<14}{'output tok/s':>14}{'total tok/s':>14}{'seconds':>10}{'roofline':>10}"]
    for name, row in report["results"].items():
        if name == "ratio":
            continue
        frac = row.get("roofline_fraction")
        lines.append(f"{name:<14}{row['output_tok_s']:>14,.1f}{row['total_tok_s']:>14,.1f}"
                     f"{row['seconds']:>10.2f}{'' if frac is None else f'{frac:>9.0%}':>10}")
    if "ratio" in report["results"]:
        lines.append(f"batchgen / hf_generate output tok/s: {report['results']['ratio']:.2f}x")
    return "\n".join(lines)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"

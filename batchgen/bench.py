"""`batchgen bench`: a fixed synthetic workload on a random-init model of a real shape, through
batchgen and (with --peer hf) HF transformers `generate` on the same weights, in one process.

Prints output and total tokens/s for each, their ratio, and the fraction of the roofline
(decode reads every weight once per step plus each sequence's KV; prefill costs 2 * params
FLOPs per token), with the HBM bandwidth measured on the spot. EOS is ignored.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from batchgen.config import (EngineConfig, MemoryConfig, ModelConfig, RuntimeConfig,
                             SchedulerConfig)
from batchgen.core import Request, SamplingParams

SHAPES = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                         hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                      hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
}
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


def hf_config_for(shape: str):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **spec)


def random_model(hf_config, dtype: torch.dtype, device: torch.device, options=None):
    """Our model with N(0, 0.02) weights drawn on the device (no checkpoint, no download)."""
    from batchgen.models.registry import model_class

    with torch.device("meta"):
        model = model_class(hf_config)(hf_config, options)
    model = model.to_empty(device=device).requires_grad_(False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.to(dtype).eval()


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


def roofline_seconds(model, layout, work: Workload, outputs: list[int], batch: int,
                     bandwidth: float, device: torch.device) -> float:
    """Lower bound on the job's time: prefill FLOPs at peak + decode bytes at HBM bandwidth."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prefill = 2 * params * work.input_len * work.requests / PEAK_BF16_FLOPS[device.type]
    steps = sum(outputs) / min(batch, work.requests)
    kv_read = sum(o * (work.input_len + o / 2) for o in outputs) * layout.bytes_per_token
    return prefill + (steps * weight_bytes + kv_read) / bandwidth


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
    """HF `generate` on static batches of the same requests, weights copied from ours."""
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.eval()
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
    dtype: str = "auto"
    kv_dtype: str = "auto"
    peer: str = "none"
    peer_batch: int = 256
    max_decode_batch: int = 256
    gpu_kv_cache_size: float | None = None
    host_kv_cache_size: float | None = None
    device: str = "auto"
    enable_cuda_graph: bool = False


def bench(cfg: BenchConfig, work: Workload) -> dict:
    from batchgen.engine.engine import pick_device
    from batchgen.models.loader import resolve_dtype

    device = pick_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    hf_config = hf_config_for(cfg.shape)
    model = random_model(hf_config, dtype, device)
    engine_cfg = EngineConfig(
        model=ModelConfig(kv_dtype=cfg.kv_dtype),
        memory=MemoryConfig(gpu_kv_cache_size=cfg.gpu_kv_cache_size,
                            host_kv_cache_size=cfg.host_kv_cache_size or 8.0),
        scheduler=SchedulerConfig(max_decode_batch=cfg.max_decode_batch),
        runtime=RuntimeConfig(cuda_graph_max_bucket_size=cfg.max_decode_batch,
                              enable_cuda_graph=cfg.enable_cuda_graph)).validate()
    ours = run_ours(model, None, engine_cfg, work)
    bandwidth = measure_hbm_bandwidth(device)
    bound = roofline_seconds(model, ours["layout"], work, ours["outputs"], cfg.max_decode_batch,
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
            "hbm_bytes_per_s": bandwidth, "roofline_seconds": bound, "results": rows,
            "engine_stats": {k: v for k, v in ours["stats"].items() if not isinstance(v, list)}}


def format_table(report: dict) -> str:
    lines = [f"{'runner':<14}{'output tok/s':>14}{'total tok/s':>14}{'seconds':>10}{'roofline':>10}"]
    for name, row in report["results"].items():
        if name == "ratio":
            continue
        frac = row.get("roofline_fraction")
        lines.append(f"{name:<14}{row['output_tok_s']:>14,.1f}{row['total_tok_s']:>14,.1f}"
                     f"{row['seconds']:>10.2f}{'' if frac is None else f'{frac:>9.0%}':>10}")
    if "ratio" in report["results"]:
        lines.append(f"batchgen / hf_generate output tok/s: {report['results']['ratio']:.2f}x")
    return "\n".join(lines)

"""`batchgen bench`'s flags: the workload and the engine settings, each one frozen dataclass.
cli.py generates the command's options from their fields and docstrings; bench.py runs them.
Light to import (torch and the model shapes load when used): `batchgen --help` reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from batchgen.core import SamplingParams


@dataclass(frozen=True)
class Workload:
    """The synthetic requests: random prompt tokens, greedy, EOS ignored."""

    requests: int = 64
    """Number of requests."""
    input_len: int = 128
    """Prompt tokens per request."""
    output_len: int = 64
    """Output tokens of every request (fixed), or the uncapped mean (lognormal)."""
    output_dist: str = "fixed"
    """fixed, or lognormal (sigma 1, uncapped mean --output-len, capped at --max-output-len)."""
    max_output_len: int = 16384
    """Cap of lognormal outputs (and max_tokens under --max-tokens-mode cap)."""
    seed: int = 0
    """Seed of the prompts and the output lengths."""
    max_tokens_mode: str = "exact"
    """exact: max_tokens = the drawn length (the scheduler knows it); cap: max_tokens =
    --max-output-len and the drawn length ends the request like an EOS."""
    shared_prefix_len: int = 0
    """The first this many of each prompt's --input-len tokens are one of --num-prefixes shared
    prefixes (drawn at random per request); the rest are the request's own."""
    num_prefixes: int = 1
    """Distinct shared prefixes."""
    n: int = 1
    """Samples per prompt (greedy, so all equal; each is computed)."""

    def validate(self) -> Workload:
        checks = [(self.requests >= 1, "--requests must be >= 1"),
                  (self.input_len >= 1, "--input-len must be >= 1"),
                  (1 <= self.output_len <= self.max_output_len,
                   "--output-len must be in [1, --max-output-len]"),
                  (self.output_dist in ("fixed", "lognormal"), "--output-dist: fixed or lognormal"),
                  (self.max_tokens_mode in ("exact", "cap"), "--max-tokens-mode: exact or cap"),
                  (0 <= self.shared_prefix_len <= self.input_len,
                   "--shared-prefix-len must be in [0, --input-len]"),
                  (self.num_prefixes >= 1, "--num-prefixes must be >= 1"),
                  (self.n >= 1, "--n must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    def lengths(self) -> list[int]:
        import torch

        if self.output_dist == "fixed":
            return [self.output_len] * self.requests
        gen = torch.Generator().manual_seed(self.seed)
        sigma = 1.0
        mu = math.log(self.output_len) - sigma ** 2 / 2  # so the uncapped mean is output_len
        draws = torch.empty(self.requests).log_normal_(mu, sigma, generator=gen)
        return [max(1, min(self.max_output_len, int(x))) for x in draws.tolist()]

    def prompts(self, vocab: int) -> list[list[int]]:
        import torch

        gen = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.requests, self.input_len)
        prompts = torch.randint(10, vocab - 10, shape, generator=gen)
        if self.shared_prefix_len:
            heads = torch.randint(10, vocab - 10, (self.num_prefixes, self.shared_prefix_len),
                                  generator=gen)
            which = torch.randint(0, self.num_prefixes, (self.requests,), generator=gen)
            prompts[:, :self.shared_prefix_len] = heads[which]
        return prompts.tolist()

    def sampling(self, length: int) -> SamplingParams:
        """Greedy, EOS ignored; the budget the scheduler sees follows `max_tokens_mode`."""
        if self.max_tokens_mode == "exact":
            return SamplingParams(max_tokens=length, min_tokens=length, temperature=0.0,
                                  ignore_eos=True, n=self.n)
        return SamplingParams(max_tokens=self.max_output_len, temperature=0.0, ignore_eos=True,
                              n=self.n)


PEERS = ("none", "hf")
"""--peer: no comparison, or transformers' `generate`."""


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark's model shape, engine settings and comparisons (the requests: Workload)."""

    shape: str = "smollm2-135m"
    """Model shape (bench_models.SHAPES): smollm2-135m, llama3-8b, llama3-70b, qwen3-8b,
    deepseek-v3-4l (37 B), gpt-oss-20b (MXFP4), qwen3-30b-a3b, mixtral-8x7b; with --mode
    embeddings: qwen3-embedding-0.6b (bench_models.EMBED_SHAPES)."""
    dtype: str = "auto"
    """Weights and activations: auto (bfloat16 on CUDA, float32 on the CPU), bfloat16,
    float16 or float32 (as `run`'s --dtype)."""
    kv_dtype: str = "auto"
    """The KV cache's dtype, as `run`'s --kv-dtype: auto (the model's), bfloat16, float16 or fp8
    (e4m3 with a scale per token and head)."""
    peer: str = "none"
    """none, or hf: HF `generate` on static batches of the same requests and weights."""
    peer_batch: int = 256
    """Requests per static batch of the HF peer's `generate`."""
    max_decode_batch: int = 256
    """Most sequences in one decode step (as `run`'s flag); also the largest captured graph."""
    max_prefill_tokens: int = 8192
    """Token budget of one packed prefill step (as `run`'s flag)."""
    initial_gpu_page_buffer: int = 32
    """Device pages reserved beyond the context when a sequence is loaded (as `run`'s flag):
    when the device pool bounds the decode batch, a smaller buffer fits more sequences."""
    gpu_kv_cache_size: float | None = None
    """Device KV pool in GB (overrides --gpu-memory-frac)."""
    host_kv_cache_size: float | None = None
    """Host KV pool in GB (default: what the workload can use, as `run` sizes it)."""
    gpu_memory_frac: float = 0.9
    """Share of device memory for weights + KV when --gpu-kv-cache-size is unset (CUDA)."""
    compare_host_tier: bool = False
    """Run the workload again with the host tier off (host pool = device pool, same device
    pool) and report both and their ratio."""
    enable_prefix_caching: bool = True
    """Share the KV of common prompt prefixes (as `run`'s flag)."""
    compare_prefix_caching: bool = False
    """Run the workload again with the prefix cache off and report both, their ratio and
    whether their tokens agree (bench_prefix.py)."""
    device: str = "auto"
    """auto (CUDA when there is one, else the CPU), cpu, cuda or cuda:N."""
    disable_cuda_graphs: bool = False
    """Decode eagerly (graphs are on by default on CUDA)."""
    cuda_graph_num_buckets: int = 16
    """Captured decode batch sizes up to --max-decode-batch."""
    decode_burst_steps: int = 8
    """Decode steps queued back to back while the running set is fixed (1: one at a time)."""
    fp8_weights: bool = False
    """FP8 e4m3 quantized linears (and DeepSeek's experts), as FP8 checkpoints ship them
    (kept FP8 on CUDA; dequantized on CPU). Not for gpt-oss (MXFP4)."""
    fp8_scales: str = "block"
    """How --fp8-weights scales them: "block" (128x128 blocks, as DeepSeek; blockwise GEMMs)
    or "tensor" (one scale per matrix, as AutoFP8 checkpoints of Llama; row-scaled GEMMs)."""
    pre_dequantize_weights: bool = False
    """Dequantize MXFP4 (gpt-oss) or FP8 weights once at load instead of on the fly."""
    enable_ep_with_offloading: bool = False
    """Keep a share of each MoE layer's routed experts in host memory (--ep-offloading-ratio),
    staged to the device when routed to (as `run`'s flag)."""
    ep_offloading_ratio: float = 0.0
    """Share of each MoE layer's routed experts kept in pinned host memory."""
    tiny: bool = False
    """The shape's layer pattern at toy widths (bench_models.TINY): CPU smoke runs and tests."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (attention heads and MLP columns; DeepSeek's routed
    experts across the ranks, i.e. EP), one process each: GPUs 0..N-1, or CPU processes over
    gloo. Every rank runs the whole workload; rank 0 reports (bench_tp.py)."""

    def model_config(self) -> ModelConfig:
        """The options the model is built with (validated like a job's, --dtype included)."""
        cfg = ModelConfig(dtype=self.dtype, kv_dtype=self.kv_dtype,
                          pre_dequantize_weights=self.pre_dequantize_weights,
                          enable_ep_with_offloading=self.enable_ep_with_offloading,
                          ep_offloading_ratio=self.ep_offloading_ratio)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """bench's own flags (the engine's are checked by engine_config, as `run` checks them):
        ValueError naming the flag and what it takes."""
        checks = [(self.peer in PEERS, f"--peer {self.peer!r}: one of {', '.join(PEERS)}"),
                  (self.peer_batch >= 1, "--peer-batch must be >= 1"),
                  (self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration for these flags (validated, bench's own flags too)."""
        self.validate()
        return EngineConfig(
            model=self.model_config(),
            memory=MemoryConfig(gpu_kv_cache_size=self.gpu_kv_cache_size,
                                host_kv_cache_size=self.host_kv_cache_size,
                                gpu_memory_frac=self.gpu_memory_frac),
            scheduler=SchedulerConfig(max_decode_batch=self.max_decode_batch,
                                      max_prefill_tokens=self.max_prefill_tokens,
                                      initial_gpu_page_buffer=self.initial_gpu_page_buffer,
                                      enable_prefix_caching=self.enable_prefix_caching),
            runtime=RuntimeConfig(device=self.device,
                                  cuda_graph_max_bucket_size=self.max_decode_batch,
                                  cuda_graph_num_buckets=self.cuda_graph_num_buckets,
                                  disable_cuda_graphs=self.disable_cuda_graphs,
                                  decode_burst_steps=self.decode_burst_steps)).validate()

    def hf_config(self):
        """The HF config of the benchmarked model (the shape, shrunk with --tiny, with its FP8
        quantization_config under --fp8-weights)."""
        from batchgen.bench_models import FP8_SCALES, hf_config_for

        if self.fp8_scales not in FP8_SCALES:
            raise ValueError(f"--fp8-scales {self.fp8_scales!r}: one of {', '.join(FP8_SCALES)}")
        if self.fp8_scales != "block" and not self.fp8_weights:
            raise ValueError(f"--fp8-scales {self.fp8_scales} describes FP8 weights: add "
                             "--fp8-weights")
        fp8 = self.fp8_scales if self.fp8_weights else None
        return hf_config_for(self.shape, self.tiny, fp8)

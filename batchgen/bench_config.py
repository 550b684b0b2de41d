"""`batchgen bench`'s flags as one frozen configuration (cli.py builds it; bench.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.bench_models import FP8_SCALES, hf_config_for
from batchgen.config import EngineConfig, MemoryConfig, ModelConfig, RuntimeConfig, SchedulerConfig


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark's model shape, engine settings and comparisons; the workload is apart
    (bench.Workload)."""

    shape: str = "smollm2-135m"
    """A key of SHAPES."""
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
    """Device KV pool in GB (overrides gpu_memory_frac)."""
    host_kv_cache_size: float | None = None
    """Host KV pool in GB (default: what the workload can use, as `run` sizes it)."""
    gpu_memory_frac: float = 0.9
    """Share of device memory for weights + KV when gpu_kv_cache_size is unset (CUDA)."""
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
    """Captured decode batch sizes up to max_decode_batch."""
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
        """The options the model is built with (validated like a job's)."""
        cfg = ModelConfig(kv_dtype=self.kv_dtype,
                          pre_dequantize_weights=self.pre_dequantize_weights,
                          enable_ep_with_offloading=self.enable_ep_with_offloading,
                          ep_offloading_ratio=self.ep_offloading_ratio)
        cfg.validate()
        return cfg

    def engine_config(self) -> EngineConfig:
        """The engine's configuration for these flags (validated)."""
        return EngineConfig(
            model=self.model_config(),
            memory=MemoryConfig(gpu_kv_cache_size=self.gpu_kv_cache_size,
                                host_kv_cache_size=self.host_kv_cache_size,
                                gpu_memory_frac=self.gpu_memory_frac),
            scheduler=SchedulerConfig(max_decode_batch=self.max_decode_batch,
                                      max_prefill_tokens=self.max_prefill_tokens,
                                      initial_gpu_page_buffer=self.initial_gpu_page_buffer,
                                      enable_prefix_caching=self.enable_prefix_caching),
            runtime=RuntimeConfig(cuda_graph_max_bucket_size=self.max_decode_batch,
                                  cuda_graph_num_buckets=self.cuda_graph_num_buckets,
                                  disable_cuda_graphs=self.disable_cuda_graphs,
                                  decode_burst_steps=self.decode_burst_steps)).validate()

    def hf_config(self):
        """The HF config of the benchmarked model (the shape, shrunk with --tiny, with its FP8
        quantization_config under --fp8-weights)."""
        if self.fp8_scales not in FP8_SCALES:
            raise ValueError(f"--fp8-scales {self.fp8_scales!r}: one of {', '.join(FP8_SCALES)}")
        if self.fp8_scales != "block" and not self.fp8_weights:
            raise ValueError(f"--fp8-scales {self.fp8_scales} describes FP8 weights: add "
                             "--fp8-weights")
        fp8 = self.fp8_scales if self.fp8_weights else None
        return hf_config_for(self.shape, self.tiny, fp8)

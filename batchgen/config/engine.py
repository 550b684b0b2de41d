"""The engine's configuration: the model, memory, scheduler and runtime settings
(`EngineConfig`), each a frozen dataclass validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from batchgen.config.base import (
    DTYPE_ALIASES, DTYPE_CHOICES, GENERATION_CONFIGS, GPU_ARCH_CHOICES, KV_DTYPE_ALIASES,
    ConfigError, read_chat_template, require)

@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """Model name (org/name, looked up under --cache-dir and the HF cache, downloaded from the
    Hub when absent: safetensors only) or a local folder or .gguf file (`./org/name` for a
    folder spelled like a Hub id). Default: the embedded SmolLM2-135M-Instruct."""
    revision: str | None = None
    """Branch, tag or commit of a Hub --model (default: main). The job's resume fingerprint
    records the commit it resolved to."""
    cache_dir: str | None = None
    """Folder holding downloaded weights: a model folder itself, or an HF hub cache
    (models--org--name/snapshots/REV/), where Hub downloads go (default: the HF cache)."""
    converted_ckpt_dir: str | None = None
    """Folder written by `batchgen convert` (or the embedded model's conversion cache); loading
    from it skips conversion. Refused if converted for another world size or tensor-parallel
    size, or to a dtype other than --dtype (a float32 folder, as every GGUF conversion is,
    loads at any --dtype)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (bfloat16 on GPU, float32 on CPU), float32|fp32|float,
    bfloat16|bf16, float16|fp16|half."""
    kv_dtype: str = "auto"
    """KV cache dtype: auto (= model dtype), bfloat16|bf16, float16|fp16, fp8_e4m3fn|fp8
    (8-bit KV with a scale per token and head: ~2x more KV, ~3% relative error per value)."""
    pre_dequantize_weights: bool = False
    """Dequantize MXFP4 routed experts to bf16 at load time (more memory, less compute)."""
    enable_ep_with_offloading: bool = False
    """Expert parallelism with a share of each rank's routed experts kept in host memory."""
    ep_offloading_ratio: float = 0.0
    """Share (0-1) of each rank's routed experts living in pinned host memory, streamed in per
    layer. Needs --enable-ep-with-offloading when > 0."""
    max_model_len: int | None = None
    """Longest context (prompt + max_tokens) of a request; above the model's own context, that
    is used (a warning says so once the model is read). A longer request becomes an error line
    naming both numbers. Memory is planned for this length.
    Default: the model's context. Also as 32k (32,000) or 32K (32,768)."""
    generation_config: str = "auto"
    """Sampling defaults of lines that leave a field out: auto (the temperature, top_p, top_k,
    min_p and repetition_penalty the model folder's generation_config.json recommends, as
    vLLM does; OpenAI's defaults for the rest), none or vllm (OpenAI's defaults only), or a
    folder whose generation_config.json is read instead of the model's."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the model's (a file, or the template text
    itself), as vLLM's: for chat lines on a model that ships none (a base model), or to fix
    one. Part of the job's fingerprint. Default: the model's own."""

    def validate(self) -> None:
        require(self.revision is None or self.model is not None, "revision", self.revision,
                 "a branch, tag or commit of a Hub --model: give it with --model org/name "
                 "(the embedded default model has no revisions)")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 self.max_model_len, "an integer >= 2 (a prompt token and an output token)")
        require(self.dtype in DTYPE_CHOICES, "dtype", self.dtype,
                 "one of " + ", ".join((*DTYPE_CHOICES, *DTYPE_ALIASES)))
        require(self.kv_dtype in set(KV_DTYPE_ALIASES.values()), "kv_dtype", self.kv_dtype,
                 "one of " + ", ".join(KV_DTYPE_ALIASES))
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # raises ConfigError naming the flag
        require(self.generation_config in GENERATION_CONFIGS
                 or (Path(self.generation_config).expanduser()
                     / "generation_config.json").is_file(),
                 "generation_config", self.generation_config,
                 "one of " + ", ".join(GENERATION_CONFIGS) + ", or a folder holding "
                 "generation_config.json")
        require(0.0 <= self.ep_offloading_ratio <= 1.0, "ep_offloading_ratio",
                 self.ep_offloading_ratio, "a ratio in [0, 1]")
        require(self.ep_offloading_ratio == 0.0 or self.enable_ep_with_offloading,
                 "ep_offloading_ratio", self.ep_offloading_ratio,
                 "values > 0 need --enable-ep-with-offloading")


@dataclass(frozen=True)
class MemoryConfig:
    host_kv_cache_size: float | None = None
    """Host KV pool in GB, exactly. Default: what the job can use (KV bytes per token x the
    requests it may hold in flight x their context), at most min(host_mem*0.9 - model_size,
    /dev/shm free). On CUDA the pool is pinned in the background: the first step never waits
    for it."""
    gpu_memory_frac: float = 0.9
    """Fraction (0-1] of device memory for weights + KV; the KV pool gets
    device_memory*(frac - 0.05) - model_size (0.05 of the device is kept for activations)."""
    gpu_kv_cache_size: float | None = None
    """Device KV pool in GB, overriding --gpu-memory-frac (on CPU it sizes the "device" pool)."""
    gpu_arch: str = "auto"
    """Device architecture hint: auto, hopper, ampere, cpu."""
    enable_hugetlbfs: bool = False
    """Back the host pool with hugetlbfs pages (needs root and reserved huge pages)."""
    fast_init: bool = False
    """Back the host pool with memfd_create + transparent huge pages (faster pinning)."""

    def validate(self) -> None:
        require(self.host_kv_cache_size is None or self.host_kv_cache_size > 0,
                 "host_kv_cache_size", self.host_kv_cache_size, "a size in GB > 0")
        require(0.0 < self.gpu_memory_frac <= 1.0, "gpu_memory_frac", self.gpu_memory_frac,
                 "a fraction in (0, 1]")
        require(self.gpu_kv_cache_size is None or self.gpu_kv_cache_size > 0,
                 "gpu_kv_cache_size", self.gpu_kv_cache_size, "a size in GB > 0")
        require(self.gpu_arch in GPU_ARCH_CHOICES, "gpu_arch", self.gpu_arch,
                 "one of " + ", ".join(GPU_ARCH_CHOICES))


EAGER_DECODE_BATCH = 256
"""--max-decode-batch where decode runs eagerly and nothing caps it."""
DEFAULT_GRAPH_BUCKET = 256
"""--cuda-graph-max-bucket-size where neither it nor --max-decode-batch is given (then also
the decode batch): W1's shape on an H200 simulates 8,325 out tok/s at 128 rows, 9,933 at 256
and 10,442 at 384; the device pool, not this cap, bounds a tighter machine."""
FOLLOWED_GRAPH_BUCKET_MAX = 1024
"""The largest graph an explicit --max-decode-batch captures by itself (a graph's logits alone
take rows x vocabulary x 4 bytes: 0.5 GB at 1,024 rows of a 128k vocabulary)."""


@dataclass(frozen=True)
class SchedulerConfig:
    initial_gpu_page_buffer: int = 32
    """Device pages (64 tokens each) reserved beyond the context when a sequence is loaded."""
    adaptive_gpu_page_buffer: bool = True
    """While other sequences wait (to be admitted, or on the host), a sequence admitted or
    loaded reserves only --extension-gpu-page-buffer pages beyond its context, so the pages
    an idle initial buffer would hold run more sequences; alone, it gets the full
    --initial-gpu-page-buffer (--no-adaptive-gpu-page-buffer: always the full one)."""
    extension_gpu_page_buffer: int = 4
    """Device pages added when a decoding sequence reaches its last page."""
    decision_frequency_pages: int = 2
    """Re-decide (load, unload, admit, evict) every this many pages of decode; must be
    <= --extension-gpu-page-buffer."""
    host_kv_watermark: float = 70.0
    """Below this host-pool usage (%), admitting new sequences wins over decode."""
    enable_prefix_caching: bool = True
    """Share the KV of common prompt prefixes: full 64-token pages are kept (on the device,
    and in the host tier once copied there by an unload; least recently used dropped first
    when room is needed) and keyed by their tokens, a request maps its longest cached prefix
    and prefills only the rest, n > 1 choices fork from one prefill, and waiting requests that
    share a prefix are admitted together (--no-enable-prefix-caching: every request prefills
    its whole prompt)."""
    enable_decode_preemption: bool = True
    """Decode may be unloaded for prefill (always on; kept for compatibility)."""
    host_kv_chunk_size: int = 8192
    """Tokens of host pages a sequence reserves at prefill (at least its prompt); it grows by
    chunks up to prompt + max_tokens."""
    enable_host_kv_eviction: bool = False
    """Deprecated and ignored: eviction is always on."""
    host_kv_eviction_watermark: float = 10.0
    """Evict (fewest decoded tokens first) when free host pages drop below this %."""
    adaptive_chunk: bool = True
    """Size the chunk from an EMA of finished decode lengths (--no-adaptive-chunk: static)."""
    adaptive_chunk_min: int = 1024
    """Lower clamp of the adaptive chunk, in tokens."""
    adaptive_chunk_max: int = 65536
    """Upper clamp of the adaptive chunk, in tokens."""
    adaptive_chunk_ema_alpha: float = 0.1
    """EMA smoothing factor in (0, 1]."""
    adaptive_chunk_multiplier: float = 1.5
    """Safety multiplier on the EMA estimate."""
    enable_prepack: bool = True
    """Pack many prompts into one varlen prefill batch (always on)."""
    max_prefill_tokens: int = 8192
    """Token budget of one packed prefill step; longer prompts are prefilled in chunks.
    Larger steps are faster on big GPUs (fewer steps, fewer host gaps): 16384 / 32768 ran
    Llama-3-8B FP8 1.5% / 2.2% faster on an H200, for ~1 / ~2 GB more activations. Also
    as 16k (16,000) or 16K (16,384)."""
    max_decode_batch: int | None = None
    """Most sequences decoded together in one step (graphs are then captured up to it, unless
    --cuda-graph-max-bucket-size says otherwise). Default: on CUDA, the largest batch
    captured in a CUDA graph (--cuda-graph-max-bucket-size, 256), because a bigger batch runs
    eagerly and the host then launches every kernel itself (SmolLM2-135M's shape on an H200:
    15,916 output tok/s eager against 155,743 in graphs, batch 256); 256 where decode runs
    eagerly anyway (CPU, --disable-cuda-graphs, expert offloading) and in `batchgen
    simulate`."""
    max_pool_size: int = 10240
    """Most live (admitted, unfinished) sequences."""
    max_intake_capacity: int = 1_000_000
    """Most requests read ahead of the scheduler (bounds memory on huge inputs): a worker
    holds at most the smaller of this and --max-pool-size, so a value above
    --max-pool-size changes nothing."""

    def with_decode_batch(self, graph_batch: int | None) -> SchedulerConfig:
        """This config with --max-decode-batch settled: as given, else `graph_batch` (the
        largest batch decode runs in a CUDA graph), else EAGER_DECODE_BATCH."""
        if self.max_decode_batch is not None:
            return self
        return replace(self, max_decode_batch=graph_batch or EAGER_DECODE_BATCH)

    def validate(self) -> None:
        positive = ("initial_gpu_page_buffer", "extension_gpu_page_buffer",
                    "decision_frequency_pages", "host_kv_chunk_size", "adaptive_chunk_min",
                    "adaptive_chunk_max", "max_prefill_tokens", "max_decode_batch",
                    "max_pool_size", "max_intake_capacity")
        for name in positive:
            value = getattr(self, name)
            if value is None and name == "max_decode_batch":
                continue
            require(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        if self.decision_frequency_pages > self.extension_gpu_page_buffer:
            raise ConfigError(
                "decision_frequency_pages", self.decision_frequency_pages,
                f"must be <= --extension-gpu-page-buffer ({self.extension_gpu_page_buffer}), "
                "or a sequence could outgrow its device pages between two decisions")
        for name in ("host_kv_watermark", "host_kv_eviction_watermark"):
            value = getattr(self, name)
            require(0.0 <= value <= 100.0, name, value, "a percentage in [0, 100]")
        require(self.adaptive_chunk_min <= self.adaptive_chunk_max, "adaptive_chunk_min",
                 self.adaptive_chunk_min,
                 f"must be <= --adaptive-chunk-max ({self.adaptive_chunk_max})")
        require(0.0 < self.adaptive_chunk_ema_alpha <= 1.0, "adaptive_chunk_ema_alpha",
                 self.adaptive_chunk_ema_alpha, "a factor in (0, 1]")
        require(self.adaptive_chunk_multiplier > 0, "adaptive_chunk_multiplier",
                 self.adaptive_chunk_multiplier, "a multiplier > 0")


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"
    """Where the model runs: auto (cuda if present), cuda, cuda:N, cpu."""
    enable_cuda_graph: bool = False
    """Capture decode in CUDA graphs (alias --enable-cuda-graphs). Graphs are already on by
    default on CUDA; the flag only states it explicitly. One graph holds the whole forward;
    BATCHGEN_SEGMENTED_GRAPH=1 in the environment captures one per model segment instead."""
    disable_cuda_graphs: bool = False
    """Run decode eagerly, without CUDA graphs (vLLM's name: --enforce-eager)."""
    cuda_graph_max_bucket_size: int | None = None
    """Largest decode batch captured in a graph; bigger batches run eagerly. Default:
    --max-decode-batch when given (at most 1024), else 256."""
    cuda_graph_num_buckets: int = 16
    """Number of captured batch sizes between 1 and the max bucket."""
    seed: int = 0
    """Job-level seed in [0, 2**63): requests without a seed get one derived from it and their
    custom_id."""
    decode_burst_steps: int = 8
    """Decode steps queued back to back while the running set is fixed: each step takes its
    input from the previous step's samples on the device, and each step's tokens are read (and
    stop conditions checked) as soon as that step ends, while the burst's later steps run; the
    next burst is queued before the last step ends, so the device does not wait for the host
    between bursts. A sequence that stops inside a burst discards the rest of its burst's tokens
    (wasted compute, never wrong output), so bursts shrink to 1/16 of the mean length of the
    sequences finished so far. 1 syncs after every token. Finished results reach the
    incremental file once per burst."""

    def validate(self) -> None:
        require(self.decode_burst_steps >= 1, "decode_burst_steps", self.decode_burst_steps,
                 "an integer >= 1")
        require(0 <= self.seed < 2**63, "seed", self.seed, "an integer in [0, 2**63)")
        if self.enable_cuda_graph and self.disable_cuda_graphs:
            raise ConfigError(
                "disable_cuda_graphs", True,
                "--enable-cuda-graph and --disable-cuda-graphs are mutually exclusive")
        require(self.cuda_graph_max_bucket_size is None or self.cuda_graph_max_bucket_size >= 1,
                 "cuda_graph_max_bucket_size", self.cuda_graph_max_bucket_size,
                 "an integer >= 1")
        require(self.cuda_graph_num_buckets >= 1, "cuda_graph_num_buckets",
                 self.cuda_graph_num_buckets, "an integer >= 1")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device",
                 self.device, "auto, cpu, cuda or cuda:N (N: the GPU's index, e.g. cuda:0)")

    @property
    def use_cuda_graphs(self) -> bool:
        return not self.disable_cuda_graphs


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs: model, memory, scheduler and runtime settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self):
        # The graphs follow an explicit --max-decode-batch: a decode batch above the largest
        # graph runs eagerly, several times slower.
        if self.runtime.cuda_graph_max_bucket_size is None:
            wanted = self.scheduler.max_decode_batch
            bucket = (min(wanted, FOLLOWED_GRAPH_BUCKET_MAX) if wanted is not None
                      else DEFAULT_GRAPH_BUCKET)
            object.__setattr__(self, "runtime",
                               replace(self.runtime, cuda_graph_max_bucket_size=bucket))

    def validate(self) -> "EngineConfig":
        for part in (self.model, self.memory, self.scheduler, self.runtime):
            part.validate()
        return self

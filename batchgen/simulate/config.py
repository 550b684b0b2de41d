"""`batchgen simulate`'s inputs: the hardware, model and workload to simulate, and the cost model
and pool sizes they give."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace

import numpy as np

from batchgen.config import canonical_kv_dtype
from batchgen.core import PAGE_SIZE
from batchgen.simulate.cost_model import (
    ACTIVATION_RESERVE, KV_BYTES_PER_VALUE, PRESETS, CostModel, Hardware)


@dataclass(frozen=True)
class SimulationConfig:
    model: str = "llama3-8b"
    """Model shape preset: llama3-8b, deepseek-r1 or smollm2-135m."""
    active_params: float | None = None
    """Override: parameters each token multiplies through (FLOPs = 2 * this per token)."""
    total_params: float | None = None
    """Override: all parameters (weight bytes = this * bytes per parameter)."""
    weight_bytes_per_param: float | None = None
    """Override: 2 for bf16 weights, 1 for fp8."""
    kv_bytes_per_token: float | None = None
    """Override: bytes of one token's KV over all layers (one copy); default from the preset
    and --kv-dtype."""
    kv_dtype: str = "bfloat16"
    """KV storage dtype: bfloat16, float16 or fp8_e4m3fn (aliases as in `batchgen run`)."""
    world_size: int = 1
    """GPUs in all; data-parallel replicas = world_size / tensor_parallel, each with its own
    scheduler and an equal contiguous share of the requests, split as `batchgen run` splits a
    job (requests sharing a prefix together)."""
    tensor_parallel: int = 1
    """GPUs per replica (weights and compute split over them; 2 all-reduces per layer)."""
    nnodes: int = 1
    """Nodes the world_size GPUs sit on (world_size / nnodes each). A TP group fits in one node
    or spans whole nodes; spanning ones all-reduce over the network too."""
    interconnect_gbps: float = 300.0
    """All-reduce bus bandwidth between TP ranks inside a node, GB/s (NCCL on H200 NVLink:
    ~300)."""
    allreduce_latency_us: float = 45.0
    """Fixed cost of one all-reduce inside a node (NCCL, 1 MiB on H200: 44 us)."""
    network_gbps: float = 40.0
    """All-reduce bandwidth per GPU between nodes, GB/s (one 400 Gb/s NIC per GPU, achieved)."""
    network_latency_us: float = 60.0
    """Extra fixed cost of an all-reduce that crosses nodes, us."""
    gpu_memory_gb: float = 150.0
    """Memory of one GPU in GB (an H200 reports 139.8 GiB = 150 GB)."""
    gpu_memory_frac: float = 0.9
    """As --gpu-memory-frac: device KV per GPU = memory * (frac - 0.05) - weights / TP."""
    device_kv_gb: float | None = None
    """Device KV pool per GPU in GB, overriding the formula above."""
    host_kv_gb: float = 200.0
    """Host KV pool of one replica in GB (one copy of each sequence's KV)."""
    pcie_gbps: float = 55.0
    """Host<->device bandwidth of each GPU, per direction, GB/s (pinned H200: 55)."""
    gpu_tflops: float = 600.0
    """Achieved dense FLOP/s of one GPU, in TFLOP/s (H200 matmul measured: 790 bf16, 1318 fp8)."""
    hbm_gbps: float = 3600.0
    """Achieved HBM read bandwidth of one GPU, GB/s (H200 copy: ~4300)."""
    transfer_overlap: float = 0.5
    """Share of a step's forward that host<->device copies can hide under (0: serial)."""
    step_overhead_ms: float = 0.5
    """Fixed host-side cost of one step (scheduling, launches), ms."""
    num_requests: int = 1000
    """Requests to generate (ignored with requests_file)."""
    prompt_len: str = "fixed:512"
    """Prompt length distribution: fixed:N, uniform:min=A,max=B, lognormal:mean=M,sigma=S,max=X."""
    output_len: str = "lognormal:mean=2048,sigma=1.0,max=16384"
    """Output length distribution (same forms); a sequence emits EOS after this many tokens."""
    max_tokens: int | None = None
    """max_tokens of every request (the scheduler's budget); default: the output maximum."""
    requests_file: str | None = None
    """JSONL of requests with "prompt_tokens" and "output_tokens" (and optional "max_tokens")."""
    shared_prefix_len: int = 0
    """Leading prompt tokens that are one of --num-prefixes shared prefixes (a system prompt,
    few-shot examples), picked at random per request; the prefix cache then reuses their KV
    (--no-enable-prefix-caching: computed again for every request). Prompts shorter than it are
    all prefix."""
    num_prefixes: int = 1
    """Distinct shared prefixes (with --shared-prefix-len)."""
    seed: int = 0
    """Seed of the length sampling (and of the prefix each request gets)."""
    timeline_points: int = 400
    """Samples in the result's timeline."""
    fast_forward: bool = True
    """Apply runs of decode steps between decisions at once (same result, much faster)."""

    def validate(self) -> SimulationConfig:
        tp, nodes = max(1, self.tensor_parallel), max(1, self.nnodes)  # checked first
        checks = [
            (self.model in PRESETS, f"--shape must be one of {', '.join(PRESETS)}"),
            (self.world_size >= 1 and self.tensor_parallel >= 1,
             "--world-size and --tensor-parallel-size must be >= 1"),
            (self.world_size % tp == 0, f"--world-size ({self.world_size}) must be a multiple "
             f"of --tensor-parallel-size ({self.tensor_parallel})"),
            (self.nnodes >= 1 and self.world_size % nodes == 0,
             f"--world-size ({self.world_size}) must be a multiple of --nnodes ({self.nnodes})"),
            (_tp_fits(tp, max(1, self.world_size // nodes)),
             "--tensor-parallel-size: a TP group must fit in one node or span whole nodes"),
            (0.0 <= self.transfer_overlap <= 1.0, "--transfer-overlap must be in [0, 1]"),
            (min(self.pcie_gbps, self.gpu_tflops, self.hbm_gbps, self.interconnect_gbps,
                 self.network_gbps, self.host_kv_gb, self.gpu_memory_gb) > 0,
             "--pcie-gbps, --gpu-tflops, --hbm-gbps, --interconnect-gbps, --network-gbps, "
             "--host-kv-cache-size and --gpu-memory-gb must be > 0"),
            (0.0 < self.gpu_memory_frac <= 1.0, "--gpu-memory-frac must be in (0, 1]"),
            (self.requests_file is not None or self.num_requests >= 1,
             "--num-requests must be >= 1"),
            (self.max_tokens is None or self.max_tokens >= 1, "--max-tokens must be >= 1"),
            (self.shared_prefix_len >= 0 and self.num_prefixes >= 1,
             "--shared-prefix-len must be >= 0 and --num-prefixes >= 1"),
            (self.seed >= 0, "--seed must be >= 0"),
            (self.timeline_points >= 1, "--timeline-points must be >= 1"),
            (min(self.allreduce_latency_us, self.network_latency_us, self.step_overhead_ms) >= 0,
             "--allreduce-latency-us, --network-latency-us and --step-overhead-ms must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_numbers()
        canonical_kv_dtype(self.kv_dtype)
        LengthDist.parse(self.prompt_len)
        LengthDist.parse(self.output_len)
        return self

    def _check_numbers(self) -> None:
        """Every float flag finite (a NaN passes any comparison check and makes every number
        of the summary NaN), and the overrides, where given, > 0."""
        for f in fields(self):
            value = getattr(self, f.name)
            flag = SIMULATE_FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number, not {value}")
            if f.name in OVERRIDES and value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0 (leave it out for its default)")


OVERRIDES = ("active_params", "total_params", "weight_bytes_per_param", "kv_bytes_per_token",
             "device_kv_gb")
"""Fields that replace a preset's or a formula's value: None, or a positive number."""
SIMULATE_FLAGS = {"model": "--shape", "tensor_parallel": "--tensor-parallel-size",
                  "host_kv_gb": "--host-kv-cache-size", "device_kv_gb": "--gpu-kv-cache-size"}
"""Fields `batchgen simulate` spells otherwise than their names (cli_options.SIMULATE_RENAMES)."""


def _tp_fits(tp: int, per_node: int) -> bool:
    return per_node >= 1 and (per_node % tp == 0 if tp <= per_node else tp % per_node == 0)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed, uniform [low, high], or lognormal clipped to high."""

    kind: str
    mean: float = 0.0
    sigma: float = 0.0
    low: int = 1
    high: int = 1

    @staticmethod
    def parse(text: str) -> LengthDist:
        kind, _, rest = text.partition(":")
        if kind == "fixed" and rest.isdigit() and int(rest) >= 1:
            return LengthDist("fixed", int(rest), 0.0, int(rest), int(rest))
        try:
            args = {k.strip(): float(v) for k, v in (p.split("=") for p in rest.split(","))}
            if kind == "uniform":
                dist = LengthDist(kind, low=int(args["min"]), high=int(args["max"]))
            elif kind == "lognormal":
                dist = LengthDist(kind, args["mean"], args["sigma"], int(args.get("min", 1)),
                                  int(args["max"]))
            else:
                raise KeyError(kind)
        except (KeyError, ValueError):
            raise ValueError(f"bad length distribution {text!r} (--prompt-len / --output-len): "
                             "use fixed:N, uniform:min=A,max=B or lognormal:mean=M,sigma=S,"
                             "max=X") from None
        if not 1 <= dist.low <= dist.high:
            raise ValueError(f"bad length distribution {text!r} (--prompt-len / --output-len): "
                             "need 1 <= min <= max")
        if kind == "lognormal" and not (0 < dist.mean < math.inf and 0 <= dist.sigma < math.inf):
            raise ValueError(f"bad length distribution {text!r} (--prompt-len / --output-len): "
                             "need mean > 0 and sigma >= 0")
        return dist

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(count, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=count)
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so the unclipped mean is `mean`
        values = np.rint(rng.lognormal(mu, self.sigma, size=count)).astype(np.int64)
        return np.clip(values, self.low, self.high)


def prefix_choices(sim: SimulationConfig, count: int) -> np.ndarray:
    """The shared prefix (0 .. num_prefixes - 1) of each of `count` requests."""
    return np.random.default_rng([sim.seed, 1]).integers(0, sim.num_prefixes, size=count)


def load_workload(sim: SimulationConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths, max_tokens) per request."""
    if sim.requests_file is not None:
        prompts, outputs, budgets = _read_requests_file(sim.requests_file, sim.max_tokens)
    else:
        rng = np.random.default_rng(sim.seed)
        prompts = LengthDist.parse(sim.prompt_len).sample(sim.num_requests, rng)
        out_dist = LengthDist.parse(sim.output_len)
        outputs = out_dist.sample(sim.num_requests, rng)
        budgets = np.full(sim.num_requests, sim.max_tokens or out_dist.high, dtype=np.int64)
    if prompts.min(initial=1) < 1 or outputs.min(initial=1) < 1:
        raise ValueError("every request needs prompt_tokens >= 1 and output_tokens >= 1")
    return prompts, np.minimum(outputs, budgets), budgets


def _read_requests_file(path: str, max_tokens: int | None):
    """(prompt lengths, output lengths, max_tokens) from --requests-file's JSONL lines
    `{"prompt_tokens", "output_tokens", "max_tokens"?}`; ValueError naming the line."""
    where = f"--requests-file {path}"
    rows = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    rows.append((int(row["prompt_tokens"]), int(row["output_tokens"]),
                                 None if row.get("max_tokens") is None
                                 else int(row["max_tokens"])))
                except (ValueError, KeyError, TypeError) as err:
                    raise ValueError(
                        f"{where}: line {number} is not a JSON object with integer "
                        f"prompt_tokens and output_tokens (max_tokens optional): {err!r}") from None
    except OSError as err:
        raise ValueError(f"{where}: cannot read it: {err.strerror or err}") from None
    if not rows:
        raise ValueError(f"{where} holds no requests")
    prompts, outputs, budgets = (np.array(column, dtype=object) for column in zip(*rows))
    default = max_tokens or int(outputs.max())
    budgets = np.array([default if b is None else b for b in budgets], dtype=np.int64)
    return prompts.astype(np.int64), outputs.astype(np.int64), budgets


def build_cost_model(sim: SimulationConfig) -> CostModel:
    """The preset's shape, with the explicit numbers of `sim` in place of its own."""
    shape = PRESETS[sim.model]
    if sim.total_params is not None:
        # Another model: its experts are unknown, so every step reads all weights (dense).
        shape = replace(shape, total_params=sim.total_params, routed_expert_params=0.0,
                        num_experts=0, experts_per_token=0,
                        active_params=min(shape.active_params, sim.total_params))
    if sim.active_params is not None:
        shape = replace(shape, active_params=sim.active_params)
    if sim.weight_bytes_per_param is not None:
        shape = replace(shape, weight_bytes_per_param=sim.weight_bytes_per_param)
    kv_bytes = sim.kv_bytes_per_token or (shape.kv_values_per_token_layer * shape.num_layers
                                          * KV_BYTES_PER_VALUE[canonical_kv_dtype(sim.kv_dtype)])
    hw = Hardware(sim.tensor_parallel, sim.gpu_tflops * 1e12, sim.hbm_gbps * 1e9,
                  sim.pcie_gbps * 1e9, sim.interconnect_gbps * 1e9, sim.allreduce_latency_us * 1e-6,
                  sim.transfer_overlap, sim.step_overhead_ms * 1e-3,
                  sim.world_size // sim.nnodes, sim.network_gbps * 1e9,
                  sim.network_latency_us * 1e-6)
    return CostModel(shape, hw, kv_bytes)


def pool_pages(sim: SimulationConfig, cost: CostModel) -> tuple[int, int]:
    """(device pages, host pages) of one replica, as the engine would size them."""
    weights_per_gpu = cost.shape.weight_bytes / sim.tensor_parallel
    device_gb = sim.device_kv_gb
    if device_gb is None:
        usable = sim.gpu_memory_gb * (sim.gpu_memory_frac - ACTIVATION_RESERVE)
        device_gb = usable - weights_per_gpu / 1e9
    device = int(device_gb * 1e9 // (PAGE_SIZE * cost.kv_bytes_per_token_gpu))
    host = int(sim.host_kv_gb * 1e9 // (PAGE_SIZE * cost.kv_bytes_per_token))
    if device < 1:
        raise ValueError(f"no device KV left: weights take {weights_per_gpu / 1e9:.1f} GB per GPU "
                         f"of {sim.gpu_memory_gb:.0f} GB; raise --tensor-parallel-size or "
                         "--gpu-kv-cache-size")
    return device, max(host, 1)

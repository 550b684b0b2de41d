"""How long one engine step takes on hardware we cannot run here: a roofline per step.

Used by `batchgen simulate` (built from its config by `config.build_cost_model`). Every count
is per replica (one scheduler, `tp` GPUs); every rate is per GPU. A step's forward is bound by
compute or by memory, whichever is slower:

    forward  = max(FLOPs / flop_rate, bytes / hbm_rate)           (per GPU, work split over TP)
    FLOPs    = 2 * active_params * tokens + attention (query, context) pairs * per-pair FLOPs
    bytes    = weights touched this step + KV read by decode and prefill attention
    comm     = 2 all-reduces per layer when tp > 1, hierarchical when the TP group spans nodes:
               NVLink part  2(g-1)/g * bytes / nvlink     (g = TP ranks per node)
               network part 2(m-1)/m * bytes/g / network  (m = nodes the group spans; each GPU
                            sends its 1/g share over its own NIC) + both latencies
    transfer = max(device->host, host->device bytes) / PCIe      (the link is full duplex)
    exposed  = max(0, transfer - overlap * forward)
    step     = forward + comm + exposed + per-step overhead

A max() rather than "prefill FLOPs/s + decode bytes/s": a mixed step reads the weights once
for its prefill and decode tokens together, so adding the two terms would count that read twice.
Transfers overlap the forward only partly (`overlap`): unloads can drain while the step runs, but
a load must land before the sequences it feeds are computed, and with layer-by-layer pipelining
only part of that wait hides behind the other sequences' work.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.core import PAGE_SIZE

ACTIVATION_RESERVE = 0.05
"""Share of device memory kept for activations (as batchgen.engine.memory.ACTIVATION_RESERVE)."""
KV_BYTES_PER_VALUE = {"bfloat16": 2.0, "float16": 2.0, "fp8_e4m3fn": 1.03, "auto": 2.0}
"""fp8 adds a float32 scale per token and head of 128 values (~3%)."""


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a step depends on; presets below, or built from explicit numbers."""

    name: str
    total_params: float
    active_params: float
    """Parameters each token multiplies through (all of them for a dense model)."""
    routed_expert_params: float
    """Parameters of all routed experts together (0 for a dense model)."""
    experts_per_token: int
    num_experts: int
    num_layers: int
    hidden_size: int
    kv_values_per_token_layer: int
    """KV values stored per token and layer: 2*kv_heads*head_dim (GQA) or latent+rope (MLA)."""
    kv_shards_over_tp: bool
    """GQA heads split over TP ranks; an MLA latent is the same on every rank (replicated)."""
    attn_flops_per_pair_layer: float
    """FLOPs for one query token against one context token in one layer (QK^T and PV)."""
    weight_bytes_per_param: float

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    def weight_bytes_touched(self, tokens: int) -> float:
        """Weights a step reads: all dense ones, and each routed expert some token picked
        (tokens route independently and uniformly: the usual balanced-router assumption)."""
        dense = self.total_params - self.routed_expert_params
        if self.num_experts == 0 or tokens == 0:
            return dense * self.weight_bytes_per_param if tokens else 0.0
        untouched = (1.0 - self.experts_per_token / self.num_experts) ** tokens
        return (dense + self.routed_expert_params * (1.0 - untouched)) * self.weight_bytes_per_param


def _gqa_attn_flops(q_heads: int, head_dim: int) -> float:
    return 4.0 * q_heads * head_dim  # 2 FLOPs per MAC, for QK^T and for PV


PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(
        "llama3-8b", 8.03e9, 8.03e9, 0.0, 0, 0, num_layers=32, hidden_size=4096,
        kv_values_per_token_layer=2 * 8 * 128, kv_shards_over_tp=True,
        attn_flops_per_pair_layer=_gqa_attn_flops(32, 128), weight_bytes_per_param=2.0),
    # 671B total / ~37B active: 58 MoE layers of 256 routed experts (top-8) of 3*7168*2048
    # parameters each (~654B); the rest (~17B) is dense. fp8 weights. MLA keeps a 512 latent +
    # 64 rope values per token and layer; decode uses the absorbed form: 128 heads each
    # doing 576 (QK) + 512 (PV) MACs per context token.
    "deepseek-r1": ModelShape(
        "deepseek-r1", 671e9, 37e9, 58 * 256 * 3 * 7168 * 2048, 8, 256, num_layers=61,
        hidden_size=7168, kv_values_per_token_layer=576, kv_shards_over_tp=False,
        attn_flops_per_pair_layer=2.0 * 128 * (576 + 512), weight_bytes_per_param=1.0),
    "smollm2-135m": ModelShape(
        "smollm2-135m", 134.5e6, 134.5e6, 0.0, 0, 0, num_layers=30, hidden_size=576,
        kv_values_per_token_layer=2 * 3 * 64, kv_shards_over_tp=True,
        attn_flops_per_pair_layer=_gqa_attn_flops(9, 64), weight_bytes_per_param=2.0),
}


@dataclass(frozen=True)
class Hardware:
    """Rates of one GPU and its links (see SimulationConfig for what each default is)."""

    tensor_parallel: int
    flops: float
    hbm_bytes_s: float
    pcie_bytes_s: float
    interconnect_bytes_s: float
    allreduce_latency_s: float
    transfer_overlap: float
    step_overhead_s: float
    gpus_per_node: int = 0
    """GPUs of one node (0: the whole TP group sits in one node)."""
    network_bytes_s: float = 0.0
    """All-reduce bus bandwidth per GPU between nodes (its NIC)."""
    network_latency_s: float = 0.0
    """Extra fixed cost of an all-reduce that crosses nodes."""

    @property
    def tp_nodes(self) -> int:
        """Nodes one TP group spans."""
        per_node = self.gpus_per_node or self.tensor_parallel
        return max(1, self.tensor_parallel // per_node)


@dataclass
class StepTime:
    total: float = 0.0
    forward: float = 0.0
    comm: float = 0.0
    transfer: float = 0.0
    """PCIe busy time (hidden or not)."""
    exposed_transfer: float = 0.0
    overhead: float = 0.0
    flops: float = 0.0
    """FLOPs per GPU."""
    hbm_bytes: float = 0.0
    """HBM bytes read per GPU."""
    transfer_bytes: float = 0.0
    """Bytes over the PCIe link of each GPU, both directions."""
    compute_bound: bool = False

    def add(self, other: StepTime) -> None:
        for name in self.__dataclass_fields__:
            if name != "compute_bound":
                setattr(self, name, getattr(self, name) + getattr(other, name))


class CostModel:
    """Step time from a step's token counts (see the module docstring for the formula)."""

    def __init__(self, shape: ModelShape, hw: Hardware, kv_bytes_per_token: float):
        self.shape = shape
        self.hw = hw
        tp = hw.tensor_parallel
        self.kv_bytes_per_token = kv_bytes_per_token
        """One copy of one token's KV, all layers (what the host pool stores)."""
        shards = tp if shape.kv_shards_over_tp else 1
        self.kv_bytes_per_token_gpu = self.kv_bytes_per_token / shards
        """What each GPU keeps of one token's KV (all of it when the latent is replicated)."""
        self._pair_flops = shape.attn_flops_per_pair_layer * shape.num_layers
        per_token, fixed = allreduce_cost(hw, shape.hidden_size * 2)  # bf16 activations
        self._comm_per_token = 2 * shape.num_layers * per_token
        self._comm_fixed = 2 * shape.num_layers * fixed

    def step(self, tokens: int, attn_pairs: float, kv_read_tokens: float,
             pages_out: int = 0, pages_in: int = 0) -> StepTime:
        """One forward over `tokens` tokens (prefill and decode together) whose attention
        covers `attn_pairs` (query, context) pairs and reads `kv_read_tokens` tokens of KV."""
        if tokens == 0 and pages_out == 0 and pages_in == 0:
            return StepTime()
        tp = self.hw.tensor_parallel
        flops = (2.0 * self.shape.active_params * tokens + self._pair_flops * attn_pairs) / tp
        hbm = (self.shape.weight_bytes_touched(tokens) / tp
               + kv_read_tokens * self.kv_bytes_per_token_gpu)
        forward = max(flops / self.hw.flops, hbm / self.hw.hbm_bytes_s) if tokens else 0.0
        comm = (self._comm_fixed + self._comm_per_token * tokens) if tokens else 0.0
        page_bytes = PAGE_SIZE * self.kv_bytes_per_token_gpu
        transfer = max(pages_out, pages_in) * page_bytes / self.hw.pcie_bytes_s
        exposed = max(0.0, transfer - self.hw.transfer_overlap * forward)
        overhead = self.hw.step_overhead_s
        return StepTime(forward + comm + exposed + overhead, forward, comm, transfer, exposed,
                        overhead, flops, hbm, (pages_out + pages_in) * page_bytes,
                        flops / self.hw.flops >= hbm / self.hw.hbm_bytes_s)

    def decode_run(self, batch: int, context_tokens: int, steps: int) -> StepTime:
        """`steps` decode steps of a fixed batch whose contexts sum to `context_tokens` at the
        first step and grow by `batch` tokens per step. Costed at the middle step: cost is
        linear in context on either side of the compute/memory crossover."""
        middle = context_tokens + batch * (steps - 1) / 2.0
        one = self.step(batch, middle, middle)
        total = StepTime()
        for name in one.__dataclass_fields__:
            if name != "compute_bound":
                setattr(total, name, getattr(one, name) * steps)
        total.compute_bound = one.compute_bound
        return total


def allreduce_cost(hw: Hardware, token_bytes: float) -> tuple[float, float]:
    """(seconds per token, fixed seconds) of one all-reduce over the TP group: NVLink inside a
    node, then the network between the nodes the group spans (module docstring)."""
    tp, nodes = hw.tensor_parallel, hw.tp_nodes
    if tp == 1:
        return 0.0, 0.0
    local = tp // nodes
    per_token = (2 * (local - 1) / local * token_bytes / hw.interconnect_bytes_s
                 if local > 1 else 0.0)
    fixed = hw.allreduce_latency_s if local > 1 else 0.0
    if nodes > 1:
        per_token += 2 * (nodes - 1) / nodes * token_bytes / local / hw.network_bytes_s
        fixed += hw.network_latency_s
    return per_token, fixed

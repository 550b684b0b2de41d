"""DeepSeek-V3 mixture of experts: grouped sigmoid routing, shared experts, expert offloading
(RoutedExperts also runs Qwen3-MoE's and Mixtral's experts: softmax_moe.py).

Shapes: T tokens, H hidden, E routed experts, k experts per token, I moe_intermediate_size.
Routed expert weights are stacked like HF's grouped layout: gate_up [E, 2I, H] (gate rows
first), down [E, H, I].

Execution: the T*k (token, expert) assignments are sorted by expert (stable), so each
expert's tokens are one contiguous run; each run goes through its expert's SwiGLU as one
grouped GEMM per projection on CUDA, or a loop over the touched experts otherwise. Outputs are
summed over k in top-k order, so the result does not depend on where an expert lives.

CUDA kernels (batchgen_kernels), chosen by `ExpertBank._grouped_path` (expert_bank.py, with
the staging slots of offloaded experts):
- routing: `deepseek_route`, one launch after the float32 router matmul (ROUTING_KERNEL);
- FP8 experts: always the Triton block-scaled grouped GEMM (`grouped_gemm_fp8`, activations
  quantized per token and 128 columns, SiLU-and-mul fused into gate_up), never a dequantize;
- bf16/fp16 experts: expert_bank.GROUPED_GEMM_BACKEND, torch._grouped_mm by default (the path
  verified on an H200); float32, or a torch without _grouped_mm, takes the Triton
  `grouped_gemm`.
benchmarks/moe_kernels_bench.py times both at DeepSeek-V3 shapes to settle the default.

Offloading (--enable-ep-with-offloading, --ep-offloading-ratio r): the last round(r * E)
experts of every layer live in host memory (pinned on CUDA). After routing, the touched ones
are copied into a device staging slot shared by all layers, on a side stream; the shared
experts and the resident experts compute meanwhile. Two slots alternate between layers, so a
layer's copy only waits for the layer before last to finish with its slot. On CPU the same
code runs with plain copies. Routing must be known before a copy can start, so the copy hides
behind this layer's shared + resident compute, not the previous layer's. Measured once on an
H200 (4 layers, 64 experts of 2048x1024, 256 tokens, 19 offloaded, all touched): 21.2 ms/step
vs 17.8 ms for the copies alone at 54 GB/s and 6.0 ms with no offloading.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.models.expert_bank import ExpertBank, ExpertStager
from batchgen.models.fp8 import QuantizedWeight, dequantize_blocks, on_block_grid, quantize_blocks
from batchgen.models.layers import SINGLE, GatedMLP
from batchgen.models.registry import UnsupportedModelError
from batchgen.parallel import TensorParallel

PROJ_ROWS = ("gate_proj", "up_proj", "down_proj")

ROUTING_KERNEL = True
"""Route on CUDA with the fused Triton kernel (False: the torch ops of TopkRouter)."""


def offloaded_share(num_experts: int, options, tp: TensorParallel = SINGLE,
                    what: str = "the number of routed experts") -> int:
    """Routed experts per layer this rank keeps in host memory (--ep-offloading-ratio)."""
    if options is None or not getattr(options, "enable_ep_with_offloading", False):
        return 0
    ratio = float(getattr(options, "ep_offloading_ratio", 0.0))
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ep_offloading_ratio={ratio} is not in [0, 1]")
    return round(ratio * tp.split(num_experts, what))


class TopkRouter(nn.Module):
    """HF DeepseekV3TopkRouter, float32 throughout (the checkpoint keeps it in float32)."""

    def __init__(self, cfg):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group or 1
        self.topk_group = cfg.topk_group or self.n_group
        self.norm_topk_prob = bool(cfg.norm_topk_prob)
        self.routed_scaling_factor = float(cfg.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        if logits.is_cuda and ROUTING_KERNEL:
            from batchgen_kernels import deepseek_route

            # Same choice as below; ties go to the lower index (torch.topk's are unspecified).
            return deepseek_route(logits, self.e_score_correction_bias, self.n_group,
                                  self.topk_group, self.top_k, self.norm_topk_prob,
                                  self.routed_scaling_factor)
        return self._route_torch(logits)

    def _route_torch(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        # The bias only steers which experts are chosen; the weights come from the raw scores.
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep[:, :, None].expand_as(per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """One layer's routed experts held by this rank: global experts [first_expert,
    first_expert + num_experts) (all of them without expert parallelism). Local experts
    [0, num_experts - n_off) are resident on the device as parameters, the rest in host memory,
    staged in through `stager` when tokens route to them. Tokens routed to other ranks' experts
    contribute zero here; the TP group's all-reduce adds the other ranks' parts."""

    def __init__(self, num_experts: int, hidden: int, inter: int, num_offloaded: int,
                 stager: ExpertStager | None, first_expert: int = 0,
                 total_experts: int | None = None):
        super().__init__()
        assert 0 <= num_offloaded <= num_experts
        assert num_offloaded == 0 or stager is not None, "offloaded experts need a stager"
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.first_expert = first_expert
        self.total_experts = total_experts or num_experts
        self.num_resident = num_experts - num_offloaded
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_resident, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_resident, hidden, inter))
        self.register_parameter("gate_up_scale", None)
        self.register_parameter("down_scale", None)
        self.block: tuple[int, int] | None = None
        self.host: ExpertBank | None = None
        self.stager = stager
        self.loaded: set[tuple[int, str]] = set()

    @property
    def num_offloaded(self) -> int:
        return self.num_experts - self.num_resident

    def resident_bank(self) -> ExpertBank:
        return ExpertBank(self.gate_up_proj, self.down_proj, self.gate_up_scale, self.down_scale,
                          self.block)

    # -- loading ----------------------------------------------------------------------
    def load(self, expert: int, proj: str, value: torch.Tensor | QuantizedWeight) -> None:
        """Place one checkpoint matrix of global expert `expert` (skipped when another rank
        holds it): proj is gate_proj / up_proj [I, H] or down_proj [H, I]."""
        assert proj in PROJ_ROWS, proj
        if not 0 <= expert < self.total_experts:
            raise ValueError(f"expert {expert} is past the config's {self.total_experts} "
                             "experts")
        expert -= self.first_expert
        if not 0 <= expert < self.num_experts:
            return
        if isinstance(value, QuantizedWeight):
            value = self._on_expert_grid(value)
        if self.block is not None and not isinstance(value, QuantizedWeight):
            value = QuantizedWeight(*quantize_blocks(value, self.block), self.block)
        quantized = isinstance(value, QuantizedWeight)
        if quantized and self.block is None:
            self._switch_to_fp8(value.block)
        bank, row = self._bank_of(expert)
        weight, scale = (value.weight, value.scale_inv) if quantized else (value, None)
        rows = {"gate_proj": slice(0, self.inter), "up_proj": slice(self.inter, 2 * self.inter),
                "down_proj": slice(None)}[proj]
        target = (bank.down if proj == "down_proj" else bank.gate_up)[row, rows]
        if tuple(target.shape) != tuple(weight.shape):  # copy_ would broadcast or crash
            raise ValueError(f"checkpoint shape {tuple(weight.shape)} != model shape "
                             f"{tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(weight)
            if quantized:
                scale_target = bank.down_scale if proj == "down_proj" else bank.gate_up_scale
                bn = self.block[0]
                scale_rows = slice(rows.start // bn, rows.stop // bn) if rows.stop else slice(None)
                scale_target[row, scale_rows].copy_(scale)
        self.loaded.add((expert, proj))

    def _on_expert_grid(self, value: QuantizedWeight) -> QuantizedWeight | torch.Tensor:
        """The grouped FP8 GEMM takes block scales only: a per-tensor scale is restated on
        the experts' block grid (the square block, at most 128, that divides both expert
        widths), a per-channel one dequantized."""
        side = math.gcd(128, self.inter, self.hidden)
        block = self.block or (side, side)
        fitted = on_block_grid(value, block) if min(block) >= 16 else None
        if fitted is not None:
            return fitted
        return dequantize_blocks(value.weight, value.scale_inv, value.block,
                                 self.gate_up_proj.dtype)

    def load_stacked(self, proj: str, tensor: torch.Tensor, presharded: bool = False) -> None:
        """Every expert's gate|up [E, 2I, H] (proj "gate_up_proj") or down [E, H, I], as
        transformers holds them and converted folders store them; a converted TP shard's
        experts (`presharded`) are numbered from this rank's first."""
        first = self.first_expert if presharded else 0
        for e in range(tensor.shape[0]):
            if proj == "down_proj":
                self.load(first + e, "down_proj", tensor[e])
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                self.load(first + e, "gate_proj", gate)
                self.load(first + e, "up_proj", up)

    def missing(self) -> list[tuple[int, str]]:
        """(global expert, projection) of this rank's experts not loaded yet."""
        return [(e + self.first_expert, p) for e in range(self.num_experts) for p in PROJ_ROWS
                if (e, p) not in self.loaded]

    def _bank_of(self, expert: int) -> tuple[ExpertBank, int]:
        if expert < self.num_resident:
            return self.resident_bank(), expert
        if self.host is None:
            self.host = self._allocate_host()
        return self.host, expert - self.num_resident

    def _allocate_host(self) -> ExpertBank:
        """Host bank, created at load time so it has the model's final dtype."""
        pin = self.gate_up_proj.is_cuda
        n = self.num_offloaded

        def empty(like: torch.Tensor | None):
            if like is None:
                return None
            return torch.empty((n, *like.shape[1:]), dtype=like.dtype, pin_memory=pin)
        return ExpertBank(empty(self.gate_up_proj), empty(self.down_proj),
                          empty(self.gate_up_scale), empty(self.down_scale), self.block)

    def expect_fp8(self, block: tuple[int, int]) -> None:
        """Hold the stacks as e4m3 on `block`'s scale grid from the start (called on the meta
        model of a block-scaled FP8 checkpoint kept FP8): materialising them in the model dtype
        first would need twice the memory of the FP8 experts. A dense matrix loaded after this
        is quantized onto the grid."""
        if self.inter % block[0] == 0:
            self._switch_to_fp8(block)

    def _switch_to_fp8(self, block: tuple[int, int]) -> None:
        """Re-allocate the stacks as e4m3 + block scales (CUDA keeps FP8 checkpoints as is)."""
        assert not self.loaded, "an FP8 checkpoint mixes quantized and dense experts"
        assert self.inter % block[0] == 0, "gate/up blocks must not straddle the gate|up seam"
        bn, bk = block
        device = self.gate_up_proj.device

        def param(shape, dtype):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        n, i, h = self.num_resident, self.inter, self.hidden
        self.block = tuple(block)
        self.gate_up_proj = param((n, 2 * i, h), torch.float8_e4m3fn)
        self.down_proj = param((n, h, i), torch.float8_e4m3fn)
        self.gate_up_scale = param((n, -(-2 * i // bn), -(-h // bk)), torch.float32)
        self.down_scale = param((n, -(-h // bn), -(-i // bk)), torch.float32)

    # -- compute ----------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x) [T, H]."""
        if self.runs_on_device(x):
            return self.forward_on_device(x, ids, weights)
        return self.finish(self.dispatch(x, ids), weights)

    def runs_on_device(self, x: torch.Tensor) -> bool:
        """No offloaded expert and a grouped GEMM for x: the layer needs no host sync (so CUDA
        graphs can capture it); offloading must read the counts on the host to copy."""
        return (x.is_cuda and self.num_offloaded == 0
                and self.resident_bank()._grouped_path(x) is not None)

    def forward_on_device(self, x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
        """`forward` with every shape static: all T*k assignments are sorted (other ranks'
        experts last, in a group past ours that the GEMM does not read) and the counts are
        scattered on the device instead of read back."""
        k = ids.shape[1]
        flat = ids.reshape(-1) - self.first_expert
        mine = (flat >= 0) & (flat < self.num_experts)
        flat = torch.where(mine, flat, self.num_experts)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts[: self.num_experts].cumsum(0).to(torch.int32)
        sizes = [] if x.is_cuda else counts[: self.num_experts].tolist()  # CPU: the loop path
        out_sorted = self.resident_bank().run(x[order // k], sizes, offs)
        # Rows past the last offset were not written by the GEMM: never let them through.
        out_sorted = torch.where(mine[order, None], out_sorted, 0)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        combined = (out.view(-1, k, self.hidden).float() * weights[..., None]).sum(dim=1)
        return combined.to(x.dtype)

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor) -> _Dispatch:
        """Sort assignments by expert and start copying the touched offloaded experts in; the
        caller may compute something else (the shared experts) before `finish`."""
        flat = ids.reshape(-1) - self.first_expert
        if self.num_experts < self.total_experts:  # other ranks' experts: one group past ours
            flat = torch.where((flat >= 0) & (flat < self.num_experts), flat, self.num_experts)
        order = torch.argsort(flat, stable=True)
        counts_dev = torch.bincount(flat, minlength=self.num_experts)
        counts = counts_dev.tolist()[: self.num_experts]  # the host sync copying on demand needs
        offloaded = [e for e in range(self.num_resident, self.num_experts) if counts[e]]
        offs = (_group_offsets(counts_dev[: self.num_experts], self.num_resident) if x.is_cuda
                else (None, None))
        staged = None
        if offloaded:
            rows = [e - self.num_resident for e in offloaded]
            staged = self.stager.fetch(self.host, rows, x.device)
        order = order[: sum(counts)]
        return _Dispatch(x[order // ids.shape[1]], order, counts, offloaded, staged, offs,
                         ids.numel())

    def finish(self, d: _Dispatch, weights: torch.Tensor) -> torch.Tensor:
        n_res = sum(d.counts[: self.num_resident])
        out_sorted = torch.empty_like(d.h)
        resident_sizes = d.counts[: self.num_resident]
        out_sorted[:n_res] = self.resident_bank().run(d.h[:n_res], resident_sizes, d.offs[0])
        if d.staged is not None:
            self.stager.wait(d.staged)
            sizes = [d.counts[e] for e in d.offloaded]
            out_sorted[n_res:] = d.staged.bank.run(d.h[n_res:], sizes, d.offs[1])
            self.stager.release(d.staged)
        out = out_sorted.new_zeros(d.assignments, self.hidden) if len(d.order) < d.assignments \
            else torch.empty_like(out_sorted)
        out[d.order] = out_sorted
        # Summing over k in top-k order keeps the result independent of where experts live.
        k = weights.shape[1]
        combined = (out.view(-1, k, self.hidden).float() * weights[..., None]).sum(dim=1)
        return combined.to(d.h.dtype)


class _Dispatch:
    """Assignments sorted by expert: h [T*k, H] inputs, `order` the sorting permutation,
    `offs` the grouped-GEMM offsets of the resident and the staged bank (CUDA only)."""

    def __init__(self, h, order, counts, offloaded, staged, offs, assignments):
        self.h, self.order, self.counts = h, order, counts
        self.offloaded, self.staged, self.offs = offloaded, staged, offs
        self.assignments = assignments
        """T * k; `order` covers only those routed to this rank's experts."""


def _group_offsets(counts: torch.Tensor, num_resident: int):
    """Device int32 prefix sums of the resident experts' and the touched offloaded experts'
    row counts. Built on the device before any expert copy is queued: a small host-to-device
    copy issued later would wait in the copy engine behind the experts, stalling compute."""
    resident = counts[:num_resident].cumsum(0).to(torch.int32)
    offloaded = counts[num_resident:]
    return resident, offloaded[offloaded > 0].cumsum(0).to(torch.int32)


class DeepseekMoE(nn.Module):
    """Routed experts + shared experts: out = routed(x) + shared(x), as HF sums them.

    Under tensor parallelism the MoE is expert parallel across the TP group: each rank holds
    E / TP routed experts and a column/row slice of the shared experts, routes every token (the
    router is replicated), computes its own part, and one all-reduce sums the parts. Hidden
    states are already replicated across the group, so no all-to-all dispatch is needed."""

    def __init__(self, cfg, num_offloaded: int = 0, stager: ExpertStager | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"hidden_act {cfg.hidden_act!r}: the routed experts' grouped kernels apply "
                "SiLU only (as DeepSeek-V3/R1 use); dense layers take other activations")
        self.tp = tp
        self.gate = TopkRouter(cfg)
        local = tp.split(cfg.n_routed_experts, "n_routed_experts")
        self.experts = RoutedExperts(local, cfg.hidden_size, cfg.moe_intermediate_size,
                                     num_offloaded, stager, first_expert=tp.rank * local,
                                     total_experts=cfg.n_routed_experts)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size,
                                           cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           tp=tp, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.experts.runs_on_device(x):
            routed = self.experts.forward_on_device(x, ids, weights)
            shared = self.shared_experts(x) if self.shared_experts is not None else None
        else:
            dispatch = self.experts.dispatch(x, ids)  # offloaded experts start copying in
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            routed = self.experts.finish(dispatch, weights)
        out = routed + shared if shared is not None else routed
        return self.tp.all_reduce(out)

"""Routed experts' storage and compute, apart from routing (moe.py): a bank of stacked expert
weights and its SwiGLU (grouped GEMMs on CUDA, a per-expert loop elsewhere), and the device
staging slots that offloaded experts are copied into when tokens route to them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.models.fp8 import fp8_linear

GROUPED_GEMM_BACKEND = "torch"
"""bf16/fp16 experts on CUDA: "torch" (torch._grouped_mm, then SiLU-and-mul) or "triton"
(batchgen_kernels.grouped_gemm with SiLU-and-mul fused). The default is the path already
verified on an H200; switch when benchmarks/moe_kernels_bench.py shows Triton ahead."""


class ExpertBank:
    """Stacked weights of some experts: gate_up [n, 2I, H], down [n, H, I], plus e4m3 block
    scales when kept in FP8. Row i of the bank serves the i-th expert it was built for."""

    def __init__(self, gate_up, down, gate_up_scale=None, down_scale=None, block=None):
        self.gate_up, self.down = gate_up, down
        self.gate_up_scale, self.down_scale, self.block = gate_up_scale, down_scale, block

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.gate_up, self.down, self.gate_up_scale, self.down_scale)
                if t is not None]

    def run(self, h: torch.Tensor, sizes: list[int], offs: torch.Tensor | None = None):
        """h [M, H], rows grouped by bank row (sizes[i] rows for row i) -> [M, H]. `offs`:
        the same sizes as a device int32 prefix sum, for the grouped GEMM."""
        if h.shape[0] == 0:
            return torch.empty_like(h)
        grouped = self._grouped_path(h) if offs is not None else None
        if grouped is not None:
            return grouped(h, offs)
        out = torch.empty_like(h)
        start = 0
        for row, n in enumerate(sizes):
            if n:
                out[start:start + n] = self._mlp(h[start:start + n], row)
            start += n
        return out

    def _mlp(self, h: torch.Tensor, row: int) -> torch.Tensor:
        if self.block is None:
            gate, up = F.linear(h, self.gate_up[row]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down[row])
        gate_up = fp8_linear(h, self.gate_up[row], self.gate_up_scale[row], self.block)
        gate, up = gate_up.chunk(2, dim=-1)
        return fp8_linear(F.silu(gate) * up, self.down[row], self.down_scale[row], self.block)

    def _grouped_path(self, h: torch.Tensor):
        """The grouped SwiGLU for h on CUDA (see the module docstring), None for the loop."""
        if not h.is_cuda:
            return None
        if self.block is not None:
            return self._run_fp8 if self._fp8_kernel_fits() else None
        if (GROUPED_GEMM_BACKEND == "torch" and hasattr(torch, "_grouped_mm")
                and h.dtype in (torch.bfloat16, torch.float16)):
            return self._run_torch_grouped
        return self._run_triton

    def _run_torch_grouped(self, h: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        groups = offs.shape[0]
        gate_up = torch._grouped_mm(h, self.gate_up[:groups].transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down[:groups].transpose(1, 2), offs=offs)

    def _run_triton(self, h: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        from batchgen_kernels import grouped_gemm

        return grouped_gemm(grouped_gemm(h, self.gate_up, offs, silu_mul=True), self.down, offs)

    def _fp8_kernel_fits(self) -> bool:
        """The FP8 kernel takes power-of-two blocks that tile both matrices exactly (R1's
        128x128 does); other blocks keep the per-expert fp8_linear loop."""
        bn, bk = self.block
        inter, hidden = self.down.shape[-1], self.down.shape[-2]
        return (all(b >= 16 and b & (b - 1) == 0 for b in (bn, bk))
                and inter % bn == 0 and inter % bk == 0 and hidden % bn == 0
                and hidden % bk == 0)

    def _run_fp8(self, h: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        from batchgen_kernels import grouped_gemm_fp8, quantize_fp8_groups

        bk = self.block[1]
        act = grouped_gemm_fp8(*quantize_fp8_groups(h, bk), self.gate_up,
                               self.gate_up_scale.float(), offs, self.block, silu_mul=True,
                               out_dtype=h.dtype)
        return grouped_gemm_fp8(*quantize_fp8_groups(act, bk), self.down, self.down_scale.float(),
                                offs, self.block, out_dtype=h.dtype)


class _Slot:
    def __init__(self, bank: ExpertBank, stream):
        self.bank = bank
        self.ready = torch.cuda.Event() if stream is not None else None
        self.free = torch.cuda.Event() if stream is not None else None


class ExpertStager:
    """Device staging slots for offloaded experts, shared by every MoE layer of a model.

    `fetch` copies the given host-bank rows into the next slot (side stream on CUDA),
    `wait` makes the compute stream wait for them, `release` marks the slot reusable once the
    compute stream has used it. Counters tell tests and benchmarks what moved."""

    NUM_SLOTS = 2

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots: list[_Slot] = []
        self.next = 0
        self.stream = None
        self.copied_experts = 0
        self.copied_bytes = 0
        self.fetches = 0

    def fetch(self, host: ExpertBank, rows: list[int], device: torch.device) -> _Slot:
        assert len(rows) <= self.capacity, (len(rows), self.capacity)
        if not self.slots:
            self._allocate(host, device)
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        if self.stream is None:
            self._copy(host, rows, slot)
        else:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(slot.free)
                self._copy(host, rows, slot)
                slot.ready.record(self.stream)
        self.fetches += 1
        self.copied_experts += len(rows)
        return slot

    def wait(self, slot: _Slot) -> None:
        if slot.ready is not None:
            torch.cuda.current_stream().wait_event(slot.ready)

    def release(self, slot: _Slot) -> None:
        if slot.free is not None:
            slot.free.record(torch.cuda.current_stream())

    def _allocate(self, host: ExpertBank, device: torch.device) -> None:
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
        for _ in range(self.NUM_SLOTS):
            tensors = [None if t is None else
                       torch.empty((self.capacity, *t.shape[1:]), dtype=t.dtype, device=device)
                       for t in (host.gate_up, host.down, host.gate_up_scale, host.down_scale)]
            slot = _Slot(ExpertBank(*tensors, block=host.block), self.stream)
            if slot.free is not None:
                slot.free.record(torch.cuda.current_stream(device))
            self.slots.append(slot)

    def _copy(self, host: ExpertBank, rows: list[int], slot: _Slot) -> None:
        blocking = self.stream is None
        for i, row in enumerate(rows):
            for src, dst in zip(host.tensors(), slot.bank.tensors()):
                dst[i].copy_(src[row], non_blocking=not blocking)
                self.copied_bytes += src[row].numel() * src.element_size()

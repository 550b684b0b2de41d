"""Row-scaled FP8 GEMMs: weights with one scale per output row, activations with one per row.

Common FP8 checkpoints of dense models scale each weight matrix once (AutoFP8: `weight_scale`,
one value) or each output channel (llm-compressor's FP8_DYNAMIC: [N, 1]). fp8.py stores both
as a QuantizedWeight with scales [N, 1] and block (1, K), i.e. one block spanning each row.
Such a weight needs no per-128-column scale steps inside the GEMM: activations are quantized
with one scale per row and torch's `_scaled_mm` applies the two scale vectors to the
accumulated product (measured on an H200 at M = 512..8192: 10-17% faster than the 128x128
blockwise recipe; docs/performance.md).

A fused RMSNorm or SiLU-and-mul can hand such a projection its input already quantized
(`QuantizedRows`), so the activation-dtype row is never written and read back.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn

FAST_ACCUMULATION = True
"""`_scaled_mm(use_fast_accum=True)`: Hopper's FP8 tensor-core accumulation without the
periodic promotion to float32. Measured on the H200 against the float64 product of the same
e4m3 operands: relative error 1.7e-3 -> 2.1e-3 (K = 4096) and 1.7e-3 -> 3.3e-3 (K = 14336;
bf16 output rounding is the 1.7e-3), beside the ~4e-2 that quantizing activations to e4m3
costs anyway; the GEMMs of a Llama-3-8B layer run 8-11% faster."""


class QuantizedRows(NamedTuple):
    """Activations quantized per row: e4m3 data [M, K] and float32 scales [M, 1]
    (data * scale ~= the activations)."""

    data: torch.Tensor
    scale: torch.Tensor


def is_row_scaled(block: tuple[int, int], k: int) -> bool:
    """Whether a weight [N, K] quantized with `block` has one scale per row."""
    return block[0] == 1 and block[1] >= k


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """x [M, K] -> QuantizedRows: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and 1 <= x.shape[1] <= 65536:
        import batchgen_kernels as K

        return QuantizedRows(*K.quantize_fp8_rows(x if x.stride(-1) == 1 else x.contiguous()))
    from batchgen_kernels.reference import quantize_fp8_rows

    return QuantizedRows(*quantize_fp8_rows(x))


def row_scaled_matmul(x: QuantizedRows, wq: torch.Tensor, ws: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """(x.data * x.scale) @ (wq * ws).T for wq [N, K] e4m3 and ws [N, 1] float32 -> [M, N]."""
    n, k = wq.shape
    if x.data.shape[0] == 0:
        return x.data.new_zeros(0, n, dtype=out_dtype)
    if x.data.is_cuda and _scaled_mm_rowwise_works(x.data.device, n % 16 == 0 and k % 16 == 0):
        out = _scaled_mm_rowwise(x.data, x.scale, wq, ws)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    # e4m3 values are exact in bfloat16/float32, so one matmul of the raw values and the two
    # scales applied after is the same arithmetic (slower: the weight is upcast per call).
    dtype = torch.float32 if out_dtype == torch.float32 or not x.data.is_cuda else out_dtype
    raw = x.data.to(dtype) @ wq.to(dtype).t()
    return (raw.float() * x.scale * ws.float().t()).to(out_dtype)


def _scaled_mm_rowwise(xq, xs, wq, ws) -> torch.Tensor:
    # torch's rowwise recipe: scale_a [M, 1] and scale_b [1, N] float32, bfloat16 output.
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.float().reshape(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUMULATION)


@functools.cache
def _scaled_mm_rowwise_works(device: torch.device, aligned: bool) -> bool:
    """Probe once per device: does this torch/GPU run the rowwise recipe (with an odd row
    count) and agree with the reference? `aligned`: K and N multiples of 16, which FP8 GEMMs
    require; unaligned shapes take the fallback without a probe."""
    if not aligned:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(5, 256, device=device, generator=gen)
    w = torch.randn(128, 256, device=device, generator=gen)
    rows = quantize_rows(x)
    ws = w.abs().amax(1, keepdim=True) / 448.0
    wq = (w / ws).to(FP8)
    try:
        out = _scaled_mm_rowwise(rows.data, rows.scale, wq, ws).float()
    except (RuntimeError, TypeError, ValueError):
        return False
    ref = (rows.data.float() * rows.scale) @ (wq.float() * ws).t()
    return bool(((out - ref).norm() <= 1e-2 * ref.norm()).item())

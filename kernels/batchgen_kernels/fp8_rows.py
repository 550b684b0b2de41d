"""Per-row e4m3 quantization of activations, for row-scaled FP8 GEMMs.

A weight with one scale per output row (per-channel checkpoints; a per-tensor scale is the
case of equal rows) multiplies activations quantized with one scale per row: torch's
`_scaled_mm` takes that pair of scale vectors directly. Each program owns one whole row (up
to 64K features), reads it once and writes its e4m3 values and scale. rmsnorm.py and
silu_mul.py have fused variants that quantize the row they just computed instead of writing it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    check_device,
    check_dtype,
    check_shape,
    hardware_fp8_cast,
    next_pow2,
    quantize_row_e4m3,
)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q,
                          BLOCK: tl.constexpr, HW_CAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_row_e4m3(x, HW_CAST)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def fp8_row_outputs(rows: int, cols: int, device: torch.device, out: torch.Tensor | None,
                    scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (e4m3 [rows, cols], float32 scales [rows, 1]) buffers of a row quantizer: the given
    ones, checked, or new ones."""
    out = torch.empty(rows, cols, dtype=FP8_DTYPE, device=device) if out is None else out
    scales = torch.empty(rows, 1, dtype=torch.float32, device=device) if scales is None else scales
    check_shape("out", out, (rows, cols))
    check_dtype("out", out, (FP8_DTYPE,))
    if not (out.stride(-1) == 1 or cols <= 1):
        raise ValueError("out: last dim must be contiguous")
    check_shape("scales", scales, (rows, 1))
    check_dtype("scales", scales, (torch.float32,))
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")
    return out, scales


def row_warps(block: int) -> int:
    """Warps for a program that holds a whole row of `block` (a power of two) elements."""
    return min(16, max(1, block // 512))


def quantize_fp8_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                      scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: scale = max(amax, 1e-12) / 448, q = rne(x * (1 / scale))
    with the reciprocal an IEEE division (`reference.quantize_fp8_rows`).

    x       [M, K] float32/float16/bfloat16, last dim contiguous, 1 <= K <= 65536.
    out     optional [M, K] float8_e4m3fn, last dim contiguous.
    scales  optional [M, 1] float32, contiguous.
    Returns (out, scales); out * scales ~= x.
    """
    check_device(x, out, scales)
    check_dtype("x", x, FLOAT_DTYPES)
    if not (x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)):
        raise ValueError("x is [M, K], K contiguous")
    rows, cols = x.shape
    if not (1 <= cols <= 65536):
        raise ValueError(f"K = {cols}: a row quantizer takes 1..65536 features")
    out, scales = fp8_row_outputs(rows, cols, x.device, out, scales)
    if rows == 0:
        return out, scales
    block = next_pow2(cols)
    _quantize_rows_kernel[(rows,)](x, out, scales, cols, x.stride(0), out.stride(0),
                                   BLOCK=block, HW_CAST=hardware_fp8_cast(x.device),
                                   num_warps=row_warps(block))
    return out, scales

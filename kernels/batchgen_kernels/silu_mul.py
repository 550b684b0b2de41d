"""Fused SiLU-and-mul (the SwiGLU gate): x [T, 2I] -> silu(x[:, :I]) * x[:, I:].

The gate and up projections come out of one fused matmul as the two halves of each row; this
reads both halves once and writes the product, computing in float32 and rounding once.
Program (t, j) handles BLOCK columns of row t. `silu_and_mul_fp8` instead quantizes each row
per row to e4m3 (fp8_rows.py) for a row-scaled FP8 down projection; a program owns a whole
row, since the scale needs the row's amax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_output,
    hardware_fp8_cast,
    next_pow2,
    quantize_row_e4m3,
)
from .fp8_rows import fp8_row_outputs, row_warps


@triton.jit
def _silu_mul(x_row, offs, n_cols):
    """silu(gate) * up at columns `offs` of one row, rounded to the row's dtype, in float32."""
    mask = offs < n_cols
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    return (silu * up).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = _silu_mul(x_ptr + row * stride_x, offs, n_cols)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=offs < n_cols)


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q,
                         BLOCK: tl.constexpr, HW_CAST: tl.constexpr):
    """One whole row (its scale needs the row's amax). On an H200 (Llama-3-8B, 14336
    columns): 14 us per call at 512 rows (a decode step), 169 us at 8,000. Two passes over
    2048-column chunks, the second re-reading the row, were slower (measured when the kernel
    still divided per value: 27 vs 26 us, 296 vs 281 us)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y, scale = quantize_row_e4m3(_silu_mul(x_ptr + row * stride_x, cols, n_cols), HW_CAST)
    tl.store(q_ptr + row * stride_q + cols, y.to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 block: int = 1024) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up].

    x      [T, 2I] float32/float16/bfloat16, last dim contiguous.
    out    optional [T, I] of x's dtype, last dim contiguous.
    block  columns per program (rounded up to a power of two).
    Returns out [T, I].
    """
    check_device(x, out)
    check_dtype("x", x, FLOAT_DTYPES)
    if not (x.dim() == 2 and x.shape[1] % 2 == 0):
        raise ValueError("x is [T, 2I]")
    if x.stride(1) != 1:
        raise ValueError("x: last dim must be contiguous")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, inter) if out is None else out
    check_output("out", out, (rows, inter), x.dtype)
    if rows == 0 or inter == 0:
        return out
    block = min(next_pow2(block), next_pow2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                           num_warps=max(1, min(8, block // 256)))
    return out


def silu_and_mul_fp8(x: torch.Tensor, out: torch.Tensor | None = None,
                     scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantized per row to e4m3 in the same kernel; bit-identical to
    quantizing `silu_and_mul`'s output with `quantize_fp8_rows`.

    x       [T, 2I] float32/float16/bfloat16, last dim contiguous, I <= 65536.
    out     optional [T, I] float8_e4m3fn; scales optional [T, 1] float32.
    Returns (out, scales).
    """
    check_device(x, out, scales)
    check_dtype("x", x, FLOAT_DTYPES)
    if not (x.dim() == 2 and x.shape[1] % 2 == 0):
        raise ValueError("x is [T, 2I]")
    if x.stride(1) != 1:
        raise ValueError("x: last dim must be contiguous")
    rows, inter = x.shape[0], x.shape[1] // 2
    if not (1 <= inter <= 65536):
        raise ValueError(f"I = {inter}: 1..65536 features")
    out, scales = fp8_row_outputs(rows, inter, x.device, out, scales)
    if rows == 0:
        return out, scales
    block = next_pow2(inter)
    _silu_mul_fp8_kernel[(rows,)](x, out, scales, inter, x.stride(0), out.stride(0),
                                  BLOCK=block, HW_CAST=hardware_fp8_cast(x.device),
                                  num_warps=row_warps(block))
    return out, scales

"""Fused SiLU-and-mul (the SwiGLU gate): x [T, 2I] -> silu(x[:, :I]) * x[:, I:].

The gate and up projections come out of one fused matmul as the two halves of each row; this
reads both halves once and writes the product, computing in float32 and rounding once.
Program (t, j) handles BLOCK columns of row t.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_shape, next_pow2


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty),
             mask=mask)


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
    assert x.dim() == 2 and x.shape[1] % 2 == 0, "x is [T, 2I]"
    assert x.stride(1) == 1, "x: last dim must be contiguous"
    rows, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, inter) if out is None else out
    check_shape("out", out, (rows, inter))
    assert out.dtype == x.dtype and out.stride(-1) == 1, "out: x's dtype, last dim contiguous"
    if rows == 0 or inter == 0:
        return out
    block = min(next_pow2(block), next_pow2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                           num_warps=max(1, min(8, block // 256)))
    return out

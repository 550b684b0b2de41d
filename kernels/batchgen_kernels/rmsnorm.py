"""Fused residual add + RMSNorm, one program per row, float32 accumulation.

h = x + residual is rounded to the activation dtype (it is the residual stream the next layer
adds to), then out = weight * (h / rms(h)), with the normalised value cast to the activation
dtype before the weight multiply, as HF Llama and batchgen's RMSNorm do, so bf16 results
match the unfused path up to the reduction order. The whole row sits in registers; rows up
to 64K features fit. `rmsnorm_fp8` quantizes that row per row to e4m3 (fp8_rows.py) instead of
writing it, for a row-scaled FP8 projection that reads it next.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_shape,
    hardware_fp8_cast,
    next_pow2,
    quantize_row_e4m3,
)
from .fp8_rows import fp8_row_outputs, row_warps


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, eps,
                    n_cols, stride_x, stride_r, stride_o, stride_ro,
                    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr,
                    HW_CAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    act = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(act)
        tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    normed = (hf * rstd).to(act).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(act)
    if FP8_OUT:  # quantize the activation-dtype row the unfused path would have written
        y, scale = quantize_row_e4m3(y.to(tl.float32), HW_CAST)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


HEADS_FEATURES = 4096
"""`rmsnorm_heads` gives a program as many whole heads of one token as fit this many features."""


@triton.jit
def _rmsnorm_heads_kernel(x_ptr, weight_ptr, out_ptr, eps, heads, n_cols, stride_t, stride_h,
                          HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, j): heads j * HEADS ... of one token as a [HEADS, n_cols] tile, each head
    normalised on its own; out is a contiguous [T, heads, n_cols]."""
    token = tl.program_id(0).to(tl.int64)
    h_offs = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (h_offs < heads) & (offs < n_cols)
    act = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + token * stride_t + h_offs * stride_h + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    normed = (xf * rstd[:, None]).to(act).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    y = (normed * w).to(act)
    tl.store(out_ptr + (token * heads + h_offs) * n_cols + offs, y, mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_shape(name, t, shape)
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(rows, features) of x [T, N] after checking it and weight [N]."""
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() != 2:
        raise ValueError("x is [T, N]")
    rows, cols = x.shape
    if cols > 65536:
        raise ValueError(f"N = {cols}: a row of over 64K features does not fit a program")
    _check_rows("x", x, (rows, cols), x.dtype)
    check_shape("weight", weight, (cols,))
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    return rows, cols


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * rmsnorm(h), h) with h = x + residual (h = x when residual is None).

    x            [T, N] float32/float16/bfloat16, last dim contiguous.
    residual     [T, N] of x's dtype, or None for a plain RMSNorm.
    weight       [N] any float dtype.
    out          optional [T, N] output of x's dtype; may be x itself (in place).
    residual_out optional [T, N] for h; may be residual itself (in place).
    Returns (out [T, N], residual_out [T, N] or None), both in x's dtype.
    """
    check_device(x, residual, weight, out, residual_out)
    rows, cols = _check_inputs(x, weight)
    out = torch.empty_like(x) if out is None else out
    _check_rows("out", out, (rows, cols), x.dtype)
    if residual is not None:
        _check_rows("residual", residual, (rows, cols), x.dtype)
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        _check_rows("residual_out", residual_out, (rows, cols), x.dtype)
    else:
        if residual_out is not None:
            raise ValueError("residual_out without residual")
    _launch(x, residual, weight, out, residual_out, None, eps)
    return out, residual_out


def _launch(x, residual, weight, out, residual_out, scales, eps) -> None:
    rows, cols = x.shape
    if rows == 0:
        return
    block = next_pow2(cols)
    r, ro = (residual, residual_out) if residual is not None else (x, out)
    _rmsnorm_kernel[(rows,)](
        x, r, weight, out, ro, scales if scales is not None else weight, eps, cols,
        x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
        BLOCK=block, HAS_RESIDUAL=residual is not None, FP8_OUT=scales is not None,
        HW_CAST=scales is not None and hardware_fp8_cast(x.device), num_warps=row_warps(block))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rmsnorm(x) for x [T, N]; see fused_add_rmsnorm."""
    return fused_add_rmsnorm(x, None, weight, eps, out=out)[0]


def rmsnorm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm of every head of x [T, H, D]: per-head norms such as Qwen3's q_norm
    and k_norm, read straight from a strided view (a slice of a fused QKV projection's output)
    with no copy first. A program takes several heads of one token (up to 4,096 features), not
    one head: a 128-feature row alone leaves a program mostly idle.

    x       [T, H, D] float32/float16/bfloat16, last dim contiguous, D <= 65536.
    weight  [D] any float dtype.
    Returns a contiguous [T, H, D] of x's dtype.
    """
    check_device(x, weight)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() != 3:
        raise ValueError("x is [T, H, D]")
    tokens, heads, cols = x.shape
    if cols > 65536:
        raise ValueError(f"D = {cols}: a row of over 64K features does not fit a program")
    if x.stride(2) != 1:
        raise ValueError("x: last dim must be contiguous")
    check_shape("weight", weight, (cols,))
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    out = torch.empty(tokens, heads, cols, dtype=x.dtype, device=x.device)
    if out.numel():
        block = next_pow2(cols)
        heads_block = min(next_pow2(heads), max(1, HEADS_FEATURES // block))
        _rmsnorm_heads_kernel[(tokens, triton.cdiv(heads, heads_block))](
            x, weight, out, eps, heads, cols, x.stride(0), x.stride(1), HEADS=heads_block,
            BLOCK=block, num_warps=row_warps(heads_block * block))
    return out


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None, scales: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm(x, weight, eps) quantized per row to e4m3 (`fp8_rows.quantize_fp8_rows`) in
    the same pass: the input of a row-scaled FP8 projection, without the activation-dtype row
    written and read back. Bit-identical to quantizing `rmsnorm`'s output.

    x       [T, N] float32/float16/bfloat16, last dim contiguous, N <= 65536.
    weight  [N] any float dtype.
    out     optional [T, N] float8_e4m3fn; scales optional [T, 1] float32.
    Returns (out, scales).
    """
    out, scales, _ = _rmsnorm_fp8(x, None, weight, eps, out, scales)
    return out, scales


def fused_add_rmsnorm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rmsnorm_fp8` of h = x + residual (rounded to x's dtype, as `fused_add_rmsnorm`).

    x, residual  [T, N] of one float dtype, last dim contiguous.
    Returns (e4m3 [T, N], scales [T, 1] float32, h [T, N]).
    """
    return _rmsnorm_fp8(x, residual, weight, eps, None, None)


def _rmsnorm_fp8(x, residual, weight, eps, out, scales):
    check_device(x, weight, out, scales, residual)
    rows, cols = _check_inputs(x, weight)
    if cols < 1:
        raise ValueError("x has no features")
    out, scales = fp8_row_outputs(rows, cols, x.device, out, scales)
    h = None
    if residual is not None:
        _check_rows("residual", residual, (rows, cols), x.dtype)
        h = torch.empty_like(x)
    _launch(x, residual, weight, out, h, scales, eps)
    return out, scales, h

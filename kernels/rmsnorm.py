"""Fused residual add + RMSNorm, one program per row, float32 accumulation.

h = x + residual is rounded to the activation dtype (it is the residual stream the next layer
adds to), then out = weight * (h / rms(h)), with the normalised value cast to the activation
dtype before the weight multiply, as HF Llama and batchgen's RMSNorm do, so bf16 results
match the unfused path up to the reduction order. The whole row sits in registers; rows up
to 64K features fit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_shape, next_pow2


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps, n_cols,
                    stride_x, stride_r, stride_o, stride_ro,
                    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    normed = (hf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_shape(name, t, shape)
    assert t.dtype == dtype, f"{name}: dtype {t.dtype}, expected {dtype}"
    assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"


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
    check_dtype("x", x, FLOAT_DTYPES)
    assert x.dim() == 2, "x is [T, N]"
    rows, cols = x.shape
    _check_rows("x", x, (rows, cols), x.dtype)
    check_shape("weight", weight, (cols,))
    assert weight.stride(0) == 1, "weight must be contiguous"
    out = torch.empty_like(x) if out is None else out
    _check_rows("out", out, (rows, cols), x.dtype)
    if residual is not None:
        _check_rows("residual", residual, (rows, cols), x.dtype)
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        _check_rows("residual_out", residual_out, (rows, cols), x.dtype)
    else:
        assert residual_out is None, "residual_out without residual"
    if rows == 0:
        return out, residual_out
    block = next_pow2(cols)
    r, ro = (residual, residual_out) if residual is not None else (x, out)
    _rmsnorm_kernel[(rows,)](
        x, r, weight, out, ro, eps, cols,
        x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
        BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 512)))
    return out, residual_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rmsnorm(x) for x [T, N]; see fused_add_rmsnorm."""
    return fused_add_rmsnorm(x, None, weight, eps, out=out)[0]

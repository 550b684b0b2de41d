"""MLA KV store: write this step's `[latent | k_pe]` rows into one layer of a paged MLA pool.

One program per token copies its C + R values to slot `slot_mapping[t]` (page * 64 + offset).
fp8 pools get one scale per token, amax / 448 (amax clamped to 1e-8), and store
round-to-nearest-even(x * (1 / scale)) (`kv_values_e4m3`), bit-identical to
`reference.quantize_fp8` (the same recipe as the GQA store, with the whole row as one group).
Tokens whose slot is negative (CUDA-graph padding rows) are skipped: indexing the pool with
slot -1 from PyTorch would write into the last page instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    FP8_MAX_C,
    PAGE_SIZE,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    hardware_fp8_cast,
    kv_values_e4m3,
    next_pow2,
)


@triton.jit
def _mla_store_kernel(src_ptr, kv_ptr, scale_ptr, slot_ptr, stride_t, stride_page, stride_slot,
                      stride_s_page, stride_s_slot, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
                      PAGE: tl.constexpr, FP8: tl.constexpr, HW_CAST: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    offset = slot % PAGE
    offs = tl.arange(0, BLOCK_W)
    mask = offs < WIDTH
    x = tl.load(src_ptr + token * stride_t + offs, mask=mask, other=0.0)
    dst = kv_ptr + page * stride_page + offset * stride_slot + offs
    if FP8:
        x = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8)
        scale = tl.math.div_rn(amax, FP8_MAX_C)
        y = kv_values_e4m3(x, scale, HW_CAST)
        tl.store(dst, y.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + page * stride_s_page + offset * stride_s_slot, scale)
    else:
        tl.store(dst, x.to(kv_ptr.dtype.element_ty), mask=mask)


def store_mla_kv(rows: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
    """Write each token's latent-cache row into one layer of a paged MLA pool, in place.

    rows         [T, W] float32/float16/bfloat16, W = C + R (`[latent | k_pe]`); last dim
                 contiguous.
    kv           [num_pages, 64, 1, W]: the layer view `pool.data[:, layer]`; any float dtype,
                 or float8_e4m3fn.
    kv_scales    [num_pages, 64, 1] float32 (`pool.scales[:, layer]`) for fp8 pools, which
                 receive one scale amax / 448 per token; None otherwise.
    slot_mapping [T] int64 (or int32) page * 64 + offset; negative entries are skipped.
    Non-fp8 pools receive the rows cast to the pool dtype.
    """
    tokens, width = rows.shape
    num_pages = kv.shape[0]
    check_device(rows, kv, kv_scales, slot_mapping)
    check_shape("kv", kv, (num_pages, PAGE_SIZE, 1, width))
    check_dtype("rows", rows, FLOAT_DTYPES)
    check_dtype("kv", kv, FLOAT_DTYPES + (FP8_DTYPE,))
    check_shape("slot_mapping", slot_mapping, (tokens,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_last_dim_contiguous("rows", rows)
    check_last_dim_contiguous("kv", kv)
    fp8 = kv.dtype == FP8_DTYPE
    if fp8 != (kv_scales is not None):
        raise ValueError("kv_scales must be given exactly for fp8 KV")
    if fp8:
        check_shape("kv_scales", kv_scales, (num_pages, PAGE_SIZE, 1))
        check_dtype("kv_scales", kv_scales, (torch.float32,))
    if tokens == 0:
        return
    scales = kv_scales if fp8 else kv.new_empty(0, dtype=torch.float32)
    s_strides = (scales.stride(0), scales.stride(1)) if fp8 else (0, 0)
    _mla_store_kernel[(tokens,)](
        rows, kv, scales, slot_mapping, rows.stride(0), kv.stride(0), kv.stride(1), *s_strides,
        WIDTH=width, BLOCK_W=next_pow2(width), PAGE=PAGE_SIZE, FP8=fp8,
        HW_CAST=fp8 and hardware_fp8_cast(kv.device), num_warps=4)

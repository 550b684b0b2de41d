"""KV page store: write this step's K and V rows into one layer of a paged pool.

One program per token copies its [KVH, D] K and V tiles to the slot `slot_mapping[t]`
(page * 64 + offset). For fp8 pools each (token, K/V, head) row gets its own scale,
amax / 448 (amax clamped to 1e-8 so all-zero rows stay finite), and is stored as
round-to-nearest-even(x * (1 / scale)), the reciprocal an IEEE division (`div_rn`) once per
row; the GPU's cast rounds where it can (`hardware_fp8_cast`), the interpreter's values are
rounded explicitly (`round_to_e4m3`). Either way the result is bit-identical to the engine's
reference `(x.float() * (1 / scale)).to(float8_e4m3fn)`, except that NaN is stored as 0
(fp8 pools never hold NaN). fp8 pools
store V transposed per page and head (`load_page_kv`), so a token's V row lands in a column of
its page's block. Tokens whose slot is negative (padding) are skipped.
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
    check_kv_scales,
    check_last_dim_contiguous,
    check_shape,
    hardware_fp8_cast,
    kv_values_e4m3,
    next_pow2,
)


@triton.jit
def _store_rows(src_ptr, stride_t, stride_h, token, dst_ptr, dst_off, stride_head, dst_cols,
                scale_ptr, scale_off, stride_s_head, offs_h, offs_d, mask_h, mask_d,
                FP8: tl.constexpr, HW_CAST: tl.constexpr):
    """Write one token's [KVH, D] rows of K or V (and their fp8 scales); element d of a row
    goes to dst_off + head * stride_head + dst_cols[d]."""
    mask = mask_h[:, None] & mask_d[None, :]
    x = tl.load(src_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :],
                mask=mask, other=0.0)
    dst = dst_ptr + dst_off + offs_h[:, None] * stride_head + dst_cols[None, :]
    if FP8:
        x = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8)
        scale = tl.math.div_rn(amax, FP8_MAX_C)
        y = kv_values_e4m3(x, scale[:, None], HW_CAST)
        tl.store(dst, y.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_off + offs_h * stride_s_head, scale, mask=mask_h)
    else:
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_v(v_ptr, stride_vt, stride_vh, token, kv_ptr, v_off, offset, stride_slot,
             stride_head, scale_ptr, scale_off, stride_s_head, offs_h, mask_h,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
             FP8: tl.constexpr, HW_CAST: tl.constexpr):
    """Write one token's V rows at slot `offset` of the page block starting at v_off."""
    offs_d = tl.arange(0, BLOCK_D)
    cols = offset * stride_slot + offs_d
    if FP8:  # V blocks are stored transposed: v[offset, d] at flat position d * 64 + offset
        flat = offs_d * PAGE + offset
        cols = (flat // HEAD_DIM) * stride_slot + flat % HEAD_DIM
    _store_rows(v_ptr, stride_vt, stride_vh, token, kv_ptr, v_off, stride_head, cols,
                scale_ptr, scale_off, stride_s_head, offs_h, offs_d, mask_h,
                offs_d < HEAD_DIM, FP8, HW_CAST)


def pool_layer_args(kv: torch.Tensor, kv_scales: torch.Tensor | None,
                    slot_mapping: torch.Tensor, tokens: int, kv_heads: int,
                    head_dim: int) -> tuple[bool, torch.Tensor, tuple]:
    """Check a layer view of a pool (and its fp8 scales) and the slots of `tokens` tokens of
    [kv_heads, head_dim] rows; (fp8, the scales argument, its four strides) for a launch."""
    num_pages = kv.shape[0]
    check_shape("kv", kv, (num_pages, PAGE_SIZE, 2, kv_heads, head_dim))
    check_dtype("kv", kv, FLOAT_DTYPES + (FP8_DTYPE,))
    check_last_dim_contiguous("kv", kv)
    check_shape("slot_mapping", slot_mapping, (tokens,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    if not check_kv_scales(kv, kv_scales, (num_pages, PAGE_SIZE, 2, kv_heads)):
        return False, kv.new_empty(0, dtype=torch.float32), (0, 0, 0, 0)
    return True, kv_scales, kv_scales.stride()


@triton.jit
def _store_kernel(k_ptr, v_ptr, kv_ptr, scale_ptr, slot_ptr,
                  stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_page, stride_slot, stride_kv, stride_head,
                  stride_s_page, stride_s_slot, stride_s_kv, stride_s_head,
                  KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                  HW_CAST: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    offset = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < KV_HEADS
    mask_d = offs_d < HEAD_DIM
    page_off = page * stride_page
    scale_off = page * stride_s_page + offset * stride_s_slot
    _store_rows(k_ptr, stride_kt, stride_kh, token, kv_ptr, page_off, stride_head,
                offset * stride_slot + offs_d, scale_ptr, scale_off, stride_s_head, offs_h,
                offs_d, mask_h, mask_d, FP8, HW_CAST)
    _store_v(v_ptr, stride_vt, stride_vh, token, kv_ptr, page_off + stride_kv, offset,
             stride_slot, stride_head, scale_ptr, scale_off + stride_s_kv, stride_s_head,
             offs_h, mask_h, HEAD_DIM, BLOCK_D, PAGE, FP8, HW_CAST)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
             slot_mapping: torch.Tensor) -> None:
    """Write k and v into one layer of a paged KV pool, in place.

    k, v         [T, KVH, D] float32/float16/bfloat16 (any strides with the last dim
                 contiguous, e.g. views of a fused QKV projection).
    kv           [num_pages, 64, 2, KVH, D]: the layer view `pool.data[:, layer]` (index 0 of
                 the third dim is K, 1 is V); any float dtype, or float8_e4m3fn.
    kv_scales    [num_pages, 64, 2, KVH] float32 (`pool.scales[:, layer]`) for fp8 pools,
                 which receive per-(token, K/V, head) scales amax / 448; None otherwise.
    slot_mapping [T] int64 (or int32) page * 64 + offset; negative entries are skipped.
    Non-fp8 pools receive k/v cast to the pool dtype; fp8 pools store each page's V block
    of a head transposed (`fp8_v_stored`).
    """
    tokens, kv_heads, head_dim = k.shape
    check_device(k, v, kv, kv_scales, slot_mapping)
    check_shape("v", v, tuple(k.shape))
    check_dtype("k", k, FLOAT_DTYPES)
    check_dtype("v", v, FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    fp8, scales, s_strides = pool_layer_args(kv, kv_scales, slot_mapping, tokens, kv_heads,
                                             head_dim)
    if tokens == 0:
        return
    _store_kernel[(tokens,)](
        k, v, kv, scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), *s_strides,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim), PAGE=PAGE_SIZE, FP8=fp8,
        HW_CAST=fp8 and hardware_fp8_cast(kv.device), num_warps=4)

"""RoPE and the KV page store in one kernel: rotate q into a new tensor, rotate k and write it
with v into one layer of a paged pool.

Apart, `apply_rope` writes the rotated k to memory and `store_kv` reads it back, in two
launches per layer. Here one program per token rotates its q heads (written out: the
attention kernels read q from memory) and its k heads, which go straight from registers into
the token's slot with v. On an H200 (`kernels_bench.py --only rope_store`, Llama-3-8B heads)
a decode step's 512 tokens take 28.6 us against 53.3 us for the two kernels with fp8 KV, an
8k-token prompt batch 116 against 142 us; rotating q and storing k/v in two programs per
token, side by side, are slower (30.6 and 133 us).

The arithmetic is that of the two kernels in sequence: k is rotated in float32 and rounded to
the activation dtype before it is stored (or, for fp8 pools, before its row scale amax / 448
is taken and it is quantized), so the pool and q_out are bit-identical to `apply_rope`
followed by `store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    FP8_MAX_C,
    PAGE_SIZE,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_output,
    check_shape,
    hardware_fp8_cast,
    kv_values_e4m3,
    next_pow2,
)
from .kv_store import _store_v, pool_layer_args
from .rope import _rotate_heads, _table_rows, check_rope_tables, rotate_halves


@triton.jit
def _store_part(y, kv_ptr, offsets, mask, scale, FP8: tl.constexpr, HW_CAST: tl.constexpr):
    """Store a column range `y` [BLOCK_H, cols] of rotated k rows at kv_ptr + offsets,
    quantized with the rows' `scale` [BLOCK_H] for fp8 pools."""
    if FP8:
        y = kv_values_e4m3(y, scale[:, None], HW_CAST)
    tl.store(kv_ptr + offsets, y.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kernel(
        q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, scale_ptr, slot_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_qot, stride_qoh, stride_cos, stride_sin,
        stride_page, stride_slot, stride_kv, stride_head,
        stride_s_page, stride_s_slot, stride_s_kv, stride_s_head, q_heads,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        BLOCK_QH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
        REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, FP8: tl.constexpr, HW_CAST: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2 = _table_rows(pos_ptr, cos_ptr, sin_ptr, token, stride_cos,
                                         stride_sin, HALF, BLOCK_R)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh,
                  q_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_QH, BLOCK_R, REST, BLOCK_REST)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding: nothing to store
        return
    page = slot // PAGE
    offset = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < KV_HEADS
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < HALF
    page_off = page * stride_page
    scale_off = page * stride_s_page + offset * stride_s_slot

    # k: both rotated halves (rounded to the activation dtype, as apply_rope writes them) and
    # the unrotated rest, then one scale per head over all three.
    mask = mask_h[:, None] & mask_r[None, :]
    src = k_ptr + token * stride_kt + offs_h[:, None] * stride_kh
    x1 = tl.load(src + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    act = k_ptr.dtype.element_ty
    y1, y2 = rotate_halves(x1, x2, cos1, cos2, sin1, sin2)
    y1, y2 = y1.to(act).to(tl.float32), y2.to(act).to(tl.float32)
    offs_p = tl.arange(0, BLOCK_REST)
    mask_p = mask_h[:, None] & (offs_p < REST)[None, :]
    rest = tl.zeros([BLOCK_H, BLOCK_REST], tl.float32)
    if REST > 0:
        rest = tl.load(src + 2 * HALF + offs_p[None, :], mask=mask_p, other=0.0).to(tl.float32)
    scale = tl.zeros([BLOCK_H], tl.float32)
    if FP8:
        amax = tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1))
        if REST > 0:
            amax = tl.maximum(amax, tl.max(tl.abs(rest), axis=1))
        scale = tl.math.div_rn(tl.maximum(amax, 1e-8), FP8_MAX_C)
        tl.store(scale_ptr + scale_off + offs_h * stride_s_head, scale, mask=mask_h)
    row = page_off + offs_h[:, None] * stride_head + offset * stride_slot
    _store_part(y1, kv_ptr, row + offs_r[None, :], mask, scale, FP8, HW_CAST)
    _store_part(y2, kv_ptr, row + HALF + offs_r[None, :], mask, scale, FP8, HW_CAST)
    if REST > 0:
        _store_part(rest, kv_ptr, row + 2 * HALF + offs_p[None, :], mask_p, scale, FP8, HW_CAST)

    _store_v(v_ptr, stride_vt, stride_vh, token, kv_ptr, page_off + stride_kv, offset,
             stride_slot, stride_head, scale_ptr, scale_off + stride_s_kv, stride_s_head,
             offs_h, mask_h, HEAD_DIM, BLOCK_D, PAGE, FP8, HW_CAST)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                  kv_scales: torch.Tensor | None, slot_mapping: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """`apply_rope(q, k, ...)` then `store_kv(k, v, ...)` in one launch; returns rotated q.

    q            [T, H, D] float32/float16/bfloat16 (any token/head strides, last dim
                 contiguous: views of a fused QKV projection work).
    k, v         [T, KVH, D] of q's dtype, same rules.
    positions    [T] int32/int64, each < max_pos.
    cos, sin     [max_pos, rot_dim] float tables (rot_dim even, <= D), last dim contiguous;
                 the first rot_dim features of each q and k head are rotated (rotate-half).
    kv           [num_pages, 64, 2, KVH, D]: one layer's view `pool.data[:, layer]`; any
                 float dtype, or float8_e4m3fn (V blocks stored transposed, as store_kv).
    kv_scales    [num_pages, 64, 2, KVH] float32 for fp8 pools, else None.
    slot_mapping [T] int64/int32 page * 64 + offset; negative entries are not stored.
    q_out        optional [T, H, D] of q's dtype (last dim contiguous) for the rotated q.
    Returns q_out. The rotated k is not returned: it lives in the pool.
    """
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    check_device(q, k, v, positions, cos, sin, kv, kv_scales, slot_mapping, q_out)
    check_dtype("q", q, FLOAT_DTYPES)
    check_shape("k", k, (tokens, kv_heads, head_dim))
    check_shape("v", v, (tokens, kv_heads, head_dim))
    if not (k.dtype == q.dtype and v.dtype == q.dtype):
        raise TypeError("q, k and v must share a dtype")
    rot_dim = check_rope_tables(positions, cos, sin, tokens, head_dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    fp8, scales, s_strides = pool_layer_args(kv, kv_scales, slot_mapping, tokens, kv_heads,
                                             head_dim)
    if q_out is None:
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_output("q_out", q_out, tuple(q.shape), q.dtype)
    if tokens == 0:
        return q_out
    half, rest = rot_dim // 2, head_dim - rot_dim
    _rope_store_kernel[(tokens,)](
        q, k, v, q_out, positions, cos, sin, kv, scales, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos.stride(0), sin.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), *s_strides, q_heads,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_QH=next_pow2(q_heads),
        BLOCK_H=next_pow2(kv_heads), BLOCK_R=next_pow2(half), REST=rest,
        BLOCK_REST=next_pow2(rest), BLOCK_D=next_pow2(head_dim), PAGE=PAGE_SIZE, FP8=fp8,
        HW_CAST=fp8 and hardware_fp8_cast(kv.device), num_warps=4)
    return q_out

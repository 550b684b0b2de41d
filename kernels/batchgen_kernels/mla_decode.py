"""Paged MLA decode attention (DeepSeek-V2/V3 absorbed path) over the latent KV cache.

Each cached token holds one vector `[latent c (C) | rotated k_pe (R)]` (C + R = 512 + 64 for
DeepSeek-V3) shared by every head: keys are the whole vector, values its first C entries. With
W_UK folded into the query (q_nope_absorbed = q_nope W_UK) the scores are
    s = (q_nope_absorbed . c + q_pe . k_pe) * sm_scale
and the output softmax(s) @ c is the latent-space output, before W_UV.

One program owns (sequence, block of BLOCK_H heads, split). All heads read the same KV (MQA
with H query heads), so a program loads each BLOCK_N-key tile of c once and uses it both as
keys (c . q_nope) and as values (p @ c); the rope part is a second, narrow dot. BLOCK_H is at
least 16 because `tl.dot` needs M >= 16. Online softmax in base 2, as the GQA decode kernel.

Split-K: a sequence's key tiles are cut into `num_splits` equal ranges *of its own length*
(read on the device, so the split is balanced per sequence and nothing syncs with the host,
which CUDA graphs need); each split writes a partial (log-sum-exp, normalised output) and the
GQA kernel's reduce merges them. With one split the first kernel finishes the softmax itself.
fp8 pools keep one float32 scale per token (the whole C + R vector shares it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    LOG2E,
    PAGE_SIZE,
    check_device,
    check_dtype,
    check_kv_scales,
    check_last_dim_contiguous,
    check_output,
    check_page_table,
    check_shape,
    dot,
    finish_softmax,
    next_pow2,
    sm_count,
    use_f32_dot,
)

# The split merge is the GQA decode kernel's: same partial layout [B, H, S, D], no sinks.
from .decode_attention import merge_splits

MAX_SPLITS = 16
"""The merge holds a [splits, C] float32 tile per program; 16 x 512 keeps it in registers."""


@triton.jit(do_not_specialize=["num_splits", "stride_pt"])  # one variant for every batch
def _mla_decode_kernel(
        q_nope_ptr, q_pe_ptr, kv_ptr, scale_ptr, page_table_ptr, context_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, sm_scale, num_splits,
        stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_ob, stride_oh,
        stride_page, stride_slot, stride_s_page, stride_s_slot, stride_pt,
        HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, FP8: tl.constexpr,
        F32_DOT: tl.constexpr):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = heads < HEADS
    mask_c = offs_c < LATENT
    mask_r = offs_r < ROPE
    dtype = q_nope_ptr.dtype.element_ty
    q_nope = tl.load(q_nope_ptr + seq * stride_qn_b + heads[:, None] * stride_qn_h
                     + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * stride_qp_b + heads[:, None] * stride_qp_h
                   + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for tile in range(first, last):
        start = tile * BLOCK_N  # BLOCK_N divides PAGE: a tile never straddles two pages
        page = tl.load(page_table_ptr + seq * stride_pt + start // PAGE).to(tl.int64)
        slots = start % PAGE + offs_n
        valid = start + offs_n < ctx
        rows = kv_ptr + page * stride_page + slots * stride_slot  # [BLOCK_N] token rows
        # Masked keys load as zero: unwritten (possibly NaN) slots never reach the dots.
        c = tl.load(rows[:, None] + offs_c[None, :], mask=valid[:, None] & mask_c[None, :],
                    other=0.0).to(dtype)  # [N, C]: keys and values
        k_pe = tl.load(rows[:, None] + LATENT + offs_r[None, :],
                       mask=valid[:, None] & mask_r[None, :], other=0.0).to(dtype)  # [N, R]
        s = dot(q_nope, tl.trans(c), F32_DOT) + dot(q_pe, tl.trans(k_pe), F32_DOT)
        if FP8:
            kv_scale = tl.load(scale_ptr + page * stride_s_page + slots * stride_s_slot,
                               mask=valid, other=0.0)
            s = s * (kv_scale * qk_scale)[None, :]
        else:
            s = s * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every walked tile holds a visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        if FP8:
            prob = prob * kv_scale[None, :]
        acc = acc * alpha[:, None] + dot(prob.to(dtype), c, F32_DOT)
        m_i = m_new

    mask_out = mask_h[:, None] & mask_c[None, :]
    if SPLIT:
        row = (seq * HEADS + heads) * num_splits + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_h)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + row[:, None] * LATENT + offs_c[None, :], o, mask=mask_out)
    else:
        o = finish_softmax(m_i, l_i, acc, 0.0, False)
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_out)


def default_num_splits(batch: int, head_blocks: int, max_tiles: int,
                       device: torch.device) -> int:
    """Enough splits to give every SM about two programs, at most MAX_SPLITS."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    programs = batch * head_blocks
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_tiles, MAX_SPLITS))


def mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                         kv_scales: torch.Tensor | None, page_table: torch.Tensor,
                         context_lens: torch.Tensor, sm_scale: float,
                         num_splits: int | None = None, out: torch.Tensor | None = None,
                         block_h: int = 16, block_n: int = 32, num_warps: int = 4,
                         num_stages: int = 2) -> torch.Tensor:
    """Latent-space attention of one new token per sequence over its paged MLA cache.

    q_nope       [B, H, C] float32/float16/bfloat16: q_nope with W_UK absorbed; row b is
                 sequence b's token at position context_lens[b] - 1. Last dim contiguous.
    q_pe         [B, H, R] q's dtype, the rotated rope part of the query. Last dim contiguous.
    kv           [num_pages, 64, 1, C + R]: one layer's view `pool.data[:, layer]` of an MLA
                 pool, each token `[latent | k_pe]`; float32/float16/bfloat16 or float8_e4m3fn.
    kv_scales    [num_pages, 64, 1] float32 (`pool.scales[:, layer]`), fp8 pools only:
                 value = fp8 * scale.
    page_table   [B, max_pages] int32 page ids; entries past a sequence's pages are not read.
    context_lens [B] int32 KV length including this token, >= 1.
    sm_scale     softmax scale applied to (q_nope . c + q_pe . k_pe).
    num_splits   split-K ranges per sequence (None: chosen from the GPU's SM count).
    out          optional [B, H, C] output buffer of q's dtype.
    block_h, block_n, num_warps, num_stages: launch configuration (heads per program, keys
                 per tile: a power of two dividing 64).
    Returns out  [B, H, C] in q's dtype: softmax(scores) @ latent, before W_UV.
    """
    batch, heads, latent = q_nope.shape
    rope = q_pe.shape[-1]
    num_pages, page, one, width = kv.shape
    device = check_device(q_nope, q_pe, kv, kv_scales, page_table, context_lens, out)
    check_dtype("q_nope", q_nope, FLOAT_DTYPES)
    check_shape("q_pe", q_pe, (batch, heads, rope))
    if q_pe.dtype != q_nope.dtype:
        raise TypeError(f"q_pe dtype {q_pe.dtype} != q_nope dtype {q_nope.dtype}")
    check_dtype("kv", kv, FLOAT_DTYPES + (FP8_DTYPE,))
    if (page, one, width) != (PAGE_SIZE, 1, latent + rope):
        raise ValueError(f"kv shape {tuple(kv.shape)}: expected "
                         f"[pages, {PAGE_SIZE}, 1, {latent} + {rope}]")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv", kv)):
        check_last_dim_contiguous(name, t)
    fp8 = check_kv_scales(kv, kv_scales, (num_pages, page, 1))
    check_shape("context_lens", context_lens, (batch,))
    check_dtype("context_lens", context_lens, (torch.int32,))
    check_page_table(page_table, batch)
    if not (block_n >= 16 and PAGE_SIZE % block_n == 0 and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n {block_n} must be a power of two in [16, {PAGE_SIZE}]")
    if not (block_h >= 16 and block_h & (block_h - 1) == 0):
        raise ValueError(f"block_h {block_h}: power of 2 >= 16")
    if out is None:
        out = torch.empty_like(q_nope)
    check_output("out", out, (batch, heads, latent), q_nope.dtype)
    if batch == 0:
        return out

    head_blocks = triton.cdiv(heads, block_h)
    max_tiles = page_table.shape[1] * (PAGE_SIZE // block_n)
    if num_splits is None:
        num_splits = default_num_splits(batch, head_blocks, max_tiles, device)
    num_splits = max(1, min(num_splits, max_tiles, MAX_SPLITS))
    split = num_splits > 1
    part_out = part_lse = out
    if split:
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device)
        part_out = torch.empty(batch, heads, num_splits, latent, dtype=torch.float32,
                               device=device)
    scales = kv_scales if fp8 else kv.new_empty(0, dtype=torch.float32)
    s_strides = (scales.stride(0), scales.stride(1)) if fp8 else (0, 0)
    _mla_decode_kernel[(batch, head_blocks, num_splits)](
        q_nope, q_pe, kv, scales, page_table, context_lens, out, part_out, part_lse,
        sm_scale, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), kv.stride(0), kv.stride(1), *s_strides,
        page_table.stride(0),
        HEADS=heads, LATENT=latent, ROPE=rope, BLOCK_H=block_h,
        BLOCK_C=max(16, next_pow2(latent)), BLOCK_R=max(16, next_pow2(rope)), BLOCK_N=block_n,
        PAGE=PAGE_SIZE, SPLIT=split, FP8=fp8, F32_DOT=use_f32_dot(q_nope.dtype),
        num_warps=num_warps, num_stages=num_stages)
    if split:
        merge_splits(part_out, part_lse, None, out, num_splits)
    return out

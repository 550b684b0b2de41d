"""Paged prefill attention over packed variable-length sequences (flash-attention style).

One program owns BLOCK_M rows of one sequence, a row being a (query token, query head) pair.
With fp8 pools a program's heads are the whole GQA group sharing one KV head, token-major (row
r is token r // GROUP, head r % GROUP of the group): each page is then converted to float16
once for the group rather than once per head, 1.26x faster at 8 x 1000 tokens on an H200
(173 -> 217 TFLOP/s). With float pools (bf16/fp16/fp32) nothing is converted and one head
per program is faster (283 vs 269 TFLOP/s): rows are tokens of one head.

The query tokens sit at the end of the sequence's context (the prefix, cached earlier, comes
first), so token i of a sequence with q_len tokens and ctx keys is at position ctx - q_len + i
and sees keys 0..position (and only the last `window` of them with a sliding window). The
program walks only the pages its rows could see, a page (64 keys) at a time, with an online
softmax in base 2: first the pages every row sees whole (no masks computed), then those
straddling the causal boundary (or, with a window, every page). K/V come from the pages, so
this step's tokens must be stored first (kv_store). With fp8 pools both dots run in float16
(`dot_dtype`): e4m3 -> bf16 costs a float32 detour per value.

The grid is sized by the longest query; programs past their sequence's end return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    PAGE_SIZE,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_output,
    check_page_table,
    check_paged_kv,
    check_shape,
    check_sinks_and_window,
    dot,
    finish_softmax,
    load_page_kv,
    next_pow2,
    tl_dot_dtype,
    use_f32_dot,
)


@triton.jit
def _attend_page(acc, m_i, l_i, q, p, hi, q_pos, window, kv_ptr, scale_ptr, page_table_ptr,
                 kv_base, scale_base, offs_n, offs_d, mask_d, qk_scale,
                 stride_page, stride_slot, stride_kv, stride_s_page, stride_s_slot, stride_s_kv,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                 F32_DOT: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One page of the online softmax. Unless MASKED, every key of page p is visible to every
    row (the caller checked), so no key bound, causal or window mask is computed."""
    page = tl.load(page_table_ptr + p).to(tl.int64)
    keys = p * PAGE + offs_n
    mask_n = keys < hi if MASKED else offs_n < PAGE
    k_t, v, k_scale, v_scale = load_page_kv(
        kv_ptr, scale_ptr, page * stride_page + kv_base, page * stride_s_page + scale_base,
        offs_n, offs_d, mask_n, mask_d, stride_slot, stride_kv, stride_s_slot, stride_s_kv,
        q.dtype, FP8, HEAD_DIM, PAGE)  # q arrives in the dot dtype
    s = dot(q, k_t, F32_DOT)
    if FP8:
        s = s * (k_scale * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        visible = keys[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible &= keys[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    # A row may see nothing on this page yet (window); keep its running max at 0 then,
    # so exp2(-inf - m) stays 0 instead of NaN.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    prob = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(prob, axis=1)
    if FP8:
        prob = prob * v_scale[None, :]
    acc = acc * alpha[:, None] + dot(prob.to(v.dtype), v, F32_DOT)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_pt"])  # one variant for any page table width
def _prefill_kernel(
        q_ptr, kv_ptr, scale_ptr, cu_seqlens_ptr, context_lens_ptr, page_table_ptr, sinks_ptr,
        out_ptr, sm_scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_page, stride_slot, stride_kv, stride_head,
        stride_s_page, stride_s_slot, stride_s_kv, stride_s_head, stride_pt,
        GROUP: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
        DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr, MIN_Q_LEN: tl.constexpr):
    block = tl.program_id(0)
    seq = tl.program_id(1)
    head_block = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    H: tl.constexpr = HEADS_PER_PROGRAM  # rows per query token
    if (block * BLOCK_M >= q_len * H) | (q_len < MIN_Q_LEN):
        return
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, PAGE)
    mask_m = offs_m < q_len * H
    mask_d = offs_d < HEAD_DIM
    tokens = q_start + offs_m // H
    heads = head_block * H + offs_m % H
    kv_head = (head_block * H) // GROUP
    q_pos = ctx - q_len + offs_m // H
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    qk_scale = sm_scale * LOG2E

    first_pos = ctx - q_len + (block * BLOCK_M) // H
    # one past the block's last visible key: its last row's position + 1
    hi = tl.minimum(ctx - q_len + (block * BLOCK_M + BLOCK_M - 1) // H + 1, ctx)
    lo = 0
    # Pages below `full_end` hold only keys every row of the block sees: the first row sits
    # at first_pos. A window hides early keys from late rows, so with one every page is masked.
    full_end = 0 if HAS_WINDOW else (first_pos + 1) // PAGE
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = page_table_ptr + seq * stride_pt
    kv_base = kv_head * stride_head
    scale_base = kv_head * stride_s_head
    for p in range(full_end):
        acc, m_i, l_i = _attend_page(
            acc, m_i, l_i, q, p, hi, q_pos, window, kv_ptr, scale_ptr, table, kv_base,
            scale_base, offs_n, offs_d, mask_d, qk_scale, stride_page, stride_slot, stride_kv,
            stride_s_page, stride_s_slot, stride_s_kv, HEAD_DIM, PAGE, FP8, F32_DOT,
            False, HAS_WINDOW)
    for p in range(tl.maximum(lo // PAGE, full_end), tl.cdiv(hi, PAGE)):
        acc, m_i, l_i = _attend_page(
            acc, m_i, l_i, q, p, hi, q_pos, window, kv_ptr, scale_ptr, table, kv_base,
            scale_base, offs_n, offs_d, mask_d, qk_scale, stride_page, stride_slot, stride_kv,
            stride_s_page, stride_s_slot, stride_s_kv, HEAD_DIM, PAGE, FP8, F32_DOT,
            True, HAS_WINDOW)

    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask_m, other=0.0).to(tl.float32) * LOG2E
    o = finish_softmax(m_i, l_i, acc, sink, HAS_SINKS)
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# Rows per program and warps/stages by pool dtype: the best of 32-128 x 2-8 x 1-3 on an H200
# at 8 x 1000 tokens (`kernels_bench.py --only prefill_sweep`).
# group_heads: a program's rows are the GQA group's heads of its tokens (else one head's tokens).
LAUNCH = {"float": {"block_m": 64, "num_warps": 4, "num_stages": 2, "group_heads": False},
          "fp8": {"block_m": 64, "num_warps": 4, "num_stages": 1, "group_heads": True}}


def paged_prefill_attention(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            page_table: torch.Tensor, sm_scale: float, max_q_len: int,
                            window: int | None = None, sinks: torch.Tensor | None = None,
                            block_m: int | None = None, out: torch.Tensor | None = None,
                            skip_one_row: bool = False) -> torch.Tensor:
    """Causal attention of packed query rows over their sequences' paged KV.

    q            [T, H, D] float32/float16/bfloat16, sequences packed back to back; last dim
                 contiguous.
    kv           [num_pages, 64, 2, KVH, D]: one layer's view `pool.data[:, layer]` (index 0 of
                 the third dim is K, 1 is V), holding every key up to context_lens (this
                 step's too); float32/float16/bfloat16 or float8_e4m3fn (whose V blocks
                 are stored transposed: `_common.fp8_v_stored`).
    kv_scales    [num_pages, 64, 2, KVH] float32 for fp8 pools (value = fp8 * scale), else None.
    cu_seqlens_q [B+1] int32 prefix sums of query lengths (q_len >= 1 each).
    context_lens [B] int32 KV length of each sequence including its query rows.
    page_table   [B, max_pages] int32 page ids.
    sm_scale     softmax scale applied to q.k.
    max_q_len    the largest q_len in the batch (host int: sizes the grid without a sync).
    window       sliding window: key j is visible from position i iff i - window < j <= i.
    sinks        [H] per-head sink logits (not scaled by sm_scale), or None.
    block_m      rows ((query token, head) pairs) per program, a power of two >= 16 (None:
                 LAUNCH's).
    out          optional [T, H, D] output buffer of q's dtype.
    skip_one_row leave the rows of one-row sequences unwritten: the caller attends them with
                 paged_decode_attention, which reads each KV page once per group of query
                 heads instead of once per head in a mostly empty BLOCK_M tile.
    Returns out  [T, H, D] in q's dtype. Head h reads KV head h // (H // KVH).
    """
    tokens, heads, head_dim = q.shape
    num_pages, page, two, kv_heads, kv_dim = kv.shape
    batch = context_lens.shape[0]
    check_device(q, kv, kv_scales, cu_seqlens_q, context_lens, page_table, sinks, out)
    fp8 = check_paged_kv(q, kv, kv_scales)
    check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        check_dtype(name, t, (torch.int32,))
        check_last_dim_contiguous(name, t)
    check_page_table(page_table, batch)
    check_sinks_and_window(sinks, heads, window)
    launch = dict(LAUNCH["fp8" if fp8 else "float"])
    default_block_m, group_heads = launch.pop("block_m"), launch.pop("group_heads")
    block_m = block_m or default_block_m
    if not (block_m >= 16 and block_m == next_pow2(block_m)):
        raise ValueError("block_m: a power of two >= 16")
    if out is None:
        out = torch.empty_like(q)
    check_output("out", out, tuple(q.shape), q.dtype)
    if tokens == 0 or batch == 0:
        return out

    scales = kv_scales if fp8 else kv.new_empty(0, dtype=torch.float32)
    s_strides = scales.stride() if fp8 else (0, 0, 0, 0)
    group = heads // kv_heads
    heads_per_program = group if group_heads else 1
    grid = (triton.cdiv(max_q_len * heads_per_program, block_m), batch,
            heads // heads_per_program)
    _prefill_kernel[grid](
        q, kv, scales, cu_seqlens_q, context_lens, page_table,
        sinks if sinks is not None else q, out, sm_scale, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), *s_strides,
        page_table.stride(0),
        GROUP=group, HEADS_PER_PROGRAM=heads_per_program, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(head_dim)), PAGE=PAGE_SIZE,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, FP8=fp8,
        DOT_DTYPE=tl_dot_dtype(q.dtype, fp8), F32_DOT=use_f32_dot(q.dtype),
        MIN_Q_LEN=2 if skip_one_row else 1, **launch)
    return out

"""Paged decode attention: one query token per sequence against its paged KV.

One program owns (sequence, KV head, split) and processes the whole GQA group of query heads
that share the KV head, so each K/V page is read from memory once per group rather than once
per query head; the group is padded to 16 rows because `tl.dot` needs M >= 16. Decode is
bandwidth-bound, so the padding costs nothing that matters.

The KV heads of a sequence are the grid's fastest axis: their programs run side by side and
together read each page's block of every head (contiguous in the pool) at about the same
time, 2-4% faster on an H200 than sequences first (`kernels_bench.py --only decode`).

The context is walked a page (64 keys) at a time with an online softmax in base 2. With few
sequences there are too few programs to fill the GPU, so the visible pages are cut into
`num_splits` ranges: each program writes a partial (log-sum-exp, normalised output) and
`_reduce_kernel` merges them; with one split the first kernel finishes the softmax itself.
A sliding window only changes which pages are walked; sinks enter at the final normalisation.
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
    check_output,
    check_page_table,
    check_paged_kv,
    check_shape,
    check_sinks_and_window,
    dot,
    finish_softmax,
    load_page_kv,
    next_pow2,
    sm_count,
    tl_dot_dtype,
    use_f32_dot,
)


# Batch-dependent ints (split sizes, the page table's width) would each compile a variant
# per divisibility class (Triton specialises ints on == 1 and % 16): a JIT pause mid-job.
@triton.jit(do_not_specialize=["pages_per_split", "num_splits", "stride_pt"])
def _decode_kernel(
        q_ptr, kv_ptr, scale_ptr, page_table_ptr, context_lens_ptr, sinks_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        sm_scale, window, pages_per_split, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_page, stride_slot, stride_kv, stride_head,
        stride_s_page, stride_s_slot, stride_s_kv, stride_s_head, stride_pt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
        DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr, MERGE_PARTS: tl.constexpr = False):
    """SPLIT: write this split's partial to part_out/part_lse ([B, H, num_splits] slots).
    MERGE_PARTS (unsplit only): before the final normalisation, fold in `num_splits` partials
    that another kernel wrote for the same (row, head) into part_out/part_lse (the shared
    prefix's, `shared_prefix_attention`), so no separate merge kernel runs."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)  # the query sits at ctx - 1; keys j > ctx-1-window
    first = lo // PAGE + split * pages_per_split
    last = tl.minimum(first + pages_per_split, tl.cdiv(ctx, PAGE))

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, PAGE)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    qk_scale = sm_scale * LOG2E

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for p in range(first, last):
        page = tl.load(page_table_ptr + seq * stride_pt + p).to(tl.int64)
        keys = p * PAGE + offs_n
        valid = (keys >= lo) & (keys < ctx)
        k_t, v, k_scale, v_scale = load_page_kv(
            kv_ptr, scale_ptr, page * stride_page + kv_head * stride_head,
            page * stride_s_page + kv_head * stride_s_head, offs_n, offs_d, valid, mask_d,
            stride_slot, stride_kv, stride_s_slot, stride_s_kv, DOT_DTYPE, FP8,
            HEAD_DIM, PAGE)
        s = dot(q, k_t, F32_DOT) * (k_scale * qk_scale)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every walked page holds a visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        prob = prob * v_scale[None, :]
        acc = acc * alpha[:, None] + dot(prob.to(v.dtype), v, F32_DOT)
        m_i = m_new

    if SPLIT:
        row = (seq * (GROUP * tl.num_programs(0)) + heads) * num_splits + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=mask_g[:, None] & mask_d[None, :])
    else:
        if MERGE_PARTS:
            m_i, l_i, acc = _fold_parts(
                m_i, l_i, acc, part_out_ptr, part_lse_ptr,
                (seq * (GROUP * tl.num_programs(0)) + heads) * num_splits, num_splits,
                mask_g, offs_d, mask_d, HEAD_DIM)
        sink = 0.0
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=mask_g, other=0.0).to(tl.float32) * LOG2E
        o = finish_softmax(m_i, l_i, acc, sink, HAS_SINKS)
        o_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _fold_parts(m_i, l_i, acc, part_out_ptr, part_lse_ptr, first, count, mask_g, offs_d, mask_d,
                HEAD_DIM: tl.constexpr):
    """Online-softmax state (m_i, l_i, acc: unnormalised) merged with `count` normalised
    partials (log2-sum-exp, output) per row, stored from slot `first` [BLOCK_G] on. A partial
    with lse = -inf weighs nothing; a state with no key yet (m_i = -inf) takes the partials'."""
    for j in range(count):
        lse = tl.load(part_lse_ptr + first + j, mask=mask_g, other=float("-inf"))
        o = tl.load(part_out_ptr + (first + j)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        weight = tl.exp2(lse - m_safe)
        l_i = l_i * alpha + weight
        acc = acc * alpha[:, None] + o * weight[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, num_splits,
                   stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, HEADS: tl.constexpr):
    # One program merges HEADS heads of one row: a program per (row, head) spent more time
    # being scheduled than merging (55 us a layer at batch 512 x 32 heads).
    seq = tl.program_id(0)
    num_heads = tl.num_programs(1) * HEADS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    for i in tl.static_range(HEADS):
        head = tl.program_id(1) * HEADS + i
        row0 = (seq * num_heads + head) * num_splits
        lse = tl.load(part_lse_ptr + row0 + offs_s, mask=mask_s, other=float("-inf"))
        o = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        # Re-weight each split's normalised output by its share of the total mass; empty
        # splits carry lse = -inf and weigh nothing. At least one split is non-empty.
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - m)
        l = tl.sum(w, axis=0)
        acc = tl.sum(o * w[:, None], axis=0)
        # finish_softmax works on row blocks; this iteration owns a single row.
        sink = 0.0
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head + tl.zeros([1], tl.int32)).to(tl.float32) * LOG2E
        out = finish_softmax(m + tl.zeros([1], tl.float32), l + tl.zeros([1], tl.float32),
                             acc[None, :], sink, HAS_SINKS)
        o_ptrs = out_ptr + seq * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d[None, :])


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, sinks: torch.Tensor | None,
                 out: torch.Tensor, num_splits: int) -> None:
    """Merge the split-K partials `part_out` [B, H, S, D] / `part_lse` [B, H, S] (float32,
    contiguous; log2 sum-exp per split) into `out` [B, H, D] (last dim contiguous), with the
    per-head `sinks` [H] when given. Internal: the launchers check the shapes."""
    batch, heads, head_dim = out.shape
    widest = max(1, 1024 // next_pow2(head_dim))  # MLA's 512-wide latents: 2 heads a program
    per_program = next(h for h in (8, 4, 2, 1) if heads % h == 0 and h <= widest)
    _reduce_kernel[(batch, heads // per_program)](
        part_out, part_lse, sinks if sinks is not None else out, out, num_splits,
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_S=reduce_block(num_splits),
        BLOCK_D=next_pow2(head_dim), HAS_SINKS=sinks is not None, HEADS=per_program,
        num_warps=4)


# Warps/stages of the decode kernel: the best of 2/4/8 warps x 1-4 stages on an H200 for
# bf16 KV, and again for fp8 KV with f16 dots (`kernels_bench.py --only decode_sweep`).
# fp8 pools store V transposed (`load_page_kv`), which took the fp8 kernel's page loop from
# 1,092 to ~800 instructions (`benchmarks/sass_report.py`) and 255 to 202 registers: 3.0 ->
# 3.3 TB/s at batch 512. With that, one warp per program is faster still
# (3.53-3.66 TB/s at batch 512) once there are programs enough to fill every SM several times
# over, and slower below (batch 48-64 at ctx 1k: 1.09-1.52 against 1.16-1.58); between, the
# two trade places within 10%. Measured slower than this kernel (docs/performance.md,
# "Measured and not adopted"): 2-4 pages or 16-32-key chunks per iteration; register caps;
# prefetching the next page into registers; evict-first loads; K loaded token-major; e4m3
# tensor-core dots (also 2.7% off the reference).
FP8_LAUNCH = {"num_warps": 2, "num_stages": 2}
FP8_FULL_LAUNCH = {"num_warps": 1, "num_stages": 2}
FP8_FULL_PROGRAMS_PER_SM = 5
"""fp8 KV takes FP8_FULL_LAUNCH from this many programs per SM on."""
BF16_LAUNCH = {"num_warps": 2, "num_stages": 2}


def launch_config(fp8: bool, programs: int, device: torch.device) -> dict:
    """num_warps/num_stages for a launch of `programs` decode programs."""
    if not fp8:
        return BF16_LAUNCH
    if device.type == "cuda" and programs >= FP8_FULL_PROGRAMS_PER_SM * sm_count(device):
        return FP8_FULL_LAUNCH
    return FP8_LAUNCH


def reduce_block(num_splits: int) -> int:
    """The merge's split tile: at least 16, so the batch-dependent split count compiles at
    most three variants of the merge (16/32/64) instead of one per power of two."""
    return max(16, next_pow2(num_splits))


def default_num_splits(batch: int, kv_heads: int, max_pages: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, keeping >= 2 pages per split."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    programs = batch * kv_heads
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_pages // 2, 64))


def paged_decode_attention(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
                           page_table: torch.Tensor, context_lens: torch.Tensor, sm_scale: float,
                           window: int | None = None, sinks: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV (stored before the call).

    q            [B, H, D] float32/float16/bfloat16; row b is sequence b's token at position
                 context_lens[b] - 1. Last dim contiguous.
    kv           [num_pages, 64, 2, KVH, D]: one layer's view `pool.data[:, layer]` (index 0 of
                 the third dim is K, 1 is V); float32/float16/bfloat16, or float8_e4m3fn
                 (whose V blocks are stored transposed: `_common.fp8_v_stored`).
    kv_scales    [num_pages, 64, 2, KVH] float32 (`pool.scales[:, layer]`), fp8 pools only:
                 value = fp8 * scale.
    page_table   [B, max_pages] int32 page ids; entries past a sequence's pages are not read.
    context_lens [B] int32 KV length including this token, >= 1.
    sm_scale     softmax scale applied to q.k.
    window       sliding window: key j is visible iff j > position - window (None: all keys).
    sinks        [H] per-head sink logits (not scaled by sm_scale), or None.
    num_splits   split-K ranges per sequence (None: chosen from the GPU's SM count).
    out          optional [B, H, D] output buffer of q's dtype.
    Returns out  [B, H, D] in q's dtype. Head h reads KV head h // (H // KVH).
    """
    batch, heads, head_dim = q.shape
    num_pages, page, two, kv_heads, kv_dim = kv.shape
    device = check_device(q, kv, kv_scales, page_table, context_lens, sinks, out)
    fp8 = check_paged_kv(q, kv, kv_scales)
    check_shape("context_lens", context_lens, (batch,))
    check_dtype("context_lens", context_lens, (torch.int32,))
    check_page_table(page_table, batch)
    check_sinks_and_window(sinks, heads, window)
    if out is None:
        out = torch.empty_like(q)
    check_output("out", out, tuple(q.shape), q.dtype)
    if batch == 0:
        return out
    if batch > 65535:
        raise ValueError("batch is the grid's y axis (at most 65535 sequences per call)")

    max_pages = page_table.shape[1]
    if window is not None:  # a window of w keys touches at most w // 64 + 2 pages
        max_pages = min(max_pages, window // PAGE_SIZE + 2)
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_pages, device)
    num_splits = max(1, min(num_splits, max_pages))
    pages_per_split = triton.cdiv(max_pages, num_splits)
    group = heads // kv_heads
    split = num_splits > 1
    part_out = part_lse = out
    if split:
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device)
        part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32,
                               device=device)
    scales = kv_scales if fp8 else kv.new_empty(0, dtype=torch.float32)
    s_strides = scales.stride() if fp8 else (0, 0, 0, 0)
    block_d = max(16, next_pow2(head_dim))
    _decode_kernel[(kv_heads, batch, num_splits)](
        q, kv, scales, page_table, context_lens, sinks if sinks is not None else q,
        out, part_out, part_lse,
        sm_scale, window or 0, pages_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), *s_strides,
        page_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d,
        PAGE=PAGE_SIZE, SPLIT=split, HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, FP8=fp8, DOT_DTYPE=tl_dot_dtype(q.dtype, fp8),
        F32_DOT=use_f32_dot(q.dtype),
        **launch_config(fp8, batch * kv_heads * num_splits, device))
    if split:
        merge_splits(part_out, part_lse, sinks, out, num_splits)
    return out

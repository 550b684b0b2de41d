"""Shared-prefix (cascade) decode attention: prefix pages read once per group of sequences.

When running sequences share their first KV pages (a common system prompt, the n samples of one
prompt), a decode step splits each sequence's keys in two: the group's shared prefix (whole
pages) and the sequence's own suffix (the pages after the prefix, the current token among
them). Softmax attention over the union equals a log-sum-exp merge of the attention over each
part, so:

- `_prefix_kernel` takes, per (KV head, row tile, prefix split), a tile of the group's query
  rows (rows x the GQA heads of one KV head, 64 query vectors) against the group's prefix
  pages: a small matmul per page, each prefix page read once per tile rather than once per
  sequence. It writes a partial (log2-sum-exp, normalised output) per (row, head).
- The paged decode kernel (`decode_attention._decode_kernel`) walks each row's own pages. Run
  unsplit (a batch large enough to fill the GPU), it folds the prefix's partials into its own
  softmax state before normalising and writes the output itself; split over the own pages
  (small batches), it writes its partials beside the prefix's and
  `decode_attention.merge_splits` merges them, sinks included.

The result equals the plain paged decode over the concatenated page list (prefix pages, then
own pages) within rounding. Rows in no group get an empty prefix partial (weight zero).

Work assignment is planned on the device by `_plan_kernel` (one program, no host sync): rows
are ordered by group (a counting sort), each group's rows are cut into tiles of
`rows_per_tile`, and tile t of a fixed-size list learns its group and row range by a search
over the groups' tile counts.
Every shape is a function of the metadata tensors' shapes, so a CUDA graph captured once
replays with new metadata written into the same tensors. Tiles past the real ones, and the
pseudo-group of ungrouped rows, walk no pages.

GQA and MHA pools, bfloat16/float16/float32 and float8_e4m3fn KV (per-token scales, V blocks
stored transposed as `_common.fp8_v_stored`) and attention sinks are supported; sliding
windows and MLA latent caches are not (such layers keep the plain kernels).

A decode step that uses it needs, in fixed-shape device buffers (padded to a graph bucket's
batch and a group capacity G, so a captured graph replays with new contents):
- row_group [B] int32: the group of each decode row, -1 for a row sharing nothing (padding
  rows included);
- prefix_pages [G, max_prefix_pages] int32 and prefix_num_pages [G] int32: each group's
  shared pages (whole pages every member holds at the same positions; 0 for unused groups);
- page_table [B, max_own_pages] int32 and suffix_lens [B] int32: each row's pages after its
  group's prefix and the keys in them (the new token included), i.e. the row's plain page
  table and context length shifted by prefix_num_pages[g] pages and that many * 64 keys.
`plan_shared_prefix(row_group, prefix_pages, prefix_num_pages, H // KVH)` runs once per step;
every layer then calls `shared_prefix_decode(q, *pool.layer(i), plan, page_table, suffix_lens,
sm_scale, sinks=...)` after storing the step's K/V as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    LOG2E,
    PAGE_SIZE,
    dot,
    interpreting,
    load_page_kv,
    next_pow2,
    sm_count,
    tl_dot_dtype,
    use_f32_dot,
)
from .decode_attention import (
    _decode_kernel,
    default_num_splits,
    launch_config,
    merge_splits,
)

TILE_QUERIES = 64
"""Query vectors (rows x GQA heads) per prefix tile: the M of the prefix kernel's matmuls."""
PREFIX_LAUNCH = {"num_warps": 4, "num_stages": 2}
MAX_PREFIX_SPLITS = 16
PLAN_TILE_ELEMENTS = 8192
"""Elements of the plan kernel's [groups, rows] comparison tiles (rows per block: this over
the padded group count, 16 to 256)."""


@triton.jit(do_not_specialize=["num_splits", "split_offset", "stride_pp"])
def _prefix_kernel(
        q_ptr, kv_ptr, scale_ptr, prefix_pages_ptr, prefix_num_pages_ptr, member_rows_ptr,
        tile_group_ptr, tile_start_ptr, tile_end_ptr, part_out_ptr, part_lse_ptr,
        sm_scale, num_splits, split_offset,
        stride_qt, stride_qh, stride_page, stride_slot, stride_kv, stride_head,
        stride_s_page, stride_s_slot, stride_s_kv, stride_s_head, stride_pp,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
        DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr):
    kv_head = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.load(tile_group_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    num_pages = tl.load(prefix_num_pages_ptr + group)
    # Each group's own prefix is cut into the splits (a fixed-width buffer, as under CUDA
    # graphs, would leave every page to the first splits).
    pages_per_split = tl.cdiv(num_pages, tl.num_programs(2))
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, num_pages)

    # Query vector m is head (m % GROUP_P2) of the tile's row (m // GROUP_P2).
    offs_m = tl.arange(0, ROWS * GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, PAGE)
    pos = start + offs_m // GROUP_P2
    head_in_group = offs_m % GROUP_P2
    mask_m = (pos < end) & (head_in_group < GROUP)
    mask_d = offs_d < HEAD_DIM
    row = tl.load(member_rows_ptr + pos, mask=pos < end, other=0).to(tl.int64)
    heads = kv_head * GROUP + head_in_group
    q_ptrs = q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    qk_scale = sm_scale * LOG2E
    all_keys = offs_n < PAGE  # prefix pages are full

    m_i = tl.full([ROWS * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS * GROUP_P2], tl.float32)
    acc = tl.zeros([ROWS * GROUP_P2, BLOCK_D], tl.float32)
    for p in range(first, last):
        page = tl.load(prefix_pages_ptr + group * stride_pp + p).to(tl.int64)
        k_t, v, k_scale, v_scale = load_page_kv(
            kv_ptr, scale_ptr, page * stride_page + kv_head * stride_head,
            page * stride_s_page + kv_head * stride_s_head, offs_n, offs_d, all_keys, mask_d,
            stride_slot, stride_kv, stride_s_slot, stride_s_kv, DOT_DTYPE, FP8,
            HEAD_DIM, PAGE)
        s = dot(q, k_t, F32_DOT) * (k_scale * qk_scale)[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        prob = prob * v_scale[None, :]
        acc = acc * alpha[:, None] + dot(prob.to(v.dtype), v, F32_DOT)
        m_i = m_new

    # Partials in the decode kernel's split layout: [row, head, split] with the prefix's
    # splits after the row's own.
    out_row = (row * (GROUP * tl.num_programs(0)) + heads) * num_splits + split_offset + split
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + out_row, lse, mask=mask_m)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(part_out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=mask_m[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize=["batch", "groups", "max_pages", "num_tiles"])
def _plan_kernel(row_group_ptr, num_pages_in_ptr, member_rows_ptr, tile_group_ptr,
                 tile_start_ptr, tile_end_ptr, num_pages_ptr, batch, groups, max_pages,
                 num_tiles, ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """One program: rows ordered by group (a counting sort), then the tile list. Group index
    `groups` collects the rows in no group."""
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g <= groups
    counts = tl.zeros([BLOCK_G], tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        hit = _group_hits(row_group_ptr, b0, batch, groups, offs_g, BLOCK_B)
        counts += tl.sum(hit.to(tl.int32), axis=1)
    starts = tl.cumsum(counts, axis=0) - counts
    filled = starts
    for b0 in range(0, batch, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        hit = _group_hits(row_group_ptr, b0, batch, groups, offs_g, BLOCK_B).to(tl.int32)
        rank = tl.cumsum(hit, axis=1) - hit  # earlier rows of the same group in this block
        pos = tl.sum(hit * (filled[:, None] + rank), axis=0)
        tl.store(member_rows_ptr + pos, offs_b, mask=offs_b < batch)
        filled += tl.sum(hit, axis=1)

    tiles = (counts + ROWS - 1) // ROWS
    tile_ends = tl.cumsum(tiles, axis=0)
    first_tile = tile_ends - tiles
    total = tl.sum(tiles, axis=0)
    for t0 in range(0, num_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        # The tile's group: how many groups end at or before it (a search over tile_ends).
        done = (tile_ends[None, :] <= t[:, None]) & mask_g[None, :]
        group = tl.minimum(tl.sum(done.to(tl.int32), axis=1), groups)
        sel = (offs_g[None, :] == group[:, None]).to(tl.int32)
        group_start = tl.sum(sel * starts[None, :], axis=1)
        group_end = group_start + tl.sum(sel * counts[None, :], axis=1)
        start = group_start + (t - tl.sum(sel * first_tile[None, :], axis=1)) * ROWS
        end = tl.minimum(start + ROWS, group_end)
        spare = t >= total  # past the real tiles: an empty range
        mask_t = t < num_tiles
        tl.store(tile_group_ptr + t, tl.where(spare, groups, group), mask=mask_t)
        tl.store(tile_start_ptr + t, tl.where(spare, 0, start), mask=mask_t)
        tl.store(tile_end_ptr + t, tl.where(spare, 0, end), mask=mask_t)

    pages = tl.load(num_pages_in_ptr + offs_g, mask=offs_g < groups, other=0).to(tl.int32)
    pages = tl.minimum(tl.maximum(pages, 0), max_pages)
    tl.store(num_pages_ptr + offs_g, pages, mask=mask_g)


@triton.jit
def _group_hits(row_group_ptr, b0, batch, groups, offs_g, BLOCK_B: tl.constexpr):
    """[BLOCK_G, BLOCK_B] bool: row b0 + j belongs to group offs_g[i] (a group outside
    [0, groups) counts as `groups`)."""
    offs_b = b0 + tl.arange(0, BLOCK_B)
    mask_b = offs_b < batch
    key = tl.load(row_group_ptr + offs_b, mask=mask_b, other=-1).to(tl.int32)
    key = tl.where((key >= 0) & (key < groups), key, groups)
    return (key[None, :] == offs_g[:, None]) & mask_b[None, :]


@dataclass(frozen=True)
class SharedPrefixPlan:
    """Which rows share which prefix pages, and the prefix kernel's tiles: device tensors of
    fixed shape, built by `plan_shared_prefix` once per decode step and used by every layer."""

    prefix_pages: torch.Tensor
    """[G, max_prefix_pages] int32: group g's shared pages, in order (only the first
    prefix_num_pages[g] entries are read)."""
    prefix_num_pages: torch.Tensor
    """[G + 1] int32: pages in each group's prefix, clamped to [0, max_prefix_pages]; entry G
    (the rows in no group) is 0."""
    member_rows: torch.Tensor
    """[B] int32: batch rows ordered by group, rows in no group last."""
    tile_group: torch.Tensor
    """[T] int32: the group of each prefix tile (G for tiles that walk nothing)."""
    tile_start: torch.Tensor
    """[T] int32: first position in member_rows of each tile."""
    tile_end: torch.Tensor
    """[T] int32: end (exclusive) of each tile's positions in member_rows."""
    rows_per_tile: int
    """Batch rows per tile: TILE_QUERIES // (query heads per KV head, padded to a power of 2),
    at least 1."""


def rows_per_tile(group_size: int) -> int:
    """Batch rows in one prefix tile when `group_size` query heads share a KV head."""
    return max(1, TILE_QUERIES // next_pow2(group_size))


def plan_shared_prefix(row_group: torch.Tensor, prefix_pages: torch.Tensor,
                       prefix_num_pages: torch.Tensor, group_size: int) -> SharedPrefixPlan:
    """The plan of one decode step, computed on the device with no host sync.

    row_group        [B] int32/int64: each row's group in [0, G), or -1 (or any value outside
                     [0, G)) for a row that shares no prefix.
    prefix_pages     [G, max_prefix_pages] int32: each group's shared page ids, G >= 1.
    prefix_num_pages [G] int32/int64: pages in each group's prefix (full pages; 0 allowed).
    group_size       query heads per KV head of the model (H // KVH).
    """
    _check_int_tensor("row_group", row_group, 1)
    _check_int_tensor("prefix_num_pages", prefix_num_pages, 1)
    _check_int_tensor("prefix_pages", prefix_pages, 2, (torch.int32,))
    groups = prefix_pages.shape[0]
    if groups < 1 or prefix_num_pages.shape[0] != groups:
        raise ValueError(f"prefix_pages {tuple(prefix_pages.shape)} and prefix_num_pages "
                         f"{tuple(prefix_num_pages.shape)} must both list the same G >= 1 "
                         "groups (pad unused groups with 0 pages)")
    if prefix_pages.stride(1) != 1:
        raise ValueError("prefix_pages rows must be contiguous (stride 1 along pages)")
    _check_same_device(row_group=row_group, prefix_pages=prefix_pages,
                       prefix_num_pages=prefix_num_pages)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    device, batch = row_group.device, row_group.shape[0]
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{device} tensors need TRITON_INTERPRET=1 (the Triton CPU "
                         "interpreter)")
    rows = rows_per_tile(group_size)
    num_tiles = -(-batch // rows) + groups + 1  # each group's last tile may be partial
    member_rows = torch.empty(batch, dtype=torch.int32, device=device)
    tile_group, tile_start, tile_end = (
        torch.empty(num_tiles, dtype=torch.int32, device=device) for _ in range(3))
    num_pages = torch.empty(groups + 1, dtype=torch.int32, device=device)
    block_g = next_pow2(groups + 1)
    block = max(16, min(256, PLAN_TILE_ELEMENTS // block_g))
    _plan_kernel[(1,)](
        row_group, prefix_num_pages, member_rows, tile_group, tile_start, tile_end, num_pages,
        batch, groups, prefix_pages.shape[1], num_tiles,
        ROWS=rows, BLOCK_G=block_g, BLOCK_B=block, BLOCK_T=block, num_warps=4)
    return SharedPrefixPlan(prefix_pages, num_pages, member_rows, tile_group, tile_start,
                            tile_end, rows)


def default_prefix_splits(plan: SharedPrefixPlan, kv_heads: int, device: torch.device) -> int:
    """Splits of the prefix pages: about two prefix programs for every SM, with
    >= 2 pages per split of the widest prefix the buffer holds (a function of the plan's shapes
    only, so graphs stay valid; each group's own prefix is cut into that many ranges). The
    programs counted are the tiles the batch's rows fill, not the plan's padding tiles (one
    per group of the buffer's capacity), which walk no pages."""
    if device.type != "cuda":
        return 1
    programs = triton.cdiv(plan.member_rows.shape[0], plan.rows_per_tile) * kv_heads
    max_pages = plan.prefix_pages.shape[1]
    # Rounded, not ceiled: at batch 512 (256 programs on 132 SMs) two splits were 2% slower
    # than one; at batch 256 two were 10-15% faster (benchmarks/shared_prefix_bench.py).
    per_sm = (2 * sm_count(device) + programs // 2) // programs
    return max(1, min(per_sm, max_pages // 2, MAX_PREFIX_SPLITS))


def shared_prefix_decode(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
                         plan: SharedPrefixPlan, page_table: torch.Tensor,
                         suffix_lens: torch.Tensor, sm_scale: float,
                         sinks: torch.Tensor | None = None, num_splits: int | None = None,
                         num_prefix_splits: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one new token per row over its group's shared prefix pages followed
    by its own pages: the plain paged decode over the concatenated page list.

    q           [B, H, D] float32/float16/bfloat16, last dim contiguous; row b's token sits at
                position prefix_num_pages[g] * 64 + suffix_lens[b] - 1 (g its group).
    kv          [num_pages, 64, 2, KVH, D]: one layer's view `pool.data[:, layer]`; K at index
                0 of the third dim, V at 1; float32/float16/bfloat16, or float8_e4m3fn with V
                blocks stored transposed (`_common.fp8_v_stored`).
    kv_scales   [num_pages, 64, 2, KVH] float32 (`pool.scales[:, layer]`), fp8 pools only.
    plan        `plan_shared_prefix(row_group, prefix_pages, prefix_num_pages, H // KVH)`
                for this batch (built once per step; its row count must be B).
    page_table  [B, max_own_pages] int32: each row's own pages after the shared prefix (for
                a row in no group: all its pages); rows contiguous.
    suffix_lens [B] int32: keys in each row's own pages, the new token included. Every row
                needs at least one key in all (its prefix or its own pages).
    sm_scale    softmax scale applied to q.k.
    sinks       [H] per-head sink logits (not scaled by sm_scale), or None.
    num_splits  split-K ranges over the own pages (None: chosen from the GPU's SM count).
    num_prefix_splits  ranges the prefix pages are cut into (None: `default_prefix_splits`).
    out         optional [B, H, D] output buffer of q's dtype, last dim contiguous.
    Returns out [B, H, D] in q's dtype. Head h reads KV head h // (H // KVH).

    Shapes, dtypes, devices and strides are checked (ValueError/TypeError); the metadata's
    contents are not (that would sync the host): page ids must lie in [0, num_pages).
    """
    device = _check_inputs(q, kv, kv_scales, plan, page_table, suffix_lens, sinks, out)
    batch, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    fp8 = kv.dtype == FP8_DTYPE
    own_pages = max(1, page_table.shape[1])
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, own_pages, device)
    num_splits = max(1, min(int(num_splits), own_pages))
    prefix_pages = max(1, plan.prefix_pages.shape[1])
    if num_prefix_splits is None:
        num_prefix_splits = default_prefix_splits(plan, kv_heads, device)
    num_prefix_splits = max(1, min(int(num_prefix_splits), prefix_pages))
    # With one own split (the decode batches where sharing pays), the own pages' kernel folds
    # the prefix partials into its softmax and writes `out`; with several, every partial goes
    # to the merge kernel.
    fused = num_splits == 1
    own = 0 if fused else num_splits
    total = own + num_prefix_splits
    part_lse = torch.empty(batch, heads, total, dtype=torch.float32, device=device)
    part_out = torch.empty(batch, heads, total, head_dim, dtype=torch.float32, device=device)
    scales = kv_scales if fp8 else kv.new_empty(0, dtype=torch.float32)
    s_strides = scales.stride() if fp8 else (0, 0, 0, 0)
    group = heads // kv_heads
    block_d = max(16, next_pow2(head_dim))
    dot_dtype, f32_dot = tl_dot_dtype(q.dtype, fp8), use_f32_dot(q.dtype)
    kv_strides = (kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3))
    _prefix_kernel[(kv_heads, plan.tile_group.shape[0], num_prefix_splits)](
        q, kv, scales, plan.prefix_pages, plan.prefix_num_pages, plan.member_rows,
        plan.tile_group, plan.tile_start, plan.tile_end, part_out, part_lse,
        sm_scale, total, own,
        q.stride(0), q.stride(1), *kv_strides, *s_strides, plan.prefix_pages.stride(0),
        GROUP=group, GROUP_P2=next_pow2(group), ROWS=plan.rows_per_tile, HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE=PAGE_SIZE, FP8=fp8, DOT_DTYPE=dot_dtype, F32_DOT=f32_dot,
        **PREFIX_LAUNCH)
    # The own pages: the decode kernel, either folding the prefix's partials (fused) or in
    # split mode writing the first num_splits of each row's `total` partial slots.
    _decode_kernel[(kv_heads, batch, num_splits)](
        q, kv, scales, page_table, suffix_lens, sinks if sinks is not None else q, out,
        part_out, part_lse, sm_scale, 0, triton.cdiv(own_pages, num_splits), total,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_strides, *s_strides,
        page_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d,
        PAGE=PAGE_SIZE, SPLIT=not fused, HAS_WINDOW=False, HAS_SINKS=fused and sinks is not None,
        FP8=fp8, DOT_DTYPE=dot_dtype, F32_DOT=f32_dot, MERGE_PARTS=fused,
        **launch_config(fp8, batch * kv_heads * num_splits, device))
    if not fused:
        merge_splits(part_out, part_lse, sinks, out, total)
    return out


def _check_int_tensor(name: str, t: torch.Tensor, dims: int,
                      dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64)) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype}, expected one of {dtypes}")


def _check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {name: t for name, t in tensors.items() if t is not None}
    device = next(iter(present.values())).device
    for name, t in present.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the others on {device}")
    return device


def _check_inputs(q, kv, kv_scales, plan, page_table, suffix_lens, sinks, out) -> torch.device:
    """Raises on any shape, dtype, stride or device the kernels cannot take; returns the
    device."""
    if not isinstance(plan, SharedPrefixPlan):
        raise TypeError("plan must come from plan_shared_prefix")
    for name, t in (("q", q), ("kv", kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q: dtype {q.dtype}, expected one of {FLOAT_DTYPES}")
    batch, heads, head_dim = q.shape
    if kv.dim() != 5 or tuple(kv.shape[1:3]) != (PAGE_SIZE, 2) or kv.shape[4] != head_dim:
        raise ValueError(f"kv must be [num_pages, {PAGE_SIZE}, 2, KVH, {head_dim}] (q's head "
                         f"dim), got shape {tuple(kv.shape)}")
    if kv.dtype not in FLOAT_DTYPES + (FP8_DTYPE,):
        raise TypeError(f"kv: dtype {kv.dtype}, expected one of {FLOAT_DTYPES + (FP8_DTYPE,)}")
    kv_heads = kv.shape[3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide over {kv_heads} KV heads")
    for name, t in (("q", q), ("kv", kv), ("out", out)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride 1)")
    fp8 = kv.dtype == FP8_DTYPE
    if fp8 != (kv_scales is not None):
        raise ValueError("kv_scales must be given for float8_e4m3fn KV and only then")
    if fp8:
        expected = (kv.shape[0], PAGE_SIZE, 2, kv_heads)
        if tuple(kv_scales.shape) != expected or kv_scales.dtype != torch.float32:
            raise ValueError(f"kv_scales must be float32 {expected}, got {kv_scales.dtype} "
                             f"{tuple(kv_scales.shape)}")
    _check_int_tensor("page_table", page_table, 2, (torch.int32,))
    if page_table.shape[0] != batch or (page_table.shape[1] > 1 and page_table.stride(1) != 1):
        raise ValueError(f"page_table must be [B={batch}, max_own_pages] with contiguous rows, "
                         f"got shape {tuple(page_table.shape)}")
    _check_int_tensor("suffix_lens", suffix_lens, 1, (torch.int32,))
    if suffix_lens.shape[0] != batch:
        raise ValueError(f"suffix_lens must be [B={batch}], got {tuple(suffix_lens.shape)}")
    if plan.member_rows.shape[0] != batch:
        raise ValueError(f"plan was built for {plan.member_rows.shape[0]} rows, q has {batch}")
    if plan.rows_per_tile != rows_per_tile(heads // kv_heads):
        raise ValueError(f"plan was built for another GQA ratio (rows_per_tile "
                         f"{plan.rows_per_tile}); pass group_size={heads // kv_heads}")
    if sinks is not None and (tuple(sinks.shape) != (heads,) or sinks.dtype not in FLOAT_DTYPES):
        raise ValueError(f"sinks must be a float [{heads}] tensor, got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if batch > 65535:
        raise ValueError(f"at most 65535 rows per call (the grid's y axis), got {batch}")
    device = _check_same_device(q=q, kv=kv, kv_scales=kv_scales, page_table=page_table,
                                suffix_lens=suffix_lens, sinks=sinks, out=out,
                                prefix_pages=plan.prefix_pages, member_rows=plan.member_rows)
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{device} tensors need TRITON_INTERPRET=1 (the Triton CPU "
                         "interpreter)")
    return device

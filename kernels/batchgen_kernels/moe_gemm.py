"""Grouped GEMM for MoE experts: rows sorted by expert, one weight matrix per run of rows.

x [M, K] holds the (token, expert) assignments sorted by expert, so group g owns rows
[offsets[g-1], offsets[g]) (starting at 0 for g = 0) -- the `offs` layout torch._grouped_mm
takes -- and out[rows of g] = x[rows of g] @ w[g]^T. Groups may be empty; w may have more
rows than there are groups (a staging slot sized for the worst case).

Tile map, without a host sync: the grid's first axis walks row tiles group after group (group g
has ceil(rows_g / BLOCK_M) tiles, none when empty). Every program loads the G offsets, takes a
prefix sum of the per-group tile counts and finds its own group in it; the grid is sized by
the bound ceil(M / BLOCK_M) + G, and programs past the last tile return at once.

silu_mul fuses the SwiGLU gate: w is then [E, 2I, K] (gate rows first, as ExpertBank stacks
them); each program accumulates a gate tile and the matching up tile and writes
silu(gate) * up [M, I], so the [M, 2I] intermediate never reaches memory.

FP8 (DeepSeek-V3 / R1 checkpoints): w is e4m3 [E, N, K] with float32 block scales
[E, N/bn, K/bk] (W ~= w * scale per bn x bk block; bn, bk powers of two, 128 for R1, N and K
multiples of them). Activations are quantized per row and bk-wide column group by
`quantize_fp8_groups` (a separate launch, as DeepSeek's act_quant), so each bk-wide step of K
has one activation scale per row and one weight scale per tile: the fp8 dot's float32 partial
sum is scaled once per step. Accumulation is float32 throughout.

Block sizes are untuned heuristics (rows per group -> BLOCK_M); benchmarks/moe_kernels_bench.py
reports what they reach on DeepSeek-V3 shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    ACT_SCALE_FLOOR_C,
    FLOAT_DTYPES,
    FP8_DTYPE,
    FP8_MAX_C,
    check_device,
    check_dtype,
    check_output,
    check_shape,
    dot,
    interpreting,
    next_pow2,
    round_to_e4m3,
    use_f32_dot,
)

@triton.jit
def _find_tile(offs_ptr, num_groups, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(group, first row, end row) of this program's row tile; group >= num_groups when the
    program lies past the last tile."""
    tile = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    valid = g < num_groups
    ends = tl.load(offs_ptr + g, mask=valid, other=0).to(tl.int32)
    starts = tl.load(offs_ptr + g - 1, mask=valid & (g > 0), other=0).to(tl.int32)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)  # inclusive; invalid groups repeat the total
    group = tl.sum((cum <= tile).to(tl.int32), axis=0)
    mine = g == group
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return group, row0, row_end


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, offs_ptr, out_ptr, num_groups, N, K,
                         stride_xm, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_G: tl.constexpr, SILU_MUL: tl.constexpr, F32_DOT: tl.constexpr):
    group, row0, row_end = _find_tile(offs_ptr, num_groups, BLOCK_M, BLOCK_G)
    if group >= num_groups:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < row_end
    mask_n = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_gate = w_ptr + group.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    w_up = w_gate + N * stride_wn  # up rows follow the N gate rows (SILU_MUL only)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        a = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        acc += dot(a, tl.load(w_gate + ks[:, None], mask=mask_w, other=0.0), F32_DOT)
        if SILU_MUL:
            acc_up += dot(a, tl.load(w_up + ks[:, None], mask=mask_w, other=0.0), F32_DOT)
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grouped_gemm_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr, num_groups, N,
                             k_blocks, stride_xm, stride_xsm, stride_we, stride_wn, stride_wse,
                             stride_wsn, stride_om, WEIGHT_BLOCK_N: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_G: tl.constexpr, SILU_MUL: tl.constexpr,
                             F32_DOT: tl.constexpr):
    """BLOCK_K is the weight block's K width and BLOCK_N divides its N height, so every step
    has one weight scale (per matrix) and one activation scale per row. N and K are exact
    multiples of the tiles: only rows are masked."""
    group, row0, row_end = _find_tile(offs_ptr, num_groups, BLOCK_M, BLOCK_G)
    if group >= num_groups:
        return
    n0 = tl.program_id(1) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < row_end
    group64 = group.to(tl.int64)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xsm
    w_gate = w_ptr + group64 * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    w_up = w_gate + N * stride_wn
    ws_gate = ws_ptr + group64 * stride_wse + (n0 // WEIGHT_BLOCK_N) * stride_wsn
    ws_up = ws_ptr + group64 * stride_wse + ((N + n0) // WEIGHT_BLOCK_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(k_blocks):
        ks = kb * BLOCK_K + offs_k
        a = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
        a_scale = tl.load(xs_rows + kb, mask=mask_m, other=0.0)[:, None]
        part = dot(a, tl.load(w_gate + ks[:, None]), F32_DOT)
        acc += part * (a_scale * tl.load(ws_gate + kb))
        if SILU_MUL:
            part = dot(a, tl.load(w_up + ks[:, None]), F32_DOT)
            acc_up += part * (a_scale * tl.load(ws_up + kb))
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, num_groups, stride_xm, stride_qm, stride_sm,
                         GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr):
    """Groups [j * GROUPS_PER_PROG, ...) of one row: scale = amax / 448 and
    round-to-nearest-even(x / scale), both divisions IEEE (bit-identical to the reference)."""
    row = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (gs < num_groups)[:, None] & (cols >= 0)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), ACT_SCALE_FLOOR_C)
    scale = tl.math.div_rn(amax, FP8_MAX_C)
    q = round_to_e4m3(tl.math.div_rn(x, scale[:, None]))
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + gs, scale, mask=gs < num_groups)


# -- launchers ---------------------------------------------------------------------------------
class FP8Tiles(NamedTuple):
    """One launch setting of the FP8 grouped GEMM."""

    block_m: int | None
    """Row tile (power of two >= 16); None sizes it to the mean rows per group."""
    block_n: int
    """Column tile, capped at the weight block's bn (one weight scale per tile and K step)."""
    num_warps: int
    num_stages: int


def fp8_tiles(m: int, groups: int, silu_mul: bool) -> FP8Tiles:
    """Launch setting by rows per group: decode batches give experts a handful of rows each
    (small row tiles, as `grouped_gemm`), prefill hundreds (large tiles that keep the tensor
    cores fed). Settings from benchmarks/moe_kernels_bench.py --sweep on an H200: at 64 and
    256 tokens the fitted tile is among the fastest (within run-to-run noise); at 8,192 tokens
    the large tiles are 1.07-1.32x faster. The threshold lies between those points (2,048
    tokens, ~78 rows per group, was swept with fitted tiles only: 334 TFLOP/s)."""
    if m < LARGE_TILE_ROWS_PER_GROUP * max(1, min(groups, m)):
        return FP8Tiles(None, 64 if silu_mul else 128, 4, 3)
    return LARGE_FP8_TILES[silu_mul]


LARGE_TILE_ROWS_PER_GROUP = 64
"""Mean rows per group from which the large prefill tiles are used (decode batches of up to
a few hundred tokens stay below it: 8 of 256 experts per token)."""
LARGE_FP8_TILES = {True: FP8Tiles(64, 128, 8, 3), False: FP8Tiles(64, 128, 4, 4)}
"""Prefill tiles of the gate_up (SiLU fused, two accumulators) and the down GEMM: on an H200
at 8,192 tokens (DeepSeek-V3 experts) 6.6 and 3.7 ms (581 and 516 TFLOP/s), against 8.7 and
4.0 ms for the fitted-row-tile setting used below the threshold."""


def _check_offsets(offsets: torch.Tensor, w: torch.Tensor) -> int:
    check_dtype("offsets", offsets, (torch.int32, torch.int64))
    if not (offsets.dim() == 1 and offsets.stride(0) == 1):
        raise ValueError("offsets is a contiguous [G]")
    groups = offsets.shape[0]
    if groups > w.shape[0]:
        raise ValueError(f"{groups} groups but {w.shape[0]} weight matrices")
    return groups


def _row_tiling(m: int, groups: int, block_m: int | None, cap: int) -> tuple[int, int]:
    """(BLOCK_M, number of row-tile programs). By default BLOCK_M fits the mean rows per group:
    decode batches give experts a handful of rows each, where a 16-row tile wastes least."""
    if block_m is None:
        block_m = min(cap, max(16, next_pow2(-(-m // max(1, min(groups, m))))))
    if not (block_m >= 16 and block_m & (block_m - 1) == 0):
        raise ValueError("block_m: a power of two >= 16")
    return block_m, triton.cdiv(m, block_m) + groups


def _out_buffer(out, shape, dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_output("out", out, shape, dtype)
    return out


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                 silu_mul: bool = False, out: torch.Tensor | None = None,
                 block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """out[rows of g] = x[rows of g] @ w[g]^T over groups of contiguous rows.

    x         [M, K] float32/float16/bfloat16, last dim contiguous, rows sorted by group.
    w         [E, N, K] of x's dtype (E >= G), last dim contiguous; with silu_mul, [E, 2I, K].
    offsets   [G] int32/int64 group ends: nondecreasing, offsets[G-1] <= M (the
              torch._grouped_mm `offs`); rows at or past offsets[G-1] are not written.
    silu_mul  write silu(x @ w[:, :I]^T) * (x @ w[:, I:]^T) [M, I] instead of [M, N].
    out       optional output of x's dtype, last dim contiguous.
    block_m, block_n  tile sizes (powers of two >= 16); None picks them.
    Returns out [M, N] (or [M, I]) in x's dtype, float32 accumulation.
    """
    check_device(x, w, offsets, out)
    check_dtype("x", x, FLOAT_DTYPES)
    if not (x.dim() == 2 and w.dim() == 3):
        raise ValueError("x is [M, K], w is [E, N, K]")
    m, k = x.shape
    if w.dtype != x.dtype:
        raise TypeError(f"w {tuple(w.shape)} {w.dtype} for x [M, {k}]")
    if w.shape[2] != k:
        raise ValueError(f"w {tuple(w.shape)} {w.dtype} for x [M, {k}]")
    if not (x.stride(1) == 1 and w.stride(2) == 1):
        raise ValueError("x and w: K must be contiguous")
    if silu_mul and w.shape[1] % 2:
        raise ValueError("silu_mul needs w = [gate | up] rows")
    groups = _check_offsets(offsets, w)
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    out = _out_buffer(out, (m, n), x.dtype, x.device)
    if m == 0 or groups == 0 or n == 0:
        return out
    block_m, row_tiles = _row_tiling(m, groups, block_m, 64 if silu_mul else 128)
    block_n = block_n or (64 if silu_mul else 128)
    block_n = min(block_n, max(16, next_pow2(n)))
    grid = (row_tiles, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, w, offsets, out, groups, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(64, max(16, next_pow2(k))),
        BLOCK_G=max(16, next_pow2(groups)), SILU_MUL=silu_mul, F32_DOT=use_f32_dot(x.dtype),
        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)
    return out


def quantize_fp8_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group`-columns e4m3 quantization of activations.

    x      [M, K] float32/float16/bfloat16, last dim contiguous; K a multiple of group (a power
           of two >= 16).
    Returns (q [M, K] float8_e4m3fn, scales [M, K / group] float32) with
    scale = max(amax, 1e-12) / 448 and q = round-to-nearest-even(x / scale).
    """
    check_device(x)
    check_dtype("x", x, FLOAT_DTYPES)
    if not (x.dim() == 2 and x.stride(1) == 1):
        raise ValueError("x is [M, K], last dim contiguous")
    if not (group >= 16 and group & (group - 1) == 0):
        raise ValueError(f"group {group}: a power of two >= 16")
    m, k = x.shape
    if k % group != 0:
        raise ValueError(f"K = {k} is not a multiple of the group {group}")
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    per_prog = min(8, next_pow2(k // group))
    grid = (m, triton.cdiv(k // group, per_prog))
    _quant_groups_kernel[grid](x, q, scales, k // group, x.stride(0), q.stride(0),
                               scales.stride(0), GROUP=group, GROUPS_PER_PROG=per_prog,
                               num_warps=4)
    return q, scales


def grouped_gemm_fp8(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     offsets: torch.Tensor, block: tuple[int, int] = (128, 128),
                     silu_mul: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                     out: torch.Tensor | None = None,
                     tiles: FP8Tiles | None = None) -> torch.Tensor:
    """Block-scaled FP8 grouped GEMM: out[rows of g] = dequant(x) @ dequant(w[g])^T.

    xq        [M, K] float8_e4m3fn, rows sorted by group; xs [M, K / bk] float32 activation
              scales (`quantize_fp8_groups(x, bk)`): x ~= xq * xs per row and bk columns.
    w         [E, N, K] float8_e4m3fn (E >= G), w_scale [E, N / bn, K / bk] float32:
              W[g] ~= w[g] * w_scale[g] per bn x bk block. Last dims contiguous.
    offsets   [G] group ends, as for `grouped_gemm`.
    block     (bn, bk): powers of two >= 16; N and K multiples of them (and, with silu_mul,
              I = N / 2 a multiple of bn, so no block straddles the gate|up seam).
    silu_mul  write silu(gate) * up [M, I] (gate = rows [0, I) of w), as `grouped_gemm`.
    tiles     the launch setting (a benchmark sweep); None: `fp8_tiles(M, G, silu_mul)`.
    Returns out [M, N] (or [M, I]) in out_dtype (float32/float16/bfloat16).
    """
    check_device(xq, xs, w, w_scale, offsets, out)
    bn, bk = block
    for name, size in (("bn", bn), ("bk", bk)):
        if not (size >= 16 and size & (size - 1) == 0):
            raise ValueError(f"{name} = {size}: a power of two >= 16")
    check_dtype("xq", xq, (FP8_DTYPE,))
    check_dtype("w", w, (FP8_DTYPE,))
    check_dtype("xs", xs, (torch.float32,))
    check_dtype("w_scale", w_scale, (torch.float32,))
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype}: one of {FLOAT_DTYPES}")
    if not (xq.dim() == 2 and w.dim() == 3):
        raise ValueError("xq is [M, K], w is [E, N, K]")
    m, k = xq.shape
    e, n_w, _ = w.shape
    if w.shape[2] != k:
        raise ValueError(f"w {tuple(w.shape)} for xq [M, {k}]")
    if not (k % bk == 0 and n_w % bn == 0):
        raise ValueError(f"N = {n_w}, K = {k} must be multiples of {block}")
    n = n_w // 2 if silu_mul else n_w
    if n % bn != 0:
        raise ValueError(f"silu_mul: I = {n} must be a multiple of bn = {bn}")
    check_shape("xs", xs, (m, k // bk))
    check_shape("w_scale", w_scale, (e, n_w // bn, k // bk))
    for name, t in (("xq", xq), ("xs", xs), ("w", w), ("w_scale", w_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    groups = _check_offsets(offsets, w)
    out = _out_buffer(out, (m, n), out_dtype, xq.device)
    if m == 0 or groups == 0 or n == 0:
        return out
    tiles = tiles or fp8_tiles(m, groups, silu_mul)
    block_m, row_tiles = _row_tiling(m, groups, tiles.block_m, 64)
    block_n = min(bn, tiles.block_n)
    grid = (row_tiles, n // block_n)
    _grouped_gemm_fp8_kernel[grid](
        xq, xs, w, w_scale, offsets, out, groups, n, k // bk, xq.stride(0), xs.stride(0),
        w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        WEIGHT_BLOCK_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
        BLOCK_G=max(16, next_pow2(groups)), SILU_MUL=silu_mul, F32_DOT=interpreting(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out

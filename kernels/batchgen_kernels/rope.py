"""Rotary position embedding, rotate-half (non-interleaved) layout, partial rotary allowed.

For each token, the first rot_dim features of every q and k head are split into halves
(x1, x2) and become (x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2), where (cos1 | cos2) is
the token's row of the [max_pos, rot_dim] table (batchgen's RotaryEmbedding repeats each half,
so cos1 == cos2, but the kernel reads both as the unfused formula `x * cos + rotate_half(x) *
sin` does). Features past rot_dim pass through. Math is float32 with one rounding at the end,
so in bf16 the result can differ by an ulp from HF, which multiplies in the activation dtype.
One program per token handles all its q heads, then all its k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_output, check_shape, next_pow2


@triton.jit
def rotate_halves(x1, x2, cos1, cos2, sin1, sin2):
    """The rotated halves (float32) of features split into halves x1, x2 (float32)."""
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, n_heads,
                  cos1, cos2, sin1, sin2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_R: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Rotate one token's [n_heads, HALF * 2] features; copy REST more when out != x."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_h < n_heads)[:, None] & (offs_r < HALF)[None, :]
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_r[None, :]
    dst = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rotate_halves(x1, x2, cos1, cos2, sin1, sin2)
    tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)
    if REST > 0:
        offs_p = tl.arange(0, BLOCK_REST)
        mask_p = (offs_h < n_heads)[:, None] & (offs_p < REST)[None, :]
        base = 2 * HALF + offs_p[None, :]
        rest = tl.load(x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + base,
                       mask=mask_p)
        tl.store(out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + base, rest,
                 mask=mask_p)


@triton.jit
def _table_rows(pos_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, HALF: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """The token's cos/sin table row as float32 halves (cos1, cos2, sin1, sin2), each
    [1, BLOCK_R] (zero past HALF)."""
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < HALF
    cos = cos_ptr + pos * stride_cos + offs_r
    sin = sin_ptr + pos * stride_sin + offs_r
    cos1 = tl.load(cos, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos + HALF, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin + HALF, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    return cos1, cos2, sin1, sin2


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                 stride_kot, stride_koh, stride_cos, stride_sin, q_heads, k_heads,
                 HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                 BLOCK_R: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2 = _table_rows(pos_ptr, cos_ptr, sin_ptr, token, stride_cos,
                                         stride_sin, HALF, BLOCK_R)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh,
                  q_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_QH, BLOCK_R, REST, BLOCK_REST)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh,
                  k_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_KH, BLOCK_R, REST, BLOCK_REST)


def check_rope_tables(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      tokens: int, head_dim: int) -> int:
    """Check the positions of `tokens` tokens and the cos/sin tables for heads of `head_dim`;
    returns the rotated dimensions (rot_dim)."""
    check_shape("positions", positions, (tokens,))
    check_dtype("positions", positions, (torch.int32, torch.int64))
    rot_dim = cos.shape[-1]
    if not (cos.dim() == 2 and cos.shape == sin.shape):
        raise ValueError("cos/sin are [max_pos, rot_dim]")
    if not (rot_dim % 2 == 0 and rot_dim <= head_dim):
        raise ValueError(f"rot_dim {rot_dim} vs head_dim {head_dim}")
    return rot_dim


def check_rope_inputs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Check q [T, H, D] and k [T, KVH, D] (one float dtype, last dims contiguous), the
    positions and the cos/sin tables; returns the rotated dimensions (rot_dim)."""
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError("q is [T, H, D]")
    tokens, _, head_dim = q.shape
    if not (k.dim() == 3 and k.shape[0] == tokens and k.shape[2] == head_dim):
        raise ValueError("k is [T, KVH, D]")
    if k.dtype != q.dtype:
        raise TypeError("q and k must share a dtype")
    rot_dim = check_rope_tables(positions, cos, sin, tokens, head_dim)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    return rot_dim


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_out: torch.Tensor | None = None,
               k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim features of every head of q and k by each token's position.

    q         [T, H, D] float32/float16/bfloat16 (any token/head strides, last dim contiguous:
              views of a fused QKV projection work).
    k         [T, KVH, D] of q's dtype, same rules.
    positions [T] int32/int64, each < max_pos.
    cos, sin  [max_pos, rot_dim] float tables (rot_dim even, <= D), last dim contiguous.
    q_out     optional [T, H, D] of q's dtype (last dim contiguous) to write instead of q.
    k_out     optional [T, KVH, D] of q's dtype, given together with q_out.
    Returns (q_out, k_out): q and k themselves, rotated in place, when no outputs are given.
    """
    tokens, q_heads, head_dim = q.shape
    check_device(q, k, positions, cos, sin)
    rot_dim = check_rope_inputs(q, k, positions, cos, sin)
    if (q_out is None) != (k_out is None):
        raise ValueError("give q_out and k_out together")
    inplace = q_out is None
    q_out, k_out = (q, k) if inplace else (q_out, k_out)
    for name, t, like in (("q_out", q_out, q), ("k_out", k_out, k)):
        check_output(name, t, tuple(like.shape), q.dtype)
    if tokens == 0:
        return q_out, k_out
    half, rest = rot_dim // 2, 0 if inplace else head_dim - rot_dim
    _rope_kernel[(tokens,)](
        q, k, q_out, k_out, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0), q_heads, k.shape[1],
        HALF=half, BLOCK_QH=next_pow2(q_heads), BLOCK_KH=next_pow2(k.shape[1]),
        BLOCK_R=next_pow2(half), REST=rest, BLOCK_REST=next_pow2(rest), num_warps=4)
    return q_out, k_out

"""Per-head RMSNorm then rotary position embedding of q and k, in one pass.

Qwen3-style attention normalises every q and k head on its own (`q_norm`, `k_norm`) and then
rotates it. Run apart, `rmsnorm_heads` and `apply_rope` read and write q and k twice; here each
program loads one token's q heads and k heads once, normalises them as `rmsnorm_heads` does
(float32 sums, the normalised value rounded to the activation dtype before the weight multiply,
the product rounded again), rotates them as `apply_rope` does (float32, one rounding at the
end) and writes contiguous outputs. The roundings are the unfused pair's, so the result equals
theirs up to the reduction order. Features past the rotated ones (partial rotary) are
normalised and passed through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_shape, next_pow2
from .rope import _table_rows, check_rope_inputs, rotate_halves


@triton.jit
def _norm_rotate_heads(x_ptr, w_ptr, out_ptr, token, stride_xt, stride_xh, n_heads, eps,
                       cos1, cos2, sin1, sin2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_R: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Normalise and rotate one token's [n_heads, 2 * HALF + REST] features into out (a
    contiguous [T, n_heads, 2 * HALF + REST])."""
    act = x_ptr.dtype.element_ty
    dim = 2 * HALF + REST
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_r = tl.arange(0, BLOCK_R)[None, :]
    mask = (offs_h < n_heads) & (offs_r < HALF)
    row = x_ptr + token * stride_xt + offs_h * stride_xh
    src = row + offs_r
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if REST > 0:
        offs_p = tl.arange(0, BLOCK_REST)[None, :]
        mask_p = (offs_h < n_heads) & (offs_p < REST)
        rest = tl.load(row + 2 * HALF + offs_p, mask=mask_p, other=0.0).to(tl.float32)
        squares += tl.sum(rest * rest, axis=1)
    rstd = tl.rsqrt(squares / dim + eps)[:, None]
    w1 = tl.load(w_ptr + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    y1 = ((x1 * rstd).to(act).to(tl.float32) * w1).to(act).to(tl.float32)
    y2 = ((x2 * rstd).to(act).to(tl.float32) * w2).to(act).to(tl.float32)
    r1, r2 = rotate_halves(y1, y2, cos1, cos2, sin1, sin2)
    out_row = out_ptr + (token * n_heads + offs_h) * dim
    tl.store(out_row + offs_r, r1.to(act), mask=mask)
    tl.store(out_row + HALF + offs_r, r2.to(act), mask=mask)
    if REST > 0:
        w_rest = tl.load(w_ptr + 2 * HALF + offs_p, mask=offs_p < REST, other=0.0)
        y_rest = (rest * rstd).to(act).to(tl.float32) * w_rest.to(tl.float32)
        tl.store(out_row + 2 * HALF + offs_p, y_rest.to(act), mask=mask_p)


@triton.jit
def _rmsnorm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr,
                         sin_ptr, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                         stride_sin, q_heads, k_heads, HALF: tl.constexpr,
                         BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr,
                         REST: tl.constexpr, BLOCK_REST: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2 = _table_rows(pos_ptr, cos_ptr, sin_ptr, token, stride_cos,
                                         stride_sin, HALF, BLOCK_R)
    _norm_rotate_heads(q_ptr, qw_ptr, q_out_ptr, token, stride_qt, stride_qh, q_heads, eps,
                       cos1, cos2, sin1, sin2, HALF, BLOCK_QH, BLOCK_R, REST, BLOCK_REST)
    _norm_rotate_heads(k_ptr, kw_ptr, k_out_ptr, token, stride_kt, stride_kh, k_heads, eps,
                       cos1, cos2, sin1, sin2, HALF, BLOCK_KH, BLOCK_R, REST, BLOCK_REST)


def rmsnorm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of weight * rmsnorm of every head of q and k (see the module docstring).

    q          [T, H, D] float32/float16/bfloat16 (any token/head strides, last dim
               contiguous: views of a fused QKV projection's output work).
    k          [T, KVH, D] of q's dtype, same rules.
    q_weight   [D] contiguous, any float dtype; k_weight likewise.
    positions  [T] int32/int64, each < max_pos.
    cos, sin   [max_pos, rot_dim] float tables (rot_dim even, <= D), last dim contiguous.
    Returns contiguous (q_out [T, H, D], k_out [T, KVH, D]) of q's dtype.
    """
    check_device(q, k, q_weight, k_weight, positions, cos, sin)
    rot_dim = check_rope_inputs(q, k, positions, cos, sin)
    tokens, q_heads, head_dim = q.shape
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_shape(name, w, (head_dim,))
        check_dtype(name, w, FLOAT_DTYPES)
        if w.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out, k_out
    half, rest = rot_dim // 2, head_dim - rot_dim
    features = max(q_heads, k.shape[1]) * head_dim
    _rmsnorm_rope_kernel[(tokens,)](
        q, k, q_weight, k_weight, q_out, k_out, positions, cos, sin, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q_heads, k.shape[1], HALF=half, BLOCK_QH=next_pow2(q_heads),
        BLOCK_KH=next_pow2(k.shape[1]), BLOCK_R=next_pow2(half), REST=rest,
        BLOCK_REST=next_pow2(rest), num_warps=8 if features > 2048 else 4)
    return q_out, k_out

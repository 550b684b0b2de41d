"""rmsnorm_rope against the float64 reference and against the unfused kernels it replaces."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import apply_rope, reference, rmsnorm_heads, rmsnorm_rope
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close
from test_kernel_rope import _tables


def _fused_qkv_views(tokens, heads, kv_heads, head_dim, dtype, device):
    """q and k as strided views of one [T, (H + 2 * KVH) * D] projection output."""
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device) * 3).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("rot_dim", [32, 12], ids=["full", "partial12"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)], ids=["gqa", "odd-heads"])
def test_rmsnorm_rope_matches_reference(device, dtype, rot_dim, heads, kv_heads):
    tokens, head_dim = 7, 32
    q, k = _fused_qkv_views(tokens, heads, kv_heads, head_dim, dtype, device)
    q_weight = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    k_weight = torch.rand(head_dim, device=device) + 0.5  # float32 weights work too
    cos, sin = _tables(100, rot_dim, device)
    positions = torch.randint(0, 100, (tokens,), device=device)
    before = (q.clone(), k.clone())
    ref_q, ref_k = reference.rmsnorm_rope(q, k, q_weight, k_weight, 1e-6, positions, cos, sin,
                                          torch.float64)

    q_out, k_out = rmsnorm_rope(q, k, q_weight, k_weight, 1e-6, positions, cos, sin)

    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_rel_close(q_out, ref_q, TOLERANCE[dtype], "q")
    assert_rel_close(k_out, ref_k, TOLERANCE[dtype], "k")
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # inputs untouched


@pytest.mark.parametrize("device", DEVICES)
def test_rmsnorm_rope_rounds_as_the_unfused_kernels(device):
    """bf16: the fused pass rounds where rmsnorm_heads then apply_rope do."""
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 64
    q, k = _fused_qkv_views(tokens, heads, kv_heads, head_dim, torch.bfloat16, device)
    q_weight = (torch.rand(head_dim, device=device) + 0.5).to(torch.bfloat16)
    k_weight = (torch.rand(head_dim, device=device) + 0.5).to(torch.bfloat16)
    cos, sin = _tables(50, head_dim, device)
    positions = torch.randint(0, 50, (tokens,), device=device)
    unfused = apply_rope(rmsnorm_heads(q, q_weight, 1e-6), rmsnorm_heads(k, k_weight, 1e-6),
                         positions, cos, sin)

    fused = rmsnorm_rope(q, k, q_weight, k_weight, 1e-6, positions, cos, sin)

    for got, want in zip(fused, unfused):
        ulp = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
        assert ulp.max() <= 2 ** -7, "more than one bf16 rounding apart"


@pytest.mark.parametrize("device", DEVICES)
def test_rmsnorm_rope_refuses_bad_inputs(device):
    q, k = torch.randn(3, 2, 16, device=device), torch.randn(3, 1, 16, device=device)
    w = torch.ones(16, device=device)
    cos, sin = _tables(10, 16, device)
    positions = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="q_weight"):
        rmsnorm_rope(q, k, torch.ones(8, device=device), w, 1e-6, positions, cos, sin)
    with pytest.raises(ValueError, match="last dim"):
        rmsnorm_rope(torch.randn(3, 2, 32, device=device)[..., ::2], k, w, w, 1e-6, positions,
                     cos, sin)
    with pytest.raises(TypeError, match="share a dtype"):
        rmsnorm_rope(q, k.double(), w, w, 1e-6, positions, cos, sin)
    with pytest.raises(ValueError, match="k is"):
        rmsnorm_rope(q, k[:2], w, w, 1e-6, positions, cos, sin)

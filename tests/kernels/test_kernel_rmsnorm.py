"""fused_add_rmsnorm / rmsnorm against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import fused_add_rmsnorm, reference, rmsnorm, rmsnorm_heads
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, poisoned


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("cols", [64, 200])
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
def test_add_rmsnorm_matches_reference(device, dtype, cols, inplace):
    x = (torch.randn(5, cols, device=device) * 3).to(dtype)
    residual = torch.randn(5, cols, device=device).to(dtype)
    weight = (torch.rand(cols, device=device) + 0.5).to(dtype)
    ref_out, ref_residual = reference.add_rmsnorm(x, residual, weight, 1e-6, torch.float64)
    if inplace:
        out, residual_out = x, residual
    else:
        out, residual_out = poisoned(x.shape, dtype, device), poisoned(x.shape, dtype, device)

    fused_add_rmsnorm(x, residual, weight, 1e-6, out=out, residual_out=residual_out)

    assert_rel_close(residual_out, ref_residual, TOLERANCE[dtype], "residual")
    assert_rel_close(out, ref_out, TOLERANCE[dtype], "out")


@pytest.mark.parametrize("device", DEVICES)
def test_plain_rmsnorm_on_strided_rows(device):
    x = torch.randn(4, 96, device=device)[:, :80]  # row stride 96
    weight = torch.rand(80, device=device)
    ref, _ = reference.add_rmsnorm(x, None, weight, 1e-5, torch.float64)
    out = poisoned(x.shape, x.dtype, device)
    rmsnorm(x, weight, 1e-5, out=out)
    assert_rel_close(out, ref, TOLERANCE[torch.float32], "rmsnorm")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,head_dim", [(1, 32), (3, 32), (5, 2048)],
                         ids=["1x32", "3x32", "5x2048-split"])  # 5 x 2048: 2 heads a program
def test_per_head_rmsnorm_reads_a_slice_of_a_fused_projection(device, dtype, heads, head_dim):
    kv_heads = 2  # q and k heads of [T, (H + 2 * KVH) * D] rows, as qkv_proj writes
    qkv = (torch.randn(7, (heads + 2 * kv_heads) * head_dim, device=device) * 3).to(dtype)
    q = qkv[:, :heads * head_dim].view(7, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(7, kv_heads, head_dim)
    weight = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    for x in (q, k):
        assert not x.is_contiguous()
        ref, _ = reference.add_rmsnorm(x, None, weight, 1e-6, torch.float64)
        out = rmsnorm_heads(x, weight, 1e-6)
        assert out.shape == x.shape and out.is_contiguous()
        assert_rel_close(out, ref, TOLERANCE[dtype], "per-head rmsnorm")


@pytest.mark.parametrize("device", DEVICES)
def test_per_head_rmsnorm_refuses_a_strided_last_dim(device):
    x = torch.randn(4, 2, 64, device=device)[..., ::2]
    with pytest.raises(ValueError, match="last dim"):
        rmsnorm_heads(x, torch.ones(32, device=device), 1e-6)

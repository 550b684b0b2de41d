"""apply_rope against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import apply_rope, reference
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, poisoned


def _tables(max_pos, rot_dim, device):
    """cos/sin [max_pos, rot_dim] built as batchgen's RotaryEmbedding does (halves repeated)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=device).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("rot_dim", [32, 16, 12], ids=["full", "half", "partial12"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "new"])
def test_rope_matches_reference(device, dtype, rot_dim, inplace):
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 32
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device).to(dtype)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]  # strided views, as in a model
    cos, sin = _tables(100, rot_dim, device)
    positions = torch.randint(0, 100, (tokens,), device=device)
    ref_q, ref_k = reference.rope(q, k, positions, cos, sin, torch.float64)
    outs = {}
    if not inplace:
        q, k = q.clone(), k.clone()  # checked untouched below
        outs = {"q_out": poisoned(q.shape, dtype, device),
                "k_out": poisoned(k.shape, dtype, device)}

    q_out, k_out = apply_rope(q, k, positions, cos, sin, **outs)

    assert_rel_close(q_out, ref_q, TOLERANCE[dtype], "q")
    assert_rel_close(k_out, ref_k, TOLERANCE[dtype], "k")
    if inplace:
        assert q_out is q and k_out is k
    else:
        assert torch.equal(q, qkv[:, :heads]) and torch.equal(k, qkv[:, heads:heads + kv_heads])


@pytest.mark.parametrize("device", DEVICES)
def test_rope_rejects_odd_rot_dim(device):
    q = torch.randn(2, 2, 8, device=device)
    cos = torch.ones(4, 5, device=device)
    with pytest.raises(ValueError):
        apply_rope(q, q, torch.zeros(2, dtype=torch.long, device=device), cos, cos)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_reads_both_table_halves(device):
    """Tables whose halves differ: the kernel must follow x * cos + rotate_half(x) * sin."""
    q, k = torch.randn(3, 2, 16, device=device), torch.randn(3, 1, 16, device=device)
    cos, sin = torch.randn(10, 16, device=device), torch.randn(10, 16, device=device)
    positions = torch.tensor([9, 0, 4], device=device)
    ref_q, ref_k = reference.rope(q, k, positions, cos, sin, torch.float64)
    apply_rope(q, k, positions, cos, sin)
    assert_rel_close(q, ref_q, TOLERANCE[torch.float32], "q")
    assert_rel_close(k, ref_k, TOLERANCE[torch.float32], "k")

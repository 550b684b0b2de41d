"""rope_store_kv against the reference (RoPE, then the store) and against apply_rope followed
by store_kv: the same bits in q_out and in the pool, fp8 quantisation included."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import apply_rope, reference, rope_store_kv, store_kv
from kernel_testing import DEVICES, PAGE_SIZE, poisoned
from test_kernel_kv_store import _same_bits
from test_kernel_rope import _tables


def _model_views(tokens, heads, kv_heads, head_dim, dtype, device):
    """q, k, v as strided views of one fused projection, with awkward k/v rows: all zeros
    (the fp8 amax clamp), tiny values (fp8 subnormals) and a large spread."""
    # Seeded: an fp8 value exactly between two codes may round either way in the two kernels.
    gen = torch.Generator(device="cpu").manual_seed(tokens * 131 + heads)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(device)
    qkv[0] = 0.0
    qkv[1] *= 1e-3
    qkv[2, :, : head_dim // 2] *= 1e4
    qkv = qkv.to(dtype)
    return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


def _pool(num_pages, kv_heads, head_dim, pool_dtype, device):
    """Layer 1 of a poisoned 3-layer pool (and its scales for fp8)."""
    shape = (num_pages, 3, PAGE_SIZE, 2, kv_heads, head_dim)
    data = poisoned(shape, torch.float32, device).to(pool_dtype)
    fp8 = pool_dtype == torch.float8_e4m3fn
    scales = poisoned(shape[:-1], torch.float32, device) if fp8 else None
    return data, scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,pool_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e4m3fn)],
    ids=["bf16", "fp16", "fp32", "bf16-fp32", "bf16-fp8", "fp16-fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim", [
    (4, 2, 32, 32), (6, 3, 24, 24), (4, 1, 32, 12)], ids=["full", "3heads", "partial"])
def test_rope_store_matches_reference_and_the_two_kernels(device, dtype, pool_dtype, heads,
                                                          kv_heads, head_dim, rot_dim):
    tokens, num_pages = 9, 5
    fp8 = pool_dtype == torch.float8_e4m3fn
    q, k, v = _model_views(tokens, heads, kv_heads, head_dim, dtype, device)
    cos, sin = _tables(300, rot_dim, device)
    positions = torch.randint(0, 300, (tokens,), device=device)
    slots = torch.randperm(num_pages * PAGE_SIZE)[:tokens].to(device)
    slots[4] = -1  # a padding token: q is rotated, nothing is stored
    data, scales = _pool(num_pages, kv_heads, head_dim, pool_dtype, device)
    kv, kv_scales = data[:, 1], (scales[:, 1] if fp8 else None)
    want_q, want_kv, want_scales = reference.rope_store_kv(q, k, v, positions, cos, sin, kv,
                                                           kv_scales, slots)
    two_data, two_scales = data.clone(), None if scales is None else scales.clone()
    q_two, k_two = apply_rope(q, k, positions, cos, sin, torch.empty_like(q),
                              torch.empty_like(k))
    store_kv(k_two, v, two_data[:, 1], None if two_scales is None else two_scales[:, 1], slots)
    q_in = q.clone()

    q_out = rope_store_kv(q, k, v, positions, cos, sin, kv, kv_scales, slots,
                          q_out=poisoned(q.shape, dtype, device))

    assert torch.equal(q, q_in), "q itself is left as it was"
    assert _same_bits(q_out, q_two) and _same_bits(data, two_data)
    if fp8:
        assert _same_bits(scales, two_scales)
    # Against the float32 reference the interpreter's casts round differently (an ulp of
    # dtype, so at times one e4m3 step): compare values, not bits.
    torch.testing.assert_close(q_out.float(), want_q.float(), rtol=1e-2, atol=1e-3)
    stored, want = kv.float(), want_kv.float()
    if fp8:
        stored, want = stored * kv_scales[..., None], want * want_scales[..., None]
    written = ~torch.isnan(want)
    assert torch.equal(written, ~torch.isnan(stored)), "wrote other slots than the reference"
    if fp8:  # an e4m3 step either way; in a row whose amax is large (token 2), small values
        # fall among the subnormals, whose step is 2^-9 of the scale, not relative to them
        subnormal = (2.0 ** -9) * want_scales[..., None].expand_as(want)
        error = (stored - want).abs()[written]
        assert (error <= 0.13 * want.abs()[written] + subnormal[written] + 1e-3).all(), \
            error.max()
    else:
        torch.testing.assert_close(stored[written], want[written], rtol=1e-2, atol=1e-3)
    other_layers = torch.cat([data[:, :1], data[:, 2:]], dim=1)
    assert torch.isnan(other_layers.float()).all(), "wrote outside the layer"


@pytest.mark.parametrize("device", DEVICES)
def test_rope_store_rejects_mismatched_pool(device):
    q, k = torch.randn(2, 4, 32, device=device), torch.randn(2, 2, 32, device=device)
    kv = torch.zeros(3, PAGE_SIZE, 2, 4, 32, device=device)  # 4 KV heads, k has 2
    cos, sin = _tables(8, 32, device)
    with pytest.raises(ValueError):
        rope_store_kv(q, k, k, torch.zeros(2, dtype=torch.long, device=device), cos, sin, kv,
                      None, torch.zeros(2, dtype=torch.int64, device=device))

"""paged_decode_attention against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import paged_decode_attention, reference
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, make_paged_kv, poisoned

# (heads, kv_heads, head_dim, window, sinks, num_splits): GQA ratios 1/4/3, window and sinks
# each on and off, one split (the kernel finishes the softmax) and several (the reduce kernel).
CASES = [
    (2, 2, 32, None, False, 1),
    (4, 1, 32, 40, True, 1),
    (6, 2, 24, None, True, 3),  # head_dim 24 is padded to the 32-wide block
    (4, 1, 32, 70, False, 2),
    (6, 2, 32, 100, True, 2),
    (4, 2, 64, 90, False, 2),  # head_dim % 64 == 0: fp8 V read along keys, vectorised
    (16, 4, 32, None, True, 3),  # the merge takes 8 heads a program
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,sinks,num_splits", CASES)
def test_decode_matches_reference(device, dtype, fp8, heads, kv_heads, head_dim, window,
                                  sinks, num_splits):
    ctx_lens = [1, 64, 65, int(torch.randint(2, 200, ()))]
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    kv, kv_scales, table = make_paged_kv(ctx_lens, kv_heads, head_dim, kv_dtype, device)
    q = torch.randn(len(ctx_lens), heads, head_dim, device=device).to(dtype)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    sink = torch.randn(heads, device=device) * 2 if sinks else None
    scale = head_dim ** -0.5

    out = poisoned(q.shape, dtype, device)
    paged_decode_attention(q, kv, kv_scales, table, context_lens, scale, window=window,
                           sinks=sink, num_splits=num_splits, out=out)

    cu = torch.arange(len(ctx_lens) + 1, dtype=torch.int32)
    ref = reference.paged_attention(q, kv, kv_scales, cu, context_lens, table, scale, window,
                                    sink, math_dtype=torch.float64)
    assert_rel_close(out, ref, TOLERANCE[dtype], "decode")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rejects_mismatched_shapes(device):
    kv, _, table = make_paged_kv([5], 2, 32, torch.float16, device)
    q = torch.randn(1, 4, 16, device=device, dtype=torch.float16)  # head_dim 16 != 32
    with pytest.raises(ValueError):
        paged_decode_attention(q, kv, None, table, table.new_tensor([5]), 1.0)

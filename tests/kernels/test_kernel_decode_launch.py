"""The fp8 decode kernel's one-warp launch (taken for large batches) computes what the
two-warp one does."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import decode_attention as DA
from batchgen_kernels import paged_decode_attention, reference
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, make_paged_kv, poisoned


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_full_launch_matches_reference(device, head_dim, monkeypatch):
    monkeypatch.setattr(DA, "FP8_FULL_PROGRAMS_PER_SM", 0)  # every launch takes it
    assert DA.launch_config(True, 1, torch.device(device)) is (
        DA.FP8_FULL_LAUNCH if device == "cuda" else DA.FP8_LAUNCH)
    ctx_lens = [1, 64, 65, 300]
    kv, kv_scales, table = make_paged_kv(ctx_lens, 2, head_dim, torch.float8_e4m3fn, device)
    q = torch.randn(len(ctx_lens), 8, head_dim, device=device).to(torch.bfloat16)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    out = poisoned(q.shape, q.dtype, device)
    paged_decode_attention(q, kv, kv_scales, table, context_lens, 0.1, num_splits=1, out=out)
    cu = torch.arange(len(ctx_lens) + 1, dtype=torch.int32)
    ref = reference.paged_attention(q, kv, kv_scales, cu, context_lens, table, 0.1,
                                    math_dtype=torch.float64)
    assert_rel_close(out, ref, TOLERANCE[torch.bfloat16], "decode, one warp")

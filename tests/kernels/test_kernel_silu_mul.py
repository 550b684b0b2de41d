"""silu_and_mul against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import reference, silu_and_mul
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, poisoned


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("inter,block", [(48, 1024), (300, 128)])
def test_silu_mul_matches_reference(device, dtype, inter, block):
    x = (torch.randn(6, 2 * inter, device=device) * 4).to(dtype)
    out = poisoned((6, inter), dtype, device)
    silu_and_mul(x, out=out, block=block)
    assert_rel_close(out, reference.silu_and_mul(x, torch.float64), TOLERANCE[dtype], "silu")


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_rejects_odd_width(device):
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 7, device=device))

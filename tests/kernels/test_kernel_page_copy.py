"""copy_pages against the reference copy: bit-exact for every dtype, scales included."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import copy_pages, reference
from kernel_testing import DEVICES, PAGE_SIZE


def _random_pool(num_pages, num_layers, token_shape, dtype, device):
    values = torch.randn(num_pages, num_layers, PAGE_SIZE, *token_shape, device=device) * 50
    return values.clamp(-448, 448).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn],
                         ids=["bf16", "fp32", "fp8"])
@pytest.mark.parametrize("token_shape", [(2, 2, 16), (1, 40)], ids=["gqa", "mla"])
@pytest.mark.parametrize("block", [64, 4096])
def test_copy_matches_reference(device, dtype, token_shape, block):
    src = _random_pool(7, 3, token_shape, dtype, device)
    dst = _random_pool(9, 3, token_shape, dtype, device)
    src_pages = torch.tensor([6, 0, 3, 3], device=device)  # a page may be read twice
    dst_pages = torch.tensor([1, 8, 0, 5], dtype=torch.int32, device=device)
    fp8 = dtype == torch.float8_e4m3fn
    src_scales = torch.rand(src.shape[:-1], device=device) if fp8 else None
    dst_scales = torch.rand(dst.shape[:-1], device=device) if fp8 else None
    want = reference.copy_pages(src, src_pages, dst, dst_pages)
    want_scales = (reference.copy_pages(src_scales, src_pages, dst_scales, dst_pages)
                   if fp8 else None)

    copy_pages(src, src_pages, dst, dst_pages, src_scales, dst_scales, block=block)

    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    if fp8:
        assert torch.equal(dst_scales, want_scales)


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_copy_through_pinned_host_memory(direction):
    device_pool = _random_pool(6, 2, (2, 2, 16), torch.bfloat16, "cuda")
    host_pool = _random_pool(5, 2, (2, 2, 16), torch.bfloat16, "cpu").pin_memory()
    src, dst = (device_pool, host_pool) if direction == "to_host" else (host_pool, device_pool)
    src_pages = torch.tensor([4, 1, 2], device="cuda")
    dst_pages = torch.tensor([0, 3, 1], device="cuda")
    want = reference.copy_pages(src, src_pages, dst, dst_pages)

    copy_pages(src, src_pages, dst, dst_pages)
    torch.cuda.synchronize()

    assert torch.equal(dst.cpu(), want.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rejects_different_page_shapes(device):
    src = torch.zeros(2, 1, PAGE_SIZE, 2, 2, 16, device=device)
    dst = torch.zeros(2, 1, PAGE_SIZE, 2, 4, 16, device=device)
    ids = torch.tensor([0], device=device)
    with pytest.raises(AssertionError):
        copy_pages(src, ids, dst, ids)

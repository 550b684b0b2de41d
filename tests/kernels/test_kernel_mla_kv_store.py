"""store_mla_kv against the reference store: bit-exact, fp8 quantisation included."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import reference, store_mla_kv
from kernel_testing import DEVICES, PAGE_SIZE, poisoned


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included) of two tensors of one dtype."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int).cpu(), b.contiguous().view(as_int).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,pool_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float8_e4m3fn)])
@pytest.mark.parametrize("width", [48, 576])
def test_mla_store_matches_reference(device, src_dtype, pool_dtype, width):
    tokens, num_pages, num_layers = 9, 4, 3
    fp8 = pool_dtype == torch.float8_e4m3fn
    shape = (num_pages, num_layers, PAGE_SIZE, 1, width)
    data = poisoned(shape, torch.float32, device).to(pool_dtype)
    scales = poisoned(shape[:-1], torch.float32, device) if fp8 else None
    kv, kv_scales = data[:, 1], (scales[:, 1] if fp8 else None)
    # Rows as a view of a wider tensor; awkward rows: all zeros (amax clamp), tiny values
    # (fp8 subnormals) and a large spread.
    wide = torch.randn(tokens, width + 16, device=device)
    wide[0] = 0.0
    wide[1] *= 1e-3
    wide[2, : width // 2] *= 1e4
    rows = wide.to(src_dtype)[:, 8:8 + width]
    slots = torch.randperm(num_pages * PAGE_SIZE)[:tokens].to(device)
    slots[4] = -1  # a padding token: nothing is written for it

    want_kv, want_scales = reference.store_mla_kv(kv, kv_scales, rows, slots)
    store_mla_kv(rows, kv, kv_scales, slots)

    assert _same_bits(kv, want_kv)
    if fp8:
        assert _same_bits(kv_scales, want_scales)
    # Other layers are untouched (still NaN).
    assert torch.isnan(data[:, 0].float()).all() and torch.isnan(data[:, 2].float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_mla_store_rejects_mismatched_width(device):
    kv = torch.zeros(2, PAGE_SIZE, 1, 48, device=device)
    rows = torch.zeros(3, 40, device=device)
    with pytest.raises(ValueError):
        store_mla_kv(rows, kv, None, torch.zeros(3, dtype=torch.long, device=device))

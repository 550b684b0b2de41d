"""store_kv against the reference store: bit-exact, fp8 quantisation included."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from batchgen_kernels import reference, store_kv
from batchgen_kernels._common import round_to_e4m3
from kernel_testing import DEVICES, PAGE_SIZE, poisoned


@triton.jit
def _cast_e4m3(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to_e4m3(x).to(y_ptr.dtype.element_ty), mask=offs < n)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included) of two tensors of one dtype."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int).cpu(), b.contiguous().view(as_int).cpu())


def _qkv_views(tokens, heads, kv_heads, head_dim, dtype, device):
    """k, v [T, KVH, D] as strided views of one fused projection, with awkward rows: all
    zeros (amax clamp), tiny values (fp8 subnormals) and a large spread."""
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device)
    qkv[0] = 0.0
    qkv[1] *= 1e-3
    qkv[2, :, : head_dim // 2] *= 1e4
    qkv = qkv.to(dtype)
    return qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,pool_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e4m3fn)])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 32), (3, 24)])
def test_store_matches_reference(device, src_dtype, pool_dtype, kv_heads, head_dim):
    tokens, num_pages, num_layers = 9, 5, 3
    fp8 = pool_dtype == torch.float8_e4m3fn
    shape = (num_pages, num_layers, PAGE_SIZE, 2, kv_heads, head_dim)
    data = poisoned(shape, torch.float32, device).to(pool_dtype)
    scales = poisoned(shape[:-1], torch.float32, device) if fp8 else None
    kv, kv_scales = data[:, 1], (scales[:, 1] if fp8 else None)
    k, v = _qkv_views(tokens, 4, kv_heads, head_dim, src_dtype, device)
    slots = torch.randperm(num_pages * PAGE_SIZE)[:tokens].to(device)
    slots[4] = -1  # a padding token: nothing is written for it

    want_kv, want_scales = reference.store_kv(kv, kv_scales, k, v, slots)
    store_kv(k, v, kv, kv_scales, slots)

    assert _same_bits(kv, want_kv)
    if fp8:
        assert _same_bits(kv_scales, want_scales)
    other_layers = torch.cat([data[:, :1], data[:, 2:]], dim=1)
    assert torch.isnan(other_layers.float()).all(), "wrote outside the layer"


@pytest.mark.parametrize("device", DEVICES)
def test_store_rejects_wrong_pool_shape(device):
    k = torch.randn(2, 2, 32, device=device)
    kv = torch.zeros(3, PAGE_SIZE, 2, 4, 32, device=device)  # 4 KV heads, k has 2
    with pytest.raises(AssertionError):
        store_kv(k, k, kv, None, torch.zeros(2, dtype=torch.int64, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_rounding_matches_torch_cast(device):
    """round_to_e4m3 + cast equals torch's cast on every fp8 value, every tie between two
    neighbours, values just off the ties, and random values from subnormal to 448."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    ties = (grid[1:] + grid[:-1]) / 2
    nudged = torch.cat([ties * (1 + 2.0 ** -20), ties * (1 - 2.0 ** -20)])
    spread = torch.randn(4096) * torch.exp2(torch.randint(-12, 8, (4096,)).float())
    x = torch.cat([grid, ties, nudged, spread.clamp(-448, 448)]).to(device)
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    _cast_e4m3[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))

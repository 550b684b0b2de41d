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
    with pytest.raises(ValueError):
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 24)])
def test_engine_pool_layout_matches_kernels(device, pool_dtype, kv_heads, head_dim):
    """The engine's own store and gather (its CPU path) agree with the kernels on the layout,
    fp8's transposed V blocks included: same bits stored, and gather reads back what the
    reference reads."""
    from batchgen.engine.kv_cache import KVLayout, KVPool

    layout = KVLayout(3, (2, kv_heads, head_dim), pool_dtype, torch.float32)
    by_engine, by_kernel = KVPool(layout, 4, device), KVPool(layout, 4, device)
    tokens = 150
    # bf16-exact inputs: the interpreter truncates float32 -> bf16 where torch rounds.
    k, v = torch.randn(2, tokens, kv_heads, head_dim, device=device).bfloat16().float()
    slots = torch.randperm(4 * PAGE_SIZE)[:tokens].to(device)
    by_engine.store(1, slots, torch.stack([k, v], dim=1))
    store_kv(k, v, *by_kernel.layer(1), slots)

    assert _same_bits(by_engine.data, by_kernel.data)
    if pool_dtype == torch.float8_e4m3fn:
        assert _same_bits(by_engine.scale_pages, by_kernel.scale_pages)
    pages = torch.tensor([2, 0, 3], device=device)
    want = reference.dequantize_pages(*by_kernel.layer(1), pages)
    got = by_engine.gather(1, pages)
    assert torch.equal(got, want.to(got.dtype))
    heads_first = by_engine.gather_heads(1, pages)
    assert torch.equal(heads_first, want.view(3, PAGE_SIZE, 2, kv_heads, head_dim).permute(
        2, 3, 0, 1, 4).to(heads_first.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_stores_write_nan_as_zero(device):
    """fp8 pools never hold NaN (the attention kernels read whole fp8 V pages): both the
    kernel and the engine's CPU store write a NaN input as 0 and its row's finite values
    stay as quantised."""
    from batchgen.engine.kv_cache import KVLayout, KVPool

    layout = KVLayout(1, (2, 2, 64), torch.float8_e4m3fn, torch.float32)
    by_engine, by_kernel = KVPool(layout, 1, device), KVPool(layout, 1, device)
    k, v = torch.randn(2, 5, 2, 64, device=device)
    k[1, 0, 3] = v[2, 1, 10] = float("nan")
    slots = torch.arange(5, device=device)
    by_engine.store(0, slots, torch.stack([k, v], dim=1))
    store_kv(k, v, *by_kernel.layer(0), slots)
    for pool in (by_engine, by_kernel):
        assert not pool.data.float().isnan().any()
        # k[1, 0, 3] at slot 1; v[2, 1, 10] at flat position 10 * 64 + 2 of head 1's V block.
        assert pool.data[0, 0, 1, 0, 0, 3] == 0 and pool.data[0, 0, 10, 1, 1, 2] == 0
        back = pool.gather(0, torch.tensor([0], device=device))
        torch.testing.assert_close(back[[0, 3, 4]], torch.stack([k, v], 1)[[0, 3, 4]],
                                   rtol=0.07, atol=1e-3)  # rows without NaN: as quantised

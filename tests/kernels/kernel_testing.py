"""Helpers for the kernel tests: devices, tolerances, poisoned buffers, random paged KV."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import reference
from batchgen_kernels._common import PAGE_SIZE, fp8_v_stored, interpreting

from batchgen.engine.kv_cache import KVLayout

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not interpreting(), reason="CPU tensors need the Triton interpreter")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]
"""Parametrise a test's `device` over these: CPU (interpreter) by default, CUDA when present."""

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Bound on max|out - ref| / max|ref| against a float64 reference, per output dtype."""


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Every element finite (outputs start poisoned with NaN) and within tol of ref's scale."""
    assert torch.isfinite(out).all(), f"{what}: non-finite (unwritten?) elements in output"
    diff = (out.double() - ref.double().to(out.device)).abs().max().item()
    scale = max(ref.double().abs().max().item(), 1e-12)
    assert diff <= tol * scale, f"{what}: max error {diff:.3g} > {tol:g} x {scale:.3g}"


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A tensor full of NaN, so any element a kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def make_paged_kv(ctx_lens: list[int], kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                  device: str, num_layers: int = 2, layer: int = 1, spare_pages: int = 3):
    """A GQA pool: `make_paged_pool` with token shape (2, KVH, D), i.e. the layer view
    [num_pages, 64, 2, KVH, D] (index 0 of the third dim is K, 1 is V)."""
    return make_paged_pool(ctx_lens, (2, kv_heads, head_dim), kv_dtype, device, num_layers,
                           layer, spare_pages)


def make_paged_pool(ctx_lens: list[int], token_shape: tuple[int, ...], kv_dtype: torch.dtype,
                    device: str, num_layers: int = 2, layer: int = 1, spare_pages: int = 3):
    """A NaN-poisoned pool [pages, layers, 64, *token_shape] with random values in each
    sequence's first ctx slots. fp8 GQA pools are poisoned with 448 instead (fp8 pools never
    hold NaN, and the kernels read whole fp8 V pages) and store V blocks transposed, as the
    kernels read them.

    Returns (kv, kv_scales, page_table): the layer view `data[:, layer]` (strided over pages,
    like the engine's), its scales view [pages, 64, *token_shape[:-1]] for fp8 (else None;
    strided like the engine's: slots innermost in memory),
    and an int32 page table of shuffled page ids.
    """
    pages_per_seq = [-(-c // PAGE_SIZE) for c in ctx_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    fp8 = kv_dtype == torch.float8_e4m3fn
    shape = (num_pages, num_layers, PAGE_SIZE, *token_shape)
    data = poisoned(shape, torch.float32, device).to(kv_dtype)
    gqa_fp8 = fp8 and len(token_shape) == 3
    if gqa_fp8:  # fp8 pools never hold NaN, and GQA kernels read whole fp8 V pages
        data.fill_(448.0)
    scales = None
    if fp8:  # stored as the engine's pools store them: a page's slots innermost
        storage = KVLayout(num_layers, token_shape, kv_dtype, torch.float32).scale_pages_shape(
            num_pages)
        scales = poisoned(storage, torch.float32, device).movedim(-1, 2)
    order = torch.randperm(num_pages)
    table = torch.zeros(len(ctx_lens), max(pages_per_seq), dtype=torch.int32)
    start = 0
    for b, (ctx, n) in enumerate(zip(ctx_lens, pages_per_seq)):
        table[b, :n] = order[start:start + n]
        start += n
        slots = torch.arange(ctx)
        page, offset = table[b, slots // PAGE_SIZE].long(), slots % PAGE_SIZE
        values = torch.randn(ctx, *token_shape, device=device)
        if fp8:
            data[page, layer, offset] = (values * 100).clamp(-448, 448).to(kv_dtype)
            scales[page, layer, offset] = torch.rand(ctx, *token_shape[:-1], device=device) * 0.02
        else:
            data[page, layer, offset] = values.to(kv_dtype)
    if gqa_fp8:  # stored with V blocks transposed
        data[:, layer] = reference.convert_v_blocks(data[:, layer], fp8_v_stored)
    kv_scales = scales[:, layer] if fp8 else None
    return data[:, layer], kv_scales, table.to(device)

"""Page gather/scatter: copy many scattered whole pages between two pools in one launch.

A page is one contiguous block of num_layers * 64 * prod(token_shape) elements, so copying
page src_pages[i] to dst_pages[i] is a flat block copy. Both pools are viewed as int32 words
(every page's byte size is a multiple of 4), so one kernel serves every dtype, fp8 included.
Program (i, j) copies the j-th BLOCK-word chunk of the i-th page pair.

Issuing one cudaMemcpy per page (or per page per layer) costs ~13 us each (docs/architecture.md,
"Measured transfer costs");
this kernel costs one launch. On GPU either pool may live in pinned host memory: the kernel
reads or writes it through its device-visible (UVA) address, so host <-> device transfers of
scattered pages need no staging buffer. Scales of fp8 pools take a second launch.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from ._common import interpreting


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, src_pages_ptr, dst_pages_ptr, page_words,
                       BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src_page = tl.load(src_pages_ptr + pair).to(tl.int64)
    dst_page = tl.load(dst_pages_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_words
    words = tl.load(src_ptr + src_page * page_words + offs, mask=mask)
    tl.store(dst_ptr + dst_page * page_words + offs, words, mask=mask)


def _as_words(pool: torch.Tensor) -> torch.Tensor:
    """A contiguous pool [num_pages, ...] as int32 words [num_pages, page_words]."""
    page_bytes = math.prod(pool.shape[1:]) * pool.element_size()
    assert page_bytes % 4 == 0, "page size must be a multiple of 4 bytes"
    return pool.view(torch.uint8).view(pool.shape[0], page_bytes).view(torch.int32)


def _launch_device(*tensors: torch.Tensor) -> torch.device:
    """The GPU that runs the copy: the first CUDA tensor's (host pools must be pinned)."""
    for t in tensors:
        if t.is_cuda:
            return t.device
    assert interpreting(), "page copies need a CUDA tensor (or TRITON_INTERPRET=1)"
    return tensors[0].device


def _check_pool(name: str, pool: torch.Tensor) -> None:
    assert pool.is_contiguous(), f"{name} must be contiguous (pages are flat blocks)"
    assert pool.is_cuda or pool.is_pinned() or interpreting(), (
        f"{name} on the host must be pinned so the GPU can address it")


def copy_pages(src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor,
               dst_pages: torch.Tensor, src_scales: torch.Tensor | None = None,
               dst_scales: torch.Tensor | None = None, block: int = 4096) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]] for every i (and the same for the scales).

    src, dst            [num_pages, num_layers, 64, *token_shape] pools of one dtype and page
                        shape (page counts may differ); contiguous; on the GPU or, for one of
                        them, in pinned host memory.
    src_pages, dst_pages [N] int32/int64 page ids on the launching GPU; dst_pages distinct
                        (otherwise which copy lands is unspecified).
    src_scales, dst_scales [num_pages, num_layers, 64, *token_shape[:-1]] float32 for fp8
                        pools (both or neither), same placement rules as the pools.
    block               int32 words per program (a power of two).
    """
    assert src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:], (
        f"pools differ: {src.dtype}{tuple(src.shape)} vs {dst.dtype}{tuple(dst.shape)}")
    assert src_pages.shape == dst_pages.shape and src_pages.dim() == 1, "page ids are [N]"
    assert src_pages.dtype in (torch.int32, torch.int64), "page ids must be int32/int64"
    assert dst_pages.dtype in (torch.int32, torch.int64), "page ids must be int32/int64"
    assert (src_scales is None) == (dst_scales is None), "give both scales or neither"
    assert block == triton.next_power_of_2(block), "block must be a power of two"
    _check_pool("src", src)
    _check_pool("dst", dst)
    device = _launch_device(src, dst)
    for ids in (src_pages, dst_pages):
        assert ids.device == device, f"page ids must be on {device}, not {ids.device}"
    if src_pages.numel() == 0:
        return
    pools = [(src, dst)]
    if src_scales is not None:
        assert src_scales.shape[0] == src.shape[0] and dst_scales.shape[0] == dst.shape[0]
        assert src_scales.shape[1:] == dst_scales.shape[1:], "scale pools differ"
        _check_pool("src_scales", src_scales)
        _check_pool("dst_scales", dst_scales)
        pools.append((src_scales, dst_scales))
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        for a, b in pools:
            a_words, b_words = _as_words(a), _as_words(b)
            page_words = a_words.shape[1]
            grid = (src_pages.numel(), triton.cdiv(page_words, block))
            _copy_pages_kernel[grid](a_words, b_words, src_pages, dst_pages, page_words,
                                     BLOCK=block, num_warps=4)


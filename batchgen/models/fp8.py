"""FP8 e4m3 block-scaled weights, as DeepSeek-V3/R1 ship them.

A weight W [N, K] is stored as `weight` [N, K] float8_e4m3fn plus `weight_scale_inv`
[ceil(N/bn), ceil(K/bk)] float32, (bn, bk) = quantization_config.weight_block_size (128x128 for
R1): W[n, k] ~= weight[n, k] * weight_scale_inv[n // bn, k // bk].

How `x @ W.T` is computed:
- CPU, and --pre-dequantize-weights: dequantize once at load, then a dense matmul.
- CUDA: activations are quantized per (row, bk-column group) to e4m3 with a float32 scale
  `xs` [M, ceil(K/bk)] (bk = 128 for R1), so every bk-wide step of K has one activation scale
  per row and one weight scale; the block-scaled GEMM is torch's `_scaled_mm` (blockwise 1x128
  x 128x128 recipe) when it accepts the shapes and agreed with the reference on a probe, else
  our Triton kernel `_fp8_gemm_kernel`.
- `block_matmul_reference`: that arithmetic in plain PyTorch, which both are tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.models.fp8_rowwise import (
    QuantizedRows,
    is_row_scaled,
    quantize_rows,
    row_scaled_matmul,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fp8 weights are dequantized there and never get here
    triton = tl = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class QuantizedWeight(NamedTuple):
    """A checkpoint matrix kept in FP8: e4m3 weight [N, K] and its block scales."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]


def quantization_config(hf_config) -> dict:
    """A config's quantization_config as a dict ({} when absent): configs read from disk keep
    the dict, transformers' quantizer classes turn it into an object."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    if isinstance(quant, dict):
        return quant
    return quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)


def quant_method(hf_config) -> str:
    """quantization_config.quant_method in lower case ("" when absent)."""
    method = quantization_config(hf_config).get("quant_method")
    return str(getattr(method, "value", method) or "").lower()


def weight_block_size(hf_config) -> tuple[int, int]:
    """quantization_config.weight_block_size, 128x128 when absent."""
    bn, bk = quantization_config(hf_config).get("weight_block_size") or (128, 128)
    return int(bn), int(bk)


SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
"""Block scales (DeepSeek: `weight_scale_inv` [N/bn, K/bk]) or a per-tensor scale (common FP8
checkpoints: `weight_scale`, one value); both multiply the e4m3 values back."""


STATIC_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")
"""Calibrated scales FP8 checkpoints may carry (AutoFP8's static activations, llm-compressor's
kv_cache_scheme), which batchgen has no use for."""


def pair_scales(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                keep_fp8: bool, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """Join each e4m3 `X.weight` with its `X.weight_scale_inv` / `X.weight_scale` (in either
    order) and yield (X.weight, QuantizedWeight) when `keep_fp8`, else the weight dequantized
    to `dtype`. A per-tensor or per-channel scale becomes one scale per row (block (1, K): the
    row-scaled GEMM of fp8_rowwise.py). Static activation and KV-cache scales (STATIC_SCALES)
    are dropped: activations are quantized dynamically, and fp8 KV pools scale each token as
    it is stored. Every other tensor passes through unchanged."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(STATIC_SCALES):
            continue
        if name.endswith(SCALE_SUFFIXES):
            base = name[: name.rindex(".weight_scale")] + ".weight"
            if base not in weights_waiting:
                scales_waiting[base] = tensor
                continue
            weight, scale = weights_waiting.pop(base), tensor
        elif tensor.dtype == FP8:
            if name not in scales_waiting:
                weights_waiting[name] = tensor
                continue
            weight, scale, base = tensor, scales_waiting.pop(name), name
        else:
            yield name, tensor
            continue
        scale, weight_block = block_grid(scale.float(), tuple(weight.shape), block)
        if keep_fp8:
            yield base, QuantizedWeight(weight, scale, weight_block)
        else:
            yield base, dequantize_blocks(weight, scale, weight_block, dtype)
    unpaired = sorted(weights_waiting) + sorted(scales_waiting)
    if unpaired:
        raise ValueError("FP8 weights without their weight_scale_inv (or the reverse): "
                         f"{unpaired[:3]}")


def block_grid(scale: torch.Tensor, shape: tuple[int, int],
               block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """(scales, block) of a weight [N, K]: block scales on their [ceil(N/bn), ceil(K/bk)]
    grid as given; a per-tensor (one value) or per-channel ([N] / [N, 1]) scale as [N, 1] with
    block (1, K), one scale per row."""
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if scale.dim() == 2 and tuple(scale.shape) == grid:
        return scale, block
    if scale.numel() in (1, shape[0]):
        return scale.reshape(-1, 1).expand(shape[0], 1).contiguous(), (1, shape[1])
    raise ValueError(f"FP8 scale of shape {tuple(scale.shape)} fits neither the {grid} block grid "
                     f"nor one value per row of a {shape} weight")


def narrow_quantized(value: QuantizedWeight, dim: int, start: int, length: int,
                     dtype: torch.dtype) -> QuantizedWeight | torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a block-quantized matrix:
    still FP8 when the cut falls on scale-block edges (or within a row-scaled matrix's rows),
    else dequantized to `dtype`."""
    if dim == 1 and is_row_scaled(value.block, value.weight.shape[1]):
        return QuantizedWeight(value.weight.narrow(1, start, length), value.scale_inv, (1, length))
    edge = value.block[dim]
    if start % edge or (length % edge and start + length != value.weight.shape[dim]):
        return dequantize_blocks(value.weight, value.scale_inv, value.block,
                                 dtype).narrow(dim, start, length)
    scales = value.scale_inv.narrow(dim, start // edge, -(-length // edge))
    return QuantizedWeight(value.weight.narrow(dim, start, length), scales, value.block)


def on_block_grid(value: QuantizedWeight, block: tuple[int, int]) -> QuantizedWeight | None:
    """A row-scaled weight restated on `block`'s scale grid (for kernels that take only block
    scales), or None when its rows' scales differ within a block (a per-channel scale)."""
    if not is_row_scaled(value.block, value.weight.shape[1]):
        return value
    n, k = value.weight.shape
    bn = block[0]
    scales = value.scale_inv.reshape(-1)
    rows = torch.cat([scales, scales[-1:].expand(-n % bn)]).view(-1, bn)  # last block padded
    if not bool((rows == rows[:, :1]).all()):
        return None
    grid = rows[:, :1].expand(-1, -(-k // block[1])).contiguous()
    return QuantizedWeight(value.weight, grid, tuple(block))


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """W [N, K] -> (e4m3 weight [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32).

    Each block's scale maps its largest |value| onto 448, the largest finite e4m3 value."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int],
                  block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [..., nb, kb] -> per-element [..., N, K]."""
    full = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., : shape[0], : shape[1]]


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_blocks`; also takes stacked experts q [E, N, K], scale [E, nb, kb]."""
    full = expand_scales(scale_inv.float(), tuple(q.shape[-2:]), block)
    return (q.float() * full).to(dtype)


def quantize_activations(x: torch.Tensor, group: int = 128):
    """x [M, K] -> (e4m3 [M, K], scales [M, ceil(K/group)] float32), one scale per row group."""
    m, k = x.shape
    groups = -(-k // group)
    tiles = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = tiles.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def block_matmul_reference(xq, xs, wq, ws, block=(128, 128), out_dtype=torch.float32):
    """Dequantize both operands in float32 and multiply: [M, K] x [N, K]^T -> [M, N]."""
    x = xq.float() * expand_scales(xs, tuple(xq.shape), (1, block[1]))
    return (x @ dequantize_blocks(wq, ws, block).T).to(out_dtype)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [..., K] @ W.T for a block-quantized W; output in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if not x.is_cuda:
        out = F.linear(x2, dequantize_blocks(wq, ws, block, x.dtype))
    elif x2.shape[0] == 0:
        out = x2.new_zeros(0, wq.shape[0])
    elif is_row_scaled(block, k):
        out = row_scaled_matmul(quantize_rows(x2), wq, ws, x.dtype)
    else:
        xq, xs = _quantize_on_device(x2, block[1])
        out = block_matmul(xq, xs, wq, ws, block, x.dtype)
    return out.reshape(*lead, wq.shape[0])


def _quantize_on_device(x: torch.Tensor, group: int):
    """The fused Triton quantizer (one read of x) where it applies; the torch reference costs
    ~8 elementwise kernels with float32 temporaries (40% of an FP8 prefill step, measured)."""
    if triton is not None and x.shape[1] % group == 0 and group >= 16 and group & (group - 1) == 0:
        import batchgen_kernels as K

        return K.quantize_fp8_groups(x.contiguous(), group)
    return quantize_activations(x, group)


def block_matmul(xq, xs, wq, ws, block=(128, 128), out_dtype=torch.bfloat16) -> torch.Tensor:
    """CUDA block-scaled GEMM: torch's `_scaled_mm` where it works, else the Triton kernel.
    xs must come from `quantize_activations(x, block[1])`."""
    n, k = wq.shape
    if block == (128, 128) and _scaled_mm_fits(n, k) and _scaled_mm_works(xq.device, n, k):
        return _scaled_mm_blockwise(xq, xs, wq, ws, out_dtype)
    return triton_block_matmul(xq, xs, wq, ws, block, out_dtype)


def _scaled_mm_fits(n: int, k: int) -> bool:
    # Seen on an H200 (torch 2.11, CUDA 13): cuBLASLt's blockwise recipe returns WRONG results,
    # silently, when ceil(K/128) is not a multiple of 4 (K = 256, 768 tried), so those shapes
    # never go there; the per-shape probe guards against cases nobody tried.
    return k % 128 == 0 and n % 128 == 0 and (k // 128) % 4 == 0


def _scaled_mm_blockwise(xq, xs, wq, ws, out_dtype):
    # cuBLASLt wants A's scales M-major (stride (1, M), M a multiple of 4: it rejects M = 1 or
    # 5) and B = W.T column-major with its 128x128 scales transposed alongside.
    m = xq.shape[0]
    pad = -m % 4
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        xs = torch.cat([xs, xs.new_ones(pad, xs.shape[1])])
    xs_m_major = xs.t().contiguous().t()
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs_m_major, scale_b=ws.t(), out_dtype=out_dtype)
    return out[:m]


@functools.cache
def _scaled_mm_works(device: torch.device, n: int, k: int) -> bool:
    """Probe once per device and weight shape: does this torch/cuBLAS build run the blockwise
    recipe, and agree with the reference?"""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(16, k, device=device, generator=gen)
    w = torch.randn(n, k, device=device, generator=gen)
    xq, xs = quantize_activations(x)
    wq, ws = quantize_blocks(w)
    try:
        out = _scaled_mm_blockwise(xq, xs, wq, ws, torch.float32)
    except (RuntimeError, TypeError, ValueError):
        return False
    ref = block_matmul_reference(xq, xs, wq, ws)
    return bool(((out - ref).norm() <= 1e-3 * ref.norm()).item())


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight stays e4m3 with per-block or per-row scales (CUDA
    only)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 reduce_over=None, output_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        # A tensor-parallel slice arrives as a view of the whole checkpoint tensor: keep a
        # compact copy (the blockwise scaled GEMM needs unit inner strides, and a view would
        # hold the whole tensor's memory).
        self.weight = nn.Parameter(compact(weight), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(compact(scale_inv.float()), requires_grad=False)
        self.block = tuple(block)
        self.reduce_over = reduce_over
        """The TensorParallel group summing a row-parallel layer's partial outputs, or None."""
        self.output_dtype = output_dtype
        """The model's dtype: outputs computed from QuantizedRows (a tensor input's dtype wins)."""

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    @property
    def row_scaled(self) -> bool:
        """One scale per weight row: the input may come as QuantizedRows (fp8_rowwise.py)."""
        return is_row_scaled(self.block, self.weight.shape[1])

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            assert self.row_scaled, "QuantizedRows feed only row-scaled FP8 projections"
            out = row_scaled_matmul(x, self.weight, self.weight_scale_inv, self.output_dtype)
        else:
            out = fp8_linear(x, self.weight, self.weight_scale_inv, self.block)
        return out if self.reduce_over is None else self.reduce_over.all_reduce(out)


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is contiguous and alone in its storage, else a contiguous copy of it."""
    alone = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.is_contiguous() and alone else t.clone(memory_format=torch.contiguous_format)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of an nn.Linear or Fp8Linear as a dense matrix."""
    if isinstance(linear, Fp8Linear):
        return linear.dense_weight(dtype)
    return linear.weight.to(dtype)


# -- Triton kernel ----------------------------------------------------------------------------
def triton_block_matmul(xq, xs, wq, ws, block=(128, 128), out_dtype=torch.bfloat16):
    """Launcher: xq [M, K] e4m3, xs [M, ceil(K/bk)], wq [N, K] e4m3, ws [ceil(N/bn), ceil(K/bk)]."""
    assert triton is not None, "the FP8 block GEMM needs Triton (pip install triton)"
    m, k = xq.shape
    n = wq.shape[0]
    bn, bk = block
    assert xq.dtype == FP8 and wq.dtype == FP8, (xq.dtype, wq.dtype)
    assert wq.shape[1] == k and bk >= 16 and bk & (bk - 1) == 0, (tuple(wq.shape), k, block)
    assert tuple(xs.shape) == (m, -(-k // bk)) and tuple(ws.shape) == (-(-n // bn), -(-k // bk))
    assert xq.stride(1) == 1 and wq.stride(1) == 1, "K must be the contiguous dimension"
    block_n = min(64, bn)
    assert bn % block_n == 0 and block_n >= 16 and block_n & (block_n - 1) == 0, (
        f"weight block n {bn}: need 16, 32 or a multiple of 64")
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    xs, ws = xs.float().contiguous(), ws.float().contiguous()
    _compiled_kernel()[grid](
        xq, wq, xs, ws, out, m, n, k, triton.cdiv(k, bk), xq.stride(0), wq.stride(0), out.stride(0),
        xs.stride(0), ws.stride(0), bn,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, F32_DOT=not xq.is_cuda)
    return out


@functools.cache
def _compiled_kernel():
    # Decorated on first use, not at import: TRITON_INTERPRET is read when jit() runs, and
    # CPU tests turn the interpreter on only around their own calls. (So the kernel calls no
    # @triton.jit helper such as tl.cdiv or tl.zeros: those were jit-ed when triton was imported.)
    return triton.jit(_fp8_gemm_kernel, do_not_specialize=["M"])  # one variant for any M


if tl is not None:
    def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, k_blocks,
                         stride_x, stride_w, stride_out, stride_xs, stride_ws, weight_block_n,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         F32_DOT: tl.constexpr):
        """One program: out[BLOCK_M, BLOCK_N]. Each 128-wide K step is one activation group and
        one weight block column, so its partial product is scaled once: xs[m] * ws[block]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < M, offs_n < N
        w_block_row = (pid_n * BLOCK_N) // weight_block_n
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for kb in range(k_blocks):
            ks = kb * BLOCK_K + offs_k
            mask_k = ks < K
            a = tl.load(x_ptr + offs_m[:, None] * stride_x + ks[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptr + offs_n[None, :] * stride_w + ks[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            if F32_DOT:  # the interpreter's dot mishandles 8/16-bit operands
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b)
            a_scale = tl.load(xs_ptr + offs_m * stride_xs + kb, mask=mask_m, other=0.0)
            b_scale = tl.load(ws_ptr + w_block_row * stride_ws + kb)
            acc += part * a_scale[:, None] * b_scale
        out_ptrs = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

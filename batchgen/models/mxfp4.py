"""MXFP4 codec, in the layout the gpt-oss checkpoints ship (and transformers reads).

A weight `[..., K]` is cut along its last (input) dim into blocks of 32 values. Each block is
one e8m0 scale byte `s` (value 2^(s - 127)) and 32 e2m1 codes packed two per byte:
    blocks [..., K / 32, 16] uint8   byte j = code[2j] | code[2j + 1] << 4  (low nibble first)
    scales [..., K / 32]     uint8
An e2m1 code is sign(bit 3) | exponent(bits 2-1) | mantissa(bit 0), one of
    +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}   (E2M1_VALUES, indexed by code).
gpt-oss experts: `gate_up_proj_blocks [E, 2I, H/32, 16]` and `down_proj_blocks [E, H, I/32, 16]`,
i.e. output-major: dequantized they are `[E, out, in]`, the nn.Linear weight layout.

Quantizer: the scale is the smallest power of two with amax <= 6 * scale (the rounding OpenAI's
triton_kernels downcast uses, so no value is clipped); codes round to nearest, ties to even code.
Dequantizing is exact in float32 and bfloat16 (every value has at most 2 significant bits).
The Triton kernel is imported lazily: TRITON_INTERPRET is read when `@triton.jit` runs, so
tests can turn the interpreter on after this module was imported.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 32
"""Values per scale."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
# Midpoints between neighbouring magnitudes 0..6; `True` where a tie rounds up (to the even
# code above), `False` where it rounds down (the code below is even).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
              (2.5, False), (3.5, True), (5.0, False))


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float `[..., K]` (K % 32 == 0) -> (blocks `[..., K/32, 16]`, scales `[..., K/32]`) uint8."""
    assert x.shape[-1] % BLOCK == 0, f"last dim {x.shape[-1]} is not a multiple of {BLOCK}"
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    exponent = _block_exponent(xf.abs().amax(dim=-1))
    scaled = xf * _pow2(-exponent).unsqueeze(-1)  # power-of-two scaling: exact
    codes = _round_to_e2m1(scaled)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8)


def _block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax <= 6 * 2^e, clamped to e8m0's [-127, 127] (int32).

    With amax = m * 2^p (m in [0.5, 1)): 6 * 2^e = 0.75 * 2^(e + 3), so e = p - 3 when
    m <= 0.75, else p - 2. Integer arithmetic, no log2 rounding at the boundaries."""
    mantissa, power = torch.frexp(amax)
    exponent = torch.where(mantissa <= 0.75, power - 3, power - 2)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -E8M0_BIAS), exponent)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8): nearest magnitude, ties to even code, saturating at 6."""
    magnitude = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for midpoint, tie_up in _MIDPOINTS:
        code += (magnitude >= midpoint) if tie_up else (magnitude > midpoint)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(blocks `[..., G, 16]`, scales `[..., G]`) -> `[..., G * 32]` in `dtype`.

    Runs the Triton kernel on CUDA tensors and the PyTorch reference elsewhere."""
    if blocks.is_cuda:
        return dequantize_mxfp4_triton(blocks, scales, dtype)
    return dequantize_mxfp4_torch(blocks, scales, dtype)


def dequantize_mxfp4_torch(blocks: torch.Tensor, scales: torch.Tensor,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure-PyTorch reference of the dequantizer (same contract as `dequantize_mxfp4`)."""
    _check_packed(blocks, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    values = lut[codes.long()] * _pow2(scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent (int32 in [-127, 128]) as float32, built from its bit pattern: exact, where
    torch.pow / ldexp may go through an approximate exp2 on some backends. -127 is subnormal,
    128 is inf (e8m0's 0xFF)."""
    biased = exponent + E8M0_BIAS
    bits = torch.where(biased == 0, torch.full_like(biased, 0x00400000), biased << 23)
    return bits.view(torch.float32)


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[-1] == BLOCK // 2, f"blocks last dim {blocks.shape[-1]} != {BLOCK // 2}"
    assert blocks.shape[:-1] == scales.shape, (tuple(blocks.shape), tuple(scales.shape))


# -- Triton ------------------------------------------------------------------------------------

ROWS_PER_PROGRAM = 64
"""32-value blocks each program dequantizes (64 x 16 bytes in, 64 x 32 values out)."""


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton launcher: same contract as `dequantize_mxfp4`.

    blocks and scales must be contiguous and on CUDA, or on CPU under TRITON_INTERPRET=1.
    Output dtype float32, float16 or bfloat16."""
    import os

    _check_packed(blocks, scales)
    assert blocks.is_contiguous() and scales.is_contiguous(), "blocks/scales must be contiguous"
    assert dtype in (torch.float32, torch.float16, torch.bfloat16), dtype
    interpreting = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    assert blocks.is_cuda or interpreting, "CPU tensors need TRITON_INTERPRET=1"
    assert scales.device == blocks.device, (scales.device, blocks.device)
    rows = scales.numel()
    out = torch.empty((*scales.shape, BLOCK), dtype=dtype, device=blocks.device)
    if rows:
        grid = (-(-rows // ROWS_PER_PROGRAM),)
        _triton_kernel()[grid](blocks, scales, out, rows, ROWS=ROWS_PER_PROGRAM)
    return out.flatten(-2)


@functools.cache
def _triton_kernel():
    """Build (once) the jit kernel; deferred so TRITON_INTERPRET is read at first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def mxfp4_dequant_kernel(blocks_ptr, scales_ptr, out_ptr, rows, ROWS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mask = row < rows
        packed = tl.load(blocks_ptr + row[:, None] * 16 + tl.arange(0, 16)[None, :],
                         mask=mask[:, None], other=0).to(tl.int32)
        code = tl.interleave(packed & 0x0F, packed >> 4)  # [ROWS, 32]: low nibble first
        # Values are assembled from float32 bit patterns (integer ops, no exp2 approximation).
        exponent = (code >> 1) & 3
        mantissa = code & 1
        bits = tl.where(exponent == 0, mantissa * 0x3F000000,  # 0 or 0.5 (e2m1 subnormal)
                        ((exponent + 126) << 23) | (mantissa << 22))
        bits = bits | ((code & 8) << 28)  # sign
        s = tl.load(scales_ptr + row, mask=mask, other=127).to(tl.int32)
        # 2^(s - 127) from its bit pattern; s = 0 is the subnormal 2^-127, s = 255 gives inf.
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        values = bits.to(tl.float32, bitcast=True) * scale[:, None]
        col = tl.arange(0, 32)
        tl.store(out_ptr + row[:, None] * 32 + col[None, :],
                 values.to(out_ptr.dtype.element_ty), mask=mask[:, None])

    return mxfp4_dequant_kernel

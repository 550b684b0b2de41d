"""MXFP4 codec: quantizer and dequantizers against a float64 reference, the checkpoint layout
against transformers' own dequantizer, and the Triton kernel against the PyTorch path."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Read when the kernel is jit-decorated (mxfp4 builds it lazily, at first launch).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from batchgen.models.mxfp4 import (
    E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_mxfp4_torch,
    dequantize_mxfp4_triton,
    quantize_mxfp4,
)

MAGNITUDES = E2M1_VALUES[:8]
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_quantize(x: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """float64, one block at a time: e = ceil(log2(amax / 6)); each value -> nearest e2m1
    magnitude of x / 2^e, ties to the even code. Returns (codes per block, scale bytes)."""
    codes, scales = [], []
    for block in x.double().reshape(-1, 32).tolist():
        amax = max(abs(v) for v in block)
        e = -127 if amax == 0 else min(127, max(-127, math.ceil(math.log2(amax / 6))))
        scales.append(e + 127)
        row = []
        for v in block:
            y = abs(v) / 2.0 ** e
            best = min(range(8), key=lambda c: (abs(MAGNITUDES[c] - y), c % 2))
            row.append(best | (8 if math.copysign(1.0, v) < 0 else 0))
        codes.append(row)
    return codes, scales


def unpack_codes(blocks: torch.Tensor) -> list[list[int]]:
    b = blocks.reshape(-1, 16)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(-1, 32).tolist()


def edge_case_blocks() -> torch.Tensor:
    """Blocks that stress the scale and rounding rules (one block per row)."""
    rows = [torch.zeros(32), -torch.zeros(32)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # amax 6 -> e = 0
    rows += [ties, -ties, ties * 2.0 ** -30, ties * 2.0 ** 40]
    just_above = torch.full((32,), 0.5)
    just_above[0] = torch.nextafter(torch.tensor(6.0), torch.tensor(7.0))  # -> e = 1
    rows += [just_above, torch.full((32,), 4.0)]
    tiny = torch.full((32,), 1e-40)  # float32 subnormals; scale clamps at 2^-127
    tiny[1] = 2.0 ** -126
    rows += [tiny, torch.full((32,), 3e38), torch.linspace(-7, 7, 32)]
    return torch.stack(rows)


def random_blocks(gen: torch.Generator, rows: int) -> torch.Tensor:
    """Normal values with a per-row magnitude between 2^-40 and 2^40."""
    x = torch.randn(rows, 64, generator=gen)
    return x * torch.pow(2.0, torch.randint(-40, 41, (rows, 1), generator=gen).float())


@pytest.mark.parametrize("source", ["edge", "random"])
def test_quantize_matches_float64_reference(source):
    x = (edge_case_blocks() if source == "edge"
         else random_blocks(torch.Generator().manual_seed(0), 64))
    blocks, scales = quantize_mxfp4(x)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (x.shape[0], x.shape[1] // 32, 16) and scales.shape == blocks.shape[:-1]
    ref_codes, ref_scales = reference_quantize(x)
    assert scales.flatten().tolist() == ref_scales
    assert unpack_codes(blocks) == ref_codes


def test_dequantize_round_trip_is_exact_in_float64():
    x = torch.cat([edge_case_blocks(),
                   random_blocks(torch.Generator().manual_seed(1), 32).reshape(-1, 32)])
    blocks, scales = quantize_mxfp4(x)
    codes, scale_bytes = reference_quantize(x)
    expected = torch.tensor([[E2M1_VALUES[c] * 2.0 ** (s - 127) for c in row]
                             for row, s in zip(codes, scale_bytes)], dtype=torch.float64)
    got = dequantize_mxfp4(blocks, scales, torch.float32).reshape(-1, 32)
    # Exact wherever float32 holds the value (3e38 rounds up to 2^128: inf, as in any float32).
    assert torch.equal(got, expected.to(torch.float32))
    # Dequantized values lie on the grid: a second round trip returns them unchanged (the
    # encoding may differ: a block whose max rounded down to 3 gets the next smaller scale).
    finite = got[torch.isfinite(got).all(dim=-1)]
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(finite), torch.float32), finite)


def every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """All 256 bytes under each finite e8m0 scale 0..254 (255 is NaN in the format)."""
    scales = torch.arange(255, dtype=torch.uint8).repeat_interleave(16).reshape(255, 16)
    blocks = torch.arange(256, dtype=torch.int32).reshape(16, 16).to(torch.uint8)
    return blocks.expand(255, 16, 16).contiguous(), scales.contiguous()


def test_dequantize_every_code_and_scale_against_float64():
    blocks, scales = every_code_and_scale()
    nib = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    expected = table[nib] * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    got = dequantize_mxfp4_torch(blocks, scales, torch.float32)
    # Exact wherever float32 can hold the value; beyond its range (scale bytes >= 253) inf.
    assert torch.equal(got, expected.flatten(-2).to(torch.float32))
    for dtype in (torch.bfloat16, torch.float16):  # exact wherever dtype can hold the value
        assert torch.equal(dequantize_mxfp4_torch(blocks, scales, dtype), got.to(dtype))


def test_layout_matches_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 40, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 40, 3), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2), theirs)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's numpy ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_kernel_equals_torch_on_every_code_and_scale(dtype):
    blocks, scales = every_code_and_scale()
    if dtype == torch.bfloat16 and KERNEL_DEVICE == "cpu":
        # The interpreter's float32 -> bfloat16 cast mishandles subnormals, which only
        # scale bytes 0 and 1 produce (2^-127, 2^-126: never seen in real checkpoints).
        blocks, scales = blocks[2:].contiguous(), scales[2:].contiguous()
    ref = dequantize_mxfp4_torch(blocks, scales, dtype)
    out = dequantize_mxfp4_triton(blocks.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("shape", [(1, 1), (3, 37, 2), (2, 70, 4)])
def test_triton_kernel_on_expert_shaped_tensors(shape):
    """Row counts that are not multiples of the program size exercise the masks."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape[:-1], shape[-1] * 32, generator=gen)
    blocks, scales = quantize_mxfp4(x)
    out = dequantize_mxfp4_triton(blocks.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE),
                                  torch.bfloat16)
    assert out.shape == x.shape
    assert torch.equal(out.cpu(), dequantize_mxfp4_torch(blocks, scales, torch.bfloat16))


def test_triton_launcher_rejects_bad_inputs():
    blocks, scales = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(AssertionError):
        dequantize_mxfp4_triton(blocks, scales[:, :1].contiguous())
    with pytest.raises(AssertionError):
        dequantize_mxfp4_triton(blocks.transpose(0, 1), scales.transpose(0, 1))
    with pytest.raises(AssertionError):
        dequantize_mxfp4_triton(blocks.int(), scales)

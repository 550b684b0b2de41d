"""Per-row e4m3 activation quantizers: the plain one against the reference (bit for bit), and
the fused RMSNorm / SiLU-and-mul variants against quantizing the unfused kernels' outputs."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_fp8,
    quantize_fp8_rows,
    reference,
    rmsnorm,
    rmsnorm_fp8,
    silu_and_mul,
    silu_and_mul_fp8,
)
from kernel_testing import DEVICES, assert_rel_close

FP8 = torch.float8_e4m3fn

E4M3_ROUNDING = 1 / 16
"""Half an e4m3 ulp at the top of the range, relative to the row's amax (plus slack)."""


def hard_rows(rows: int, cols: int, dtype, device) -> torch.Tensor:
    """Random rows with an all-zero row (the amax floor), a tiny one (e4m3 subnormals) and one
    with a large spread."""
    x = torch.randn(rows, cols, device=device) * 2
    x[0] = 0.0
    x[1] *= 1e-4
    x[2, : cols // 3] *= 1e4
    return x.to(dtype)


def poisoned_fp8(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((rows, cols), float("nan"), device=device).to(FP8),
            torch.full((rows, 1), float("nan"), device=device))


def assert_same_fp8(got, want) -> None:
    (q, s), (want_q, want_s) = got, want
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cols", [96, 200])
def test_quantize_fp8_rows_is_bit_exact(device, dtype, cols):
    x = hard_rows(5, cols, dtype, device)
    q, scales = poisoned_fp8(5, cols, device)
    quantize_fp8_rows(x, out=q, scales=scales)
    assert_same_fp8((q, scales), reference.quantize_fp8_rows(x))
    assert torch.all(scales[0] > 0), "an all-zero row keeps a finite, positive scale"


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_fp8_rows_reads_strided_rows(device):
    x = torch.randn(4, 160, device=device)[:, :120]
    assert_same_fp8(quantize_fp8_rows(x), reference.quantize_fp8_rows(x.contiguous()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cols", [64, 200])
def test_rmsnorm_fp8_is_rmsnorm_then_quantize(device, dtype, cols):
    x = hard_rows(4, cols, dtype, device)
    weight = (torch.rand(cols, device=device) + 0.5).to(dtype)
    q, scales = poisoned_fp8(4, cols, device)
    rmsnorm_fp8(x, weight, 1e-6, out=q, scales=scales)
    assert_same_fp8((q, scales), quantize_fp8_rows(rmsnorm(x, weight, 1e-6)))
    ref, _ = reference.add_rmsnorm(x, None, weight, 1e-6, torch.float64)
    assert_rel_close(q.double() * scales.double(), ref, E4M3_ROUNDING, "dequantized")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_add_rmsnorm_fp8_adds_the_residual_first(device):
    x, residual = hard_rows(4, 96, torch.bfloat16, device), hard_rows(4, 96, torch.bfloat16, device)
    weight = torch.rand(96, device=device) + 0.5
    q, scales, h = fused_add_rmsnorm_fp8(x, residual, weight, 1e-6)
    want_normed, want_h = fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(h, want_h)
    if device == "cuda":  # the interpreter truncates float32 -> bfloat16 instead of rounding
        assert torch.equal(h, x + residual)
    assert_same_fp8((q, scales), quantize_fp8_rows(want_normed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("inter", [48, 300])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize(device, dtype, inter):
    x = hard_rows(4, 2 * inter, dtype, device)
    x[3, inter - 1] = 30.0  # the amax in the last column
    q, scales = poisoned_fp8(4, inter, device)
    silu_and_mul_fp8(x, out=q, scales=scales)
    assert_same_fp8((q, scales), quantize_fp8_rows(silu_and_mul(x)))
    ref = reference.silu_and_mul(x, torch.float64)
    assert_rel_close(q.double() * scales.double(), ref, E4M3_ROUNDING, "dequantized")


@pytest.mark.parametrize("device", DEVICES)
def test_row_quantizers_take_no_rows(device):
    empty = torch.empty(0, 32, device=device)
    for q, s in (quantize_fp8_rows(empty), rmsnorm_fp8(empty, torch.ones(32, device=device), 1e-6),
                 silu_and_mul_fp8(torch.empty(0, 64, device=device))):
        assert q.shape == (0, 32) and s.shape == (0, 1)

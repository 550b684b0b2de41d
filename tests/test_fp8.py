"""FP8 e4m3 block-scaled weights: our quantizer, dequantization, the block-scaled GEMM (Triton
kernel through the CPU interpreter here, torch._scaled_mm / Triton on CUDA) against the
pure-PyTorch reference, and checkpoint pairing of weight + weight_scale_inv."""

from __future__ import annotations

import pytest
import torch

from batchgen.models import fp8
from batchgen.models.fp8 import (
    FP8,
    Fp8Linear,
    QuantizedWeight,
    block_matmul_reference,
    dequantize_blocks,
    pair_scales,
    quantize_activations,
    quantize_blocks,
)

E4M3_REL = 2.0 ** -4
"""Half the spacing of e4m3's 3-bit mantissa, relative to the value (normal range)."""
E4M3_SUBNORMAL_STEP = 2.0 ** -9
"""Spacing of e4m3 subnormals; times the block scale it bounds the error of tiny values."""


def random_weight(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude, so blocks get different scales.
    return torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 300), (128, 128)),
                                         ((48, 40), (16, 16))])
def test_quantize_roundtrip_error_is_bounded(shape, block):
    w = random_weight(*shape)
    q, scale = quantize_blocks(w, block)
    assert q.dtype == FP8 and q.shape == w.shape
    assert scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    full_scale = fp8.expand_scales(scale, shape, block)
    err = (dequantize_blocks(q, scale, block) - w).abs()
    assert (err <= w.abs() * E4M3_REL + full_scale * E4M3_SUBNORMAL_STEP).all()
    # Each block's largest magnitude lands exactly on e4m3's largest finite value.
    assert q.float().abs().max() == fp8.FP8_MAX


def test_scale_inv_is_the_dequantization_multiplier():
    """DeepSeek's convention: W = weight * weight_scale_inv (not divided)."""
    w = torch.full((128, 128), 0.5)
    q, scale = quantize_blocks(w)
    assert torch.allclose(scale, torch.tensor([[0.5 / 448]]))
    assert torch.equal(q.float() * scale, w)


def test_activation_quantization_error_is_bounded():
    x = torch.randn(7, 300) * 3
    xq, xs = quantize_activations(x, 128)
    assert xs.shape == (7, 3)
    back = xq.float() * fp8.expand_scales(xs, (7, 300), (1, 128))
    assert ((back - x).abs() <= x.abs() * E4M3_REL + back.abs().max() * 2**-9).all()


def test_reference_matmul_is_within_fp8_tolerance_of_dense():
    x, w = torch.randn(9, 384), random_weight(256, 384)
    xq, xs = quantize_activations(x)
    wq, ws = quantize_blocks(w)
    ref = block_matmul_reference(xq, xs, wq, ws)
    dense = x @ w.T
    assert (ref - dense).norm() / dense.norm() < 0.05


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Run the Triton kernel through Triton's CPU interpreter (read when jit() runs)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # the GPU tests run the compiled kernel instead
        pytest.skip("interpreter test; this machine has a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8._compiled_kernel.cache_clear()
    yield
    fp8._compiled_kernel.cache_clear()


@pytest.mark.parametrize("m,n,k,block", [(5, 192, 320, (128, 128)), (33, 96, 64, (32, 32)),
                                         (16, 64, 128, (64, 128))])
def test_triton_kernel_matches_reference_in_interpreter(triton_interpreter, m, n, k, block):
    x, w = torch.randn(m, k), random_weight(n, k, seed=m)
    xq, xs = quantize_activations(x, block[1])
    wq, ws = quantize_blocks(w, block)
    out = fp8.triton_block_matmul(xq, xs, wq, ws, block, torch.float32)
    ref = block_matmul_reference(xq, xs, wq, ws, block)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fp8_linear_on_cpu_is_the_dequantized_linear():
    x, w = torch.randn(2, 3, 64), random_weight(32, 64)
    q, scale = quantize_blocks(w, (16, 16))
    layer = Fp8Linear(q, scale, (16, 16))
    expected = torch.nn.functional.linear(x, dequantize_blocks(q, scale, (16, 16)))
    assert torch.equal(layer(x), expected)
    dense = dequantize_blocks(q, scale, (16, 16))
    assert torch.equal(fp8.dense_weight(layer, torch.float32), dense)


@pytest.mark.parametrize("dim", [0, 1])
def test_fp8_linear_keeps_a_compact_copy_of_a_tensor_parallel_slice(dim):
    """A rank's slice is a view of the whole tensor; a column slice is not contiguous, which
    the blockwise scaled GEMM refuses (seen at TP 2 on the H200), and any view would keep the
    whole tensor's memory alive."""
    from batchgen.parallel import TensorParallel

    q, scale = quantize_blocks(random_weight(64, 128), (16, 16))
    tp = TensorParallel(size=2, rank=1)
    weight, scale_inv = tp.shard(q, dim), tp.shard(scale, dim)
    layer = Fp8Linear(weight, scale_inv, (16, 16))
    for kept, view in ((layer.weight, weight), (layer.weight_scale_inv, scale_inv)):
        assert kept.is_contiguous() and torch.equal(kept, view)
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    whole = quantize_blocks(random_weight(32, 64), (16, 16))
    layer = Fp8Linear(*whole, (16, 16))
    assert layer.weight.data_ptr() == whole[0].data_ptr()  # already compact: not copied


def test_pair_scales_joins_weights_and_scales_in_any_order():
    w1, w2 = random_weight(32, 32, 1), random_weight(32, 32, 2)
    (q1, s1), (q2, s2) = quantize_blocks(w1, (16, 16)), quantize_blocks(w2, (16, 16))
    norm = torch.ones(4)
    stream = [("a.weight", q1), ("a.weight_scale_inv", s1), ("b.weight_scale_inv", s2),
              ("n.weight", norm), ("b.weight", q2)]
    dense = dict(pair_scales(stream, (16, 16), keep_fp8=False, dtype=torch.float32))
    assert set(dense) == {"a.weight", "b.weight", "n.weight"}
    assert torch.equal(dense["b.weight"], dequantize_blocks(q2, s2, (16, 16)))
    assert dense["n.weight"] is norm
    kept = dict(pair_scales(stream, (16, 16), keep_fp8=True, dtype=torch.float32))
    assert isinstance(kept["a.weight"], QuantizedWeight) and kept["a.weight"].weight is q1
    with pytest.raises(ValueError, match="c.weight"):
        list(pair_scales([("c.weight", q1)], (16, 16), True, torch.float32))


def test_weight_block_size_reads_quantization_config():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(quantization_config={"quant_method": "fp8",
                                                "weight_block_size": [64, 32]})
    assert fp8.weight_block_size(cfg) == (64, 32)
    assert fp8.weight_block_size(DeepseekV3Config()) == (128, 128)


# -- CUDA --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(384, 512), (256, 256), (512, 768), (200, 320)])
@pytest.mark.parametrize("m", [1, 5, 16, 100])
def test_cuda_block_matmul_backends_match_reference(m, n, k):
    x, w = torch.randn(m, k, device="cuda"), random_weight(n, k).cuda()
    xq, xs = quantize_activations(x)
    wq, ws = quantize_blocks(w)
    ref = block_matmul_reference(xq, xs, wq, ws)
    tol = {"rtol": 1e-3, "atol": 1e-3 * ref.abs().max().item()}
    torch.testing.assert_close(fp8.triton_block_matmul(xq, xs, wq, ws, (128, 128), torch.float32),
                               ref, **tol)
    chosen = fp8.block_matmul(xq, xs, wq, ws, (128, 128), torch.float32)  # scaled_mm or Triton
    torch.testing.assert_close(chosen, ref, **tol)
    out = fp8.fp8_linear(x.bfloat16(), wq, ws)  # bf16 activations quantized inside
    dense = x @ dequantize_blocks(wq, ws).cuda().T
    assert (out.float() - dense).norm() / dense.norm() < 0.05


@pytest.mark.gpu
def test_cuda_scaled_mm_probe_accepts_r1_shapes():
    """The shapes R1's block-scaled GEMMs use must not fall back to the slower Triton kernel."""
    device = torch.device("cuda")
    for n, k in [(24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048), (1536, 7168)]:
        assert fp8._scaled_mm_fits(n, k) and fp8._scaled_mm_works(device, n, k), (n, k)

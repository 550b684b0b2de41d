"""Row-scaled FP8 weights (one scale per tensor or per output channel, as AutoFP8 and
llm-compressor checkpoints store them): pairing, slicing, the MoE restatement on block grids,
the row-scaled GEMM (CPU fallback here; torch's rowwise `_scaled_mm` on CUDA) and the fused
norm / SiLU quantizers feeding it in a model."""

from __future__ import annotations

import pytest
import torch

from batchgen.models import fp8_rowwise
from batchgen.models.fp8 import (
    FP8,
    Fp8Linear,
    QuantizedWeight,
    block_grid,
    dequantize_blocks,
    narrow_quantized,
    on_block_grid,
    pair_scales,
    quantize_activations,
)
from batchgen.models.fp8_rowwise import QuantizedRows, is_row_scaled, row_scaled_matmul


def per_row_quantized(n, k, per_tensor: bool, seed=0, device="cpu"):
    """(e4m3 [N, K], the checkpoint's scale: one value or [N, 1]) of rows of varied size."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]).to(device)
    scale = (w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)) / 448.0
    return (w / scale).to(FP8), scale


@pytest.mark.parametrize("per_tensor", [True, False], ids=["tensor", "channel"])
def test_pair_scales_keeps_per_tensor_and_per_channel_weights_row_scaled(per_tensor):
    q, scale = per_row_quantized(48, 40, per_tensor)
    stream = [("a.weight_scale", scale), ("a.input_scale", torch.tensor(1.0)), ("a.weight", q),
              ("attn.k_scale", torch.tensor(0.1)), ("attn.v_scale", torch.tensor(0.1))]
    (name, kept), = pair_scales(stream, (16, 16), keep_fp8=True, dtype=torch.float32)
    assert name == "a.weight" and kept.block == (1, 40) and kept.scale_inv.shape == (48, 1)
    want = q.float() * scale
    assert torch.equal(dequantize_blocks(kept.weight, kept.scale_inv, kept.block), want)
    (_, dense), = pair_scales(stream, (16, 16), keep_fp8=False, dtype=torch.float32)
    assert torch.equal(dense, want)


def test_block_grid_prefers_the_block_reading_of_an_ambiguous_scale():
    """A [1, 2] scale of a [2, 256] weight with 128x128 blocks is its block grid, not per-row."""
    scale, block = block_grid(torch.ones(1, 2), (2, 256), (128, 128))
    assert block == (128, 128) and scale.shape == (1, 2)
    with pytest.raises(ValueError, match="fits neither"):
        block_grid(torch.ones(3), (4, 8), (2, 2))


def test_narrowing_a_row_scaled_weight_keeps_it_fp8():
    q, scale = per_row_quantized(32, 64, per_tensor=False)
    value = QuantizedWeight(q, scale, (1, 64))
    dense = dequantize_blocks(q, scale, (1, 64))
    cols = narrow_quantized(value, 1, 16, 32, torch.float32)  # a row-parallel TP slice
    rows = narrow_quantized(value, 0, 5, 7, torch.float32)  # a column-parallel one
    assert cols.block == (1, 32) and rows.block == (1, 64)
    assert torch.equal(dequantize_blocks(*cols), dense[:, 16:48])
    assert torch.equal(dequantize_blocks(*rows), dense[5:12])


def test_experts_get_block_scales_or_dense_weights():
    q, scale = per_row_quantized(64, 32, per_tensor=True)
    value = QuantizedWeight(q, scale.reshape(1, 1).expand(64, 1).contiguous(), (1, 32))
    on_grid = on_block_grid(value, (16, 16))
    assert on_grid.block == (16, 16) and on_grid.scale_inv.shape == (4, 2)
    assert torch.equal(dequantize_blocks(*on_grid), dequantize_blocks(*value))
    per_channel = QuantizedWeight(*per_row_quantized(64, 32, per_tensor=False), (1, 32))
    assert on_block_grid(per_channel, (16, 16)) is None


@pytest.mark.parametrize("m", [1, 7])
def test_row_scaled_linear_on_cpu_equals_its_dequantized_weight(m):
    q, scale = per_row_quantized(24, 40, per_tensor=False)
    layer = Fp8Linear(q, scale, (1, 40), output_dtype=torch.float32)
    assert layer.row_scaled and is_row_scaled(layer.block, 40)
    x = torch.randn(m, 40)
    dense = x @ (q.float() * scale).T
    torch.testing.assert_close(layer(x), dense)  # a tensor input: dequantized on CPU
    rows = QuantizedRows(*quantize_activations(x, 40))
    want = (rows.data.float() * rows.scale) @ (q.float() * scale).T
    torch.testing.assert_close(layer(rows), want)  # pre-quantized rows: the fallback GEMM


def test_row_scaled_linear_takes_no_rows():
    q, scale = per_row_quantized(24, 40, per_tensor=True)
    layer = Fp8Linear(q, scale.reshape(1, 1).expand(24, 1), (1, 40))
    out = layer(QuantizedRows(torch.zeros(0, 40, dtype=FP8), torch.ones(0, 1)))
    assert out.shape == (0, 24) and out.dtype == torch.bfloat16


def test_block_scaled_linear_refuses_quantized_rows():
    layer = Fp8Linear(*per_row_quantized(32, 32, False)[:1], torch.ones(2, 2), (16, 16))
    with pytest.raises(AssertionError, match="row-scaled"):
        layer(QuantizedRows(torch.zeros(1, 32, dtype=FP8), torch.ones(1, 1)))


# -- CUDA --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("n,k", [(256, 512), (4096, 14336), (96, 48)])
def test_cuda_row_scaled_matmul_matches_the_reference(m, n, k):
    q, scale = per_row_quantized(n, k, per_tensor=False, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rows = fp8_rowwise.quantize_rows(x)
    want = (rows.data.double() * rows.scale.double()) @ (q.double() * scale.double()).T
    out = row_scaled_matmul(rows, q, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < 4e-3, f"relative error {err:.2e} (bf16 output rounding is ~2e-3)"
    exact = x.double() @ (q.double() * scale.double()).T  # activations unquantized
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.gpu
def test_cuda_rowwise_scaled_mm_probe_passes_on_llama_shapes():
    """A failed probe would quietly send every row-scaled GEMM to the slow fallback."""
    assert fp8_rowwise._scaled_mm_rowwise_works(torch.device("cuda"), True)


@pytest.mark.gpu
def test_cuda_fused_quantizers_feed_row_scaled_projections_exactly():
    """`bench --fp8-weights --fp8-scales tensor` on a tiny Llama: the norms and SiLU hand the
    FP8 projections QuantizedRows; turning that off (each projection quantizes its own
    input) must give bit-identical logits."""
    from batchgen.bench_models import hf_config_for, random_model
    from batchgen.models.fp8_dense import feed_quantized_rows

    model = random_model(hf_config_for("llama3-8b", tiny=True, fp8_weights="tensor"),
                         torch.bfloat16, torch.device("cuda"))
    layer = model.model.layers[0]
    assert layer.input_layernorm.fp8_rows and layer.post_attention_layernorm.fp8_rows
    assert layer.mlp.down_proj.row_scaled
    x = torch.randn(9, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    fused = layer.mlp(layer.post_attention_layernorm(x))
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.fp8_rows = False
    down = layer.mlp.down_proj
    gate_up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x))
    import batchgen_kernels as K

    unfused = down(K.silu_and_mul(gate_up))  # a tensor: down_proj quantizes it itself
    assert torch.equal(fused, unfused)
    feed_quantized_rows(model.model.layers)
    assert layer.input_layernorm.fp8_rows

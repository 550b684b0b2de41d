"""tp_slices: the one tensor-parallel slicer of every model family's checkpoint tensors."""

from __future__ import annotations

import pytest
import torch

from batchgen.models.fp8 import QuantizedWeight, dequantize_blocks, quantize_blocks
from batchgen.models.tp_slices import local_part, rank_part, split_dim
from batchgen.parallel import ParallelError, TensorParallel

TABLE = {"q_proj.weight": 0, "o_proj.weight": 1}


def test_split_dim_reads_the_table():
    assert split_dim("model.layers.3.self_attn.q_proj.weight", TABLE) == 0
    assert split_dim("model.layers.3.self_attn.o_proj.weight", TABLE) == 1
    assert split_dim("model.layers.3.input_layernorm.weight", TABLE) is None


@pytest.mark.parametrize("dim", [0, 1])
def test_ranks_share_a_dense_tensor(dim):
    w = torch.randn(8, 12)
    parts = [local_part("x.q_proj.weight" if dim == 0 else "x.o_proj.weight", w, TABLE,
                        TensorParallel(size=4, rank=r), torch.float32) for r in range(4)]
    torch.testing.assert_close(torch.cat(parts, dim=dim), w, rtol=0, atol=0)
    assert local_part("x.norm.weight", w, TABLE, TensorParallel(size=4, rank=1),
                      torch.float32) is w


def test_fp8_stays_fp8_on_block_edges_else_is_dequantized():
    w = torch.randn(256, 128)
    q, scale = quantize_blocks(w, (64, 64))
    value = QuantizedWeight(q, scale, (64, 64))
    whole = dequantize_blocks(q, scale, (64, 64))
    aligned = rank_part(value, 0, TensorParallel(size=2, rank=1), torch.float32)
    assert isinstance(aligned, QuantizedWeight) and aligned.scale_inv.shape == (2, 2)
    torch.testing.assert_close(dequantize_blocks(*aligned), whole[128:], rtol=0, atol=0)
    cut = rank_part(value, 0, TensorParallel(size=8, rank=1), torch.float32)  # 32 rows: no edge
    assert not isinstance(cut, QuantizedWeight)
    torch.testing.assert_close(cut, whole[32:64], rtol=0, atol=0)


def test_an_indivisible_dimension_is_refused():
    with pytest.raises(ParallelError, match="not divisible by the tensor-parallel size 3"):
        rank_part(torch.zeros(8, 4), 0, TensorParallel(size=3, rank=0), torch.float32)

"""Tensor-parallel slicing of whole-checkpoint tensors, one loader for every model family.

A family declares which parameters are split in a table of name suffix -> dimension (0:
column-parallel, split by output rows: heads, features; 1: row-parallel, split by input
columns); every other parameter is replicated. `rank_part` cuts this rank's contiguous share,
dense or block-FP8: an FP8 matrix keeps its FP8 form when the cut falls on scale-block edges
(or within a row-scaled matrix's rows), else that part is dequantized (fp8.narrow_quantized).
"""

from __future__ import annotations

import torch

from batchgen.models.fp8 import QuantizedWeight, narrow_quantized
from batchgen.parallel import TensorParallel


def split_dim(name: str, table: dict[str, int]) -> int | None:
    """The dimension `name` is split along under tensor parallelism (None: replicated)."""
    for suffix, dim in table.items():
        if name.endswith(suffix):
            return dim
    return None


def narrow(value, dim: int, start: int, length: int, dtype: torch.dtype):
    """value[start:start + length] along `dim`, a dense tensor or a QuantizedWeight (whose
    dequantized form, when needed, is in `dtype`)."""
    if isinstance(value, QuantizedWeight):
        return narrow_quantized(value, dim, start, length, dtype)
    return value.narrow(dim, start, length)


def rank_part(value, dim: int, tp: TensorParallel, dtype: torch.dtype):
    """This rank's contiguous share of `value` along `dim` (refused, naming the sizes, when the
    dimension does not divide by the group)."""
    shape = value.weight.shape if isinstance(value, QuantizedWeight) else value.shape
    part = tp.split(shape[dim], f"dimension {dim} of a {tuple(shape)} tensor")
    return narrow(value, dim, tp.rank * part, part, dtype)


def local_part(name: str, value, table: dict[str, int], tp: TensorParallel,
               dtype: torch.dtype):
    """This rank's part of whole-checkpoint tensor `name` under the family's split table."""
    dim = split_dim(name, table)
    if tp.size == 1 or dim is None:
        return value
    return rank_part(value, dim, tp, dtype)

"""Prefix groups of a decode batch as the tensors of `forward_batch.PrefixGroups` (which rows
read which shared prefix once: sched/decode_groups.py)."""

from __future__ import annotations

import torch

from batchgen.forward_batch import PrefixGroups
from batchgen.sched.decode_groups import MAX_GROUPS, group_rows
from batchgen.sched.step import PrefixShare, SeqChunk


def prefix_groups(chunks: list[SeqChunk], shares: list[PrefixShare],
                  device: torch.device) -> PrefixGroups | None:
    """The PrefixGroups of decode rows `chunks` on `device`, or None (see group_rows). The
    group tensors always hold MAX_GROUPS groups (unused ones with no pages), as the CUDA
    graphs' buffers do: the step's plan kernel then compiles once for every group count."""
    found = group_rows(chunks, shares)
    if found is None:
        return None
    row_group, pages = found
    width = max(len(p) for p in pages)
    table = torch.zeros(MAX_GROUPS, width, dtype=torch.int32)
    counts = torch.zeros(MAX_GROUPS, dtype=torch.int32)
    for group, group_pages in enumerate(pages):
        table[group, :len(group_pages)] = torch.tensor(group_pages, dtype=torch.int32)
        counts[group] = len(group_pages)
    return PrefixGroups(
        row_group=torch.tensor(row_group, dtype=torch.int32).to(device, non_blocking=True),
        prefix_pages=table.to(device, non_blocking=True),
        prefix_num_pages=counts.to(device, non_blocking=True))

"""ForwardBatch: the tensors of one packed forward (prefill chunks and decode tokens together).

Sequences are packed without padding: sequence b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`
and, after this step, `context_lens[b]` tokens of KV reachable through `page_table[b]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from batchgen.core import PAGE_SIZE
from batchgen.engine.kv_cache import KVPool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[T] token ids, all sequences packed."""
    positions: torch.Tensor
    """[T] position of each token in its sequence."""
    cu_seqlens_q: torch.Tensor
    """[B+1] int32 prefix sums of query lengths."""
    context_lens: torch.Tensor
    """[B] int32 KV length of each sequence including this step's tokens."""
    page_table: torch.Tensor
    """[B, max_pages] int32 device page ids (unused entries 0)."""
    slot_mapping: torch.Tensor
    """[T] int64 flat KV slot (page * PAGE_SIZE + offset) each new token is written to."""
    logits_indices: torch.Tensor
    """[S] int64 rows of T whose logits are needed (last token of sequences that sample)."""
    kv_pool: KVPool
    q_lens: list[int]
    """Host copy of the query lengths (the reference path loops over sequences)."""
    ctx_lens: list[int]
    """Host copy of context_lens."""

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @cached_property
    def one_row_part(self) -> tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(query rows, page table, context lengths) of a mixed batch's one-row sequences,
        which attend as decode rows do; None if there are none. Built once per forward: a
        layer that made the index tensors itself would copy them from the host (a stream
        synchronisation) in every layer. Sequences are packed in the order they were
        admitted, so decode rows usually come first: then these are views, not copies."""
        seqs = [b for b, q_len in enumerate(self.q_lens) if q_len == 1]
        if not seqs:
            return None
        if seqs[-1] == len(seqs) - 1:  # sequences 0..n-1, which are rows 0..n-1
            n = len(seqs)
            return slice(0, n), self.page_table[:n], self.context_lens[:n]
        starts = [0]
        for q_len in self.q_lens[:-1]:
            starts.append(starts[-1] + q_len)
        device = self.cu_seqlens_q.device
        index = torch.tensor(seqs, dtype=torch.long).to(device, non_blocking=True)
        rows = torch.tensor([starts[b] for b in seqs], dtype=torch.long).to(device,
                                                                         non_blocking=True)
        return rows, self.page_table[index], self.context_lens[index]

    @staticmethod
    def build(token_ids: list[list[int]], starts: list[int], page_tables: list[list[int]],
              sample_mask: list[bool], kv_pool: KVPool, device: torch.device) -> "ForwardBatch":
        """Pack sequences: sequence b computes `token_ids[b]` at positions `starts[b]...`."""
        q_lens = [len(t) for t in token_ids]
        ctx_lens = [s + q for s, q in zip(starts, q_lens)]
        flat_ids = [t for toks in token_ids for t in toks]
        positions = [p for s, q in zip(starts, q_lens) for p in range(s, s + q)]
        slots = [pt[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                 for pt, s, q in zip(page_tables, starts, q_lens) for p in range(s, s + q)]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        logits_rows = [cu[b + 1] - 1 for b, want in enumerate(sample_mask) if want]
        width = max(1, max((-(-c // PAGE_SIZE) for c in ctx_lens), default=1))
        table = [pt[: -(-c // PAGE_SIZE)] + [0] * (width - -(-c // PAGE_SIZE))
                 for pt, c in zip(page_tables, ctx_lens)]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=tensor(flat_ids, torch.long),
            positions=tensor(positions, torch.long),
            cu_seqlens_q=tensor(cu, torch.int32),
            context_lens=tensor(ctx_lens, torch.int32),
            page_table=tensor(table, torch.int32),
            slot_mapping=tensor(slots, torch.long),
            logits_indices=tensor(logits_rows, torch.long),
            kv_pool=kv_pool,
            q_lens=q_lens,
            ctx_lens=ctx_lens,
        )

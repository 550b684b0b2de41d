"""Decode bursts: a fixed decode set runs several steps back to back, with one host sync.

Between scheduler decisions nothing about the running set changes but its tokens, and every
step's positions, KV slots and context lengths follow from the first step's. So they are
computed on the host once, uploaded in one go, and each step takes its input ids from the
previous step's samples on the device: the host only launches work, the device never waits for
Python between tokens, and the sampled tokens come back together at the end of the burst.

A row that would pass the pages it owns or its budget (it hit max_tokens earlier in the burst)
repeats its last position, writes its KV to slot -1 (skipped) and attends only within its
pages; its samples are discarded afterwards, as are the samples of a row after its EOS or
stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.core import PAGE_SIZE
from batchgen.engine.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVPool
from batchgen.sched.sequence import Sequence


@dataclass
class DecodeBurst:
    first_ids: torch.Tensor
    """[B] the pending token of each sequence (the input of step 0)."""
    positions: torch.Tensor
    """[K, B] int64 position computed by each row at each step."""
    slots: torch.Tensor
    """[K, B] int64 KV slot written (-1 once a row is past its pages)."""
    context_lens: torch.Tensor
    """[K, B] int32 KV length each row attends to."""
    page_table: torch.Tensor
    """[B, W] int32, wide enough for the last step."""
    cu_seqlens_q: torch.Tensor
    logits_indices: torch.Tensor
    ctx_host: list[list[int]]
    """Host copy of context_lens per step (the CPU attention path loops on it)."""
    kv_pool: KVPool

    @property
    def steps(self) -> int:
        return len(self.ctx_host)

    @staticmethod
    def build(seqs: list[Sequence], steps: int, kv_pool: KVPool,
              device: torch.device) -> "DecodeBurst":
        """Every sequence decodes: it computes its last token (position num_tokens - 1)."""
        starts = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.long)
        # A row may use positions below its pages' end and its budget (prompt + max_tokens,
        # which the model's context bounds); a row still decoding never reaches either.
        limit = torch.tensor([min(len(s.device_pages) * PAGE_SIZE, s.budget_tokens)
                              for s in seqs], dtype=torch.long)[None, :]
        wanted = starts[None, :] + torch.arange(steps, dtype=torch.long)[:, None]
        inside = wanted < limit
        positions = torch.minimum(wanted, limit - 1)  # idle rows repeat their last position
        context = positions + 1
        width = max(1, int(-(-context.max() // PAGE_SIZE)))
        table = torch.tensor([s.device_pages[:width] + [0] * (width - len(s.device_pages[:width]))
                              for s in seqs], dtype=torch.long)
        page_of = (positions // PAGE_SIZE).clamp(max=width - 1).T  # [B, K]
        slots = table.gather(1, page_of).T * PAGE_SIZE + positions % PAGE_SIZE
        slots = torch.where(inside, slots, torch.full_like(slots, -1))
        first = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long)

        def upload(values: torch.Tensor, dtype=torch.long) -> torch.Tensor:
            return values.to(dtype).to(device, non_blocking=True)

        rows = torch.arange(len(seqs), dtype=torch.long)
        return DecodeBurst(
            first_ids=upload(first), positions=upload(positions), slots=upload(slots),
            context_lens=upload(context, torch.int32), page_table=upload(table, torch.int32),
            cu_seqlens_q=upload(torch.arange(len(seqs) + 1), torch.int32),
            logits_indices=upload(rows), ctx_host=context.tolist(), kv_pool=kv_pool)

    def batch(self, step: int, input_ids: torch.Tensor) -> ForwardBatch:
        """The ForwardBatch of one step; `input_ids` are the previous step's samples."""
        return ForwardBatch(
            input_ids=input_ids, positions=self.positions[step],
            cu_seqlens_q=self.cu_seqlens_q, context_lens=self.context_lens[step],
            page_table=self.page_table, slot_mapping=self.slots[step],
            logits_indices=self.logits_indices, kv_pool=self.kv_pool,
            q_lens=[1] * len(self.ctx_host[step]), ctx_lens=self.ctx_host[step])

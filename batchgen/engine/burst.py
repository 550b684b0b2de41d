"""Decode bursts: a fixed decode set runs several steps back to back, with one host sync.

Between scheduler decisions nothing about the running set changes but its tokens, and every
step's positions, KV slots and context lengths follow from the first step's. So they are
computed on the host once, uploaded in one go, and each step takes its input ids from the
previous step's samples on the device: the host only launches work, the device never waits for
Python between tokens, and the host reads each step's tokens as that step ends. A burst may
continue another still on the device: its first inputs are the other's last samples.

A row that would pass the pages it owns or its budget (it hit max_tokens earlier in the burst)
repeats its last position, writes its KV to slot -1 (skipped) and attends only within its
pages; its samples are discarded afterwards, as are the samples of a row after its EOS or
stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch, PrefixGroups
from batchgen.engine.kv_cache import KVPool
from batchgen.engine.sampler import HostSample, SamplingRows
from batchgen.sched.scheduler import SeqChunk


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
    prefix_groups: PrefixGroups | None = None
    """Rows sharing prefix pages (the same at every step: shared pages are full)."""

    @property
    def steps(self) -> int:
        return len(self.ctx_host)

    @staticmethod
    def build(chunks: list[SeqChunk], steps: int, kv_pool: KVPool, device: torch.device,
              first_ids: torch.Tensor | None = None,
              prefix_groups: PrefixGroups | None = None) -> "DecodeBurst":
        """Row i computes position chunks[i].start + k at step k. Its step-0 input is the
        token at that position, from the host unless `first_ids` (on the device) gives it."""
        seqs = [c.seq for c in chunks]
        starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
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

        def upload(values: torch.Tensor, dtype=torch.long) -> torch.Tensor:
            return values.to(dtype).to(device, non_blocking=True)

        rows = torch.arange(len(seqs), dtype=torch.long)
        if first_ids is None:
            first_ids = upload(torch.tensor([c.seq.token_ids[c.start] for c in chunks]))
        return DecodeBurst(
            first_ids=first_ids, positions=upload(positions), slots=upload(slots),
            context_lens=upload(context, torch.int32), page_table=upload(table, torch.int32),
            cu_seqlens_q=upload(torch.arange(len(seqs) + 1), torch.int32),
            logits_indices=upload(rows), ctx_host=context.tolist(), kv_pool=kv_pool,
            prefix_groups=prefix_groups)

    def batch(self, step: int, input_ids: torch.Tensor) -> ForwardBatch:
        """The ForwardBatch of one step; `input_ids` are the previous step's samples."""
        return ForwardBatch(
            input_ids=input_ids, positions=self.positions[step],
            cu_seqlens_q=self.cu_seqlens_q, context_lens=self.context_lens[step],
            page_table=self.page_table, slot_mapping=self.slots[step],
            logits_indices=self.logits_indices, kv_pool=self.kv_pool,
            q_lens=[1] * len(self.ctx_host[step]), ctx_lens=self.ctx_host[step],
            prefix_groups=self.prefix_groups)


@dataclass
class QueuedBurst:
    """Decode steps queued on the device whose samples the host has not all read yet."""

    chunks: list[SeqChunk]
    """The decode chunk of each row at step 0 (row i computes chunks[i].start + k at step k)."""
    rows: list[SamplingRows]
    """Sampling settings of each step."""
    samples: list[HostSample]
    """Each step's samples, on their way to the host."""
    last_tokens: torch.Tensor
    """[B] the last step's samples on the device: the input of a burst that continues this."""

    @property
    def steps(self) -> int:
        return len(self.rows)

    def rows_of(self, chunks: list[SeqChunk]) -> list[int]:
        """The row of each chunk's sequence in this burst."""
        row_of = {id(c.seq): row for row, c in enumerate(self.chunks)}
        return [row_of[id(c.seq)] for c in chunks]

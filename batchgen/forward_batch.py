"""ForwardBatch: the tensors of one packed forward (prefill chunks and decode tokens together).

Sequences are packed without padding: sequence b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`
and, after this step, `context_lens[b]` tokens of KV reachable through `page_table[b]`.

A dense batch (`build_dense`, `dense` set) is a whole-prompt forward that keeps no KV: sequences
right-padded to one length, sequence b owning rows `b * L ... b * L + L - 1`, no pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Any, Protocol

import numpy as np
import torch

from batchgen.core import PAGE_SIZE


class KVPages(Protocol):
    """What a model's attention needs from the paged KV pool of a forward (the engine's
    `engine.kv_cache.KVPool` is the one implementation). Declared here, beside the batch, so
    models depend on this description and never on the engine."""

    layout: Any
    """The pool's KVLayout: dtype, compute dtype, token shape, whether it is quantized."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of one layer's pages (and fp8 scales) for the kernels."""

    def store(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write this step's KV rows of `layer` at flat `slots`."""

    def gather(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """KV of `pages` token after token, in the compute dtype."""

    def gather_heads(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """KV of `pages` with the token's leading dims (K/V, heads) first."""


def long_tensor(values: list) -> torch.Tensor:
    """An int64 tensor of a list of ints (or of equally long lists of them), through numpy:
    ~3x faster than torch.tensor for the thousands of ids and page numbers of a prefill
    step, which the device waits for."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


@dataclass(frozen=True)
class DenseShape:
    """The shape of a dense batch's rows: `seqs` sequences of `length` rows each."""

    seqs: int
    """B: sequences in the batch."""
    length: int
    """L: rows per sequence (the longest one's tokens); shorter ones end in padding rows."""


@dataclass
class PrefixGroups:
    """Decode rows that share leading KV pages (a common prompt prefix), for attention that
    reads those pages once per group (`batchgen_kernels.shared_prefix_decode`). Row b's first
    `prefix_num_pages[row_group[b]]` pages are `prefix_pages[row_group[b]]`; its other pages
    follow in its own page-table row."""

    row_group: torch.Tensor
    """[B] int32: each row's group, -1 for a row in none."""
    prefix_pages: torch.Tensor
    """[G, P] int32: each group's shared page ids (padded with 0)."""
    prefix_num_pages: torch.Tensor
    """[G] int32: pages in each group's prefix (whole pages; 0 for an unused group)."""


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
    kv_pool: KVPages | None
    """The KV pool this forward reads and writes (None in a dense batch)."""
    q_lens: list[int]
    """Host copy of the query lengths (the reference path loops over sequences)."""
    ctx_lens: list[int]
    """Host copy of context_lens."""
    prefix_groups: PrefixGroups | None = None
    """One-row sequences sharing prefix pages, or None: the rows of a decode-only batch, or
    of a mixed batch's `one_row_part`, in that order."""
    derived: dict = field(default_factory=dict)
    """Tensors the layers derive from this batch once per forward (not per layer)."""
    dense: DenseShape | None = None
    """Set for a dense batch: attention runs causally over each sequence's own rows, padded to
    [B, L], and stores nothing (`models.attention.dense_attention`)."""

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
              sample_mask: list[bool], kv_pool: KVPages, device: torch.device) -> "ForwardBatch":
        """Pack sequences: sequence b computes `token_ids[b]` at positions `starts[b]...`.
        Per-token values are computed with tensor ops, not Python loops: a prefill step packs
        thousands of tokens while the device waits for its inputs."""
        q_lens = [len(t) for t in token_ids]
        ctx_lens = [s + q for s, q in zip(starts, q_lens)]
        pages = [-(-c // PAGE_SIZE) for c in ctx_lens]
        width = max(1, max(pages, default=1))
        table = long_tensor([pt[:n] + [0] * (width - n) for pt, n in zip(page_tables, pages)])
        lengths = torch.tensor(q_lens, dtype=torch.long)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=cu[1:])
        owner = torch.repeat_interleave(torch.arange(len(q_lens)), lengths)  # sequence of a row
        first = torch.tensor(starts, dtype=torch.long) - cu[:-1]  # position minus row index
        positions = torch.arange(int(cu[-1])) + first[owner]
        slots = table[owner, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        logits_rows = (cu[1:] - 1)[torch.tensor(sample_mask, dtype=torch.bool)]

        def upload(values: torch.Tensor, dtype=torch.long) -> torch.Tensor:
            return values.to(dtype).to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=upload(long_tensor(list(chain.from_iterable(token_ids)))),
            positions=upload(positions),
            cu_seqlens_q=upload(cu, torch.int32),
            context_lens=upload(torch.tensor(ctx_lens), torch.int32),
            page_table=upload(table, torch.int32),
            slot_mapping=upload(slots),
            logits_indices=upload(logits_rows),
            kv_pool=kv_pool,
            q_lens=q_lens,
            ctx_lens=ctx_lens,
        )

    @staticmethod
    def build_dense(token_ids: list[list[int]], device: torch.device) -> "ForwardBatch":
        """Whole prompts right-padded to the longest: sequence b is rows `b*L ... b*L+L-1`,
        its tokens first (positions 0...), then padding rows (token 0). Causal attention keeps
        every real row from seeing the padding after it; whoever reads the rows must skip the
        padding ones. No pages, no KV pool; `logits_indices` are the last real rows."""
        q_lens = [len(t) for t in token_ids]
        seqs, length = len(q_lens), max(q_lens)
        lengths = torch.tensor(q_lens, dtype=torch.long)
        ids = torch.zeros(seqs, length, dtype=torch.long)
        ids[torch.arange(length)[None] < lengths[:, None]] = torch.tensor(
            list(chain.from_iterable(token_ids)), dtype=torch.long)
        cu = torch.zeros(seqs + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=cu[1:])

        def upload(values: torch.Tensor, dtype=torch.long) -> torch.Tensor:
            return values.to(dtype).to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=upload(ids.view(-1)),
            positions=upload(torch.arange(length).repeat(seqs)),
            cu_seqlens_q=upload(cu, torch.int32),
            context_lens=upload(lengths, torch.int32),
            page_table=upload(torch.zeros(seqs, 1), torch.int32),
            slot_mapping=upload(torch.zeros(0)),
            logits_indices=upload(torch.arange(seqs) * length + lengths - 1),
            kv_pool=None,
            q_lens=q_lens,
            ctx_lens=q_lens,
            dense=DenseShape(seqs, length),
        )

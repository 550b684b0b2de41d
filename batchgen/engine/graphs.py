"""CUDA-graph decode: the model forward for one-token-per-sequence batches, captured once per
bucket size and replayed with the batch padded up to the nearest bucket.

Static buffers hold the inputs; a replay copies the step's values into them. Padding rows write
to slot -1 (the KV store skips negative slots) and attend to one key of page 0, so they cost a
little compute and touch no real sequence. Batches above the largest bucket run eagerly. (The reference's per-segment mode,
BATCHGEN_SEGMENTED_GRAPH=1, is not implemented: the whole model is one graph per bucket.)
"""

from __future__ import annotations

import bisect
import logging

import torch

from batchgen.core import PAGE_SIZE
from batchgen.engine.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVPool

log = logging.getLogger("batchgen.graphs")


def bucket_sizes(max_bucket: int, num_buckets: int) -> list[int]:
    """`num_buckets` sizes from 1 to `max_bucket`: powers of two first, then even steps."""
    sizes = {max_bucket}
    size = 1
    while size < max_bucket and len(sizes) < num_buckets:
        sizes.add(size)
        size *= 2
    step = max(1, max_bucket // max(1, num_buckets))
    candidate = step
    while len(sizes) < num_buckets and candidate < max_bucket:
        sizes.add(candidate)
        candidate += step
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, pool: KVPool, max_bucket: int, num_buckets: int,
                 max_context: int):
        self.model = model
        self.pool = pool
        self.sizes = bucket_sizes(max_bucket, num_buckets)
        device = pool.device
        largest = self.sizes[-1]
        self.max_pages = -(-max_context // PAGE_SIZE)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(largest, self.max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        """The captured inputs. A graph replays raw addresses: every tensor it reads must stay
        alive (a freed logits_indices got reused and indexed out of bounds)."""
        self._pool_handle = None

    def _batch(self, size: int) -> ForwardBatch:
        cu = torch.arange(size + 1, dtype=torch.int32, device=self.pool.device)
        return ForwardBatch(self.input_ids[:size], self.positions[:size], cu,
                            self.context_lens[:size], self.page_table[:size], self.slots[:size],
                            torch.arange(size, device=self.pool.device), self.pool,
                            q_lens=[1] * size, ctx_lens=[1] * size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            batch = self.batches[size] = self._batch(size)
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                self.model(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool_handle):
                self.outputs[size] = self.model(batch)
            if self._pool_handle is None:
                self._pool_handle = graph.pool()
            self.graphs[size] = graph
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.decode_only and batch.num_seqs <= self.sizes[-1]
                and batch.page_table.shape[1] <= self.max_pages)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.context_lens[:n].copy_(batch.context_lens)
        self.context_lens[n:size].fill_(1)
        width = batch.page_table.shape[1]
        self.page_table[:n, :width].copy_(batch.page_table)
        self.graphs[size].replay()
        return self.outputs[size][:n]

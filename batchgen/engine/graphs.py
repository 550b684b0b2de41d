"""CUDA-graph decode: the model forward for one-token-per-sequence batches, captured once per
bucket size and replayed with the batch padded up to the nearest bucket.

Static buffers hold the inputs; a replay copies the step's values into them. Padding rows write
to slot -1 (the KV store skips negative slots) and attend to one key of page 0, so they cost a
little compute and touch no real sequence. Batches above the largest bucket run eagerly.

By default the whole forward is one graph per bucket. Per-segment mode
(BATCHGEN_SEGMENTED_GRAPH=1) captures one graph per segment of the model's
chain (embedding, each decoder layer, final norm, LM head: `PagedCausalLM.segments`), each
reading the previous one's output buffer, and replays them in order; a capture that fails
names its segment.

Decode batches whose rows share prefix pages (`ForwardBatch.prefix_groups`) replay a second
set of graphs, captured for a bucket the first time such a batch needs it: their attention reads
each group's prefix once (models/attention.py), from group buffers of MAX_GROUPS x
MAX_PREFIX_PAGES. Jobs without shared prefixes never capture them.

Before capturing, the forward also runs eagerly at the powers of two between the buckets: the
decode kernel picks its launch settings (warps, split-K) by batch size, and the decode rows of
mixed steps run eagerly at any size, so a size class no bucket warmed would compile its Triton
variant in the middle of a job. (With buckets [1, 2, 4, 8, 16, 512] on an H200, 33-82 decode
rows with fp8 KV take the two-warp unsplit launch that no bucket runs: the likely variant the
W1 FP8 benchmark compiled inside its timed run.) The warm-up sizes stop below the largest
bucket, so a job whose buckets were cut to its size (`capture_sizes`) warms up no size it cannot
reach either.
"""

from __future__ import annotations

import bisect
import logging

import torch

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch, PrefixGroups
from batchgen.engine.kv_cache import KVPool
from batchgen.sched.decode_groups import MAX_GROUPS, MAX_PREFIX_PAGES

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


def graph_limit(job_sequences: int | None, max_decode_batch: int | None) -> int | None:
    """The most sequences one decode step can hold: the job's sequences and the decode batch,
    whichever are known (None: neither)."""
    known = [n for n in (job_sequences, max_decode_batch) if n is not None]
    return min(known) if known else None


def capture_sizes(max_bucket: int, num_buckets: int, limit: int | None = None) -> list[int]:
    """The buckets to capture: `bucket_sizes`, less those above `limit` (the most sequences
    the job can decode at once, None: no bound), with `limit` itself as the largest bucket
    when it falls between two. A job of 20 sequences under buckets 128 / 16 captures
    [1, 2, 4, 8, 16, 20] instead of 16 graphs up to 128: capturing (and warming up) a bucket
    the job can never fill costs start-up time and buys nothing."""
    sizes = bucket_sizes(max_bucket, num_buckets)
    if limit is None or limit >= sizes[-1]:
        return sizes
    limit = max(1, limit)
    return [size for size in sizes if size < limit] + [limit]


def eager_warmup_sizes(sizes: list[int]) -> list[int]:
    """The powers of two below the largest bucket that are not buckets themselves."""
    extra, size = [], 1
    while size < sizes[-1]:
        if size not in sizes:
            extra.append(size)
        size *= 2
    return extra


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, pool: KVPool, max_bucket: int, num_buckets: int,
                 max_context: int, segmented: bool = False, limit: int | None = None):
        """`limit`: the most sequences a decode step of this job can hold (capture_sizes)."""
        self.model = model
        self.segmented = segmented
        self.pool = pool
        self.sizes = capture_sizes(max_bucket, num_buckets, limit)
        device = pool.device
        largest = self.sizes[-1]
        self.max_pages = -(-max_context // PAGE_SIZE)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(largest, self.max_pages, dtype=torch.int32, device=device)
        self.groups = PrefixGroups(
            torch.full((largest,), -1, dtype=torch.int32, device=device),
            torch.zeros(MAX_GROUPS, min(MAX_PREFIX_PAGES, self.max_pages), dtype=torch.int32,
                        device=device),
            torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device))
        """The shared-prefix graphs' group buffers (row_group padded with -1)."""
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        """Per (bucket, with prefix groups), the graphs replayed in order (one unless
        segmented)."""
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.batches: dict[tuple[int, bool], ForwardBatch] = {}
        """The captured inputs. A graph replays raw addresses: every tensor it reads must stay
        alive (a freed logits_indices got reused and indexed out of bounds)."""
        self._pool_handle = None

    def _batch(self, size: int, grouped: bool = False) -> ForwardBatch:
        """A batch over the static buffers; a new object each call, so nothing a layer derives
        from one forward (ForwardBatch.derived) is reused by the next or by a capture."""
        cu = torch.arange(size + 1, dtype=torch.int32, device=self.pool.device)
        groups = None
        if grouped:
            groups = PrefixGroups(self.groups.row_group[:size], self.groups.prefix_pages,
                                  self.groups.prefix_num_pages)
        return ForwardBatch(self.input_ids[:size], self.positions[:size], cu,
                            self.context_lens[:size], self.page_table[:size], self.slots[:size],
                            torch.arange(size, device=self.pool.device), self.pool,
                            q_lens=[1] * size, ctx_lens=[1] * size, prefix_groups=groups)

    @torch.inference_mode()
    def probe(self, grouped: bool = False) -> None:
        """One forward at each size `capture` runs (eager warm-up sizes and buckets), for
        start-up's precompile pass (`engine.precompile`); nothing is captured. `grouped`: also
        each bucket's shared-prefix forward, whose graphs are captured in the middle of a job
        (its kernels would otherwise compile there, on first need)."""
        for size in eager_warmup_sizes(self.sizes) + self.sizes:
            self.model(self._batch(size))
        if grouped:
            for size in self.sizes:
                self.model(self._batch(size, grouped=True))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        for size in eager_warmup_sizes(self.sizes):  # compiles what eager steps will meet
            self.model(self._batch(size))
        for size in reversed(self.sizes):
            self._capture_bucket(size, grouped=False)
        log.info("captured decode CUDA graphs for batch sizes %s%s", self.sizes,
                 f", {len(self._segments())} segments each" if self.segmented else "")

    def _segments(self):
        return (self.model.segments() if self.segmented
                else [lambda _, batch: self.model(batch)])

    def _capture_bucket(self, size: int, grouped: bool) -> None:
        segments = self._segments()
        for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
            self.model(self._batch(size, grouped))
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize()
        batch = self.batches[size, grouped] = self._batch(size, grouped)
        x, graphs = None, []
        for index, segment in enumerate(segments):
            try:
                graph, x = self._capture_segment(segment, x, batch, grouped)
            except Exception as err:
                where = f" (segment {index} of {len(segments)})" if self.segmented else ""
                raise RuntimeError(f"batch size {size}{where}: {err}") from err
            graphs.append(graph)
        self.graphs[size, grouped], self.outputs[size, grouped] = graphs, x

    def capture_grouped(self) -> None:
        """Capture every bucket's shared-prefix graphs now, not each when a job first needs it
        (a benchmark's warm-up: a capture in the middle of the timed run would be timed)."""
        for size in reversed(self.sizes):
            self._capture_grouped(size)

    @torch.inference_mode()
    def _capture_grouped(self, size: int) -> bool:
        """Capture the shared-prefix graphs of one bucket in the middle of a job: the static
        inputs are first reset to padding (the warm-up forwards must write no real KV slot);
        False (logged once) if it fails, and such batches then run eagerly."""
        if (size, True) in self.graphs:
            return self.graphs[size, True] is not None
        torch.cuda.synchronize()
        self.slots.fill_(-1)
        self.context_lens.fill_(1)
        self.page_table.zero_()
        self.groups.row_group.fill_(-1)
        self.groups.prefix_num_pages.zero_()
        try:
            self._capture_bucket(size, grouped=True)
        except Exception as err:  # decoding still works: those batches run eagerly
            log.warning("shared-prefix CUDA graph capture failed (%s); running eagerly", err)
            self.graphs[size, True] = None
            return False
        log.info("captured the shared-prefix decode CUDA graph for batch size %d", size)
        return True

    def _capture_segment(self, segment, x: torch.Tensor | None, batch: ForwardBatch,
                         mid_job: bool):
        """One graph of `segment(x, batch)`; its output tensor stays the next one's input."""
        graph = torch.cuda.CUDAGraph()
        # A capture in the middle of a job (the shared-prefix graphs) may meet the host pool's
        # background registration on another thread: only this thread's calls may break it.
        mode = "thread_local" if mid_job else "global"
        with torch.cuda.graph(graph, pool=self._pool_handle, capture_error_mode=mode):
            out = segment(x, batch)
        if self._pool_handle is None:
            self._pool_handle = graph.pool()
        return graph, out

    def can_run(self, batch: ForwardBatch) -> bool:
        if not (batch.decode_only and batch.num_seqs <= self.sizes[-1]
                and batch.page_table.shape[1] <= self.max_pages):
            return False
        groups = batch.prefix_groups
        if groups is None:
            return True
        rows, width = self.groups.prefix_pages.shape
        if groups.prefix_pages.shape[0] > rows or groups.prefix_pages.shape[1] > width:
            return False
        return self._capture_grouped(self.sizes[bisect.bisect_left(self.sizes, batch.num_seqs)])

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        grouped = batch.prefix_groups is not None
        if grouped:
            self._copy_groups(batch.prefix_groups, n, size)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.context_lens[:n].copy_(batch.context_lens)
        self.context_lens[n:size].fill_(1)
        width = batch.page_table.shape[1]
        self.page_table[:n, :width].copy_(batch.page_table)
        for graph in self.graphs[size, grouped]:
            graph.replay()
        return self.outputs[size, grouped][:n]

    def _copy_groups(self, groups: PrefixGroups, n: int, size: int) -> None:
        count, width = groups.prefix_pages.shape
        self.groups.row_group[:n].copy_(groups.row_group)
        self.groups.row_group[n:size].fill_(-1)
        self.groups.prefix_pages[:count, :width].copy_(groups.prefix_pages)
        self.groups.prefix_num_pages[:count].copy_(groups.prefix_num_pages)
        self.groups.prefix_num_pages[count:].zero_()

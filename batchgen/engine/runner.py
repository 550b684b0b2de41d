"""ModelRunner: turns a ScheduleOutput into tensors, runs the model, samples.

The only engine piece that touches tensors besides the models. Order inside a step:
unloads (device -> host), forks (device -> device), loads (host -> device), forward over the
packed batch, sampling.
Decode bursts are queued whole and their samples collected step by step (`queue_burst`,
`collect`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable

import torch

from batchgen.core import PAGE_SIZE
from batchgen.engine.burst import DecodeBurst, QueuedBurst
from batchgen.forward_batch import ForwardBatch, PrefixGroups
from batchgen.engine.host_pin import ChunkedPin, cuda_register, cuda_unregister
from batchgen.engine.kv_cache import KVLayout, KVPool, copy_pages, page_runs
from batchgen.engine.sampler import HostSample, SamplingRows, sample_on_device
from batchgen.engine.host_pool import HostSegment, lazy_zeros
from batchgen.engine.precompile import CompileWorkers, precompile, precompile_ahead
from batchgen.engine.prefix_groups import prefix_groups
from batchgen.sched.decode_groups import MAX_GROUPS
from batchgen.sched.scheduler import PrefixShare, ScheduleOutput, SeqChunk

log = logging.getLogger("batchgen.runner")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, device_pages: int,
                 host_pages: int, device: torch.device, fast_init: bool = False,
                 hugetlbfs: bool = False, runtime=None, graph_limit: int | None = None,
                 compile_workers: CompileWorkers | None = None):
        """`graph_limit`: the most sequences a decode step can hold (the job's size, the
        decode batch); CUDA graphs above it are not captured (graphs.capture_sizes), and none
        at all when it is 0 (a job of embeddings only). `compile_workers`: processes started
        while the model loaded, for `precompile` (closed here either way)."""
        self.model = model
        self.device = device
        self.overlaps_host = device.type == "cuda"
        """Whether queued work runs while the host goes on (a CUDA stream). Elsewhere a burst
        is computed as it is queued: queueing the next one before reading the last would
        overlap nothing, only hold back this burst's results and compute rows that finished."""
        self.layout = layout
        self.shared_prefix = (device.type == "cuda"
                              and getattr(model, "shared_prefix_decode", False))
        """Whether decode rows sharing prefix pages read them once (the Triton kernel)."""
        self.startup: dict[str, float] = {}
        """Seconds of the runner's start-up phases: `host_pool` (mapping the pools),
        `graphs` (CUDA-graph capture)."""
        start = time.perf_counter()
        self.device_pool = self._device_pool(device_pages)
        self.host_segment = HostSegment(_host_bytes(layout, host_pages), fast_init, hugetlbfs)
        self.host_pool, parts = self._host_pool(host_pages)
        self.host_pin: ChunkedPin | None = None
        """Pins the host pool's chunks as copies first touch them (CUDA only)."""
        self.startup["host_pool"] = time.perf_counter() - start
        self.graphs = None
        if device.type == "cuda":
            captured = threading.Event()
            segment = self.host_segment
            self.host_pin = ChunkedPin(segment.tensor.data_ptr(), host_pages, parts,
                                       cuda_register, cuda_unregister, segment.prefault,
                                       workers=max(1, min(8, (os.cpu_count() or 2) // 2)))
            self.host_pin.start(captured, device)
            decodes = graph_limit != 0  # 0: nothing in the job decodes (embeddings only)
            if decodes:
                self.host_pin.touch([0])  # the first pages a job unloads land here
            start = time.perf_counter()
            try:
                if runtime is not None and runtime.use_cuda_graphs and decodes:
                    self.graphs = self._capture(runtime, graph_limit, compile_workers)
                elif not decodes:
                    log.info("nothing in this job decodes: no CUDA graph captured")
            finally:
                captured.set()
        if compile_workers is not None:
            compile_workers.close()  # unused, or done
            self.startup["graphs"] = time.perf_counter() - start

    def _device_pool(self, pages: int) -> KVPool:
        """The device tier; on CPU its memory is committed page by page as it is first used,
        so a pool sized for the worst case costs resident memory only for what a job uses."""
        if self.device.type != "cpu":
            return KVPool(self.layout, pages, self.device)
        shape = (pages, self.layout.num_layers, 64, *self.layout.token_shape)
        raw = lazy_zeros(math.prod(shape) * self.layout.dtype.itemsize)
        return KVPool(self.layout, pages, self.device, data=raw.view(self.layout.dtype).view(shape))

    def host_pin_state(self) -> str:
        """How much of the host pool is pinned ("pageable" on CPU), and why pinning stopped
        if it failed."""
        return self.host_pin.state() if self.host_pin is not None else "pageable"

    def _capture(self, runtime, limit: int | None = None,
                 compile_workers: CompileWorkers | None = None):
        if getattr(self.model, "expert_stager", None) is not None:
            # Which offloaded experts to copy in is read on the host after routing, every MoE
            # layer of every step: nothing a replayed graph could do.
            log.info("expert offloading is on: decode runs eagerly (no CUDA graphs)")
            return None
        graphs = decode_graphs(self.model, self.device_pool, runtime, limit)
        if getattr(self.model, "probe_without_kernels", False):
            # Workers given their work ahead (precompile_stand_in) are only waited for.
            precompile(lambda: probe(self.model, graphs, self.device_pool), self.device,
                       compile_workers)
        try:
            graphs.capture()
        except Exception as err:  # a model or kernel that cannot be captured still runs
            log.warning("CUDA graph capture failed (%s); decoding eagerly", err)
            return None
        return graphs

    def _host_pool(self, host_pages: int) -> tuple[KVPool, list[tuple[int, int]]]:
        """Carve the host segment into the page data tensor (and fp8 scales after it):
        the pool, and the (offset, bytes per page) of each part, as ChunkedPin takes them."""
        layout = self.layout
        raw = self.host_segment.tensor
        parts = _host_parts(layout, host_pages)
        scale_pages = None
        if layout.quantized:
            scale_shape = layout.scale_pages_shape(host_pages)
            scale_pages = (raw[parts[1][0]:].view(torch.float32)[: math.prod(scale_shape)]
                           .view(scale_shape))
        shape = (host_pages, layout.num_layers, 64, *layout.token_shape)
        data = raw[: host_pages * parts[0][1]].view(layout.dtype).view(shape)
        return KVPool(layout, host_pages, "cpu", data=data, scale_pages=scale_pages), parts

    def move_pages(self, out: ScheduleOutput) -> None:
        """The step's page copies: unloads (device -> host), forks (device -> device), then
        loads (host -> device). A copy touching a host chunk not pinned yet runs pageable and
        asks for the chunk to be pinned."""
        for copy in out.swap_out:
            copy_pages(self.device_pool, self.host_pool,
                       self._host_runs(copy.src, copy.dst, host_is_src=False))
        for copy in out.device_copies:
            copy_pages(self.device_pool, self.device_pool, page_runs(copy.src, copy.dst))
        for copy in out.swap_in:
            copy_pages(self.host_pool, self.device_pool,
                       self._host_runs(copy.src, copy.dst, host_is_src=True))

    def _host_runs(self, src: list[int], dst: list[int], host_is_src: bool):
        runs = page_runs(src, dst)
        if self.host_pin is None:
            return runs
        self.host_pin.touch(src if host_is_src else dst)
        return self.host_pin.cut_runs(runs, host_is_src)

    @torch.inference_mode()
    def execute(self, out: ScheduleOutput, rows: SamplingRows, logits_processor=None,
                on_result=None, while_running: Callable[[], None] | None = None) -> None:
        """Copies, then one forward over the packed batch and its sampling by `rows`: the
        samples go to `on_result(0, result)` (nothing is sampled when no chunk samples).
        `logits_processor(logits)` may mask the sampled rows' logits in place first
        (structured outputs). `while_running()`: host work done once the step is queued,
        before its samples are waited for."""
        self.move_pages(out)
        if not out.chunks:
            return
        batch = ForwardBatch.build(
            token_ids=[c.seq.token_ids[c.start:c.end] for c in out.chunks],
            starts=[c.start for c in out.chunks],
            page_tables=[c.seq.device_pages for c in out.chunks],
            sample_mask=[c.sample for c in out.chunks],
            kv_pool=self.device_pool,
            device=self.device,
        )
        batch.prefix_groups = self._groups(out.chunks, out.shares)
        logits = self._forward(batch)
        if not rows.params:
            return
        if logits_processor is not None:
            logits_processor(logits)
        pending = HostSample(sample_on_device(logits, rows))
        if while_running is not None:
            while_running()
        result = pending.result(rows)
        if on_result is not None:
            on_result(0, result)

    @torch.inference_mode()
    def queue_burst(self, chunks: list[SeqChunk], rows: list[SamplingRows],
                    after: QueuedBurst | None = None,
                    shares: list[PrefixShare] = ()) -> QueuedBurst:
        """Queue `len(rows)` decode steps of `chunks` back to back without waiting for the
        device: each step takes its input ids from the previous step's samples on the device.
        `after`: a queued burst this one continues (its rows include these; its last step's
        samples are the first inputs). `shares`: the plan's rows sharing prefix pages."""
        first_ids = None
        if after is not None:
            kept = after.rows_of(chunks)
            first_ids = after.last_tokens
            if kept != list(range(len(after.chunks))):
                first_ids = first_ids[torch.tensor(kept).to(self.device, non_blocking=True)]
        plan = DecodeBurst.build(chunks, len(rows), self.device_pool, self.device, first_ids,
                                 self._groups(chunks, shares))
        input_ids, samples = plan.first_ids, []
        for step, step_rows in enumerate(rows):
            drawn = sample_on_device(self._forward(plan.batch(step, input_ids)), step_rows)
            samples.append(HostSample(drawn))
            input_ids = drawn.tokens
        return QueuedBurst(chunks, rows, samples, input_ids)

    def collect(self, burst: QueuedBurst, on_result, before_last=None) -> None:
        """Hand each step's samples to `on_result(step, result)` in order, as soon as that step
        has ended: the host's per-token work for step i overlaps the device's steps i+1...
        `before_last()` runs while only the last step is still on the device: what it queues
        (the next burst) follows without leaving the device idle. Where nothing runs apart
        from the host (`overlaps_host` false) there is no such moment: it is not called."""
        if not self.overlaps_host:
            before_last = None
        for step, (sample_of_step, step_rows) in enumerate(zip(burst.samples, burst.rows)):
            if step == burst.steps - 1 and before_last is not None:
                before_last()
            on_result(step, sample_of_step.result(step_rows))

    def _groups(self, chunks: list[SeqChunk], shares: list[PrefixShare]):
        """The prefix groups of `chunks`' one-row sequences (a mixed batch's `one_row_part`, in
        its order; every row of a decode batch), or None."""
        if not (self.shared_prefix and shares):
            return None
        return prefix_groups([c for c in chunks if c.end - c.start == 1], shares, self.device)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch)

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no page copy may still target the segment
        self.host_pool = None
        if self.host_pin is not None:
            self.host_pin.close()
        self.host_segment.close()


def _host_parts(layout: KVLayout, host_pages: int) -> list[tuple[int, int]]:
    """(byte offset, bytes per page) of each part of the host segment: the page values, and an
    fp8 pool's scales after them from the next OS page (a pinned chunk's scales never share a
    locked page with its values)."""
    if not layout.quantized:
        return [(0, layout.bytes_per_page)]
    value_bytes = layout.num_layers * 64 * layout.values_per_token
    scales_at = -(-host_pages * value_bytes // 4096) * 4096
    return [(0, value_bytes), (scales_at, math.prod(layout.scale_pages_shape(1)) * 4)]


def _host_bytes(layout: KVLayout, host_pages: int) -> int:
    """The host segment's size: where its last part ends."""
    return max(offset + host_pages * size for offset, size in _host_parts(layout, host_pages))


def decode_graphs(model: torch.nn.Module, pool: KVPool, runtime, limit: int | None):
    """The decode CUDA graphs of `runtime`'s buckets up to `limit` (not captured yet)."""
    from batchgen.engine.graphs import DecodeGraphs

    segmented = os.environ.get("BATCHGEN_SEGMENTED_GRAPH", "0") not in ("", "0")
    return DecodeGraphs(model, pool, runtime.cuda_graph_max_bucket_size,
                        runtime.cuda_graph_num_buckets, model.max_context, segmented, limit)


@torch.inference_mode()
def probe(model: torch.nn.Module, graphs, pool: KVPool) -> None:
    """The forwards whose Triton variants `precompile` compiles ahead: every decode size
    the capture runs, then a mixed step (three decode rows, a fresh prompt, a chunk after a
    cached prefix: 197 rows) and a prefill step of 256 rows, so the row counts cover 1,
    multiples of 16 and the rest. The prefill batches write no KV (every slot -1). A model
    whose decode reads shared prefixes once also runs the buckets' shared-prefix forwards, and
    mixed steps whose decode rows (3, and each bucket's number) form one prefix group: an eager
    step's tables are as wide as its longest row, not a multiple of 16 as the graphs' buffers
    are, and the row count decides whether the kernel splits: variants of their own."""
    grouped = getattr(model, "shared_prefix_decode", False)
    with model.probe_layers():
        graphs.probe(grouped=grouped)
        model(_mixed_probe(3, pool))
        for rows in sorted({3, *graphs.sizes}) if grouped else ():
            batch = _mixed_probe(rows, pool)
            batch.prefix_groups = _probe_groups(rows, pool.device)
            model(batch)
        model(_probe_batch([0, 0], [128, 128], pool))


def _mixed_probe(rows: int, pool: KVPool) -> ForwardBatch:
    """`rows` decode rows at position 64, a fresh 130-token prompt and a 64-token chunk after
    64 cached tokens."""
    return _probe_batch([64] * rows + [0, 64], [1] * rows + [130, 64], pool)


def _probe_batch(starts: list[int], lengths: list[int], pool: KVPool) -> ForwardBatch:
    """A batch of sequences computing `lengths` tokens from `starts`, every page 0, writing no
    KV (every slot -1)."""
    tables = [[0] * -(-(s + n) // PAGE_SIZE) for s, n in zip(starts, lengths)]
    batch = ForwardBatch.build([[1] * n for n in lengths], starts, tables,
                               [True] * len(starts), pool, pool.device)
    batch.slot_mapping.fill_(-1)
    return batch


def _probe_groups(rows: int, device: torch.device) -> PrefixGroups:
    """One prefix group of `rows` rows sharing page 0, in an eager step's group tensors
    (MAX_GROUPS groups; a table 3 pages wide, as a step whose longest prefix is 3 pages)."""
    counts = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)
    counts[0] = 1
    return PrefixGroups(torch.zeros(rows, dtype=torch.int32, device=device),
                        torch.zeros(MAX_GROUPS, 3, dtype=torch.int32, device=device), counts)


STAND_IN_PAGES = 16
"""Device pages of the stand-in's pool (the probe's forwards read page 0 only)."""


def precompile_stand_in(build: Callable[[], torch.nn.Module | None], config,
                        workers: CompileWorkers, job_sequences: int | None = None) -> int:
    """Hand `workers` the Triton variants a ModelRunner meets in its capture and first steps,
    noted on a stand-in of the job's model (`build()`: the same layer shapes, fewer layers,
    any weights, or None where there is none: bench_models.stand_in_model), run before the
    real weights load, which then overlaps the compile; the stand-in's memory is given back
    after. `config`: the job's EngineConfig; `job_sequences` as Engine's. Returns how many
    variants were handed over: 0 where the pass does not apply (not CUDA, no CUDA graphs, a
    model whose forwards need their kernels' outputs) or failed; the capture then runs its own
    pass."""
    from batchgen.engine.graphs import graph_limit

    runtime = config.runtime
    limit = graph_limit(job_sequences, config.scheduler.max_decode_batch)
    if not runtime.use_cuda_graphs or limit == 0:  # 0: nothing decodes, nothing is captured
        return 0
    try:
        model = build()
        if model is None:
            return 0
        device = next(model.parameters()).device
        if (device.type != "cuda" or not getattr(model, "probe_without_kernels", False)
                or getattr(model, "expert_stager", None) is not None):
            return 0
        pool = KVPool(KVLayout.of_model(model, config.model.kv_dtype), STAND_IN_PAGES, device)
        graphs = decode_graphs(model, pool, runtime, limit)
        return precompile_ahead(lambda: probe(model, graphs, pool), device, workers)
    except Exception as err:  # only a head start: the capture's own pass covers it
        log.debug("the stand-in precompile pass failed: %s", err)
        return 0
    finally:
        model = pool = graphs = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
